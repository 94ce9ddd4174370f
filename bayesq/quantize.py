"""BayesQ end to end: posterior -> loss table -> allocation -> integer codes -> quantised model.

The quantised model is rebuilt from the stored encoding alone (codes plus per-group scales /
zero-points, or look-up tables), never from the float weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

import torch
from torch import nn

from bayesq.baselines.activations import InputStats, StatsSums
from bayesq.blocks import check_finite, check_model_finite, layer_blocks, quantizable_layers, unquantized_weights
from bayesq.canonical import on_canonical
from bayesq.config import BayesQConfig, Curvature, DistillConfig, PosteriorConfig, QuantConfig
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.distill import DistillResult, apply_distilled, distill
from bayesq.evaluation import log_probs
from bayesq.forward import Batch, kept_state, model_batches, pass_logits
from bayesq.memory import check as check_memory_fits, estimate as estimate_memory, release_freed
from bayesq.methods import Inputs, Outcome, read, register
from bayesq.output_offset import OutputOffset, fit_output_offset
from bayesq.posterior import ROWS_IN_PASS, Posterior, fit_posterior as _fit_posterior
from bayesq.result import QuantizationResult, QuantizedWeight, quantized_copy
from bayesq.rounding import bias_correction, ef_column_metric, layer_input_stats, needs_input_stats, reads_input_stats
from bayesq.selection import Encoding, encode_candidates, select_encoding
from bayesq.stage_cache import StageCache, cached, fingerprint
from bayesq.tables import grid_tables


@on_canonical
def fit_posterior(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig, progress: bool = True,
    *, exclude: Sequence[str] = (),
) -> Posterior:
    """Label-free posterior of the model's Linear/Conv2d weights (``config.posterior.curvature``)
    but those ``exclude`` matches (names or glob patterns, as :func:`quantize_model`); batches and
    errors as :func:`quantize_model` (the same split of batches in the curvature pass, so the same
    posterior), and ``model`` comes back as it was."""
    layers = quantizable_layers(model, tuple(exclude))
    check_finite(layers)
    check_model_finite(model)
    with kept_state(model):
        model.eval()
        batches = model_batches(model, calibration)
        need = estimate_memory(model, layers, batches) if batches and layers else None
        return _fit_posterior(model, batches, layers, config.posterior, seed=config.seed, progress=progress,
                              max_inputs=need and need.pass_inputs)


def posterior_and_stats(
    model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module], cfg: PosteriorConfig,
    q: QuantConfig, *, seed: int = 0, progress: bool = True, max_inputs: int | None = None,
    logits: list[torch.Tensor | None] | None = None,
) -> tuple[Posterior, dict[str, InputStats] | None]:
    """The posterior of ``layers`` and, when :func:`needs_input_stats` says the encoding reads
    them, the layers' input statistics (else None): taken in the posterior's own pass when its
    curvature allows (:data:`bayesq.posterior.ROWS_IN_PASS`; the same sums as
    :func:`bayesq.baselines.activations.input_stats`, one pass fewer), else by one more forward
    pass. ``calibration``: re-iterable batches in the model's dtype; ``model`` in eval mode;
    ``max_inputs``: the most inputs the curvature pass holds at once
    (:func:`bayesq.posterior.fit_posterior`); ``logits``: a list that receives the model's logits
    of the curvature pass (:func:`bayesq.posterior.fit_posterior`)."""
    one_pass = Curvature(cfg.curvature) in ROWS_IN_PASS  # diagonal: the posterior has no K-FAC factors
    sums = StatsSums(abs_mean=False) if one_pass and reads_input_stats(q, kfac=False) else None
    posterior = _fit_posterior(model, calibration, layers, cfg, seed=seed, progress=progress, on_rows=sums,
                               max_inputs=max_inputs, logits=logits)
    if not needs_input_stats(posterior, q):
        return posterior, None
    if sums is not None:
        return posterior, sums.stats(layers, posterior.n_examples)
    return posterior, layer_input_stats(posterior, model, calibration, progress)


@on_canonical
def quantize_model(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig = BayesQConfig(),
    *, posterior: Posterior | None = None, progress: bool | None = None, selection: Iterable[Batch] | None = None,
    exclude: Sequence[str] = (), check_memory: bool = True, keep_posterior: bool = False,
    known: KnownOutputs | None = None, cache: StageCache | None = None,
) -> QuantizationResult:
    """BayesQ: posterior -> expected-loss tables -> allocation -> quantised model.

    Args:
        model: any module built of Linear/Conv2d layers (others stay in floating point);
            it must return (B, C) logits, or per-token (B, T, V) logits (a causal language
            model: read on the real tokens of the batches' ``attention_mask``,
            :mod:`bayesq.forward`), as a tensor, an object with ``.logits``, a dict with
            ``"logits"`` or a tuple whose first element is the logits.
        calibration: iterable of input batches: tensors, dicts of tensors (keyword arguments)
            or ``(inputs, labels)`` tuples (labels are never read); floating inputs are cast to
            the model's dtype.
        config: budget (average bits per quantised weight, all metadata included), posterior,
            codebook, table, allocation and rounding settings, and the distillation applied at
            budgets up to ``config.distill.max_budget`` (0 by default: off; same codes and bits).
        posterior: a posterior fitted earlier (skips the curvature pass).
        progress: a bar over each step; None: ``config.progress``.
        selection: input batches held out of ``calibration`` (e.g. another draw of training
            inputs): the grid candidates are scored on them, which also admits the other range
            search as a candidate (:func:`grid_candidates`); None scores on ``calibration``.
        exclude: module names or glob patterns (``"classifier"``, ``"encoder.layer.0.*"``) kept in
            floating point; they are listed in the result's ``unquantized``.
        check_memory: before any work, estimate the peak memory (:mod:`bayesq.memory`) and stop
            with an error when the model's device has less free. The estimate also sets how
            many inputs the curvature pass holds at once (batches split so that its activations
            stay within ``bayesq.memory.PASS_BYTES`` / ``PART_BYTES``; the same sums up to float rounding).
        keep_posterior: return the posterior in the result (its ``posterior``; to distil or
            quantise at another budget without a second curvature pass). Off by default: it is as
            large as the model in float32, and it is released before the candidates are scored.
        known: the FP model's outputs where the caller has them (:class:`bayesq.context.KnownOutputs`:
            its log-probabilities on ``selection``, else on ``calibration``, and its logits on
            ``calibration``); else computed once here (:class:`bayesq.context.FPOutputs`) and read
            by both the grid selection and the output offset's fit.
        cache: a :class:`bayesq.stage_cache.StageCache` that keeps the curvature pass (posterior,
            input statistics, FP logits) under a fingerprint of everything it reads, so another
            budget or target on the same model and calibration inputs skips it (the same tensors).

    Returns:
        :class:`QuantizationResult` with the quantised copy of the model, the codes and
        codebooks of every layer, the allocation and its true average bits. ``model`` itself
        comes back as it was (modes, ``requires_grad``, ``.grad``).

    Raises:
        ValueError: NaN/Inf in a parameter, buffer or calibration input (naming it); an
            infeasible budget.
        TypeError: batches or model outputs of a kind the library cannot read (naming it).
        bayesq.memory.InsufficientMemoryError: the estimated peak exceeds the free memory
            (naming the estimate, its terms and what lowers each); nothing was changed.
    """
    with kept_state(model):
        model.eval()  # every pass reads the model as deployed (frozen BatchNorm, no dropout)
        progress = config.progress if progress is None else progress
        return _quantize_model(model, calibration, config, posterior, progress, selection, tuple(exclude),
                               check_memory, keep_posterior, known, cache)


def _quantize_model(model, calibration, config, posterior, progress, selection, exclude,
                    check_memory, keep_posterior, known, cache) -> QuantizationResult:
    layers = quantizable_layers(model, exclude)
    check_finite(layers)
    check_model_finite(model)
    q = config.quant
    blocks = layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value, q.row_blocked)
    calibration = model_batches(model, calibration)
    selection = model_batches(model, selection, "selection")
    need = estimate_memory(model, layers, calibration) if calibration and layers else None
    if check_memory and need is not None:
        check_memory_fits(need, next(iter(layers.values())).weight.device)
    outputs: list[torch.Tensor | None] = []  # the FP model's logits of the curvature pass: read below, not recomputed
    if posterior is None:
        def curvature_pass() -> tuple:
            seen: list[torch.Tensor | None] = []
            post, st = posterior_and_stats(model, calibration, layers, config.posterior, q, seed=config.seed,
                                           progress=progress, max_inputs=need and need.pass_inputs, logits=seen)
            return post, st, seen

        posterior, stats, outputs = cached(cache, "curvature pass", lambda: fingerprint(
            model, sorted(layers), calibration, config.posterior, q, config.seed, need and need.pass_inputs),
            curvature_pass)
    else:
        stats = layer_input_stats(posterior, model, calibration, progress) if needs_input_stats(posterior, q) else None
    metric = ef_column_metric(posterior, q, model, calibration, progress=progress, stats=stats)
    correction = bias_correction(model, stats, calibration) if q.bias_correction else None
    del stats  # read by the two lines above only: its (d_in, d_in) sums need not wait for the end
    tables = grid_tables(posterior, blocks, q, held_out=selection is not None, seed=config.seed, model=model,
                         calibration=calibration, progress=progress, column_metric=metric)
    cands = encode_candidates(model, posterior, next(iter(tables.values())), q, config.budget, config.allocation,
                              seed=config.seed, calibration=calibration, column_metric=metric, correction=correction,
                              progress=progress, selection=selection, tables=tables, consume_metric=True)
    del tables
    # Model-sized and read by nothing from here on: the layers' input moments always, the
    # posterior unless it is returned or distillation's teacher.
    del metric
    if not (keep_posterior or config.distill.applies(config.budget)):
        posterior = None
    release_freed()
    fp = FPOutputs(model, cands.scored, calibration, held_out=bool(selection), known=known)
    # the FP model's (B, C) logits on the calibration inputs (model dtype), from the curvature pass
    pass_fp = pass_logits(outputs, calibration) if calibration else None
    del outputs
    if fp.known_log_probs() is None and (len(cands.built) > 1 or (selection and q.output_offset and calibration)):
        # one FP pass over the scored inputs, read by the selection and by the offset's fit (on
        # the calibration inputs, the curvature pass has made it)
        label = f"FP on the {'selection' if selection else 'calibration'} inputs"
        if pass_fp is not None and not selection:
            fp.offer_log_probs([log_probs(z) for z in pass_fp])
        else:
            fp.log_probs(desc=label if progress else None)
    enc = select_encoding(model, cands, fp, progress=progress)
    del cands
    # the offset's fit reads both models' outputs on the scored inputs from the selection's scores
    # (on the held-out inputs when there are some, else on the calibration inputs), the FP model's
    # on the calibration inputs from the curvature pass (float32, as predict gives them)
    scored_fp = fp.known_log_probs()
    fp.offer_logits(scored_fp if scored_fp is not None and not selection else (
        None if pass_fp is None else [z.float() for z in pass_fp]))
    qmodel, weights, _, offset = assemble(model, enc, posterior, calibration, config.distill, config.budget,
                                          config.seed, progress, selection=selection, fp=fp)
    return QuantizationResult(qmodel, weights, enc.allocation, enc.table, posterior if keep_posterior else None,
                              enc.name, enc.selection_kl, correction, unquantized_weights(model, layers, exclude),
                              offset)


@register(BayesQConfig)
def bayesq_method(model: nn.Module, config: BayesQConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`quantize_model` at ``budget`` (``config.budget`` is replaced) on the calibration and
    selection batches; ``details``: the grids kept (``encoding``) and each candidate's selection KL."""
    res = quantize_model(model, inputs.need_calibration("BayesQ"), replace(config, budget=budget),
                         selection=inputs.selection, exclude=tuple(inputs.exclude), known=inputs.known,
                         cache=inputs.cache)
    fitted = res.output_offset is not None and res.output_offset.fitted
    # the selection scores several candidates against the FP log-probabilities; the offset's fit
    # reads them as the FP side of the held-out inputs
    scored = bool(res.selection_kl) or (fitted and inputs.selection is not None)
    return Outcome(res, {"encoding": res.encoding, "encoding_kl": dict(res.selection_kl)},
                   (read(inputs, "log_probs") if scored else frozenset())
                   | (read(inputs, "logits") if fitted else frozenset()))


def assemble(
    model: nn.Module, enc: Encoding, posterior: Posterior | None, calibration: Sequence[Batch] | None,
    distill_cfg: DistillConfig | None, budget: float, seed: int = 0, progress: bool = False, *,
    selection: Sequence[Batch] | None = None, fp: FPOutputs | None = None,
) -> tuple[nn.Module, dict[str, QuantizedWeight], DistillResult | None, OutputOffset | None]:
    """The last stage: the model running ``enc`` (a copy; its bias correction applied), its
    scales distilled to the posterior teacher first when ``distill_cfg.applies(budget)``
    (:func:`bayesq.distill.distill` on ``calibration``; the correction is then applied only if
    distillation trained no bias, which already fits the mean), then its output layer's bias
    refitted to the FP model's mean prediction on ``calibration`` and the held-out ``selection``
    inputs when ``enc.quant.output_offset`` (:func:`bayesq.output_offset.fit_output_offset`; not
    without calibration batches). The fit reads the FP model's outputs ``fp`` holds and ``enc``'s
    model's logits on the scored inputs (:attr:`Encoding.scored_logits`; not when distillation
    changed that model) instead of running the models again.

    Returns:
        (quantised model, the encoded layers it runs, the :class:`DistillResult` or None, the
        :class:`OutputOffset` applied or None).
    """
    scored_q = enc.scored_logits
    if distill_cfg is None or not distill_cfg.applies(budget):
        qmodel, weights, res = quantized_copy(model, enc.weights, enc.correction), enc.weights, None
    else:
        scored_q = None  # the scored model's outputs, not the distilled one's
        if posterior is None or calibration is None:
            raise ValueError("distillation needs the posterior (its teacher) and calibration batches")
        res = distill(model, enc.weights, posterior, calibration, distill_cfg, scale_bits=enc.quant.scale_bits,
                      lut_bits=enc.quant.lut_bits, seed=seed, progress=progress)
        qmodel, weights = apply_distilled(model, res), res.weights
        if enc.correction is not None and not res.biases:
            enc.correction.apply(qmodel, model)
    offset = None
    if enc.quant.output_offset and calibration:
        offset = fit_output_offset(model, qmodel, calibration, progress, selection=selection, fp=fp,
                                   scored_q=scored_q)
        offset.apply(qmodel)
    return qmodel, weights, res, offset
