"""The codebook interface (bayesq.books): every kind implements it, round-trips through its export
tensors, its distillation parameters and the kernels' layout, and a kind defined here (registered
through the interface, no library edit) goes through export save / load."""

import inspect
import math
from dataclasses import dataclass, fields
from typing import ClassVar, Mapping

import pytest
import torch
from torch import nn

from bayesq.blocks import LayerBlocks
from bayesq.books import BOOKS, CodeBook, Field, Slot, book_class, register_book
from bayesq.config import QuantConfig
from bayesq.export import layer_from_tensors, layer_tensors, load, read_export, save_export
from bayesq.grids import UniformGrids
from bayesq.kernels.packed import pack_weight
from bayesq.levels import LevelTables, MulawTables, mulaw_levels
from bayesq.result import QuantizedWeight
from bayesq.storage import header_bits, lut_unit_cost_bits, mulaw_unit_cost_bits, unit_cost_bits, vq_cost_bits
from bayesq.vq import VQBook

QUANT = QuantConfig(bits=(2, 3, 4), group_size=8, unit_groups=2, vq_dim=2)
SHAPE = (6, 16)  # 12 groups of 8 weights, 6 units of 2 groups


def _layer() -> LayerBlocks:
    return LayerBlocks("w", SHAPE, QUANT.group_size, QUANT.unit_groups, False)


def _book(kind: str, bits: int, n: int, gen: torch.Generator) -> CodeBook:
    """A stored-precision book of ``kind`` for ``n`` groups (a unit's groups share a LUT)."""
    k = 2**bits
    if kind == "grid":
        scale = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.1 + 1e-3).half().double()
        return UniformGrids(bits, scale, torch.randint(0, k, (n,), generator=gen).double())
    if kind == "lut":
        levels = torch.randn(n // QUANT.unit_groups, k, generator=gen, dtype=torch.float64).half().double()
        return LevelTables(bits, levels.sort(1).values, torch.arange(n) // QUANT.unit_groups)
    if kind == "mulaw":
        absmax = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
        return MulawTables(bits, mulaw_levels(absmax, bits, QUANT.mulaw_mu, QUANT.scale_bits), torch.arange(n))
    codebook = torch.randn(2 ** (bits * QUANT.vq_dim), QUANT.vq_dim, generator=gen, dtype=torch.float64)
    return VQBook(bits, codebook.half().double(), torch.ones(n, QUANT.group_size, dtype=torch.float64))


def _weight(kinds: Mapping[int, str], seed: int = 0) -> QuantizedWeight:
    """Random codes and books: unit u at bit-width ``list(kinds)[u % len(kinds)]``."""
    gen = torch.Generator().manual_seed(seed)
    lb = _layer()
    bits = list(kinds)
    group_bits = torch.tensor([bits[u % len(bits)] for u in range(lb.n_units)])[lb.group_unit()]
    dim = QUANT.vq_dim if "vq" in kinds.values() else 1
    books = {b: _book(kinds[b], b, int((group_bits == b).sum()), gen) for b in bits}
    per_code = torch.tensor([books[int(b)].code_dim for b in group_bits])
    codes = (torch.rand(lb.n_groups, lb.group_size // dim, generator=gen, dtype=torch.float64)
             * (2.0 ** (group_bits * per_code))[:, None]).floor().long()
    return QuantizedWeight(lb, group_bits, codes, books)


def _same_book(a: CodeBook, b: CodeBook) -> None:
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "omega":  # VQ's assignment metric is not stored
            continue
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name


def test_books_every_kind_registered_and_complete():
    assert {"grid", "lut", "mulaw", "vq"} <= set(BOOKS)
    for kind, cls in BOOKS.items():
        assert issubclass(cls, CodeBook) and not inspect.isabstract(cls), kind
        assert cls.kind == kind and book_class(kind) is cls
    with pytest.raises(KeyError, match="unknown codebook kind"):
        book_class("no-such-kind")


@pytest.mark.parametrize("kinds", [{2: "grid", 3: "grid", 4: "grid"}, {2: "lut", 3: "grid"}, {3: "mulaw", 4: "grid"},
                                   {2: "lut", 3: "mulaw", 4: "grid"}, {2: "vq"}])
def test_books_export_tensors_round_trip(kinds):
    qw = _weight(kinds, seed=len(kinds))
    t, layout = layer_tensors(qw, QUANT)
    back = layer_from_tensors("w", t, layout)
    assert torch.equal(back.group_bits, qw.group_bits) and torch.equal(back.codes, qw.codes)
    for b, book in qw.books.items():
        _same_book(back.books[b], book)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert layout["kinds"] == {str(b): k for b, k in kinds.items()}


def test_books_one_whole_tensor_per_layer():
    # the format has one L/vq tensor: two VQ bit-widths in one layer cannot be written
    with pytest.raises(ValueError, match="whole tensor 'vq'"):
        layer_tensors(_weight({2: "vq", 3: "vq"}), QUANT)


@pytest.mark.parametrize("kind", ["grid", "lut", "mulaw", "vq"])
def test_books_codes_values_round_trip(kind):
    gen = torch.Generator().manual_seed(3)
    book = _book(kind, 2, 4, gen)
    n = QUANT.group_size // book.code_dim
    codes = torch.randint(0, 2 ** (2 * book.code_dim), (4, n), generator=gen)
    w = book.dequantize(codes)
    assert w.dtype == torch.float64 and w.shape == (4, QUANT.group_size)
    assert torch.equal(book.dequantize(book.quantize(w)), w)  # values decode to themselves
    assert torch.equal(book.take(torch.tensor([1, 2])).dequantize(codes[1:3]), w[1:3])


@pytest.mark.parametrize("kind", ["grid", "lut", "mulaw", "vq"])
def test_books_trained_parameters_round_trip(kind):
    book = _book(kind, 3, 4, torch.Generator().manual_seed(5))
    codes = torch.randint(0, 2 ** (3 * book.code_dim), (4, QUANT.group_size // book.code_dim),
                          generator=torch.Generator().manual_seed(6))
    params = book.trainable()
    decoded = book.decode_trained({k: v.float() for k, v in params.items()}, codes)
    assert decoded.dtype == torch.float32 and torch.allclose(decoded.double(), book.dequantize(codes), atol=1e-6)
    again, new_codes = book.from_trained(params, codes, QUANT.scale_bits, QUANT.lut_bits)
    if kind == "mulaw":  # trained mu-law tables are stored as tables: rounded to the LUT precision
        book = MulawTables(book.bits, book.levels.half().double(), book.row)
    _same_book(again, book)
    assert torch.equal(new_codes, codes)


@pytest.mark.parametrize("kind", ["grid", "lut", "mulaw"])
def test_books_kernel_levels_match_dequantize(kind):
    book = _book(kind, 2, 4, torch.Generator().manual_seed(7))
    every_code = torch.arange(4).expand(4, -1)
    assert torch.equal(book.group_levels(), book.dequantize(every_code))
    assert (book.affine_fields() is not None) == (kind == "grid") and book.decodable


def test_books_unit_cost_bits_match_storage():
    n, g, b, choices = 64, 4, 3, 3
    assert book_class("grid").unit_cost_bits(n, g, b, choices, QUANT) == unit_cost_bits(n, g, b, choices, 16)
    assert book_class("lut").unit_cost_bits(n, g, b, choices, QUANT) == lut_unit_cost_bits(n, b, choices, 16)
    assert book_class("mulaw").unit_cost_bits(n, g, b, choices, QUANT) == mulaw_unit_cost_bits(n, g, b, choices, 16)
    assert book_class("vq").unit_cost_bits(n, g, b, choices, QUANT) == (vq_cost_bits(32, 2, 64, 16)
                                                                      + header_bits(choices))


# ---- a kind defined only here ---------------------------------------------------------------------

@dataclass(frozen=True)
class SymmetricGrids(CodeBook):
    """Toy kind: ``level_k = scale * (2k + 1 - K)`` (symmetric, no zero-point), one fp32 scale per
    group stored in the layer's own tensor ``sym``."""

    kind: ClassVar[str] = "test-symmetric"
    bits: int
    scale: torch.Tensor

    def take(self, rows):
        return SymmetricGrids(self.bits, self.scale[rows])

    def group_levels(self):
        k = 2**self.bits
        return self.scale[:, None] * (2 * torch.arange(k, dtype=torch.float64) + 1 - k)

    def quantize(self, w):
        k = 2**self.bits
        return torch.round((w / self.scale[:, None] + k - 1) / 2).clamp(0, k - 1).long()

    def dequantize(self, codes):
        return self.group_levels().gather(1, codes)

    @classmethod
    def unit_cost_bits(cls, n_weights, n_groups, bits, n_choices, quant):
        return n_weights * bits + 32 * n_groups + header_bits(n_choices)

    def export_fields(self, sel, blocks, quant):
        return [Field("sym", sel, self.scale, bits=32)]

    @classmethod
    def export_slots(cls, bits, sel, blocks, layout):
        return [Slot("sym", sel)]

    @classmethod
    def from_export(cls, bits, sel, blocks, layout, fields, need):
        return cls(bits, fields["sym"][:, 0])


@pytest.fixture
def symmetric_kind():
    register_book(SymmetricGrids)
    yield SymmetricGrids
    del BOOKS[SymmetricGrids.kind]


def test_books_new_kind_export_save_load_without_library_edits(tmp_path, symmetric_kind):
    quant = QuantConfig(bits=(2, 3), group_size=8, unit_groups=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 6)).eval()
    lb = LayerBlocks("0", (6, 16), 8, 1, True)
    gen = torch.Generator().manual_seed(11)
    group_bits = torch.tensor([2, 3] * (lb.n_groups // 2))
    n2, n3 = int((group_bits == 2).sum()), int((group_bits == 3).sum())
    books = {2: SymmetricGrids(2, (torch.rand(n2, generator=gen, dtype=torch.float64) + 0.1).float().double()),
             3: UniformGrids(3, (torch.rand(n3, generator=gen, dtype=torch.float64) * 0.1).half().double(),
                             torch.randint(0, 8, (n3,), generator=gen).double())}
    codes = (torch.rand(lb.n_groups, 8, generator=gen, dtype=torch.float64) * 2.0 ** group_bits[:, None]).floor().long()
    qw = QuantizedWeight(lb, group_bits, codes, books)
    with torch.no_grad():
        net[0].weight.copy_(qw.dequantize().float())
    accounted = sum(book_class(books[int(group_bits[u])].kind).unit_cost_bits(n, g, int(group_bits[u]), 2, quant)
                    for u, (n, g) in enumerate(lb.unit_sizes()))
    path = tmp_path / "toy.safetensors"
    info = save_export(path, net, {"0": qw}, quant, accounted)
    assert accounted <= info.payload_bits < accounted + 8 * 3
    back = read_export(path).weights["0"]
    assert isinstance(back.books[2], SymmetricGrids) and torch.equal(back.books[2].scale, books[2].scale)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert pack_weight(back).mode == "lut"  # the kernels decode it through its levels
    model = load(path, skeleton=nn.Sequential(nn.Linear(16, 6)))
    x = torch.randn(5, 16, generator=gen)
    with torch.no_grad():
        assert torch.allclose(model(x), net(x), atol=1e-6)
    assert math.isfinite(info.payload_avg_bits)


def test_new_codebook_is_one_module_quantize_model_and_export_run_it(tmp_path, symmetric_kind):
    """A codebook defined only here (its book class and its fit) is what quant.codebook names:
    the loss table fits it, quantize_model meets the budget with it and its export loads back to
    the same outputs; the library is not edited."""
    from bayesq.books import FITS, register_fit

    def fit(layer_fit, b):  # scale: the group's largest magnitude over the outermost level
        book = SymmetricGrids(b, (layer_fit.mu.abs().max(1).values / (2**b - 1)).clamp_min(1e-8).float().double())
        return book, layer_fit.units(layer_fit.levels(book.group_levels()))

    register_fit("test-symmetric")(fit)
    try:
        _quantize_with_the_new_codebook(tmp_path)
    finally:
        del FITS["test-symmetric"]
    with pytest.raises(ValueError, match="quant.codebook = 'test-symmetric': choose from"):
        QuantConfig(codebook="test-symmetric", rounding="nearest")  # unregistered again


def _quantize_with_the_new_codebook(tmp_path):
    from bayesq import BayesQConfig, quantize_model
    from bayesq.config import DistillConfig
    from bayesq.export import load, save_export

    with pytest.raises(ValueError, match="error feedback needs uniform grids; codebook is 'test-symmetric'"):
        QuantConfig(codebook="test-symmetric")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    cal = [torch.randn(8, 16) for _ in range(3)]
    q = QuantConfig(codebook="test-symmetric", rounding="nearest", group_size=64, unit_groups=2)
    res = quantize_model(net, cal, BayesQConfig(budget=4.0, quant=q, distill=DistillConfig(max_budget=0)),
                         progress=False)
    assert res.average_bits <= 4.0
    assert any(isinstance(b, SymmetricGrids) for qw in res.weights.values() for b in qw.books.values())
    path = tmp_path / "sym.safetensors"
    save_export(path, res.model, res.weights, q, res.allocation.total_bits)
    x, skeleton = torch.randn(5, 16), nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        torch.testing.assert_close(load(path, skeleton=skeleton)(x), res.model(x))
