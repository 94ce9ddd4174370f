"""BRECQ (Li et al. 2021, "BRECQ: Pushing the Limit of Post-Training Quantization by Block
Reconstruction"): AdaRound's learned rounding, fitted on the output of a whole residual block or
transformer layer at a time instead of one layer's linear output.

The network is cut into reconstruction units (:func:`reconstruction_units`): the blocks a model is
built of (a ResNet's bottlenecks, an EfficientNet's MBConv blocks, a transformer's layers) and, for
the layers in no block (a stem convolution, a classifier), the layer alone. Units are reconstructed
in the order the forward pass reaches them. For unit ``u`` with layers ``l`` and AdaRound's soft
weights (:mod:`bayesq.baselines.adaround`)

    W_l(V_l) = s_l (clip(floor(W_l / s_l) + z_l + h(V_l), 0, maxq_l) - z_l),

the logits ``V`` of every layer of the unit are learned together by Adam on

    mean_{real positions, features} (u(x_q; W(V)) - u(x; W))^2  +  lambda sum_l sum (1 - |2 h(V_l) - 1|^beta)

where ``x`` is the unit's input in the full-precision model and ``x_q`` its input in the model
whose earlier units are already quantised (BRECQ's ``asym`` reconstruction, its published
setting), one calibration batch per step in a shuffled cycle. The unit's first output tensor is
reconstructed (a transformer layer's hidden states); positions a batch pads
(``attention_mask`` 0) are left out of the mean. ``beta`` anneals from 20 to 2 after a warm-up
without the regulariser (20 % of the steps), as in AdaRound; the codes are then
``c0 + [h(V) >= 1/2]``, clipped to the grid, and the next unit reads the quantised unit's output.

Settings are those of the authors' code (20,000 steps per unit, Adam at 1e-3, lambda 0.01, beta
from 20 to 2, 20 % warm-up, batches of 32 when the calibration batches are of 32). Grids, budgets and
variants are GPTQ's (:mod:`bayesq.baselines.gptq`: min/max grids per group or channel, the
mixed-precision rule, the uniform layouts and a supplied allocation, selection on held-out inputs),
so that BRECQ, AdaRound and GPTQ differ only in how they round. As in this library's AdaRound, the
reconstruction error is the mean over output elements, the scale ``lambda`` was set for; the paper
also offers a Fisher-weighted error (not its default in the authors' code) and, for activation
quantisation, step sizes, neither of which applies to weight-only quantisation here.

A unit's module runs with its other parameters (biases, norms) as they are; keyword arguments
the model passes it (attention masks, position biases) are replayed as captured, except cache
objects (a ``*Cache`` instance: replaced by None, so that replaying a call does not grow them) and
``use_cache`` (False). A module the forward pass calls several times is reconstructed on its first call.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.baselines.activations import InputStats
from bayesq.baselines.adaround import beta_at, check_schedule, initial_logits, rectified_sigmoid
from bayesq.baselines.gptq import LayerRounding, grid_method_outcome
from bayesq.baselines.lsq import nearest_rows
from bayesq.baselines.select import group_sizes_setting
from bayesq.canonical import canonical
from bayesq.config import BayesQConfig, Granularity, QuantConfig
from bayesq.forward import Batch, call, kept_state, model_batches, padding_mask
from bayesq.memory import release_freed
from bayesq.methods import Inputs, Outcome, register
from bayesq.output_offset import fit_output_offset
from bayesq.quantize import quantize_model
from bayesq.result import QuantizationResult, QuantizedWeight, quantized_copy
from bayesq.rounding import group_grid
from bayesq.selection import Encoding
from bayesq.settings import validate

CONTAINERS = (nn.Sequential, nn.ModuleList)


@dataclass(frozen=True)
class Unit:
    """One reconstruction unit: the module ``name`` and the quantised layers inside it (by their
    names in the model; a single layer is its own unit)."""

    name: str
    layers: tuple[str, ...]


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or prefix == "" or name.startswith(prefix + ".")


def block_modules(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """Names of the blocks of ``model`` that hold two or more of ``layers``.

    A block is an element of an ``nn.Sequential`` / ``nn.ModuleList`` holding two or more layers,
    with at least one sibling that does too (a stage of repeated blocks), and holding no smaller
    such block. So a ResNet's bottlenecks, a transformer's layers and an EfficientNet's MBConv
    blocks are blocks (a stage of one MBConv block is, as that stage's element), while a
    squeeze-excitation inside one MBConv block is not (no sibling of it holds two layers).
    """
    count = {}
    for name, _ in model.named_modules():
        count[name] = sum(_inside(n, name) for n in layers)
    found = set()
    for name, mod in model.named_modules():
        if isinstance(mod, CONTAINERS):
            elems = [f"{name}.{k}" if name else k for k, _ in mod.named_children()]
            multi = [e for e in elems if count.get(e, 0) >= 2]
            if len(multi) >= 2:
                found.update(multi)
    return sorted(b for b in found if not any(o != b and _inside(o, b) for o in found))


def reconstruction_units(model: nn.Module, layers: Sequence[str], batch: Batch) -> list[Unit]:
    """Every layer of ``layers`` in exactly one unit (:func:`block_modules`, else the layer
    alone), the units in the order one forward pass on ``batch`` first calls them.

    Raises:
        ValueError: a layer whose unit the forward pass never calls.
    """
    blocks = block_modules(model, layers)
    units = [Unit(b, tuple(n for n in layers if _inside(n, b))) for b in blocks]
    units += [Unit(n, (n,)) for n in layers if not any(_inside(n, b) for b in blocks)]
    order: dict[str, int] = {}

    def seen(name: str) -> None:  # returns None: a pre-hook's return value would replace the inputs
        order.setdefault(name, len(order))

    handles = [model.get_submodule(u.name).register_forward_pre_hook(lambda *_, name=u.name: seen(name))
               for u in units]
    try:
        with torch.no_grad():
            call(model, _stateless_batch(model, batch))
    finally:
        for h in handles:
            h.remove()
    never = [u.name for u in units if u.name not in order]
    if never:
        raise ValueError(f"BRECQ: the forward pass never calls {never[:3]}: keep them in floating point with "
                         "exclude=[...]")
    return sorted(units, key=lambda u: order[u.name])


def _stateless_batch(model: nn.Module, batch: Batch) -> Batch:
    """``batch`` with ``use_cache=False`` when the model's forward takes it (a language model's
    key/value cache is not built)."""
    if isinstance(batch, dict) and "use_cache" in inspect.signature(model.forward).parameters:
        return {**batch, "use_cache": False}
    return batch


def _is_cache(value: Any) -> bool:
    return any(c.__name__.endswith("Cache") for c in type(value).__mro__)


def _detached(value: Any) -> Any:
    """A captured argument as replayed: tensors detached, cache objects None, ``use_cache`` False."""
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return None if _is_cache(value) else value


def first_tensor(out: Any) -> torch.Tensor:
    """A unit's reconstructed output: ``out`` itself, or the first tensor of a tuple / list /
    mapping / object with ``last_hidden_state`` (a transformer layer's hidden states)."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    elif hasattr(out, "last_hidden_state"):
        out = [out.last_hidden_state]
    for v in out:
        if torch.is_tensor(v):
            return v
    raise ValueError(f"BRECQ: a unit returned {type(out).__name__} without a tensor to reconstruct")


class _Stop(Exception):
    """Raised by a capture hook: the rest of the forward pass is not needed."""


def capture(model: nn.Module, unit: str, batches: Sequence[Batch], *, inputs: bool) -> list:
    """Per batch, the (args, kwargs) the forward pass calls module ``unit`` with (``inputs``) or
    its first output tensor (:func:`first_tensor`), detached; the pass stops there."""
    mod = model.get_submodule(unit)
    seen: list = []

    def pre(_m, args, kwargs):
        seen.append((_detached(args), {k: False if k == "use_cache" else _detached(v) for k, v in kwargs.items()}))
        raise _Stop

    def post(_m, _args, out):
        seen.append(first_tensor(out).detach())
        raise _Stop

    handle = (mod.register_forward_pre_hook(pre, with_kwargs=True) if inputs
              else mod.register_forward_hook(post))
    try:
        with torch.no_grad():
            for batch in batches:
                n = len(seen)
                try:
                    call(model, _stateless_batch(model, batch))
                except _Stop:
                    pass
                if len(seen) != n + 1:
                    raise ValueError(f"BRECQ: the forward pass did not call '{unit}' on batch {len(seen)}")
    finally:
        handle.remove()
    return seen


def element_grid(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, maxq, codes) of every weight of an encoding as (out, row) float64 tensors."""
    lb = qw.blocks
    idx = lb.element_groups(slice(0, lb.shape[0]))
    scale, zero, maxq = (x[idx].double() for x in group_grid(lb, qw.group_bits, qw.books))
    codes = lb.from_groups(qw.indices()).reshape(lb.shape[0], -1).double()
    return scale, zero, maxq, codes


class SoftWeight:
    """AdaRound's soft weight of one layer on its fixed grid (module docstring): ``logits`` V
    (out, row) in the model's dtype, :meth:`weight` ``W(V)``, :meth:`regulariser` and the hard
    :meth:`codes`."""

    def __init__(self, weight: torch.Tensor, qw: QuantizedWeight) -> None:
        scale, zero, maxq, _ = element_grid(qw)
        w = weight.detach().reshape(scale.shape).double()
        self.shape, self.dtype = weight.shape, weight.dtype
        self.live = scale > 0
        s = torch.where(self.live, scale, torch.ones_like(scale))
        ratio = w / s
        self.low = torch.floor(ratio) + zero
        dt = self.dtype
        self.s, self.zero, self.maxq, self.low_t = (x.to(dt) for x in (scale, zero, maxq, self.low))
        self.zero_code = zero.round()
        self.logits = initial_logits((ratio - torch.floor(ratio)).clamp(0.0, 1 - 1e-6)).to(dt).requires_grad_()

    def weight(self) -> torch.Tensor:
        c = torch.minimum((self.low_t + rectified_sigmoid(self.logits)).clamp(min=0), self.maxq)
        return (self.s * (c - self.zero)).reshape(self.shape)

    def regulariser(self, beta: float) -> torch.Tensor:
        h = rectified_sigmoid(self.logits)
        return ((1 - (2 * h - 1).abs().pow(beta)) * self.live).sum()

    def codes(self) -> torch.Tensor:
        up = rectified_sigmoid(self.logits.detach()).double() >= 0.5
        codes = torch.minimum(torch.clamp(self.low + up, min=0), self.maxq.double())
        return torch.where(self.live, codes, self.zero_code).to(torch.int64)


def with_codes(qw: QuantizedWeight, codes: torch.Tensor) -> QuantizedWeight:
    """``qw`` with the (out, row) ``codes`` in place of its own (same grids, same storage)."""
    groups, _ = qw.blocks.to_groups(codes.reshape(-1))
    return QuantizedWeight(qw.blocks, qw.group_bits, groups, qw.books, qw.col_scale)


def reconstruction_error(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error over the output's elements; with a (B, T) padding ``mask`` matching the
    output's first two axes, over the real positions' elements only."""
    sq = (out - target).pow(2)
    if mask is None or sq.dim() < 3 or tuple(sq.shape[:2]) != tuple(mask.shape):
        return sq.mean()
    keep = mask.reshape(*mask.shape, *([1] * (sq.dim() - 2))).to(sq.dtype)
    return (sq * keep).sum() / (keep.sum() * sq[0, 0].numel()).clamp(min=1)


@dataclass(frozen=True)
class BRECQConfig:
    """BRECQ on GPTQ's grids and variants (:mod:`bayesq.baselines.gptq`): with ``select`` the
    variant with the least KL on the selection inputs (``group_sizes`` its uniform layouts,
    ``bias_correction``: each variant also bias-corrected), else the ``mixed`` rule at
    ``granularity``. ``iters`` (Adam steps per unit, one calibration batch each), ``lam``,
    ``beta``, ``warmup``, ``lr``: the authors' schedule; ``seed``: the batch order."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    bias_correction: bool = True
    iters: int = 20000
    lam: float = 0.01
    beta: tuple[float, float] = (20.0, 2.0)
    warmup: float = 0.2
    lr: float = 1e-3
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "BRECQConfig")
        check_schedule("brecq", self)


def reconstruct_unit(
    unit: nn.Module, soft: dict[str, SoftWeight], q_inputs: list, targets: list[torch.Tensor],
    masks: list[torch.Tensor | None], config: BRECQConfig, name: str = "",
) -> dict[str, torch.Tensor]:
    """The learned codes (relative layer name -> (out, row) int64) of the layers ``soft`` of
    ``unit`` (names relative to it: ``""`` for the unit itself): Adam on the module docstring's
    objective, step ``k`` on batch ``order[k mod B]`` (a fresh seeded shuffle of the B batches
    each cycle), ``q_inputs`` / ``targets`` / ``masks`` per batch as :func:`capture` and
    :func:`bayesq.forward.padding_mask` give them."""
    opt = torch.optim.Adam([s.logits for s in soft.values()], lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed)
    frozen = [p for p in unit.parameters() if p.requires_grad]
    order: list[int] = []
    try:
        for p in frozen:
            p.requires_grad_(False)
        with torch.enable_grad():
            for step in tqdm(range(config.iters), desc=f"BRECQ {name}".strip(), disable=not config.progress,
                             leave=False, mininterval=1.0):
                if not order:
                    order = torch.randperm(len(targets), generator=gen).tolist()
                i = order.pop()
                over = {(f"{rel}.weight" if rel else "weight"): s.weight() for rel, s in soft.items()}
                args, kwargs = q_inputs[i]
                out = first_tensor(torch.func.functional_call(unit, over, args, kwargs))
                loss = reconstruction_error(out, targets[i], masks[i])
                b = beta_at(step, config.iters, config.warmup, config.beta)
                if b is not None and config.lam > 0:
                    loss = loss + config.lam * sum(s.regulariser(b) for s in soft.values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return {rel: s.codes() for rel, s in soft.items()}


def brecq_codes(model: nn.Module, layers: dict[str, nn.Module], encodings: dict[str, QuantizedWeight],
                batches: Sequence[Batch], config: BRECQConfig) -> dict[str, QuantizedWeight]:
    """Every layer's encoding re-rounded by BRECQ on its grid (``encodings``: the layers'
    encodings on their fixed grids, whatever their codes; ``model``: the full-precision model in
    eval mode, left as it is; ``batches``: the calibration batches)."""
    batches = list(batches)
    if not batches:
        raise ValueError("BRECQ reconstructs on calibration batches, but none were given")
    units = reconstruction_units(model, list(layers), batches[0])
    masks = [padding_mask(b) for b in batches]
    qmodel = copy.deepcopy(model).eval()  # its units quantised as they are reconstructed
    out = dict(encodings)
    for u in tqdm(units, desc="BRECQ units", disable=not config.progress, leave=False):
        targets = capture(model, u.name, batches, inputs=False)
        q_inputs = capture(qmodel, u.name, batches, inputs=True)
        qunit = qmodel.get_submodule(u.name)
        rel = {n: n[len(u.name) + 1:] if n != u.name else "" for n in u.layers}
        soft = {rel[n]: SoftWeight(layers[n].weight, out[n]) for n in u.layers}
        codes = reconstruct_unit(qunit, soft, q_inputs, targets, masks, config, u.name)
        for n in u.layers:
            out[n] = with_codes(out[n], codes[rel[n]])
            w = qmodel.get_submodule(n).weight
            with torch.no_grad():
                w.copy_(out[n].dequantize().reshape(w.shape).to(w.dtype))
        del targets, q_inputs, soft
        release_freed()
    return out


def brecq_rounding(config: BRECQConfig, model: nn.Module, batches: Sequence[Batch]) -> LayerRounding:
    """GPTQ's pipeline with BRECQ's rounding: each layer first to the nearest level of its grid,
    then every unit reconstructed (:func:`brecq_codes`)."""
    def refine(layers: dict[str, nn.Module], encodings: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        return brecq_codes(model, layers, encodings, batches, config)

    return LayerRounding("BRECQ", InputStats.output_mse_metric, nearest_rows, refine=refine)


@register(BRECQConfig)
def brecq_method(model: nn.Module, config: BRECQConfig, budget: float, inputs: Inputs) -> Outcome:
    """BRECQ from the calibration batches (and ``inputs.stats`` for the grids' mixed rule, else
    computed); with ``config.select``, ``inputs.allocation`` is one more variant and the variants
    are scored on ``inputs.selection`` (else the calibration batches) against ``inputs.reference``
    when given."""
    batches = model_batches(model, inputs.need_calibration("BRECQ"))
    return grid_method_outcome(model, config, budget, inputs, "BRECQ",
                               rounding=brecq_rounding(config, model, batches))


@dataclass(frozen=True)
class BayesQBRECQConfig:
    """BayesQ, then its encoding rounded again by BRECQ's block reconstruction (:func:`bayesq_brecq`).

    ``bayesq``: BayesQ's settings (posterior, grid candidates and their selection, tables,
    allocation); its distillation must not apply at the budget (the new codes would discard the
    scales it learned). ``brecq``: the reconstruction's schedule (``iters``, ``lam``, ``beta``,
    ``warmup``, ``lr``, ``seed``, ``progress``); its grid and variant fields are not read, the
    grids and bit-widths being BayesQ's."""

    bayesq: BayesQConfig = field(default_factory=BayesQConfig)
    brecq: BRECQConfig = field(default_factory=BRECQConfig)


def bayesq_brecq(model: nn.Module, calibration: Sequence[Batch], config: BayesQBRECQConfig, budget: float, *,
                 selection: Sequence[Batch] | None = None, exclude: Sequence[str] = ()) -> QuantizationResult:
    """:func:`bayesq.quantize.quantize_model` at ``budget``, then every layer's codes learned again
    by :func:`brecq_codes` on the grids BayesQ kept, unit by unit on ``calibration``.

    The bits, grids (refitted scales included) and allocation are BayesQ's; only the codes change.
    BayesQ's bias correction is not applied: the reconstruction fits each block's output, its mean
    included, and the correction on top overshoots (docs/findings.md: KL 0.0785 against 0.0576
    without it on lite0, 0.00617 against 0.00297 on MiniLM). The output offset
    (``quant.output_offset``, :mod:`bayesq.output_offset`) is fitted again on the re-rounded model,
    on the calibration and ``selection`` inputs.

    Returns:
        :class:`bayesq.result.QuantizationResult` (``correction`` None; ``encoding`` and
        ``selection_kl``: BayesQ's choice among its grid candidates).

    Raises:
        ValueError: distillation applies at ``budget``; no calibration batches; as
            :func:`quantize_model`.
    """
    if config.bayesq.distill.applies(budget):
        raise ValueError(f"BayesQ + BRECQ re-rounds BayesQ's encoding, which would discard its distilled scales: set "
                         f"distill.max_budget below {budget} (0, the default, turns distillation off)")
    with canonical(model, exclude), kept_state(model):
        model.eval()
        batches = model_batches(model, calibration)
        if not batches:
            raise ValueError("BayesQ + BRECQ reconstructs on calibration batches, but none were given")
        res = quantize_model(model, batches, replace(config.bayesq, budget=budget), progress=config.brecq.progress,
                             selection=selection, exclude=exclude)
        weights = _relearned(model, res.weights, batches, config.brecq)
        qmodel, offset = quantized_copy(model, weights), None
        if config.bayesq.quant.output_offset:  # refitted on the re-rounded model, as the pipeline's assemble does
            offset = fit_output_offset(model, qmodel, batches, config.brecq.progress,
                                       selection=model_batches(model, selection, "selection"))
            offset.apply(qmodel)
        return replace(res, model=qmodel, weights=weights, correction=None, output_offset=offset)


def _relearned(model: nn.Module, weights: dict[str, QuantizedWeight], batches: Sequence[Batch],
               config: BRECQConfig) -> dict[str, QuantizedWeight]:
    """``weights`` (layer name -> encoding of that layer of ``model``) with their codes learned
    again by :func:`brecq_codes` on their own grids."""
    return brecq_codes(model, {n: model.get_submodule(n) for n in weights}, dict(weights), batches, config)


def brecq_encoding(model: nn.Module, enc: Encoding, batches: Sequence[Batch], config: BRECQConfig) -> Encoding:
    """A BayesQ encoding of ``model`` (:func:`bayesq.selection.encode_best`) with every layer's codes
    learned again by :func:`brecq_codes` on its grids, and no bias correction: the last step of
    :func:`bayesq_brecq`, for a caller that has the encoding (``model`` comes back as it was)."""
    with canonical(model), kept_state(model):
        model.eval()
        weights = _relearned(model, enc.weights, model_batches(model, batches), config)
    return replace(enc, weights=weights, correction=None, scored_logits=None)  # not the scored model's


@register(BayesQBRECQConfig)
def bayesq_brecq_method(model: nn.Module, config: BayesQBRECQConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`bayesq_brecq` on the calibration batches, BayesQ's grid candidates scored on
    ``inputs.selection`` (else on the calibration batches)."""
    res = bayesq_brecq(model, inputs.need_calibration("BayesQ + BRECQ"), config, budget, selection=inputs.selection,
                       exclude=tuple(inputs.exclude))
    return Outcome(res, {"encoding": res.encoding, "encoding_kl": dict(res.selection_kl)})
