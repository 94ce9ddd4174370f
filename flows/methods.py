"""The pipeline's method registry: one :class:`MethodEntry` per row name, everything else derived.

An entry holds a method's ``params.yaml`` / ``--method`` name, its report label, the library
config class its rows run with and the settings that make the method (e.g. OPTQ is
``GPTQConfig(act_order=False)``; the handler is the one :func:`bayesq.methods.register` gave that
class), the sources only its rows run (their cache key leaves out the others') and the groups of
rows it belongs to. A baseline's rows read ``params.yaml``'s ``baselines.<name>`` section, which
loads straight into that class (:class:`BaselineSettings`): the library's defaults unless the
section says otherwise. :class:`Method`, the labels, the config factories, the sources and the groups are
all read off :data:`METHODS`, so adding a baseline is two places: its module under
``bayesq/baselines/`` (config class and registered handler) and its entry here (docs/usage.md,
"Adding a method").
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Mapping

from bayesq.baselines.aciq import ACIQConfig
from bayesq.baselines.adaround import AdaRoundConfig
from bayesq.baselines.anneal import AnnealConfig
from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.bitsplit import BitSplitConfig
from bayesq.baselines.blockwise import BlockwiseConfig
from bayesq.baselines.brecq import BRECQConfig
from bayesq.baselines.dorefa import DoReFaConfig
from bayesq.baselines.gptq import GPTQConfig
from bayesq.baselines.hawq import HAWQConfig
from bayesq.baselines.lsq import LSQConfig, StepGradient
from bayesq.baselines.ocs import OCSConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.baselines.smoothquant import SmoothQuantConfig
from bayesq.baselines.zeroq import ZeroQConfig
from bayesq.config import Codebook, Granularity
from bayesq.settings import from_mapping

#: The groups an entry may belong to, and what membership means.
GROUPS = {
    "bayesq": "runs BayesQ's posterior, tables and encoding (flows.configs.method_config builds its config)",
    "shared-prep": "a BayesQ row that starts from the bayesq row's saved encoding (the same preparation)",
    "grid": "a baseline on GPTQ's grids and variants: BayesQ's allocation is one more of its variants",
    "calibrated": "a baseline that reads calibration inputs (and the calibration / baselines sections)",
    "data-free": "reads no calibration input at all",
    "shift": "run by the shift stage: BayesQ and the strongest rivals with corrections",
    "deploy": "its encodings are what ONNX Runtime's MatMulNBits stores: run by the deploy stage",
}


@dataclass(frozen=True)
class MethodEntry:
    """One pipeline method (a row name).

    Attributes:
        name: its ``params.yaml`` / ``--method`` name (``"optq"``).
        label: its name in the reports (``"OPTQ (best variant, natural order)"``).
        config: the library config class a baseline row runs with; None for the BayesQ rows, whose
            config :func:`flows.configs.method_config` builds from the method sections.
        defaults: the settings of ``config`` that make this method (over the class's defaults;
            ``params.yaml``'s ``baselines.<name>`` section goes over them).
        sources: files (from the repository root) that only this method's rows run among the
            methods: each row's cache key leaves out the other methods' (tests/test_flows.py
            profiles every row to check that none calls into a source its key leaves out).
        groups: the row groups it belongs to (:data:`GROUPS`).
    """

    name: str
    label: str
    config: type | None = None
    sources: tuple[str, ...] = ()
    groups: frozenset[str] = frozenset()
    defaults: Mapping[str, Any] = field(default_factory=dict)


def _entry(name: str, label: str, config: type | tuple[type, dict] | None = None, sources: tuple[str, ...] = (),
           *groups: str) -> MethodEntry:
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"method {name!r}: unknown groups {sorted(unknown)}; choose from {list(GROUPS)}")
    cls, defaults = config if isinstance(config, tuple) else (config, {})
    return MethodEntry(name, label, cls, sources, frozenset(groups), defaults)


_GPTQ = "bayesq/baselines/gptq.py"
_LEARNED = ("calibrated", "grid")

#: Every method, BayesQ's rows first, then the baselines in the reports' order (GPTQ's family,
#: learned rounding, AWQ's family, per-layer mixed precision, data-free rules).
METHODS: tuple[MethodEntry, ...] = (
    _entry("bayesq", "BayesQ", None, (), "bayesq", "shift", "deploy"),
    _entry("bayesq-ef", "BayesQ (K-FAC)", None, (), "bayesq"),  # K-FAC posterior (error feedback in its input factor)
    _entry("bayesq-distill", "BayesQ + distillation", None, ("bayesq/distill.py",), "bayesq", "shared-prep"),
    _entry("bayesq-paper", "BayesQ (paper-literal)", None, (), "bayesq"),  # fixed prior, draws, nearest rounding
    _entry("bayesq-brecq", "BayesQ + BRECQ rounding (no bias correction)", None,
           ("bayesq/baselines/brecq.py", "bayesq/baselines/adaround.py"), "bayesq", "shared-prep"),
    _entry("gptq", "GPTQ (best variant, act-order)",
           GPTQConfig,
           (_GPTQ,), *_LEARNED, "shift", "deploy"),
    _entry("optq", "OPTQ (best variant, natural order)",  # GPTQ as first published: natural column order
           (GPTQConfig, {"act_order": False}),
           (_GPTQ,), *_LEARNED, "shift"),
    _entry("anneal", "Mixed precision by annealing (per layer, GPTQ)",  # one width per layer, annealed on the KL
           AnnealConfig,
           ("bayesq/baselines/anneal.py", _GPTQ, "bayesq/baselines/brecq.py"), "calibrated"),
    _entry("adaround", "AdaRound (best variant)",
           AdaRoundConfig,
           ("bayesq/baselines/adaround.py", _GPTQ), *_LEARNED),
    _entry("brecq", "BRECQ (best variant)",  # AdaRound's rounding learned per residual block / transformer layer
           BRECQConfig,
           ("bayesq/baselines/brecq.py", "bayesq/baselines/adaround.py", "bayesq/baselines/lsq.py", _GPTQ),
           *_LEARNED),
    _entry("lsq", "LSQ (best variant)",
           LSQConfig,
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("lsq-plus", "LSQ+ (best variant)",  # learned step sizes and offsets (zero-points)
           (LSQConfig, {"offset": True}),
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("pact", "PACT (best variant)",  # LSQ's fit with PACT's gradient (the clipped ends' only)
           (LSQConfig, {"gradient": StepGradient.PACT}),
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("dorefa", "DoReFa (best variant)",
           DoReFaConfig,
           ("bayesq/baselines/dorefa.py", _GPTQ), *_LEARNED),
    _entry("bit-split", "Bit-Split (best variant)",
           BitSplitConfig,
           ("bayesq/baselines/bitsplit.py", _GPTQ), *_LEARNED),
    _entry("ocs", "OCS + GPTQ (best ratio and variant)",  # channels split, then GPTQ on the expanded layers
           OCSConfig,
           ("bayesq/baselines/ocs.py", _GPTQ), "calibrated"),
    _entry("awq", "AWQ (g64)",
           AWQConfig,
           ("bayesq/baselines/awq.py",), "calibrated", "shift", "deploy"),
    _entry("smoothquant", "SmoothQuant weight-only (best variant)",  # on AWQ's code
           SmoothQuantConfig,
           ("bayesq/baselines/smoothquant.py", "bayesq/baselines/awq.py"), "calibrated"),
    _entry("hawq", "HAWQ-style (per layer)",
           HAWQConfig,
           ("bayesq/baselines/hawq.py",)),
    _entry("zeroq", "ZeroQ (per layer, distilled data)",  # reads the shape of one calibration batch, not its values
           ZeroQConfig, ("bayesq/baselines/zeroq.py",), "calibrated"),
    _entry("aciq", "ACIQ (per channel)", ACIQConfig, ("bayesq/baselines/aciq.py",),
           "data-free"),
    _entry("lloyd-block", "Per-block Lloyd (LUT per 1024)",
           (BlockwiseConfig, {"codebook": Codebook.LLOYD}), ("bayesq/baselines/blockwise.py",), "data-free"),
    _entry("clip-block", "Per-block uniform + clipping (g64)",
           (BlockwiseConfig, {"codebook": Codebook.UNIFORM}), ("bayesq/baselines/blockwise.py",), "data-free"),
    _entry("rtn-group", "RTN per-group (g64)", (RTNConfig, {"granularity": Granularity.GROUP}), (), "data-free"),
    _entry("rtn-channel", "RTN per-channel", (RTNConfig, {"granularity": Granularity.CHANNEL}), (), "data-free"),
    _entry("rtn-tensor", "RTN per-tensor", (RTNConfig, {"granularity": Granularity.TENSOR}), (), "data-free"),
)

#: The methods the pipeline knows, by ``params.yaml`` name (``Method.LSQ_PLUS == "lsq-plus"``).
Method = Enum("Method", [(e.name.upper().replace("-", "_"), e.name) for e in METHODS], type=str)
Method.__doc__ = "Quantization methods the pipeline knows (flows.methods.METHODS)."
Method.__module__ = __name__
ENTRY: dict[Method, MethodEntry] = {Method(e.name): e for e in METHODS}


def group(name: str) -> tuple[Method, ...]:
    """The methods of group ``name`` (:data:`GROUPS`), in :data:`METHODS` order."""
    if name not in GROUPS:
        raise ValueError(f"unknown method group {name!r}: choose from {list(GROUPS)}")
    return tuple(m for m, e in ENTRY.items() if name in e.groups)


BAYESQ_ROWS = group("bayesq")
SHARED_PREP = group("shared-prep")
GRID_METHODS = group("grid")
CALIBRATED_METHODS = group("calibrated")
DATA_FREE_METHODS = group("data-free")
SHIFT_METHODS = group("shift")
DEPLOY_METHODS = group("deploy")
BASELINES = tuple(m for m in Method if m not in BAYESQ_ROWS)  # every other row, in the reports' order

#: Methods ``--method`` / ``methods:`` accept (params.yaml's names).
BYO_METHODS = tuple(m.value for m in Method)
METHOD_LABEL = {e.name: e.label for e in METHODS}
METHOD_SOURCES = {m: e.sources for m, e in ENTRY.items() if e.sources}

#: Keys of the ``baselines`` section before it held one section per method, each with its place now.
MOVED_KEYS = {
    "gptq_damp": "gptq: {damp: ...} (and optq, ocs)", "gptq_act_order": "gptq: {act_order: ...} (and ocs)",
    "awq_grid": "awq: {grid: ...}", "hawq_probes": "hawq: {probes: ...}",
    "select": "<method>: {select: ...} for each of gptq, optq, awq, ...",
    "group_sizes": "<method>: {group_sizes: [...]} for each of gptq, optq, awq, ...",
    "bias_correction": "<method>: {bias_correction: ...} for each of gptq, optq, awq, ...",
    "adaround_iters": "adaround: {iters: ...}", "adaround_lambda": "adaround: {lam: ...} (and brecq)",
    "brecq_iters": "brecq: {iters: ...}", "lsq_iters": "lsq: {iters: ...} (and lsq-plus)",
    "lsq_lr": "lsq: {lr: ...} (and lsq-plus)", "pact_iters": "pact: {iters: ...}", "pact_lr": "pact: {lr: ...}",
    "dorefa_iters": "dorefa: {iters: ...}", "dorefa_lr": "dorefa: {lr: ...}",
    "bitsplit_epochs": "bit-split: {epochs: ...}", "smoothquant_alpha": "smoothquant: {alpha: ...}",
    "ocs_expand_ratios": "ocs: {expand_ratios: [...]}", "anneal_steps": "anneal: {steps: ...}",
    "anneal_inputs": "anneal: {search_inputs: ...}",
}
_ROW_FIELDS = ("quant", "seed")  # set by the pipeline: the quant section, the row's seed


@dataclass(frozen=True)
class BaselineSettings:
    """``baselines`` in params.yaml: one section per baseline, by its name (``gptq``, ``lsq-plus``,
    ...), holding fields of its library config class (:attr:`MethodEntry.config`) that its rows
    set to other than the method's defaults, e.g. ``{hawq: {probes: 2}}``; a method without a
    section runs with the library's defaults. ``quant`` is the quant section's and ``seed`` the
    row's, so a section sets neither. Built by :func:`read_baselines`; ``sections`` holds
    (method, ((field, value), ...)) pairs, sorted."""

    sections: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    def section(self, method) -> dict[str, Any]:
        """The fields ``method``'s section sets (``{}``: none)."""
        return dict(dict(self.sections).get(Method(method).value, ()))

    def config(self, method, quant=None, seed: int = 0):
        """``method``'s library config: its class with the method's :attr:`MethodEntry.defaults`,
        then its section, ``quant`` (default: the class's) and ``seed`` where the class has one.

        Raises:
            ValueError: a bad value, naming ``baselines.<method>`` and the field.
        """
        entry = ENTRY[Method(method)]
        names = {f.name for f in fields(entry.config)}
        data = {**entry.defaults, **self.section(method), **({"quant": quant} if quant is not None else {}),
                **({"seed": seed} if "seed" in names else {})}
        try:
            return from_mapping(entry.config, data, f"baselines.{entry.name}")
        except ValueError as err:
            text = str(err)
            raise ValueError(text if text.startswith("baselines.") else f"baselines.{entry.name}: {text}") from None

    def as_mapping(self) -> dict[str, dict[str, Any]]:
        return {m: dict(items) for m, items in self.sections}

    def changed(self, overrides: Mapping[str, Any], where: str = "baselines") -> "BaselineSettings":
        """These settings with ``{"<method>.<field>": value}`` overrides applied (validated)."""
        data = self.as_mapping()
        for dotted, value in overrides.items():
            method, _, key = str(dotted).partition(".")
            if not key:
                raise ValueError(f"{where}: '{dotted}' is not a '<method>.<field>' of the baselines section "
                                 "(e.g. gptq.damp)")
            data.setdefault(method, {})[key] = value
        return read_baselines(data, where)


def read_baselines(data: Mapping[str, Any] | None, where: str = "baselines") -> BaselineSettings:
    """params.yaml's ``baselines`` section, each method's settings checked by building its config.

    Raises:
        ValueError: a key of the old flat section (with where it goes), a method that is not a
            baseline (with a suggestion), a section that is not a mapping, ``quant`` or ``seed``
            set, a field its config lacks or a bad value (naming ``baselines.<method>.<field>``).
    """
    sections = []
    for method, body in dict(data or {}).items():
        if method in MOVED_KEYS:
            raise ValueError(f"{where}.{method} was removed: the section holds one mapping per method now, "
                             f"e.g. {where}: {{{MOVED_KEYS[method]}}}")
        names = [m.value for m in BASELINES]
        if method not in names:
            close = difflib.get_close_matches(str(method), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"{where}: '{method}' is not a baseline{hint}; baselines: {', '.join(names)}")
        if body is not None and not isinstance(body, Mapping):
            raise ValueError(f"{where}.{method} = {body!r}: need a mapping of its config's fields, "
                             f"e.g. {where}: {{hawq: {{probes: 2}}}}")
        body = dict(body or {})
        for key in _ROW_FIELDS:
            if key in body:
                raise ValueError(f"{where}.{method}.{key}: set by the pipeline ({'the quant section' if key == 'quant' else 'the seeds list'}), "
                                 "not per method")
        sections.append((method, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in body.items()))))
    settings = BaselineSettings(tuple(sorted(sections)))
    for method, _ in settings.sections:
        settings.config(method)  # every bad field or value fails here, at load
    return settings
