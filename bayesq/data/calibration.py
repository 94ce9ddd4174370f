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


def sample_selection_indices(n_total: int, n_cal: int, seed: int) -> Tensor:
    """Draw the selection inputs: up to ``n_cal`` indices disjoint from the calibration draw.

    They are the next ``n_cal`` entries of the same seeded permutation
    :func:`sample_calibration_indices` takes its first ``n_cal`` from (fewer when the pool is
    smaller than ``2 * n_cal``), so the two draws never share an input.  Choices made among
    candidates fitted on the calibration inputs (grid and variant selection) are scored on
    these: the calibration inputs themselves favour what fits them best (docs/method.md, 18d).

    Returns:
        int64 tensor (min(n_cal, n_total - n_cal),), sorted ascending.

    Raises:
        ValueError: as :func:`sample_calibration_indices`, or no input left after the
            calibration draw ("use a smaller calibration set or score on the calibration inputs").
    """
    sample_calibration_indices(n_total, n_cal, seed)  # validates the arguments
    if n_cal >= n_total:
        raise ValueError(f"the calibration draw takes all {n_total} inputs of the pool, so none is left to "
                         "score the selection on: use a smaller calibration set, or set "
                         "calibration.selection: calibration")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    idx = torch.randperm(n_total, generator=gen, dtype=torch.int64)[n_cal:2 * n_cal]
    return torch.sort(idx).values
