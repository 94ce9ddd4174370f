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

from bayesq.config import AllocationConfig, BayesQConfig, DistillConfig, PosteriorConfig, QuantConfig
from bayesq.harness.corruptions import CORRUPTIONS
from bayesq.harness.data.files import DataSource
from bayesq.harness.data.sentiment import DOMAIN_FILES
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import known_models
from bayesq.settings import (
    Relation, at_least, checks, each_of, from_mapping, integer, rule, setting, validate,
)
from flows.methods import BYO_METHODS, BaselineSettings, Method, read_baselines
from flows.stage_params import POSITIVE_BUDGETS, AblationConfig, DeployConfig, ShiftConfig

OOD_TEXT_DOMAINS = tuple(d for d in DOMAIN_FILES if d != "movie")  # the in-domain training source is no test


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
                                         POSITIVE_BUDGETS)
    methods: tuple[Method, ...] = tuple(Method)
    data: DataConfig = field(default_factory=DataConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    posterior: PosteriorConfig = field(default_factory=PosteriorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    baselines: BaselineSettings = field(default_factory=BaselineSettings)
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
    "baselines": BaselineSettings, "distill": DistillConfig, "robustness": RobustnessConfig,
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
        kwargs[name] = (read_baselines(merged.get(name)) if cls is BaselineSettings
                        else from_mapping(cls, merged.get(name), name))
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
    """``params`` with dotted ``section.key`` overrides applied and validated (``baselines.<method>.<field>``
    for a baseline's setting).

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
        try:
            if section == "baselines":  # baselines.<method>.<field>
                kwargs[section] = params.baselines.changed(over)
                continue
            base = {f.name: getattr(getattr(params, section), f.name) for f in fields(_SECTIONS[section])}
            kwargs[section] = from_mapping(_SECTIONS[section], {**base, **over}, section)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return dataclasses.replace(params, **kwargs)