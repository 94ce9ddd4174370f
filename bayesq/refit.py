"""Scale refit: the per-group scales that minimise the deployed cost for fixed integer codes.

After the codes are chosen (nearest or error-feedback rounding), a layer's deployed weights are
``W_hat[r, j] = a_g(r, j) * u[r, j]`` with ``u = code - zero`` fixed and one scale ``a_g`` per
group of ``group_size`` consecutive weights (row-major). The deployed cost of section 2 of
docs/method.md, with the data curvature in K-FAC form ``C ~= G (x) H`` and ``G`` taken diagonal
(as the error-feedback solver does), is per layer

    J(a) = sum_r (W_hat_r - W_r)^T H (W_hat_r - W_r)        (H: (groups, d, d) per conv group),

a convex quadratic in the scales ``a``. When each row holds ``k`` whole groups of contiguous
columns (``d_in`` a multiple of the group size) the rows decouple and each row's k scales solve
the k x k normal equations ``M_r a_r = b_r`` exactly,

    M_r[g, h] = u_{r,g}^T H_{gh} u_{r,h},   b_r[g] = u_{r,g}^T (H W_r)_g,

built with one pass of products over the column blocks (the cost of one product ``U H``);
with ``c_r = W_r^T H W_r`` (one more product, which no scale depends on) they also give ``J(a) = sum_r a_r^T M_r a_r - 2 a_r^T b_r + c_r`` of
any scales, so the costs before and after the refit take no further product.
Otherwise (groups straddle rows, which couples them) ``J`` is minimised by preconditioned
gradient steps with an exact line search: the direction is the gradient divided by the diagonal
of the Hessian in ``a``; the step ``alpha`` minimises ``J`` along it in closed form, so ``J``
never increases. The scales are then rounded to their stored
precision (fp16), and a layer keeps its old scales when the rounded refit is not better.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def metric_apply(R: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """(out, d) ``R_r H_{k(r)}`` for rows split evenly into ``H.shape[0]`` convolution groups.

    Args:
        R: (out, d) float64; H: (groups, d, d) or (d, d) float64 symmetric.
    """
    H = H if H.dim() == 3 else H.unsqueeze(0)
    per = R.shape[0] // H.shape[0]
    return torch.einsum("grd,gde->gre", R.reshape(H.shape[0], per, -1), H).reshape(R.shape)


def layer_cost(W_hat: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    """``sum_r (W_hat_r - W_r)^T H (W_hat_r - W_r)`` of (out, d) matrices."""
    R = W_hat - W
    return float((metric_apply(R, H) * R).sum())


def _normal_equations(W: torch.Tensor, u: torch.Tensor, group: torch.Tensor, n: int,
                      H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(M, b, c)`` with ``J(a) = sum_r a_r^T M_r a_r - 2 a_r^T b_r + c_r`` when every row holds ``k``
    whole groups of contiguous columns (``group[r, j] = r * k + j // (d / k)``), else None.

    Returns:
        M (out, k, k) symmetric, b (out, k), c (out,) float64 (``c_r = W_r^T H W_r``): two products
        of the cost of ``U H`` build all of them, and J of any scales then costs O(out k^2).
    """
    out, d = W.shape
    if n % out or d % (n // out):
        return None
    k = n // out
    width = d // k
    dev = group.device
    if not torch.equal(group, torch.arange(out, device=dev)[:, None] * k + torch.arange(d, device=dev)[None] // width):
        return None
    return row_equations(W, u, k, H)


def row_equations(W: torch.Tensor, u: torch.Tensor, k: int, H: torch.Tensor,
                  constant: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_normal_equations` of rows that each hold ``k`` whole groups of ``d / k`` contiguous
    columns (the caller knows the layout): each row's equations read only that row, so those of a
    large layer can be built a chunk of rows at a time and concatenated (rows split evenly into
    ``H.shape[0]`` convolution groups need all rows at once).

    ``M`` and ``b`` both come from the products ``P_g = u_{r,g}^T H_{g,:}`` (one ``U H`` in all):
    ``M_r[g, h] = P_g . u_{r,h}`` and ``b_r[g] = P_g . W_r``. ``constant=False`` skips
    ``c_r = W_r^T H W_r`` (returned as zeros), a second product that no scale depends on: the
    refit's solution and its kept-or-not decision are the same, and ``J`` is then ``J - sum_r c_r``.

    Args:
        W, u: (out, d) float64; H: (groups, d, d) or (d, d) float64 symmetric.
    """
    out, d = W.shape
    width = d // k
    Hs = H if H.dim() == 3 else H.unsqueeze(0)
    per = out // Hs.shape[0]
    M = torch.empty(out, k, k, dtype=torch.float64, device=W.device)
    b = torch.empty(out, k, dtype=torch.float64, device=W.device)
    c = torch.zeros(out, dtype=torch.float64, device=W.device)
    for i, Hc in enumerate(Hs):  # convolution groups: rows i*per ... (i+1)*per - 1
        rows = slice(i * per, (i + 1) * per)
        Uc, Wc = u[rows], W[rows]
        if constant:
            c[rows] = (metric_apply(Wc, Hc) * Wc).sum(1)
        for g in range(k):
            cols = slice(g * width, (g + 1) * width)
            P = Uc[:, cols] @ Hc[cols]  # (per, d): u_{r,g}^T H_{g,:}
            M[rows, g] = (P * Uc).reshape(per, k, width).sum(-1)
            b[rows, g] = (P * Wc).sum(1)
    return 0.5 * (M + M.mT), b, c


def _quadratic_cost(eq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a: torch.Tensor) -> float:
    """``J(a)`` from :func:`_normal_equations`' ``(M, b, c)`` for (G,) scales ``a``."""
    M, b, c = eq
    A = a.reshape(b.shape)
    return float(((M @ A.unsqueeze(-1)).squeeze(-1) * A).sum() - 2.0 * (A * b).sum() + c.sum())


def _solve_rows(eq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: torch.Tensor) -> torch.Tensor | None:
    """Each row's k x k normal equations ``M_r a_r = b_r`` solved (Cholesky), a group whose codes
    are all at the zero point (its row and column of M are 0) keeping its scale; None when some
    M_r is not positive definite."""
    M, b, _ = eq
    M, b = M.clone(), b.clone()
    dead = M.diagonal(dim1=1, dim2=2) <= 0  # (out, k): u = 0 in the group, so its row and column are 0
    M.diagonal(dim1=1, dim2=2)[dead] = 1.0
    b[dead] = scale.reshape(b.shape)[dead]
    L, info = torch.linalg.cholesky_ex(M)
    if bool((info != 0).any()):
        return None
    return torch.cholesky_solve(b.unsqueeze(-1), L).reshape(-1)


def row_block_solve(W: torch.Tensor, u: torch.Tensor, group: torch.Tensor, scale: torch.Tensor,
                    H: torch.Tensor) -> torch.Tensor | None:
    """The exact minimiser of ``J(a)`` when every row holds ``k`` whole groups of contiguous
    columns (``group[r, j] = r * k + j // (d / k)``), else None.

    Args: as :func:`refit_scales` (float64). A group whose codes are all at the zero point
    (``u = 0``: ``J`` does not depend on its scale) keeps its scale.

    Returns:
        (G,) float64 scales (unrounded), or None when the layout does not decouple the rows or a
        row's normal equations are not positive definite.
    """
    eq = _normal_equations(W, u, group, scale.shape[0], H)
    return None if eq is None else _solve_rows(eq, scale)


def refit_scales(
    W: torch.Tensor, u: torch.Tensor, group: torch.Tensor, scale: torch.Tensor, H: torch.Tensor, *,
    iters: int = 20, scale_bits: int = 16, rtol: float = 1e-9,
) -> tuple[torch.Tensor, float, float]:
    """Group scales minimising ``J(a)`` (module docstring) for fixed codes.

    Args:
        W: (out, d) float64 trained weights.
        u: (out, d) float64 ``code - zero`` of every weight.
        group: (out, d) int64 group index of every weight, in ``[0, len(scale))``.
        scale: (G,) float64 current (stored) scales.
        H: (groups, d, d) or (d, d) float64 SPD column metric.
        iters: groups straddling rows (no exact solve, :func:`row_block_solve`): at most this
            many preconditioned steps ...
        rtol: ... stopping after one that lowers ``J`` by at most ``rtol * J(scale)``.
        scale_bits: 16 (fp16) or 32 (fp32) storage of the scales.

    Returns:
        (scales (G,) float64 as stored, J before, J after); the old scales when the rounded
        refit does not lower ``J``.
    """
    if W.shape != u.shape or W.shape != group.shape:
        raise ValueError(f"W, u and group must share one (out, d) shape; got {tuple(W.shape)}, "
                         f"{tuple(u.shape)}, {tuple(group.shape)}")
    eq = _normal_equations(W, u, group, scale.shape[0], H)

    def cost(x: torch.Tensor) -> float:  # decoupled rows: from the normal equations, no product
        return _quadratic_cost(eq, x) if eq is not None else layer_cost(x[group] * u, W, H)

    before = cost(scale)
    exact = _solve_rows(eq, scale) if eq is not None else None
    a = exact if exact is not None else _descend(W, u, group, scale, H, iters, rtol, before)
    return _kept(a, scale, cost, before, scale_bits)


def refit_rows(eq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: torch.Tensor, *,
               scale_bits: int = 16) -> tuple[torch.Tensor, float, float] | None:
    """:func:`refit_scales` of a layer whose rows decouple, from their normal equations
    (:func:`row_equations`, e.g. built a chunk of rows at a time and concatenated): the same
    result; None when some row's equations are not positive definite (then call
    :func:`refit_scales`, which descends). Equations built with ``constant=False`` give the same
    scales, and the two costs less ``sum_r c_r``."""
    exact = _solve_rows(eq, scale)
    if exact is None:
        return None
    return _kept(exact, scale, lambda x: _quadratic_cost(eq, x), _quadratic_cost(eq, scale), scale_bits)


def _kept(a: torch.Tensor, scale: torch.Tensor, cost: Callable[[torch.Tensor], float], before: float,
          scale_bits: int) -> tuple[torch.Tensor, float, float]:
    """Scales ``a`` rounded to their stored precision, kept when that lowers ``cost`` below
    ``before`` (the cost of ``scale``), else ``scale``: (scales, J before, J after)."""
    dtype = torch.float16 if scale_bits == 16 else torch.float32
    stored = a.to(dtype).to(torch.float64)
    stored = torch.where(torch.isfinite(stored) & (stored > 0), stored, scale)  # a scale stays positive
    after = cost(stored)
    if not after < before:
        return scale, before, before
    return stored, before, after


def _descend(W: torch.Tensor, u: torch.Tensor, group: torch.Tensor, scale: torch.Tensor, H: torch.Tensor,
             iters: int, rtol: float, before: float) -> torch.Tensor:
    """Preconditioned steepest descent with exact line search on ``J(a)`` from ``scale``
    (module docstring): at most ``iters`` steps, stopping after one that lowers ``J`` by at most
    ``rtol * before``. Returns the (G,) float64 scales, unrounded."""
    n = scale.shape[0]
    flat = group.reshape(-1)
    diag = (H if H.dim() == 3 else H.unsqueeze(0)).diagonal(dim1=-2, dim2=-1)  # (groups, d)
    hdiag = torch.zeros(n, dtype=torch.float64, device=W.device).index_add_(  # sum of u^2 H_jj per group
        0, flat, (u * u * diag.repeat_interleave(W.shape[0] // diag.shape[0], 0)).reshape(-1))
    a = scale.clone()
    R = a[group] * u - W
    RH = metric_apply(R, H)  # kept current: R H after a step is RH - alpha * D H (one product per step)
    for _ in range(iters):
        grad = torch.zeros(n, dtype=torch.float64, device=W.device).index_add_(0, flat, (u * RH).reshape(-1))
        step = torch.where(hdiag > 0, grad / hdiag.clamp_min(1e-300), torch.zeros_like(grad))
        D = step[group] * u  # (out, d) change of W_hat per unit alpha
        HD = metric_apply(D, H)
        curv = float((HD * D).sum())
        if curv <= 0:
            break
        slope = float((HD * R).sum())
        alpha = slope / curv  # argmin_alpha J(a - alpha * step); J drops by alpha * slope
        a, R, RH = a - alpha * step, R - alpha * D, RH - alpha * HD
        if alpha * slope <= rtol * before:  # converged far below the stored precision of the scales
            break
    return a
