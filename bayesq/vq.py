"""Small vector quantisation (VQ): g consecutive weights share one index into a K-entry codebook.

The caller cuts weights into N vectors ``x_n`` of g (2, 4 or 8) consecutive weights. One
codebook ``C`` (K, g), stored in fp16, serves them all; each vector stores a log2(K)-bit index,
so the payload is ``log2(K) / g`` bits per weight plus ``K g 16`` codebook bits
(``storage.vq_cost_bits``). With per-coordinate metric weights ``omega`` (precisions
``1/sigma^2`` give the whitened cost of docs/method.md section 2) the fitted distortion is

    D(C, a) = sum_n sum_d omega_nd (C_{a_n d} - x_nd)^2,

minimised by weighted Lloyd iterations after k-means++ seeding in the same metric:

    a_n  = argmin_k sum_d omega_nd (C_kd - x_nd)^2                         (assignment)
    C_kd = sum_{n: a_n = k} omega_nd x_nd / sum_{n: a_n = k} omega_nd      (centroid, per coordinate)

Each step cannot increase D (block-coordinate descent); a codeword with no vectors keeps its
value. Posterior expectation, with w ~ N(mu, diag sigma^2):
``E_w[sum omega (C_{a_n} - w)^2] = D(C, a) + sum omega sigma^2`` exactly for the assignment
``a`` made on the means (what is stored), and ``E_w[min_k sum omega (C_k - w)^2]`` (the
quantiser applied to posterior samples, the analogue of ``codebook.levels_cost``) is at most
that; :func:`vq_expected_cost` estimates the latter by Monte Carlo. ``tests/test_vq.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from bayesq.books import CodeBook, Field, Need, Slot, register_book
from bayesq.levels import _round_stored
from bayesq.storage import header_bits, vq_cost_bits

MAX_CODEBOOK = 4096  # 12 index bits
_CHUNK_ELEMENTS = 1 << 22  # vectors x codewords per distance block


def _check(x: torch.Tensor, omega: torch.Tensor, k: int) -> None:
    if x.ndim != 2 or omega.shape != x.shape:
        raise ValueError(f"x and omega must both be (N, g), got {tuple(x.shape)} and {tuple(omega.shape)}")
    if bool((omega < 0).any()):
        raise ValueError("omega (metric weights) must be non-negative")
    if k > MAX_CODEBOOK:
        raise ValueError(f"codebook of K={k} entries exceeds {MAX_CODEBOOK} (12 index bits): "
                         "use a smaller K, or fewer weights per vector g")
    if k < 1 or k & (k - 1):
        raise ValueError(f"K must be a power of two (index bits = log2 K), got {k}")


def vq_assign(x: torch.Tensor, omega: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest codeword of each vector in the omega metric.

    Args:
        x, omega: (N, g) float64 vectors and metric weights; codebook: (K, g) float64.

    Returns:
        (assign (N,) int64, cost (N,) float64 ``sum_d omega_nd (C_{a_n d} - x_nd)^2``).
    """
    assign = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    rows = max(1, _CHUNK_ELEMENTS // codebook.shape[0])
    for s in range(0, x.shape[0], rows):
        xs, om = x[s:s + rows], omega[s:s + rows]
        # (r, K): sum_d omega (c - x)^2 = omega c^2 - 2 omega x c + omega x^2, the last term dropped
        d = om @ (codebook * codebook).T - 2 * (om * xs) @ codebook.T
        assign[s:s + rows] = d.argmin(1)
    return assign, (omega * (codebook[assign] - x) ** 2).sum(1)


def vq_lloyd_step(
    x: torch.Tensor, omega: torch.Tensor, codebook: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One weighted Lloyd iteration: assign to ``codebook``, then per-coordinate weighted centroids.

    Returns:
        (new codebook (K, g), assignment (N,) to the *input* codebook, D of the input codebook).
    """
    _check(x, omega, codebook.shape[0])
    assign, cost = vq_assign(x, omega, codebook)
    num = torch.zeros_like(codebook).index_add_(0, assign, omega * x)  # (K, g)
    den = torch.zeros_like(codebook).index_add_(0, assign, omega)  # (K, g)
    new = torch.where(den > 0, num / den.clamp_min(1e-300), codebook)
    return new, assign, float(cost.sum())


def _kmeanspp(x: torch.Tensor, omega: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: first centre ~ vector weight, then ~ weighted squared distance D^2."""
    base = omega.sum(1)  # (N,) weight of each vector
    base = base if bool((base.sum() > 0)) else torch.ones_like(base)
    first = torch.multinomial(base, 1, generator=gen)
    centers = [x[first]]  # (1, g) each
    d2 = (omega * (x - centers[0]) ** 2).sum(1)  # (N,)
    for _ in range(1, k):
        p = d2 if bool(d2.sum() > 0) else base
        centers.append(x[torch.multinomial(p, 1, generator=gen)])
        d2 = torch.minimum(d2, (omega * (x - centers[-1]) ** 2).sum(1))
    return torch.cat(centers, 0)


def fit_vq(
    x: torch.Tensor, omega: torch.Tensor, k: int, *, iters: int = 15, rtol: float = 1e-4,
    seed: int = 0, lut_bits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Weighted k-means codebook of K entries for (N, g) vectors.

    k-means++ seeding (seeded generator, D^2 in the omega metric), then at most ``iters``
    :func:`vq_lloyd_step` iterations, stopping once D falls by at most ``rtol`` (relative).
    The codebook is rounded to the stored format (``lut_bits`` 16 / 32 / 64 = fp16 / fp32 /
    unrounded) and the vectors are reassigned to the rounded codebook.

    Args:
        x: (N, g) float64 vectors (posterior means); omega: (N, g) float64 metric weights.
        k: codebook size, a power of two <= 4096.

    Returns:
        (codebook (K, g) float64 as stored, assign (N,) int64, cost = D(codebook, assign)).
    """
    _check(x, omega, k)
    if iters < 0 or rtol < 0:
        raise ValueError(f"need iters >= 0 and rtol >= 0, got {iters}, {rtol}")
    gen = torch.Generator(device=x.device).manual_seed(seed)
    codebook, prev = _kmeanspp(x, omega, k, gen), None
    for _ in range(iters):
        new, _, obj = vq_lloyd_step(x, omega, codebook)
        if prev is not None and prev - obj <= rtol * prev:
            break
        codebook, prev = new, obj
    codebook = _round_stored(codebook, lut_bits, "VQ codebook")
    assign, cost = vq_assign(x, omega, codebook)
    return codebook, assign, float(cost.sum())


def vq_expected_cost(
    mu: torch.Tensor, sigma: torch.Tensor, omega: torch.Tensor, codebook: torch.Tensor,
    samples: int = 256, seed: int = 0,
) -> float:
    """Monte Carlo ``E_{w ~ N(mu, sigma^2)}[sum_n min_k sum_d omega_nd (C_kd - w_nd)^2]``.

    Args:
        mu, sigma, omega: (N, g) float64 (sigma >= 0); codebook: (K, g) float64.
        samples: number of posterior draws (seeded); the standard error falls as 1/sqrt(samples).

    Returns:
        The sample mean (float). ``D(C, a(mu)) + sum omega sigma^2`` is an upper bound of the
        exact value (see the module docstring).
    """
    _check(mu, omega, codebook.shape[0])
    if sigma.shape != mu.shape or bool((sigma < 0).any()) or samples < 1:
        raise ValueError("need sigma >= 0 shaped like mu (N, g) and samples >= 1")
    gen = torch.Generator(device=mu.device).manual_seed(seed)
    per = max(1, _CHUNK_ELEMENTS // (mu.numel() * codebook.shape[0]))  # draws per batch
    total = 0.0
    for s in range(0, samples, per):
        m = min(per, samples - s)
        noise = torch.randn((m, *mu.shape), dtype=mu.dtype, device=mu.device, generator=gen)  # (m, N, g)
        w = (mu + sigma * noise).reshape(-1, mu.shape[1])  # (m N, g)
        total += float(vq_assign(w, omega.repeat(m, 1), codebook)[1].sum())
    return total / samples


@register_book
@dataclass(frozen=True)
class VQBook(CodeBook):
    """One layer's VQ codebook over (G, g) group rows cut into vectors of ``dim`` weights.

    Attributes:
        bits: bits per weight, ``log2(K) / dim``.
        codebook: (K, dim) float64 as stored (fp16-rounded).
        omega: (G, g) float64 metric weights of the assignment (not stored: the stored model
            holds only the indices and the codebook).

    Codes are (G, g / dim) int64 indices; ``g`` must be a multiple of ``dim``. Stored (kind
    ``vq``): the (K, dim) codebook (``lut_bits``); the kernels hold VQ layers dequantised, and
    distillation leaves the codebook as stored.
    """

    kind: ClassVar[str] = "vq"
    decodable: ClassVar[bool] = False
    bits: int
    codebook: torch.Tensor
    omega: torch.Tensor

    @property
    def dim(self) -> int:
        return int(self.codebook.shape[1])

    @property
    def code_dim(self) -> int:
        return self.dim

    def take(self, rows: torch.Tensor) -> "VQBook":
        """The selected groups' book: the same codebook (a loaded book holds no omega: none taken)."""
        return VQBook(self.bits, self.codebook, self.omega[rows] if self.omega.numel() else self.omega)

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """(G, g / dim) int64 indices of the nearest codeword in the omega metric (:func:`vq_assign`)."""
        x, om = w.reshape(-1, self.dim), self.omega.reshape(-1, self.dim)  # (G g / dim, dim)
        return vq_assign(x, om, self.codebook)[0].reshape(w.shape[0], -1)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(G, g) float64 codewords of the (G, g / dim) indices."""
        return self.codebook[codes].reshape(codes.shape[0], -1)

    @classmethod
    def unit_cost_bits(cls, n_weights: int, n_groups: int, bits: int, n_choices: int, quant,
                       rows: int = 1) -> int:
        d = quant.vq_dim
        return vq_cost_bits(math.ceil(n_weights / d), d, 2 ** (bits * d), quant.lut_bits) + header_bits(n_choices)

    def export_fields(self, sel: torch.Tensor, blocks, quant) -> list[Field]:
        return [Field("vq", torch.zeros(1, dtype=torch.int64), self.codebook.reshape(1, -1), bits=quant.lut_bits,
                      shape=tuple(self.codebook.shape))]

    @classmethod
    def export_slots(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping) -> list[Slot]:
        return []  # the codebook is read whole (from_export)

    @classmethod
    def read_code_dim(cls, layout: Mapping, need: Need) -> int:
        return int(need("vq").shape[1])

    @classmethod
    def from_export(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping,
                    fields: Mapping[str, torch.Tensor], need: Need) -> "VQBook":
        return cls(bits, need("vq").double(), torch.zeros(0, dtype=torch.float64))
