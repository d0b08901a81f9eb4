"""The training data pipeline: reader sub-batches -> Base Batch Shuffling -> batches.

The training split is an endless sequence of requests ``0, 1, 2, ...`` cut into reader
sub-batches of ``sub_batch_size`` requests; sub-batch ``j`` holds requests
``[j * S, (j + 1) * S)``. Rank ``r`` of ``R`` reads sub-batches ``r, r + R, r + 2R, ...``
(its n-th local sub-batch is global sub-batch ``r + n R``), so ranks never exchange data
and together cover every request exactly once.

Each rank balances its own steps with :class:`hyperrec.bbs.BalancedShuffler`: the
sub-batches of ``window_steps`` consecutive steps are pooled and dealt so that every
step gets ``sub_batches_per_step`` of them with similar total cost (heavy-tailed history
lengths make some sub-batches far more expensive than others). A sub-batch trains at
most ``window_steps - 1`` steps away from its arrival-order step. The reader is an
endless index-only source (``__getitem__``, no length), which the shuffler resumes by
index: its checkpointed position is all a resumed run needs to replay exactly the same
batches, and nothing before the interrupted window is read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperrec.bbs import BalancedShuffler, CostModel
from hyperrec.integration.data import TRAIN, Batch, SyntheticRecsysData

__all__ = [
    "StepBatch",
    "StepPlan",
    "SubBatch",
    "SubBatchReader",
    "TrainStream",
    "default_cost_model",
]


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
    """Global sub-batch index ``j`` (requests ``[j * S, (j + 1) * S)``)."""
    requests: np.ndarray
    """int64 [S]: the request indices."""
    lengths: np.ndarray
    """int64 [S]: their history lengths."""


class SubBatchReader:
    """Rank ``rank``'s endless stream of sub-batches: item ``n`` is global sub-batch
    ``rank + n R``.

    Index-only on purpose: ``__getitem__`` without ``__len__`` or ``__iter__``, so
    :class:`~hyperrec.bbs.BalancedShuffler` reads it as ``reader[0], reader[1], ...``
    and resumes at any position by index, without a length and without re-reading.
    """

    def __init__(
        self, data: SyntheticRecsysData, *, sub_batch_size: int, rank: int, world_size: int
    ):
        self.data = data
        self.sub_batch_size = sub_batch_size
        self.rank, self.world_size = rank, world_size

    def __getitem__(self, n: int) -> SubBatch:
        """Sub-batch ``n`` of this rank.

        Raises:
            IndexError: ``n`` is negative (the stream has no end to count from).
        """
        if n < 0:
            raise IndexError(f"sub-batch index must be >= 0, got {n}")
        j = self.rank + n * self.world_size
        requests = np.arange(j * self.sub_batch_size, (j + 1) * self.sub_batch_size)
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
        data: the synthetic data generator.
        sub_batch_size: requests per reader sub-batch (>= 1).
        sub_batches_per_step: sub-batches per step on this rank (>= 1).
        window_steps: BBS window W (>= 1; 1 = arrival order).
        rank, world_size: this rank and the number of ranks.
        cost: the BBS cost model of one request's history length (default:
            :func:`default_cost_model` of width 64).

    Raises:
        ValueError / TypeError: a size below 1 or ``rank`` outside ``[0, world_size)``.
    """

    def __init__(
        self,
        data: SyntheticRecsysData,
        *,
        sub_batch_size: int,
        sub_batches_per_step: int,
        window_steps: int,
        rank: int = 0,
        world_size: int = 1,
        cost: CostModel | None = None,
    ):
        for name, value in (("sub_batch_size", sub_batch_size), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.data = data
        self.cost = cost if cost is not None else default_cost_model(64)
        self.reader = SubBatchReader(
            data, sub_batch_size=sub_batch_size, rank=rank, world_size=world_size
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
        a background loader builds batches from plans, see :mod:`.loader`)."""
        if self._it is None:
            self._it = iter(self.shuffler)
        chosen = next(self._it)
        return StepPlan(
            requests=np.concatenate([sb.requests for sb in chosen]),
            sub_batches=tuple(sb.index for sb in chosen),
            cost=float(self.shuffler.last_step_cost),
            arrival_cost=float(self.shuffler.last_step_arrival_cost),
        )

    def next(self) -> StepBatch:
        """The next step's batch on this rank."""
        plan = self.next_plan()
        return StepBatch(
            batch=self.data.batch(TRAIN, plan.requests),
            sub_batches=plan.sub_batches,
            cost=plan.cost,
            arrival_cost=plan.arrival_cost,
        )

    def state_dict(self) -> dict[str, Any]:
        """The shuffler's position plus this stream's layout (ints only)."""
        return {"shuffler": self.shuffler.state_dict(), **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position saved by :meth:`state_dict`.

        Raises:
            ValueError: the state was saved with another sub-batch size, step size,
                window, rank or world size (its positions would mean other requests).
        """
        saved = {k: state.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ValueError(
                f"stream state was saved with {saved}, this stream has {self._layout()}"
            )
        # States of 0.1.0 also hold "steps", a step count that only the arrival-cost
        # recomputation needed; it is ignored, so their checkpoints still resume.
        self.shuffler.load_state_dict(state["shuffler"])
        self._it = None

    def _layout(self) -> dict[str, int]:
        return {
            "sub_batch_size": self.reader.sub_batch_size,
            "sub_batches_per_step": self.sub_batches_per_step,
            "window_steps": self.shuffler.config.window_steps,
            "rank": self.reader.rank,
            "world_size": self.reader.world_size,
        }
