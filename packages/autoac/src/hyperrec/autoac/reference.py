"""Executable specification of the planner: brute force over every plan.

Readable and exponential; the tests check the exact solver against it on small
instances and the greedy solver's stated bound.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hyperrec.autoac.model import Assignment, Problem, chosen

__all__ = ["brute_force", "live_bytes", "plan_time"]


def live_bytes(prob: Problem, a: Assignment) -> np.ndarray:
    """Live bytes of plan ``a`` at every segment, summed interval by interval."""
    live = prob.base.astype(np.int64).copy()
    for g in range(len(prob.groups)):
        for s, e, d in chosen(prob, a, g).intervals:
            for k in range(s, e):
                live[k] += d
    return live


def plan_time(prob: Problem, a: Assignment) -> float:
    """Added seconds of plan ``a``: fixed mode costs plus each chosen option's time."""
    total = 0.0
    for r, m in enumerate(a.modes):
        total += prob.regions[r].fixed_s[m]
    for g in range(len(prob.groups)):
        total += chosen(prob, a, g).time_s
    return total


def _held(prob: Problem, a: Assignment, r: int) -> int:
    h = prob.held_segment(r)
    return sum(
        d for g in prob.regions[r].groups for s, e, d in chosen(prob, a, g).intervals if s <= h < e
    )


def brute_force(prob: Problem) -> tuple[Assignment | None, float]:
    """The least added time over every plan that meets every cap.

    Returns:
        ``(plan, time)``; ``(None, inf)`` when no plan is feasible.
    """
    best: tuple[Assignment | None, float] = (None, math.inf)
    mode_sets = [sorted(r.fixed_s) for r in prob.regions]
    for modes in itertools.product(*mode_sets):
        ranges = [range(len(g.choices[modes[g.region]])) for g in prob.groups]
        for picks in itertools.product(*ranges):
            a = Assignment(tuple(modes), tuple(picks))
            live = live_bytes(prob, a)
            if prob.cap is not None and live.max(initial=0) > prob.cap:
                continue
            if any(_held(prob, a, r) > c for r, c in prob.region_caps.items()):
                continue
            t = plan_time(prob, a)
            if t < best[1] - 1e-15:
                best = (a, t)
    return best
