"""Baselines at their strongest: the best budget-feasible variant, chosen on calibration data.

A baseline (GPTQ, AWQ) can meet a budget of ``B`` average bits per weight (codes, scales,
zero-points, stored AWQ scales and bit-width headers all counted by :mod:`bayesq.storage`) in
several ways; each candidate below meets it exactly under that accounting:

* ``mixed``: the method's own mixed-precision rule (the greedy knapsack over units of about
  ``group_size * unit_groups`` weights with its diagonal error proxy); offered when its cheapest
  allocation (every unit at the lowest bit-width) fits.
* ``uniform-<b>-g<G>`` / ``uniform-<b>-channel``: one bit-width ``b`` for every weight (no
  bit-width header: a single choice needs none) with the smallest group size ``G`` of the
  candidate list, tried in ascending order with one grid per output channel last, whose exact
  cost fits the budget; one variant per ``b`` of ``cfg.bits`` for which some layout fits.
* ``allocation``: an externally supplied allocation (layer -> bit-width of each unit, e.g.
  BayesQ's ``Allocation.unit_bits`` over the same blocks) with the method's own rounding.

Bias correction (``correction`` of :func:`select_best`): every candidate is also scored with
each layer's mean output shift on the calibration inputs moved back into its bias or the
BatchNorm reading it (:mod:`bayesq.bias_correction`, no stored parameter added), as the
``<variant>+bc`` candidate. It is not part of GPTQ or AWQ as published; BayesQ's default uses
it, so a baseline at its strongest is offered it too.
With it, the kept candidate's output-layer bias is also refitted on the calibration inputs and
the held-out selection inputs, if any, so that its mean prediction is the FP model's
(:mod:`bayesq.output_offset`), as BayesQ's default does last; the candidates are scored without
that refit.

Selection: the variant with the least mean ``KL(p_FP(y|x) || p_Q(y|x))`` over the calibration
inputs (the inputs the method's statistics come from; never the test set). Ties keep the first
candidate in the order given (a variant before its ``+bc`` form); a NaN KL never wins. Scoring
runs in two looks: a candidate resolved worse than the best so far on the first quarter of the
inputs is not scored on the rest (:func:`select_best`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.rtn import rtn_blocks
from bayesq.bias_correction import BiasCorrection
from bayesq.blocks import LayerBlocks, layer_blocks
from bayesq.comparison import paired_difference
from bayesq.config import Granularity, QuantConfig, Target
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.evaluation import kl_per_input
from bayesq.expected_loss import LossTable
from bayesq.forward import Batch, pass_logits
from bayesq.grids import UniformGrids
from bayesq.memory import release_freed
from bayesq.methods import Inputs, Outcome, read
from bayesq.output_offset import fit_output_offset
from bayesq.result import Allocation, QuantizationResult, quantized_copy
from bayesq.selection import selection_looks
from bayesq.settings import ascending, rule, setting
from bayesq.storage import budget_bits
from bayesq.targets import spec

#: Candidate group sizes of the uniform variants (per-output-channel grids are always tried last).
GROUP_SIZES = (32, 64, 128, 256)


def group_sizes_setting():
    """The ``group_sizes`` field of a selecting baseline's config: a non-empty, strictly
    ascending list of integer group sizes >= 1 (:data:`GROUP_SIZES` by default), kept as a tuple."""
    return setting(GROUP_SIZES,
                   rule(lambda g: isinstance(g, (tuple, list)) and len(g) > 0
                        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in g),
                        "need a non-empty list of integer group sizes >= 1, e.g. [32, 64, 128, 256]"),
                   ascending("[32, 64, 128, 256]"), convert=tuple)


@dataclass(frozen=True)
class BaselineChoice:
    """What :func:`select_best` returns.

    Attributes:
        result: the chosen candidate's quantisation.
        variant: its name (``mixed``, ``uniform-3-g64``, ``uniform-2-channel``, ``allocation``;
            ``+bc`` appended when the bias-corrected form won).
        kl: candidate name -> mean calibration ``KL(p_FP || p_Q)`` (nats per example).
        avg_bits: candidate name -> true average bits per quantised weight.
        inputs: candidate name -> inputs its ``kl`` is the mean over (fewer than all for one
            dropped after the first look of :func:`select_best`).
    """

    result: QuantizationResult
    variant: str
    kl: dict[str, float]
    avg_bits: dict[str, float]
    inputs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class UniformVariant:
    """One bit-width everywhere with one grid layout.

    Attributes:
        bits: the bit-width of every weight.
        group_size: weights per scale group; ``None`` for one grid per output channel.
    """

    bits: int
    group_size: int | None

    @property
    def name(self) -> str:
        layout = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"uniform-{self.bits}-{layout}"

    @property
    def granularity(self) -> Granularity:
        return Granularity.CHANNEL if self.group_size is None else Granularity.GROUP

    def config(self, cfg: QuantConfig) -> QuantConfig:
        """``cfg`` with this single bit-width and group size (the unit layout is irrelevant)."""
        return replace(cfg, bits=(self.bits,), group_size=self.group_size or cfg.group_size)


# ---- exact costs ----------------------------------------------------------------------------------

def layout_bits(blocks: Sequence[LayerBlocks], bits: int, n_choices: int, cfg: QuantConfig) -> int:
    """Exact storage bits of every unit of ``blocks`` at one bit-width (int).

    Each unit costs what ``cfg``'s target stores for it (:meth:`bayesq.grids.UniformGrids.unit_cost_bits`):
    in BayesQ's format :func:`bayesq.storage.unit_cost_bits` (codes, one scale and one zero-point
    per group, and a header naming one of ``n_choices`` bit-widths, none when ``n_choices = 1``);
    for ONNX Runtime one row (:func:`bayesq.targets.matmulnbits_unit_cost_bits`).
    """
    return sum(UniformGrids.unit_cost_bits(n, g, bits, n_choices, cfg, lb.unit_rows)
               for lb in blocks for n, g in lb.unit_sizes())


def baseline_blocks(layers: Mapping[str, nn.Module], granularity: Granularity, cfg: QuantConfig) -> list[LayerBlocks]:
    """The GPTQ / AWQ / RTN layouts of ``layers`` (group = ``cfg.group_size``, channel = one row)."""
    return rtn_blocks(layer_blocks(dict(layers), cfg.group_size, cfg.unit_groups), Granularity(granularity), cfg)


def mixed_min_bits(
    layers: Mapping[str, nn.Module], granularity: Granularity, cfg: QuantConfig, extra_bits: int = 0,
) -> int:
    """Bits of the mixed rule's cheapest allocation: every unit at ``min(cfg.bits)`` plus headers
    and ``extra_bits`` (AWQ's stored scales)."""
    blocks = baseline_blocks(layers, granularity, cfg)
    return layout_bits(blocks, min(cfg.bits), len(cfg.bits), cfg) + extra_bits


def uniform_bits(
    layers: Mapping[str, nn.Module], variant: UniformVariant, cfg: QuantConfig, extra_bits: int = 0,
) -> int:
    """Exact bits of ``variant`` on ``layers`` (no headers) plus ``extra_bits``."""
    blocks = baseline_blocks(layers, variant.granularity, variant.config(cfg))
    return layout_bits(blocks, variant.bits, 1, variant.config(cfg)) + extra_bits


def layouts(group_sizes: Iterable[int], cfg: QuantConfig | None = None) -> list[int | None]:
    """Group sizes in the order tried: ascending, then ``None`` (one grid per output channel);
    under a deployment target (``cfg.target``) only the block sizes it runs, no per-channel grid."""
    sizes = sorted(set(int(g) for g in group_sizes))
    if cfg is None or cfg.target == Target.BAYESQ:
        return [*sizes, None]
    return [g for g in sizes if g in spec(cfg.target).block_sizes]


def uniform_variants(
    layers: Mapping[str, nn.Module], budget: float, cfg: QuantConfig,
    group_sizes: Iterable[int] = GROUP_SIZES, extra_bits: int = 0,
) -> list[UniformVariant]:
    """Feasible uniform variants: for each ``b`` in ``cfg.bits`` the first layout of
    :func:`layouts` whose exact bits (plus ``extra_bits``) fit ``budget`` average bits; widths
    with no fitting layout are left out."""
    n = sum(m.weight.numel() for m in layers.values())
    limit = budget_bits(budget, n)
    out = []
    for b in cfg.bits:
        for g in layouts(group_sizes, cfg):
            v = UniformVariant(b, g)
            if uniform_bits(layers, v, cfg, extra_bits) <= limit:
                out.append(v)
                break
    return out


def cheapest_bits(
    layers: Mapping[str, nn.Module], granularity: Granularity, cfg: QuantConfig,
    group_sizes: Iterable[int] = GROUP_SIZES, extra_bits: int = 0,
) -> float:
    """Least average bits any mixed or uniform variant needs (the minimum feasible budget)."""
    n = sum(m.weight.numel() for m in layers.values())
    costs = [mixed_min_bits(layers, granularity, cfg, extra_bits)]
    costs += [uniform_bits(layers, UniformVariant(min(cfg.bits), g), cfg, extra_bits)
              for g in layouts(group_sizes, cfg)]
    return min(costs) / n


def check_feasible(candidates: Mapping[str, object], method: str, budget: float, cheapest: float) -> None:
    """Raise ``ValueError`` naming the minimum feasible budget when ``candidates`` is empty."""
    if not candidates:
        raise ValueError(
            f"budget of {budget} bits/weight is infeasible for {method}: its cheapest variant needs "
            f"{cheapest:.4f} bits/weight (lowest bit-width plus scales, zero-points and headers); "
            "raise the budget or add a larger group size to baselines.group_sizes"
        )


def given_allocation(table: LossTable, unit_bits: Mapping[str, Sequence[int]], budget: float) -> Allocation:
    """:class:`Allocation` of supplied per-unit bit-widths, costed by ``table``'s exact unit costs.

    Args:
        table: candidates of every layer (its blocks define the units).
        unit_bits: layer name -> one bit-width per unit of that layer (a sequence of ints).
        budget: average bits per quantised weight the allocation must meet.

    Raises:
        ValueError: a layer missing or with the wrong number of units, a bit-width that is not a
            candidate, or a total above the budget.
    """
    limit = budget_bits(budget, table.n_weights)
    chosen, total, loss = {}, 0, 0.0
    for t in table.layers:
        name, n_units = t.blocks.name, t.blocks.n_units
        bits = tuple(int(b) for b in unit_bits.get(name, ()))
        if len(bits) != n_units:
            raise ValueError(f"allocation gives layer '{name}' {len(bits)} unit bit-widths but its layout has "
                             f"{n_units} units (group_size={t.blocks.group_size}, unit_groups={t.blocks.unit_groups}); "
                             "build it over the same blocks")
        bad = sorted(set(bits) - set(t.bits))
        if bad:
            raise ValueError(f"allocation gives layer '{name}' bit-widths {bad}, not among the candidates "
                             f"{list(t.bits)}")
        col = torch.tensor([t.bits.index(b) for b in bits], device=t.unit_cost.device)
        rows = torch.arange(n_units, device=t.unit_cost.device)
        total += int(t.unit_cost[rows, col].sum())
        loss += float(t.unit_loss[rows, col].sum())
        chosen[name] = bits
    if total > limit:
        raise ValueError(f"the supplied allocation costs {total / table.n_weights:.4f} bits/weight under this "
                         f"encoding, above the budget of {budget}; allocate with the same quant settings")
    return Allocation(chosen, total, table.n_weights, limit, loss)


def encoding_config(result: QuantizationResult, cfg: QuantConfig) -> QuantConfig:
    """``cfg`` with the bit set ``result``'s units choose from (a uniform variant: its one width,
    no unit header), as :func:`bayesq.export.save_export` needs to write exactly the accounted bits.

    Raises:
        ValueError: layers with different bit sets.
    """
    sets = {t.bits for t in result.table.layers}
    if len(sets) != 1:
        raise ValueError(f"layers choose from different bit sets {sorted(sets)}; one export config cannot name them")
    return replace(cfg, bits=sets.pop())


# ---- calibration KL and the choice ----------------------------------------------------------------

def stats_correction(model: nn.Module, stats: Mapping[str, InputStats], batches: Iterable[Batch]) -> BiasCorrection:
    """:class:`BiasCorrection` of the layers in ``stats`` from their mean inputs (``InputStats.mean``).

    Raises:
        ValueError: statistics without mean inputs, or an empty ``batches``.
    """
    missing = [name for name, s in stats.items() if s.mean is None]
    if missing:
        raise ValueError(f"input statistics of {missing[:3]} carry no mean input; compute them with "
                         "bayesq.baselines.activations.input_stats for bias correction")
    return BiasCorrection.fit(model, {name: s.mean for name, s in stats.items()}, batches)


def corrected(result: QuantizationResult, model: nn.Module, correction: BiasCorrection,
              in_place: bool = False) -> QuantizationResult:
    """``result`` with ``correction`` applied to a copy of its model (``model``: full precision;
    ``in_place``: to its model itself, when ``result`` is not read again); weights, allocation and
    table unchanged."""
    qmodel = result.model if in_place else copy.deepcopy(result.model)
    correction.apply(qmodel, model)
    return replace(result, model=qmodel.eval(), correction=correction)


def select_best(
    candidates: Mapping[str, Callable[[], QuantizationResult]], model: nn.Module, fp: FPOutputs,
    correction: BiasCorrection | None = None, progress: bool = False,
) -> BaselineChoice:
    """Build every candidate in turn and keep the one with the least mean calibration KL.

    Each candidate is scored in two looks (:func:`bayesq.selection.selection_looks`): on the first
    look's inputs, a candidate whose per-input KL is resolved *worse* than the best one so far
    (the 95 % paired-bootstrap interval of the difference above zero,
    :func:`bayesq.comparison.paired_difference`) is dropped unscored on the rest; its ``kl`` is
    then its mean on the first look (``inputs`` says on how many). The others are scored on every
    input and the least mean wins, as with one look: a dropped candidate would have had to beat
    the best one on the rest by more than it was resolved to lose on the first look.

    Args:
        candidates: variant name -> builder of its :class:`QuantizationResult` (called once,
            in order), whose model is ``quantized_copy(model, weights)`` as every baseline's
            (:func:`bayesq.result.baseline_result`): only the best candidate's weights are kept
            while the others are built and scored, and its model is made again at the end.
        model: the full-precision model (the KL's reference).
        fp: its outputs (:class:`bayesq.context.FPOutputs`): ``fp.scored`` are the inputs the
            candidates are scored on (the calibration inputs, or inputs held out of them), against
            its log-probabilities there (computed once when not known: one pass shared by callers
            that score several selections on the same inputs). With ``fp.calibration``, the kept
            candidate's output-layer bias is then refitted on those inputs so that its mean
            prediction is the FP model's (:mod:`bayesq.output_offset`; the result's
            ``output_offset``), as BayesQ's default does (callers give them with the bias
            correction); with ``fp.held_out`` on both, the two models' log-probabilities on the
            scored inputs taken from the scoring (no further forward pass over them).
        correction: given, each candidate is also scored with it applied (:func:`corrected`),
            named ``<variant>+bc``.
        progress: a bar over the candidates (the one under way as its postfix) and over each pass's batches.

    Raises:
        ValueError: no candidates, or no calibration batch.
    """
    if not candidates:
        raise ValueError("no candidate to select from: the budget is infeasible for every variant")
    batches = fp.scored or []
    if not batches:
        raise ValueError("empty calibration set: the selection scores candidates on calibration (or held-out) inputs")
    reference = fp.log_probs(desc="FP on the scored inputs" if progress else None)
    first = selection_looks(batches)
    kl, bits, inputs = {}, {}, {}
    best, best_kl, best_losses, best_logits = None, math.inf, None, None
    bar = tqdm(candidates.items(), desc="variants", total=len(candidates), disable=not progress, leave=False)
    for name, build in bar:
        bar.set_postfix_str(name)
        release_freed()  # the last candidate's model copy: its small tensors stay resident in the C heap
        res = build()
        for label in [name] + ([f"{name}+bc"] if correction else []):
            if label != name:  # in place: the kept form holds no model (rebuilt at the end)
                res = corrected(res, model, correction, in_place=True)
            bits[label] = res.average_bits
            desc = f"selection KL ({label})" if progress else None
            losses, logits, dropped = _scored(res.model, reference, batches, first, best_losses, desc)
            kl[label], inputs[label] = float(losses.mean()), len(losses)
            if dropped:
                continue
            score = math.inf if math.isnan(kl[label]) else kl[label]
            if best is None or score < best_kl:  # its weights and correction; one model copy alive at a time
                best, best_kl, best_losses = (label, replace(res, model=None)), score, losses
                best_logits = logits
        del res
    label, kept = best
    qmodel, offset = quantized_copy(model, kept.weights, kept.correction), None
    if fp.calibration:
        held = dict(selection=batches, scored_q=best_logits) if fp.held_out else {}
        offset = fit_output_offset(model, qmodel, fp.calibration, progress, fp=fp, **held)
        offset.apply(qmodel)
    return BaselineChoice(replace(kept, model=qmodel, output_offset=offset), label, kl, bits, inputs)


def _scored(qmodel: nn.Module, fp_log_probs: Sequence[torch.Tensor], batches: list[Batch], first: int,
            best_losses: torch.Tensor | None, desc: str | None) -> tuple[torch.Tensor, list, bool]:
    """One candidate's per-input KL in :func:`select_best`'s two looks: (its KL on the inputs it was
    scored on, its (B, C) float32 logits per batch scored, whether it was dropped after the first
    look as resolved worse than ``best_losses``)."""
    logits = []  # the output offset's fit reads the kept one's
    losses = kl_per_input(fp_log_probs[:first], qmodel, batches[:first], desc, logits=logits)
    if first < len(batches) and best_losses is not None and _resolved_worse(losses, best_losses[:len(losses)]):
        return losses, logits, True
    if first < len(batches):
        rest = kl_per_input(fp_log_probs[first:], qmodel, batches[first:], desc, logits=logits)
        losses = torch.cat([losses, rest])
    return losses, logits, False


def select_variants(
    candidates: Mapping[str, Callable[[], QuantizationResult]], model: nn.Module,
    stats: Mapping[str, InputStats], batches: Iterable[Batch], bias_correction: bool = False,
    selection: Iterable[Batch] | None = None, known: KnownOutputs | None = None, progress: bool = False,
) -> BaselineChoice:
    """:func:`select_best` as the statistics-reading baselines' ``*_select`` functions call it:
    the candidates scored on ``selection`` (inputs held out of ``batches``; None: on ``batches``,
    the calibration inputs ``stats`` come from); with ``bias_correction`` each also in its form
    corrected by :func:`stats_correction`, and the kept one's output offset fitted on ``batches``
    (and ``selection``), reading the FP outputs the caller has (``known``)."""
    batches = list(batches)  # read by the correction's target search and by the selection
    correction = stats_correction(model, stats, batches) if bias_correction else None
    fp = FPOutputs(model, batches if selection is None else selection, batches if bias_correction else None,
                   held_out=selection is not None, known=known)
    return select_best(candidates, model, fp, correction, progress=progress)


def _resolved_worse(losses: torch.Tensor, best: torch.Tensor) -> bool:
    """Whether ``losses`` is resolved above ``best`` on the same inputs (a non-finite loss counts
    as worse once ``best`` is finite)."""
    if not bool(torch.isfinite(best).all()):
        return False
    if not bool(torch.isfinite(losses).all()):
        return True
    return paired_difference(losses, best).ci_low > 0


def stats_of(model: nn.Module, inputs: Inputs, method: str, progress: bool = False
             ) -> tuple[list[Batch], Mapping[str, InputStats], KnownOutputs]:
    """(calibration batches, layer-input statistics, the FP outputs known) a statistics-reading
    baseline's handler works from: ``inputs.stats`` when given, else :func:`input_stats` on the
    calibration batches (``progress``: a bar over them); the known outputs are ``inputs.known``'s,
    with the FP logits on the calibration batches those of the statistics pass when not given
    (float32, one (B, C) tensor per batch: what :func:`bayesq.evaluation.predict` gives, so the
    output offset's fit need not run the FP model again; None for per-token logits, or
    statistics given without logits)."""
    batches = inputs.need_calibration(method)
    known = inputs.known or KnownOutputs()
    if inputs.stats is not None:
        return batches, inputs.stats, known
    outputs: list[torch.Tensor | None] = []
    stats = input_stats(model, batches, exclude=tuple(inputs.exclude), progress=progress, logits=outputs)
    if known.logits is not None:
        return batches, stats, known
    fp = pass_logits(outputs, batches)
    return batches, stats, replace(known, logits=None if fp is None else [z.float() for z in fp])


def choice_outcome(choice: BaselineChoice, inputs: Inputs) -> Outcome:
    """A selecting baseline's :class:`~bayesq.methods.Outcome`: the kept variant and, in
    ``details``, ``variant`` / ``variant_kl`` / ``variant_bits`` / ``variant_inputs``."""
    details = {"variant": choice.variant, "variant_kl": dict(choice.kl), "variant_bits": dict(choice.avg_bits),
               "variant_inputs": dict(choice.inputs)}
    fitted = choice.result.output_offset is not None and choice.result.output_offset.fitted
    return Outcome(choice.result, details,
                   read(inputs, "stats", "log_probs") | (read(inputs, "logits") if fitted else frozenset()))


def mixed_outcome(result: QuantizationResult, inputs: Inputs) -> Outcome:
    """A statistics-reading baseline's :class:`~bayesq.methods.Outcome` without a selection:
    the ``mixed`` rule's result."""
    details = {"variant": "mixed", "variant_kl": {}, "variant_bits": {}, "variant_inputs": {}}
    return Outcome(result, details, read(inputs, "stats"))
