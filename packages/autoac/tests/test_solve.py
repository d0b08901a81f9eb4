"""Planner solvers on random small instances against brute force (the reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.autoac.model import (
    Choice,
    Group,
    Problem,
    RegionModes,
    feasible,
    min_memory,
    peak_of,
    time_of,
)
from hyperrec.autoac.reference import brute_force, live_bytes, plan_time
from hyperrec.autoac.solve import _weight, lagrangian_bound, solve_exact, solve_greedy


def random_problem(
    seed: int,
    *,
    regions: int = 2,
    max_groups: int = 3,
    segments: int = 10,
    single_position: bool = False,
    none_mode: bool = True,
    region_cap: bool = False,
) -> Problem:
    """Intervals and times drawn at random; the cap between the floor and the no-limit peak.

    ``single_position``: one segment, every option's bytes count there (the setting of
    the greedy bound); only the ``"sac"`` mode.
    """
    rng = np.random.default_rng(seed)
    n = 1 if single_position else segments
    base = rng.integers(100, 1000, size=n).astype(np.int64)
    regs, groups = [], []
    for r in range(regions):
        modes = {"sac": float(rng.uniform(0, 2))}
        if none_mode and not single_position:
            modes["none"] = 0.0
        rm = RegionModes(f"r{r}", modes, held_pos=int(rng.integers(0, n)), input_bytes=10)
        for _ in range(int(rng.integers(1, max_groups + 1))):
            ch: dict[str, list[Choice]] = {}
            for m in modes:
                opts = []
                k = int(rng.integers(1 if m == "none" else 2, 4))
                for i in range(k):
                    t = 0.0 if (m == "none" and i == 0) else float(rng.uniform(0, 5))
                    if m == "sac" and i == 0:
                        opts.append(Choice("recompute", t, ()))
                        continue
                    ivs = []
                    for _ in range(int(rng.integers(1, 3))):
                        if single_position:
                            ivs.append((0, 1, int(rng.integers(1, 400))))
                        else:
                            a = int(rng.integers(0, n))
                            b = int(rng.integers(a + 1, n + 1))
                            ivs.append((a, b, int(rng.integers(-50, 400))))
                    opts.append(Choice("keep" if i == 1 else f"f{i}", t, tuple(ivs)))
                ch[m] = opts
            rm.groups.append(len(groups))
            groups.append(Group(region=r, op=None, choices=ch))
        regs.append(rm)
    prob = Problem(base=base, seg_start=np.arange(n), regions=regs, groups=groups)
    floor = peak_of(prob, min_memory(prob))
    hi = floor + 1200
    prob.cap = int(rng.integers(floor, hi + 1))
    if region_cap:
        prob.region_caps = {0: int(rng.integers(0, 600))}
    return prob


seeds = st.integers(min_value=0, max_value=2**31 - 1)


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_exact_matches_brute_force(seed):
    prob = random_problem(seed)
    a_ref, t_ref = brute_force(prob)
    res = solve_exact(prob)
    assert res.proven_optimal
    assert a_ref is not None  # the least-memory plan meets the cap by construction
    assert feasible(prob, res.assignment)
    assert math.isclose(res.time_s, t_ref, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_exact_matches_brute_force_with_region_caps(seed):
    prob = random_problem(seed, region_cap=True)
    a_ref, t_ref = brute_force(prob)
    res = solve_exact(prob)
    if a_ref is None:
        # Region caps below what the least-memory plan holds can make it infeasible.
        assert not feasible(prob, res.assignment)
        return
    assert feasible(prob, res.assignment)
    assert math.isclose(res.time_s, t_ref, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_greedy_feasible_and_bound_below_optimum(seed):
    prob = random_problem(seed)
    _, t_ref = brute_force(prob)
    g = solve_greedy(prob)
    assert feasible(prob, g.assignment)
    assert g.time_s >= t_ref - 1e-12
    lb = lagrangian_bound(prob, iters=60, upper=g.time_s)
    assert lb <= t_ref + 1e-9


@settings(max_examples=80, deadline=None)
@given(seeds)
def test_greedy_bound_single_position(seed):
    """One binding position: greedy <= optimum + the most time one move saves."""
    prob = random_problem(seed, regions=3, max_groups=3, single_position=True)
    _, t_ref = brute_force(prob)
    g = solve_greedy(prob)
    assert feasible(prob, g.assignment)
    largest = max(
        max(c.time_s for c in grp.choices["sac"]) - min(c.time_s for c in grp.choices["sac"])
        for grp in prob.groups
    )
    assert g.time_s <= t_ref + largest + 1e-12


def test_greedy_bound_is_attained_shape():
    """The classic bad case for greedy: a dense small item blocks the big one; the bound
    (largest single gain) is what it loses, not more."""
    groups = [
        Group(0, None, {"sac": [Choice("recompute", 1.0, ()), Choice("keep", 0.0, ((0, 1, 1),))]}),
        Group(0, None, {"sac": [Choice("recompute", 9.0, ()), Choice("keep", 0.0, ((0, 1, 10),))]}),
    ]
    reg = RegionModes("r", {"sac": 0.0}, 0, 0, [0, 1])
    prob = Problem(np.array([0]), np.array([0]), [reg], groups, cap=10)
    g = solve_greedy(prob)
    _, t_ref = brute_force(prob)
    assert t_ref == 1.0
    assert g.time_s == 9.0  # takes the dense item first, then the big one no longer fits
    assert g.time_s <= t_ref + 9.0
    assert solve_exact(prob).time_s == 1.0


def test_reference_helpers_agree_with_model():
    prob = random_problem(7)
    a = solve_greedy(prob).assignment
    assert plan_time(prob, a) == pytest.approx(time_of(prob, a))
    assert int(live_bytes(prob, a).max()) == peak_of(prob, a)


def test_exact_node_limit_reports_unproven():
    prob = random_problem(3, regions=3, max_groups=3)
    res = solve_exact(prob, node_limit=1)
    assert not res.proven_optimal
    assert feasible(prob, res.assignment)


def test_weight_is_peak_of_own_intervals():
    c = Choice("keep", 0.0, ((0, 4, 3), (2, 6, 5), (5, 7, -1)))
    assert _weight(c) == 8
