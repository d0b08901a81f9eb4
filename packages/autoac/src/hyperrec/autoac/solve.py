"""Solvers for :class:`~hyperrec.autoac.model.Problem`: exact, greedy, and a lower bound.

* :func:`solve_exact`: depth-first branch and bound over region modes and group
  options. It prunes a partial plan when its time plus the least time the rest can add
  reaches the best plan found, or when its live bytes plus the least bytes the rest can
  add exceed a cap at some segment. Exact (proved optimal) when it finishes within
  ``node_limit`` nodes; the greedy plan is its first incumbent.
* :func:`solve_greedy`: marginal return. Start from the least-memory plan (full
  recompute) and repeatedly apply the move with the most seconds saved per byte of
  added peak contribution (a group's next option, or switching a region off
  checkpointing) that keeps every cap. This is how one global budget is split across
  regions: bytes go where they buy the most time. Bound: when a single position
  binds (every option's memory counts at one position, one cap), each group's moves
  follow the lower convex hull of its options, and the plan's time is at most the
  optimum plus the largest time one move saves (the classic greedy bound for the
  multiple-choice knapsack, Sinha & Zoltners 1979); tested against brute force.
* :func:`lagrangian_bound`: a lower bound on the optimal time for any instance
  (subgradient ascent on the Lagrangian dual of the caps), reported with every plan
  so that a greedy plan carries a certified optimality gap.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from hyperrec.autoac.model import (
    Assignment,
    Choice,
    Interval,
    Problem,
    min_memory,
    profile_of,
    time_of,
)

__all__ = ["SolveResult", "lagrangian_bound", "solve_exact", "solve_greedy"]

_EPS = 1e-15


@dataclass(frozen=True)
class SolveResult:
    """A solver's answer.

    Attributes:
        assignment: the plan.
        time_s: its added time.
        proven_optimal: the exact solver finished (no node limit hit).
        nodes: search nodes visited (exact) or moves applied (greedy).
    """

    assignment: Assignment
    time_s: float
    proven_optimal: bool
    nodes: int


def _weight(c: Choice) -> int:
    """Largest bytes an option adds at any position (its own peak contribution)."""
    if not c.intervals:
        return 0
    ev: dict[int, int] = {}
    for s, e, d in c.intervals:
        ev[s] = ev.get(s, 0) + d
        ev[e] = ev.get(e, 0) - d
    run = best = 0
    for k in sorted(ev):
        run += ev[k]
        best = max(best, run)
    return best


class _State:
    """Live bytes per segment of the current plan plus held bytes per capped region."""

    def __init__(self, prob: Problem, a: Assignment) -> None:
        self.prob = prob
        self.modes = list(a.modes)
        self.picks = list(a.picks)
        self.T = profile_of(prob, a)
        self.cap = math.inf if prob.cap is None else prob.cap
        self.held_seg = {r: prob.held_segment(r) for r in prob.region_caps}

    def choice(self, g: int) -> Choice:
        grp = self.prob.groups[g]
        return grp.choices[self.modes[grp.region]][self.picks[g]]

    def _delta(self, plus: list[Interval], minus: list[Interval]) -> list[Interval]:
        ev: dict[int, int] = {}
        for s, e, d in plus:
            ev[s] = ev.get(s, 0) + d
            ev[e] = ev.get(e, 0) - d
        for s, e, d in minus:
            ev[s] = ev.get(s, 0) - d
            ev[e] = ev.get(e, 0) + d
        keys = sorted(ev)
        out: list[Interval] = []
        run = 0
        for a, b in zip(keys, keys[1:]):
            run += ev[a]
            if run:
                out.append((a, b, run))
        return out

    def try_apply(self, region: int, plus: list[Interval], minus: list[Interval]) -> bool:
        delta = self._delta(plus, minus)
        for s, e, d in delta:
            if d > 0 and self.T[s:e].max() + d > self.cap:
                return False
        if region in self.held_seg:
            h = self.held_seg[region]
            held = sum(d for s, e, d in self._region_intervals(region) if s <= h < e)
            dh = sum(d for s, e, d in delta if s <= h < e)
            if dh > 0 and held + dh > self.prob.region_caps[region]:
                return False
        for s, e, d in delta:
            self.T[s:e] += d
        return True

    def _region_intervals(self, r: int) -> list[Interval]:
        out: list[Interval] = []
        for g in self.prob.regions[r].groups:
            out += list(self.choice(g).intervals)
        return out


def solve_greedy(prob: Problem, *, start: Assignment | None = None) -> SolveResult:
    """Marginal-return greedy (see module docstring), from ``start`` (default: the
    least-memory plan, :func:`~hyperrec.autoac.model.min_memory`; it must meet every
    cap)."""
    st = _State(prob, min_memory(prob) if start is None else start)
    weights = {
        (g, m, i): _weight(c)
        for g, grp in enumerate(prob.groups)
        for m, opts in grp.choices.items()
        for i, c in enumerate(opts)
    }
    # refused moves: (group, mode, option) or ("switch", region)
    blocked: set[tuple[int, str, int] | tuple[str, int]] = set()
    version = [0] * len(prob.groups)
    rversion = [0] * len(prob.regions)
    # (-seconds saved per byte, -seconds saved, kind (0 group, 1 region switch), group or
    # region, its version when pushed, option)
    heap: list[tuple[float, float, int, int, int, int]] = []
    applied = 0

    def group_move(g: int) -> None:
        grp = prob.groups[g]
        m = st.modes[grp.region]
        cur = st.choice(g)
        wc = weights[(g, m, st.picks[g])]
        best: tuple[tuple[float, float], int] | None = None
        for i, c in enumerate(grp.choices[m]):
            if (g, m, i) in blocked or c.time_s >= cur.time_s - _EPS:
                continue
            gain = cur.time_s - c.time_s
            dw = weights[(g, m, i)] - wc
            eff = math.inf if dw <= 0 else gain / dw
            key = (eff, gain)
            if best is None or key > best[0]:
                best = (key, i)
        if best is not None:
            (eff, gain), i = best
            heapq.heappush(heap, (-eff, -gain, 0, g, version[g], i))

    def switch_plan(r: int) -> tuple[list[int], float, list[Interval], list[Interval]]:
        reg = prob.regions[r]
        picks: list[int] = []
        plus: list[Interval] = []
        minus: list[Interval] = []
        t_new = reg.fixed_s["none"]
        for g in reg.groups:
            opts = prob.groups[g].choices["none"]
            i = min(range(len(opts)), key=lambda k: (weights[(g, "none", k)], opts[k].time_s))
            picks.append(i)
            t_new += opts[i].time_s
            plus += list(opts[i].intervals)
            minus += list(st.choice(g).intervals)
        return picks, t_new, plus, minus

    def region_move(r: int) -> None:
        reg = prob.regions[r]
        if st.modes[r] != "sac" or "none" not in reg.fixed_s or ("switch", r) in blocked:
            return
        t_cur = reg.fixed_s["sac"] + sum(st.choice(g).time_s for g in reg.groups)
        picks, t_new, plus, minus = switch_plan(r)
        gain = t_cur - t_new
        if gain <= _EPS:
            return
        delta = st._delta(plus, minus)
        dw = max((d for _, _, d in delta), default=0)
        eff = math.inf if dw <= 0 else gain / dw
        heapq.heappush(heap, (-eff, -gain, 1, r, rversion[r], -1))

    def rebuild() -> None:
        heap.clear()
        for g in range(len(prob.groups)):
            group_move(g)
        for r in range(len(prob.regions)):
            region_move(r)

    rebuild()
    # Moves refused once may fit after later moves freed memory (a region switched off
    # checkpointing drops recomputed copies): retry them while rounds make progress.
    for _round in range(8):
        progressed = False
        while heap:
            _, _, kind, idx, ver, i = heapq.heappop(heap)
            if kind == 0:
                g = idx
                if ver != version[g]:
                    continue
                grp = prob.groups[g]
                m = st.modes[grp.region]
                new = grp.choices[m][i]
                if st.try_apply(grp.region, list(new.intervals), list(st.choice(g).intervals)):
                    st.picks[g] = i
                    applied += 1
                    progressed = True
                    rversion[grp.region] += 1
                    region_move(grp.region)
                else:
                    blocked.add((g, m, i))
                version[g] += 1
                group_move(g)
            else:
                r = idx
                if ver != rversion[r] or st.modes[r] != "sac":
                    continue
                picks, _, plus, minus = switch_plan(r)
                if st.try_apply(r, plus, minus):
                    st.modes[r] = "none"
                    for g, i in zip(prob.regions[r].groups, picks):
                        st.picks[g] = i
                        version[g] += 1
                        group_move(g)
                    applied += 1
                    progressed = True
                else:
                    blocked.add(("switch", r))
                rversion[r] += 1
        if not progressed or not blocked:
            break
        blocked.clear()
        for k in range(len(version)):
            version[k] += 1
        for k in range(len(rversion)):
            rversion[k] += 1
        rebuild()
    a = Assignment(tuple(st.modes), tuple(st.picks))
    return SolveResult(a, time_of(prob, a), False, applied)


# --------------------------------------------------------------------------- exact
def _dense(c: Choice, n: int) -> np.ndarray:
    diff = np.zeros(n + 1, dtype=np.int64)
    for s, e, d in c.intervals:
        diff[s] += d
        diff[e] -= d
    return np.cumsum(diff[:-1])


def solve_exact(
    prob: Problem, *, node_limit: int = 200_000, incumbent: Assignment | None = None
) -> SolveResult:
    """Branch and bound (see module docstring); exact when it finishes in ``node_limit``."""
    n = prob.n_segments
    cap = np.full(n, np.iinfo(np.int64).max // 4, dtype=np.int64)
    if prob.cap is not None:
        cap = np.full(n, prob.cap, dtype=np.int64)
    room = cap - prob.base  # bytes the plan may add at each segment
    R = len(prob.regions)
    held_seg = {r: prob.held_segment(r) for r in prob.region_caps}
    # Options per (group, mode), cheapest first.
    opts: dict[tuple[int, str], list[tuple[float, np.ndarray, int]]] = {}
    gmin_v: dict[tuple[int, str], np.ndarray] = {}
    gmin_t: dict[tuple[int, str], float] = {}
    for g, grp in enumerate(prob.groups):
        for m, cs in grp.choices.items():
            lst = sorted(
                ((c.time_s, _dense(c, n), i) for i, c in enumerate(cs)), key=lambda x: x[0]
            )
            opts[(g, m)] = lst
            gmin_v[(g, m)] = np.min(np.stack([v for _, v, _ in lst]), axis=0)
            gmin_t[(g, m)] = min(t for t, _, _ in lst)
    reg_min_v, reg_min_t = [], []
    for reg in prob.regions:
        vs, ts = [], []
        for m, f in reg.fixed_s.items():
            v = np.zeros(n, dtype=np.int64)
            for g in reg.groups:
                v = v + gmin_v[(g, m)]
            vs.append(v)
            ts.append(f + sum(gmin_t[(g, m)] for g in reg.groups))
        reg_min_v.append(np.min(np.stack(vs), axis=0))
        reg_min_t.append(min(ts))
    suf_v = [np.zeros(n, dtype=np.int64) for _ in range(R + 1)]
    suf_t = [0.0] * (R + 1)
    for r in range(R - 1, -1, -1):
        suf_v[r] = suf_v[r + 1] + reg_min_v[r]
        suf_t[r] = suf_t[r + 1] + reg_min_t[r]
    # Within a region and mode: suffix minima over its groups.
    gsuf: dict[tuple[int, str], list[tuple[np.ndarray, float]]] = {}
    for r, reg in enumerate(prob.regions):
        for m in reg.fixed_s:
            acc_v, acc_t = np.zeros(n, dtype=np.int64), 0.0
            suffix = [(acc_v, acc_t)]
            for g in reversed(reg.groups):
                acc_v = acc_v + gmin_v[(g, m)]
                acc_t = acc_t + gmin_t[(g, m)]
                suffix.append((acc_v, acc_t))
            gsuf[(r, m)] = list(reversed(suffix))

    start = incumbent if incumbent is not None else solve_greedy(prob).assignment
    best_t = time_of(prob, start)
    best_a: Assignment | None = start
    if not _feasible_vec(prob, start):
        best_t, best_a = math.inf, None
    modes = [""] * R
    picks = [0] * len(prob.groups)
    nodes = [0]
    stopped = [False]

    def held_ok(r: int, m: str, vec: np.ndarray, i: int) -> bool:
        if r not in held_seg:
            return True
        h = held_seg[r]
        return vec[h] + gsuf[(r, m)][i][0][h] <= prob.region_caps[r]

    def region(r: int, cur_v: np.ndarray, cur_t: float) -> None:
        nonlocal best_t, best_a
        if r == R:
            if cur_t < best_t - 1e-15:
                best_t = cur_t
                best_a = Assignment(tuple(modes), tuple(picks))
            return
        reg = prob.regions[r]
        order = sorted(reg.fixed_s, key=lambda m: reg.fixed_s[m] + gsuf[(r, m)][0][1])
        for m in order:
            t0 = cur_t + reg.fixed_s[m]
            if t0 + gsuf[(r, m)][0][1] + suf_t[r + 1] >= best_t - 1e-15:
                continue
            if np.any(cur_v + gsuf[(r, m)][0][0] + suf_v[r + 1] > room):
                continue
            modes[r] = m
            group(r, m, 0, cur_v, t0, np.zeros(n, dtype=np.int64))

    def group(r: int, m: str, i: int, cur_v: np.ndarray, cur_t: float, reg_v: np.ndarray) -> None:
        nodes[0] += 1
        if nodes[0] > node_limit:
            stopped[0] = True
            return
        reg = prob.regions[r]
        if i == len(reg.groups):
            region(r + 1, cur_v, cur_t)
            return
        g = reg.groups[i]
        for t, v, idx in opts[(g, m)]:
            if stopped[0]:
                return
            nt = cur_t + t
            if nt + gsuf[(r, m)][i + 1][1] + suf_t[r + 1] >= best_t - 1e-15:
                break  # options are sorted by time
            nv = cur_v + v
            if np.any(nv + gsuf[(r, m)][i + 1][0] + suf_v[r + 1] > room):
                continue
            nreg = reg_v + v
            if not held_ok(r, m, nreg, i + 1):
                continue
            picks[g] = idx
            group(r, m, i + 1, nv, nt, nreg)

    region(0, np.zeros(n, dtype=np.int64), 0.0)
    a = best_a if best_a is not None else start
    return SolveResult(a, time_of(prob, a), not stopped[0], nodes[0])


def _feasible_vec(prob: Problem, a: Assignment) -> bool:
    from hyperrec.autoac.model import feasible

    return feasible(prob, a)


# --------------------------------------------------------------------------- bound
def lagrangian_bound(prob: Problem, *, iters: int = 200, upper: float | None = None) -> float:
    """A lower bound on the least added time of any feasible plan.

    Relaxes the caps with multipliers ``mu`` (per segment) and ``nu`` (per capped
    region) and maximises the dual function by projected subgradient steps (Polyak step
    towards ``upper``, the best known plan's time). Any value it returns is a valid
    lower bound: ``min_plan time + mu . (live - cap) + nu . (held - cap) <= OPT`` for
    every ``mu, nu >= 0``.
    """
    n = prob.n_segments
    rows: list[tuple[int, str, float]] = []  # (group, mode, time) per option
    iv_row, iv_s, iv_e, iv_d = [], [], [], []
    index: dict[tuple[int, str], list[int]] = {}
    for g, grp in enumerate(prob.groups):
        for m, cs in grp.choices.items():
            ids = []
            for c in cs:
                k = len(rows)
                rows.append((g, m, c.time_s))
                ids.append(k)
                for s, e, d in c.intervals:
                    iv_row.append(k)
                    iv_s.append(s)
                    iv_e.append(e)
                    iv_d.append(d)
            index[(g, m)] = ids
    t = np.array([x[2] for x in rows], dtype=np.float64)
    iv_row_a = np.asarray(iv_row, dtype=np.int64)
    iv_s_a = np.asarray(iv_s, dtype=np.int64)
    iv_e_a = np.asarray(iv_e, dtype=np.int64)
    iv_d_a = np.asarray(iv_d, dtype=np.float64)
    held_seg = {r: prob.held_segment(r) for r in prob.region_caps}
    capped = list(held_seg)
    on_masks = []
    for r in capped:
        h = held_seg[r]
        inr = np.isin(iv_row_a, _rows_of_region(prob, index, r))
        on_masks.append(inr & (iv_s_a <= h) & (iv_e_a > h))
    mu = np.zeros(n)
    nu = np.zeros(len(capped))
    has_cap = prob.cap is not None
    cap = float(prob.cap) if prob.cap is not None else 0.0
    best = -math.inf
    theta = 1.0
    stall = 0
    ub = upper
    for _ in range(max(iters, 1)):
        M = np.concatenate([[0.0], np.cumsum(mu)])
        cost = t.copy()
        if len(iv_row_a):
            contrib = iv_d_a * (M[iv_e_a] - M[iv_s_a])
            for j in range(len(capped)):
                contrib = contrib + np.where(on_masks[j], iv_d_a * nu[j], 0.0)
            cost += np.bincount(iv_row_a, weights=contrib, minlength=len(rows))
        total = 0.0
        pick_rows: list[int] = []
        for reg in prob.regions:
            best_v, best_rows = math.inf, []
            for m, f in reg.fixed_s.items():
                v, rs = f, []
                for g in reg.groups:
                    ids = index[(g, m)]
                    k = ids[int(np.argmin(cost[ids]))]
                    v += cost[k]
                    rs.append(k)
                if v < best_v:
                    best_v, best_rows = v, rs
            total += best_v
            pick_rows += best_rows
        if has_cap:
            total += float(mu @ (prob.base - cap))
        for j, r in enumerate(capped):
            total -= nu[j] * prob.region_caps[r]
        best = max(best, total)
        # Subgradient at the minimiser.
        diff = np.zeros(n + 1)
        held = np.zeros(len(capped))
        if len(iv_row_a):
            sel = np.isin(iv_row_a, np.asarray(pick_rows, dtype=np.int64))
            np.add.at(diff, iv_s_a[sel], iv_d_a[sel])
            np.add.at(diff, iv_e_a[sel], -iv_d_a[sel])
            for j in range(len(capped)):
                held[j] = iv_d_a[on_masks[j] & sel].sum()
        live = prob.base + np.cumsum(diff[:-1])
        gmu = (live - cap) if has_cap else np.zeros(n)
        gnu = np.array([held[j] - prob.region_caps[r] for j, r in enumerate(capped)])
        norm = float(gmu @ gmu + gnu @ gnu)
        if norm <= 0:
            break
        if ub is None or not math.isfinite(ub):
            ub = total + 1.0
        step = theta * max(ub - total, 1e-12) / norm
        if has_cap:
            mu = np.maximum(0.0, mu + step * gmu)
        nu = np.maximum(0.0, nu + step * gnu)
        if total >= best - 1e-15:
            stall = 0
        else:
            stall += 1
            if stall >= 10:
                theta *= 0.5
                stall = 0
    return best


def _rows_of_region(prob: Problem, index: dict[tuple[int, str], list[int]], r: int) -> np.ndarray:
    rows: list[int] = []
    for g in prob.regions[r].groups:
        for (gg, _m), ids in index.items():
            if gg == g:
                rows += ids
    return np.asarray(rows, dtype=np.int64)
