"""How the library calls a model on a calibration batch, whatever the batch looks like.

A batch is either a tensor (images, (B, C, H, W)) or a mapping of tensors passed as keyword
arguments (tokenised text: ``input_ids``, ``attention_mask``, ...).  Outputs may be a tensor of
logits or an object with a ``.logits`` attribute (Hugging Face models).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

Batch = Any  # torch.Tensor | Mapping[str, torch.Tensor]


def logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """(B, C) logits of ``model`` on ``batch``."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    return out.logits if hasattr(out, "logits") else out


def batch_size(batch: Batch) -> int:
    """Number of examples in a batch."""
    if isinstance(batch, Mapping):
        return int(next(iter(batch.values())).shape[0])
    return int(batch.shape[0])


def by_length(batches: Iterable[Batch]) -> list[Batch]:
    """The same examples regrouped by length, each batch cut to its longest member.

    For sums over examples (curvature, layer-input statistics): tokenised batches padded to
    their longest member (a mapping with a (B, L) ``attention_mask`` of right padding) are
    concatenated, sorted by the number of real tokens (stable) and split again into batches
    of the first batch's size, every (B, L) tensor cut to the new batch's longest example.
    Each example's outputs are unchanged (padding is masked); a random draw of sentences in
    batches of 32 is about half padding, so the passes run on about half the tokens. Tensor
    batches (images) and batches without right padding come back as they are.
    """
    batches = list(batches)
    if not batches or not all(isinstance(b, Mapping) and "attention_mask" in b for b in batches):
        return batches
    masks = [b["attention_mask"] for b in batches]
    if any(m.dim() != 2 or bool((m[:, 1:] > m[:, :-1]).any()) for m in masks):
        return batches  # not right padding (or not (B, L)): cutting would drop real tokens
    width = max(m.shape[1] for m in masks)
    keys = [k for k, v in batches[0].items() if torch.is_tensor(v) and v.dim() == 2 and v.shape == masks[0].shape]

    def padded(b: Mapping, k: str) -> torch.Tensor:
        v = b[k]
        return torch.nn.functional.pad(v, (0, width - v.shape[1])) if k in keys else v

    every = {k: torch.cat([padded(b, k) for b in batches]) for k in batches[0]}
    order = every["attention_mask"].sum(1).argsort(stable=True)
    size = batch_size(batches[0])
    out = []
    for i in range(0, len(order), size):
        idx = order[i:i + size]
        longest = int(every["attention_mask"][idx].sum(1).max())
        out.append({k: v[idx][:, :longest] if k in keys else v[idx] for k, v in every.items()})
    return out
