"""Declaring and validating configuration fields, and building configurations from mappings.

Each field's checks sit next to it as metadata (:func:`setting` with :class:`Rule` helpers such as
:func:`at_least`, :func:`within`, :func:`one_of`), and one generic :func:`validate`, called from
every ``__post_init__``, coerces ``Enum``-typed fields from their annotation, requires ``bool``
fields to be true or false, runs each field's rules and then the class's short list of
cross-field rules. Every error names the offending field and value
(``section.field = value: why``), and :func:`from_mapping` rejects unknown keys with the closest
valid key, so a misspelled setting never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Callable, Iterable, Mapping


@dataclass(frozen=True)
class Rule:
    """One check of a field's value: ``ok(value)`` must hold, else construction fails with
    ``{section}.{name} = {value!r}: {why}`` (``shown(value)`` in place of the value where set,
    e.g. the offending members of a list). A predicate that raises ``TypeError`` or ``ValueError``
    (a string where a number belongs) fails."""

    ok: Callable[[Any], bool]
    why: str
    shown: Callable[[Any], Any] | None = None

    def holds(self, value: Any) -> bool:
        try:
            return bool(self.ok(value))
        except (TypeError, ValueError):
            return False

    def show(self, value: Any) -> Any:
        try:
            return self.shown(value) if self.shown else value
        except (TypeError, ValueError):
            return value


def rule(ok: Callable[[Any], bool], why: str, shown: Callable[[Any], Any] | None = None) -> Rule:
    """A field rule with its own predicate and message."""
    return Rule(ok, why, shown)


def _says(what: str, claim: str, note: str) -> str:
    return f"{what + ' ' if what else ''}{claim}{f' ({note})' if note else ''}"


def at_least(lo: float, note: str = "", *, what: str = "") -> Rule:
    """``value >= lo``: "must be >= lo (note)"."""
    return Rule(lambda v: v >= lo, _says(what, f"must be >= {lo}", note))


def above(lo: float, note: str = "", *, what: str = "") -> Rule:
    """``value > lo``: "must be > lo (note)"."""
    return Rule(lambda v: v > lo, _says(what, f"must be > {lo}", note))


def integer(lo: int, note: str = "") -> Rule:
    """A real ``int`` (not a bool, not a float) ``>= lo``: "must be an integer >= lo (note)"."""
    return Rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo,
                _says("", f"must be an integer >= {lo}", note))


def finite(lo: float) -> Rule:
    """A finite number ``>= lo``: "must be a finite number >= lo"."""
    return Rule(lambda v: lo <= v < math.inf, f"must be a finite number >= {lo}")


def within(interval: str, note: str = "", *, what: str = "") -> Rule:
    """``value`` in ``interval``, written as the message shows it: ``"(0, 1]"``, ``"[0, 1)"``."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    closed_lo, closed_hi = interval[0] == "[", interval[-1] == "]"

    def ok(v: Any) -> bool:
        return (v >= lo if closed_lo else v > lo) and (v <= hi if closed_hi else v < hi)

    return Rule(ok, _says(what, f"must be in {interval}", note))


def one_of(choices: Iterable[Any], why: str) -> Rule:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    return Rule(lambda v: v in choices, why)


def each_of(choices: Iterable[Any]) -> Rule:
    """Every member of a list is one of ``choices``: "choose from [...]", showing the others."""
    choices = tuple(choices)
    return Rule(lambda v: all(x in choices for x in v), f"choose from {list(choices)}",
                shown=lambda v: [x for x in v if x not in choices])


def ascending(example: str) -> Rule:
    """A strictly ascending list: "must be strictly ascending, e.g. <example>"."""
    return Rule(lambda v: list(v) == sorted(set(v)), f"must be strictly ascending, e.g. {example}")


def checks(*rules: Rule, convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Field metadata for :func:`validate`: ``rules`` in order (the first that fails names the
    field), then ``convert`` normalises the valid value (``tuple``, ``dict``, ...)."""
    return {"rules": rules, "convert": convert}


def setting(default: Any, *rules: Rule, convert: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with ``default`` and :func:`checks` ``(*rules, convert=convert)``."""
    return field(default=default, metadata=checks(*rules, convert=convert))


Relation = tuple[bool, str, Any, str]  # (holds, "section.field", value shown, why)


@dataclass(frozen=True)
class _FieldPlan:
    name: str
    enum: type[Enum] | None  # coerce the value (or, with many, each member) to this enum
    many: bool
    boolean: bool
    rules: tuple[Rule, ...]
    convert: Callable[[Any], Any] | None


@functools.cache
def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    """What :func:`validate` does to each field of dataclass ``cls``, read once from its
    annotations and field metadata."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in fields(cls):
        hint, enum, many = hints[f.name], None, False
        if isinstance(hint, type) and issubclass(hint, Enum):
            enum = hint
        elif typing.get_origin(hint) is tuple:
            args = typing.get_args(hint)
            if len(args) == 2 and args[1] is Ellipsis and isinstance(args[0], type) and issubclass(args[0], Enum):
                enum, many = args[0], True
        plan.append(_FieldPlan(f.name, enum, many, hint is bool, tuple(f.metadata.get("rules", ())),
                               f.metadata.get("convert")))
    return tuple(plan)


def _fail(section: str, name: str, value: Any, why: str) -> typing.NoReturn:
    raise ValueError(f"{section}.{name} = {value!r}: {why}")


def validate(cfg: Any, section: str, relations: Callable[[], Iterable[Relation]] | None = None) -> None:
    """Check and normalise the frozen dataclass ``cfg`` of params section ``section``.

    Per field, in declaration order: an ``Enum`` (or ``tuple[Enum, ...]``) field is coerced from
    its value ("choose from [...]" otherwise); a ``bool`` field must be true or false; the field's
    :func:`checks` rules run in order, and its ``convert`` normalises the value. Then
    ``relations()`` yields the class's cross-field rules, each ``(holds, "section.field", value,
    why)``; they are read lazily, so a later one may rely on an earlier one holding.

    Raises:
        ValueError: ``"{section}.{name} = {value!r}: {why}"`` for the first check that fails.
    """
    for f in _plan(type(cfg)):
        value = original = getattr(cfg, f.name)
        if f.enum is not None:
            try:
                value = tuple(f.enum(v) for v in value) if f.many else f.enum(value)
            except (TypeError, ValueError):
                _fail(section, f.name, original, f"choose from {[e.value for e in f.enum]}")
        elif f.boolean and not isinstance(value, bool):
            _fail(section, f.name, value, "must be true or false")
        for r in f.rules:
            if not r.holds(value):
                _fail(section, f.name, r.show(value), r.why)
        if f.convert is not None:
            try:
                value = f.convert(value)
            except (TypeError, ValueError) as err:
                _fail(section, f.name, value, f"cannot be read ({err})")
        if value is not original:
            object.__setattr__(cfg, f.name, value)
    for holds, where, value, why in (relations() if relations else ()):
        if not holds:
            raise ValueError(f"{where} = {value!r}: {why}")


def from_mapping(cls: type, data: Mapping[str, Any] | None, section: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with a suggestion.

    A class lists the keys that earlier versions had, each with what to do instead, in its
    ``removed_keys`` class attribute (``{key: hint}``).

    Raises:
        ValueError: ``"<section>: unknown key 'x' (did you mean 'y'?) ..."``, or
            ``"<section>.<key> was removed: <hint>"``.
    """
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}
    for key, hint in getattr(cls, "removed_keys", {}).items():
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
