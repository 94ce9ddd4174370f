"""Label-free diagonal Fisher of Linear/Conv2d weights from per-example gradients.

For each calibration input x_n, labels are sampled from the model's own predictive
``y ~ softmax(f(x_n; w))`` (no dataset labels are used), and

    F_sum = sum_n E_y[ g_n(y)^2 ],   g_n(y) = d/dw  -log p(y | x_n, w),

estimated with ``label_samples`` draws per input.  Per-example weight gradients come from the
layer inputs and output gradients captured by hooks (``g_out^T a`` for Linear, the same on
unfolded patches for Conv2d), so one backward pass serves a whole batch.  The model runs in
eval mode (no dropout, batch-norm statistics frozen), so examples do not interact.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from bayesq.forward import Batch, batch_size, logits


def _per_example_grad(mod: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients (N, *weight.shape) from input ``a`` and output grad ``g``."""
    n = a.shape[0]
    if isinstance(mod, nn.Linear):
        a = a.reshape(n, -1, a.shape[-1])  # (N, T, in)
        g = g.reshape(n, -1, g.shape[-1])  # (N, T, out)
        return torch.einsum("nto,nti->noi", g, a)
    # Conv2d; subclasses that pad inside forward ("same" padding) are handled by padding the
    # captured input the same way (left = total // 2), which is a no-op for plain Conv2d.
    kh, kw = mod.kernel_size
    (sh, sw), (dh, dw), (ph, pw) = mod.stride, mod.dilation, mod.padding
    oh, ow = g.shape[-2:]
    extra_h = (oh - 1) * sh + dh * (kh - 1) + 1 - a.shape[-2] - 2 * ph
    extra_w = (ow - 1) * sw + dw * (kw - 1) + 1 - a.shape[-1] - 2 * pw
    if extra_h > 0 or extra_w > 0:
        eh, ew = max(extra_h, 0), max(extra_w, 0)
        a = F.pad(a, [ew // 2, ew - ew // 2, eh // 2, eh - eh // 2])
    cols = F.unfold(a, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    groups = mod.groups
    cols = cols.reshape(n, groups, -1, cols.shape[-1])  # (N, groups, in/groups*kh*kw, L)
    g = g.reshape(n, groups, -1, oh * ow)  # (N, groups, out/groups, L)
    grad = torch.einsum("ngol,ngil->ngoi", g, cols)
    return grad.reshape(n, *mod.weight.shape)


def fisher_diagonal(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    *,
    label_samples: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sum over inputs of the sampled-label Fisher diagonal of every layer in ``layers``.

    Args:
        model: classifier returning (B, C) logits (or an object with ``.logits``).
        batches: calibration input batches (no labels).
        layers: name -> Linear/Conv2d module of ``model``.
        label_samples: labels drawn per input from the model's predictive.
        seed: seed of the label sampler.

    Returns:
        (fisher, n): name -> float64 tensor shaped like the weight holding ``F_sum``; and n,
        the number of inputs seen.

    Raises:
        ValueError: if ``batches`` is empty.
    """
    gen = torch.Generator().manual_seed(seed)
    acts: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    fisher = {name: torch.zeros_like(m.weight, dtype=torch.float64) for name, m in layers.items()}

    def fwd_hook(name: str):
        def hook(mod, inputs, output):
            acts[name] = inputs[0].detach()
            output.register_hook(lambda grad: outs.__setitem__(name, grad.detach()))
        return hook

    handles = [m.register_forward_hook(fwd_hook(n)) for n, m in layers.items()]
    needs_grad = {n: m.weight.requires_grad for n, m in layers.items()}
    for m in layers.values():
        m.weight.requires_grad_(True)
    was_training = model.training
    model.eval()
    n_seen = 0
    try:
        for batch in tqdm(batches, desc="fisher", disable=not progress, leave=False):
            out = logits(model, batch)
            probs = torch.softmax(out.detach().double(), -1)
            for s in range(label_samples):
                y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                loss = F.cross_entropy(out, y, reduction="sum")
                model.zero_grad(set_to_none=True)
                loss.backward(retain_graph=s < label_samples - 1)
                for name, mod in layers.items():
                    if name in outs:  # a layer unused by this forward has no gradient
                        grad = _per_example_grad(mod, acts[name], outs.pop(name)).double()
                        fisher[name] += grad.pow(2).sum(0) / label_samples
            n_seen += batch_size(batch)
            acts.clear()
    finally:
        for h in handles:
            h.remove()
        for n, m in layers.items():
            m.weight.requires_grad_(needs_grad[n])
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    if n_seen == 0:
        raise ValueError(
            "empty calibration set: the posterior needs at least one unlabelled input batch"
        )
    return fisher, n_seen
