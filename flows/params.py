"""The pipeline's parameter schema: the whole of ``params.yaml`` (profiles, the embedded models'
data and fine-tuning, calibration, the method sections, baselines, robustness, ablations, the
modules each model keeps in floating point).

The method sections (``posterior``, ``quant``, ``allocation``, ``distill``) are the library's
configs (:mod:`bayesq.config`), ``data`` and ``finetune`` the embedded models' harness settings
(:mod:`bayesq.harness.models.config`); the sections only the pipeline reads are defined here, validated
the same declarative way (:func:`bayesq.settings.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

import yaml

from bayesq.baselines.ort import Peer
from bayesq.config import AllocationConfig, BayesQConfig, DistillConfig, PosteriorConfig, QuantConfig
from bayesq.harness.corruptions import CORRUPTIONS
from bayesq.harness.data.files import DataSource
from bayesq.harness.data.sentiment import DOMAIN_FILES
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import get_entry, known_models
from bayesq.settings import (
    Relation, above, ascending, at_least, checks, each_of, from_mapping, integer, one_of, rule, setting, validate,
    within,
)


class Method(str, Enum):
    """Quantization methods the pipeline knows."""

    BAYESQ = "bayesq"
    BAYESQ_EF = "bayesq-ef"  # K-FAC posterior (error feedback in its input factor)
    BAYESQ_DISTILL = "bayesq-distill"  # BayesQ + posterior-predictive distillation (budget <= distill.max_budget)
    BAYESQ_PAPER = "bayesq-paper"  # the paper-literal configuration: fixed prior, draws objective, nearest rounding
    BAYESQ_BRECQ = "bayesq-brecq"  # BayesQ's encoding rounded again by BRECQ's block reconstruction, no bias correction
    RTN_TENSOR = "rtn-tensor"
    RTN_CHANNEL = "rtn-channel"
    RTN_GROUP = "rtn-group"
    GPTQ = "gptq"
    AWQ = "awq"
    HAWQ = "hawq"
    ZEROQ = "zeroq"  # ZeroQ: per-layer widths from the KL on data distilled from BatchNorm statistics (data-free)
    ACIQ = "aciq"
    ADAROUND = "adaround"  # AdaRound's learned up/down rounding on GPTQ's grids and variants
    BRECQ = "brecq"  # BRECQ: AdaRound's rounding learned per residual block / transformer layer on GPTQ's grids
    LSQ = "lsq"  # LSQ's learned step sizes on GPTQ's grids and variants, nearest rounding
    LSQ_PLUS = "lsq-plus"  # LSQ+: learned step sizes and offsets (zero-points)
    PACT = "pact"  # PACT's learned clipping level (the clipped ends' gradient only) on GPTQ's grids and variants
    DOREFA = "dorefa"  # DoReFa's straight-through fine-tuning of the latent weights on GPTQ's grids and variants
    BIT_SPLIT = "bit-split"  # Bit-Split: symmetric grids, ternary bit planes fitted in turn, on GPTQ's layouts and variants
    OCS = "ocs"  # OCS: the largest-|w| input channels split in two, then GPTQ on the expanded layers
    OPTQ = "optq"  # GPTQ as first published (OPTQ): columns in their natural order, no act-order
    SMOOTHQUANT = "smoothquant"  # SmoothQuant's activation-to-weight migration, weight-only (on AWQ's code)
    ANNEAL = "anneal"  # one width per layer searched by simulated annealing on the calibration KL (GPTQ rounding)
    CLIP_BLOCK = "clip-block"  # per-block uniform grids with MSE-optimal clipping (data-free)
    LLOYD_BLOCK = "lloyd-block"  # per-block non-uniform Lloyd (k-means) tables (data-free)


#: Rows that run BayesQ's posterior, tables and encoding; those in SHARED_PREP start from the
#: ``bayesq`` row's (its saved encoding: the same prep, so one fit serves them).
BAYESQ_ROWS = (Method.BAYESQ, Method.BAYESQ_EF, Method.BAYESQ_DISTILL, Method.BAYESQ_PAPER, Method.BAYESQ_BRECQ)
SHARED_PREP = (Method.BAYESQ_DISTILL, Method.BAYESQ_BRECQ)
#: Baselines on GPTQ's grids and variants: BayesQ's allocation is one more of their variants.
GRID_METHODS = (Method.GPTQ, Method.OPTQ, Method.ADAROUND, Method.BRECQ, Method.LSQ, Method.LSQ_PLUS, Method.PACT,
                Method.DOREFA, Method.BIT_SPLIT)
#: Baselines that read calibration inputs (and params.yaml's calibration and baselines sections).
CALIBRATED_METHODS = (*GRID_METHODS, Method.OCS, Method.AWQ, Method.SMOOTHQUANT, Method.ANNEAL,
                      Method.ZEROQ)  # ZeroQ: the shape of one calibration batch, never its values


OOD_TEXT_DOMAINS = tuple(d for d in DOMAIN_FILES if d != "movie")  # the in-domain training source is no test


#: Methods ``--method`` / ``methods:`` accept (params.yaml's names).
BYO_METHODS = tuple(m.value for m in Method)


@dataclass(frozen=True)
class ByoModel:
    """One user model and its data: what the CLI's flags, a zoo file entry (``model:`` /
    ``data:``) or an entry of params.yaml's ``sources:`` say.

    Attributes:
        name: the row's model name (reports, MLflow, export names).
        model: Hugging Face directory, ``torchvision:<arch>`` or ``package.module:function``.
        data: where the examples are and which columns to read.
        checkpoint, num_classes, tokenizer: see :func:`bayesq.harness.sources.resolve_model`.
        calibration, selection, test: sizes of the three disjoint seeded draws (None: the
            default, shrunk to fit the data: :func:`bayesq.harness.data.files.fit_draw_sizes`).
        budgets, methods: what to run (zoo file and params.yaml entries).
        exclude: module names or glob patterns kept in floating point.
    """

    name: str
    model: str
    data: DataSource
    checkpoint: str = ""
    num_classes: int = 0
    tokenizer: str = ""
    calibration: int | None = None  # default 512 (benchmarks/byo_sizes.py: 128 or 256 resolved above 1024, 512 not)
    selection: int | None = None  # default 256
    test: int | None = None  # default 512
    budgets: tuple[float, ...] = (3.0,)
    methods: tuple[str, ...] = ("bayesq",)
    exclude: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for key in ("calibration", "test"):
            if getattr(self, key) is not None and int(getattr(self, key)) < 1:
                raise ValueError(f"{self.name}: {key} = {getattr(self, key)}: need at least 1 example")
        if self.selection is not None and self.selection < 0:
            raise ValueError(f"{self.name}: selection = {self.selection}: need 0 or more examples")
        if not self.budgets or not all(isinstance(b, (int, float)) and b > 0 for b in self.budgets):
            raise ValueError(f"{self.name}: budgets = {list(self.budgets)}: need positive bits per weight")
        bad = [m for m in self.methods if m not in BYO_METHODS]
        if bad or not self.methods:
            raise ValueError(f"{self.name}: methods = {list(self.methods)}: choose from {', '.join(BYO_METHODS)}")


#: keys of a zoo / params.yaml entry -> ByoModel / DataSource fields
MODEL_KEYS = ("name", "model", "checkpoint", "num_classes", "tokenizer", "calibration", "selection", "test",
              "budgets", "methods", "exclude")
DATA_KEYS = ("data", "split", "text_column", "image_column", "label_column", "max_length", "image_size")


def byo_from_mapping(item: Mapping[str, Any], where: str, budgets: tuple[float, ...] = (3.0,),
                     methods: tuple[str, ...] = ("bayesq",)) -> ByoModel:
    """A :class:`ByoModel` from a zoo-file or params.yaml entry (``where`` names it in errors).

    Raises:
        ValueError: an unknown key (with the valid ones), a missing ``model`` / ``data``, a
            value of the wrong type.
    """
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: need a mapping with 'model' and 'data'")
    unknown = sorted(set(item) - set(MODEL_KEYS) - set(DATA_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(MODEL_KEYS + DATA_KEYS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"{where}: unknown key '{unknown[0]}'{hint}; valid keys: {', '.join(MODEL_KEYS + DATA_KEYS)}")
    for key in ("model", "data"):
        if not item.get(key):
            raise ValueError(f"{where}: '{key}' is required (model: a Hugging Face folder, torchvision:<arch> or "
                             "package.module:function; data: a dataset folder or file)")
    text = item.get("text_column") or ()
    try:
        data = DataSource(str(item["data"]), str(item.get("split", "train")),
                          (text,) if isinstance(text, str) else tuple(map(str, text)),
                          str(item.get("image_column") or ""), str(item.get("label_column") or ""),
                          int(item.get("max_length", 128)), int(item.get("image_size", 224)))
        listed = {k: tuple(item[k]) if isinstance(item.get(k), (list, tuple)) else item.get(k)
                  for k in ("budgets", "methods", "exclude") if k in item}
        for k, v in listed.items():
            if not isinstance(v, tuple):
                raise ValueError(f"'{k}' must be a list, got {v!r}")
        name = str(item.get("name") or Path(str(item["model"]).rstrip("/")).name.replace("torchvision:", ""))
        return ByoModel(name, str(item["model"]), data, str(item.get("checkpoint") or ""),
                        int(item.get("num_classes") or 0), str(item.get("tokenizer") or ""),
                        *(None if item.get(k) is None else int(item[k]) for k in ("calibration", "selection", "test")),
                        tuple(float(b) for b in listed.get("budgets", budgets)),
                        tuple(map(str, listed.get("methods", methods))), tuple(map(str, listed.get("exclude", ()))))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None



class SelectionInputs(str, Enum):
    """Which inputs score the choices among candidates fitted on the calibration inputs (BayesQ's
    grids, GPTQ's / AWQ's variants)."""

    HELD_OUT = "held-out"  # another draw of training inputs, disjoint from the calibration draw
    CALIBRATION = "calibration"  # the calibration inputs themselves (ablation)


@dataclass(frozen=True)
class CalibrationConfig:
    """Unlabelled calibration set sizes (labels are never used), batch size, and the inputs
    that score selections among fitted candidates (``selection``: ``held-out``, a second draw of
    ``selection_images`` / ``selection_sentences`` training inputs disjoint from the calibration
    draw; or the calibration inputs).

    The Laplace data size N is ``posterior.n_data`` (one definition for the library and the
    pipeline); the key ``fisher_scale`` that set it here before is rejected with that hint.
    """

    removed_keys: ClassVar[Mapping[str, str]] = {  # keys of earlier versions: what to do instead
        "fisher_scale": "the Laplace data size N is posterior.n_data alone (0 = the calibration set size); "
                        "delete this key",
    }

    images: int = setting(500, at_least(1))
    sentences: int = setting(1000, at_least(1))
    batch_size: int = setting(32, at_least(1))
    selection: SelectionInputs = SelectionInputs.HELD_OUT
    selection_images: int = setting(2000, at_least(1))
    selection_sentences: int = setting(2000, at_least(1))

    def __post_init__(self) -> None:
        validate(self, "calibration")


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

    gptq_damp: float = setting(0.01, within("(0, 1)", "GPTQ uses 0.01"))  # dampening, fraction of mean(diag H)
    gptq_act_order: bool = True  # columns by decreasing diag(H)
    awq_grid: int = setting(20, integer(1))  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    hawq_probes: int = setting(2, integer(1))  # Rademacher probes per calibration batch for the Hessian traces
    select: bool = True  # GPTQ / AWQ: best budget-feasible variant on the calibration KL
    group_sizes: tuple[int, ...] = setting(  # uniform variants' group sizes (per-channel last)
        (32, 64, 128, 256),
        rule(lambda g: isinstance(g, (tuple, list)) and len(g) > 0
             and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in g),
             "need a non-empty list of integer group sizes >= 1, e.g. [32, 64, 128, 256]"),
        ascending("[32, 64, 128, 256]"), convert=tuple)
    bias_correction: bool = True  # GPTQ / AWQ selection: each variant also with bias correction
    adaround_iters: int = setting(10000, integer(1))  # AdaRound: Adam steps per layer (the paper's 10,000)
    adaround_lambda: float = setting(0.01, at_least(0))  # AdaRound: weight of the rounding regulariser
    brecq_iters: int = setting(20000, integer(1))  # BRECQ: Adam steps per block (the authors' 20,000)
    lsq_iters: int = setting(10000, integer(1))  # LSQ / LSQ+: Adam steps per layer (benchmarks/learned_iters.py)
    lsq_lr: float = setting(0.2, above(0, "Adam's step on s / s0"))  # LSQ / LSQ+: step on the scale ratio
    pact_iters: int = setting(2000, integer(1))  # PACT: Adam steps per layer (benchmarks/learned_iters.py)
    pact_lr: float = setting(0.01, above(0, "Adam's step on s / s0"))  # PACT: step on the scale ratio
    dorefa_iters: int = setting(10000, integer(1))  # DoReFa: Adam steps per layer (benchmarks/learned_iters.py)
    dorefa_lr: float = setting(2e-4, above(0, "Adam's step on the latent weights, in code units"))
    bitsplit_epochs: int = setting(100, integer(1))  # Bit-Split: alternations of scales and planes at most (the paper's)
    smoothquant_alpha: float = setting(0.5, within("[0, 1]", "the paper's default is 0.5"))  # migration strength
    ocs_expand_ratios: tuple[float, ...] = setting(  # OCS: shares of input channels split (variants of the selection)
        (0.01, 0.02, 0.05),
        rule(lambda r: isinstance(r, (tuple, list)) and len(r) > 0
             and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 for v in r),
             "need a non-empty list of shares in (0, 1], e.g. [0.01, 0.02, 0.05]"), convert=tuple)
    anneal_steps: int = setting(200, integer(0))  # annealing search: moves proposed
    anneal_inputs: int = setting(256, integer(1))  # annealing search: calibration inputs each move is scored on

    def __post_init__(self) -> None:
        validate(self, "baselines")


@dataclass(frozen=True)
class RobustnessConfig:
    """Calibration and out-of-domain evaluation (``robustness`` in params.yaml).

    Every (method, budget) row gets accuracy, ECE / MCE (``ece_bins`` equal-width bins, and
    ``random_bin_repeats`` sets of random bin edges), worst-k% accuracy and CVaR on the test
    split; rows of ``methods`` at ``budgets`` (plus the FP model) are also evaluated on
    ``corruptions`` x ``severities`` of the first ``corruption_examples`` test images, and text
    models on the ``text_domains`` of the sentiment archive (``domain_examples`` each).
    """

    ece_bins: int = setting(15, integer(1))
    random_bin_repeats: int = setting(20, integer(1))
    budgets: tuple[float, ...] = setting((3.0,), convert=lambda v: tuple(float(b) for b in v))
    methods: tuple[Method, ...] = (Method.BAYESQ, Method.BAYESQ_DISTILL, Method.BAYESQ_EF, Method.GPTQ,
                                   Method.AWQ, Method.RTN_GROUP)
    corruptions: tuple[str, ...] = setting(("gaussian_noise", "shot_noise", "impulse_noise", "gaussian_blur",
                                            "defocus_blur", "fog", "brightness", "contrast", "pixelate",
                                            "jpeg_compression"), each_of(CORRUPTIONS))
    severities: tuple[int, ...] = setting(
        (1, 2, 3, 4, 5),
        rule(lambda v: all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 5 for s in v),
             "severities are integers 1..5"))
    corruption_examples: int = setting(500, integer(1))
    text_domains: tuple[str, ...] = setting(("tweets", "amazon", "nyt"), each_of(OOD_TEXT_DOMAINS))
    domain_examples: int = setting(1000, integer(1))

    def __post_init__(self) -> None:
        validate(self, "robustness")


MAX_ROW_LABEL = 60  # an ablation row's label: nested 18 columns deep in dvc.lock, wrapped past column 80

_POSITIVE_BUDGETS = rule(lambda v: all(b > 0 for b in v), "list positive average bit budgets")


@dataclass(frozen=True)
class AblationConfig:
    """Ablation grid: ``rows[group][label]`` maps dotted keys (``quant.codebook``) to values.

    Each row is BayesQ with the main parameters overridden by its mapping; rows are validated
    by :func:`ablation_params`, so a typo in a key or value fails on load.
    """

    models: tuple[str, ...] = setting((), convert=tuple)
    budgets: tuple[float, ...] = setting((3.0, 3.5), _POSITIVE_BUDGETS, convert=lambda v: tuple(float(b) for b in v))
    rows: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self, "ablations", self._relations)

    def _relations(self) -> Iterator[Relation]:
        for group, rows in self.rows.items():
            yield (isinstance(rows, Mapping) and len(rows) > 0, f"ablations.rows.{group}", rows,
                   "map row labels to {dotted.key: value}")
            for label, over in rows.items():
                where = f"ablations.rows.{group}.{label}"
                yield isinstance(over, Mapping), where, over, "need a mapping {dotted.key: value}"
                yield (len(str(label)) <= MAX_ROW_LABEL, where, over,
                       f"row labels are at most {MAX_ROW_LABEL} characters: DVC copies params.yaml into "
                       "dvc.lock with an 80-column YAML writer that breaks a longer key across lines, and then "
                       "cannot read its own lock; shorten the label")


SHIFT_METHODS = (Method.BAYESQ, Method.GPTQ, Method.OPTQ, Method.AWQ)  # BayesQ and the strongest rivals with corrections


@dataclass(frozen=True)
class ShiftCase:
    """One case of the ``shift`` stage: ``model`` calibrated on inputs from one part of the data
    and tested on others. Text models: ``calibrate`` is a sentiment domain (``movie``: the
    model's own training split) and ``test`` the domains tested (``movie``: its test split).
    Image models: ``calibrate`` the classes whose training images calibrate, ``test`` ``("all",)``:
    the test split, every class."""

    name: str
    model: str
    calibrate: str | tuple[int, ...]
    test: tuple[str, ...]


_CASE_KEYS = ("model", "calibrate", "test")


def _case_problems(name: str, case: Any) -> Iterator[tuple[str, Any, str]]:
    """(where, value, why) of everything wrong with one ``shift.cases`` entry (nothing: valid)."""
    where = f"shift.cases.{name}"
    if not isinstance(case, Mapping) or set(case) != set(_CASE_KEYS):
        yield where, case, f"need a mapping with exactly the keys {list(_CASE_KEYS)}"
        return
    known = known_models()
    if case["model"] not in known:
        yield f"{where}.model", case["model"], f"unknown model; known models: {', '.join(known)}"
        return
    entry = get_entry(case["model"])
    test = case["test"]
    if not isinstance(test, (list, tuple)) or not test:
        yield f"{where}.test", test, "need a non-empty list"
        return
    if entry.task == "image":
        cal, classes = case["calibrate"], getattr(entry, "num_classes", None)  # None: not declared by the entry
        if (not isinstance(cal, (list, tuple)) or not cal
                or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < (classes or c + 1) for c in cal)):
            yield (f"{where}.calibrate", cal, "an image model calibrates on a list of its classes, integers in "
                                              f"0..{classes - 1 if classes else 'C - 1'}, e.g. [0, 1, 2]")
        elif len(set(cal)) == classes:
            yield f"{where}.calibrate", cal, "every class: that is no shift; list a subset of the classes"
        if list(test) != ["all"]:
            yield f"{where}.test", test, "an image model is tested on its whole test split: [all]"
    else:
        domains = list(DOMAIN_FILES)
        if case["calibrate"] not in domains:
            yield f"{where}.calibrate", case["calibrate"], f"a text model calibrates on one domain of {domains}"
        if not all(t in domains for t in test):
            yield f"{where}.test", test, f"choose test domains from {domains}"
        elif case["calibrate"] in test:
            yield f"{where}.test", test, "the calibration domain is no shift; test on other domains"


@dataclass(frozen=True)
class ShiftConfig:
    """The ``shift`` stage (``make ablations``; ``reports/shift.md``): each of ``methods`` with and
    without its data-fitted corrections at ``budget``, calibrated on one part of the data and
    tested on another, for every case of ``cases`` (``{name: {model, calibrate, test}}``,
    :class:`ShiftCase`); at most ``test_examples`` examples per test set."""

    budget: float = setting(3.0, above(0))
    methods: tuple[Method, ...] = setting(SHIFT_METHODS, rule(
        lambda v: len(v) > 0 and all(m in SHIFT_METHODS for m in v), f"choose from {[m.value for m in SHIFT_METHODS]}",
        shown=lambda v: [m.value for m in v]))
    test_examples: int = setting(5000, integer(1))
    cases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self, "shift", self._relations)

    def _relations(self) -> Iterator[Relation]:
        yield isinstance(self.cases, Mapping), "shift.cases", self.cases, "need a mapping {name: {model, calibrate, test}}"
        for name, case in (self.cases.items() if isinstance(self.cases, Mapping) else ()):
            for where, value, why in _case_problems(str(name), case):
                yield False, where, value, why

    def shift_cases(self) -> tuple[ShiftCase, ...]:
        """The cases, in order, as :class:`ShiftCase` values."""
        return tuple(ShiftCase(str(name), c["model"], c["calibrate"] if isinstance(c["calibrate"], str)
                               else tuple(c["calibrate"]), tuple(c["test"])) for name, c in self.cases.items())


DEPLOY_METHODS = (Method.BAYESQ, Method.GPTQ, Method.AWQ)  # methods whose encodings MatMulNBits stores: BayesQ, its rivals


def _peer_problem(name: Any) -> str:
    """Why ``name`` is not an ONNX Runtime peer ``<rtn|hqq|gptq>-<bits>b-b<block>`` ("" if it is one)."""
    try:
        deploy_peer(name)
    except (ValueError, TypeError) as err:
        return str(err)
    return ""


def deploy_peer(name: str):
    """The :class:`bayesq.baselines.ort.Peer` named ``<algorithm>-<bits>b-b<block>``, e.g. ``rtn-4b-b128``."""
    parts = str(name).split("-")
    if len(parts) != 3 or not parts[1].endswith("b") or not parts[2].startswith("b"):
        raise ValueError(f"peer {name!r}: write <rtn|hqq|gptq>-<bits>b-b<block>, e.g. rtn-4b-b128")
    try:
        return Peer(parts[0], int(parts[1][:-1]), int(parts[2][1:]))
    except ValueError as err:
        raise ValueError(f"peer {name!r}: {err}") from None


@dataclass(frozen=True)
class DeployConfig:
    """The ``deploy`` stage (``reports/deploy.md``, :mod:`flows.deploy`): each of ``models`` as an
    ONNX Runtime file (``MatMulNBits``, the ``onnxruntime`` target) by each of ``methods`` at each
    of ``budgets``, next to ONNX Runtime's own quantisers ``peers`` on the model's FP32 graph, and
    BayesQ again at each peer's true bits; scored on at most ``test_examples`` test examples in
    ONNX Runtime at ``accuracy_level``; latency at batch sizes ``batches`` (median of ``repeats``
    calls on ``threads`` threads)."""

    models: tuple[str, ...] = setting(("lite0-fmnist", "minilm-sentiment"), rule(len, "list at least one model"),
                                      convert=tuple)
    budgets: tuple[float, ...] = setting((3.0, 4.0), rule(len, "list positive average bit budgets"),
                                         _POSITIVE_BUDGETS, convert=lambda v: tuple(float(b) for b in v))
    methods: tuple[Method, ...] = setting(DEPLOY_METHODS, rule(
        lambda v: len(v) > 0 and all(m in DEPLOY_METHODS for m in v), f"choose from {[m.value for m in DEPLOY_METHODS]}",
        shown=lambda v: [m.value for m in v]))
    peers: tuple[str, ...] = setting(("rtn-4b-b128", "hqq-4b-b128", "gptq-4b-b64", "hqq-2b-b64"), rule(
        lambda v: all(not _peer_problem(p) for p in v), "each peer is <rtn|hqq|gptq>-<bits>b-b<block>, e.g. "
        "rtn-4b-b128 (GPTQ: 4 bits; blocks: powers of two from 16)"), convert=lambda v: tuple(str(p) for p in v))
    accuracy_level: int = setting(4, one_of((1, 2, 3, 4), "MatMulNBits' accuracy levels are 1 (float32) to 4 (int8)"))
    test_examples: int = setting(1000, integer(1))
    batches: tuple[int, ...] = setting((1, 8), rule(lambda v: len(v) > 0 and all(int(b) >= 1 for b in v),
                                                    "list batch sizes of at least 1"),
                                     convert=lambda v: tuple(int(b) for b in v))
    threads: int = setting(2, integer(1))
    repeats: int = setting(20, integer(1))

    def __post_init__(self) -> None:
        validate(self, "deploy", self._relations)

    def _relations(self) -> Iterator[Relation]:
        known = known_models()
        for m in self.models:
            yield m in known, "deploy.models", m, f"unknown model; known models: {', '.join(known)}"


@dataclass(frozen=True)
class Params:
    """The whole of ``params.yaml`` after the selected profile's overrides are applied.

    ``sources``: a user's models and data (:class:`ByoModel`, run by the ``sources`` stage next to
    the embedded models; each at its own ``budgets`` / ``methods``, default the profile's budgets
    and :data:`SOURCE_METHODS`).

    ``exclude``: per embedded model, the module names or glob patterns (``fnmatch``, as
    :func:`bayesq.quantize.quantize_model`'s ``exclude=``) it keeps in floating point, the same
    for every method, its posterior and its statistics; a model not listed excludes nothing.
    Checked here: known model names, lists of non-empty strings; that each pattern matches a
    layer of its model needs the model (:func:`flows.prepare.checked_exclude`).
    """

    profile: str = "quick"
    models: tuple[str, ...] = setting(("lite0-fmnist", "minilm-sentiment"), rule(len, "list at least one model"))
    seeds: tuple[int, ...] = setting((17,), rule(len, "list at least one seed"))
    budgets: tuple[float, ...] = setting((3.0, 3.5, 4.0), rule(len, "list positive average bit budgets"),
                                         _POSITIVE_BUDGETS)
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
    ablations: AblationConfig = field(default_factory=AblationConfig)
    shift: ShiftConfig = field(default_factory=ShiftConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    sources: tuple[ByoModel, ...] = ()
    exclude: Mapping[str, tuple[str, ...]] = field(default_factory=dict, metadata=checks(
        rule(lambda v: isinstance(v, Mapping), "need a mapping {model: [module names or glob patterns]}, "
                                               "e.g. {minilm-sentiment: [classifier]}"),
        convert=lambda v: {str(k): tuple(p) if isinstance(p, (list, tuple)) else p for k, p in v.items()}))

    def __post_init__(self) -> None:
        validate(self, "params", self._relations)
        self.bayesq(self.budgets[0], self.seeds[0])  # cross-section checks (e.g. rounding vs curvature)

    def _relations(self) -> Iterator[Relation]:
        known = known_models()
        for model, patterns in self.exclude.items():
            where = f"exclude.{model}"
            close = difflib.get_close_matches(model, list(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            yield (model in known, where, patterns, f"unknown model{hint}; known models: {', '.join(known)}")
            yield (isinstance(patterns, tuple), where, patterns,
                   "need a list of module names or glob patterns, e.g. [classifier, 'encoder.layer.0.*']")
            yield (all(isinstance(p, str) and p for p in patterns), where, patterns,
                   "every pattern is a non-empty string (a module name or fnmatch glob); quote one YAML reads "
                   "as a number or null")

    def bayesq(self, budget: float, seed: int) -> BayesQConfig:
        return BayesQConfig(budget=budget, posterior=self.posterior, quant=self.quant,
                            allocation=self.allocation, distill=self.distill, seed=seed)

    def excluded(self, model: str) -> tuple[str, ...]:
        """The module names or glob patterns ``model`` keeps in floating point (``exclude``)."""
        return self.exclude.get(model, ())


_SECTIONS = {
    "data": DataConfig, "finetune": FinetuneConfig, "calibration": CalibrationConfig,
    "posterior": PosteriorConfig, "quant": QuantConfig, "allocation": AllocationConfig,
    "baselines": BaselinesConfig, "distill": DistillConfig, "robustness": RobustnessConfig,
    "ablations": AblationConfig, "shift": ShiftConfig, "deploy": DeployConfig,
}
_STAGE_SECTIONS = ("ablations", "shift", "deploy")  # a stage's own rows, not method settings an override may change
_LISTS = ("models", "seeds", "budgets", "methods")
SOURCE_METHODS = ("bayesq", "gptq")  # methods of a `sources:` entry that names none (BayesQ and its strongest rival)
_MAPPINGS = ("exclude",)  # top-level mappings that are no section: {model: [patterns]}


def _merge(base: dict, over: Mapping[str, Any], where: str) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def read_params(path: Path) -> Params:
    """Validated params of the file ``path`` with the selected profile applied."""
    with open(path) as f:
        return load_params(yaml.safe_load(f) or {})


def load_params(raw: Mapping[str, Any]) -> Params:
    """Validate a parsed ``params.yaml`` and apply ``profiles[profile]`` on top of it.

    Raises:
        ValueError: unknown top-level or section key (with a suggestion), unknown profile, or
            an invalid value (naming ``section.field``, or ``exclude.<model>``).
    """
    raw = dict(raw)
    profiles = raw.pop("profiles", {}) or {}
    profile = raw.get("profile", "quick")
    if profile not in profiles and profiles:
        raise ValueError(f"profile = {profile!r}: unknown profile; defined: {', '.join(profiles)}")
    merged = _merge(raw, profiles.get(profile, {}) or {}, f"profiles.{profile}")
    top = {"profile", "sources", *_LISTS, *_MAPPINGS, *_SECTIONS}
    for key in merged:
        if key not in top:
            close = difflib.get_close_matches(key, list(top), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"params: unknown key '{key}'{hint}; valid keys: {', '.join(sorted(top))}")
    kwargs: dict[str, Any] = {k: tuple(merged[k]) for k in _LISTS if k in merged}
    kwargs["profile"] = profile
    kwargs |= {k: {} if merged[k] is None else merged[k] for k in _MAPPINGS if k in merged}  # `exclude:` alone: none
    for name, cls in _SECTIONS.items():
        kwargs[name] = from_mapping(cls, merged.get(name), name)
    kwargs["sources"] = read_sources(merged.get("sources"), kwargs.get("budgets", Params.budgets))
    return Params(**kwargs)


def read_sources(items: Any, budgets: tuple[float, ...]) -> tuple[ByoModel, ...]:
    """params.yaml's ``sources:`` (None or a list of entries, :func:`byo_from_mapping`; each at
    ``budgets`` and :data:`SOURCE_METHODS` unless it names its own).

    Raises:
        ValueError: not a list, a bad entry (naming ``sources[i]`` and the key), a name listed
            twice or one of an embedded model.
    """
    if items is None:
        return ()
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"params: sources = {items!r}: need a list of models, each with 'model' and 'data'")
    out, names = [], set(known_models())
    for i, item in enumerate(items):
        byo = byo_from_mapping(item, f"params: sources[{i}]", tuple(budgets), SOURCE_METHODS)
        if byo.name in names:
            raise ValueError(f"params: sources[{i}].name = {byo.name!r}: already the name of another model; give it "
                             "its own 'name'")
        names.add(byo.name)
        out.append(byo)
    return tuple(out)


def ablation_params(params: Params, overrides: Mapping[str, Any], where: str = "ablation") -> Params:
    """``params`` with dotted ``section.key`` overrides applied and validated.

    Raises:
        ValueError: unknown section or key (with a suggestion) or an invalid value, naming
            ``where`` (the ablation row) and the key.
    """
    changes: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        section, _, key = str(dotted).partition(".")
        if section not in _SECTIONS or section in _STAGE_SECTIONS or not key:
            close = difflib.get_close_matches(section, [k for k in _SECTIONS if k not in _STAGE_SECTIONS], n=1)
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