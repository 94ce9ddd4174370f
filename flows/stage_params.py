"""The ``params.yaml`` sections of the stages with rows of their own: ``ablations``, ``shift``
(calibrate on one source, test on another) and ``deploy`` (the embedded models in a runtime next
to its own quantisers). Validated as every section is (:func:`bayesq.settings.validate`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from bayesq.baselines.ort import Peer
from bayesq.harness.data.sentiment import DOMAIN_FILES
from bayesq.harness.models.zoo import get_entry, known_models
from bayesq.settings import Relation, above, integer, one_of, rule, setting, validate
from flows.methods import DEPLOY_METHODS, SHIFT_METHODS, Method

MAX_ROW_LABEL = 60  # an ablation row's label: nested 18 columns deep in dvc.lock, wrapped past column 80


POSITIVE_BUDGETS = rule(lambda v: all(b > 0 for b in v), "list positive average bit budgets")


@dataclass(frozen=True)
class AblationConfig:
    """Ablation grid: ``rows[group][label]`` maps dotted keys (``quant.codebook``) to values.

    Each row is BayesQ with the main parameters overridden by its mapping; rows are validated
    by :func:`ablation_params`, so a typo in a key or value fails on load.
    """

    models: tuple[str, ...] = setting((), convert=tuple)
    budgets: tuple[float, ...] = setting((3.0, 3.5), POSITIVE_BUDGETS, convert=lambda v: tuple(float(b) for b in v))
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
                                         POSITIVE_BUDGETS, convert=lambda v: tuple(float(b) for b in v))
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
