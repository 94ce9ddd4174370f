"""A store for the one stage of BayesQ that does not depend on the budget or the grids: the
curvature pass (the posterior, the layers' input statistics and the FP logits it saw), so that
several runs on one model and one set of calibration inputs (other budgets, another target's bit
counts) make that pass once.

:func:`bayesq.quantize.quantize_model` looks the pass up by :func:`fingerprint` of everything it
reads, the library's own source included: the model's parameters and buffers (names, dtypes,
values), the layers quantised, the calibration batches, the posterior and quantiser settings,
the seed and how the pass splits its batches. A caller passes any object with ``get`` / ``put``
(:class:`StageCache`), e.g. :class:`MemoryCache` (the pipeline's ``deploy`` stage keeps one per
run: its BayesQ rows at five budgets of one model make one pass). A hit returns what the pass
returned, so the result is the same tensors as without a cache (``tests/test_stage_cache.py``
checks it element for element).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TypeVar

import torch
from torch import nn

T = TypeVar("T")


class StageCache(Protocol):
    """Where stage results are kept: ``get`` returns None for a key never ``put``."""

    def get(self, stage: str, key: str) -> Any | None: ...

    def put(self, stage: str, key: str, value: Any) -> None: ...


class MemoryCache:
    """A :class:`StageCache` in this process's memory (values copied in and out, so a caller that
    changes what it got changes nothing kept); ``max_items``: the most values kept, the least
    recently used dropped first (None: no limit; a curvature pass is about the model's size)."""

    def __init__(self, max_items: int | None = None) -> None:
        self.items: dict[tuple[str, str], Any] = {}
        self.max_items = max_items

    def get(self, stage: str, key: str) -> Any | None:
        value = self.items.pop((stage, key), None)
        if value is None:
            return None
        self.items[stage, key] = value  # the most recently used last
        return copy.deepcopy(value)

    def put(self, stage: str, key: str, value: Any) -> None:
        self.items.pop((stage, key), None)
        self.items[stage, key] = copy.deepcopy(value)
        while self.max_items is not None and len(self.items) > self.max_items:
            del self.items[next(iter(self.items))]


@lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 of the library's source files (``bayesq/**/*.py``): a change to the code is a new key."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    """Feed ``obj`` into the hash ``h``: tensors by dtype, shape and bytes; modules by their
    named parameters and buffers; dataclasses, mappings and sequences element by element."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, nn.Module):
        h.update(type(obj).__name__.encode())
        _feed(h, dict(obj.state_dict(keep_vars=False)))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(type(obj).__name__.encode())
        _feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k in obj:
            _feed(h, k)
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(obj, Enum):
        h.update(f"E{obj.value!r}".encode())
    elif obj is None or isinstance(obj, (str, int, float, bool)):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        raise TypeError(f"cannot fingerprint a {type(obj).__name__}: pass tensors, modules, dataclasses, "
                        "mappings, sequences or plain values")


def fingerprint(*parts: Any) -> str:
    """sha256 (hex) of ``parts`` and :func:`code_version`: equal only for equal values (tensors
    bit for bit, with their dtypes and shapes)."""
    h = hashlib.sha256(code_version().encode())
    for p in parts:
        _feed(h, p)
    return h.hexdigest()


def cached(cache: StageCache | None, stage: str, key: Callable[[], str], compute: Callable[[], T]) -> T:
    """``compute()``, or what ``cache`` holds for ``(stage, key())``; a computed value is put there.
    No cache: ``compute()`` (the key is not computed)."""
    if cache is None:
        return compute()
    k = key()
    value = cache.get(stage, k)
    if value is None:
        value = compute()
        cache.put(stage, k, value)
    return value
