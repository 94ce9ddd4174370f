"""Method configuration: one frozen dataclass per section, validated declaratively on construction
(:mod:`bayesq.settings`: each field's rules next to it, errors that name the field and value,
unknown keys rejected with the closest valid one by :func:`bayesq.settings.from_mapping`).

The pipeline's parameter schema (profiles, calibration, baselines, robustness, ablations) lives
in :mod:`flows.params`; the embedded models' data and fine-tuning settings in
:mod:`bayesq.harness.models.config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Mapping

from bayesq.books import FITS, UNIFORM_FITS
from bayesq.settings import (
    Relation, above, ascending, at_least, checks, finite, integer, one_of, rule, setting, validate, within,
)
from bayesq.targets import ONNXRUNTIME, spec


class Granularity(str, Enum):
    """Scale granularity of a uniform grid: one scale/zero-point per tensor, row or group."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"


class Prior(str, Enum):
    """How each layer's prior precision lambda_l is set."""

    FITTED = "fitted"  # maximise the layer's Laplace marginal likelihood (MacKay's fixed point)
    FIXED = "fixed"  # lambda_l = posterior.damping for every layer


class Curvature(str, Enum):
    """Curvature estimate behind the posterior precision."""

    FISHER = "fisher"  # sampled-label Fisher diagonal (default)
    EMPIRICAL_FISHER = "empirical-fisher"  # squared gradients at the model's argmax labels
    HUTCHINSON_HESSIAN = "hutchinson-hessian"  # Rademacher probes, Hessian-vector products
    HUTCHINSON_GGN = "hutchinson-ggn"  # Rademacher probes, Gauss-Newton-vector products
    KFAC = "kfac"  # Kronecker factors A (inputs) x G (output gradients)
    LOWRANK = "lowrank"  # K-FAC with eigen-truncated (low-rank + diagonal) factors


class Whitening(str, Enum):
    """Metric the quantisation error is measured in."""

    POSTERIOR = "posterior"  # d^T Sigma^-1 d (the method)
    IDENTITY = "identity"  # plain squared error under the posterior (no whitening)
    PCA = "pca"  # data-only: layer-input second moments, no curvature


class Codebook(str, Enum):
    """Codebook of each candidate with at most 16 levels (8-bit candidates stay uniform min/max)."""

    UNIFORM = "uniform"  # uniform grid per group, range searched on the expected cost (default)
    UNIFORM_FIXED = "uniform-fixed"  # uniform grid per group, Gaussian-optimal range (no search)
    LLOYD = "lloyd"  # posterior-weighted Lloyd-Max LUT per allocation unit
    LLOYD_UNIFORM = "lloyd-uniform"  # Lloyd LUT compiled to a uniform grid per group (no LUT)
    MULAW = "mulaw"  # fixed mu-law companding table, one scale per group (control)
    VQ = "vq"  # vectors of vq_dim weights, one weighted k-means codebook per layer (tensor units)


class Objective(str, Enum):
    """What a loss-table entry scores."""

    DEPLOYED = "deployed"  # posterior-expected loss increase of deploying Q(mu): 0.5 (q - mu)^T C (q - mu)
    DRAWS = "draws"  # distortion of quantised posterior draws E_w[(Q(w) - w)^2 / sigma^2] (ablation)


class CostTerms(str, Enum):
    """Which precision terms weigh the deployed weights' error (``quant.objective: deployed``)."""

    DATA = "data"  # the data curvature C alone (the task's loss)
    DATA_PRIOR = "data-prior"  # C + lambda_l: the posterior precision (prior as a penalty)


class Rounding(str, Enum):
    """How weights are mapped to a fixed grid."""

    NEAREST = "nearest"
    ERROR_FEEDBACK = "error-feedback"  # sequential rounding in the data's input metric (GPTQ-style)


class AllocationUnit(str, Enum):
    """Granularity of one bit-width choice."""

    BLOCK = "block"  # unit_groups consecutive groups (default)
    GROUP = "group"  # one scale group
    CHANNEL = "channel"  # one output channel
    TENSOR = "tensor"  # one whole layer


class Target(str, Enum):
    """Where the quantised model runs, and so what its file stores (:mod:`bayesq.targets`)."""

    BAYESQ = "bayesq"  # BayesQ's packed .safetensors: every width, unit and codebook
    ONNXRUNTIME = "onnxruntime"  # an .onnx file of MatMulNBits nodes (widths 2 / 4 / 8, float32 scales)


class Allocator(str, Enum):
    """How bit-widths are chosen from the loss table."""

    GREEDY = "greedy"
    GREEDY_HW = "greedy-hw"  # greedy with hardware-aware near-tie breaking
    DP = "dp"  # exact dynamic programme (oracle)
    LAGRANGIAN = "lagrangian"  # budget regularisation: argmin L + lambda C, lambda bisected
    RANDOM = "random"  # control


class Proxy(str, Enum):
    """Source of the expected-loss table entries."""

    CLOSED = "closed"  # closed form under the diagonal posterior
    MC_KL = "mc-kl"  # Monte Carlo logit KL on the most sensitive layers (rescales their entries)
    MC_OUTPUT = "mc-output"  # Monte Carlo K-FAC layer-output error on the most sensitive layers


@dataclass(frozen=True)
class PosteriorConfig:
    """Label-free Laplace posterior: ``precision = N * mean_n C_n + lambda_l``.

    ``n_data`` is the one definition of the data size N that scales the mean per-example
    curvature, in the library and in the pipeline alike; 0 means "the calibration set"
    (``precision = sum_n C_n + lambda_l``). ``prior = fitted``: each layer's prior precision
    lambda_l maximises its Laplace marginal likelihood; ``fixed``: ``lambda_l = damping``.
    Variances ``1 / precision`` are clipped to ``[var_min, var_max]``. ``curvature_share``: the
    backward pass of the Fisher curvatures (``fisher``, ``empirical-fisher``) reads this share of
    the calibration batches, spread evenly, and its sum is scaled to all of them (the
    layer-input statistics still read every batch; the other curvatures read every batch).
    0.5 measured as good as 1.0 on both embedded models (``docs/findings.md``).
    """

    damping: float = setting(1e-2, above(0, "it is the prior precision"))
    n_data: int = setting(0, at_least(0, "0 = calibration set size"))
    prior: Prior = Prior.FITTED
    var_min: float = 1e-12
    var_max: float = 1e4
    label_samples: int = setting(1, at_least(1))
    curvature: Curvature = Curvature.FISHER
    probes: int = setting(16, at_least(1, "Rademacher probes per batch"))
    auto_damping: bool = False
    kfac_decay: float = setting(0.95, within("(0, 1]", what="EMA decay"))
    rank: int = setting(32, at_least(1))
    explained: float = setting(0.95, within("(0, 1]", what="explained trace fraction"))
    small_calibration: int = setting(50, at_least(0))
    curvature_share: float = setting(0.5, within("(0, 1]", what="share of the calibration batches"))

    def __post_init__(self) -> None:
        validate(self, "posterior", self._relations)

    def _relations(self) -> Iterator[Relation]:
        yield (0 < self.var_min < self.var_max, "posterior.var_min", self.var_min,
               f"need 0 < var_min < var_max = {self.var_max}")


UNIFORM_CODEBOOKS = (Codebook.UNIFORM, Codebook.UNIFORM_FIXED, Codebook.LLOYD_UNIFORM)  # codebooks on a uniform grid


def _known_codebook(name: Any) -> bool:
    """A built-in codebook or one whose fit is registered (:func:`bayesq.books.register_fit`)."""
    return name in Codebook._value2member_map_ or (isinstance(name, str) and name in FITS)


def _codebook(name: Any) -> Codebook | str:
    """The built-in :class:`Codebook` of ``name``, else the registered name itself."""
    return Codebook(name) if name in Codebook._value2member_map_ else str(name)


@dataclass(frozen=True)
class QuantConfig:
    """Grids, candidate bit-widths and allocation units.

    Weights of each Linear/Conv2d layer are flattened row-major (output channel first) and cut
    into groups of ``group_size`` consecutive weights; ``unit_groups`` consecutive groups form
    one allocation unit, which carries a bit-width header.
    """

    bits: tuple[int, ...] = setting(
        (2, 3, 4, 8),
        rule(lambda v: len(v) > 0 and all(1 <= b <= 8 for b in v), "need a non-empty list of bit-widths in 1..8"),
        ascending("[2, 3, 4, 8]"), convert=lambda v: tuple(int(b) for b in v))
    group_size: int = setting(64, at_least(1))
    unit_groups: int = setting(16, at_least(1))
    scale_bits: int = setting(16, one_of((16, 32), "scales are stored as fp16 (16) or fp32 (32)"))
    range_iters: int = setting(12, at_least(1))
    min_range_ratio: float = setting(0.2, within("(0, 1]"))
    range_grid: int = setting(20, integer(0, "0: golden section only"))
    objective: Objective = Objective.DEPLOYED
    cost_terms: CostTerms = CostTerms.DATA
    unit: AllocationUnit = AllocationUnit.BLOCK
    codebook: Codebook | str = setting(
        Codebook.UNIFORM,
        rule(_known_codebook, f"choose from {[c.value for c in Codebook]} or a codebook whose fit is registered "
                              "(bayesq.books.register_fit)"),
        convert=_codebook)
    whitening: Whitening = Whitening.POSTERIOR
    rounding: Rounding = Rounding.ERROR_FEEDBACK
    act_order: bool = True
    refit: bool = True
    feedback_table: bool = True
    feedback_search: bool = True
    cd_passes: int = setting(2, integer(0, "0: error-feedback codes as they are"))
    select_grids: bool = True
    bias_correction: bool = True
    output_offset: bool = True
    proxy: Proxy = Proxy.CLOSED
    mc_samples: int = setting(8, rule(lambda v: v >= 4 and v % 2 == 0, "need an even number >= 4 (antithetic pairs)"))
    mc_top_fraction: float = setting(0.1, within("(0, 1]"))
    mc_examples: int = setting(128, at_least(1))
    mulaw_mu: float = setting(4.0, at_least(0, "0 is the uniform limit"))
    lut_bits: int = setting(16, one_of((16, 32), "LUT entries are stored as fp16 (16) or fp32 (32)"))
    vq_dim: int = setting(2, one_of((2, 4, 8), "choose 2, 4 or 8 weights per vector"))
    target: Target = Target.BAYESQ

    def __post_init__(self) -> None:
        validate(self, "quant", self._relations)

    def _relations(self) -> Iterator[Relation]:
        uniform = self.codebook in UNIFORM_CODEBOOKS or self.codebook in UNIFORM_FITS
        name = getattr(self.codebook, "value", self.codebook)
        yield (self.rounding != Rounding.ERROR_FEEDBACK or uniform, "quant.rounding", self.rounding.value,
               f"error feedback needs uniform grids; codebook is '{name}': set quant.rounding: nearest")
        vq = self.codebook == Codebook.VQ
        yield (not vq or self.unit == AllocationUnit.TENSOR, "quant.codebook", "vq",
               "VQ keeps one codebook per layer: set quant.unit: tensor")
        yield (not vq or self.group_size % self.vq_dim == 0, "quant.group_size", self.group_size,
               f"VQ needs a multiple of vq_dim = {self.vq_dim}")
        if self.target == Target.ONNXRUNTIME:  # what MatMulNBits stores
            ort = ONNXRUNTIME
            yield (self.codebook == Codebook.UNIFORM, "quant.codebook", name,
                   "the onnxruntime target stores uniform grids: set quant.codebook: uniform")
            yield (set(self.bits) <= set(ort.widths), "quant.bits", list(self.bits),
                   f"the onnxruntime target runs widths {list(ort.widths)}")
            yield (self.group_size in ort.block_sizes, "quant.group_size", self.group_size,
                   f"the onnxruntime target's blocks are {list(ort.block_sizes)} weights")
            yield (self.unit.value in ort.units, "quant.unit", self.unit.value,
                   "the onnxruntime target holds one width per output row (quant.unit: channel) or per layer "
                   "(quant.unit: tensor)")
            yield (self.scale_bits == ort.scale_bits, "quant.scale_bits", self.scale_bits,
                   f"the onnxruntime file stores float{ort.scale_bits} scales")

    def for_target(self, target: "Target | str", block: int | None = None) -> "QuantConfig":
        """These settings inside what ``target`` runs (:mod:`bayesq.targets`): its widths (the
        ones it runs, of these; all of its own if none are), its block size (``block``, else the
        target's measured default, else the group size if the target takes it, else the nearest
        one it takes), its allocation unit (this one if the target holds it, else the target's) and
        scale width.

        Raises:
            ValueError: an unknown target (naming the ones there are), a block the target does not
                take, or settings the target cannot hold (another codebook).
        """
        t = spec(target)
        if t.name == Target.BAYESQ.value:
            return dataclasses.replace(self, target=Target.BAYESQ)
        bits = tuple(b for b in self.bits if b in t.widths) or t.widths
        if block is not None and block not in t.block_sizes:
            raise ValueError(f"block {block}: the {t.name} target takes blocks of {list(t.block_sizes)} weights")
        group = block or t.block or (self.group_size if self.group_size in t.block_sizes else min(
            t.block_sizes, key=lambda b: (abs(math.log2(b / self.group_size)), -b)))
        unit = self.unit if t.units is None or self.unit.value in t.units else AllocationUnit(t.unit)
        return dataclasses.replace(self, bits=bits, group_size=group, unit=unit,
                                   scale_bits=t.scale_bits, target=Target(t.name))

    @property
    def row_blocked(self) -> bool:
        """Whether the target stores blocks along each row (any target but BayesQ's format), so
        that a whole-layer unit's groups are row-aligned too (:meth:`bayesq.blocks.LayerBlocks.with_unit`)."""
        return self.target != Target.BAYESQ

    @property
    def feeds_back_table(self) -> bool:
        """Whether the table weighs the metric's columns by the error-feedback gains (the
        deployed objective of error-feedback rounding with ``feedback_table``)."""
        return (self.feedback_table and self.rounding == Rounding.ERROR_FEEDBACK
                and self.objective == Objective.DEPLOYED)

    @property
    def selects_grids(self) -> bool:
        """Whether :func:`bayesq.quantize.quantize_model` also builds a second encoding (its own
        table and allocation): with held-out selection inputs the other range search, else the
        min/max grids (no clipping search, no refit); the anchor (min/max, else the searched
        grids) is kept unless the other has a lower KL to the full-precision model by a resolved
        margin (:func:`bayesq.tables.grid_candidates`, :func:`bayesq.selection.encode_best`)."""
        return (self.select_grids and self.rounding == Rounding.ERROR_FEEDBACK
                and self.codebook == Codebook.UNIFORM and self.min_range_ratio < 1)

    @property
    def needs_data(self) -> bool:
        """Whether the loss table reads calibration inputs (pca metric, error-feedback gains
        under a diagonal posterior, Monte Carlo proxy)."""
        return self.whitening == Whitening.PCA or self.proxy != Proxy.CLOSED or self.feeds_back_table


@dataclass(frozen=True)
class AllocationConfig:
    """How bit-widths are chosen from the loss table.

    Attributes:
        allocator: greedy (default), greedy-hw (near-ties within ``hw_tolerance`` broken for
            fewer distinct bit-widths per layer), dp (exact), lagrangian, random (control).
        penalty: budget regularisation lambda >= 0: minimise
            ``(L - L_min) / (L_floor - L_min) + lambda * avg_bits`` under the budget (L_floor:
            every unit at its cheapest candidate, L_min: at its least-loss one), i.e. stop
            upgrading once an upgrade's normalised loss drop per average bit falls below lambda
            (0: spend the whole budget).
        floors: per-stage bit floors, ``{layer-name glob: minimum bits}`` (fnmatch patterns,
            e.g. ``{"classifier*": 4}``); a layer matching several takes the largest.
        latency: rank upgrades by loss drop per predicted kernel time instead of per bit
            (latency-aware density; the budget still counts storage bits).
        unaligned_penalty: kernel-time model of the latency density: a weight at a bit-width
            that does not divide 32 (3 bits) costs ``1 + unaligned_penalty`` times its bits.
    """


    allocator: Allocator = Allocator.GREEDY
    hw_tolerance: float = setting(0.01, within("[0, 1)"))
    penalty: float = setting(0.0, finite(0))
    floors: Mapping[str, int] = field(default_factory=dict, metadata=checks(
        rule(lambda v: isinstance(v, Mapping) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                                      for b in v.values()),
             "need a mapping {layer-name glob: minimum bits >= 1}"),
        convert=dict))
    latency: bool = False
    unaligned_penalty: float = setting(0.25, finite(0))

    def __post_init__(self) -> None:
        validate(self, "allocation", self._relations)

    def _relations(self) -> Iterator[Relation]:
        yield (not self.penalty or self.allocator != Allocator.RANDOM, "allocation.penalty", self.penalty,
               "the random control does not read losses; use 0")
        yield (not self.latency or self.allocator == Allocator.GREEDY, "allocation.latency", True,
               f"latency-aware density works with allocator greedy, not '{self.allocator.value}'")


@dataclass(frozen=True)
class DistillConfig:
    """Calibration-only distillation of scales / zero-points / LUT entries (``distill``).

    Teacher: mean of ``softmax(f(x; w_m) / temperature)`` over ``samples`` posterior draws,
    tempered until they agree with the mean model on ``agreement`` of the calibration inputs
    (:mod:`bayesq.distill`); AdamW with learning rate ``lr`` for ``steps`` steps. ``lr`` and
    ``agreement`` are what measured best (``benchmarks/distill_step.py``, docs/findings.md): AdamW
    moves each scale by about ``lr`` in its own units, and 1e-4 wrecked the scales of both embedded
    models; at 0.95 agreement the tempered teacher was farther from the FP model than the quantised
    model is, so the fit moved away from it. Applied when the budget is at most ``max_budget``: 0 by
    default (off). With these settings and the output offset the held-out check accepts it on both
    embedded models and the test KL falls by 0.9 % (lite0) and 6.2 % (MiniLM) at 100 steps, by 0.2 %
    (not resolved) and 9.9 % at 500, multiplying BayesQ's one-time cost by 2-3 and 4-10
    (docs/findings.md, 2026-12-02): too little for the default, whose one-time cost is GPTQ's;
    ``max_budget=3.5`` (the pipeline's ``bayesq-distill`` row, ``bayesq quantize --distill``)
    buys it. The calibration inputs are split
    by the seed: ``holdout`` of them are held out of the fit, and the distilled parameters are
    kept only if they lower the mean KL(p_FP || p_quantised) on the held-out inputs (``accept``;
    false: always kept, an ablation).
    """

    max_budget: float = setting(0.0, at_least(0, "0: never distil"))
    samples: int = setting(8, integer(1))
    temperature: float = setting(2.0, above(0))
    steps: int = setting(500, integer(1))
    lr: float = setting(1e-6, above(0))
    train_bias: bool = False
    agreement: float = setting(1.0, within("(0, 1]", "share of calibration inputs"))
    holdout: float = setting(0.25, within("(0, 1)", "share of calibration inputs held out of the fit"))
    accept: bool = True

    def __post_init__(self) -> None:
        validate(self, "distill")

    def applies(self, budget: float) -> bool:
        """Whether a model quantised at ``budget`` average bits is distilled."""
        return budget <= self.max_budget


@dataclass(frozen=True)
class BayesQConfig:
    """Everything :func:`bayesq.quantize_model` needs besides the model and calibration data;
    ``progress``: a bar over each step (the curvature pass, the tables, the encodings, the
    selection) unless ``quantize_model`` is told otherwise."""

    budget: float = setting(3.0, above(0, what="average bits per weight"))
    posterior: PosteriorConfig = field(default_factory=PosteriorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "config", self._relations)

    def _relations(self) -> Iterator[Relation]:
        yield (self.quant.proxy != Proxy.MC_OUTPUT or self.posterior.curvature in (Curvature.KFAC, Curvature.LOWRANK),
               "quant.proxy", "mc-output",
               "the layer-output proxy needs K-FAC factors: set posterior.curvature: kfac or lowrank")


