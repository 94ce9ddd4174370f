"""How the library calls a model on a calibration batch, whatever the batch looks like.

A batch is either a tensor (images, (B, C, H, W)) or a mapping of tensors passed as keyword
arguments (tokenised text: ``input_ids``, ``attention_mask``, ...).  Outputs may be a tensor of
logits or an object with a ``.logits`` attribute (Hugging Face models).
"""

from __future__ import annotations

from typing import Any, Mapping

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
