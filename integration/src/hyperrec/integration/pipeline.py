"""The training data pipeline: reader sub-batches -> Base Batch Shuffling -> batches.

The training split is read as an endless sequence of *positions* ``0, 1, 2, ...`` cut
into reader sub-batches of ``sub_batch_size``; sub-batch ``j`` holds positions
``[j * S, (j + 1) * S)``. A :class:`RequestOrder` maps positions to request ids: the
identity for an endless source (the synthetic generator), and for a finite one (a log
of ``N`` requests) epoch ``p // N``'s pseudo-random permutation of ``[0, N)`` (or time
order), so a sub-batch may straddle two epochs and every request is read once per
epoch. Rank ``r`` of ``R`` reads sub-batches ``r, r + R, r + 2R, ...`` (its n-th local
sub-batch is global sub-batch ``r + n R``), so ranks never exchange data and together
cover every position exactly once.

Each rank balances its own steps with :class:`hyperrec.bbs.BalancedShuffler`: the
sub-batches of ``window_steps`` consecutive steps are pooled and dealt so that every
step gets ``sub_batches_per_step`` of them with similar total cost (heavy-tailed history
lengths make some sub-batches far more expensive than others). A sub-batch trains at
most ``window_steps - 1`` steps away from its arrival-order step. The reader is an
index-only source (``__getitem__``, no length), which the shuffler resumes by index: its
checkpointed position is all a resumed run needs to replay exactly the same batches,
and nothing before the interrupted window is read again.

A run of a fixed number of passes (``TrainConfig.epochs``) gives the stream an ``end``:
the global sub-batch count of its steps. The reader then ends before sub-batch ``end``,
so the shuffler plans the last window as a short one (the steps left, not ``W``) and
every sub-batch below ``end`` trains before the run ends; without it a full window was
planned past the last step and some sub-batches of the last pass never trained while
sub-batches of the next pass took their place.

Resuming on another world size (:func:`reshard_streams`): the sub-batches every old
rank had not yet trained (the rest of its interrupted window and everything after it)
are collected from the old ranks' states; those below the highest old read position
form a *backlog* dealt round-robin to the new ranks, which read it first and then
continue with the usual stride from that position. No sub-batch is lost or read twice.
With an ``end``, the backlog is topped up from the stride so that every new rank has the
same number of sub-batches below ``end`` (its steps left, times its sub-batches per step).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperrec.bbs import BalancedShuffler, CostModel
from hyperrec.integration.data import TRAIN, Batch, DataSource, _hash

__all__ = [
    "RequestOrder",
    "StepBatch",
    "StepPlan",
    "SubBatch",
    "SubBatchReader",
    "TrainStream",
    "default_cost_model",
    "permute",
    "reshard_streams",
]

_FEISTEL_ROUNDS = 4


def permute(i: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """A pseudo-random bijection of ``[0, n)`` applied to ``i`` (int64 array in ``[0, n)``).

    A 4-round balanced Feistel network over the smallest even number of bits covering
    ``n``, with cycle walking (values outside ``[0, n)`` are permuted again until they
    fall inside), keyed by ``key`` through splitmix64: O(1) memory whatever ``n``, so a
    log of 10^8 events needs no permutation array per epoch.

    Raises:
        ValueError: an index outside ``[0, n)`` (cycle walking would never end).
    """
    i = np.asarray(i, dtype=np.int64)
    if i.size and (int(i.min()) < 0 or int(i.max()) >= n):
        raise ValueError(
            f"permute: i must lie in [0, {n}), got values in [{int(i.min())}, {int(i.max())}]"
        )
    if n <= 1:
        return i.copy()
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    key = tuple(int(k) for k in key)
    out = i.astype(np.uint64)
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():
        v = out[todo]
        left, right = v >> shift, v & mask
        for r in range(_FEISTEL_ROUNDS):
            left, right = right, left ^ (_hash(*key, r, right) & mask)
        out[todo] = (left << shift) | right
        todo[todo] = out[todo] >= np.uint64(n)
    return out.astype(np.int64)


class RequestOrder:
    """Training-stream position -> request id of the training split.

    Args:
        num_requests: size of the training split; ``None`` for an endless source
            (position ``p`` is request ``p``).
        shuffle: a fresh pseudo-random order every epoch (else ``0..N-1`` each epoch).
        seed: the orders' seed.

    Raises:
        ValueError: ``num_requests`` below 1.
        TypeError: ``num_requests`` neither an int (numpy integers included) nor None, or
            ``seed`` not an int.
    """

    def __init__(self, num_requests: int | None = None, *, shuffle: bool = True, seed: int = 0):
        if num_requests is not None:
            # A numpy count (a source's len of an array) was refused as "the training
            # split is empty"; only a non-integer is a TypeError, and it says so.
            if isinstance(num_requests, bool) or not isinstance(num_requests, int | np.integer):
                raise TypeError(
                    f"num_requests must be an int or None, got "
                    f"{type(num_requests).__name__} {num_requests!r}"
                )
            num_requests = int(num_requests)
            if num_requests < 1:
                raise ValueError(
                    f"num_requests must be a positive int or None, got {num_requests!r} "
                    "(the training split is empty)"
                )
        # A float seed was truncated (1.7 gave seed 1's order) without a word.
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        self.num_requests, self.shuffle, self.seed = num_requests, shuffle, int(seed)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """int64 request ids of int64 ``positions`` (>= 0)."""
        positions = np.asarray(positions, dtype=np.int64)
        n = self.num_requests
        if n is None:
            return positions.copy()
        epoch, i = np.divmod(positions, n)
        if not self.shuffle:
            return i
        out = np.empty_like(i)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            out[sel] = permute(i[sel], n, (self.seed, 0x0EC0, e))
        return out

    def epoch(self, position: int) -> float:
        """Epochs completed at stream position ``position`` (fractional); 0 when endless."""
        return 0.0 if self.num_requests is None else position / self.num_requests


def default_cost_model(dim: int) -> CostModel:
    """Cost of a request with a history of ``L`` events: ``L + L^2 / (6 dim)`` tokens.

    A transformer block of width ``d`` spends about ``24 d^2`` FLOPs per token on its
    projections and ``4 d`` per token pair on attention (hence the ``1 / (6 d)``); costs
    are in token units so they read naturally in logs.
    """
    return CostModel(linear=1.0, quadratic=1.0 / (6.0 * dim))


@dataclass(frozen=True)
class SubBatch:
    """One reader sub-batch: which requests, and their history lengths (for the cost)."""

    index: int
    """Global sub-batch index ``j`` (stream positions ``[j * S, (j + 1) * S)``)."""
    requests: np.ndarray
    """int64 [S]: the request ids (of the training split) at those positions."""
    lengths: np.ndarray
    """int64 [S]: their history lengths."""


class SubBatchReader:
    """Rank ``rank``'s stream of sub-batches: endless, or ending before global sub-batch
    ``end``.

    Item ``n`` is global sub-batch ``backlog[n]`` for ``n < len(backlog)`` and
    ``frontier + rank + (n - len(backlog)) R`` after it (``backlog`` is empty and
    ``frontier`` 0 unless the run was resumed on another world size). With ``end``, the
    items are those whose global index is below ``end`` (a prefix: the backlog is sorted
    and below ``frontier``); reading past them raises ``IndexError``.

    Index-only on purpose: ``__getitem__`` without ``__len__`` or ``__iter__``, so
    :class:`~hyperrec.bbs.BalancedShuffler` reads it as ``reader[0], reader[1], ...``
    and resumes at any position by index, without a length and without re-reading.
    """

    def __init__(
        self,
        data: DataSource,
        *,
        sub_batch_size: int,
        rank: int,
        world_size: int,
        order: RequestOrder | None = None,
        backlog: Sequence[int] = (),
        frontier: int = 0,
        end: int | None = None,
    ):
        self.data = data
        self.sub_batch_size = sub_batch_size
        self.rank, self.world_size = rank, world_size
        self.order = order if order is not None else RequestOrder(None)
        self.backlog = tuple(int(j) for j in backlog)
        self.frontier = int(frontier)
        self.end = _check_end(end)

    def global_index(self, n: int) -> int:
        """Global sub-batch index of local item ``n``."""
        if n < len(self.backlog):
            return self.backlog[n]
        return self.frontier + self.rank + (n - len(self.backlog)) * self.world_size

    def count(self, start: int, limit: int) -> int:
        """How many of the local items ``[start, start + limit)`` exist (``limit`` when
        endless)."""
        if self.end is None:
            return limit
        for n in range(start, start + limit):
            if self.global_index(n) >= self.end:
                return n - start
        return limit

    def __getitem__(self, n: int) -> SubBatch:
        """Sub-batch ``n`` of this rank.

        Raises:
            IndexError: ``n`` is negative (the stream has no end to count from), or the
                stream has an ``end`` and item ``n`` lies past it.
        """
        if n < 0:
            raise IndexError(f"sub-batch index must be >= 0, got {n}")
        j = self.global_index(n)
        if self.end is not None and j >= self.end:
            raise IndexError(f"sub-batch {j} is past the stream's end ({self.end})")
        positions = np.arange(j * self.sub_batch_size, (j + 1) * self.sub_batch_size)
        requests = self.order(positions)
        return SubBatch(j, requests, self.data.history_lengths(TRAIN, requests))


@dataclass(frozen=True)
class StepPlan:
    """Which requests one step of this rank trains on (cheap: no batch built yet)."""

    requests: np.ndarray
    """int64 [B]: the request indices, sub-batch by sub-batch."""
    sub_batches: tuple[int, ...]
    """Global sub-batch indices the step is made of."""
    cost: float
    """The step's cost under the pipeline's cost model."""
    arrival_cost: float
    """Cost of the step arrival order (no BBS) would have built."""


@dataclass(frozen=True)
class StepBatch:
    """One step's batch of this rank and its bookkeeping."""

    batch: Batch
    """The requests (CPU tensors)."""
    sub_batches: tuple[int, ...]
    """Global sub-batch indices it is made of."""
    cost: float
    """Its cost under the pipeline's cost model."""
    arrival_cost: float
    """Cost of the step that arrival order (no BBS) would have built (reported by the
    shuffler, from the costs it already computed)."""


class TrainStream:
    """This rank's stream of training batches, balanced by BBS; checkpointable.

    Args:
        data: the data source (its training split).
        sub_batch_size: requests per reader sub-batch (>= 1).
        sub_batches_per_step: sub-batches per step on this rank (>= 1).
        window_steps: BBS window W (>= 1; 1 = arrival order).
        rank, world_size: this rank and the number of ranks.
        cost: the BBS cost model of one request's history length (default:
            :func:`default_cost_model` of width 64).
        order: stream position -> request id (default: the identity, for an endless
            source; see :class:`RequestOrder`).
        backlog, frontier: sub-batches to read first and where the stride starts (from
            :func:`reshard_streams` after a change of world size).
        end: the global sub-batch index the stream ends before (``None``: endless). A
            run of ``steps`` steps over every pass of a finite split gives
            ``steps * global_batch_size // sub_batch_size``: the last BBS window is then
            planned short, with the steps left, so every sub-batch below ``end`` trains
            within the run. :meth:`next_plan` raises ``StopIteration`` past the end.

    Raises:
        ValueError / TypeError: a size below 1, ``rank`` outside ``[0, world_size)`` or
            a negative ``end``.
    """

    def __init__(
        self,
        data: DataSource,
        *,
        sub_batch_size: int,
        sub_batches_per_step: int,
        window_steps: int,
        rank: int = 0,
        world_size: int = 1,
        cost: CostModel | None = None,
        order: RequestOrder | None = None,
        backlog: Sequence[int] = (),
        frontier: int = 0,
        end: int | None = None,
    ):
        for name, value in (("sub_batch_size", sub_batch_size), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.data = data
        self.cost = cost if cost is not None else default_cost_model(64)
        self.reader = SubBatchReader(
            data,
            sub_batch_size=sub_batch_size,
            rank=rank,
            world_size=world_size,
            order=order,
            backlog=backlog,
            frontier=frontier,
            end=end,
        )
        self.shuffler = BalancedShuffler(
            self.reader,
            sub_batches_per_step=sub_batches_per_step,
            window_steps=window_steps,
            cost=self._sub_batch_cost,
        )
        self.sub_batches_per_step = sub_batches_per_step
        self._it: Iterator[list[SubBatch]] | None = None

    def _sub_batch_cost(self, sub_batch: SubBatch) -> float:
        return self.cost(sub_batch.lengths)

    def next_plan(self) -> StepPlan:
        """The next step's requests on this rank, without building the batch (BBS only;
        a background loader builds batches from plans, see :mod:`.loader`).

        Raises:
            StopIteration: the stream has an ``end`` and every step before it was drawn.
        """
        if self._it is None:
            self._it = iter(self.shuffler)
        before = self.shuffler.state_dict()
        try:
            chosen = next(self._it)
        except StopIteration:
            # The end: the shuffler would start a new pass from position 0 next; stay at
            # the end instead (a checkpoint, or a later call, sees where the stream is).
            self.shuffler.load_state_dict(before)
            self._it = None
            raise
        cost = self.shuffler.last_step_cost
        arrival_cost = self.shuffler.last_step_arrival_cost
        if cost is None or arrival_cost is None:
            # The shuffler sets both before it yields a step.
            raise RuntimeError("the shuffler yielded a step without recording its costs")
        return StepPlan(
            requests=np.concatenate([sb.requests for sb in chosen]),
            sub_batches=tuple(sb.index for sb in chosen),
            cost=float(cost),
            arrival_cost=float(arrival_cost),
        )

    def next(self) -> StepBatch:
        """The next step's batch on this rank (``StopIteration`` past the ``end``)."""
        plan = self.next_plan()
        return StepBatch(
            batch=self.data.batch(TRAIN, plan.requests),
            sub_batches=plan.sub_batches,
            cost=plan.cost,
            arrival_cost=plan.arrival_cost,
        )

    @property
    def end(self) -> int | None:
        """The global sub-batch index the stream ends before (``None``: endless)."""
        return self.reader.end

    def state_dict(self) -> dict[str, Any]:
        """The shuffler's position, the backlog / frontier, the end and this stream's
        layout."""
        return {
            "shuffler": self.shuffler.state_dict(),
            "backlog": list(self.reader.backlog),
            "frontier": self.reader.frontier,
            "end": self.reader.end,
            **self._layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position saved by :meth:`state_dict`.

        The stream keeps its own ``end`` (a resumed run may train more or fewer passes),
        but a state saved inside a BBS window resumes only if that window holds as many
        sub-batches under this ``end`` as under the saved one: else its plan, and so the
        steps already trained from it, would differ.

        Raises:
            ValueError: the state was saved with another sub-batch size, step size,
                window, rank or world size (its positions would mean other requests;
                :func:`reshard_streams` moves positions to another world size), or
                inside a window that another ``end`` shortens or lengthens.
        """
        saved = {k: state.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ValueError(
                f"stream state was saved with {saved}, this stream has {self._layout()}"
            )
        # States of 0.1.0 also hold "steps", a step count that only the arrival-cost
        # recomputation needed; it is ignored, so their checkpoints still resume. States
        # before 0.1.3 have no backlog (none existed); states saved before streams had an end
        # have none (endless).
        backlog, frontier = self.reader.backlog, self.reader.frontier
        self.reader.backlog = tuple(int(j) for j in state.get("backlog", ()))
        self.reader.frontier = int(state.get("frontier", 0))
        try:
            _check_window_end(self.reader, state["shuffler"], _check_end(state.get("end")))
            self.shuffler.load_state_dict(state["shuffler"])
        except BaseException:
            self.reader.backlog, self.reader.frontier = backlog, frontier
            raise
        self._it = None

    def _layout(self) -> dict[str, int]:
        return {
            "sub_batch_size": self.reader.sub_batch_size,
            "sub_batches_per_step": self.sub_batches_per_step,
            "window_steps": self.shuffler.config.window_steps,
            "rank": self.reader.rank,
            "world_size": self.reader.world_size,
        }


def _check_end(end: Any) -> int | None:
    if end is None:
        return None
    if isinstance(end, bool) or not isinstance(end, int | np.integer) or end < 0:
        raise ValueError(f"end must be None or an int >= 0, got {end!r}")
    return int(end)


def _check_window_end(reader: SubBatchReader, shuffler: dict[str, Any], saved_end: Any) -> None:
    """Refuse to resume inside a window whose length the reader's end changes."""
    if saved_end == reader.end or not shuffler.get("steps_done_in_window"):
        return
    w, k = shuffler.get("window_steps"), shuffler.get("sub_batches_per_step")
    if not isinstance(w, int) or not isinstance(k, int):
        return  # the shuffler's own checks name the bad entry
    start = int(shuffler["window_start"])
    now = reader.count(start, w * k)
    before = SubBatchReader(
        reader.data,
        sub_batch_size=reader.sub_batch_size,
        rank=reader.rank,
        world_size=reader.world_size,
        backlog=reader.backlog,
        frontier=reader.frontier,
        end=saved_end,
    ).count(start, w * k)
    if now != before:
        raise ValueError(
            f"the stream state was saved inside a BBS window of {before} sub-batches (stream "
            f"end {saved_end}); this stream's end ({reader.end}) makes it {now}, so the "
            "window's plan would differ: resume with the saved run's steps / epochs, or from "
            "a checkpoint at a window boundary"
        )


def reshard_streams(
    states: Sequence[dict[str, Any]],
    data: DataSource,
    *,
    world_size: int,
    cost: CostModel | None = None,
    order: RequestOrder | None = None,
    end: int | None = None,
) -> tuple[list[list[int]], int]:
    """Move the training position of ``len(states)`` old ranks to ``world_size`` new ones.

    Args:
        states: every old rank's :meth:`TrainStream.state_dict`, in rank order.
        data, cost, order: as the old streams had them (the interrupted BBS windows are
            re-planned from the sub-batches' costs, under each state's own ``end``, to
            tell which were already trained).
        world_size: the new number of ranks.
        end: the new streams' end (``None``: endless). With one, the backlog is topped up
            from the stride until its sub-batches below ``end`` deal evenly, so every new
            rank holds as many sub-batches below ``end`` as the others.

    Returns:
        ``(backlogs, frontier)``: new rank ``r`` builds its :class:`TrainStream` with
        ``backlog=backlogs[r]``, ``frontier`` (and ``end``). Together the new ranks read
        every sub-batch the old ranks had not trained, exactly once.

    Raises:
        ValueError: no states, or states that are not ranks ``0..R-1`` of one layout.
    """
    if not states:
        raise ValueError("states must hold the stream state of every old rank")
    old_world = states[0]["world_size"]
    if sorted(s["rank"] for s in states) != list(range(old_world)) or any(
        s["world_size"] != old_world or s["sub_batch_size"] != states[0]["sub_batch_size"]
        for s in states
    ):
        raise ValueError(
            f"states must be ranks 0..{old_world - 1} of one stream layout, got "
            f"{[(s['rank'], s['world_size']) for s in states]}"
        )
    untrained: set[int] = set()
    starts: list[int] = []
    for state in states:
        old = TrainStream(
            data,
            sub_batch_size=state["sub_batch_size"],
            sub_batches_per_step=state["sub_batches_per_step"],
            window_steps=state["window_steps"],
            rank=state["rank"],
            world_size=old_world,
            cost=cost,
            order=order,
            end=_check_end(state.get("end")),
        )
        old.load_state_dict(state)
        sh = old.shuffler.state_dict()
        k, w = state["sub_batches_per_step"], state["window_steps"]
        next_read = sh["window_start"]
        if sh["steps_done_in_window"]:
            # The rest of the interrupted window, re-planned exactly as the old rank would
            # (a short one before the old stream's end).
            rest = itertools.islice(iter(old.shuffler), w - sh["steps_done_in_window"])
            untrained.update(sb.index for step in rest for sb in step)
            next_read += old.reader.count(next_read, w * k)
        backlog = old.reader.backlog
        untrained.update(backlog[next_read:])
        stride_from = max(0, next_read - len(backlog))
        starts.append(old.reader.frontier + state["rank"] + stride_from * old_world)
    frontier = max(starts)
    for start in starts:
        untrained.update(range(start, frontier, old_world))
    end = _check_end(end)
    if end is not None:
        # Dealt round-robin, a backlog whose part below the end is not a multiple of the
        # world size left the ranks unequal numbers of sub-batches before the end (a rank
        # ran out of steps before the others, another trained past the end): take the next
        # stride sub-batches into the backlog until it is one.
        below = sum(1 for j in untrained if j < end)
        extra = min((-below) % world_size, max(0, end - frontier))
        untrained.update(range(frontier, frontier + extra))
        frontier += extra
    ordered = sorted(untrained)
    return [ordered[r::world_size] for r in range(world_size)], frontier
