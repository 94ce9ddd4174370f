"""Sequential error-feedback rounding (OBQ / GPTQ style) for a fixed per-element grid.

Minimises, greedily column by column, the whitened distortion of the weight error
``D = Q - W`` (out x in) under a column metric H (in x in, SPD):

    cost(D) = tr(D H D^T) = sum_o D[o] H D[o]^T.

Step j (columns in the order ``order``): round the current column j to its nearest level
``q = scale * (clamp(round(w / scale + zero), 0, maxq) - zero)``, then move the not yet
quantised columns F to the exact least-squares optimum given everything fixed so far
(the OBS update, Hassibi & Stork 1993; Frantar et al. 2022):

    W[:, F] <- W[:, F] - (w_j - q_j) / [H_F'^-1]_jj * [H_F'^-1]_{j, F},   F' = F + {j}.

With ``H^-1 = U^T U`` (U upper Cholesky factor of the inverse, in the permuted order) row j of U
gives exactly these numbers: ``[H_F'^-1]_{j,F} / [H_F'^-1]_jj = U[j, F] / U[j, j]``. Updates are
applied lazily in blocks of ``block_size`` columns (same result up to rounding, faster).

K-FAC metric: for a precision ``G (x) A`` the cost is ``tr(G D A D^T)``. Fixing some columns Q,
the optimal free columns solve ``d/dD_F tr(G D A D^T) = 2 G (D A)_F = 0``; for G invertible that
is ``(D A)_F = 0``, i.e. ``D_F = -D_Q A_QF A_FF^-1``, which does not involve G. So the
compensating update of later columns is the same with ``H = A`` whatever G is. (G would only
enter the joint rounding of one column's entries across rows; like GPTQ, each entry is
rounded to its nearest level.)
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, Mapping

import torch

from bayesq.grids import rounding_divisor
from bayesq.memory import LazyMap


def damped_metric(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """GPTQ's relative dampening of a (groups, d, d) or (d, d) column metric ``H`` (float64 copy).

    Dead inputs (``H_jj = 0``) get ``H_jj = 1``; then ``H + damp * mean(diag H) * I`` per group.
    """
    if damp <= 0:
        raise ValueError(f"damp={damp}: the relative dampening must be > 0 (GPTQ's default 0.01)")
    H = H.to(torch.float64, copy=True)
    diag = H.diagonal(dim1=-2, dim2=-1)  # view: (..., d)
    diag[diag <= 0] = 1.0
    diag += damp * diag.mean(-1, keepdim=True)
    return H


class LazyMetrics(LazyMap):
    """Layer name -> column metric, made by ``make(name)`` on each access and never kept.

    Every layer's (d_in, d_in) metric (and its factor, :func:`shared_factors`) held at once is the
    largest memory term of error-feedback rounding on a large model (1 GiB each at GPT-2 small):
    a caller that reads one layer at a time holds one (the layer read last is kept, so that
    repeated reads of it return one object, whose factor :func:`shared_factors` memoises; a
    ``shared_factors`` scope around several layers would keep all of theirs). ``gains(act_order)`` keeps the small
    per-layer :func:`feedback_gain` vectors instead, so that several tables of the same metric
    (grid candidates) factor each layer once for them.

    Args:
        names: the layers, in order.
        make: name -> (d_in, d_in) or (groups, d_in, d_in) float64 SPD metric (e.g.
            ``lambda n: damped_metric(H[n])``).
        forget: name -> None, drops what ``make`` reads for that layer (:meth:`release`).
    """

    def __init__(self, names: Iterable[str], make: Callable[[str], torch.Tensor],
                 forget: Callable[[str], None] | None = None) -> None:
        super().__init__(names, make)
        self._forget = forget
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)  # the layer read last, its metric
        self._gains: dict[bool, dict[str, torch.Tensor]] = {}

    def release(self, name: str) -> None:
        """Free layer ``name``'s source (its input moment) for a caller that will not read it again:
        it leaves the map (reading it raises KeyError), its gains stay."""
        if self._forget is not None:
            self._forget(name)
        self._names = tuple(n for n in self._names if n != name)
        self._known = self._known - {name}
        if self._last[0] == name:
            self._last = (None, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        if self._last[0] != name:  # the same object for repeated reads of one layer (shared_factors' key)
            self._last = (name, None)  # the previous layer's metric freed before the next is made
            self._last = (name, self._make(name))
        return self._last[1]

    def gains(self, act_order: bool) -> dict[str, torch.Tensor]:
        """:func:`feedback_gain` of every layer's metric in ``act_order``'s column order (made once)."""
        if bool(act_order) not in self._gains:
            self._gains[bool(act_order)] = {n: feedback_gain(self[n], act_order=act_order) for n in self._names}
        return self._gains[bool(act_order)]


def damped_metrics(moments: Mapping[str, torch.Tensor], damp: float = 0.01) -> LazyMetrics:
    """:class:`LazyMetrics` of :func:`damped_metric` of each layer's moment (``moments``: layer name
    -> (d_in, d_in) or (groups, d_in, d_in) tensor, kept by reference; the damped float64 copy is
    made on access)."""
    if damp <= 0:
        raise ValueError(f"damp={damp}: the relative dampening must be > 0 (GPTQ's default 0.01)")
    moments = dict(moments)
    return LazyMetrics(moments, lambda name: damped_metric(moments[name], damp), moments.pop)


def _broadcast(name: str, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    try:
        return torch.broadcast_to(torch.as_tensor(x), shape)
    except RuntimeError:
        raise ValueError(
            f"{name} has shape {tuple(torch.as_tensor(x).shape)}, not broadcastable to the "
            f"weight shape {shape}; build per-element (out, in) tensors"
        ) from None


def _validate_grid(W, scale, zero, maxq):
    shape = tuple(W.shape)
    scale = _broadcast("scale", scale, shape).to(W.device, torch.float64)
    zero = _broadcast("zero", zero, shape).to(W.device, torch.float64)
    maxq = _broadcast("maxq", maxq, shape)
    if maxq.dtype.is_floating_point or maxq.dtype == torch.bool:
        raise ValueError(f"maxq must be an integer tensor (int64), got {maxq.dtype}")
    maxq = maxq.to(W.device, torch.int64)
    if not (torch.isfinite(scale).all() and (scale >= 0).all()):
        raise ValueError("scale must be finite and >= 0 everywhere (0: a group whose every weight decodes to 0)")
    if not torch.isfinite(zero).all():
        raise ValueError("zero has NaN/Inf entries")
    if (maxq < 0).any():
        raise ValueError("maxq must be >= 0 (2**bits - 1)")
    return scale, zero, maxq


def _validate_order(order: torch.Tensor | None, d: int, device) -> torch.Tensor:
    if order is None:
        return torch.arange(d, device=device)
    order = torch.as_tensor(order)
    if order.dim() != 1 or order.dtype.is_floating_point or order.numel() != d or not torch.equal(
        torch.sort(order).values, torch.arange(d, device=order.device)
    ):
        raise ValueError(f"order must be a permutation of range({d}) (an int64 tensor of {d} indices)")
    return order.to(device, torch.int64)


def _cholesky(H: torch.Tensor) -> torch.Tensor:
    """Lower L with ``H = L L^T``; H (..., in, in) float64, batched over leading dims.

    Raises ValueError if some H is not SPD (naming the first failing batch index)."""
    L, info = torch.linalg.cholesky_ex(H)
    if bool((info != 0).any()):
        where = f" in group {int(torch.nonzero(info.reshape(-1))[0])}" if info.dim() else ""
        raise ValueError(
            f"H is not positive definite{where} (Cholesky failed); add damping, e.g. "
            "H + 0.01 * H.diagonal().mean() * I"
        )
    return L


def _inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """Upper U with ``H^-1 = U^T U``; H (..., in, in) float64, batched over leading dims.

    Raises ValueError if some H is not SPD (naming the first failing batch index)."""
    return torch.linalg.cholesky(torch.cholesky_inverse(_cholesky(H)), upper=True)


_FACTORS: ContextVar[dict | None] = ContextVar("error_feedback_factors", default=None)


@contextmanager
def shared_factors() -> Iterator[None]:
    """Within it, :func:`error_feedback_groups` factors each metric tensor once per column order
    (the same ``U``, bit for bit): the row chunks of a layer and the rounding of every grid
    candidate read one factor. The factors are memoised on the
    tensor object (its in-place version checked) and dropped on exit (of the outermost, when
    nested)."""
    if _FACTORS.get() is not None:
        yield
        return
    token = _FACTORS.set({})
    try:
        yield
    finally:
        _FACTORS.reset(token)


def _ordered_factor(H: torch.Tensor, device: torch.device, act_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, U): :func:`_solver_order`'s column order of ``H`` as (groups, d, d) float64 on
    ``device`` (checked by :func:`_metric64`) and :func:`_inverse_cholesky` of the permuted
    metric; memoised on ``H`` inside :func:`shared_factors` (checked and factorised once)."""
    memo = _FACTORS.get()
    key = (id(H), H._version, bool(act_order), device)
    if memo is not None and key in memo and memo[key][0] is H:
        return memo[key][1]
    perm, Hp = _solver_order(_metric64(H, device), act_order)
    factor = perm, _inverse_cholesky(Hp)
    if memo is not None:
        memo[key] = (H, factor)  # holds H: its id is not reused while the entry lives
    return factor


def _check_metric(W: torch.Tensor, H: torch.Tensor, block_size: int) -> torch.Tensor:
    """H as (groups, in, in) float64 on W's device, after the checks both solvers share."""
    _check_shapes(W, H, block_size)
    return _metric64(H, W.device)


def _check_shapes(W: torch.Tensor, H: torch.Tensor, block_size: int) -> None:
    """W a finite 2-D float (out, in) tensor, H (in, in) or (groups, in, in) with ``groups``
    dividing out, ``block_size`` a positive int (ValueError naming what is wrong)."""
    if W.dim() != 2 or not W.dtype.is_floating_point:
        raise ValueError(f"W must be a 2-D float (out, in) tensor, got {W.dtype} {tuple(W.shape)}")
    n_out, d = W.shape
    Hg = H if H.dim() == 3 else H.unsqueeze(0)
    if tuple(Hg.shape[1:]) != (d, d):
        raise ValueError(f"H has shape {tuple(H.shape)}; expected ({d}, {d}) = (in, in) for W {tuple(W.shape)}")
    if n_out % Hg.shape[0]:
        raise ValueError(f"{n_out} output rows do not split into {Hg.shape[0]} groups")
    if not torch.isfinite(W).all():
        raise ValueError("W has NaN/Inf entries")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size} must be a positive int")


def _metric64(H: torch.Tensor, device: torch.device) -> torch.Tensor:
    """H (checked finite and symmetric) as (groups, in, in) float64 on ``device``."""
    Hg = H if H.dim() == 3 else H.unsqueeze(0)
    if not torch.isfinite(Hg).all():
        raise ValueError("H has NaN/Inf entries")
    Hg = Hg.to(device, torch.float64)
    if ((Hg - Hg.transpose(1, 2)).abs().amax((1, 2)) > 1e-10 * Hg.abs().amax((1, 2)).clamp_min(1e-300)).any():
        raise ValueError("H is not symmetric; pass 0.5 * (H + H.T)")
    return Hg


def _solver_order(H: torch.Tensor, act_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's column order and its permuted metric.

    Args:
        H: (groups, d, d) float64 metrics.
        act_order: decreasing ``diag H[g]`` (stable), else natural order.

    Returns:
        perm (groups, d) int64 (``perm[g, k]``: the column quantised k-th) and
        ``H[g][perm[g]][:, perm[g]]`` (groups, d, d).
    """
    G, d = H.shape[:2]
    if act_order:
        perm = torch.argsort(H.diagonal(dim1=1, dim2=2), dim=1, descending=True, stable=True)
    else:
        perm = torch.arange(d, device=H.device).expand(G, d)
    Hp = torch.gather(torch.gather(H, 1, perm[:, :, None].expand(-1, -1, d)), 2, perm[:, None, :].expand(-1, d, -1))
    return perm, Hp


def _round_ordered(Wp: torch.Tensor, U: torch.Tensor, s: torch.Tensor, z: torch.Tensor, m: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """Error-feedback codes, batched over groups, columns already in quantisation order.

    Args:
        Wp: (groups, rows, in) float64 weights (not modified).
        U: (groups, in, in) upper factors of each group's permuted ``H^-1 = U^T U``.
        s, z, m: (groups, rows, in) per-element scale, zero (float64) and maxq (int64).

    Returns:
        (groups, rows, in) int64 codes in the same (permuted) column order.

    Works on (groups, in, rows) copies, so that each column is contiguous.
    """
    Wt, s, z = (x.transpose(1, 2).contiguous() for x in (Wp, s, z))
    m = m.transpose(1, 2).to(torch.float64)  # codes are rounded in float64, exact integers
    div = rounding_divisor(s)  # the library's rounding rule: a zero scale gives the zero-point code
    d = Wt.shape[1]
    codes = torch.empty(Wt.shape, dtype=torch.int64, device=Wt.device)
    # per-column views, made once (the column loop is bound by per-operation overhead)
    w_, s_, z_, m_, codes_, div_ = (x.unbind(1) for x in (Wt, s, z, m, codes, div))
    for i1 in range(0, d, block_size):
        i2 = min(i1 + block_size, d)
        W1, U1 = Wt[:, i1:i2], U[:, i1:i2, i1:i2]  # views: (G, b, rows), (G, b, b)
        err = torch.zeros_like(W1)  # (G, b, rows) scaled errors
        err_, pivot = err.unbind(1), U1.diagonal(dim1=1, dim2=2)[:, :, None].unbind(1)  # (G, 1) pivots
        for k in range(i2 - i1):
            j = i1 + k
            c = torch.minimum(torch.addcdiv(z_[j], w_[j], div_[j]).round_().clamp_min_(0), m_[j])  # nearest level
            codes_[j].copy_(c)
            torch.div(w_[j] - (c - z_[j]).mul_(s_[j]), pivot[k], out=err_[k])
            W1[:, k:].baddbmm_(U1[:, k, k:, None], err[:, k : k + 1], alpha=-1.0)  # -= U1[k, k:]^T err_k
        Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].transpose(1, 2), err, alpha=-1.0)
    return codes.transpose(1, 2)


def error_feedback_round(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    maxq: torch.Tensor,
    *,
    block_size: int = 128,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integer codes of W on a per-element grid, rounded with error feedback under metric H.

    Args:
        W: (out, in) float weights (computed in float64). Conv: (out, in/groups*kh*kw).
        H: (in, in) symmetric positive definite column metric (K-FAC: the damped A factor;
            GPTQ: X X^T of the layer inputs), damped by the caller.
        scale, zero: (out, in) float64 grid per element (anything broadcastable to it);
            dequantised weight ``scale * (code - zero)``.
        maxq: (out, in) int64 largest code per element (2**bits - 1).
        block_size: columns per lazy update block (does not change the result).
        order: optional permutation of range(in): column ``order[k]`` is quantised k-th
            (act-order); codes are returned in the original column order.

    Returns:
        (out, in) int64 codes in [0, maxq], greedily minimising ``tr(D H D^T)``,
        ``D = scale * (code - zero) - W`` (module docstring).

    Raises:
        ValueError: bad shapes, non-finite values, H not symmetric positive definite (add
            damping), bad grid, block_size or order.
    """
    if H.dim() != 2:
        raise ValueError(f"H has shape {tuple(H.shape)}; expected (in, in) (several groups: error_feedback_groups)")
    Hg = _check_metric(W, H, block_size)
    scale, zero, maxq = _validate_grid(W, scale, zero, maxq)
    perm = _validate_order(order, W.shape[1], W.device)
    U = _inverse_cholesky(Hg[0][perm][:, perm])  # (in, in) upper
    s, z, m = (x[:, perm][None] for x in (scale, zero, maxq))  # (1, out, in) each
    codes = _round_ordered(W.to(torch.float64)[:, perm][None].clone(), U[None], s, z, m, block_size)[0]
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return out


def error_feedback_groups(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    maxq: torch.Tensor,
    *,
    act_order: bool = False,
    block_size: int = 128,
) -> torch.Tensor:
    """:func:`error_feedback_round` with one column metric per block of rows (grouped Conv2d),
    all groups solved together (one batched factorisation, one column loop).

    Args:
        W: (out, d_in) float weights; rows ``g*out/groups ... (g+1)*out/groups - 1`` belong to
            convolution group g (Linear / ungrouped Conv2d: one group).
        H: (groups, d_in, d_in) or (d_in, d_in) SPD metric(s), damped by the caller.
        scale, zero, maxq: (out, d_in) per-element grid (see :func:`error_feedback_round`).
        act_order: quantise the columns of each group in order of decreasing ``diag(H[g])``
            (GPTQ's act-order heuristic: the most active inputs first).

    Returns:
        (out, d_in) int64 codes, the same as :func:`error_feedback_round` per group.
    """
    _check_shapes(W, H, block_size)
    groups, (n_out, d) = (H.shape[0] if H.dim() == 3 else 1), W.shape
    scale, zero, maxq = _validate_grid(W, scale, zero, maxq)
    perm, U = _ordered_factor(H, W.device, act_order)  # H checked and factorised once per shared_factors
    rows = perm[:, None, :].expand(groups, n_out // groups, d)  # (G, rows, d) column index per element

    def permuted(x: torch.Tensor) -> torch.Tensor:
        return torch.gather(x.reshape(groups, -1, d), 2, rows)

    codes = _round_ordered(permuted(W.to(torch.float64)).clone(), U,
                           permuted(scale), permuted(zero), permuted(maxq), block_size)
    return torch.empty_like(codes).scatter_(2, rows, codes).reshape(n_out, d)


def feedback_gain(H: torch.Tensor, act_order: bool = False) -> torch.Tensor:
    """Per-column share of the nearest-rounding cost that error feedback leaves: ``r_j = d_j / H_jj``.

    Rounding column j with feedback onto the not yet quantised columns F leaves, per unit of
    squared rounding error, the cost ``d_j = 1 / [H_{F'}^-1]_jj = H_jj - H_jF H_FF^-1 H_Fj``
    (``F' = F + {j}``: the Schur complement, i.e. the conditional precision of column j given
    the later columns; ``1 / U_jj^2`` with U the upper Cholesky factor of the permuted inverse
    of :func:`error_feedback_round`, equally ``L_jj^2`` with L the lower Cholesky factor of the
    metric in the reversed column order, which is what is computed). For independent zero-mean rounding errors ``e`` the
    expected cost is ``sum_j d_j E[e_j^2]`` instead of nearest rounding's ``sum_j H_jj E[e_j^2]``,
    so ``0 < r_j <= 1`` and the last column quantised has ``r = 1``.

    Args:
        H: (groups, d, d) or (d, d) SPD column metric(s), damped (same as for the rounding).
        act_order: the column order of :func:`error_feedback_groups` (decreasing ``diag H``).

    Returns:
        float64 gains shaped like ``diag H``: (groups, d) or (d,), in the original column order.
    """
    batched = H.dim() == 3
    Hg = (H if batched else H.unsqueeze(0)).double()
    perm, Hp = _solver_order(Hg, act_order)
    # d_j given the later columns is L_jj^2 of the Cholesky factor in the reversed order: one
    # factorisation, a third of the rounding's (inverse, then factor again)
    L = _cholesky(Hp.flip(1, 2))
    d = (L.diagonal(dim1=1, dim2=2) ** 2).flip(1)  # (G, d) in solver order
    r_perm = d / Hp.diagonal(dim1=1, dim2=2)  # r_j in solver order
    out = torch.empty_like(r_perm).scatter_(1, perm, r_perm)
    return out if batched else out[0]


def coordinate_descent(
    W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
    codes: torch.Tensor, *, passes: int = 2, block_size: int = 128, dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Polish codes by exact coordinate descent on ``tr(D H D^T)`` over the fixed grid.

    For column j, with every other column fixed, the row-wise cost is the convex quadratic
    ``H_jj (q - w_j)^2 + 2 (q - w_j) sum_{k != j} H_jk D_k`` in the column's value q, minimised
    over the grid by the level nearest to ``q* = Q_j - (D H)_j / H_jj``. Sweeping the columns
    (natural order, ``passes`` times) never raises the cost; from error-feedback codes it stops
    at a point no single code change improves (when enough passes are run). Inside a block of
    ``block_size`` columns, a change of column j updates ``D H`` only for the block's later
    columns, the ones this sweep reads next; one matrix product per block then brings the
    other columns up to date (the block's own through the upper triangle of its ``H`` block;
    none behind the block in the last sweep, which reads them no more). The same codes as
    updating every column at every change, up to float rounding, and faster.

    Args:
        W: (out, d_in) float weights; rows split evenly into ``H.shape[0]`` convolution groups.
        H: (groups, d_in, d_in) or (d_in, d_in) SPD metric(s), damped as for the rounding.
        scale, zero, maxq: (out, d_in) per-element grid (see :func:`error_feedback_round`).
        codes: (out, d_in) int64 starting codes (e.g. from :func:`error_feedback_groups`).
        passes: sweeps over the columns (0 returns ``codes``).
        dtype: what ``D H`` and the grid values are kept in. float32 halves the time (the products
            and the column updates); it differs from float64 only where two levels are within
            float32 rounding of a tie (BERT-base's and MiniLM's layers: 3 codes in 100,000 moved,
            the summed cost within 2e-6 either way; ``benchmarks/cd_dtype.py`` at 2423b3a, docs/findings.md).

    Returns:
        (out, d_in) int64 codes.
    """
    H = (H if H.dim() == 3 else H.unsqueeze(0)).to(dtype)
    groups, d = H.shape[0], H.shape[-1]
    if W.shape[0] % groups:
        raise ValueError(f"{W.shape[0]} output rows do not split into {groups} groups")
    shape = (groups, W.shape[0] // groups, d)

    def by_column(x: torch.Tensor) -> torch.Tensor:  # (groups, d, rows): one column is contiguous
        return torch.broadcast_to(torch.as_tensor(x), W.shape).to(dtype).reshape(shape).transpose(1, 2).contiguous()

    s, z, m, c, Wt = (by_column(x) for x in (scale, zero, maxq, codes, W))
    Q = s * (c - z)
    HD = torch.bmm(H, Q - Wt)  # (groups, d, rows): (D H)^T per row, kept current
    inv_hdiag = 1.0 / H.diagonal(dim1=1, dim2=2)[:, :, None]  # (groups, d, 1)
    # per-column views, made once (the column loop is bound by per-operation overhead)
    div = rounding_divisor(s)  # a zero scale keeps the zero-point code (the library's rounding rule)
    s_, z_, m_, c_, Q_, HD_, ih_, div_ = (x.unbind(1) for x in (s, z, m, c, Q, HD, inv_hdiag, div))
    for sweep in range(passes):
        last = sweep == passes - 1  # the last sweep reads no column of a block behind it again
        for i1 in range(0, d, block_size):
            i2 = min(i1 + block_size, d)
            delta = torch.zeros(shape[0], i2 - i1, shape[1], dtype=dtype, device=W.device)
            HD_block, H_block, delta_ = HD[:, i1:i2], H[:, i1:i2], delta.unbind(1)
            moved = False
            for j in range(i1, i2):
                k = j - i1
                target = torch.addcmul(Q_[j], HD_[j], ih_[j], value=-1.0)
                cj = torch.minimum(torch.addcdiv(z_[j], target, div_[j]).round_().clamp_min_(0), m_[j])
                if torch.equal(cj, c_[j]):  # no code of the column moves: delta_j = 0, nothing to update
                    continue
                moved = True
                qj = (cj - z_[j]).mul_(s_[j])
                torch.sub(qj, Q_[j], out=delta_[k])
                if j + 1 < i2:  # the block's later columns, read in this sweep: += H[:, j] delta_j^T
                    HD_block[:, k + 1 :].baddbmm_(H_block[:, k + 1 :, j : j + 1], delta[:, k : k + 1])
                Q_[j].copy_(qj)
                c_[j].copy_(cj)
            if not moved:
                continue
            HD[:, i2:] += torch.bmm(H[:, i2:, i1:i2], delta)
            if not last:  # the rest of D H: the block's own columns (each from its own delta on) and those before it
                HD_block.baddbmm_(H_block[:, :, i1:i2].triu(), delta)
                HD[:, :i1] += torch.bmm(H[:, :i1, i1:i2], delta)
    return c.transpose(1, 2).reshape(W.shape).to(torch.int64)
