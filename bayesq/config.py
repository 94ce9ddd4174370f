"""Configuration: one frozen dataclass per ``params.yaml`` section, validated on construction.

Every error names the offending field and value, and unknown keys (typos in ``params.yaml``)
are rejected with the closest valid key, so a misspelled setting never silently falls back
to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Mapping


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


class SelectionInputs(str, Enum):
    """Which inputs score the choices among candidates fitted on the calibration inputs (BayesQ's
    grids, GPTQ's / AWQ's variants)."""

    HELD_OUT = "held-out"  # another draw of training inputs, disjoint from the calibration draw
    CALIBRATION = "calibration"  # the calibration inputs themselves (ablation)


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


class Method(str, Enum):
    """Quantization methods the pipeline knows."""

    BAYESQ = "bayesq"
    BAYESQ_EF = "bayesq-ef"  # K-FAC posterior (error feedback in its input factor)
    BAYESQ_DISTILL = "bayesq-distill"  # BayesQ + posterior-predictive distillation (budget <= distill.max_budget)
    BAYESQ_PAPER = "bayesq-paper"  # the paper-literal configuration: fixed prior, draws objective, nearest rounding
    RTN_TENSOR = "rtn-tensor"
    RTN_CHANNEL = "rtn-channel"
    RTN_GROUP = "rtn-group"
    GPTQ = "gptq"
    AWQ = "awq"
    HAWQ = "hawq"
    ACIQ = "aciq"


def _fail(section: str, name: str, value: Any, why: str) -> None:
    raise ValueError(f"{section}.{name} = {value!r}: {why}")


def _enum(cfg: Any, section: str, name: str, enum: type[Enum]) -> None:
    """Coerce field ``name`` of frozen ``cfg`` to ``enum`` or fail naming the choices."""
    try:
        object.__setattr__(cfg, name, enum(getattr(cfg, name)))
    except ValueError:
        _fail(section, name, getattr(cfg, name), f"choose from {[e.value for e in enum]}")


@dataclass(frozen=True)
class PosteriorConfig:
    """Label-free Laplace posterior: ``precision = N * mean_n C_n + lambda_l``.

    ``n_data`` is the one definition of the data size N that scales the mean per-example
    curvature, in the library and in the pipeline alike; 0 means "the calibration set"
    (``precision = sum_n C_n + lambda_l``). ``prior = fitted``: each layer's prior precision
    lambda_l maximises its Laplace marginal likelihood; ``fixed``: ``lambda_l = damping``.
    Variances ``1 / precision`` are clipped to ``[var_min, var_max]``.
    """

    damping: float = 1e-2
    n_data: int = 0
    prior: Prior = Prior.FITTED
    var_min: float = 1e-12
    var_max: float = 1e4
    label_samples: int = 1
    curvature: Curvature = Curvature.FISHER
    probes: int = 16
    auto_damping: bool = False
    kfac_decay: float = 0.95
    rank: int = 32
    explained: float = 0.95
    small_calibration: int = 50

    def __post_init__(self) -> None:
        s = "posterior"
        _enum(self, s, "curvature", Curvature)
        _enum(self, s, "prior", Prior)
        if self.probes < 1:
            _fail(s, "probes", self.probes, "must be >= 1 (Rademacher probes per batch)")
        if not 0 < self.kfac_decay <= 1:
            _fail(s, "kfac_decay", self.kfac_decay, "EMA decay must be in (0, 1]")
        if self.rank < 1:
            _fail(s, "rank", self.rank, "must be >= 1")
        if not 0 < self.explained <= 1:
            _fail(s, "explained", self.explained, "explained trace fraction must be in (0, 1]")
        if self.small_calibration < 0:
            _fail(s, "small_calibration", self.small_calibration, "must be >= 0")
        if not self.damping > 0:
            _fail(s, "damping", self.damping, "must be > 0 (it is the prior precision)")
        if self.n_data < 0:
            _fail(s, "n_data", self.n_data, "must be >= 0 (0 = calibration set size)")
        if not 0 < self.var_min < self.var_max:
            _fail(s, "var_min", self.var_min, f"need 0 < var_min < var_max = {self.var_max}")
        if self.label_samples < 1:
            _fail(s, "label_samples", self.label_samples, "must be >= 1")


@dataclass(frozen=True)
class QuantConfig:
    """Grids, candidate bit-widths and allocation units.

    Weights of each Linear/Conv2d layer are flattened row-major (output channel first) and cut
    into groups of ``group_size`` consecutive weights; ``unit_groups`` consecutive groups form
    one allocation unit, which carries a bit-width header.
    """

    bits: tuple[int, ...] = (2, 3, 4, 8)
    group_size: int = 64
    unit_groups: int = 16
    scale_bits: int = 16
    range_iters: int = 12
    min_range_ratio: float = 0.2
    range_grid: int = 20
    objective: Objective = Objective.DEPLOYED
    cost_terms: CostTerms = CostTerms.DATA
    unit: AllocationUnit = AllocationUnit.BLOCK
    codebook: Codebook = Codebook.UNIFORM
    whitening: Whitening = Whitening.POSTERIOR
    rounding: Rounding = Rounding.ERROR_FEEDBACK
    act_order: bool = True
    refit: bool = True
    feedback_table: bool = True
    feedback_search: bool = True
    cd_passes: int = 2
    select_grids: bool = True
    bias_correction: bool = True
    proxy: Proxy = Proxy.CLOSED
    mc_samples: int = 8
    mc_top_fraction: float = 0.1
    mc_examples: int = 128
    mulaw_mu: float = 4.0
    lut_bits: int = 16
    vq_dim: int = 2

    def __post_init__(self) -> None:
        s = "quant"
        for name, enum in (("unit", AllocationUnit), ("codebook", Codebook), ("whitening", Whitening),
                           ("rounding", Rounding), ("proxy", Proxy), ("objective", Objective),
                           ("cost_terms", CostTerms)):
            _enum(self, s, name, enum)
        if self.mc_samples < 4 or self.mc_samples % 2:
            _fail(s, "mc_samples", self.mc_samples, "need an even number >= 4 (antithetic pairs)")
        uniform = (Codebook.UNIFORM, Codebook.UNIFORM_FIXED, Codebook.LLOYD_UNIFORM)
        if self.rounding == Rounding.ERROR_FEEDBACK and self.codebook not in uniform:
            _fail(s, "rounding", self.rounding.value,
                  f"error feedback needs uniform grids; codebook is '{self.codebook.value}': set quant.rounding: nearest")
        if self.codebook == Codebook.VQ and self.unit != AllocationUnit.TENSOR:
            _fail(s, "codebook", "vq", "VQ keeps one codebook per layer: set quant.unit: tensor")
        if self.vq_dim not in (2, 4, 8):
            _fail(s, "vq_dim", self.vq_dim, "choose 2, 4 or 8 weights per vector")
        if self.codebook == Codebook.VQ and self.group_size % self.vq_dim:
            _fail(s, "group_size", self.group_size, f"VQ needs a multiple of vq_dim = {self.vq_dim}")
        if self.lut_bits not in (16, 32):
            _fail(s, "lut_bits", self.lut_bits, "LUT entries are stored as fp16 (16) or fp32 (32)")
        if not self.mulaw_mu >= 0:
            _fail(s, "mulaw_mu", self.mulaw_mu, "must be >= 0 (0 is the uniform limit)")
        if self.mc_examples < 1:
            _fail(s, "mc_examples", self.mc_examples, "must be >= 1")
        if not 0 < self.mc_top_fraction <= 1:
            _fail(s, "mc_top_fraction", self.mc_top_fraction, "must be in (0, 1]")
        object.__setattr__(self, "bits", tuple(int(b) for b in self.bits))
        if not self.bits or any(not 1 <= b <= 8 for b in self.bits):
            _fail(s, "bits", self.bits, "need a non-empty list of bit-widths in 1..8")
        if list(self.bits) != sorted(set(self.bits)):
            _fail(s, "bits", self.bits, "must be strictly ascending, e.g. [2, 3, 4, 8]")
        if self.group_size < 1:
            _fail(s, "group_size", self.group_size, "must be >= 1")
        if self.unit_groups < 1:
            _fail(s, "unit_groups", self.unit_groups, "must be >= 1")
        if self.scale_bits not in (16, 32):
            _fail(s, "scale_bits", self.scale_bits, "scales are stored as fp16 (16) or fp32 (32)")
        if self.range_iters < 1:
            _fail(s, "range_iters", self.range_iters, "must be >= 1")
        if isinstance(self.range_grid, bool) or not isinstance(self.range_grid, int) or self.range_grid < 0:
            _fail(s, "range_grid", self.range_grid, "must be an integer >= 0 (0: golden section only)")
        if not 0 < self.min_range_ratio <= 1:
            _fail(s, "min_range_ratio", self.min_range_ratio, "must be in (0, 1]")
        if isinstance(self.cd_passes, bool) or not isinstance(self.cd_passes, int) or self.cd_passes < 0:
            _fail(s, "cd_passes", self.cd_passes, "must be an integer >= 0 (0: error-feedback codes as they are)")
        for name in ("act_order", "refit", "feedback_table", "feedback_search", "select_grids", "bias_correction"):
            if not isinstance(getattr(self, name), bool):
                _fail(s, name, getattr(self, name), "must be true or false")


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
        margin (:func:`bayesq.quantize.grid_candidates`, :func:`bayesq.quantize.encode_best`)."""
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
    hw_tolerance: float = 0.01
    penalty: float = 0.0
    floors: Mapping[str, int] = field(default_factory=dict)
    latency: bool = False
    unaligned_penalty: float = 0.25

    def __post_init__(self) -> None:
        s = "allocation"
        _enum(self, s, "allocator", Allocator)
        if not 0 <= self.hw_tolerance < 1:
            _fail(s, "hw_tolerance", self.hw_tolerance, "must be in [0, 1)")
        if not 0 <= self.penalty < float("inf"):
            _fail(s, "penalty", self.penalty, "must be a finite number >= 0")
        if self.penalty and self.allocator == Allocator.RANDOM:
            _fail(s, "penalty", self.penalty, "the random control does not read losses; use 0")
        if not isinstance(self.floors, Mapping) or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in self.floors.values()):
            _fail(s, "floors", self.floors, "need a mapping {layer-name glob: minimum bits >= 1}")
        object.__setattr__(self, "floors", dict(self.floors))
        if not 0 <= self.unaligned_penalty < float("inf"):
            _fail(s, "unaligned_penalty", self.unaligned_penalty, "must be a finite number >= 0")
        if self.latency and self.allocator != Allocator.GREEDY:
            _fail(s, "latency", True, f"latency-aware density works with allocator greedy, not '{self.allocator.value}'")


@dataclass(frozen=True)
class DistillConfig:
    """Calibration-only distillation of scales / zero-points / LUT entries (``distill``).

    Teacher: mean of ``softmax(f(x; w_m) / temperature)`` over ``samples`` posterior draws,
    tempered until they agree with the mean model on ``agreement`` of the calibration inputs
    (:mod:`bayesq.distill`); AdamW with learning rate ``lr`` for ``steps`` steps. Applied when
    the budget is at most ``max_budget`` (0 switches it off). The calibration inputs are split
    by the seed: ``holdout`` of them are held out of the fit, and the distilled parameters are
    kept only if they lower the mean KL(p_FP || p_quantised) on the held-out inputs (``accept``;
    false: always kept, an ablation).
    """

    max_budget: float = 3.5
    samples: int = 8
    temperature: float = 2.0
    steps: int = 500
    lr: float = 1e-4
    train_bias: bool = False
    agreement: float = 0.95
    holdout: float = 0.25
    accept: bool = True

    def __post_init__(self) -> None:
        s = "distill"
        if not self.max_budget >= 0:
            _fail(s, "max_budget", self.max_budget, "must be >= 0 (0: never distil)")
        for name in ("samples", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(s, name, v, "must be an integer >= 1")
        for name in ("temperature", "lr"):
            if not getattr(self, name) > 0:
                _fail(s, name, getattr(self, name), "must be > 0")
        if not isinstance(self.train_bias, bool):
            _fail(s, "train_bias", self.train_bias, "must be true or false")
        if not 0 < self.agreement <= 1:
            _fail(s, "agreement", self.agreement, "must be in (0, 1] (share of calibration inputs)")
        h = self.holdout
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < 1:
            _fail(s, "holdout", h, "must be in (0, 1) (share of calibration inputs held out of the fit)")
        if not isinstance(self.accept, bool):
            _fail(s, "accept", self.accept, "must be true or false")

    def applies(self, budget: float) -> bool:
        """Whether a model quantised at ``budget`` average bits is distilled."""
        return budget <= self.max_budget


@dataclass(frozen=True)
class BayesQConfig:
    """Everything :func:`bayesq.quantize_model` needs besides the model and calibration data."""

    budget: float = 3.0
    posterior: PosteriorConfig = field(default_factory=PosteriorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.budget > 0:
            _fail("config", "budget", self.budget, "average bits per weight must be > 0")
        structured = (Curvature.KFAC, Curvature.LOWRANK)
        if self.quant.proxy == Proxy.MC_OUTPUT and self.posterior.curvature not in structured:
            _fail("quant", "proxy", "mc-output",
                  "the layer-output proxy needs K-FAC factors: set posterior.curvature: kfac or lowrank")


@dataclass(frozen=True)
class DataConfig:
    """Sizes of the embedded data sets (the default profile keeps a cold run short)."""

    image_size: int = 64
    image_train_subset: int = 12000
    image_test_subset: int = 2000
    text_max_length: int = 64
    text_test_fraction: float = 0.2
    text_train_subset: int = 3000
    text_test_subset: int = 1000
    split_seed: int = 0

    def __post_init__(self) -> None:
        s = "data"
        if self.image_size < 32:
            _fail(s, "image_size", self.image_size, "must be >= 32 for EfficientNet-Lite0")
        for name in ("image_train_subset", "image_test_subset", "text_train_subset",
                     "text_test_subset", "text_max_length"):
            if getattr(self, name) < 1:
                _fail(s, name, getattr(self, name), "must be >= 1")
        if not 0 < self.text_test_fraction < 1:
            _fail(s, "text_test_fraction", self.text_test_fraction, "must be in (0, 1)")


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning of the embedded models (a cached pipeline step).

    ``threads``: torch intra-op threads during fine-tuning. Float32 reductions split over threads
    sum in a thread-dependent order, and AdamW turns those last-bit differences into different
    weights, so the fine-tuned model depends on the thread count; a fixed count makes it the same
    on machines with another number of cores (0: torch's default, the machine's core count).

    ``frozen_backbone``: models whose pretrained backbone stays as shipped; only their new head is
    trained, for ``head_epochs`` epochs on the backbone's features (computed once, eval mode).
    Training every weight of a convolutional net amplifies the CPU kernels' last-bit rounding
    into a different model on another CPU; a head on fixed features is the same model there.

    ``length_groups``: for inputs of varying length (sentences), each epoch's shuffled order is
    cut into chunks of this many mini-batches, each chunk sorted by length before it is cut into
    mini-batches, and the mini-batches are then shuffled (Hugging Face's ``group_by_length``):
    batches padded to their longest member then carry little padding. 0: plain shuffled batches.
    """

    epochs: int = 1
    scratch_epochs: int = 3  # models trained from random initialisation (resnet18-fmnist)
    batch_size: int = 64
    lr_image: float = 1e-3
    lr_text: float = 5e-5
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2
    frozen_backbone: tuple[str, ...] = ()
    head_epochs: int = 3
    length_groups: int = 50

    def __post_init__(self) -> None:
        s = "finetune"
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            _fail(s, "threads", self.threads, "must be an integer >= 0 (0: torch's default)")
        if isinstance(self.length_groups, bool) or not isinstance(self.length_groups, int) or self.length_groups < 0:
            _fail(s, "length_groups", self.length_groups, "must be an integer >= 0 (0: no grouping by length)")
        if isinstance(self.frozen_backbone, str) or not all(isinstance(m, str) for m in self.frozen_backbone):
            _fail(s, "frozen_backbone", self.frozen_backbone, "must be a list of model names, e.g. [lite0-fmnist]")
        object.__setattr__(self, "frozen_backbone", tuple(self.frozen_backbone))
        for name in ("epochs", "scratch_epochs", "head_epochs"):
            if getattr(self, name) < 1:
                _fail(s, name, getattr(self, name), "must be >= 1")
        if self.batch_size < 1:
            _fail(s, "batch_size", self.batch_size, "must be >= 1")
        for name in ("lr_image", "lr_text"):
            if not getattr(self, name) > 0:
                _fail(s, name, getattr(self, name), "must be > 0")


@dataclass(frozen=True)
class CalibrationConfig:
    """Unlabelled calibration set sizes (labels are never used), batch size, and the inputs
    that score selections among fitted candidates (``selection``: ``held-out``, a second draw of
    ``selection_images`` / ``selection_sentences`` training inputs disjoint from the calibration
    draw; or the calibration inputs).

    The Laplace data size N is ``posterior.n_data`` (one definition for the library and the
    pipeline); the key ``fisher_scale`` that set it here before is rejected with that hint.
    """

    images: int = 500
    sentences: int = 1000
    batch_size: int = 32
    selection: SelectionInputs = SelectionInputs.HELD_OUT
    selection_images: int = 2000
    selection_sentences: int = 2000

    def __post_init__(self) -> None:
        s = "calibration"
        for name in ("images", "sentences", "batch_size", "selection_images", "selection_sentences"):
            if getattr(self, name) < 1:
                _fail(s, name, getattr(self, name), "must be >= 1")
        _enum(self, s, "selection", SelectionInputs)


_REMOVED = {  # keys of earlier versions: section -> {key: what to do instead}
    "calibration": {"fisher_scale": "the Laplace data size N is posterior.n_data alone "
                                    "(0 = the calibration set size); delete this key"},
}


def from_mapping(cls: type, data: Mapping[str, Any] | None, section: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with a suggestion.

    Raises:
        ValueError: ``"<section>: unknown key 'x' (did you mean 'y'?) ..."``.
    """
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}
    for key, hint in _REMOVED.get(section, {}).items():
        if key in data:
            raise ValueError(f"{section}.{key} was removed: {hint}")
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"{section}: unknown key '{key}'{hint}; valid keys: {', '.join(sorted(known))}"
            )
    kwargs = {}
    for key, value in data.items():
        default = known[key].default
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # wrong value type inside a dataclass
        raise ValueError(f"{section}: {err}") from err


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` re-exported so callers need not import dataclasses."""
    return dataclasses.replace(cfg, **changes)


@dataclass(frozen=True)
class BaselinesConfig:
    """Settings of the baselines that have their own knobs (``baselines`` in params.yaml).

    ``select``: GPTQ and AWQ are the variant with the least calibration KL among their own mixed
    rule, uniform bit-widths at the smallest group size of ``group_sizes`` (then per-channel)
    that fits the budget, and (GPTQ) a supplied allocation (:mod:`bayesq.baselines.select`);
    false: their own mixed rule only (an ablation). ``bias_correction`` (with ``select``): each
    variant is also offered with BayesQ's bias correction (``<variant>+bc``), so the baselines
    get every free improvement BayesQ's default uses.
    """

    gptq_damp: float = 0.01  # dampening, fraction of mean(diag H)
    gptq_act_order: bool = True  # columns by decreasing diag(H)
    awq_grid: int = 20  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    hawq_probes: int = 2  # Rademacher probes per calibration batch for the Hessian traces
    select: bool = True  # GPTQ / AWQ: best budget-feasible variant on the calibration KL
    group_sizes: tuple[int, ...] = (32, 64, 128, 256)  # uniform variants' group sizes (per-channel last)
    bias_correction: bool = True  # GPTQ / AWQ selection: each variant also with bias correction

    def __post_init__(self) -> None:
        s = "baselines"
        if not 0 < self.gptq_damp < 1:
            _fail(s, "gptq_damp", self.gptq_damp, "must be in (0, 1) (GPTQ uses 0.01)")
        for name in ("gptq_act_order", "select", "bias_correction"):
            if not isinstance(getattr(self, name), bool):
                _fail(s, name, getattr(self, name), "must be true or false")
        for name in ("awq_grid", "hawq_probes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(s, name, v, "must be an integer >= 1")
        g = self.group_sizes
        if (not isinstance(g, (tuple, list)) or not g
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in g)):
            _fail(s, "group_sizes", g, "need a non-empty list of integer group sizes >= 1, e.g. [32, 64, 128, 256]")
        if list(g) != sorted(set(g)):
            _fail(s, "group_sizes", g, "must be strictly ascending, e.g. [32, 64, 128, 256]")
        object.__setattr__(self, "group_sizes", tuple(g))


@dataclass(frozen=True)
class RobustnessConfig:
    """Calibration and out-of-domain evaluation (``robustness`` in params.yaml).

    Every (method, budget) row gets accuracy, ECE / MCE (``ece_bins`` equal-width bins, and
    ``random_bin_repeats`` sets of random bin edges), worst-k% accuracy and CVaR on the test
    split; rows of ``methods`` at ``budgets`` (plus the FP model) are also evaluated on
    ``corruptions`` x ``severities`` of the first ``corruption_examples`` test images, and text
    models on the ``text_domains`` of the sentiment archive (``domain_examples`` each).
    """

    ece_bins: int = 15
    random_bin_repeats: int = 20
    budgets: tuple[float, ...] = (3.0,)
    methods: tuple[Method, ...] = (Method.BAYESQ, Method.BAYESQ_DISTILL, Method.BAYESQ_EF, Method.GPTQ,
                                   Method.AWQ, Method.RTN_GROUP)
    corruptions: tuple[str, ...] = ("gaussian_noise", "shot_noise", "impulse_noise", "gaussian_blur",
                                    "defocus_blur", "fog", "brightness", "contrast", "pixelate",
                                    "jpeg_compression")
    severities: tuple[int, ...] = (1, 2, 3, 4, 5)
    corruption_examples: int = 500
    text_domains: tuple[str, ...] = ("tweets", "amazon", "nyt")
    domain_examples: int = 1000

    def __post_init__(self) -> None:
        from bayesq.corruptions import CORRUPTIONS
        from bayesq.data.sentiment import DOMAIN_FILES

        s = "robustness"
        for name in ("ece_bins", "random_bin_repeats", "corruption_examples", "domain_examples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(s, name, v, "must be an integer >= 1")
        object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        try:
            object.__setattr__(self, "methods", tuple(Method(m) for m in self.methods))
        except ValueError:
            _fail(s, "methods", self.methods, f"choose from {[m.value for m in Method]}")
        for name, valid in (("corruptions", CORRUPTIONS), ("text_domains", tuple(d for d in DOMAIN_FILES if d != "movie"))):
            bad = [v for v in getattr(self, name) if v not in valid]
            if bad:
                _fail(s, name, bad, f"choose from {list(valid)}")
        if any(isinstance(v, bool) or not (isinstance(v, int) and 1 <= v <= 5) for v in self.severities):
            _fail(s, "severities", self.severities, "severities are integers 1..5")


@dataclass(frozen=True)
class Params:
    """The whole of ``params.yaml`` after the selected profile's overrides are applied."""

    profile: str = "quick"
    models: tuple[str, ...] = ("lite0-fmnist", "minilm-sentiment")
    seeds: tuple[int, ...] = (17,)
    budgets: tuple[float, ...] = (3.0, 3.5, 4.0)
    methods: tuple[Method, ...] = tuple(Method)
    data: DataConfig = field(default_factory=DataConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    posterior: PosteriorConfig = field(default_factory=PosteriorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    robustness: RobustnessConfig = field(default_factory=RobustnessConfig)
    ablations: AblationConfig = field(default_factory=lambda: AblationConfig())

    def __post_init__(self) -> None:
        if not self.models:
            _fail("params", "models", self.models, "list at least one model")
        if not self.seeds:
            _fail("params", "seeds", self.seeds, "list at least one seed")
        if not self.budgets or any(not b > 0 for b in self.budgets):
            _fail("params", "budgets", self.budgets, "list positive average bit budgets")
        try:
            object.__setattr__(self, "methods", tuple(Method(m) for m in self.methods))
        except ValueError:
            _fail("params", "methods", self.methods, f"choose from {[m.value for m in Method]}")
        self.bayesq(self.budgets[0], self.seeds[0])  # cross-section checks (e.g. rounding vs curvature)

    def bayesq(self, budget: float, seed: int) -> BayesQConfig:
        return BayesQConfig(budget=budget, posterior=self.posterior, quant=self.quant,
                            allocation=self.allocation, distill=self.distill, seed=seed)


MAX_ROW_LABEL = 60  # an ablation row's label: nested 18 columns deep in dvc.lock, wrapped past column 80


@dataclass(frozen=True)
class AblationConfig:
    """Ablation grid: ``rows[group][label]`` maps dotted keys (``quant.codebook``) to values.

    Each row is BayesQ with the main parameters overridden by its mapping; rows are validated
    by :func:`ablation_params`, so a typo in a key or value fails on load.
    """

    models: tuple[str, ...] = ()
    budgets: tuple[float, ...] = (3.0, 3.5)
    rows: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        if any(not b > 0 for b in self.budgets):
            _fail("ablations", "budgets", self.budgets, "list positive average bit budgets")
        for group, rows in self.rows.items():
            if not isinstance(rows, Mapping) or not rows:
                _fail("ablations.rows", group, rows, "map row labels to {dotted.key: value}")
            for label, over in rows.items():
                if not isinstance(over, Mapping):
                    _fail(f"ablations.rows.{group}", label, over, "need a mapping {dotted.key: value}")
                if len(str(label)) > MAX_ROW_LABEL:
                    _fail(f"ablations.rows.{group}", label, over,
                          f"row labels are at most {MAX_ROW_LABEL} characters: DVC copies params.yaml into "
                          "dvc.lock with an 80-column YAML writer that breaks a longer key across lines, and then "
                          "cannot read its own lock; shorten the label")


_SECTIONS = {
    "data": DataConfig, "finetune": FinetuneConfig, "calibration": CalibrationConfig,
    "posterior": PosteriorConfig, "quant": QuantConfig, "allocation": AllocationConfig,
    "baselines": BaselinesConfig, "distill": DistillConfig, "robustness": RobustnessConfig,
    "ablations": AblationConfig,
}
_LISTS = ("models", "seeds", "budgets", "methods")


def _merge(base: dict, over: Mapping[str, Any], where: str) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def load_params(raw: Mapping[str, Any]) -> Params:
    """Validate a parsed ``params.yaml`` and apply ``profiles[profile]`` on top of it.

    Raises:
        ValueError: unknown top-level or section key (with a suggestion), unknown profile, or
            an invalid value (naming ``section.field``).
    """
    raw = dict(raw)
    profiles = raw.pop("profiles", {}) or {}
    profile = raw.get("profile", "quick")
    if profile not in profiles and profiles:
        raise ValueError(f"profile = {profile!r}: unknown profile; defined: {', '.join(profiles)}")
    merged = _merge(raw, profiles.get(profile, {}) or {}, f"profiles.{profile}")
    top = {"profile", *_LISTS, *_SECTIONS}
    for key in merged:
        if key not in top:
            close = difflib.get_close_matches(key, list(top), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"params: unknown key '{key}'{hint}; valid keys: {', '.join(sorted(top))}")
    kwargs: dict[str, Any] = {k: tuple(merged[k]) for k in _LISTS if k in merged}
    kwargs["profile"] = profile
    for name, cls in _SECTIONS.items():
        kwargs[name] = from_mapping(cls, merged.get(name), name)
    return Params(**kwargs)


def ablation_params(params: Params, overrides: Mapping[str, Any], where: str = "ablation") -> Params:
    """``params`` with dotted ``section.key`` overrides applied and validated.

    Raises:
        ValueError: unknown section or key (with a suggestion) or an invalid value, naming
            ``where`` (the ablation row) and the key.
    """
    changes: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        section, _, key = str(dotted).partition(".")
        if section not in _SECTIONS or section == "ablations" or not key:
            close = difflib.get_close_matches(section, [k for k in _SECTIONS if k != "ablations"], n=1)
            hint = f" (did you mean '{close[0]}.{key}'?)" if close else ""
            raise ValueError(f"{where}: '{dotted}' is not a 'section.key' of params.yaml{hint}")
        changes.setdefault(section, {})[key] = value
    kwargs = {}
    for section, over in changes.items():
        base = {f.name: getattr(getattr(params, section), f.name) for f in fields(_SECTIONS[section])}
        try:
            kwargs[section] = from_mapping(_SECTIONS[section], {**base, **over}, section)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return dataclasses.replace(params, **kwargs)
