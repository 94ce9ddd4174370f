"""Unlabelled calibration subsets drawn from a training pool."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_calibration_indices(n_total: int, n_cal: int, seed: int) -> Tensor:
    """Draw ``n_cal`` distinct indices from ``range(n_total)``.

    Args:
        n_total: size of the pool (e.g. the fine-tuning training split).
        n_cal: number of calibration examples, ``1 <= n_cal <= n_total``.
        seed: seed of the ``torch.Generator`` (same arguments -> same indices).

    Returns:
        int64 tensor (n_cal,), sorted ascending, without repetition.

    Raises:
        ValueError: ``n_total < 1`` ("empty calibration pool"), ``n_cal < 1`` or
            ``n_cal > n_total``.
    """
    if n_total < 1:
        raise ValueError(f"empty calibration pool (n_total = {n_total}); nothing to sample from")
    if n_cal < 1:
        raise ValueError(f"calibration size n_cal = {n_cal} must be >= 1")
    if n_cal > n_total:
        raise ValueError(
            f"calibration size n_cal = {n_cal} exceeds the pool of {n_total} examples; "
            f"lower the calibration size to at most {n_total}"
        )
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    idx = torch.randperm(n_total, generator=gen, dtype=torch.int64)[:n_cal]
    return torch.sort(idx).values
