"""The layout planner: pack tensors into one flat, rank-major buffer of equal shards.

``plan_layout(numels, granularities, world_size, alignment=...)`` returns a
:class:`Layout`: tensor ``i`` occupies ``[offsets[i], offsets[i] + numels[i])`` of a buffer
of ``world_size * shard_numel`` elements, rank ``r`` owns ``[r * S, (r + 1) * S)`` with
``S = shard_numel``. Contract (checked by the tests with :func:`.reference.layout_violations`):

- tensors do not overlap and lie inside the buffer;
- every offset, and ``S`` itself, is a multiple of ``alignment`` (so each rank's shard
  and every tensor piece inside it start aligned);
- no multiple of ``S`` falls strictly inside a block of any tensor (a block is
  ``granularities[i]`` consecutive elements counted from the tensor's start; the last
  may be shorter), so a rank boundary never cuts a block;
- all shards have the same size, so one ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` moves the whole buffer;
- the result is a pure function of the inputs (same on every rank).

How: a *strategy* orders the tensors; one shared pass lays them out in that order,
vectorised between rank boundaries (``O(world_size)`` Python steps, not ``O(n)``). At a
boundary the crossing tensor starts at the nearest offset where the boundary meets one
of its block starts (or, if it cannot cross, at the boundary); the gap left behind is a
*hole*. Strategies with ``fill_holes`` then move their smallest tensors from the tail
into holes (best fit). The ``pack`` strategy instead bin-packs tensors that are a single
block (whole matrices) best-fit-decreasing into shards. ``S`` starts at the lower bound
and grows only as far as a strategy needs; the least padding wins (ties: the baselines
``given`` then ``size``, which are always searched in full).

Lower bound (reported): ``world_size * S`` holds every tensor rounded up to the
alignment (tensors start aligned); ``S >=`` the largest block (it must fit in one shard);
``S`` is a multiple of ``alignment``; and a tensor longer than ``2 S`` crosses at least two
boundaries, which forces ``S`` to be a multiple of its block.
``padding_lower_bound = world_size * S_lb - total``.

Guarantee: when all tensors share one block size ``g``, ``padding - padding_lower_bound <
2 * world_size * lcm(g, alignment)`` (the search always tries the shard sizes at which
every crossing costs less than one block). Otherwise the reported gap is the measure.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hyperrec.raggedshard._validate import check_int
from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["STRATEGIES", "Layout", "Strategy", "plan_layout"]


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A pluggable way to lay tensors out; :func:`plan_layout` tries several.

    Give ``order`` (the shared sequential pass lays the tensors out in that order) or
    ``place`` (a complete layout for one shard size). Both must be deterministic.

    Raises:
        TypeError: ``name`` is not a str, or ``order``/``place``/``applies`` is not
            callable.
        ValueError: neither or both of ``order`` and ``place`` are given.
    """

    name: str
    """Reported in :attr:`Layout.strategy`."""
    order: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
    """``order(numels, blocks) -> permutation`` (int64 arrays; ``blocks[i] =
    min(granularity, numel)``, the effective block)."""
    fill_holes: bool = True
    """With ``order``: after the pass, move tail tensors into the holes left at rank
    boundaries (best fit)."""
    place: Callable[..., np.ndarray] | None = None
    """``place(numels, blocks, sizes, shard_numel, alignment) -> offsets`` (``sizes`` are
    numels rounded up to the alignment). Offsets may run past the buffer; the search then
    grows the shard size."""
    applies: Callable[[np.ndarray, np.ndarray], bool] | None = None
    """``applies(numels, blocks)``: skip the strategy when False (default: always)."""
    baseline: bool = False
    """Search this strategy in full, never pruned by another's result, so the chosen
    layout is never worse than this strategy's own."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        for attr in ("order", "place", "applies"):
            fn = getattr(self, attr)
            if fn is not None and not callable(fn):
                raise TypeError(f"{attr} must be callable or None, got {type(fn).__name__}")
        if (self.order is None) == (self.place is None):
            raise ValueError(f"strategy {self.name!r} needs exactly one of order= or place=")


def _given(numels: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    return np.arange(len(numels), dtype=np.int64)


def _by_size(numels: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    # Largest first; stable, so ties keep the caller's order.
    return np.argsort(-numels, kind="stable")


def _by_block(numels: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    # Coarse blocks first (they are the hard items), each class largest first; fine
    # blocks come last, where the tail repair can move them into holes.
    return np.lexsort((-numels, -blocks))


def _has_solid(numels: np.ndarray, blocks: np.ndarray) -> bool:
    return bool(((blocks >= numels) & (numels > 0)).any())


def _pack(numels: np.ndarray, blocks: np.ndarray, sizes: np.ndarray, s: int, a: int) -> np.ndarray:
    """Bin packing for unsplittable tensors, splittable ones in the rooms and after.

    A tensor that is one block (``block == numel``) must sit inside one shard. These go
    first, largest first, each into the fullest shard that still has room (best fit
    decreasing). Splittable tensors, largest first, then take the fullest room they fit
    in; the rest run on after the last used shard, crossing boundaries at block starts.
    """
    offsets = np.zeros(len(numels), dtype=np.int64)
    solid = (blocks >= numels) & (numels > 0)
    n_list, g_list, size_list = numels.tolist(), blocks.tolist(), sizes.tolist()
    rooms: list[tuple[int, int]] = []  # (room, shard), ascending
    used: list[int] = []
    for i in np.flatnonzero(solid)[np.argsort(-sizes[solid], kind="stable")].tolist():
        if n_list[i] > s:
            raise _NoCrossing(n_list[i])
        k = bisect.bisect_left(rooms, (n_list[i], -1))
        if k == len(rooms):
            room, shard = s, len(used)  # open the next shard
            used.append(0)
        else:
            room, shard = rooms.pop(k)
        offsets[i] = shard * s + used[shard]
        used[shard] += size_list[i]
        if room > size_list[i]:
            bisect.insort(rooms, (room - size_list[i], shard))
    tail = []
    for i in np.flatnonzero(~solid)[np.argsort(-sizes[~solid], kind="stable")].tolist():
        k = bisect.bisect_left(rooms, (n_list[i], -1))
        if n_list[i] == 0 or k == len(rooms):
            tail.append(i)
            continue
        room, shard = rooms.pop(k)
        offsets[i] = shard * s + used[shard]
        used[shard] += size_list[i]
        if room > size_list[i]:
            bisect.insort(rooms, (room - size_list[i], shard))
    cur = (len(used) - 1) * s + used[-1] if used else 0
    for i in tail:
        off = _cross(cur, n_list[i], g_list[i], s, a)
        offsets[i] = off
        cur = off + size_list[i]
    return offsets


STRATEGIES: tuple[Strategy, ...] = (
    Strategy(name="given", order=_given, fill_holes=False, baseline=True),
    Strategy(name="given+fill", order=_given),
    Strategy(name="size", order=_by_size, baseline=True),
    Strategy(name="block", order=_by_block),
    Strategy(name="pack", place=_pack, applies=_has_solid),
)
"""The default strategies, all tried by :func:`plan_layout`."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Layout:
    """Where every tensor lives in a flat rank-major buffer (see :func:`plan_layout`)."""

    offsets: np.ndarray
    """int64 ``(n,)``: tensor ``i`` starts at ``offsets[i]`` in the full buffer."""
    numels: np.ndarray
    """int64 ``(n,)``: the tensors' element counts."""
    granularities: np.ndarray
    """int64 ``(n,)``: the block sizes the layout honours."""
    world_size: int
    """Ranks; the buffer has ``world_size * shard_numel`` elements."""
    shard_numel: int
    """Elements per rank (equal for every rank)."""
    alignment: int
    """Every offset and ``shard_numel`` are multiples of it."""
    strategy: str
    """Name of the strategy that produced this layout."""
    lower_bound_shard_numel: int
    """The smallest ``shard_numel`` any layout honouring the contract could have."""
    candidates: dict[str, int] = field(default_factory=dict)
    """Padding reached by every strategy tried (strategy name -> padding elements)."""

    @property
    def total_numel(self) -> int:
        """Sum of the tensors' element counts."""
        return int(self.numels.sum())

    @property
    def buffer_numel(self) -> int:
        """``world_size * shard_numel``."""
        return self.world_size * self.shard_numel

    @property
    def padding(self) -> int:
        """Elements of the buffer that hold no tensor."""
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """``padding / total_numel`` (0 for an empty layout)."""
        return self.padding / self.total_numel if self.total_numel else 0.0

    @property
    def padding_lower_bound(self) -> int:
        """Padding of the lower-bound shard size: no layout can pad less."""
        return self.world_size * self.lower_bound_shard_numel - self.total_numel

    @property
    def gap(self) -> int:
        """``padding - padding_lower_bound`` (>= 0): how far from the bound we are."""
        return self.padding - self.padding_lower_bound

    def rank_ranges(self, index: int) -> np.ndarray:
        """int64 ``(world_size, 2)``: per rank, the ``[start, end)`` elements of tensor
        ``index`` (in the tensor's own row-major order) that the rank holds.

        Raises:
            IndexError: ``index`` out of range.
        """
        off, n = self._tensor(index)
        edges = np.arange(self.world_size + 1, dtype=np.int64) * self.shard_numel - off
        edges = np.clip(edges, 0, n)
        return np.stack([edges[:-1], edges[1:]], axis=1)

    def rank_range(self, index: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` elements of tensor ``index`` held by ``rank``."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank must be in [0, {self.world_size}), got {rank}")
        off, n = self._tensor(index)
        lo = rank * self.shard_numel - off
        return min(max(lo, 0), n), min(max(lo + self.shard_numel, 0), n)

    def shard_range(self, index: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` of tensor ``index``'s piece inside ``rank``'s shard storage:
        ``0 <= start <= end <= shard_numel``; ``(0, 0)`` if the rank holds none of it.

        With :meth:`rank_range` this is the whole geometry a flat buffer needs: rank
        ``rank``'s piece of tensor ``index`` is ``shard[start:end]`` and holds the
        tensor's flat elements ``rank_range(index, rank)``.
        """
        start, end = self.rank_range(index, rank)
        if start == end:
            return 0, 0
        off = self._tensor(index)[0] + start - rank * self.shard_numel
        return off, off + (end - start)

    def numels_per_rank(self, index: int) -> tuple[int, ...]:
        """Elements of tensor ``index`` held by each rank."""
        r = self.rank_ranges(index)
        return tuple(int(v) for v in r[:, 1] - r[:, 0])

    def placement(self, index: int, shape: Sequence[int]) -> RaggedShard:
        """The ``RaggedShard`` matching this layout for tensor ``index`` of ``shape``.

        Raises:
            ValueError: ``prod(shape) != numels[index]``.
        """
        n = int(self.numels[index])
        if math.prod(shape) != n:
            raise ValueError(f"shape {tuple(shape)} has {math.prod(shape)} elements, not {n}")
        return RaggedShard.from_numels(shape, self.numels_per_rank(index))

    def tensors_on_rank(self, rank: int) -> np.ndarray:
        """Indices of the tensors with at least one element on ``rank``."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        ends = self.offsets + self.numels
        return np.flatnonzero((self.offsets < hi) & (ends > lo) & (self.numels > 0))

    def _tensor(self, index: int) -> tuple[int, int]:
        if not -len(self.numels) <= index < len(self.numels):
            raise IndexError(f"tensor index {index} out of range for {len(self.numels)} tensors")
        return int(self.offsets[index]), int(self.numels[index])


# -- problem setup ----------------------------------------------------------------------------


def _as_int_array(values: object, name: str, n: int | None = None) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-D integer array, got {values.dtype}{values.shape}")
        arr = values.astype(np.int64)
    else:
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
        for i, v in enumerate(values):
            check_int(f"{name}[{i}]", v)
        arr = np.asarray(list(values), dtype=np.int64).reshape(-1)
    if n is not None and len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} entries for {n} tensors")
    return arr


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _ShardSizes:
    """Shard sizes that are multiples of ``alignment`` and of the block of every tensor
    longer than ``spans * S``.

    ``spans=2`` gives the *legal* sizes: a tensor longer than ``2 S`` crosses two
    boundaries, which are then both block starts, so their distance ``S`` must be a
    multiple of its block. ``spans=1`` gives the *safe* sizes: every tensor that must
    cross a boundary can then start on any block start and crosses every boundary at one,
    so no crossing costs more than a block of padding.
    """

    def __init__(self, numels: np.ndarray, blocks: np.ndarray, alignment: int, spans: int):
        crossing = blocks < numels
        order = np.argsort(-numels[crossing], kind="stable")
        self.spans = spans
        self.sizes = numels[crossing][order].tolist()  # descending
        self.neg_sizes = [-s for s in self.sizes]
        lcms = [alignment]
        for g in blocks[crossing][order].tolist():
            lcms.append(math.lcm(lcms[-1], g))
        self.lcms = lcms

    def forced(self, s: int) -> int:
        """How many tensors are longer than ``spans * s`` (a prefix of ``self.sizes``)."""
        return bisect.bisect_left(self.neg_sizes, -self.spans * s)

    def at_least(self, x: int) -> int:
        """The smallest such shard size ``>= x``."""
        s = max(int(x), 1)
        while True:
            c = self.forced(s)
            cand = _round_up(s, self.lcms[c])
            if c == 0:
                return cand
            # Tensor c-1 (the shortest forced one) stops being forced at ceil(n / spans).
            release = -(-self.sizes[c - 1] // self.spans)
            if cand < release:
                return cand
            s = release


# -- the shared placement pass ------------------------------------------------------------------


class _NoCrossing(Exception):
    """A tensor found no legal place at this shard size; ``block`` names what would fit:
    any shard size that is a multiple of it (or, for one-block tensors, at least it)."""

    def __init__(self, block: int):
        super().__init__(block)
        self.block = block


def _cross(cur: int, n: int, g: int, s: int, a: int) -> int:
    """Smallest legal offset ``>= cur`` for a tensor that would cross the next boundary.

    ``cur`` is aligned. Raises :class:`_NoCrossing` if the tensor cannot be placed with
    shard size ``s`` at all (no boundary can meet one of its block starts).
    """
    b = (cur // s + 1) * s
    if cur + n <= b:
        return cur
    if g >= n:  # one block: the tensor must sit inside one shard
        if n > s:
            raise _NoCrossing(n)
        return b
    if s % g == 0:  # every boundary is a block start once the tensor starts on one
        return _round_up(cur, math.lcm(g, a))
    # Otherwise it may cross exactly one boundary, at a block start, with both parts
    # fitting in a shard: front = g * m (m a multiple of q for alignment).
    q = a // math.gcd(g, a)
    m_lo = max(1, -(-(n - s) // g))
    m_hi_n = (n - 1) // g
    for edge, lo in ((b, cur), (b + s, b)):
        m = min((edge - lo) // g, m_hi_n)
        m -= m % q
        if m >= m_lo:
            return edge - g * m
        if edge == b and n <= s:
            return b
    raise _NoCrossing(g)


class _Sequence:
    """An order with what the sequential pass needs, computed once per strategy."""

    def __init__(
        self, order: np.ndarray, numels: np.ndarray, sizes: np.ndarray, blocks: np.ndarray
    ):
        self.order = order
        self.prefix = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(sizes[order], out=self.prefix[1:])
        self.pre = self.prefix.tolist()
        self.n = numels[order].tolist()
        self.g = blocks[order].tolist()
        self.size = sizes[order].tolist()


def _sequential(
    seq: _Sequence,
    s: int,
    a: int,
    start: int,
    offsets: np.ndarray,
    holes: list[tuple[int, int]] | None,
) -> int:
    """Lay ``seq`` out from ``start`` into ``offsets``; returns the end.

    Between two boundaries the tensors that fit are placed in one vectorised segment;
    only the tensor that meets a boundary is handled in Python, so the cost is
    ``O(boundaries passed)`` Python steps plus ``O(n)`` numpy.
    """
    n_items = len(seq.order)
    if n_items == 0:
        return start
    pre = seq.pre
    seg_start, seg_base = [], []
    cur, i = start, 0
    while i < n_items:
        b = (cur // s + 1) * s
        j = bisect.bisect_right(pre, pre[i] + (b - cur), lo=i) - 1
        if j > i:
            seg_start.append(i)
            seg_base.append(cur - pre[i])
            cur += pre[j] - pre[i]
            i = j
            if i == n_items:
                break
        off = _cross(cur, seq.n[i], seq.g[i], s, a)
        if off > cur and holes is not None:
            # Record the gap split at the boundary so that a hole never spans two shards.
            holes.append((cur, min(off, b)))
            if off > b:
                holes.append((b, off))
        seg_start.append(i)
        seg_base.append(off - pre[i])
        cur = off + seq.size[i]
        i += 1
    counts = np.diff(np.append(seg_start, n_items))
    offsets[seq.order] = seq.prefix[:-1] + np.repeat(np.asarray(seg_base, dtype=np.int64), counts)
    return cur


def _fill_holes(
    seq: _Sequence,
    numels: np.ndarray,
    sizes: np.ndarray,
    blocks: np.ndarray,
    s: int,
    a: int,
    offsets: np.ndarray,
    holes: list[tuple[int, int]],
    deficit: int,
) -> None:
    """Move a tail of the sequence into earlier holes (best fit), re-lay the rest.

    Stops once twice the ``deficit`` (how far the plain pass overran the buffer) has
    moved: the rest of the moves would not change whether the layout fits.
    """
    order = seq.order
    if not holes or len(order) < 2:
        return
    starts = offsets[order]
    hole_ends = np.asarray([h[1] for h in holes], dtype=np.int64)
    hole_cap = np.cumsum(np.asarray([h[1] - h[0] for h in holes], dtype=np.int64))
    tail = seq.prefix[-1] - seq.prefix[:-1]  # tail[k] = size of order[k:]
    # The longest tail whose size the holes before it could hold (monotone in k).
    lo, hi = 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        before = int(np.searchsorted(hole_ends, starts[mid], side="right"))
        if before and hole_cap[before - 1] >= tail[mid]:
            hi = mid
        else:
            lo = mid + 1
    k = lo
    if k >= len(order):
        return
    free = sorted((h1 - h0, h0) for h0, h1 in holes if h0 < h1 <= starts[k])
    if not free:
        return
    items = order[k:]
    moved = np.zeros(len(items), dtype=bool)
    n_list, size_list = seq.n[k:], seq.size[k:]
    moved_numel = 0
    for t in np.argsort(-sizes[items], kind="stable").tolist():
        if moved_numel >= 2 * deficit:
            break
        pos = bisect.bisect_left(free, (n_list[t], -1))
        if pos == len(free):
            continue
        room, h0 = free.pop(pos)
        offsets[items[t]] = h0
        moved[t] = True
        moved_numel += size_list[t]
        if room > size_list[t]:
            bisect.insort(free, (room - size_list[t], h0 + size_list[t]))
    if moved.any():
        rest = _Sequence(items[~moved], numels, sizes, blocks)
        # A subsequence of a tail that fitted from here fits from here again.
        _sequential(rest, s, a, int(starts[k]), offsets, None)


def _lay_out(
    strategy: Strategy,
    seq: _Sequence | None,
    numels: np.ndarray,
    sizes: np.ndarray,
    blocks: np.ndarray,
    s: int,
    a: int,
    buffer: int,
) -> tuple[np.ndarray, int]:
    """``(offsets, end)`` of the strategy at shard size ``s``; the end may pass ``buffer``."""
    if strategy.place is not None:
        offsets = np.asarray(strategy.place(numels, blocks, sizes, s, a), dtype=np.int64)
    else:
        if seq is None:
            raise RuntimeError(f"strategy {strategy.name!r} has an order but no sequence")
        offsets = np.zeros(len(numels), dtype=np.int64)
        holes: list[tuple[int, int]] | None = [] if strategy.fill_holes else None
        end = _sequential(seq, s, a, 0, offsets, holes)
        if holes and end > buffer:
            _fill_holes(seq, numels, sizes, blocks, s, a, offsets, holes, end - buffer)
    # The buffer must hold the data, not the last tensor's alignment padding.
    return offsets, int((offsets + numels).max()) if len(numels) else 0


#: What every size trial needs: ``(numels, sizes, blocks, world_size, alignment)``.
_Ctx = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]


class _Candidate:
    """One strategy under search: its cached sequence, last miss, best hit."""

    def __init__(self, strategy: Strategy, seq: _Sequence | None):
        self.strategy = strategy
        self.seq = seq
        # Read only after the first miss (phase 1 tries the lower bound on every candidate).
        self.miss = 0  # largest shard size known not to fit
        self.need = 0  # the size the last miss asked for
        self.hit: tuple[int, np.ndarray] | None = None

    def try_size(self, s: int, ctx: _Ctx) -> bool:
        numels, sizes, blocks, world_size, a = ctx
        try:
            out = _lay_out(self.strategy, self.seq, numels, sizes, blocks, s, a, world_size * s)
        except _NoCrossing as e:
            out = None
            # The next size that is a multiple of the stuck block lets that tensor cross.
            need = _round_up(s + 1, e.block)
        if out is not None and out[1] <= world_size * s:
            if self.hit is None or s < self.hit[0]:
                self.hit = (s, out[0])
            return True
        self.miss = max(self.miss, s)
        self.need = -(-out[1] // world_size) if out is not None else need
        return False


def _search(
    cand: _Candidate,
    legal: _ShardSizes,
    safe: _ShardSizes,
    cap: int | None,
    tol: int,
    ctx: _Ctx,
) -> None:
    """Find the candidate's smallest fitting shard size below ``cap``.

    Track 1 walks the safe sizes up from the lower bound: there every crossing costs less
    than one block, so the end barely moves with the size and a Newton step or two lands
    (this track alone guarantees the padding bound of :func:`plan_layout`). Track 2 walks
    the legal sizes below that hit (each miss steps to the size its overflow asks for,
    doubling after two misses in a row, since a layout may fit only at particular sizes).
    Last, bisection between the largest miss and the best hit (or ``cap``) to ``tol``.
    """
    start = cand.need
    s = safe.at_least(cand.miss + 1)
    for _ in range(8):
        # Many distinct blocks make safe sizes sparse; far above the ask they are useless.
        if (cap is not None and s >= cap) or s > 2 * max(start, cand.miss):
            break
        if cand.try_size(s, ctx):
            cap = s
            break
        s = safe.at_least(max(cand.need, s + 1))
    s, step = cand.miss, 0
    s_from = start
    for miss in range(64):
        step = max(s_from - s, 1, 2 * step if miss >= 2 else 0)
        s = legal.at_least(s + step)
        if cap is not None and s >= cap:
            break
        if cand.try_size(s, ctx):
            break
        s_from = cand.need
    # Bisect between the largest miss and the best hit (or the cap, if none below it).
    hi = cand.hit[0] if cand.hit is not None else cap
    while hi is not None and hi - cand.miss > tol:
        mid = legal.at_least((cand.miss + hi) // 2 + 1)
        if mid >= hi:
            break
        if cand.try_size(mid, ctx):
            hi = mid


def plan_layout(
    numels: Sequence[int] | np.ndarray,
    granularities: Sequence[int] | np.ndarray | int,
    world_size: int,
    *,
    alignment: int = 1,
    strategies: Sequence[Strategy] | None = None,
) -> Layout:
    """Plan a flat rank-major buffer of equal shards that never cuts a block.

    Args:
        numels: element count of every tensor (ints ``>= 0``).
        granularities: block size in elements per tensor (ints ``>= 1``; one int applies
            to all). Convert a spec like ``"32 rows"`` with :func:`block_numel`.
        world_size: ranks sharing the buffer (``>= 1``).
        alignment: every offset and the shard size are multiples of it (``>= 1``;
            e.g. 16 bytes / element size). Default 1.
        strategies: orderings to try (default :data:`STRATEGIES`); the layout with the
            least padding wins, ties going to the earlier strategy.

    Returns:
        The :class:`Layout` (offsets, ``shard_numel``, padding, lower bound, per-rank
        ranges and ``RaggedShard`` placements).

    Raises:
        TypeError: non-integer inputs; ``strategies`` not a sequence of ``Strategy``.
        ValueError: negative numels, granularities < 1, mismatched lengths,
            ``world_size < 1``, ``alignment < 1``, or an empty ``strategies``.
    """
    n = _as_int_array(numels, "numels")
    if isinstance(granularities, int | np.integer) and not isinstance(granularities, bool):
        if granularities < 1:  # checked even with no tensors to broadcast it to
            raise ValueError(f"granularities must be >= 1, got {granularities}")
        g = np.full(len(n), int(granularities), dtype=np.int64)
    else:
        g = _as_int_array(granularities, "granularities", len(n))
    check_int("world_size", world_size, minimum=1)
    check_int("alignment", alignment, minimum=1)
    if (n < 0).any():
        raise ValueError(f"numels must be >= 0, got {int(n.min())} at index {int(n.argmin())}")
    if (g < 1).any():
        raise ValueError(
            f"granularities must be >= 1, got {int(g.min())} at index {int(g.argmin())}"
        )
    world_size, a = int(world_size), int(alignment)
    if strategies is not None and (
        isinstance(strategies, str | Strategy) or not isinstance(strategies, Sequence)
    ):
        raise TypeError(f"strategies must be a sequence of Strategy, got {strategies!r}")
    chosen = tuple(STRATEGIES if strategies is None else strategies)
    if not all(isinstance(st, Strategy) for st in chosen):
        raise TypeError(f"strategies must hold Strategy objects, got {chosen!r}")
    if not chosen:
        raise ValueError("strategies must be a non-empty sequence of Strategy")
    blocks = np.minimum(g, np.maximum(n, 1))
    sizes = -(-n // a) * a
    legal = _ShardSizes(n, blocks, a, spans=2)
    safe = _ShardSizes(n, blocks, a, spans=1)
    total = int(n.sum())
    widest = int(blocks[n > 0].max()) if (n > 0).any() else 1
    # Every tensor starts aligned and the buffer ends aligned, so it spans whole
    # alignment units: the aligned sizes, not the numels, bound the buffer from below.
    s_lb = legal.at_least(max(-(-int(sizes.sum()) // world_size), widest, 1))
    if total == 0:
        return Layout(
            offsets=_frozen(np.zeros(len(n), dtype=np.int64)),
            numels=_frozen(n),
            granularities=_frozen(g),
            world_size=world_size,
            shard_numel=0,
            alignment=a,
            strategy=chosen[0].name,
            lower_bound_shard_numel=0,
            candidates={},
        )
    ctx: _Ctx = (n, sizes, blocks, world_size, a)
    cands: list[_Candidate] = []
    seen_orders: list[tuple[np.ndarray, bool]] = []
    for st in chosen:
        if st.applies is not None and not st.applies(n, blocks):
            continue
        seq = None
        if st.order is not None:
            order = np.asarray(st.order(n, blocks), dtype=np.int64)
            if not np.array_equal(np.sort(order), np.arange(len(n))):
                raise ValueError(f"strategy {st.name!r} did not return a permutation")
            # The same order with the same hole policy gives the same layout.
            if any(np.array_equal(order, o) and f == st.fill_holes for o, f in seen_orders):
                continue
            seen_orders.append((order, st.fill_holes))
            seq = _Sequence(order, n, sizes, blocks)
        cands.append(_Candidate(st, seq))
    # Phase 1: every strategy at the lower bound; the first that fits is optimal.
    for c in cands:
        if c.try_size(s_lb, ctx) and c.hit is not None:
            return _layout(n, g, world_size, a, s_lb, c.strategy.name, c.hit[1], s_lb, cands)
    # Phase 2: baselines in full, then the rest most promising first (smallest size asked
    # for), each only below the best so far.
    tol = max(1, total // (world_size * 100_000))  # stop refining below 10 ppm of padding
    best: tuple[str, int, np.ndarray] | None = None  # (strategy, shard size, offsets)
    for c in sorted(cands, key=lambda c: (not c.strategy.baseline, c.need)):
        cap = None if best is None or c.strategy.baseline else best[1]
        _search(c, legal, safe, cap, tol, ctx)
        if c.hit is not None and (best is None or c.hit[0] < best[1]):
            best = (c.strategy.name, *c.hit)
    if best is None:
        raise RuntimeError(f"no strategy found a layout: {[c.strategy.name for c in cands]}")
    name, size, offsets = best
    return _layout(n, g, world_size, a, size, name, offsets, s_lb, cands)


def _layout(
    n: np.ndarray,
    g: np.ndarray,
    world_size: int,
    a: int,
    s: int,
    name: str,
    offsets: np.ndarray,
    s_lb: int,
    cands: list[_Candidate],
) -> Layout:
    total = int(n.sum())
    candidates = {c.strategy.name: world_size * c.hit[0] - total for c in cands if c.hit}
    return Layout(
        offsets=_frozen(offsets),
        numels=_frozen(n),
        granularities=_frozen(g),
        world_size=world_size,
        shard_numel=s,
        alignment=a,
        strategy=name,
        lower_bound_shard_numel=s_lb,
        candidates=candidates,
    )
