"""BayesQ's grid selection: every candidate allocated and encoded, then scored by its KL to the
FP model on held-out inputs; the anchor is kept unless another wins by a resolved margin.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.assignment import allocate
from bayesq.baselines.activations import InputStats
from bayesq.bias_correction import BiasCorrection
from bayesq.comparison import sequential_choice
from bayesq.config import AllocationConfig, QuantConfig, Rounding
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.error_feedback import LazyMetrics, shared_factors
from bayesq.evaluation import kl_per_input
from bayesq.expected_loss import LossTable
from bayesq.forward import Batch, batch_size
from bayesq.memory import release_freed
from bayesq.posterior import Posterior
from bayesq.result import Allocation, QuantizedWeight, load_quantized
from bayesq.rounding import (
    bias_correction, ef_column_metric, encode_layer_candidates, layer_input_stats, layer_metric, needs_input_stats,
    stats_of,
)
from bayesq.tables import candidate_tables, grid_candidates


@dataclass(frozen=True)
class Encoding:
    """The allocated and encoded candidate :func:`encode_best` kept.

    Attributes:
        name: its :func:`grid_candidates` name.
        quant: its configuration.
        table, allocation, weights: its loss table, allocation and encoded layers.
        selection_kl: candidate name -> mean ``KL(p_FP || p_Q)`` on the inputs it was scored on
            (``selection``, else the calibration inputs; empty: one candidate).
        correction: the bias correction :func:`quantized_copy` applies (None: ``quant.bias_correction`` off).
        selection_margin: candidate name -> 95 % paired-bootstrap interval (low, high) of its mean
            KL minus the anchor's on those inputs (``minmax`` when built, else ``q``'s own
            grids); a candidate is kept over the anchor only when ``high < 0``
            (:func:`bayesq.comparison.resolved_choice`).
        selection_inputs: candidate name -> the inputs it was scored on: the first look's
            (:func:`selection_looks`) for a candidate resolved worse than the anchor there, and
            for the anchor too when no other was left; else all of them.
        scored_logits: the kept candidate's (B, C) float32 logits on each scored batch, in
            order, when the selection scored it on all of them and its logits have no token axis
            (the output offset's fit reads them instead of running the model again: the same
            logits bit for bit); else None.
    """

    name: str
    quant: QuantConfig
    table: LossTable
    allocation: Allocation
    weights: dict[str, QuantizedWeight]
    selection_kl: Mapping[str, float]
    correction: BiasCorrection | None = None
    selection_margin: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    selection_inputs: Mapping[str, int] = field(default_factory=dict)
    scored_logits: Sequence[torch.Tensor] | None = None


SELECTION_FIRST_LOOK = 0.25  # share of the scored inputs in the selection's first look ...


SELECTION_LOOK_MIN = 256  # ... and at least this many, else one look on every input


def first_look_inputs(n: int, batch: int = 1) -> int:
    """Inputs in the first look of a selection over ``n`` inputs in batches of ``batch`` (the
    last may be shorter): ``max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * n)`` rounded up to
    whole batches, or all ``n`` (one look) when that is more than half. Batches meant for a
    selection should draw these inputs at random from the ``n`` (padding order only inside each
    look), so that the early stop sees a sample of all of them."""
    need = max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * n)
    return n if 2 * need > n else min(n, math.ceil(need / batch) * batch)


def selection_looks(batches: Sequence[Batch]) -> int:
    """Batches in the first look of :func:`bayesq.comparison.sequential_choice` over ``batches``:
    the fewest that hold ``max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * N)`` of the N inputs;
    all of them (one look) when that is more than half (:func:`first_look_inputs`)."""
    sizes = [batch_size(b) for b in batches]
    need = first_look_inputs(sum(sizes))
    return len(sizes) if need == sum(sizes) else int(np.searchsorted(np.cumsum(sizes), need)) + 1


def encode_best(
    model: nn.Module, posterior: Posterior, table: LossTable, q: QuantConfig, budget: float,
    allocation_cfg: AllocationConfig = AllocationConfig(), *, seed: int = 0,
    calibration: Iterable[Batch] | None = None, column_metric: Mapping[str, torch.Tensor] | None = None,
    correction: BiasCorrection | None = None, progress: bool = False,
    stats: Mapping[str, InputStats] | None = None, selection: Iterable[Batch] | None = None,
    known: KnownOutputs | None = None, tables: Mapping[str, LossTable] | None = None,
) -> Encoding:
    """Allocate and encode ``table`` (built for ``q``); with ``q.selects_grids`` also the other
    candidates of :func:`grid_candidates` (their tables built here), each scored by its
    per-input ``KL(p_FP || p_Q)`` after its bias correction (``q.bias_correction``) on
    ``selection`` (inputs held out of the fit, e.g.
    :func:`bayesq.harness.data.calibration.sample_selection_indices`; they admit the other range search
    as the second candidate), else on ``calibration`` (the second candidate: min/max grids). The
    ``minmax`` grids when built, else ``q``'s own, are kept unless the other candidate's mean KL
    is lower by a resolved margin (95 % paired-bootstrap interval of the difference below zero,
    :func:`bayesq.comparison.resolved_choice`), scored in two looks
    (:func:`bayesq.comparison.sequential_choice`, :func:`selection_looks`): a candidate resolved
    worse than the anchor on the first quarter of the inputs is not scored on the rest.

    ``column_metric``: :func:`ef_column_metric` of ``q``; ``correction``: :func:`bias_correction`
    (each computed here when None and needed, from ``stats``: the layers' input statistics
    :func:`bayesq.baselines.activations.input_stats` on ``calibration``, one pass here when None).
    ``known``: the FP model's log-probabilities on the scored inputs where the caller has them
    (:class:`bayesq.context.KnownOutputs`), else computed here look by look (per-token logits:
    an :class:`bayesq.evaluation.FPReference`, the FP model run again on each scored batch). ``tables``: the
    other candidates' tables by name (:func:`candidate_tables`; they do not depend on the
    budget, so a caller encoding several budgets builds them once); those absent are built here.
    """
    cands = encode_candidates(model, posterior, table, q, budget, allocation_cfg, seed=seed, calibration=calibration,
                              column_metric=column_metric, correction=correction, progress=progress, stats=stats,
                              selection=selection, tables=tables)
    return select_encoding(model, cands, FPOutputs(model, cands.scored, known=known), progress=progress)


@dataclass(frozen=True)
class Candidates:
    """Every grid candidate of :func:`encode_best` allocated and encoded, not yet scored.

    Attributes:
        built: candidate name (:func:`grid_candidates` order) -> (its configuration, loss table,
            allocation, encoded layers).
        correction: the bias correction each is scored and deployed with (None: off).
        scored: the input batches a selection scores them on (``selection``, else the calibration
            batches); None when there is one candidate and no calibration.
    """

    built: Mapping[str, tuple[QuantConfig, LossTable, Allocation, dict[str, QuantizedWeight]]]
    correction: BiasCorrection | None
    scored: list[Batch] | None


def encode_candidates(
    model: nn.Module, posterior: Posterior, table: LossTable, q: QuantConfig, budget: float,
    allocation_cfg: AllocationConfig = AllocationConfig(), *, seed: int = 0,
    calibration: Iterable[Batch] | None = None, column_metric: Mapping[str, torch.Tensor] | None = None,
    correction: BiasCorrection | None = None, progress: bool = False,
    stats: Mapping[str, InputStats] | None = None, selection: Iterable[Batch] | None = None,
    tables: Mapping[str, LossTable] | None = None, consume_metric: bool = False,
) -> Candidates:
    """The first half of :func:`encode_best` (same arguments): every candidate allocated and
    encoded. Nothing it returns refers to ``posterior`` or ``column_metric``, so a caller can
    release them (model-sized at scale) before :func:`select_encoding` scores the candidates.

    ``consume_metric``: ``column_metric`` (a :class:`LazyMetrics`) is the caller's to give away:
    each layer's input moment is released once every candidate has encoded the layer, so that
    the moments of the layers done are not held while the rest are encoded."""
    layers = {t.blocks.name: model.get_submodule(t.blocks.name) for t in table.layers}
    weights = {n: m.weight for n, m in layers.items()}
    selection = list(selection) if selection is not None else None
    if selection is not None and not selection:
        raise ValueError("selection= is empty: pass held-out input batches to score the grid candidates on, "
                         "or None to score them on the calibration inputs")
    cands = grid_candidates(q, held_out=selection is not None)
    if len(cands) > 1 or needs_input_stats(posterior, q):
        calibration = list(calibration) if calibration is not None else None
    if len(cands) > 1 and not (selection or calibration):
        raise ValueError("quant.select_grids scores each candidate's KL on the calibration inputs, but none were "
                         "given: pass calibration= batches, or set quant.select_grids: false")
    scored = selection if selection is not None else calibration
    need_metric = column_metric is None and Rounding(q.rounding) == Rounding.ERROR_FEEDBACK and not posterior.kfac
    need_correction = correction is None and q.bias_correction
    if need_metric or need_correction:
        stats = (layer_input_stats(posterior, model, calibration, progress) if stats is None
                 else stats_of(stats, posterior))
        if need_metric:
            column_metric = ef_column_metric(posterior, q, stats=stats)
        if need_correction:
            correction = bias_correction(model, stats, calibration)
    if column_metric is None:
        column_metric = ef_column_metric(posterior, q)  # the K-FAC posterior's, or None
    blocks = [t.blocks for t in table.layers]
    given = {**(tables or {}), **{k: table for k, cq in cands.items() if cq is q}}
    missing = {k: v for k, v in cands.items() if k not in given}
    if missing:
        given |= candidate_tables(posterior, blocks, q, seed=seed, model=model, calibration=calibration,
                                  column_metric=column_metric, progress=progress, only=missing)
    built = {name: (cq, given[name], allocate(given[name], budget, allocation_cfg, seed), {})
             for name, cq in cands.items()}
    bar = f"encode ({Rounding(q.rounding).value}" + (f", {len(cands)} candidates)" if len(cands) > 1 else ")")
    for lb in tqdm(blocks, desc=bar, disable=not progress, leave=False):
        with shared_factors():  # every candidate's rounding of this layer: one factor, one metric held
            metric = layer_metric(lb.name, q.rounding, column_metric, posterior)
            same: dict[tuple, list] = {}  # candidates that round alike are encoded in one stacked call
            for cq, t, allocation, qw in built.values():
                key = (cq.rounding, cq.act_order, cq.refit, cq.scale_bits, cq.cd_passes)
                same.setdefault(key, []).append((t.layer(lb.name), allocation.unit_bits[lb.name], qw))
            for (rounding, act_order, refit, scale_bits, cd_passes), group in same.items():
                encoded = encode_layer_candidates(
                    [(t, bits) for t, bits, _ in group], weights[lb.name], metric, rounding=rounding,
                    act_order=act_order, refit=refit, scale_bits=scale_bits, cd_passes=cd_passes, progress=progress)
                for (_, _, qw), enc in zip(group, encoded):
                    qw[lb.name] = enc
            del metric
        if consume_metric and isinstance(column_metric, LazyMetrics):
            column_metric.release(lb.name)
        release_freed()
    return Candidates(built, correction, scored)


def select_encoding(model: nn.Module, cands: Candidates, fp: FPOutputs | None = None, *,
                    progress: bool = False) -> Encoding:
    """The second half of :func:`encode_best`: the candidate kept by the selection rule described
    there, scored on ``cands.scored`` against ``model``, whose log-probabilities there ``fp`` holds
    or computes look by look (None: an :class:`bayesq.context.FPOutputs` of ``cands.scored``)."""
    built, correction, scored = cands.built, cands.correction, cands.scored
    if len(built) == 1:
        return Encoding(next(iter(built)), *next(iter(built.values())), {}, correction)
    fp = fp if fp is not None else FPOutputs(model, scored)  # the FP log-probabilities of each look's batches
    scored_logits: dict[str, list[torch.Tensor]] = {}  # each candidate's, by-products of its scores
    scoring = [None, copy.deepcopy(model)]  # one quantised copy, holding the candidate named first

    def score(name: str, part: slice) -> torch.Tensor:
        reference = fp.log_probs(part, "FP on the selection inputs" if progress else None)
        if scoring[0] != name:  # exactly quantized_copy(model, its encoding, correction)
            load_quantized(scoring[1], model, built[name][3], correction)
            scoring[0] = name
        return kl_per_input(reference, scoring[1].eval(), scored[part], f"selection KL ({name})" if progress else None,
                            logits=scored_logits.setdefault(name, []))

    anchor = "minmax" if "minmax" in built else next(iter(built))
    kept, margins, kls = sequential_choice(score, list(built), anchor, selection_looks(scored), len(scored))
    cq, t, allocation, qw = built[kept]
    kept_lp = scored_logits.get(kept) or None
    if kept_lp is not None and sum(len(z) for z in kept_lp) != sum(batch_size(b) for b in scored):
        kept_lp = None  # scored on the first look only
    return Encoding(kept, cq, t, allocation, qw, {k: float(v.mean()) for k, v in kls.items()}, correction,
                    {k: (d.ci_low, d.ci_high) for k, d in margins.items()}, {k: len(v) for k, v in kls.items()},
                    kept_lp)
