"""How fast any plan could be within a budget, whatever its regions.

:func:`plan` searches plans whose unit of checkpointing is a region: a whole module or
a :class:`~hyperrec.autoac.regions.Span`. Its lower bound (``Plan.lower_bound_s``)
covers those plans only. Marking finer spans changes what can be planned, so a user who
misses a speed target at some budget needs to know whether finer regions could meet
it at all. :func:`span_free_bound` answers that from the same profile, with a bound
that holds for every plan of keep / pack / recompute decisions per saved tensor,
whatever the regions (finer spans, a different split, per-op checkpointing):

* Every tensor autograd needs is either held from the forward until its backward use
  (kept or packed) or produced again before it (recomputed; at least its own op's
  time, once).
* Everything held is alive at once when the forward ends, together with what the
  step found resident and had not released by then (parameters, optimizer state,
  inputs the caller still holds). So the held bytes fit in ``budget - resident``.

Minimising the added time (recomputation plus packing) subject to that one capacity is
a multiple-choice knapsack; its linear relaxation, solved exactly through its dual
(one multiplier on the capacity), is the bound. It ignores everything that only makes
plans slower or larger: the working set of the backward, the inputs a recomputation
needs (a region's inputs, made by another region, cost nothing in it), recomputing an
op more than once, workspaces, allocator rounding. It is priced
in the profile's op times and packing costs, like the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hyperrec.autoac._validate import check_float
from hyperrec.autoac.formats import packed_nbytes
from hyperrec.autoac.model import _pack_time, _packable
from hyperrec.autoac.planner import PlanConfig, measured_formats
from hyperrec.autoac.profiler import Profile

__all__ = ["SpanFreeBound", "span_free_bound"]


def _real(name: str, value: object, *, minimum: float, exclusive: bool = False) -> float:
    """``check_float``, with an int beyond float's range a ``ValueError`` naming the
    argument (``float()`` raises ``OverflowError`` on it)."""
    try:
        return check_float(name, value, minimum=minimum, exclusive=exclusive)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an int beyond float's range") from None


@dataclass(frozen=True)
class SpanFreeBound:
    """Result of :func:`span_free_bound`. Bytes are ints, times seconds.

    Attributes:
        budget: the peak budget asked about.
        capacity: ``budget - resident``: what held tensors may occupy at the end of the
            forward (negative: no plan fits).
        resident: bytes the step found allocated, used and still held when its
            forward ended (``Profile.resident_at_backward``; 0 for a profile made
            before 0.1.17, which does not record it). What regions that cannot be
            checkpointed hold is not counted: part of it may be held only by another
            region's checkpoint, which other plans drop.
        lower_bound_s: no plan within ``budget`` adds less time than this over keeping
            everything (``inf`` when even recomputing everything that can be does not
            fit).
        full_recompute_s: what recomputing every region adds in the same prices (full
            activation checkpointing of the profiled regions).
        step_s: the profiled step's time (fully checkpointed, instrumented: above the
            measured step).
        needed_bytes: bytes of the tensors autograd needs, all kept (no AC).
        decisions: saved tensors decided for (op outputs autograd needs).
        multiplier: the capacity's price (seconds per byte) at the optimum of the dual.
        formats: the packed formats allowed.
    """

    budget: int
    capacity: int
    resident: int
    lower_bound_s: float
    full_recompute_s: float
    step_s: float
    needed_bytes: int
    decisions: int
    multiplier: float
    formats: tuple[str, ...]

    def speedup_bound(self, no_ac_s: float, full_ac_s: float) -> float:
        """How much faster than full checkpointing any plan within the budget can run,
        given the measured steps of no AC (``no_ac_s``) and full AC (``full_ac_s``).

        A plan's step is no AC's plus what it adds. The bound's added time is in the
        profile's prices, which differ from what the measured steps imply (profiled op
        times include instrumentation; eager launches overlap in a real step), so it is
        re-priced with the measured recompute cost ``k = (full_ac_s - no_ac_s) /
        full_recompute_s``: ``full_ac_s / (no_ac_s + k * lower_bound_s)``, or without
        the re-pricing, whichever is larger. An estimate, not a proof: it assumes the
        profile over- or under-prices the ops a plan recomputes as it does all of them.

        Raises:
            TypeError: a time that is not a number.
            ValueError: a time that is not positive and finite, or ``full_ac_s`` below
                ``no_ac_s``.
        """
        n = _real("no_ac_s", no_ac_s, minimum=0.0, exclusive=True)
        f = _real("full_ac_s", full_ac_s, minimum=0.0, exclusive=True)
        if f < n:
            raise ValueError(f"full_ac_s must be >= no_ac_s ({n}), got {f}")
        if not math.isfinite(self.lower_bound_s):
            return 0.0
        k = (f - n) / self.full_recompute_s if self.full_recompute_s > 0 else 1.0
        return max(f / (n + k * self.lower_bound_s), f / (n + self.lower_bound_s))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields (``inf`` as ``None``)."""
        lb = self.lower_bound_s if math.isfinite(self.lower_bound_s) else None
        return {
            "budget": self.budget,
            "capacity": self.capacity,
            "resident": self.resident,
            "lower_bound_s": lb,
            "full_recompute_s": self.full_recompute_s,
            "step_s": self.step_s,
            "needed_bytes": self.needed_bytes,
            "decisions": self.decisions,
            "multiplier": self.multiplier,
            "formats": list(self.formats),
        }


def _choices(profile: Profile, formats: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per needed op output: (time, bytes) of each choice; ``inf`` where not allowed.

    Columns: keep, recompute, then one per format. (A region that cannot be checkpointed
    lists no ops: its saves are neither items nor counted, which only lowers the bound.)
    """
    times: list[list[float]] = []
    nbytes: list[list[float]] = []
    for r in profile.regions:
        replayable = "sac" in r.modes
        for o in r.ops:
            if o.is_input:
                # another region's output (or the step's input): counted there, if at all
                continue
            need = [lv for lv in o.storages if lv.needed]
            if not need:
                continue
            # an un-checkpointed compiled region may hold less of it (``none_held``,
            # calibrated); the least a keep can hold keeps this a lower bound
            kept = float(sum(o.none_held_bytes(lv) for lv in need))
            t = [0.0, o.time_s if (replayable and not o.collective) else math.inf]
            b = [kept, 0.0]
            for fmt in formats:
                if fmt not in o.formats:
                    t.append(math.inf)
                    b.append(math.inf)
                    continue
                tq, bq = 0.0, 0.0
                for lv in need:
                    if _packable(profile, lv, fmt):
                        tq += _pack_time(profile, fmt, lv.numel)
                        bq += packed_nbytes(lv.numel, fmt)
                    else:
                        bq += lv.nbytes
                t.append(tq)
                b.append(bq)
            times.append(t)
            nbytes.append(b)
    k = 2 + len(formats)
    return (
        np.asarray(times, dtype=np.float64).reshape(-1, k),
        np.asarray(nbytes, dtype=np.float64).reshape(-1, k),
    )


def _dual(t: np.ndarray, b: np.ndarray, cap: float, lam: np.ndarray) -> np.ndarray:
    """``sum_i min_k (t_ik + lam * b_ik) - lam * cap`` for each multiplier in ``lam``."""
    out = np.empty(lam.shape, dtype=np.float64)
    for s in range(0, lam.size, 1024):
        lm = lam[s : s + 1024]
        # inf * 0 would be nan: an unavailable choice is inf in both arrays.
        v = t[None] + lm[:, None, None] * np.where(np.isinf(b), 0.0, b)[None]
        v = np.where(np.isinf(t)[None], np.inf, v)
        out[s : s + 1024] = v.min(axis=2).sum(axis=1) - lm * cap
    return out


def span_free_bound(
    profile: Profile, budget: float, *, formats: tuple[str, ...] | None = None
) -> SpanFreeBound:
    """The least time any plan within ``budget`` could add, whatever its regions.

    Args:
        profile: from :func:`hyperrec.autoac.profile` (the op times, lifetimes and
            packing costs are read from it; regions only tell which ops may be
            replayed).
        budget: peak memory of the step in bytes, counted as :func:`plan` counts it.
        formats: packed formats allowed (a subset of those the profile measured);
            ``None``: all it measured; ``()``: keep / recompute only.

    Returns:
        :class:`SpanFreeBound`: ``lower_bound_s`` is a lower bound on the added time of
        every keep / pack / recompute plan whose peak is within ``budget``, for any
        choice of regions; :meth:`SpanFreeBound.speedup_bound` turns it into a bound on
        its speed over full checkpointing, given measured steps.

    Raises:
        TypeError: ``profile`` not a :class:`Profile`; ``budget`` not a number;
            ``formats`` not a tuple of strings.
        ValueError: ``budget`` negative, NaN or infinite; ``formats`` beyond those the
            profile measured.
    """
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
    bud = _real("budget", budget, minimum=0.0)
    # PlanConfig checks the type and the names, as for plan(formats=...)
    fmts = measured_formats(profile, PlanConfig(formats=formats).formats, "formats")
    t, b = _choices(profile, fmts)
    # Resident storages the forward released (a batch reduced and dropped) are not
    # there when it ends; a profile without the count gets none (a lower bound still).
    resident = int(profile.resident_at_backward or 0)
    cap = float(int(bud) - resident)
    full = sum(r.full_recompute_s for r in profile.regions if "sac" in r.modes)
    needed = int(b[:, 0].sum()) if b.size else 0

    lb, lam = _lp_bound(t, b, cap)
    return SpanFreeBound(
        budget=int(bud),
        capacity=int(cap),
        resident=resident,
        lower_bound_s=lb,
        full_recompute_s=full,
        step_s=profile.step_s,
        needed_bytes=needed,
        decisions=int(t.shape[0]),
        multiplier=lam,
        formats=fmts,
    )


def _lp_bound(t: np.ndarray, b: np.ndarray, cap: float) -> tuple[float, float]:
    """Optimum of the linear relaxation of: pick one choice per row minimising the sum
    of ``t`` with the sum of ``b`` at most ``cap`` (``inf``: choice not allowed).
    Returns ``(value, multiplier)``; ``(inf, inf)`` when nothing fits."""
    if t.shape[0] == 0:
        return (0.0, 0.0) if cap >= 0 else (math.inf, math.inf)
    least = np.where(np.isinf(t), np.inf, b).min(axis=1).sum()
    if cap < least:
        # Not even the smallest choice of every tensor fits: the relaxation is
        # infeasible, so no plan is.
        return math.inf, math.inf
    # The dual is concave and piecewise linear in the multiplier, with kinks where a
    # tensor's cheapest choice changes: (t_j - t_i) / (b_i - b_j) for two of its
    # choices with b_i > b_j. Its maximum lies at 0 or at one of them (strong duality:
    # the maximum is the relaxation's optimum).
    cands = [np.zeros(1)]
    k = t.shape[1]
    for i in range(k):
        for j in range(k):
            ok = np.isfinite(t[:, i]) & np.isfinite(t[:, j]) & (b[:, i] > b[:, j])
            lam = (t[ok, j] - t[ok, i]) / (b[ok, i] - b[ok, j])
            cands.append(lam[lam > 0])
    lams = np.unique(np.concatenate(cands))
    vals = _dual(t, b, cap, lams)
    best = int(np.argmax(vals))
    # The dual at 0 is the sum of each row's least time (>= 0): the max only guards
    # rounding.
    return max(float(vals[best]), 0.0), float(lams[best])
