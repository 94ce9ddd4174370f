"""Layer inputs as rows of the weight's column space: the one input-unfolding path of every
curvature estimator (diagonal Fisher, K-FAC, the posterior's per-layer statistics).

A Linear weight ``W`` (out, in) acts on rows ``a_{n,t}`` (in,) at every token ``t``. A Conv2d
weight (out, in/groups, kh, kw) acts, per group, on unfolded patches: with the input padded as
the convolution pads it (``padding`` as ints or ``"same"``, every ``padding_mode``: zeros,
reflect, replicate, circular) and then ``F.unfold`` with the kernel size, dilation and stride,
each output position ``t`` reads the patch ``a_{n,g,t}`` (in/groups*kh*kw,), flattened in the
weight's own (channel, kh, kw) order, so ``out_{n,o,t} = W_o . a_{n,g(o),t}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


ADD_CHUNK = 1 << 16  # elements converted per step by add_widened


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a model's curvature and input-moment sums accumulate and are kept in: the
    model's, at least float32 (GPTQ's reference keeps its Hessian in float32). Adding B batches in
    float32 rounds a sum by about B * 2^-24 relative at most, orders of magnitude below the
    sampling error of N calibration inputs (of order 1 / sqrt(N)), and halves the largest memory
    terms of a large model (docs/method.md, section 18f); a float64 model (the tests' exact
    references) sums in float64."""
    return torch.promote_types(dtype, torch.float32)


def add_widened(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``total += x`` in place for a ``total`` (float64, or the float32 sums of a half-precision
    model, :func:`sum_dtype`) and an ``x`` of a narrower float dtype (plain ``add_`` when the
    dtypes match): the same numbers as ``total.add_(x)`` (widening is exact), 5-7x faster on the CPU,
    where PyTorch's mixed-dtype add is slow, and without a widened copy of ``x`` (it converts
    ``ADD_CHUNK`` elements at a time into one small buffer)."""
    if x.dtype == total.dtype or total.device.type != "cpu" or not total.is_contiguous():
        return total.add_(x)
    flat, src = total.view(-1), x.reshape(-1)
    buf = torch.empty(min(ADD_CHUNK, flat.numel()), dtype=total.dtype)
    for i in range(0, flat.numel(), ADD_CHUNK):
        part = buf[: min(ADD_CHUNK, flat.numel() - i)]
        flat[i : i + part.numel()].add_(part.copy_(src[i : i + part.numel()]))
    return total


def explicit_padding(mod: nn.Conv2d, a: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """Apply the conv's own padding to input (N, C, H, W), plus any padding done in forward.

    ``_reversed_padding_repeated_twice`` covers int/tuple padding, ``padding="same"`` and every
    ``padding_mode``; subclasses that pad inside ``forward`` (TF "same") are reproduced from the
    output shape, left = total // 2.
    """
    pad = list(mod._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        a = F.pad(a, pad, mode=mode)
    (kh, kw), (sh, sw), (dh, dw) = mod.kernel_size, mod.stride, mod.dilation
    extra_h = (out_hw[0] - 1) * sh + dh * (kh - 1) + 1 - a.shape[-2]
    extra_w = (out_hw[1] - 1) * sw + dw * (kw - 1) + 1 - a.shape[-1]
    if extra_h > 0 or extra_w > 0:
        eh, ew = max(extra_h, 0), max(extra_w, 0)
        a = F.pad(a, [ew // 2, ew - ew // 2, eh // 2, eh - eh // 2])
    return a


def _pointwise(mod: nn.Conv2d) -> bool:
    """A 1x1 convolution with stride 1 and no padding: each patch is one pixel's channels."""
    return (tuple(mod.kernel_size) == (1, 1) and tuple(mod.stride) == (1, 1)
            and not any(mod._reversed_padding_repeated_twice))


def input_rows(mod: nn.Module, a: torch.Tensor, out_shape: torch.Size, widen: bool = True) -> torch.Tensor:
    """Layer inputs as rows of the weight's column space: (N, groups, T, d_in), float64 when
    ``widen`` (else the input's dtype).

    Linear: (N, ..., in) -> (N, 1, T, in).  Conv2d: unfolded patches per group,
    (N, groups, L, in/groups*kh*kw) with L = out_h*out_w (a transposed view of the unfolded
    (N, groups, d_in, L) tensor; a 1x1 convolution with stride 1 and no padding skips the
    unfolding copy: a view of the input); ``out_shape``: the layer output's shape (N, out, out_h, out_w).
    """
    n = a.shape[0]
    if widen:
        a = a.double()
    if isinstance(mod, nn.Linear):
        return a.reshape(n, 1, -1, a.shape[-1])  # (N, 1, T, in)
    out_hw = (int(out_shape[-2]), int(out_shape[-1]))
    if _pointwise(mod) and tuple(a.shape[-2:]) == out_hw:  # 1x1: the patches are the pixels, a view
        return a.reshape(n, mod.groups, -1, out_hw[0] * out_hw[1]).transpose(2, 3)
    a = explicit_padding(mod, a, out_hw)
    cols = F.unfold(a, mod.kernel_size, dilation=mod.dilation, stride=mod.stride)  # (N, C*kh*kw, L)
    cols = cols.reshape(n, mod.groups, -1, cols.shape[-1])  # (N, groups, d_in, L)
    return cols.transpose(2, 3)  # (N, groups, L, d_in)


def output_rows(mod: nn.Module, g: torch.Tensor, groups: bool = False) -> torch.Tensor:
    """Output gradients as (N, T, d_out) (Conv2d: T = out_h*out_w positions), in ``g``'s dtype;
    with ``groups``, split by the conv's groups: (N, groups, T, out/groups) (Linear: one group)."""
    n = g.shape[0]
    if isinstance(mod, nn.Linear):
        rows = g.reshape(n, -1, g.shape[-1])  # (N, T, out)
    else:
        rows = g.reshape(n, g.shape[1], -1).transpose(1, 2)  # (N, L, out)
    if not groups:
        return rows
    k = getattr(mod, "groups", 1)
    return rows.reshape(n, rows.shape[1], k, -1).transpose(1, 2)  # (N, groups, T, out/groups)


def per_example_grad(mod: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients (N, *weight.shape) from the layer's input ``a`` and output
    gradient ``g``: ``dL_n/dW_{o,i} = sum_t g_{n,t,o} a_{n,g(o),t,i}``, in the inputs' dtype."""
    rows = input_rows(mod, a, g.shape, widen=False)  # (N, groups, T, d_in)
    grads = output_rows(mod, g, groups=True)  # (N, groups, T, out/groups)
    grad = torch.einsum("ngto,ngti->ngoi", grads, rows)
    return grad.reshape(a.shape[0], *mod.weight.shape)


BATCHED_GRAD_ELEMENTS = 1 << 20  # per-example gradient elements a batch may materialise at once


def squared_grad_sum(mod: nn.Module, a: torch.Tensor, g: torch.Tensor, rows: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_n (dL_n/dW)^2``, shaped like the weight, in the inputs' dtype: the squares of
    :func:`per_example_grad` summed over the batch.

    When the N per-example gradients hold more than ``BATCHED_GRAD_ELEMENTS`` elements they are
    formed one example at a time and squared into the sum (``addcmul``) instead of as one
    (N, *weight.shape) tensor, which is written and read twice: memory-bound, about 2x slower on
    MiniLM's layers with N = 32 (benchmarks/posterior.py). ``rows``: :func:`input_rows` of ``a``
    (unwidened) when the caller has them.

    ``out``: a running sum shaped like the weight to add the result into, in place, and return
    (:func:`add_widened` for a wider dtype). For one example (N = 1: a curvature pass in parts of
    one input) and an ``out`` in the inputs' dtype (contiguous), its square goes straight into it
    (``addcmul``: ``out += grad * grad``, no square or batch-sum temporaries; the CPU's fused
    multiply-add rounds once where forming the square and adding it rounds twice, so the sums
    differ in the last bits; ``benchmarks/squares.py`` at 2423b3a). Several examples or a wider ``out``:
    their sum as without ``out``, added with :func:`add_widened`.
    """
    if rows is None:
        rows = input_rows(mod, a, g.shape, widen=False)  # (N, groups, T, d_in)
    grads = output_rows(mod, g, groups=True).transpose(-1, -2)  # (N, groups, out/groups, T)
    if out is not None and rows.shape[0] == 1 and out.dtype == rows.dtype and out.is_contiguous():
        grad = torch.matmul(grads[0], rows[0])  # (groups, out/groups, d_in)
        out.view_as(grad).addcmul_(grad, grad)
        return out
    if rows.shape[0] * mod.weight.numel() <= BATCHED_GRAD_ELEMENTS:
        total = torch.matmul(grads, rows).pow_(2).sum(0)  # (groups, out/groups, d_in)
    else:
        total = torch.zeros(grads.shape[1], grads.shape[2], rows.shape[3], dtype=rows.dtype, device=rows.device)
        for n in range(rows.shape[0]):
            grad = torch.matmul(grads[n], rows[n])
            total.addcmul_(grad, grad)
    total = total.reshape(mod.weight.shape)
    return total if out is None else add_widened(out, total)
