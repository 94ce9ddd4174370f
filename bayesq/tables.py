"""Loss tables of one or several quantisation configurations, and BayesQ's grid candidates.

:func:`build_table` is the closed-form table of :mod:`bayesq.expected_loss` plus the Monte
Carlo proxy when one is chosen (:func:`apply_mc_proxy`: sampled entries, with standard errors,
for the most sensitive layers); :func:`grid_candidates` names the encodings
:func:`bayesq.selection.encode_best` builds and scores.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.blocks import LayerBlocks
from bayesq.config import Objective, Proxy, QuantConfig, Whitening
from bayesq.expected_loss import LayerTable, LossTable, posterior_tables
from bayesq.forward import Batch, batch_size, first_inputs
from bayesq.monte_carlo import MCEstimate, kfac_quadratic, mc_layer_output_loss, mc_logit_kl
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


def layer_quantizer(t: LayerTable, j: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``w -> Q(w)``: every unit of layer ``t`` at candidate ``j`` (nearest rounding), weight-shaped."""
    book, lb = t.books[j], t.blocks

    def q(w: torch.Tensor) -> torch.Tensor:
        groups, _ = lb.to_groups(w.detach().double().reshape(-1))
        return lb.from_groups(book.dequantize(book.quantize(groups))).to(w.dtype)

    return q


def top_layers(table: LossTable, fraction: float) -> list[int]:
    """Indices of the ``ceil(fraction * n_layers)`` layers with the largest loss at the lowest bits."""
    score = torch.tensor([float(t.unit_loss[:, 0].sum()) for t in table.layers])
    k = max(1, math.ceil(fraction * len(table.layers)))
    return sorted(torch.argsort(score, descending=True)[:k].tolist())


def rescale_layer(t: LayerTable, mean: torch.Tensor, se: torch.Tensor) -> LayerTable:
    """Replace a layer's entries by a layer-level estimate, shared out as the closed form shares it.

    ``L_u(b) <- L_u(b) * mean_b / sum_u L_u(b)`` and ``se_u(b) = L_u(b) * se_b / sum_u L_u(b)``;
    candidates whose closed-form total is 0 are spread evenly over the units.
    """
    total = t.unit_loss.sum(0)  # (nb,)
    share = torch.where(total > 0, t.unit_loss / total.clamp_min(1e-300), torch.full_like(t.unit_loss, 1 / t.unit_loss.shape[0]))
    return replace(t, unit_loss=share * mean.clamp_min(0), unit_se=share * se)


def apply_mc_proxy(
    table: LossTable, posterior: Posterior, cfg: QuantConfig, *, kind: str,
    model: nn.Module | None = None, batches: Sequence | None = None, n_kl: int = 0, seed: int = 0,
    progress: bool = True,
) -> LossTable:
    """Monte Carlo entries, with standard errors, for the top ``cfg.mc_top_fraction`` layers.

    ``kind="kl"``: ``n_scale * E_w sum_x KL(p(x; w) || p(x; Q(w)))`` over ``batches`` (``n_kl``
    inputs) with only the layer's weight drawn, ``n_scale = N / n_kl`` and ``N`` the data size
    the posterior conditions on (``monte_carlo.mc_logit_kl``; on the closed form's scale, see
    ``rescale_to_closed_form``). ``kind="output"``: ``0.5 E_w tr(G' D A' D^T)`` with the
    posterior's damped K-FAC factors (``monte_carlo.mc_layer_output_loss``). Draws are shared by
    every candidate of a layer (common random numbers) and come in antithetic pairs.
    """
    layers = list(table.layers)
    for i in tqdm(top_layers(table, cfg.mc_top_fraction), desc=f"mc-{kind}", disable=not progress, leave=False):
        t = layers[i]
        name = t.blocks.name
        mu, sd = posterior.mean[name], posterior.std(name)
        qs = [layer_quantizer(t, j) for j in range(len(t.bits))]
        deployed = Objective(cfg.objective) == Objective.DEPLOYED
        if kind == "output":
            f = (posterior.kfac or {}).get(name)
            if f is None:
                raise ValueError(f"layer '{name}' has no K-FAC factors: the output proxy needs posterior.curvature kfac or lowrank")
            mat = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731  (out, d_in)
            if deployed:  # exact: 0.5 tr(G' D A' D^T) of the deployed error D = Q(mu) - mu
                total = torch.stack([0.5 * kfac_quadratic(mat(q(mu) - mu), f.A, f.G) for q in qs]).double()
                est = MCEstimate(total, torch.zeros_like(total), 0, total[None])
            else:
                est = mc_layer_output_loss(mat(mu), mat(sd), f.A, f.G,
                                           [lambda w, q=q: mat(q(w.reshape(mu.shape))) for q in qs],
                                           samples=cfg.mc_samples, seed=seed + i)
        elif kind == "kl":
            if model is None or not batches or n_kl < 1:
                raise ValueError("the logit-KL proxy needs the model and calibration batches")
            dtype = model.get_submodule(name).weight.dtype
            est = mc_logit_kl(model, batches, name, mu.to(dtype), sd.to(dtype), qs, samples=cfg.mc_samples,
                              seed=seed + i, deployed=deployed)
            est = est.scaled(_data_scale(posterior, cfg) / n_kl)
        else:
            raise ValueError(f"unknown Monte Carlo proxy {kind!r}: use 'kl' or 'output'")
        layers[i] = rescale_layer(t, est.mean.double(), est.se.double())
    return LossTable(tuple(layers))


def _data_scale(posterior: Posterior, cfg: QuantConfig) -> float:
    """N: the data size the posterior's precision is scaled to (n_data, else the calibration set)."""
    return float(posterior.n_data or posterior.n_examples)
