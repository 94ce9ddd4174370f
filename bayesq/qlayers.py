"""Quantised Linear / Conv2d modules that hold packed codes (:mod:`bayesq.kernels`) and run
them: fused dequantising GEMV for Linear (dequantise-then-matmul past 8 rows), dequantise-then-conv for Conv2d (through the
original module's forward, so Conv2d subclasses keep their padding logic).

On the CPU (the reference backend) the dequantised weight is computed once from the packed
buffers and kept (``cache_dense``), as a CPU deployment would; on CUDA every forward decodes.
"""

from __future__ import annotations

import torch
from torch import nn

from bayesq.blocks import tied_layers
from bayesq.kernels import PackedWeight, dequant_linear, dequantize, pack_weight
from bayesq.kernels.launcher import resolve_backend


class _Packed(nn.Module):
    """Shared part: the packed buffers (moved by ``.to``), the layout ints, the backend."""

    def __init__(self, pw: PackedWeight, bias: torch.Tensor | None, backend: str = "auto") -> None:
        super().__init__()
        for name, t in pw.tensors().items():
            self.register_buffer(name, t)
        for name in ("dense", "col_scale"):
            if getattr(pw, name) is None:
                self.register_buffer(name, None)
        self.n, self.k, self.group_size, self.groups_per_row = pw.n, pw.k, pw.group_size, pw.groups_per_row
        self.uniform_bits, self.layout = pw.uniform_bits, pw.layout
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.backend = backend
        self.cache_dense = True
        self._dense: torch.Tensor | None = None

    def packed(self) -> PackedWeight:
        return PackedWeight(self.words, self.goff, self.gbits, self.scale, self.zero, self.lut, self.lutoff,
                            self.dense, self.col_scale, self.n, self.k, self.group_size, self.groups_per_row,
                            self.uniform_bits, self.layout)

    def weight_dense(self) -> torch.Tensor:
        """(N, K) float32 dequantised weight (cached on the reference backend)."""
        pw = self.packed()
        if self._dense is None or self._dense.device != pw.device:
            self._dense = dequantize(pw, torch.float32, "torch")
        return self._dense

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight in the layer's own shape, float32 (for code that reads
        ``module.weight``, e.g. Hugging Face T5 casts its input to the weight's dtype)."""
        return self.weight_dense().reshape(getattr(self, "weight_shape", (self.n, self.k)))

    def _reference(self, device: torch.device) -> bool:
        return resolve_backend(self.backend, device, self.packed()) == "torch"

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the buffers; ``.half()`` / ``.to(dtype)`` leave the packed data's
        types (fp16 scales, fp32 tables) as stored, so decoding stays exact."""
        self._dense = None
        dtypes = {k: b.dtype for k, b in self._buffers.items() if b is not None}
        out = super()._apply(fn, recurse)
        for k, dt in dtypes.items():
            if self._buffers[k].dtype != dt:
                self._buffers[k] = self._buffers[k].to(dt)
        return out


class QuantLinear(_Packed):
    """``y = x W^T + b`` with W decoded from packed codes; x (..., in_features)."""

    def __init__(self, pw: PackedWeight, bias: torch.Tensor | None, backend: str = "auto") -> None:
        super().__init__(pw, bias, backend)
        self.in_features, self.out_features = pw.k, pw.n

    @classmethod
    def from_quantized(cls, qw, bias: torch.Tensor | None, backend: str = "auto") -> "QuantLinear":
        return cls(pack_weight(qw), bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = self.weight_dense() if self._reference(x.device) else None  # reference path: decode once
        return dequant_linear(x, self.packed(), self.bias, self.backend, weight=cached)

    def extra_repr(self) -> str:
        return f"in_features={self.k}, out_features={self.n}, mode={self.packed().mode}"


class QuantConv2d(_Packed):
    """A Conv2d (or subclass: static "same" padding, ...) whose weight is decoded from packed codes
    and then convolved by the original module's own forward (dequantise-then-conv)."""

    def __init__(self, pw: PackedWeight, conv: nn.Conv2d, backend: str = "auto",
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        super().__init__(pw, None, backend)
        self.weight_shape = tuple(conv.weight.shape)
        del conv.weight  # the float weight is not kept; forward sets the decoded one
        self.conv = conv
        self.memory_format = memory_format  # of the decoded 4-D weight (channels_last: the conv runs NHWC)
        self._conv_weight: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        self._conv_weight = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._reference(x.device):
            if self._conv_weight is None:  # decoded once (dropped by .to / .half / ...)
                self._conv_weight = self.weight_dense().reshape(self.weight_shape).contiguous(
                    memory_format=self.memory_format)
            w = self._conv_weight
        else:
            w = dequantize(self.packed(), x.dtype, self.backend).reshape(self.weight_shape)
        self.conv.weight = w.to(x.dtype)  # a plain tensor attribute
        return self.conv(x)

    def extra_repr(self) -> str:
        return f"weight={self.weight_shape}, mode={self.packed().mode}"


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _tie(model: nn.Module, alias: str, owner: _Packed, backend: str, memory_format: torch.memory_format) -> None:
    """Module ``alias`` held the weight of the quantised ``owner``: a Linear / Conv2d of the same
    shape runs the same packed buffers (shared, not copied); any other module (an embedding)
    holds the decoded weight, so both stay tied to the one encoding."""
    mod = model.get_submodule(alias)
    shape = tuple(mod.weight.shape)
    if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward and (owner.n, owner.k) == shape:
        _swap(model, alias, QuantLinear(owner.packed(), mod.bias, backend))
    elif isinstance(mod, nn.Conv2d) and getattr(owner, "weight_shape", None) == shape:
        _swap(model, alias, QuantConv2d(owner.packed(), mod, backend, memory_format))
    else:
        mod.weight = nn.Parameter(owner.weight_dense().reshape(shape).to(mod.weight.dtype), requires_grad=False)


def replace_quantized(model: nn.Module, weights: dict, backend: str = "auto",
                      memory_format: torch.memory_format = torch.contiguous_format) -> nn.Module:
    """Swap each named Linear / Conv2d of ``model`` for its quantised module (in place);
    ``memory_format``: that of the convolutions' decoded weights (:class:`QuantConv2d`). A module
    tied to one of them (holding the same weight, :func:`bayesq.blocks.tied_layers`) runs the
    same encoding."""
    aliases = tied_layers(model, {name: model.get_submodule(name) for name in weights})
    for name, qw in weights.items():
        mod = model.get_submodule(name)
        if tuple(mod.weight.shape) != qw.shape:
            raise ValueError(f"layer '{name}': module weight {tuple(mod.weight.shape)} vs quantised "
                             f"{qw.shape}: the skeleton does not match")
        if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward:
            new = QuantLinear(pack_weight(qw), mod.bias, backend)
        elif isinstance(mod, nn.Conv2d):
            new = QuantConv2d(pack_weight(qw), mod, backend, memory_format)
        else:
            raise ValueError(f"layer '{name}' is a {type(mod).__name__}; BayesQ runs quantised nn.Linear "
                             "(plain forward) and nn.Conv2d layers")
        _swap(model, name, new)
    for alias, owner in aliases.items():
        _tie(model, alias, model.get_submodule(owner), backend, memory_format)
    return model
