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


class FisherScale(str, Enum):
    """Which data set size the summed calibration Fisher is scaled to (the Laplace 'N')."""

    TRAIN = "train"  # the training split the model was fine-tuned on
    CALIBRATION = "calibration"  # the calibration set itself: p(w | D_cal)


class Method(str, Enum):
    """Quantization methods the pipeline knows."""

    BAYESQ = "bayesq"
    RTN_TENSOR = "rtn-tensor"
    RTN_CHANNEL = "rtn-channel"
    RTN_GROUP = "rtn-group"


def _fail(section: str, name: str, value: Any, why: str) -> None:
    raise ValueError(f"{section}.{name} = {value!r}: {why}")


@dataclass(frozen=True)
class PosteriorConfig:
    """Label-free diagonal Fisher Laplace posterior: ``precision = n_data * mean_n F_n + damping``.

    ``n_data`` scales the mean per-example Fisher to the data set the posterior conditions on;
    0 means "the calibration set" (``precision = sum_n F_n + damping``, the paper's p(w | D_cal)).
    Variances ``1 / precision`` are clipped to ``[var_min, var_max]``.
    """

    damping: float = 1e-2
    n_data: int = 0
    var_min: float = 1e-12
    var_max: float = 1e4
    label_samples: int = 1

    def __post_init__(self) -> None:
        s = "posterior"
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

    def __post_init__(self) -> None:
        s = "quant"
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
        if not 0 < self.min_range_ratio <= 1:
            _fail(s, "min_range_ratio", self.min_range_ratio, "must be in (0, 1]")


@dataclass(frozen=True)
class BayesQConfig:
    """Everything :func:`bayesq.quantize_model` needs besides the model and calibration data."""

    budget: float = 3.0
    posterior: PosteriorConfig = field(default_factory=PosteriorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.budget > 0:
            _fail("config", "budget", self.budget, "average bits per weight must be > 0")


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
    """Fine-tuning of the embedded models (a cached pipeline step)."""

    epochs: int = 1
    batch_size: int = 64
    lr_image: float = 1e-3
    lr_text: float = 5e-5
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        s = "finetune"
        if self.epochs < 1:
            _fail(s, "epochs", self.epochs, "must be >= 1")
        if self.batch_size < 1:
            _fail(s, "batch_size", self.batch_size, "must be >= 1")
        for name in ("lr_image", "lr_text"):
            if not getattr(self, name) > 0:
                _fail(s, name, getattr(self, name), "must be > 0")


@dataclass(frozen=True)
class CalibrationConfig:
    """Unlabelled calibration set sizes (labels are never used), batch size, Fisher scale.

    ``fisher_scale = train`` sets ``posterior.n_data`` to the model's training-split size, so the
    posterior is that of the trained weights given their training data, with the curvature
    estimated on the calibration inputs.
    """

    images: int = 500
    sentences: int = 1000
    batch_size: int = 32
    fisher_scale: FisherScale = FisherScale.TRAIN

    def __post_init__(self) -> None:
        s = "calibration"
        try:
            object.__setattr__(self, "fisher_scale", FisherScale(self.fisher_scale))
        except ValueError:
            _fail(s, "fisher_scale", self.fisher_scale, f"choose from {[f.value for f in FisherScale]}")
        for name in ("images", "sentences", "batch_size"):
            if getattr(self, name) < 1:
                _fail(s, name, getattr(self, name), "must be >= 1")


def from_mapping(cls: type, data: Mapping[str, Any] | None, section: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with a suggestion.

    Raises:
        ValueError: ``"<section>: unknown key 'x' (did you mean 'y'?) ..."``.
    """
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}
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

    def bayesq(self, budget: float, seed: int) -> BayesQConfig:
        return BayesQConfig(budget=budget, posterior=self.posterior, quant=self.quant, seed=seed)


_SECTIONS = {
    "data": DataConfig, "finetune": FinetuneConfig, "calibration": CalibrationConfig,
    "posterior": PosteriorConfig, "quant": QuantConfig,
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
