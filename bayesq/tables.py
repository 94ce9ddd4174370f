"""Loss tables of one or several quantisation configurations, and BayesQ's grid candidates.

:func:`build_table` is the closed-form table of :mod:`bayesq.expected_loss` plus the Monte
Carlo proxy when one is chosen; :func:`grid_candidates` names the encodings
:func:`bayesq.selection.encode_best` builds and scores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

import torch
from torch import nn

from bayesq.blocks import LayerBlocks
from bayesq.config import Proxy, QuantConfig, Whitening
from bayesq.expected_loss import LossTable, apply_mc_proxy, posterior_tables
from bayesq.forward import Batch, batch_size, first_inputs
from bayesq.posterior import Posterior, input_moments
from bayesq.rounding import ef_column_metric, feedback_gains


def grid_candidates(q: QuantConfig, held_out: bool = False) -> dict[str, QuantConfig]:
    """The encodings :func:`encode_best` builds: ``q`` itself (``searched`` clipping, or
    ``minmax`` when ``q.min_range_ratio = 1``) and, when ``q.selects_grids``, one other:

    * with ``held_out`` (candidates scored on inputs they were not fitted on) and
      ``q.feeds_back_table``, the other range search of the error-feedback table:
      ``searched-plain`` (``feedback_search: false``) when ``q`` searches with the gains, else
      ``searched-gained``. Neither search wins on every model, and only held-out inputs tell
      which one wins: scored on the calibration inputs, this candidate was kept where the test KL
      was worse (docs/method.md, section 18d);
    * otherwise ``minmax``: min/max grids (``min_range_ratio = 1``, GPTQ's) without the scale
      refit. With the other search on held-out inputs min/max is not built: in the default
      run it never had the lowest selection KL, and where the rule kept it the other search's
      test KL was the same (docs/method.md, section 18d), while each candidate costs an
      encoding and a pass over the selection inputs.
    """
    out = {"searched" if q.min_range_ratio < 1 else "minmax": q}
    if not q.selects_grids:
        return out
    if held_out and q.feeds_back_table:
        other = "searched-plain" if q.feedback_search else "searched-gained"
        out[other] = replace(q, feedback_search=not q.feedback_search)
    else:
        out["minmax"] = replace(q, min_range_ratio=1.0, refit=False, select_grids=False)
    return out


def candidate_tables(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None,
    column_metric: Mapping[str, torch.Tensor] | None = None, progress: bool = False,
    only: Mapping[str, QuantConfig] | None = None,
) -> dict[str, LossTable]:
    """The loss tables of :func:`grid_candidates` (``held_out=True``: every candidate a selection
    can score) other than ``q``'s own, by candidate name: what :func:`encode_best` builds per call
    when not given them. ``only``: just these candidates (name -> config). Arguments as
    :func:`build_table`."""
    cands = only if only is not None else {k: c for k, c in grid_candidates(q, held_out=True).items() if c is not q}
    return build_tables(posterior, blocks, cands, seed=seed, model=model, calibration=calibration, progress=progress,
                        column_metric=column_metric)


def build_table(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None, progress: bool = True,
    column_metric: Mapping[str, torch.Tensor] | None = None,
) -> LossTable:
    """Loss table for ``q``: closed form, then the Monte Carlo proxy if chosen.

    ``model`` and ``calibration`` are read only when ``q.needs_data`` (the PCA metric's input
    moments, the error-feedback metric of ``quant.feedback_table``, the logit-KL proxy's
    inputs); ``seed`` seeds the Monte Carlo draws; ``column_metric`` (from
    :func:`ef_column_metric`) saves recomputing the error-feedback metric.
    """
    return build_tables(posterior, blocks, {"": q}, seed=seed, model=model, calibration=calibration,
                        progress=progress, column_metric=column_metric)[""]


def build_tables(
    posterior: Posterior, blocks: list[LayerBlocks], configs: Mapping[str, QuantConfig], *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None, progress: bool = True,
    column_metric: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, LossTable]:
    """:func:`build_table` of each configuration, by name (arguments as there): the same tables as
    one call each. Configurations that differ only in ``feedback_search`` (the grid candidates of
    :func:`grid_candidates` with held-out inputs) are tabulated layer by layer together
    (:func:`bayesq.expected_loss.posterior_tables`: their range searches score the ratio grid once)."""
    batches = None
    needy = next((q for q in configs.values() if q.needs_data), None)
    if needy is not None:
        if model is None or calibration is None:
            raise ValueError(f"quant.whitening = '{needy.whitening.value}' / quant.proxy = '{needy.proxy.value}' / "
                             f"quant.feedback_table = {needy.feedback_table} read calibration data: pass model= "
                             "and calibration=")
        batches = list(calibration)
    groups: dict[QuantConfig, list[str]] = {}
    for name, q in configs.items():
        groups.setdefault(replace(q, feedback_search=False), []).append(name)
    out = {}
    for names in groups.values():
        qs = [configs[n] for n in names]
        q = qs[0]
        input_diag = None
        if q.whitening == Whitening.PCA:
            layers = {lb.name: model.get_submodule(lb.name) for lb in blocks}
            input_diag, _ = input_moments(model, batches, layers)
        gains = None
        if q.feeds_back_table:
            metric = column_metric if column_metric is not None else ef_column_metric(posterior, q, model, batches)
            gains = feedback_gains(posterior, q, metric)
        for name, cq, table in zip(names, qs, posterior_tables(posterior, blocks, qs, progress, input_diag, gains)):
            out[name] = _proxied(table, posterior, cq, seed, batches, model, progress)
    return {name: out[name] for name in configs}


def _proxied(table: LossTable, posterior: Posterior, q: QuantConfig, seed: int, batches: list[Batch] | None,
             model: nn.Module | None, progress: bool) -> LossTable:
    """``table`` with ``q.proxy``'s Monte Carlo entries when one is chosen."""
    if q.proxy == Proxy.MC_KL:
        few = first_inputs(batches, q.mc_examples)
        return apply_mc_proxy(table, posterior, q, kind="kl", model=model, batches=few,
                              n_kl=sum(batch_size(b) for b in few), seed=seed, progress=progress)
    if q.proxy == Proxy.MC_OUTPUT:
        return apply_mc_proxy(table, posterior, q, kind="output", seed=seed, progress=progress)
    return table


def grid_tables(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, held_out: bool = True, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None,
    column_metric: Mapping[str, torch.Tensor] | None = None, progress: bool = False,
) -> dict[str, LossTable]:
    """The loss tables of every candidate of :func:`grid_candidates` ``(q, held_out)``, ``q``'s own
    first, by candidate name, built together (:func:`build_tables`). Arguments as :func:`build_table`."""
    return build_tables(posterior, blocks, grid_candidates(q, held_out=held_out), seed=seed, model=model,
                        calibration=calibration, progress=progress, column_metric=column_metric)
