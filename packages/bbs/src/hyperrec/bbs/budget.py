"""Cost-budget batching: every step is filled up to a fixed cost, sample counts vary.

The alternative to fixed-count BBS, like max-tokens batching: each rank fills each step
with items (sub-batches or single samples) until the next one would exceed a budget
that every rank derives from the same dataset statistics. Per-step cost is then
balanced across ranks without communication; the number of samples per step is not,
so the loss must be normalised by the global sample count (see the README).

Algorithm for one step ``t`` (identical in :class:`CostBudgetBatcher` and in the
simulator, which runs it for thousands of ranks at once):

1. Top up the look-ahead buffer in arrival order until it holds ``lookahead_steps *
   budget`` of cost (or ``max_buffer_items`` items).
2. Take every *forced* item: one read ``max_wait_steps`` steps ago (hard delay bound).
3. First fit in arrival order: take each remaining item that still fits the budget
   (oldest first, so an item skipped once leads the next step).
4. Close the gap: up to ``swap_rounds`` times, swap one taken (non-forced) item for a
   waiting one that is heavier by at most the remaining gap, the largest such gain.
5. If nothing was taken (every item exceeds the budget alone), take the oldest alone.

A step exceeds the budget only through forced items or an item larger than the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from hyperrec.bbs._source import open_at
from hyperrec.bbs._validate import as_costs, check_float, check_int
from hyperrec.bbs.cost import CostFn, CostModel, checked_cost, resolve_cost_fn

__all__ = ["BudgetConfig", "CostBudgetBatcher", "budget_from_costs", "budget_select"]

T = TypeVar("T")

_STATE_VERSION = 1
_SWAP_CANDIDATES = 16  # newest taken x oldest waiting items per swap round (64: no better)


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """Parameters of cost-budget batching.

    Raises:
        TypeError: a field of the wrong type (ints must be ints, numbers real numbers).
        ValueError: a non-positive or non-finite ``budget``, ``max_wait_steps < 1``,
            ``lookahead_steps < 1`` (or not finite), ``max_buffer_items < 1``, negative
            ``swap_rounds``.
    """

    budget: float
    """Cost each step is filled up to, the same on every rank, e.g.
    :func:`budget_from_costs` (mean item cost x items per step)."""
    max_wait_steps: int = 2
    """``W >= 1``: an item read while step ``t`` is assembled is trained at step ``t + W``
    at the latest (forced in even if the budget overflows)."""
    lookahead_steps: float | None = None
    """Buffer fill, in budgets of cost. ``None``: ``min(1 + W / 2, 3)``, which keeps the
    typical wait below ``W`` so forcing stays rare. Must be >= 1."""
    max_buffer_items: int = 4096
    """Cap on buffered items (protects memory when items are nearly free)."""
    swap_rounds: int = 2
    """Gap-closing swaps per step (0 disables step 4)."""

    def __post_init__(self) -> None:
        check_float("budget", self.budget, minimum=0, exclusive=True)
        check_int("max_wait_steps", self.max_wait_steps, minimum=1)
        if self.lookahead_steps is not None:
            look = check_float("lookahead_steps", self.lookahead_steps, minimum=0, exclusive=True)
            if look < 1:
                raise ValueError(f"lookahead_steps must be >= 1, got {look}")
        check_int("max_buffer_items", self.max_buffer_items, minimum=1)
        check_int("swap_rounds", self.swap_rounds, minimum=0)

    @property
    def lookahead(self) -> float:
        """The effective look-ahead in budgets."""
        if self.lookahead_steps is not None:
            return float(self.lookahead_steps)
        return min(1.0 + self.max_wait_steps / 2.0, 3.0)


def budget_from_costs(costs: Any, items_per_step: float) -> float:
    """A budget from dataset statistics: ``mean(costs) * items_per_step``.

    Args:
        costs: ``(n,)`` costs of a representative sample of items (n >= 1).
        items_per_step: the average number of items a step should hold (> 0), e.g. the
            ``k`` of fixed-count batching.

    Raises:
        TypeError: ``costs`` not array-like of real numbers, ``items_per_step`` not a
            number.
        ValueError: empty or invalid ``costs``, non-positive ``items_per_step``, a
            zero mean cost, or a budget too large for a float64.
    """
    arr = as_costs("costs", costs, ndim=1)
    if arr.size == 0:
        raise ValueError("costs must not be empty")
    per = check_float("items_per_step", items_per_step, minimum=0, exclusive=True)
    # The mean is taken at the scale of the largest cost (a power of two, exact): summed
    # as they are, huge finite costs (1e308) overflow to inf and the budget came out inf.
    exponent = int(np.frexp(arr.max())[1])
    mean = float(np.ldexp(np.ldexp(arr, -exponent).mean(), exponent))
    out = mean * per
    if out <= 0:
        raise ValueError("costs have zero mean; a positive budget cannot be derived")
    if not np.isfinite(out):
        raise ValueError(
            f"budget = mean(costs) * items_per_step = {mean!r} * {per!r} overflows a "
            "float64; rescale the costs"
        )
    return out


def budget_select(
    costs: np.ndarray,
    live: np.ndarray,
    seq: np.ndarray,
    forced: np.ndarray,
    budget: float,
    *,
    swap_rounds: int = 2,
) -> np.ndarray:
    """Steps 2-5 of the algorithm for ``B`` buffers at once.

    Args:
        costs: ``(B, cap)`` float64 item costs (any value where not ``live``).
        live: ``(B, cap)`` bool, slot holds a buffered item.
        seq: ``(B, cap)`` int64 arrival index (orders the buffer, oldest first).
        forced: ``(B, cap)`` bool, item must be taken now.
        budget: the step budget.
        swap_rounds: gap-closing swap rounds.

    Returns:
        ``(B, cap)`` bool: the items trained this step.
    """
    b, full = costs.shape
    rows = np.arange(b)
    # Work in arrival order so "first" means "oldest" everywhere below, on the
    # leading `cap` columns that hold every row's live items.
    cap = int(live.sum(axis=1).max()) if b else 0
    if cap == 0:
        return np.zeros((b, full), dtype=bool)
    order = np.argsort(np.where(live, seq, np.iinfo(np.int64).max), axis=1, kind="stable")
    order = order[:, :cap]
    oc = np.take_along_axis(costs, order, 1)
    olive = np.take_along_axis(live, order, 1)
    oforced = np.take_along_axis(forced, order, 1) & olive
    taken = oforced.copy()
    total = np.where(taken, oc, 0.0).sum(axis=1)

    # First fit: the longest fitting prefix in one vectorised pass, then one item per
    # iteration. Once an item is skipped the gap is below its cost and only shrinks,
    # so "the first remaining item that fits" is exactly what a sequential scan takes.
    cand = olive & ~taken
    csum = np.cumsum(np.where(cand, oc, 0.0), axis=1)
    fits = total[:, None] + csum <= budget
    prefix = np.where(fits.all(axis=1), cap, fits.argmin(axis=1))
    first = cand & (np.arange(cap)[None, :] < prefix[:, None])
    taken |= first
    total = total + np.where(first, oc, 0.0).sum(axis=1)
    while True:
        fit = olive & ~taken & (total[:, None] + oc <= budget)
        has = fit.any(axis=1)
        if not has.any():
            break
        j = fit.argmax(axis=1)
        r = rows[has]
        taken[r, j[has]] = True
        total[r] += oc[r, j[has]]

    pos = np.arange(cap)
    for _ in range(swap_rounds):
        gap = budget - total
        movable = taken & ~oforced
        waiting = olive & ~taken
        if not (movable.any() and waiting.any()):
            break
        # x: the newest qx taken items; y: the oldest qy waiting ones.
        qx = min(_SWAP_CANDIDATES, int(movable.sum(axis=1).max()))
        qy = min(_SWAP_CANDIDATES, int(waiting.sum(axis=1).max()))
        xs = np.argsort(np.where(movable, -pos, cap), axis=1, kind="stable")[:, :qx]
        ys = np.argsort(np.where(waiting, pos, cap), axis=1, kind="stable")[:, :qy]
        cx = np.where(np.take_along_axis(movable, xs, 1), np.take_along_axis(oc, xs, 1), np.inf)
        cy = np.where(np.take_along_axis(waiting, ys, 1), np.take_along_axis(oc, ys, 1), -np.inf)
        gain = cy[:, None, :] - cx[:, :, None]
        gain = np.where((gain > 0) & (total[:, None, None] + gain <= budget), gain, -np.inf)
        flat = gain.reshape(b, -1)
        best = flat.argmax(axis=1)
        ok = np.isfinite(flat[rows, best]) & (gap > 0)
        if not ok.any():
            break
        xi, yi = np.unravel_index(best[ok], (qx, qy))
        r = rows[ok]
        taken[r, xs[r, xi]] = False
        taken[r, ys[r, yi]] = True
        total[r] += flat[r, best[ok]]

    # Nothing fits (every item alone exceeds the budget): train the oldest alone.
    empty = ~taken.any(axis=1) & olive.any(axis=1)
    taken[empty, 0] = True

    out = np.zeros((b, full), dtype=bool)
    np.put_along_axis(out, order, taken, 1)
    return out


class _Buffers:
    """``B`` look-ahead buffers of fixed capacity, batched (the simulator's ranks)."""

    def __init__(self, rows: int, config: BudgetConfig) -> None:
        cap = config.max_buffer_items
        self.config = config
        self.cost = np.zeros((rows, cap))
        self.seq = np.zeros((rows, cap), dtype=np.int64)
        self.read_step = np.zeros((rows, cap), dtype=np.int64)
        self.live = np.zeros((rows, cap), dtype=bool)
        self.held = np.zeros(rows)  # buffered cost per row

    def wants(self) -> np.ndarray:
        """``(B,)`` bool: the buffer is below its look-ahead cost and has a free slot."""
        target = self.config.lookahead * self.config.budget
        return (self.held < target) & ~self.live.all(axis=1)

    def push(self, rows: np.ndarray, costs: np.ndarray, seqs: np.ndarray, step: int) -> None:
        """One item into each of ``rows`` (first free slot)."""
        slot = np.argmin(self.live[rows], axis=1)
        self.cost[rows, slot] = costs
        self.seq[rows, slot] = seqs
        self.read_step[rows, slot] = step
        self.live[rows, slot] = True
        self.held[rows] += costs

    def fill(self, source: np.ndarray, ptr: np.ndarray, step: int) -> bool:
        """Top every row up from ``source[row, ptr[row]:]`` in one vectorised pass.

        Reads exactly what repeated :meth:`wants` / :meth:`push` would: item ``j`` is
        read while the running total (held, then plus each item read, accumulated in
        the same order) is below the target and a slot is free. Advances ``ptr``.
        Returns ``True`` (and reads nothing) if some row would read past its data.
        """
        b, n = source.shape
        free = (~self.live).sum(axis=1)
        width = int(free.max())
        if width == 0:
            return False
        idx = ptr[:, None] + np.arange(width)[None, :]
        valid = idx < n
        upcoming = np.where(valid, source[np.arange(b)[:, None], np.minimum(idx, n - 1)], 0.0)
        running = np.cumsum(np.concatenate([self.held[:, None], upcoming], axis=1), axis=1)
        target = self.config.lookahead * self.config.budget
        read = (running[:, :width] < target) & (np.arange(width)[None, :] < free[:, None])
        # The running total only grows, so `read` is a prefix of each row.
        if (read & ~valid).any():
            return True
        count = read.sum(axis=1)
        slots = np.argsort(self.live, axis=1, kind="stable")[:, :width]  # free slots first
        r, j = np.nonzero(read)
        s = slots[r, j]
        self.cost[r, s] = upcoming[r, j]
        self.seq[r, s] = idx[r, j]
        self.read_step[r, s] = step
        self.live[r, s] = True
        self.held = running[np.arange(b), count]
        ptr += count
        return False

    def select(self, step: int) -> np.ndarray:
        forced = self.live & (step - self.read_step >= self.config.max_wait_steps)
        taken = budget_select(
            self.cost,
            self.live,
            self.seq,
            forced,
            self.config.budget,
            swap_rounds=self.config.swap_rounds,
        )
        self.live &= ~taken
        self.held = self._arrival_order_sum()
        return taken

    def _arrival_order_sum(self) -> np.ndarray:
        """``(B,)`` buffered cost, added one item at a time in arrival order.

        ``held`` decides how many items the next fill reads (``held < target``), so it
        must not depend on which slots the items sit in: a resumed batcher re-buffers
        its items in other slots than the interrupted run had, and numpy's pairwise
        sum over slots then differs in the last bit, which flips the comparison at a
        boundary and makes the resumed run read (and train) other items. Summed in
        arrival order, it is exactly what :meth:`push` and :meth:`fill` accumulate
        (they add items in arrival order too; adding the zeros of empty slots at the
        end changes nothing).
        """
        key = np.where(self.live, self.seq, np.iinfo(np.int64).max)
        order = np.argsort(key, axis=1, kind="stable")
        ordered = np.take_along_axis(np.where(self.live, self.cost, 0.0), order, 1)
        if ordered.shape[1] == 0:
            return np.zeros(ordered.shape[0])
        return np.cumsum(ordered, axis=1)[:, -1]


class CostBudgetBatcher(Generic[T]):
    """Stream steps whose cost is filled up to a fixed budget (variable item count).

    One rank, its own reader, no communication; deterministic. See the module
    docstring for the algorithm.

    Delay bound: an item read from ``source`` while step ``t`` is being assembled is
    yielded at a step ``s`` with ``t <= s <= t + max_wait_steps``.

    Args:
        source: any iterable of items (sub-batches, or samples for max-tokens-style
            batching), read like :class:`BalancedShuffler`'s: ``"sized"`` and
            ``"index_only"`` sources are indexed from the oldest buffered item on a
            resume, other iterables are re-read from their start. For
            :meth:`load_state_dict` it must replay the same order.
        budget, max_wait_steps, lookahead_steps, max_buffer_items, swap_rounds: see
            :class:`BudgetConfig`.
        cost: :class:`CostModel`, callable ``item -> float`` or ``None`` (items are
            their own cost).

    Yields:
        ``list`` of items per step, in arrival order.

    Raises:
        TypeError / ValueError: invalid arguments; an invalid item cost when read;
            ValueError also when a resumed source ends before the saved position.
    """

    def __init__(
        self,
        source: Iterable[T],
        *,
        budget: float,
        max_wait_steps: int = 2,
        cost: CostModel | CostFn | None = None,
        lookahead_steps: float | None = None,
        max_buffer_items: int = 4096,
        swap_rounds: int = 2,
    ) -> None:
        if not isinstance(source, Iterable) and not hasattr(source, "__getitem__"):
            raise TypeError(f"source must be iterable, got {type(source).__name__}")
        self.config = BudgetConfig(
            budget=budget,
            max_wait_steps=max_wait_steps,
            lookahead_steps=lookahead_steps,
            max_buffer_items=max_buffer_items,
            swap_rounds=swap_rounds,
        )
        self._source = source
        self._cost = resolve_cost_fn(cost)
        self._reset()
        self._epoch = 0
        self.last_step_cost: float | None = None
        """Cost of the most recently yielded step."""

    def _reset(self) -> None:
        self._step = 0
        self._next_read = 0
        self._pending: list[tuple[int, int]] = []  # (arrival index, read step), buffered

    def __iter__(self) -> Iterator[list[T]]:
        bufs = _Buffers(1, self.config)
        items: dict[int, T] = {}
        pending = dict(self._pending)
        start = min(pending, default=self._next_read)
        it = open_at(self._source, start)
        # Resume: re-read the buffered items; the ones in between were already trained.
        for seq in range(start, self._next_read):
            try:
                item = next(it)
            except StopIteration:
                # A StopIteration escaping a generator becomes an unexplained
                # RuntimeError (PEP 479); the cause is a source shorter than the state.
                raise ValueError(
                    f"source ended at item {seq}, before the saved position "
                    f"state['next_read']={self._next_read}; a resume needs a source that "
                    "replays the same items"
                ) from None
            if seq in pending:
                items[seq] = item
                c = checked_cost(self._cost, item)
                bufs.push(np.zeros(1, np.int64), np.array([c]), np.array([seq]), pending[seq])
        exhausted = False
        zero = np.zeros(1, dtype=np.int64)
        while True:
            while not exhausted and bufs.wants()[0]:
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                c = checked_cost(self._cost, item)
                items[self._next_read] = item
                bufs.push(zero, np.array([c]), np.array([self._next_read]), self._step)
                self._next_read += 1
            if not bufs.live.any():
                break
            cost_before = bufs.cost[0].copy()
            seqs = bufs.seq[0].copy()
            taken = bufs.select(self._step)[0]
            out_seq = np.sort(seqs[taken])
            self.last_step_cost = float(cost_before[taken].sum())
            self._step += 1
            live = bufs.live[0]
            self._pending = sorted(
                zip(bufs.seq[0][live].tolist(), bufs.read_step[0][live].tolist())
            )
            yield [items.pop(int(s)) for s in out_seq]
        self._reset()
        self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """Position after the last yielded step; the buffer is stored as arrival indices."""
        return {
            "version": _STATE_VERSION,
            "step": self._step,
            "next_read": self._next_read,
            "pending": [list(p) for p in self._pending],
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so the next iteration yields exactly what an uninterrupted run would.

        Raises:
            TypeError: ``state`` is not a dict, or an entry is not an int.
            ValueError: unknown version or inconsistent entries (a position outside
                the read range or buffered twice).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state version {state.get('version')!r} != {_STATE_VERSION}")
        step = check_int("state['step']", state["step"], minimum=0)
        nxt = check_int("state['next_read']", state["next_read"], minimum=0)
        # Each entry checked as ints (int() truncated 2.5 to 2 and let a malformed entry
        # fail with an unnamed unpacking error), and each position buffered once (a
        # duplicate was silently merged).
        raw = state["pending"]
        if not isinstance(raw, (list, tuple)) or any(
            not isinstance(p, (list, tuple)) or len(p) != 2 for p in raw
        ):
            raise ValueError("state['pending'] must be a list of [arrival index, read step]")
        pending = [
            (check_int("state['pending']", s, minimum=0), check_int("state['pending']", r))
            for s, r in raw
        ]
        if any(not 0 <= s < nxt or not 0 <= r <= step for s, r in pending):
            raise ValueError("state['pending'] holds positions outside the read range")
        if len({s for s, _ in pending}) != len(pending):
            raise ValueError("state['pending'] holds an arrival index twice")
        if len(pending) > self.config.max_buffer_items:
            raise ValueError("state['pending'] exceeds max_buffer_items")
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        # Assigned only once every entry passed: a rejected state leaves the batcher as
        # it was (an invalid epoch used to be found after the position was overwritten).
        self._step, self._next_read, self._pending = step, nxt, sorted(pending)
        self._epoch = epoch
