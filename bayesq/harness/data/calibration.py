"""Unlabelled calibration subsets drawn from a training pool."""

from __future__ import annotations

import torch
from torch import Tensor


def _permutation(n_total: int, seed: int) -> Tensor:
    """The seeded permutation of ``range(n_total)`` both draws take their indices from: int64 (n_total,)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randperm(n_total, generator=gen, dtype=torch.int64)


def sample_calibration_indices(n_total: int, n_cal: int, seed: int) -> Tensor:
    """Draw ``n_cal`` distinct indices from ``range(n_total)``: the first ``n_cal`` entries of the
    seeded permutation.

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
    return torch.sort(_permutation(n_total, seed)[:n_cal]).values


def sample_selection_indices(n_total: int, n_cal: int, seed: int, n_sel: int | None = None) -> Tensor:
    """Draw the selection inputs: up to ``n_sel`` indices disjoint from the calibration draw.

    They are the next ``n_sel`` entries (default ``n_cal``) of the same seeded permutation
    :func:`sample_calibration_indices` takes its first ``n_cal`` from (fewer when the pool is
    smaller than ``n_cal + n_sel``), so the two draws never share an input.  Choices made among
    candidates fitted on the calibration inputs (grid and variant selection) are scored on
    these: the calibration inputs themselves favour what fits them best, and candidates whose
    mean KL differs by a few per cent need more inputs than the fit does (docs/method.md, 18d).

    Returns:
        int64 tensor (min(n_sel, n_total - n_cal),), sorted ascending.

    Raises:
        ValueError: as :func:`sample_calibration_indices`, ``n_sel < 1``, or no input left after
            the calibration draw ("use a smaller calibration set or score on the calibration inputs").
    """
    sample_calibration_indices(n_total, n_cal, seed)  # validates the arguments
    n_sel = n_cal if n_sel is None else n_sel
    if n_sel < 1:
        raise ValueError(f"selection size n_sel = {n_sel} must be >= 1")
    if n_cal >= n_total:
        raise ValueError(f"the calibration draw takes all {n_total} inputs of the pool, so none is left to "
                         "score the selection on: use a smaller calibration set, or set "
                         "calibration.selection: calibration")
    return torch.sort(_permutation(n_total, seed)[n_cal:n_cal + n_sel]).values
