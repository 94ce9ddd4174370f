"""Bit allocation under a global storage budget: greedy knapsack, its variants and oracles.

Problem: choose one candidate j_b >= floors[b] (default 0) per block b to minimise
``sum_b losses[b][j_b]`` subject to ``sum_b costs[b][j_b] <= budget`` (bits, ascending).

Greedy (:func:`greedy_allocate`): start at the floors and repeatedly take the upgrade with the
largest ``gamma = (L_b(i) - L_b(j)) / (C_b(j) - C_b(i))`` (with ``density_costs`` T replaces C
in the denominator: the latency-aware gamma_lat) along each block's lower convex hull; an upgrade
that no longer fits retires its block.  Ties: larger absolute gain, then lower block index.  With
diminishing returns every allocation it passes through is optimal for its own cost (Everett).

Vectorised, identical to a max-heap: the heap pops hull segments in the order of a global sort
by each segment's *prefix-max heap key* (a segment never pops before its predecessor); all
segments before the first misfit form a prefix of that order, and the few that still fit after
it are found by repeated arg-max.  Also :func:`hw_greedy_allocate` (hardware-aware near-ties);
the other allocators and the table of all of them by name are in :mod:`bayesq.allocators`.
Derivations: docs/method.md.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

Table = Union[Sequence[Sequence[float]], np.ndarray]  # ragged lists or an (n, K) array
_EXACT = 2.0**53  # float64 sums of integers below this are exact in any order
_MAX_EVENTS = 64  # arg-max steps after the first misfit before a sorted scan takes over


@dataclass(frozen=True)
class _Problem:
    """Validated tables, padded to a rectangle.

    loss:  (n, K) float64, ``+inf`` where a block has fewer than K candidates.
    cost:  (n, K) float64 storage bits (padding repeats the last cost; never chosen).
    dcost: (n, K) float64 cost used in the density (``cost`` unless ``density_costs`` given).
    size:  (n,) int64 number of candidates per block.
    floor: (n,) int64 lowest allowed candidate per block.
    need:  bits of the floor allocation.
    """

    loss: np.ndarray
    cost: np.ndarray
    dcost: np.ndarray
    size: np.ndarray
    floor: np.ndarray
    need: float


def _as_table(x, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(n, K) float64 array padded with NaN and the (n,) candidate counts of a (ragged) table."""
    if isinstance(x, np.ndarray):
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D (blocks x candidates), got shape {x.shape}")
        return x.astype(np.float64, copy=False), np.full(x.shape[0], x.shape[1], np.int64)
    rows = list(x)
    size = np.array([len(r) for r in rows], np.int64)
    width = int(size.max()) if len(rows) else 0
    if len(rows) and (size == width).all():
        return np.asarray(rows, np.float64).reshape(len(rows), width), size  # (n, K)
    out = np.full((len(rows), width), np.nan)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out, size


def _validate(loss, lsize, cost, csize, name: str = "costs") -> None:
    """``ValueError`` for mismatched, empty, non-finite or non-ascending tables (NaN-padded)."""
    if loss.shape[0] != cost.shape[0]:
        raise ValueError(f"losses has {loss.shape[0]} blocks but {name} has {cost.shape[0]}")
    bad = np.flatnonzero((lsize != csize) | (lsize == 0))
    if bad.size:
        raise ValueError(f"block {bad[0]}: need the same non-zero number of losses and {name}")
    ragged = bool((csize != cost.shape[1]).any())
    valid = np.arange(cost.shape[1])[None, :] < csize[:, None]  # (n, K)
    for what, arr in (("losses", loss), (name, cost)):
        finite = np.isfinite(arr) | ~valid if ragged else np.isfinite(arr)
        if not finite.all():
            b = np.flatnonzero(~finite.all(axis=1))[0]
            raise ValueError(f"block {b}: {what} must be finite, got {arr[b][: csize[b]].tolist()}")
    steps_ok = np.diff(cost, axis=1) > 0
    if ragged:
        steps_ok |= ~valid[:, 1:]
    if not steps_ok.all():
        b = np.flatnonzero(~steps_ok.all(axis=1))[0]
        what = "candidate costs" if name == "costs" else name
        raise ValueError(f"block {b}: {what} must be strictly ascending, got {cost[b][: csize[b]].tolist()}")


def _floors(floors, size: np.ndarray) -> np.ndarray:
    if floors is None:
        return np.zeros(size.shape[0], np.int64)
    f = np.asarray(floors)
    if f.shape != size.shape or (f.size and not np.issubdtype(f.dtype, np.integer)):
        raise ValueError(
            f"floors must hold one integer candidate index per block ({size.shape[0]}), got shape {f.shape}"
        )
    bad = np.flatnonzero((f < 0) | (f >= size))
    if bad.size:
        b = bad[0]
        raise ValueError(
            f"floors[{b}]={f[b]} is out of range for block {b} with {size[b]} candidates; use 0..{size[b] - 1}"
        )
    return f.astype(np.int64)


def _need(cost: np.ndarray, floor: np.ndarray) -> float:
    """Bits of the floor allocation, summed left to right like the built-in ``sum``."""
    picked = cost.reshape(-1)[np.arange(cost.shape[0]) * cost.shape[1] + floor]  # (n,)
    return float(np.cumsum(picked)[-1]) if picked.size else 0.0


def _prepare(losses, costs, budget: float, floors=None, density_costs=None) -> _Problem:
    """Validate and pad the tables; ``ValueError`` naming the problem and the fix."""
    loss, lsize = _as_table(losses, "losses")
    cost, csize = _as_table(costs, "costs")
    _validate(loss, lsize, cost, csize)
    if budget != budget:
        raise ValueError("budget is NaN; pass the total number of bits allowed")
    dcost = cost
    if density_costs is not None:
        dcost, dsize = _as_table(density_costs, "density_costs")
        if dcost.shape[0] != cost.shape[0] or (dsize != csize).any():
            raise ValueError("density_costs must have the same shape as costs (one entry per block and candidate)")
        _validate(loss, lsize, dcost, dsize, "density_costs")
    pad = np.arange(cost.shape[1])[None, :] >= csize[:, None]  # (n, K)
    if pad.any():
        last = np.take_along_axis(cost, (csize - 1)[:, None], 1)
        loss, cost = np.where(pad, np.inf, loss), np.where(pad, last, cost)
        dcost = np.where(pad, np.take_along_axis(dcost, (csize - 1)[:, None], 1), dcost)
    floor = _floors(floors, csize)
    need = _need(cost, floor)
    if need > budget:
        how = "every block at its lowest bit-width" if floors is None else "every block at its floor candidate"
        fix = "" if floors is None else " or lower the floors"
        raise ValueError(
            f"budget of {budget:.0f} bits is infeasible: the cheapest allocation ({how}) needs "
            f"{need:.0f} bits; raise the budget to at least that{fix}"
        )
    return _Problem(loss, cost, dcost, csize, floor, need)


def min_feasible_budget(costs: Table, *, floors: Sequence[int] | None = None) -> float:
    """Bits of the cheapest allocation (every block at its first candidate, or at its floor)."""
    if floors is None and not isinstance(costs, np.ndarray):
        return float(sum(c[0] for c in costs))
    cost, size = _as_table(costs, "costs")
    return _need(cost, _floors(floors, size))


def _hulls(loss: np.ndarray, dcost: np.ndarray, floor: np.ndarray) -> tuple[np.ndarray, ...]:
    """Lower convex hulls of (dcost, loss) from each block's floor, loss strictly decreasing.

    Monotone-chain scan over candidates, vectorised over blocks (flat gathers); collinear
    points are kept.  Returns hull (n, K) int64 candidate indices (first ``length[b]`` valid),
    length (n,) int64, and the hull's losses and dcosts, (n, K) float64 each.
    """
    n, k = loss.shape
    kk = max(k, 1)
    base = np.arange(n) * kk  # flat offset of each block's row
    hull = np.zeros((n, kk), np.int64)
    hull[:, 0] = floor
    hl, hc = np.zeros((n, kk)), np.zeros((n, kk))
    hl[:, 0], hc[:, 0] = loss.reshape(-1).take(base + floor), dcost.reshape(-1).take(base + floor)
    hf, hlf, hcf = hull.reshape(-1), hl.reshape(-1), hc.reshape(-1)  # (n * K,) views
    length = np.ones(n, np.int64)
    loss_t, dcost_t = loss.T.copy(), dcost.T.copy()  # (K, n) contiguous columns
    for j in range(1, k):
        lj, cj = loss_t[j], dcost_t[j]
        act = (j > floor) & (lj < hlf[base + length - 1])  # else dominated
        r = np.flatnonzero(act & (length >= 2))
        while r.size:
            top = base[r] + length[r] - 1
            li, ci = hlf[top - 1], hcf[top - 1]
            # keep the top only if the slope from the one below to it is steeper than to j
            keep = (hlf[top] - li) * (cj[r] - ci) <= (lj[r] - li) * (hcf[top] - ci)
            popped = r[~keep]
            length[popped] -= 1
            r = popped[length[popped] >= 2]
        ra = np.flatnonzero(act)
        at = base[ra] + length[ra]
        hf[at], hlf[at], hcf[at] = j, lj[ra], cj[ra]
        length[ra] += 1
    return hull, length, hl, hc


@dataclass(frozen=True)
class _Segments:
    """Hull upgrades (i -> j) of all blocks, block-major, each block's in hull order (size m).

    block, step: (m,) int64 block index and position on its hull; extra: (m,) float64 storage
    bits added; dens: (m,) float64 gamma; ed, eg: (m,) float64 prefix-max heap key from gamma
    and the loss drop (a segment pops no earlier than its predecessor): order (-ed, -eg, block, step).
    """

    block: np.ndarray
    step: np.ndarray
    extra: np.ndarray
    dens: np.ndarray
    ed: np.ndarray
    eg: np.ndarray


def _segments(p: _Problem, hull, length, hl, hc) -> _Segments:
    """Hull upgrades of every block from :func:`_hulls` output (same argument order)."""
    n, k = hull.shape
    if k < 2:
        e = np.zeros(0)
        return _Segments(np.zeros(0, np.int64), np.zeros(0, np.int64), e, e, e, e)
    hcost = p.cost.reshape(-1).take(hull + (np.arange(n) * k)[:, None])  # (n, K) bits on the hull
    gain = hl[:, :-1] - hl[:, 1:]  # (n, K-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # slots past a hull's end: unused
        dens = gain / (hc[:, 1:] - hc[:, :-1])
    extra = hcost[:, 1:] - hcost[:, :-1]
    ed, eg = dens.copy(), gain.copy()
    for t in range(1, k - 1):  # heap key (-d, -g): running lexicographic max along the hull
        d, e_prev = dens[:, t], ed[:, t - 1]
        tied = np.minimum(gain[:, t], eg[:, t - 1])
        eg[:, t] = np.where(d < e_prev, gain[:, t], np.where(d > e_prev, eg[:, t - 1], tied))
        ed[:, t] = np.minimum(d, e_prev)
    idx = np.flatnonzero(np.arange(k - 1)[None, :] < (length - 1)[:, None])  # existing, block-major
    block, step = np.divmod(idx, k - 1)
    take = lambda a: a.reshape(-1).take(idx)  # noqa: E731  (n, K-1) -> (m,)
    return _Segments(block, step, take(extra), take(dens), take(ed), take(eg))


def _order(s: _Segments, idx: np.ndarray) -> np.ndarray:
    """``idx`` sorted by the heap key (-ed, -eg, block, step)."""
    return idx[np.lexsort((s.step[idx], s.block[idx], -s.eg[idx], -s.ed[idx]))]


def _band(s: _Segments, need: float, budget: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Split segments into a set surely taken (total extra <= room) and a band holding the first
    misfit, thresholding ``ed`` at quantiles of a fixed-seed sample; None if no split is found.
    Needs integer-valued extras (sums then do not depend on order)."""
    m = s.ed.size
    pick = np.random.default_rng(0).integers(0, m, min(m, 1 << 16))
    sample = pick[np.argsort(-s.ed[pick], kind="stable")]
    cum = np.cumsum(s.extra[sample]) * (s.extra.sum() / max(s.extra[sample].sum(), 1.0))
    at = int(np.searchsorted(cum, budget - need, side="right"))
    for delta in (256, 1024, 4096, 16384):
        hi = s.ed[sample[at - delta]] if at - delta >= 0 else np.inf
        lo = s.ed[sample[at + delta]] if at + delta < sample.size else -np.inf
        top = s.ed > hi
        if need + s.extra[top].sum() <= budget and need + s.extra[s.ed > lo].sum() > budget:
            return np.flatnonzero(top), np.flatnonzero(~top & (s.ed > lo))
    return None


def _finish(s: _Segments, taken: np.ndarray, spent: float, budget: float) -> None:
    """Continue the heap's sequence after every segment keyed before the first misfit is decided.

    Next taken = the smallest-key segment whose predecessor is taken and that still fits
    (``spent + extra <= budget``); live segments keyed before it did not fit and retired their
    blocks.  Updates ``taken`` (m,) bool in place.
    """
    q = np.flatnonzero(~taken & ~(spent + s.extra > budget))
    for _ in range(_MAX_EVENTS):
        live = q[(s.step[q] == 0) | taken[np.maximum(q - 1, 0)]]
        if live.size == 0:
            return
        best = live[s.ed[live] == s.ed[live].max()]
        nxt = _order(s, best)[0]
        taken[nxt] = True
        spent = spent + s.extra[nxt]
        q = q[q != nxt]
        q = q[~(spent + s.extra[q] > budget)]
    for x in _order(s, q).tolist():  # many small upgrades left: sorted sequential scan
        if (s.step[x] == 0 or taken[x - 1]) and not spent + s.extra[x] > budget:
            taken[x] = True
            spent = spent + s.extra[x]


def _above(s: _Segments, penalty: float) -> _Segments:
    """The segments the heap pops before its top density falls below ``penalty``: a prefix of
    every block's hull (``ed`` is non-increasing along a hull), so block-major order is kept."""
    keep = np.flatnonzero(s.ed >= penalty)
    return _Segments(*(a[keep] for a in (s.block, s.step, s.extra, s.dens, s.ed, s.eg)))


def _greedy(p: _Problem, budget: float, penalty: float = 0.0) -> np.ndarray:
    """(n,) int64 greedy choice, identical to the max-heap over hull upgrades."""
    hull, *rest = _hulls(p.loss, p.dcost, p.floor)
    s = _segments(p, hull, *rest)
    if penalty > 0:
        s = _above(s, penalty)
    taken = np.zeros(s.ed.size, bool)
    extra_sum = float(s.extra.sum())
    integral = (  # then every sum below is exact whatever its order
        bool(np.all(s.extra == np.round(s.extra))) and p.need == round(p.need) and abs(p.need) + extra_sum < _EXACT
    )
    if integral and p.need + extra_sum <= budget:
        taken[:] = True
    else:
        split = _band(s, p.need, budget) if integral else None
        top, band = split if split is not None else (np.zeros(0, np.int64), np.arange(s.ed.size))
        taken[top] = True
        band = _order(s, band)
        spent = np.cumsum(np.concatenate([[p.need + s.extra[top].sum()], s.extra[band]]))  # sequential
        misfit = np.flatnonzero(spent[:-1] + s.extra[band] > budget)
        first = misfit[0] if misfit.size else band.size
        taken[band[:first]] = True
        _finish(s, taken, float(spent[first]), budget)
    pos = np.bincount(s.block[taken], minlength=hull.shape[0])
    return hull[np.arange(hull.shape[0]), pos]


def greedy_allocate(
    losses: Table,
    costs: Table,
    budget: float,
    *,
    floors: Sequence[int] | None = None,
    density_costs: Table | None = None,
    penalty: float = 0.0,
) -> list[int]:
    """Candidate index per block chosen by the greedy gain-per-bit knapsack.

    Args:
        losses: ``losses[b][j]`` expected loss of block b at its j-th candidate; lists (ragged
            allowed) or an (n, K) array.
        costs: ``costs[b][j]`` exact bits of block b at its j-th candidate (strictly ascending).
        budget: total bits allowed.
        floors: optional lowest candidate index per block (e.g. first/last layer >= 4 bits);
            the greedy starts there and the budget must cover it.
        density_costs: optional table (shape of ``costs``, strictly ascending) replacing the
            storage cost in the density, ``gamma_lat = (L(i) - L(j)) / (T(j) - T(i))``; hulls
            are taken in (T, loss); the budget still applies to ``costs``.
        penalty: budget regularisation lambda >= 0 (loss per bit): stop once the best
            upgrade's density falls below it, i.e. minimise ``L + lambda C`` under the budget.

    Returns:
        list of chosen candidate indices, one per block; total cost <= budget.

    Raises:
        ValueError: if even the cheapest allocation exceeds ``budget`` (the message names the
            minimum feasible budget), or the tables or floors are malformed.
    """
    p = _prepare(losses, costs, budget, floors, density_costs)
    return _greedy(p, budget, _penalty(penalty)).tolist()


def _penalty(penalty: float) -> float:
    if not 0 <= penalty < np.inf:
        raise ValueError(f"penalty must be a finite number >= 0 (loss per bit), got {penalty}")
    return float(penalty)


def total(table: Table, choice: Sequence[int]) -> float:
    """Sum of ``table[b][choice[b]]`` (total loss or total bits of an allocation)."""
    if isinstance(table, np.ndarray):
        c = np.asarray(choice, np.int64)
        return float(sum(table[np.arange(c.size), c].tolist()))
    return float(sum(row[j] for row, j in zip(table, choice)))


def _hw_pick(window, layer, bits, pos_bits, counts):
    """Index into ``window`` of the upgrade the hardware rules prefer.

    Key: (change of the layer's number of distinct bit-widths, 0 if the target bit-width
    is a most common one in the layer now else 1, -density, -gain, block).
    """
    def key(entry):
        neg_d, neg_g, b, j = entry
        c, src, dst = counts[layer[b]], pos_bits[b], bits[b][j]
        distinct = 0 if src == dst else (c[dst] == 0) - (c[src] == 1)
        dominant = c[dst] == max(c.values())
        return (distinct, 0 if dominant else 1, neg_d, neg_g, b)

    return min(range(len(window)), key=lambda w: key(window[w]))


def hw_greedy_allocate(
    losses: Table,
    costs: Table,
    budget: float,
    *,
    layer: Sequence[int],
    bits: Sequence[Sequence[int]],
    eta: float = 0.01,
    floors: Sequence[int] | None = None,
    penalty: float = 0.0,
) -> list[int]:
    """Greedy with hardware-aware near-tie breaking (paper appendix, "Hardware-Aware Tie-Breakers").

    Among the available hull upgrades with density >= (1 - eta) * the best one, take the one that
    (1) adds the fewest distinct bit-widths to its layer (change of the layer's count: +1, 0 or
    -1), then (2) moves its block to a most common bit-width of its layer, then (3) has the larger
    density (then gain, block index, as greedy).  Window upgrades that do not fit retire their
    blocks (they never fit later).  ``eta == 0`` is exactly :func:`greedy_allocate`.

    Bound (docs/method.md): each upgrade has density >= (1 - eta) * the best available, so until
    an upgrade is first skipped for the budget, at spent bits c,
    ``L_hw <= L*(c) + eta * (L_floor - L*(c))`` with L*(c) the optimum at budget c.

    Args:
        layer: (n,) layer id of each block; bits: ``bits[b][j]`` bit-width of candidate j.
        eta: relative density tolerance in [0, 1).
        (others, ``penalty`` included, as in :func:`greedy_allocate`)

    Returns:
        list of chosen candidate indices, one per block; total cost <= budget.
    """
    if not 0 <= eta < 1:
        raise ValueError(f"eta must be in [0, 1) (relative density tolerance), got {eta}")
    p = _prepare(losses, costs, budget, floors)
    n = p.loss.shape[0]
    if len(layer) != n or len(bits) != n or any(len(bits[b]) != p.size[b] for b in range(n)):
        raise ValueError("layer needs one id per block and bits one bit-width per block and candidate")
    penalty = _penalty(penalty)
    if eta == 0:
        return _greedy(p, budget, penalty).tolist()
    hull, length, _, _ = _hulls(p.loss, p.dcost, p.floor)
    hulls = [hull[b, : length[b]].tolist() for b in range(n)]
    loss, cost = p.loss.tolist(), p.cost.tolist()
    pos_bits = [bits[b][hulls[b][0]] for b in range(n)]
    counts: dict[int, Counter] = {}
    for b in range(n):
        counts.setdefault(layer[b], Counter())[pos_bits[b]] += 1
    pos, spent, heap = [0] * n, p.need, []

    def push(b: int) -> None:
        if pos[b] + 1 < len(hulls[b]):
            i, j = hulls[b][pos[b]], hulls[b][pos[b] + 1]
            gain = loss[b][i] - loss[b][j]
            heapq.heappush(heap, (-gain / (cost[b][j] - cost[b][i]), -gain, b, j))

    for b in range(n):
        push(b)
    while heap and -heap[0][0] >= penalty:
        floor_d = max(-heap[0][0] * (1 - eta), penalty)
        window = []
        while heap and -heap[0][0] >= floor_d:
            e = heapq.heappop(heap)
            i = hulls[e[2]][pos[e[2]]]
            if not spent + (cost[e[2]][e[3]] - cost[e[2]][i]) > budget:
                window.append(e)  # misfits retire their block
        if not window:
            continue
        w = _hw_pick(window, layer, bits, pos_bits, counts)
        _, _, b, j = window.pop(w)
        for e in window:
            heapq.heappush(heap, e)
        spent += cost[b][j] - cost[b][hulls[b][pos[b]]]
        c = counts[layer[b]]
        c[pos_bits[b]] -= 1
        c += Counter()  # drops the bit-width if no block of the layer uses it any more
        pos_bits[b] = bits[b][j]
        c[pos_bits[b]] += 1
        pos[b] += 1
        push(b)
    return [hulls[b][pos[b]] for b in range(n)]
