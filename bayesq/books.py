"""The codebook interface: what every codebook kind implements, and the registry of kinds.

A codebook ("book") holds what decodes the integer codes of the groups quantised at one
bit-width of one layer (``QuantizedWeight.books[b]``). Every kind is one class deriving from
:class:`CodeBook` and registered under its :attr:`CodeBook.kind` name with :func:`register_book`:

    grid   ``bayesq.grids.UniformGrids``   scale * (code - zero), one fp16 scale and zero per group
    lut    ``bayesq.levels.LevelTables``    a sorted look-up table per allocation unit (Lloyd)
    mulaw  ``bayesq.levels.MulawTables``    the fixed mu-law table times one scale per group
    vq     ``bayesq.vq.VQBook``               one (K, dim) codebook of weight vectors per layer

Callers (storage accounting, the export format, the packed kernels' layout, distillation) call the
methods below and never branch on the class, so a new kind is one class here plus its fit in
``bayesq.expected_loss`` (docs/method.md section 25).

Export: a layer's file tensors (``L/scale``, ``L/zero``, ``L/lut``, ``L/vq``, or a new kind's own
names) are shared by the layer's books. Each book hands :func:`bayesq.export.layer_tensors` its
:class:`Field` entries, keyed by group index; the export orders the entries of one name by key,
concatenates them and stores them as floats (``bits``) or as a packed bit stream (``widths``).
Reading, each kind's :meth:`CodeBook.export_slots` says which entries of which name it owns
(keys, lengths, widths: the same as it wrote, known from the layout alone), the export cuts them
out and :meth:`CodeBook.from_export` rebuilds the book.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

Need = Callable[..., torch.Tensor]  # need(key, n=None): a layer tensor of the export, checked


@dataclass(frozen=True)
class Field:
    """Entries one book writes into the export tensor ``name`` of its layer.

    Attributes:
        name: the tensor's name inside the layer (``scale``, ``zero``, ``lut``, ``vq``, ...).
        key: (m,) int64 order of the entries (the group index an entry belongs to: the first group
            of its unit for per-unit entries); entries of all books are stored in key order.
        values: (m,) or (m, L) entries (float64 values, or int64 for a packed stream).
        widths: (m,) int64 bits of each entry of a packed integer stream (L = 1); None: floats.
        bits: stored float precision (16: fp16, else fp32) of float fields.
        shape: the stored tensor's shape (a field written whole by one book, e.g. ``vq``);
            None: one flat tensor.
    """

    name: str
    key: torch.Tensor
    values: torch.Tensor
    widths: torch.Tensor | None = None
    bits: int = 16
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Slot:
    """The entries of export tensor ``name`` one book reads back: (m,) keys, ``length`` values
    each, and for packed streams the (m,) widths (as the book's :class:`Field` wrote them)."""

    name: str
    key: torch.Tensor
    length: int = 1
    widths: torch.Tensor | None = None


class CodeBook(ABC):
    """One codebook kind (see the module docstring). Subclasses are frozen dataclasses with at
    least a ``bits`` field; rows of every per-group tensor follow the groups at that bit-width."""

    kind: ClassVar[str]  # the name in export layouts and loss tables
    decodable: ClassVar[bool] = True  # the packed kernels decode its codes (else: held dequantised)
    bits: int

    # ---- codes <-> values ---------------------------------------------------------------------
    @abstractmethod
    def take(self, rows: torch.Tensor) -> "CodeBook":
        """The book of the selected groups (index or boolean mask)."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """(G, n) int64 codes of (G, g) weights (n = g / code_dim)."""

    @abstractmethod
    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(G, g) float64 weights of (G, n) codes."""

    @property
    def code_dim(self) -> int:
        """Weights one code stands for (1; VQ: the vector length)."""
        return 1

    # ---- storage ------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def unit_cost_bits(cls, n_weights: int, n_groups: int, bits: int, n_choices: int, quant,
                       rows: int = 1) -> int:
        """Exact bits of one allocation unit of ``n_weights`` weights in ``n_groups`` groups at
        ``bits``: codes, this kind's metadata and the bit-width header (``bayesq.storage``);
        ``rows``: the output rows the unit spans, passed only when above 1 (a whole layer of a
        row-blocked target, whose cost :func:`bayesq.targets.matmulnbits_unit_cost_bits` depends
        on it), so a codebook that no such target stores need not take it."""

    # ---- export format ------------------------------------------------------------------------
    @abstractmethod
    def export_fields(self, sel: torch.Tensor, blocks, quant) -> list[Field]:
        """What the export stores besides the codes; ``sel`` (n,) are the layer's group indices
        of this book's rows, ``blocks`` the layer's ``LayerBlocks``, ``quant`` the QuantConfig."""

    def layout_entries(self, quant) -> dict:
        """Entries of the layer's JSON layout this kind needs to rebuild itself (default none)."""
        return {}

    @classmethod
    @abstractmethod
    def export_slots(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping) -> list[Slot]:
        """The entries :meth:`export_fields` wrote for the groups ``sel`` at ``bits``."""

    @classmethod
    def read_code_dim(cls, layout: Mapping, need: Need) -> int:
        """:attr:`code_dim` of the stored book, before it is rebuilt (default 1)."""
        return 1

    @classmethod
    @abstractmethod
    def from_export(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping,
                    fields: Mapping[str, torch.Tensor], need: Need) -> "CodeBook":
        """The book again from its slots' entries (``fields[name]``: (m, length) float64, or
        (m, 1) int64 for packed streams) or whole tensors of the layer (``need(key)``)."""

    # ---- packed kernels -----------------------------------------------------------------------
    def affine_fields(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """((n,) scale, (n,) zero) when the book decodes ``scale * (code - zero)``, else None."""
        return None

    def with_affine(self, scale: torch.Tensor, zero: torch.Tensor) -> "CodeBook":
        """The affine book with other scales and zero-points (affine kinds only)."""
        raise ValueError(f"a '{self.kind}' codebook has no scales and zero-points: it needs uniform grids")

    def group_levels(self) -> torch.Tensor:
        """(n, 2**bits) float64: the value of every code of each group (the kernels' LUT rows)."""
        raise ValueError(f"a '{self.kind}' codebook has no per-group levels")

    # ---- distillation -------------------------------------------------------------------------
    def trainable(self) -> dict[str, torch.Tensor]:
        """The float parameters distillation trains (name -> float64 tensor); default none."""
        return {}

    def decode_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
        """(n, g) float32 weights of ``codes``, differentiable in ``params`` (:meth:`trainable`)."""
        return self.dequantize(codes).float()

    def from_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor, scale_bits: int,
                     lut_bits: int) -> tuple["CodeBook", torch.Tensor]:
        """(book, codes) with trained ``params`` (float64, detached) rounded to their stored
        precision; the codes change only where the book reorders its values."""
        return self, codes


BOOKS: dict[str, type[CodeBook]] = {}


def register_book(cls: type[CodeBook]) -> type[CodeBook]:
    """Class decorator: make ``cls`` the codebook of kind ``cls.kind`` (export reading, storage)."""
    if BOOKS.get(cls.kind, cls) is not cls:
        raise ValueError(f"codebook kind {cls.kind!r} is already registered by {BOOKS[cls.kind].__name__}")
    BOOKS[cls.kind] = cls
    return cls


def book_class(kind: str) -> type[CodeBook]:
    """The registered class of ``kind``."""
    if kind not in BOOKS:
        raise KeyError(f"unknown codebook kind {kind!r}; registered: {sorted(BOOKS)}")
    return BOOKS[kind]


Fit = Callable[..., tuple[CodeBook, torch.Tensor]]  # fit(layer_fit, bits) -> (book, (U,) unit losses)
FITS: dict[str, Fit] = {}  # quant.codebook name -> how a loss table fits that codebook
UNIFORM_FITS: set[str] = set()  # fits whose books are affine grids (error-feedback rounding can use them)


def register_fit(name: str, *, uniform: bool = False) -> Callable[[Fit], Fit]:
    """Decorator: ``fit(layer_fit, bits) -> (book, unit_loss)`` is how a loss table fits the
    codebook ``quant.codebook = name`` at one bit-width.

    ``layer_fit`` is the layer's fit context (:class:`bayesq.expected_loss._LayerFit`): group rows
    ``mu`` / ``mask`` / ``omega`` (G, g) float64, the metric-weighted costs ``uniform(grids)`` and
    ``levels(levels)`` ((G,) per group), ``units(group_cost)`` (the (U,) table entries), the
    layer's ``blocks`` and ``cfg``. ``uniform``: its books are affine grids, so error-feedback
    rounding may use them. A new codebook is a :class:`CodeBook` subclass (``register_book``)
    and its fit (``register_fit``), both in one module; ``quant.codebook`` accepts the name once
    that module is imported."""
    def deco(fit: Fit) -> Fit:
        if FITS.get(name, fit) is not fit:
            raise ValueError(f"codebook fit {name!r} is already registered")
        FITS[name] = fit
        if uniform:
            UNIFORM_FITS.add(name)
        return fit
    return deco


def stored_float(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 values rounded to the stored float format (16: fp16, 32: fp32, 64: unchanged)."""
    return x.to(torch.float16 if bits == 16 else torch.float32).double() if bits < 64 else x
