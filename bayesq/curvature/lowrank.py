"""Low-rank-plus-isotropic truncation of a symmetric PSD matrix (e.g. a K-FAC factor).

With the eigendecomposition ``M = V diag(l) V^T`` (l descending), keep the top r pairs and
replace the rest by their mean:

    M_r = U diag(e) U^T + delta (I - U U^T),   U = V[:, :r],  e = l[:r],
    delta = mean(l[r:])   (0 when r = d).

``M_r`` has the same trace as ``M`` and is exact when r = d. Every product below goes through
U (d x r) only, never a dense d x d inverse:

    f(M_r + c I) X = U diag(f(e + c)) U^T X + f(delta + c) (X - U U^T X)

for f(x) = x, 1/x, x^-1/2.  Rank rule: the smallest r whose top eigenvalues explain at least a
fraction ``explained`` of the trace, capped by ``rank`` and ``max_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowRankFactor:
    """``U diag(eig) U^T + delta (I - U U^T)``.

    Attributes:
        U: (d, r) float64 orthonormal columns (top eigenvectors).
        eig: (r,) float64 kept eigenvalues, descending.
        delta: mean of the discarded eigenvalues (0.0 if none were discarded).
    """

    U: torch.Tensor
    eig: torch.Tensor
    delta: float

    @property
    def d(self) -> int:
        return int(self.U.shape[0])

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])

    def dense(self) -> torch.Tensor:
        """(d, d) float64 matrix represented."""
        eye = torch.eye(self.d, dtype=self.U.dtype, device=self.U.device)
        return (self.U * self.eig) @ self.U.T + self.delta * (eye - self.U @ self.U.T)

    def diag(self) -> torch.Tensor:
        """(d,) diagonal: ``sum_k U_ik^2 e_k + delta (1 - sum_k U_ik^2)``."""
        u2 = self.U.pow(2)
        return u2 @ self.eig + self.delta * (1.0 - u2.sum(1))

    def _apply(self, X: torch.Tensor, kept: torch.Tensor, rest: float) -> torch.Tensor:
        """``U diag(kept) U^T X + rest (X - U U^T X)`` for X (d,) or (d, k)."""
        if X.shape[0] != self.d:
            raise ValueError(f"X has {X.shape[0]} rows but the factor is {self.d} x {self.d}")
        vec = X.dim() == 1
        X2 = X.reshape(self.d, -1).to(self.U.dtype)  # (d, k)
        P = self.U.T @ X2  # (r, k)
        Y = self.U @ (kept[:, None] * P) + rest * (X2 - self.U @ P)
        return Y.reshape(-1) if vec else Y  # (d,) or (d, k)

    def matmul(self, X: torch.Tensor) -> torch.Tensor:
        """``M_r X`` for X (d,) or (d, k)."""
        return self._apply(X, self.eig, self.delta)

    matvec = matmul

    def _damped(self, damping: float) -> tuple[torch.Tensor, float]:
        kept, rest = self.eig + damping, self.delta + damping
        vals = kept.tolist() + ([rest] if self.rank < self.d else [])
        if min(vals) <= 1e-12 * max(max(vals), 0.0):  # singular to working precision
            raise ValueError(
                f"M_r + {damping} I is singular (eigenvalues {min(vals):.3g} .. {max(vals):.3g}); "
                "pass damping > 0"
            )
        return kept, rest

    def inv_matmul(self, X: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
        """``(M_r + damping I)^-1 X`` without a dense inverse; X (d,) or (d, k)."""
        kept, rest = self._damped(damping)
        return self._apply(X, 1.0 / kept, 1.0 / rest if rest > 0 else 0.0)

    def inv_sqrt_matmul(self, X: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
        """``(M_r + damping I)^-1/2 X`` (symmetric inverse square root); X (d,) or (d, k)."""
        kept, rest = self._damped(damping)
        return self._apply(X, kept.rsqrt(), rest ** -0.5 if rest > 0 else 0.0)


def _choose_rank(eig: torch.Tensor, rank: int | None, explained: float | None, max_rank: int) -> int:
    """Smallest r with ``sum(eig[:r]) >= explained * sum(eig)``, capped by rank and max_rank."""
    d = eig.numel()
    r = min(d, max_rank)
    if rank is not None:
        r = min(r, rank)
    if explained is not None:
        total = float(eig.sum())
        if total <= 0:
            return 0
        frac = torch.cumsum(eig, 0) / total
        hit = torch.nonzero(frac >= explained - 1e-12)
        r_exp = int(hit[0]) + 1 if hit.numel() else d
        r = min(r, r_exp)
    return r


def truncate(
    M: torch.Tensor,
    *,
    rank: int | None = None,
    explained: float | None = None,
    max_rank: int = 64,
) -> LowRankFactor:
    """Eigen-truncate a symmetric PSD matrix ``M`` (d, d) to a ``LowRankFactor``.

    Args:
        M: (d, d) symmetric positive semi-definite (computed in float64).
        rank: keep at most this many eigenpairs.
        explained: keep the fewest top eigenpairs whose eigenvalues sum to at least this
            fraction (0, 1] of the trace.
        max_rank: upper cap on the rank (typical 16/32/64).

    Returns:
        LowRankFactor with r = min(d, max_rank, rank, r_explained) and delta = mean of the
        discarded eigenvalues (0 if none).

    Raises:
        ValueError: non-square, non-symmetric, non-finite or clearly indefinite M; bad rank
            arguments.
    """
    if M.dim() != 2 or M.shape[0] != M.shape[1] or M.shape[0] == 0:
        raise ValueError(f"M must be a non-empty square (d, d) matrix, got shape {tuple(M.shape)}")
    if rank is not None and rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    if max_rank < 0:
        raise ValueError(f"max_rank={max_rank} must be >= 0")
    if explained is not None and not 0.0 < explained <= 1.0:
        raise ValueError(f"explained={explained} must lie in (0, 1]")
    M = M.double()
    if not torch.isfinite(M).all():
        raise ValueError("M has NaN/Inf entries; check the curvature estimate")
    scale = float(M.abs().max())
    if (M - M.T).abs().max() > 1e-10 * max(scale, 1e-300):
        raise ValueError("M is not symmetric; pass 0.5 * (M + M.T)")
    eig, vec = torch.linalg.eigh(0.5 * (M + M.T))
    if eig[0] < -1e-8 * max(scale, 1e-300):
        raise ValueError(
            f"M is not positive semi-definite (eigenvalue {float(eig[0]):.3g}); a K-FAC factor or "
            "covariance is PSD: check how it was built"
        )
    eig, vec = eig.flip(0).clamp_min(0.0), vec.flip(1)  # descending
    r = _choose_rank(eig, rank, explained, max_rank)
    delta = float(eig[r:].mean()) if r < eig.numel() else 0.0
    return LowRankFactor(U=vec[:, :r].contiguous(), eig=eig[:r].clone(), delta=delta)
