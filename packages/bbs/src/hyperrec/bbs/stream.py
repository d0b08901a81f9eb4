"""The streaming shuffler: BBS over any iterable of sub-batches, one rank, no collectives."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from hyperrec.bbs._source import IndexedSource, SourceKind, open_at, source_kind
from hyperrec.bbs._validate import check_bool, check_int
from hyperrec.bbs.cost import CostFn, CostModel, checked_cost, resolve_cost_fn
from hyperrec.bbs.plan import _check_method, plan_partial_window, plan_windows

__all__ = ["BBSConfig", "BalancedShuffler"]

T = TypeVar("T")

_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class BBSConfig:
    """Window shape of Base Batch Shuffling (fixed number of sub-batches per step).

    Raises:
        TypeError: ``sub_batches_per_step``/``window_steps`` not ints.
        ValueError: either < 1, or an unknown ``method``.
    """

    sub_batches_per_step: int
    """``k``: sub-batches trained per step on each rank (e.g. 8 x 128 samples)."""
    window_steps: int
    """``W``: steps per window. Bigger balances better (excess ~ 1/sqrt(W)) but moves a
    sub-batch up to ``W - 1`` steps from its natural step and buffers ``W * k`` of them."""
    method: str = "auto"
    """Partition algorithm (:data:`hyperrec.bbs.partition.METHODS`); ``"auto"`` = KK + swaps."""

    def __post_init__(self) -> None:
        check_int("sub_batches_per_step", self.sub_batches_per_step, minimum=1)
        check_int("window_steps", self.window_steps, minimum=1)
        _check_method(self.method)


class BalancedShuffler(Generic[T]):
    """Stream steps of ``k`` sub-batches, dealt so that every step costs about the same.

    Reads ``W * k`` sub-batches (one window), plans them with :func:`shuffle_plan`
    and yields ``W`` steps, then reads the next window. Each rank runs its own
    shuffler on its own reader: no communication, deterministic.

    Delay bound: with ``i`` the arrival index of a sub-batch (0-based, counted from the
    start of the pass) and ``s`` the index of the step that yields it,
    ``|s - i // k| <= W - 1``. Memory: ``W * k`` sub-batches.

    Sources, by how a resume reaches its position (:attr:`source_kind`):

    - ``"sized"``: ``__len__`` and ``__getitem__`` (a list, a map-style dataset):
      indexed directly.
    - ``"index_only"``: ``__getitem__`` but neither ``__len__`` nor ``__iter__``: an
      endless or unknown-length reader, read as ``source[0], source[1], ...`` until
      ``source[i]`` raises ``IndexError`` or ``StopIteration`` (Python's sequence
      protocol). Also indexed directly, so resuming deep into an endless stream costs
      one window of reads. An ``IndexError`` escaping from a bug inside
      ``__getitem__`` also ends the data, as it would for Python's ``iter()``.
    - ``"iterable"``: anything else (a generator, an ``IterableDataset``): iterated
      again from its start and the items before the position read and dropped.

    Indexed sources must return the same item for the same index and iterables must
    replay the same order, or a resumed run trains on other data.

    Args:
        source: the sub-batches, of any kind above.
        sub_batches_per_step: ``k >= 1``.
        window_steps: ``W >= 1`` (``W = 1`` keeps arrival order).
        cost: a :class:`CostModel` (items are 1-D sequence lengths), any callable
            ``item -> float``, or ``None`` (items are their own cost).
        method: partition algorithm, default ``"auto"``.
        drop_last: drop the trailing ``n % k`` sub-batches of a finite source so every
            step has exactly ``k``; otherwise the last window's steps may be short.

    Yields:
        ``list`` of sub-batches per step (``k`` of them except possibly in the last
        window), in ascending arrival order within the step.

    Raises:
        TypeError / ValueError: bad sizes or ``cost``; a cost that is negative, NaN or
            not a number raises when that item is read.

    Iterating again after a pass ended starts a new pass from the beginning. One
    iterator at a time: :meth:`state_dict` describes the most recent one.
    """

    def __init__(
        self,
        source: Iterable[T] | IndexedSource[T],
        *,
        sub_batches_per_step: int,
        window_steps: int,
        cost: CostModel | CostFn | None = None,
        method: str = "auto",
        drop_last: bool = False,
    ) -> None:
        if not isinstance(source, Iterable) and not hasattr(source, "__getitem__"):
            raise TypeError(f"source must be iterable, got {type(source).__name__}")
        self.config = BBSConfig(
            sub_batches_per_step=sub_batches_per_step, window_steps=window_steps, method=method
        )
        check_bool("drop_last", drop_last)
        self._source = source
        self._cost = resolve_cost_fn(cost)
        self._drop_last = drop_last
        self._window_start = 0  # source position of the current window's first item
        self._steps_done = 0  # steps of the current window already yielded
        self._step = 0  # steps yielded in this pass
        self._epoch = 0  # completed passes
        self.last_step_cost: float | None = None
        """Cost of the most recently yielded step (for local metrics); ``None`` before
        the first step."""
        self.last_step_arrival_cost: float | None = None
        """What the most recently yielded step would have cost without BBS: the summed
        cost of the sub-batches of its natural step (arrival positions ``[s k, (s+1) k)``
        of the pass for step ``s``; fewer in a short last window). Over a window both
        costs add up to the same total (up to rounding), so ``last_step_cost`` against
        this is the BBS gain of the step, with no second reading of the source. ``None``
        before the first step."""

    @property
    def source_kind(self) -> SourceKind:
        """``"sized"``, ``"index_only"`` or ``"iterable"``: how the source is read and
        resumed (see the class docstring). Only an ``"iterable"`` source is read again
        before the interrupted window on resume."""
        return source_kind(self._source)

    def __iter__(self) -> Iterator[list[T]]:
        k, w = self.config.sub_batches_per_step, self.config.window_steps
        pos, skip = self._window_start, self._steps_done
        it = open_at(self._source, pos)
        while True:
            window = list(itertools.islice(it, w * k))
            if self._drop_last:
                window = window[: len(window) - len(window) % k]
            if not window:
                break
            costs = np.array([checked_cost(self._cost, x) for x in window], dtype=np.float64)
            if len(window) == w * k:
                plan = list(plan_windows(costs[None], k, w, method=self.config.method)[0])
            else:
                plan = plan_partial_window(costs, k, method=self.config.method)
            for s in range(skip, len(plan)):
                if s + 1 == len(plan):
                    self._window_start, self._steps_done = pos + len(window), 0
                else:
                    self._window_start, self._steps_done = pos, s + 1
                self._step += 1
                self.last_step_cost = float(costs[plan[s]].sum())
                # Plans never move data across windows and windows start at multiples
                # of W*k, so step s of a window replaces that window's s-th run of k.
                self.last_step_arrival_cost = float(costs[s * k : (s + 1) * k].sum())
                yield [window[i] for i in plan[s]]
            skip = 0
            pos += len(window)
            if len(window) < w * k:
                break
        # The pass is over: the next iteration starts a new one.
        self._window_start, self._steps_done, self._step = 0, 0, 0
        self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """Position after the last yielded step: ints only (safe for any checkpoint)."""
        return {
            "version": _STATE_VERSION,
            "window_start": self._window_start,
            "steps_done_in_window": self._steps_done,
            "step": self._step,
            "epoch": self._epoch,
            "sub_batches_per_step": self.config.sub_batches_per_step,
            "window_steps": self.config.window_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so the next iteration yields exactly the steps not yet yielded.

        Raises:
            ValueError: the state comes from another window shape or version, or its
                position is not one this shape can reach (a step beyond the window).
            TypeError: ``state`` is not a mapping with int entries.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state version {state.get('version')!r} != {_STATE_VERSION}")
        for key in ("sub_batches_per_step", "window_steps"):
            if state.get(key) != getattr(self.config, key):
                raise ValueError(
                    f"state has {key}={state.get(key)!r} but this shuffler has "
                    f"{getattr(self.config, key)}; a window plan cannot be resumed "
                    "under another shape"
                )
        start = check_int("state['window_start']", state["window_start"], minimum=0)
        done = check_int("state['steps_done_in_window']", state["steps_done_in_window"], minimum=0)
        # A window has at most W steps, and a window with steps already yielded starts
        # at a multiple of W * k. Out of range, the old checks let a resume silently skip
        # whole windows or plan windows shifted against the saved run's.
        w, per_window = (
            self.config.window_steps,
            self.config.window_steps * (self.config.sub_batches_per_step),
        )
        if done >= w:
            raise ValueError(f"state['steps_done_in_window'] must be < {w}, got {done}")
        if done and start % per_window:
            raise ValueError(
                f"state['window_start'] must be a multiple of window_steps * "
                f"sub_batches_per_step = {per_window} mid-window, got {start}"
            )
        step = check_int("state['step']", state["step"], minimum=0)
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        # Assigned only once every entry passed: a rejected state leaves the shuffler as
        # it was (it used to keep the entries checked before the bad one).
        self._window_start, self._steps_done, self._step, self._epoch = start, done, step, epoch
