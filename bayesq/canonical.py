"""Layers that compute with a weight matrix but are not an ``nn.Linear`` / ``nn.Conv2d``, rewritten
as modules built of those two kinds, computing the same function.

* ``nn.MultiheadAttention`` keeps its q/k/v projections in one raw ``in_proj_weight`` (3E, E)
  and calls ``out_proj`` functionally, so no hook sees the projections' inputs.
  :class:`SplitAttention` runs the same attention with four ``nn.Linear`` modules, ``q_proj``,
  ``k_proj``, ``v_proj`` (the three (E, E) blocks of ``in_proj_weight``) and ``out_proj``.
* Hugging Face ``Conv1D`` (GPT-2 family: ``y = x W + b`` with W stored (in, out)) becomes an
  ``nn.Linear`` with the weight (out, in) = Wᵀ, a transposed view of W (no copy), under the same name.
* ``nn.Conv1d`` (N, C, L) becomes :class:`Conv1dAs2d`, a height-1 ``nn.Conv2d`` named ``conv``
  inside it: ``y = conv2d(x[:, :, None, :])[:, :, 0, :]`` with kernel (1, k), stride (1, s),
  padding (0, p), dilation (1, d), the same groups and padding mode.

Every entry point of the library that reads a user's model runs inside :func:`canonical`
(:func:`on_canonical`): the rewrite is made in place and undone on exit, so the user's model
comes back as it was, while results (layer names, the quantised copy, exports) are those of the
rewritten model (``attn.q_proj``, ``conv.conv``, ...). :func:`make_canonical` rewrites for good
(the skeleton an export is loaded into).

Left as they are (their weights are listed as unquantised, with the reason, by
:func:`bayesq.blocks.unquantized_weights`): an ``nn.MultiheadAttention`` with ``add_bias_kv`` or
``add_zero_attn``, and subclasses that override ``forward``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from bayesq.blocks import excluded


def _param(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=like.requires_grad)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (out, in) and ``bias`` (out,) (views, no copy)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = _param(weight, like)
    if bias is not None:
        lin.bias = _param(bias, like)
    return lin


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as 0 / -inf, a float mask as it is (added to the scores)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def splittable(mod: nn.Module) -> bool:
    """An ``nn.MultiheadAttention`` :class:`SplitAttention` reproduces (no ``add_bias_kv`` /
    ``add_zero_attn``, ``forward`` not overridden)."""
    return (isinstance(mod, nn.MultiheadAttention) and type(mod).forward is nn.MultiheadAttention.forward
            and mod.bias_k is None and mod.bias_v is None and not mod.add_zero_attn)


class SplitAttention(nn.Module):
    """``nn.MultiheadAttention`` with its projections as four ``nn.Linear`` modules.

    Same call and results as the module it replaces: ``forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False) -> (output, weights | None)``, batched (``batch_first`` or not) or unbatched
    inputs, boolean or float masks (``attn_mask`` (L, S) or (N*H, L, S), ``key_padding_mask``
    (N, S)), dropout in training mode.

    ``heads_h = softmax(q_h k_hᵀ / sqrt(d) + mask) v_h`` with ``q = q_proj(query)``,
    ``k = k_proj(key)``, ``v = v_proj(value)`` split into H heads of d = E / H, and
    ``output = out_proj(concat_h heads_h)``.
    """

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        if not splittable(mha):
            raise ValueError("SplitAttention reproduces nn.MultiheadAttention without add_bias_kv / add_zero_attn")
        self.embed_dim, self.num_heads, self.head_dim = mha.embed_dim, mha.num_heads, mha.head_dim
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        # nn.TransformerEncoderLayer reads these to decide on its fused kernel: None rules it out
        self.in_proj_weight = self.in_proj_bias = None
        self._qkv_same_embed_dim = False
        if mha._qkv_same_embed_dim:
            like = mha.in_proj_weight
            weights = mha.in_proj_weight.detach().chunk(3)  # (E, E) views
        else:
            like = mha.q_proj_weight
            weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.detach().chunk(3)
        self.q_proj, self.k_proj, self.v_proj = (_linear(w, b, like) for w, b in zip(weights, biases))
        self.out_proj = mha.out_proj
        self.train(mha.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:  # (L, E): one sequence
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, length, s, h, d = query.shape[0], query.shape[1], key.shape[1], self.num_heads, self.head_dim

        def heads(x: torch.Tensor, t: int) -> torch.Tensor:
            return x.reshape(n, t, h, d).transpose(1, 2)  # (N, H, T, d)

        q, k, v = heads(self.q_proj(query), length), heads(self.k_proj(key), s), heads(self.v_proj(value), s)
        mask = _additive(attn_mask, q.dtype)
        if mask is None and is_causal:
            mask = _additive(torch.ones(length, s, dtype=torch.bool, device=q.device).triu(1), q.dtype)
        if mask is not None:
            mask = mask.reshape(1, 1, length, s) if mask.dim() == 2 else mask.reshape(n, h, length, s)
        pad = _additive(key_padding_mask, q.dtype)
        if pad is not None:
            pad = pad.reshape(n, 1, 1, s)
            mask = pad if mask is None else mask + pad
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q / math.sqrt(d)) @ k.transpose(-2, -1)  # (N, H, L, S)
            attn = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            attn = F.dropout(attn, p) if p else attn
            ctx = attn @ v
            weights = attn.mean(1) if average_attn_weights else attn
            if not batched:
                weights = weights.squeeze(0)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = self.out_proj(ctx.transpose(1, 2).reshape(n, length, h * d))  # (N, L, E)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


class Conv1dAs2d(nn.Module):
    """``nn.Conv1d`` run as the height-1 ``nn.Conv2d`` ``self.conv``: input (N, C, L) or (C, L)."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        padding = conv.padding if isinstance(conv.padding, str) else (0, conv.padding[0])
        self.conv = nn.Conv2d(conv.in_channels, conv.out_channels, (1, conv.kernel_size[0]), (1, conv.stride[0]),
                              padding, (1, conv.dilation[0]), conv.groups, conv.bias is not None, conv.padding_mode,
                              device="meta")
        self.conv.weight = _param(conv.weight.detach().unsqueeze(2), conv.weight)  # (out, in/groups, 1, k)
        if conv.bias is not None:
            self.conv.bias = _param(conv.bias, conv.bias)
        self.train(conv.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(-2)).squeeze(-2)


def _hf_conv1d() -> type | None:
    """Hugging Face's ``Conv1D`` class when transformers is loaded (a model holding one has loaded it)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _rewritten(mod: nn.Module, hf_conv1d: type | None) -> nn.Module | None:
    """The replacement of ``mod``, or None when it stays as it is."""
    if splittable(mod):
        return SplitAttention(mod)
    if type(mod) is nn.Conv1d:
        return Conv1dAs2d(mod)
    if hf_conv1d is not None and type(mod) is hf_conv1d:  # weight (in, out), y = x W + b
        return _linear(mod.weight.detach().t(), mod.bias, mod.weight)
    return None


def _rewrite(model: nn.Module, exclude: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Module]]:
    """Rewrite ``model`` in place but the modules ``exclude`` matches (:func:`bayesq.blocks.excluded`);
    returns (parent, attribute, original module) of every swap."""
    hf_conv1d = _hf_conv1d()
    swaps, made = [], {}  # made: one replacement per module object, however many names it has
    for name, mod in list(model.named_modules(remove_duplicate=False)):
        if id(mod) not in made:
            made[id(mod)] = None if excluded(name, exclude) else _rewritten(mod, hf_conv1d)
        new = made[id(mod)]
        if new is None:
            continue
        if not name:
            raise ValueError(f"the model itself is a {type(mod).__name__}: wrap it in a module that calls it")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swaps.append((parent, child, mod))
        setattr(parent, child, new)
    return swaps


def _unfused(model: nn.Module) -> list[nn.TransformerEncoder]:
    """Turn off the nested-tensor path of every ``nn.TransformerEncoder`` (it reads the fused
    projection weights); returns those that had it on."""
    encoders = [m for m in model.modules() if isinstance(m, nn.TransformerEncoder) and m.use_nested_tensor]
    for m in encoders:
        m.use_nested_tensor = False
    return encoders


def make_canonical(model: nn.Module, exclude: Sequence[str] = ()) -> nn.Module:
    """Rewrite ``model`` in place for good (see the module docstring) but the modules ``exclude``
    matches; returns it."""
    if _rewrite(model, tuple(exclude)):
        _unfused(model)
    return model


@contextmanager
def canonical(model: nn.Module, exclude: Sequence[str] = ()) -> Iterator[nn.Module]:
    """``model`` rewritten in place inside the block (see the module docstring) but the modules
    ``exclude`` matches (they stay as the user wrote them, and are listed under their own names),
    as it was after. The rewritten layers share the original weights' memory; nothing is copied
    (a Hugging Face ``Conv1D`` layer's weight becomes a transposed view)."""
    swaps = _rewrite(model, tuple(exclude))
    encoders = _unfused(model) if swaps else []
    try:
        yield model
    finally:
        for parent, child, original in reversed(swaps):
            setattr(parent, child, original)
        for m in encoders:
            m.use_nested_tensor = True


F_ = TypeVar("F_", bound=Callable)


def on_canonical(fn: F_) -> F_:
    """Decorate a library entry point whose first argument is the user's model (and whose
    exclusions, if any, come as the keyword ``exclude``): it runs on the model rewritten by
    :func:`canonical` (a no-op when it already is)."""
    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args, **kwargs):
        with canonical(model, kwargs.get("exclude") or ()):
            return fn(model, *args, **kwargs)
    return wrapper  # type: ignore[return-value]
