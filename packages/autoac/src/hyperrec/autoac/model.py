"""The planning problem: choices, their memory over the step, their time.

Every plan is the profiled (fully checkpointed) trace with some lifetimes changed. A
**choice** for one op's outputs is a recompute time plus a list of intervals
``(start, end, bytes)`` of positions where the plan holds ``bytes`` more (or less)
than the trace; a plan's live bytes at position ``p`` are the trace's plus the sum of
its choices' intervals covering ``p``, so its peak is a maximum over positions, not a
sum of saved bytes.

Per region the plan picks a **mode**:

``"sac"``: checkpointed with a selective policy. For each op output:
    * ``recompute``: nothing held; pays the op's time in the recomputation.
    * ``keep``: held from where Python released it (``fwd_free``) to where the
      recomputation would have recreated it (``rc_alloc``).
    * a packed format: a packed copy held from the op (``fwd_alloc``) to
      ``rc_alloc``, where it is unpacked (plus the unpacker's workspace there); pays
      packing and unpacking.
    A checkpoint also replays in-place/view ops and random ops (``fixed`` time).

``"none"``: not checkpointed. Tensors autograd needs are held from the forward
    (``keep``) or packed until their first backward use; nothing is recomputed, so
    the recomputed copies of the tensors autograd does not need disappear.

Positions are compressed to segments between interval endpoints: the sum of any
plan's intervals is constant on a segment, so each segment keeps only its largest
trace value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hyperrec.autoac.formats import packed_nbytes
from hyperrec.autoac.profiler import Profile, RegionProfile, SavedOp, StorageLife, packable

__all__ = [
    "Assignment",
    "Choice",
    "Group",
    "Problem",
    "RegionModes",
    "build_problem",
    "compress",
    "least_peak",
]

Interval = tuple[int, int, int]


@dataclass(frozen=True)
class Choice:
    """One option for a group: its kind, added time and memory intervals.

    Attributes:
        kind: ``"recompute"``, ``"keep"``, ``"drop"`` (none-mode, not needed) or a
            format name.
        time_s: seconds it adds to the step.
        intervals: ``(start, end, bytes)`` over positions (end exclusive), relative to
            the profiled trace.
    """

    kind: str
    time_s: float
    intervals: tuple[Interval, ...]


@dataclass
class Group:
    """The op outputs one decision covers, with its options per region mode."""

    region: int
    op: SavedOp | None
    choices: dict[str, list[Choice]]  # mode -> options


@dataclass
class RegionModes:
    """Per region: allowed modes, the time each mode always adds, the held position
    (a position of the trace: the last one before the region's recomputation)."""

    name: str
    fixed_s: dict[str, float]
    held_pos: int
    input_bytes: int
    groups: list[int] = field(default_factory=list)


@dataclass
class Problem:
    """A planning instance on compressed positions (segments).

    Attributes:
        base: largest trace value on each segment (bytes, int64), ``S`` entries.
        seg_start: first position of each segment.
        regions: per region, its modes and groups.
        groups: the decision groups; intervals already mapped to segments.
        cap: bound on ``base + sum of chosen intervals`` at every segment (``None``: no
            global budget).
        region_caps: ``region -> bound`` on the region's held bytes beyond its inputs
            at its held position.
        offset: device bytes outside the trace added to every reported peak.
    """

    base: np.ndarray
    seg_start: np.ndarray
    regions: list[RegionModes]
    groups: list[Group]
    cap: int | None = None
    region_caps: dict[int, int] = field(default_factory=dict)
    offset: int = 0

    @property
    def n_segments(self) -> int:
        return len(self.base)

    def held_segment(self, r: int) -> int:
        return int(np.searchsorted(self.seg_start, self.regions[r].held_pos, side="right") - 1)


# --------------------------------------------------------------------------- choices
def _iv(a: int | None, b: int | None, d: int) -> list[Interval]:
    if a is None or b is None or b <= a or d == 0:
        return []
    return [(int(a), int(b), int(d))]


def _pack_time(profile: Profile, fmt: str, numel: int) -> float:
    c = profile.pack_costs.get(fmt)
    if c is None:
        return 0.0
    return (
        c["pack_call_s"]
        + c["pack_per_elem_s"] * numel
        + c["unpack_call_s"]
        + c["unpack_per_elem_s"] * numel
    )


def _ws(profile: Profile, fmt: str, key: str, numel: int) -> int:
    c = profile.pack_costs.get(fmt)
    return 0 if c is None else int(c[key] * numel)


def _workspaces(
    profile: Profile, fmt: str, lv: StorageLife, pack_at: int, unpack_at: int, held: int = 0
) -> list[Interval]:
    """The packer's workspace at ``pack_at`` and the unpacker's at ``unpack_at`` (plus
    ``held`` bytes there), one position each."""
    return _iv(pack_at, pack_at + 1, _ws(profile, fmt, "pack_ws_per_elem", lv.numel)) + _iv(
        unpack_at, unpack_at + 1, held + _ws(profile, fmt, "unpack_ws_per_elem", lv.numel)
    )


def _packable(profile: Profile, lv: StorageLife, fmt: str) -> bool:
    return packable(lv, fmt, profile.config.min_pack_bytes)


def _sac_choices(profile: Profile, o: SavedOp, formats: tuple[str, ...]) -> list[Choice]:
    t = o.time_s if o.recomputed else 0.0
    out = [Choice("recompute", t, ())]
    if o.random or o.mutated or not o.recomputed:
        return out
    keep: list[Interval] = []
    for lv in o.storages:
        keep += _iv(lv.fwd_free, lv.rc_alloc, lv.nbytes)
    out.append(Choice("keep", 0.0, tuple(keep)))
    for fmt in formats:
        if fmt not in o.formats:
            continue
        ivs: list[Interval] = []
        tq = 0.0
        for lv in o.storages:
            if lv.rc_alloc is None:
                continue
            if not _packable(profile, lv, fmt):
                ivs += _iv(lv.fwd_free, lv.rc_alloc, lv.nbytes)
                continue
            pb = packed_nbytes(lv.numel, fmt)
            ivs += _iv(lv.fwd_alloc, lv.rc_alloc, pb)
            ivs += _workspaces(profile, fmt, lv, lv.fwd_alloc, lv.rc_alloc, held=pb)
            tq += _pack_time(profile, fmt, lv.numel)
        out.append(Choice(fmt, tq, tuple(ivs)))
    return out


def _input_choices(profile: Profile, o: SavedOp, formats: tuple[str, ...]) -> list[Choice]:
    """An un-checkpointed region's input (see ``profiler._with_input_ops``): kept as the
    trace holds it, or packed: the packed copy from the region's first op to the
    trace's release, the input itself gone from its last forward read to its first
    backward read (``rc_alloc``, where the backward unpacks it)."""
    out = [Choice("keep", 0.0, ())]
    for fmt in formats:
        if fmt not in o.formats:
            continue
        ivs: list[Interval] = []
        tq = 0.0
        for lv in o.storages:
            if not _packable(profile, lv, fmt) or lv.rc_alloc is None or lv.rc_free is None:
                continue
            pb = packed_nbytes(lv.numel, fmt)
            ivs += _iv(lv.fwd_alloc, max(lv.rc_free, lv.rc_alloc + 1), pb)
            ivs += _iv(lv.fwd_free, lv.rc_alloc, -lv.nbytes)
            ivs += _workspaces(profile, fmt, lv, lv.fwd_alloc, lv.rc_alloc)
            tq += _pack_time(profile, fmt, lv.numel)
        if ivs:
            out.append(Choice(fmt, tq, tuple(ivs)))
    return out


def _none_choices(profile: Profile, o: SavedOp, formats: tuple[str, ...]) -> list[Choice]:
    if o.is_input:
        return _input_choices(profile, o, formats)
    keep: list[Interval] = []
    for lv in o.storages:
        if lv.needed:
            # a compiled graph may hold only part of it (recomputing the rest in its
            # backward); the backward's copy stays in the base trace
            keep += _iv(lv.fwd_free, lv.rc_alloc, o.none_held_bytes(lv))
        else:
            keep += _iv(lv.rc_alloc, lv.rc_free, -lv.nbytes)
    out = [Choice("keep" if o.needed else "drop", 0.0, tuple(keep))]
    if not o.needed:
        return out
    for fmt in formats:
        if fmt not in o.formats:
            continue
        ivs: list[Interval] = []
        tq = 0.0
        for lv in o.storages:
            if not lv.needed:
                ivs += _iv(lv.rc_alloc, lv.rc_free, -lv.nbytes)
                continue
            if not _packable(profile, lv, fmt) or lv.rc_alloc is None:
                ivs += _iv(lv.fwd_free, lv.rc_alloc, lv.nbytes)
                continue
            last = lv.bwd_use if lv.bwd_use is not None else lv.rc_free
            if last is None:
                # The profiler sets rc_free whenever it sets rc_alloc.
                raise ValueError(
                    f"profile of {o.op} has a recomputed storage with neither a backward "
                    "use nor a release (rc_free)"
                )
            use = max(min(last, lv.rc_free if lv.rc_free is not None else last), lv.rc_alloc)
            pb = packed_nbytes(lv.numel, fmt)
            ivs += _iv(lv.fwd_alloc, use, pb)
            ivs += _iv(lv.rc_alloc, use, -lv.nbytes)
            ivs += _workspaces(profile, fmt, lv, lv.fwd_alloc, use)
            # The packed copy is held by every backward node that saved a view of the
            # storage, until the last one releases it (where the trace frees the
            # recomputed copy, rc_free), not only until the first use: ending it at the
            # first use under-predicted every position up to the last node's unpack.
            end = max(lv.rc_free if lv.rc_free is not None else use, use + 1)
            ivs += _iv(use, end, pb)
            tq += _pack_time(profile, fmt, lv.numel)
        out.append(Choice(fmt, tq, tuple(ivs)))
    return out


def _backward_span(profile: Profile, r: RegionProfile) -> tuple[int, int] | None:
    """Positions ``[a, b)`` of region ``r``'s recomputation and backward in the trace:
    from its recomputation to the release of the last tensor it recomputed (its
    backward's end: the backward of what comes before it in the forward, regions
    profiled un-checkpointed or modules outside regions, follows), and never past the
    next region's recomputation."""
    a = r.rc_start
    if a is None or a < 1:
        return None
    later = [q.rc_start for q in profile.regions if q.rc_start is not None and q.rc_start > a]
    b = min(later, default=len(profile.live))
    frees = [lv.rc_free for o in r.ops for lv in o.storages if lv.rc_free is not None]
    if frees:
        b = min(b, max(max(frees) + 1, a + 1))
    return a, b


def _none_backward_fit(profile: Profile, r: RegionProfile, groups: list[Group]) -> list[Interval]:
    """Intervals that make the un-checkpointed region's backward allocate
    ``r.none_backward_bytes`` at most beyond the live bytes where it starts (the most,
    where the trace allocates less): the eager backward the trace recorded allocates
    what a compiled one fuses away (every element-wise gradient). Computed on the
    region's un-packed un-checkpointed choices; other regions' choices are constant
    over the span (their held bytes)."""
    span = _backward_span(profile, r)
    cap = r.none_backward_bytes
    if span is None or cap is None:
        return []
    a, b = span
    lo = a - 1
    diff = np.zeros(b - lo + 1, dtype=np.int64)
    for g in groups:
        opts = g.choices.get("none", [])
        c = next((c for c in opts if c.kind in ("keep", "drop")), None)
        for s, e, d in () if c is None else c.intervals:
            s, e = max(s, lo), min(e, b)
            if s < e:
                diff[s - lo] += d
                diff[e - lo] -= d
    live = np.asarray(profile.live[lo:b], dtype=np.int64) + np.cumsum(diff[:-1])
    ws = live[1:] - live[0]  # the span is never empty
    cut = -np.maximum(ws - cap, 0)
    top = int(np.argmax(ws))
    if cap > ws[top]:
        cut[top] += cap - int(ws[top])  # the compiled backward allocates more
    ivs: list[Interval] = []
    start = 0
    for i in range(1, len(cut) + 1):
        if i == len(cut) or cut[i] != cut[start]:
            if cut[start] != 0:
                ivs.append((a + start, a + i, int(cut[start])))
            start = i
    return ivs


def build_problem(
    profile: Profile,
    *,
    formats: tuple[str, ...],
    allow_none: bool = True,
) -> Problem:
    """The planning instance of ``profile``, intervals on trace positions (see
    :func:`compress`)."""
    regions: list[RegionModes] = []
    groups: list[Group] = []
    for r in profile.regions:
        modes = [m for m in r.modes if allow_none or m != "none" or r.modes == ("none",)]
        held = (r.rc_start - 1) if r.rc_start is not None else r.fwd_start
        rm = RegionModes(
            name=r.name,
            fixed_s={m: (r.fixed_recompute_s if m == "sac" else 0.0) for m in modes},
            held_pos=max(held, 0),
            input_bytes=r.input_bytes,
        )
        regions.append(rm)
        if r.rc_start is None:
            continue
        for o in r.ops:
            if o.collective:
                continue
            ch: dict[str, list[Choice]] = {}
            if "sac" in modes:
                ch["sac"] = _sac_choices(profile, o, formats)
            if "none" in modes:
                ch["none"] = _none_choices(profile, o, formats)
            # A group with one option in every mode and no memory is a constant.
            if all(len(v) == 1 and not v[0].intervals for v in ch.values()):
                for m, v in ch.items():
                    rm.fixed_s[m] += v[0].time_s
                continue
            rm.groups.append(len(groups))
            groups.append(Group(region=r.index, op=o, choices=ch))
        # not where the region may pack: the fit is of its unpacked backward, and a
        # packed region's live bytes there are other (the measured step packs nothing)
        fit = r.none_backward_bytes is not None and "none" in modes
        if fit and not any(f in o.formats for o in r.ops for f in formats):
            ivs = _none_backward_fit(profile, r, [groups[g] for g in rm.groups])
            if ivs:
                # the same in every plan that leaves the region un-checkpointed: one
                # option per mode ("drop": no decision of the plan)
                rm.groups.append(len(groups))
                ch = {"none": [Choice("drop", 0.0, tuple(ivs))]}
                if "sac" in modes:
                    ch["sac"] = [Choice("drop", 0.0, ())]
                groups.append(Group(region=r.index, op=None, choices=ch))
    base = np.asarray(profile.live, dtype=np.int64)
    prob = Problem(
        base=base,
        seg_start=np.arange(len(base), dtype=np.int64),
        regions=regions,
        groups=groups,
        offset=profile.device_offset,
    )
    return prob


def compress(prob: Problem) -> Problem:
    """Map positions to segments between interval endpoints (see module docstring)."""
    n = len(prob.base)
    cuts = {0, n}
    for g in prob.groups:
        for opts in g.choices.values():
            for c in opts:
                for a, b, _ in c.intervals:
                    cuts.add(min(max(a, 0), n))
                    cuts.add(min(max(b, 0), n))
    for r in prob.regions:
        cuts.add(min(r.held_pos, n - 1))
        cuts.add(min(r.held_pos + 1, n))
    bp = np.array(sorted(cuts), dtype=np.int64)
    starts = bp[:-1]
    seg_base = np.maximum.reduceat(prob.base, starts) if n else np.zeros(0, np.int64)

    def seg(p: int) -> int:
        return int(np.searchsorted(bp, min(max(p, 0), n), side="left"))

    groups = []
    for g in prob.groups:
        ch = {}
        for m, opts in g.choices.items():
            ch[m] = [
                Choice(
                    c.kind,
                    c.time_s,
                    tuple((seg(a), seg(b), d) for a, b, d in c.intervals if seg(b) > seg(a)),
                )
                for c in opts
            ]
        groups.append(Group(g.region, g.op, ch))
    regions = [
        RegionModes(
            r.name,
            dict(r.fixed_s),
            r.held_pos,
            r.input_bytes,
            list(r.groups),
        )
        for r in prob.regions
    ]
    return Problem(
        base=seg_base.astype(np.int64),
        seg_start=starts,
        regions=regions,
        groups=groups,
        cap=prob.cap,
        region_caps=dict(prob.region_caps),
        offset=prob.offset,
    )


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class Assignment:
    """A solution: a mode per region and an option index per group (in that mode)."""

    modes: tuple[str, ...]
    picks: tuple[int, ...]


def chosen(prob: Problem, a: Assignment, g: int) -> Choice:
    grp = prob.groups[g]
    return grp.choices[a.modes[grp.region]][a.picks[g]]


def profile_of(prob: Problem, a: Assignment) -> np.ndarray:
    """``base + sum of chosen intervals`` on every segment (int64)."""
    diff = np.zeros(len(prob.base) + 1, dtype=np.int64)
    for g in range(len(prob.groups)):
        for s, e, d in chosen(prob, a, g).intervals:
            diff[s] += d
            diff[e] -= d
    return prob.base + np.cumsum(diff[:-1])


def time_of(prob: Problem, a: Assignment) -> float:
    t = sum(prob.regions[r].fixed_s[m] for r, m in enumerate(a.modes))
    return t + sum(chosen(prob, a, g).time_s for g in range(len(prob.groups)))


def held_of(prob: Problem, a: Assignment, r: int) -> int:
    """Bytes region ``r`` holds beyond its inputs just before its recomputation."""
    h = prob.held_segment(r)
    tot = 0
    for g in prob.regions[r].groups:
        for s, e, d in chosen(prob, a, g).intervals:
            if s <= h < e:
                tot += d
    return tot


def feasible(prob: Problem, a: Assignment) -> bool:
    """Whether ``a`` meets the global cap at every segment and every region cap."""
    if prob.cap is not None and profile_of(prob, a).max(initial=0) > prob.cap:
        return False
    return all(held_of(prob, a, r) <= c for r, c in prob.region_caps.items())


def peak_of(prob: Problem, a: Assignment) -> int:
    """Largest live bytes of ``a`` over the step (trace level, without the offset)."""
    return int(profile_of(prob, a).max(initial=0))


def min_memory(prob: Problem) -> Assignment:
    """Every region checkpointed (where allowed), every group at its least memory."""
    modes = tuple("sac" if "sac" in r.fixed_s else next(iter(r.fixed_s)) for r in prob.regions)
    picks = []
    for g in prob.groups:
        opts = g.choices[modes[g.region]]
        w = [max((d for _, _, d in c.intervals), default=0) for c in opts]
        picks.append(int(np.argmin(w)) if opts[0].kind != "recompute" else 0)
    return Assignment(modes, tuple(picks))


def least_peak(
    prob: Problem,
    *,
    frozen: frozenset[int] = frozenset(),
    caps: Mapping[int, int] | None = None,
) -> Assignment:
    """:func:`min_memory`, then every region (outside ``frozen``) whose un-checkpointed
    mode lowers the step's peak left un-checkpointed, until no switch lowers it.

    Full recompute is not always the least peak: a checkpoint holds its inputs until its
    backward and its recomputation allocates again what the backward does not need, so
    for a region whose saved tensors are small, not checkpointing it uses less. Taking
    :func:`min_memory`'s peak as the floor rejected feasible budgets with an error
    naming a "smallest feasible" budget that was not. A local search (one region at a
    time) from the lower of :func:`min_memory` and no checkpoint (outside ``frozen``):
    never above either's peak. A region in ``frozen`` with an entry in ``caps`` (bytes
    it may hold beyond its inputs) may be left un-checkpointed where that fits its cap.
    """
    caps = caps or {}
    a = min_memory(prob)
    best = peak_of(prob, a)
    off = tuple(
        "none" if r not in frozen and "none" in reg.fixed_s else a.modes[r]
        for r, reg in enumerate(prob.regions)
    )
    no_ac = Assignment(
        off,
        tuple(
            next((i for i, c in enumerate(g.choices["none"]) if c.kind in ("keep", "drop")), 0)
            if off[g.region] == "none"
            else a.picks[k]
            for k, g in enumerate(prob.groups)
        ),
    )
    if peak_of(prob, no_ac) < best:
        a, best = no_ac, peak_of(prob, no_ac)
    improved = True
    while improved:
        improved = False
        for r, reg in enumerate(prob.regions):
            if (r in frozen and r not in caps) or a.modes[r] == "none" or "none" not in reg.fixed_s:
                continue
            modes = list(a.modes)
            modes[r] = "none"
            picks = list(a.picks)
            for g in reg.groups:
                opts = prob.groups[g].choices["none"]
                w = [max((d for _, _, d in c.intervals), default=0) for c in opts]
                picks[g] = int(np.argmin(w))
            b = Assignment(tuple(modes), tuple(picks))
            if r in frozen and held_of(prob, b, r) > caps[r]:
                continue
            pb = peak_of(prob, b)
            if pb < best:
                a, best, improved = b, pb, True
    return a
