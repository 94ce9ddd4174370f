"""Mixed-precision search by simulated annealing: one bit-width per layer, chosen on the network's KL.

Where the knapsack rules (BayesQ's, GPTQ's, HAWQ's) rank bit-widths by a per-layer proxy, a
search measures each candidate assignment end to end. The layers are rounded by GPTQ (error
feedback, act-order, min/max grids per group of ``group_size``) at every candidate width once;
a layer's codes at a width do not depend on the other layers' widths (GPTQ's statistics come
from the full-precision model), so an assignment is assembled from those encodings without
re-running GPTQ. The search state is one width per layer under the exact storage accounting
(codes, scales, zero-points and one bit-width header per layer), and its energy is

    E(b) = mean_x KL(p_FP(y|x) || p_b(y|x))        over the first ``search_inputs`` calibration inputs.

Annealing (Metropolis): from GPTQ's own per-layer knapsack allocation (the loss
``sum H_jj (Q_b(w) - w)^2`` per layer, greedy), each step moves one random layer one width up or
down; a move over the budget also moves random other layers down until it fits (else it is
rejected). A move is accepted when ``dE < 0``, else with probability ``exp(-dE / T)``, the
temperature falling geometrically from ``t_start * E(start)`` to ``t_end * E(start)`` over
``steps`` steps. The best assignment seen is kept. Then, as every selecting baseline does, the
held-out selection inputs choose between it and the start (each also bias-corrected when asked):
a search that over-fits its own inputs is not kept.

A move changes one layer (and, over the budget, a few random others), so the forward pass up
to the first changed one is the current state's: the search keeps each unit's outputs on the
search inputs (:class:`UnitOutputs`; units as BRECQ's, residual blocks and transformer layers)
and runs a proposal from the first unit it changes, with the energies of full passes.
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.assignment import allocate
from bayesq.baselines.activations import InputStats
from bayesq.baselines.brecq import reconstruction_units
from bayesq.baselines.gptq import DAMP, gptq_codes, gptq_table
from bayesq.baselines.select import BaselineChoice, choice_outcome, given_allocation, select_variants, stats_of
from bayesq.blocks import checked_layers, layer_blocks
from bayesq.canonical import on_canonical
from bayesq.config import AllocationUnit, QuantConfig
from bayesq.context import KnownOutputs
from bayesq.evaluation import kl_per_input, reference_log_probs
from bayesq.expected_loss import LossTable
from bayesq.forward import Batch, first_inputs
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import Allocation, QuantizationResult, QuantizedWeight, baseline_result, quantized_copy
from bayesq.settings import validate
from bayesq.storage import budget_bits


@dataclass(frozen=True)
class SearchTrace:
    """What :func:`anneal_search` did.

    Attributes:
        start, best: layer name -> bit-width of the start and of the best assignment.
        start_kl, best_kl: their energies (mean KL on the search inputs).
        accepted: moves accepted out of ``steps`` proposed (infeasible ones count as rejected).
    """

    start: dict[str, int]
    best: dict[str, int]
    start_kl: float
    best_kl: float
    accepted: int
    steps: int


def layer_encodings(
    layers: Mapping[str, nn.Module], stats: Mapping[str, InputStats], cfg: QuantConfig, *,
    act_order: bool = True, damp: float = DAMP, progress: bool = False,
) -> tuple[LossTable, dict[int, dict[str, QuantizedWeight]]]:
    """GPTQ's per-layer table (one unit per layer) and each layer's encoding at every width
    (``progress``: a bar over the layers of each width).

    Returns:
        (table, {bits: {layer: QuantizedWeight}}): ``table`` over ``cfg.bits`` with one unit per
        layer (exact costs with a header); the encodings of GPTQ at each width of ``cfg.bits``.
    """
    blocks = layer_blocks(dict(layers), cfg.group_size, cfg.unit_groups, AllocationUnit.TENSOR.value)
    table = gptq_table(dict(layers), dict(stats), blocks, cfg)
    n = table.n_weights
    out = {}
    for j, b in enumerate(cfg.bits):
        unit_bits = {t.blocks.name: (b,) for t in table.layers}
        total = sum(int(t.unit_cost[0, j]) for t in table.layers)
        alloc = Allocation(unit_bits, total, n, total)  # every layer at b: no budget here
        out[b] = gptq_codes(dict(layers), dict(stats), table, alloc, act_order, damp, scale_bits=cfg.scale_bits,
                            progress=progress)
    return table, out


def _cloned(out: Any) -> Any:
    """A unit's output with its tensors copied (tuples / lists / dicts kept), so that no later
    in-place operation changes a kept output."""
    if torch.is_tensor(out):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_cloned(v) for v in out)
    if isinstance(out, dict):
        return type(out)((k, _cloned(v)) for k, v in out.items())
    return out


class UnitOutputs:
    """Each unit's outputs on the search inputs for the current weights, so that a pass after a
    change runs from the first changed unit on.

    ``units``: module names of ``model`` in the order a forward pass first calls them, each called
    once per pass (:func:`bayesq.baselines.brecq.reconstruction_units`). Inside
    :meth:`pass_from` ``(first)``, units before ``first`` return their kept outputs without running
    (in call order: the n-th call of the context gets the n-th kept output) and the others run,
    their outputs recorded; :meth:`keep` makes the recorded outputs the kept ones. A model that
    calls a unit more or less than once per pass is seen on the first (full) pass, after which
    every pass runs in full (``active`` False): reuse is exact only when each unit's inputs come
    from the units before it. The passes give the outputs of full passes bit for bit (the same
    operations on the same inputs).
    """

    def __init__(self, model: nn.Module, units: Sequence[str]) -> None:
        self.model = model
        self.mods = [model.get_submodule(u) for u in units]
        self.kept: list[list[Any]] | None = None  # per unit, its outputs in call order
        self.fresh: list[list[Any]] = []
        self.first = 0  # the unit the last pass ran from
        self.active = True

    @contextmanager
    def pass_from(self, first: int) -> Iterator[None]:
        """Forward passes of ``model`` inside run from unit ``first`` (0, or no outputs kept yet:
        full passes)."""
        if not (self.active and self.mods):
            self.active = False
            yield
            return
        self.first = first = first if self.kept is not None else 0
        self.fresh = [[] for _ in self.mods]
        calls = [0]
        handles = [self.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))]
        handles += [mod.register_forward_hook(lambda _m, _a, out, j=j: self.fresh[j].append(_cloned(out)))
                    for j, mod in enumerate(self.mods) if j >= first]
        for j in range(first):
            self.mods[j].forward = self._replay(self.kept[j])
        try:
            yield
        finally:
            for j in range(first):
                del self.mods[j].forward
            for h in handles:
                h.remove()
        if self.kept is None and any(len(f) != calls[0] for f in self.fresh):
            self.active, self.fresh = False, []  # a unit called more or less than once per pass: no reuse

    @staticmethod
    def _replay(outs: list[Any]):
        calls = iter(outs)

        def forward(*_args, **_kwargs):
            return _cloned(next(calls))
        return forward

    def keep(self) -> None:
        """The outputs of the last :meth:`pass_from` become the current weights' (the units it ran)."""
        if not self.active:
            return
        if self.kept is None:
            self.kept = self.fresh
        else:
            self.kept[self.first:] = self.fresh[self.first:]
        self.fresh = []


def _units_of(model: nn.Module, names: Sequence[str], batch: Batch) -> tuple[list[str], dict[str, int]]:
    """The units of ``names`` in call order and the unit a change of each layer runs from: its
    own, or 0 for a layer whose weight is tied to another parameter (e.g. a language model's head
    and its token embedding, read before the first unit). (([], {}) where a layer's unit is never
    called: no reuse.)"""
    try:
        units = reconstruction_units(model, names, batch)
    except ValueError:
        return [], {}
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tied = {n for n in names if uses.get(id(model.get_submodule(n).weight), 0) > 1}
    return [u.name for u in units], {n: 0 if n in tied else j for j, u in enumerate(units) for n in u.layers}


def anneal_search(
    model: nn.Module, table: LossTable, encodings: Mapping[int, Mapping[str, QuantizedWeight]], batches: Sequence[Batch],
    budget: float, *, steps: int = 200, t_start: float = 0.05, t_end: float = 0.001, seed: int = 0,
    progress: bool = False, reuse: bool = True,
) -> SearchTrace:
    """Simulated annealing over one width per layer (module docstring).

    Args:
        model: the full-precision model (canonical form: the layers of ``table`` by name).
        table: :func:`layer_encodings`' table (one unit per layer).
        encodings: bits -> layer -> its GPTQ encoding at that width.
        batches: the search inputs (the energy is the mean KL over them).
        budget: average bits per quantised weight.
        steps, t_start, t_end, seed: the schedule (temperatures relative to the start's energy).
        reuse: run each proposal from the first unit it changes (:class:`UnitOutputs`; the same
            energies as full passes); False: every pass in full.

    Raises:
        ValueError: an infeasible budget (from the start allocation).
    """
    names = [t.blocks.name for t in table.layers]
    bits = table.layers[0].bits
    cost = [[int(c) for c in t.unit_cost[0]] for t in table.layers]  # (L, nb) exact bits of each width
    limit = budget_bits(budget, table.n_weights)
    start_alloc = allocate(table, budget)
    state = [bits.index(start_alloc.unit_bits[n][0]) for n in names]
    start = list(state)
    reference = reference_log_probs(model, batches)
    work = quantized_copy(model, {n: encodings[bits[j]][n] for n, j in zip(names, state)})
    params = {n: work.get_submodule(n).weight for n in names}
    units, unit_of = _units_of(work, names, batches[0]) if reuse and batches else ([], {})
    outputs = UnitOutputs(work, units)

    def energy(changed: Sequence[int] = ()) -> float:
        first = min((unit_of[names[m]] for m in changed), default=0) if unit_of else 0
        with outputs.pass_from(first):
            return float(kl_per_input(reference, work, batches).mean())

    def put(i: int, j: int) -> None:
        with torch.no_grad():
            params[names[i]].copy_(encodings[bits[j]][names[i]].dequantize())

    rng = random.Random(seed)
    e = start_e = energy()
    outputs.keep()
    best, best_e, accepted = list(state), e, 0
    spent = sum(cost[i][j] for i, j in enumerate(state))
    for k in tqdm(range(steps), desc="annealing search", disable=not progress, leave=False):
        temp = start_e * t_start * (t_end / t_start) ** (k / max(1, steps - 1))
        new = list(state)
        i = rng.randrange(len(names))
        new[i] = min(max(new[i] + rng.choice((-1, 1)), 0), len(bits) - 1)
        total = spent + cost[i][new[i]] - cost[i][state[i]]
        down = [m for m in range(len(names)) if m != i and new[m] > 0]
        while total > limit and down:
            m = down.pop(rng.randrange(len(down)))
            total += cost[m][new[m] - 1] - cost[m][new[m]]
            new[m] -= 1
        if new == state or total > limit:
            continue
        changed = [m for m in range(len(names)) if new[m] != state[m]]
        for m in changed:
            put(m, new[m])
        e_new = energy(changed)
        if e_new < e or (temp > 0 and rng.random() < math.exp(-(e_new - e) / temp)):
            state, e, spent, accepted = new, e_new, total, accepted + 1
            outputs.keep()
            if e < best_e:
                best, best_e = list(state), e
        else:
            for m in changed:
                put(m, state[m])
    return SearchTrace({n: bits[j] for n, j in zip(names, start)}, {n: bits[j] for n, j in zip(names, best)},
                       start_e, best_e, accepted, steps)


@on_canonical
def anneal_select(
    model: nn.Module, stats: Mapping[str, InputStats], batches: Iterable[Batch], budget: float,
    cfg: QuantConfig = QuantConfig(), *, steps: int = 200, search_inputs: int = 256, t_start: float = 0.05,
    t_end: float = 0.001, seed: int = 0, act_order: bool = True, damp: float = DAMP, bias_correction: bool = False,
    selection: Iterable[Batch] | None = None, known: KnownOutputs | None = None,
    exclude: Sequence[str] = (), progress: bool = False,
) -> tuple[BaselineChoice, SearchTrace]:
    """The searched assignment or the start, whichever has the least KL on ``selection`` (else
    ``batches``); the search runs on the first ``search_inputs`` inputs of ``batches``.

    Raises:
        ValueError: missing stats, an infeasible budget, an empty ``batches``.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("empty calibration set: the annealing search scores assignments on calibration inputs")
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    table, encodings = layer_encodings(layers, stats, cfg, act_order=act_order, damp=damp, progress=progress)
    trace = anneal_search(model, table, encodings, first_inputs(batches, search_inputs), budget, steps=steps,
                          t_start=t_start, t_end=t_end, seed=seed, progress=progress)

    def build(assignment: dict[str, int]) -> QuantizationResult:
        alloc = given_allocation(table, {n: (b,) for n, b in assignment.items()}, budget)
        weights = {n: encodings[b][n] for n, b in assignment.items()}
        return baseline_result(model, layers, weights, alloc, table, exclude)

    cands = {"annealed": lambda: build(trace.best), "start": lambda: build(trace.start)}
    choice = select_variants(cands, model, stats, batches, bias_correction, selection, known, progress)
    return choice, trace


@dataclass(frozen=True)
class AnnealConfig:
    """Mixed precision by simulated annealing over one width per layer (:func:`anneal_select`),
    layers rounded by GPTQ; ``steps`` moves scored on the first ``search_inputs`` calibration inputs."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    steps: int = 200
    search_inputs: int = 256
    t_start: float = 0.05
    t_end: float = 0.001
    seed: int = 0
    bias_correction: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "AnnealConfig")
        if not (isinstance(self.steps, int) and self.steps >= 0):
            raise ValueError(f"AnnealConfig.steps = {self.steps!r}: must be an integer >= 0")
        if not (isinstance(self.search_inputs, int) and self.search_inputs >= 1):
            raise ValueError(f"AnnealConfig.search_inputs = {self.search_inputs!r}: must be an integer >= 1")
        if not (self.t_start >= self.t_end > 0):
            raise ValueError(f"AnnealConfig temperatures need t_start >= t_end > 0, got {self.t_start}, {self.t_end}")


@register(AnnealConfig)
def anneal_method(model: nn.Module, config: AnnealConfig, budget: float, inputs: Inputs) -> Outcome:
    """The annealing search from ``inputs.stats`` (else computed) on the calibration batches,
    its result against the start chosen on ``inputs.selection``; ``details`` add the search's
    ``start_kl``, ``search_kl`` and ``accepted``."""
    batches, stats, known = stats_of(model, inputs, "the annealing search", config.progress)
    choice, trace = anneal_select(
        model, stats, batches, budget, config.quant, steps=config.steps, search_inputs=config.search_inputs,
        t_start=config.t_start, t_end=config.t_end, seed=config.seed, bias_correction=config.bias_correction,
        selection=inputs.selection, known=known, exclude=tuple(inputs.exclude),
        progress=config.progress)
    out = choice_outcome(choice, inputs)
    details = dict(out.details, start_kl=trace.start_kl, search_kl=trace.best_kl, accepted=trace.accepted)
    return Outcome(out.result, details, out.read)
