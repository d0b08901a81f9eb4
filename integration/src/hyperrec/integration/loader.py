"""Batches off the critical path: built ahead in workers, validated, pinned, copied early.

The training step must not wait for its input. :class:`StepLoader` takes the BBS plans of
a :class:`~hyperrec.integration.pipeline.TrainStream` (which requests each step trains
on; cheap, decided in the main process so the stream stays checkpointable) and builds
the batches in ``torch.utils.data.DataLoader`` worker processes (a
:class:`~hyperrec.integration.data.DataSource` serves any request ids in any process:
the synthetic generator is a pure function of the request index, an event log a
memory-mapped file, so a worker needs nothing else).
Each batch is validated once, there, on the CPU (:func:`validate_batch`: offsets, id
ranges, NaN, the history cap), so the model can call its attention ops without
validation and the device step never reads device values. On CUDA the batch comes back
in pinned memory and is copied to the device on a side stream while the previous step
computes; the compute stream waits on an event, not on the host.

Checkpoints: the stream's sampler runs ahead of training by the prefetch depth, so the
loader remembers the stream state right after each plan was drawn and
:meth:`StepLoader.state_dict` returns the one of the last step handed out: a resumed run
replays exactly the steps that were not trained.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from hyperrec.integration.config import DataConfig, DataSchema
from hyperrec.integration.data import TRAIN, Batch, DataSource
from hyperrec.integration.pipeline import StepPlan, TrainStream

__all__ = ["LoadedStep", "StepLoader", "validate_batch"]


def validate_batch(batch: Batch, data: DataSchema | DataConfig) -> None:
    """:meth:`Batch.validate` against ``data``'s schema, plus the history and candidate caps.

    Meant for CPU batches at loading time (on device tensors it would synchronise).

    Args:
        batch: the batch.
        data: the source's :class:`~hyperrec.integration.config.DataSchema` (or a
            synthetic ``DataConfig``, whose ``schema`` is used; messages name what was
            given).

    Raises:
        ValueError / TypeError: see :meth:`Batch.validate`; or a history longer than
            ``max_seqlen``, or a request with more than ``max_candidates`` candidates.
        TypeError: ``batch`` not a Batch, or ``data`` neither a DataSchema nor a DataConfig.
    """
    # Named here: Batch.validate's message would name its own ``schema`` parameter, and a
    # non-Batch would fail with an AttributeError.
    if not isinstance(batch, Batch):
        raise TypeError(f"validate_batch: batch must be a Batch, got {type(batch).__name__}")
    if not isinstance(data, (DataSchema, DataConfig)):
        raise TypeError(
            f"validate_batch: data must be a DataSchema or a DataConfig, got {type(data).__name__}"
        )
    where = type(data).__name__
    schema = data.schema if isinstance(data, DataConfig) else data
    batch.validate(schema)
    if batch.max_history_len > schema.max_seqlen:
        raise ValueError(
            f"Batch.max_history_len = {batch.max_history_len} exceeds "
            f"{where}.max_seqlen = {schema.max_seqlen}"
        )
    most = int(batch.candidate_offsets.diff().max()) if batch.num_requests else 0
    if most > schema.max_candidates:
        raise ValueError(
            f"Batch.candidate_offsets: a request has {most} candidates, more than "
            f"{where}.max_candidates = {schema.max_candidates}"
        )


def _pin(batch: Batch) -> Batch:
    kw: dict[str, Any] = {}  # every field, by name (mixed types)
    for f in fields(batch):
        v = getattr(batch, f.name)
        kw[f.name] = v.pin_memory() if torch.is_tensor(v) else v
    return Batch(**kw)


class _Built:
    """A step's CPU batch as it leaves a worker; the DataLoader's pinning thread calls
    :meth:`pin_memory`."""

    def __init__(self, seq: int, plan: StepPlan, batch: Batch):
        self.seq, self.plan, self.batch = seq, plan, batch

    def pin_memory(self, device: Any = None) -> _Built:
        return _Built(self.seq, self.plan, _pin(self.batch))

    # Out of a worker by value: a tensor would travel as a shared-memory file descriptor,
    # and fetching each one waits on the worker's resource-sharer thread, i.e. on the
    # worker's GIL while it builds the next batch (~5-8 ms per tensor measured on the
    # trainer's thread). numpy arrays are pickled into the pipe instead.
    def __getstate__(self) -> dict[str, Any]:
        fields_: dict[str, Any] = {}
        for f in fields(self.batch):
            v = getattr(self.batch, f.name)
            fields_[f.name] = (
                ("numpy", v.numpy()) if torch.is_tensor(v) and v.dtype in _NUMPY_DTYPES else v
            )
        return {"seq": self.seq, "plan": self.plan, "batch": fields_}

    def __setstate__(self, state: dict[str, Any]) -> None:
        kw: dict[str, Any] = {
            k: torch.from_numpy(v[1]) if isinstance(v, tuple) and v[:1] == ("numpy",) else v
            for k, v in state["batch"].items()
        }
        self.seq, self.plan, self.batch = state["seq"], state["plan"], Batch(**kw)


_NUMPY_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64,
)  # fmt: skip


class _PlanDataset(Dataset[_Built]):
    """Item ``(seq, plan)`` -> the plan's batch, validated when asked."""

    def __init__(self, data: DataSource, validate: bool):
        self.data, self.validate = data, validate
        self.schema = data.schema

    def __getitem__(self, item: tuple[int, StepPlan]) -> _Built:
        seq, plan = item
        batch = self.data.batch(TRAIN, plan.requests)
        if self.validate:
            validate_batch(batch, self.schema)
        return _Built(seq, plan, batch)


def _worker_init(_: int) -> None:
    # Workers generate with numpy; one torch thread each keeps them off the trainer's cores.
    torch.set_num_threads(1)


@dataclass
class LoadedStep:
    """One step's input, ready on the device."""

    seq: int
    """0-based index of the step within this loader's life (since the last reset)."""
    plan: StepPlan
    """The requests, sub-batches and BBS costs of the step."""
    host: Batch
    """The CPU batch (pinned on CUDA): for bookkeeping that must not read the device."""
    batch: Batch
    """The same batch on the training device (``host`` itself on a CPU run)."""
    ready: torch.cuda.Event | None
    """Recorded on the copy stream after the copy (CUDA), else None."""


class StepLoader:
    """The training batches of ``stream``, built ahead and delivered on ``device``.

    Args:
        stream: the rank's BBS stream (its ``next_plan`` is called here, in order).
        device: the training device.
        workers: worker processes building batches (0: built in this process when asked).
        prefetch: batches each worker keeps ready (``prefetch_factor``).
        validate: validate each batch at build time (:func:`validate_batch`).

    Raises:
        ValueError: a negative ``workers`` or ``prefetch < 1``.
    """

    def __init__(
        self,
        stream: TrainStream,
        device: torch.device,
        *,
        workers: int = 0,
        prefetch: int = 2,
        validate: bool = True,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
        self.stream, self.device = stream, torch.device(device)
        self.workers, self.prefetch_factor, self.validate = workers, prefetch, validate
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._it: Iterator[_Built] | None = None
        self._states: dict[int, dict[str, Any]] = {}
        self._consumed_state: dict[str, Any] | None = None
        self._ready: LoadedStep | None = None

    # -- plans and their stream states ---------------------------------------------------
    def _plans(self) -> Iterator[tuple[int, StepPlan]]:
        for seq in itertools.count():
            try:
                plan = self.stream.next_plan()
            except StopIteration:
                # A stream with an end (a run of epochs): the read-ahead stops there.
                return
            # Drawn in the main process, possibly steps ahead of training: remember where
            # the stream stood right after this step, for checkpoints.
            self._states[seq] = copy.deepcopy(self.stream.state_dict())
            yield seq, plan

    def _iterator(self) -> Iterator[_Built]:
        if self._it is None:
            if self._consumed_state is None:
                self._consumed_state = copy.deepcopy(self.stream.state_dict())
            loader = DataLoader(
                _PlanDataset(self.stream.data, self.validate),
                batch_size=None,
                sampler=self._plans(),
                num_workers=self.workers,
                pin_memory=self._cuda,
                prefetch_factor=self.prefetch_factor if self.workers else None,
                persistent_workers=False,
                worker_init_fn=_worker_init if self.workers else None,
                # Not fork: a fork copies the trainer's threads' locks (Inductor's compile
                # pool, OpenMP) in whatever state they are; a worker forked so crashed
                # (SIGSEGV) in about half the CPU ablation smoke runs. Workers start from a
                # clean fork server instead.
                multiprocessing_context="forkserver" if self.workers else None,
                # Its own generator: creating an iterator draws a worker seed, which must
                # not move the global RNG (dropout masks after a resume depend on it).
                generator=torch.Generator().manual_seed(0),
            )
            self._it = iter(loader)
        return self._it

    # -- delivery ------------------------------------------------------------------------
    def _fetch(self) -> LoadedStep | None:
        built = next(self._iterator(), None)
        if built is None:  # the stream's end
            return None
        if self._copy_stream is None:
            return LoadedStep(built.seq, built.plan, built.batch, built.batch, None)
        with torch.cuda.stream(self._copy_stream):
            on_device = built.batch.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return LoadedStep(built.seq, built.plan, built.batch, on_device, ready)

    def prefetch(self) -> None:
        """Build (or take from the workers) the next batch and start its copy now, so it
        overlaps the step the caller has just enqueued."""
        if self._ready is None:
            self._ready = self._fetch()  # None at the stream's end: next() raises

    def next(self) -> LoadedStep:
        """The next step's input. On CUDA the current stream waits (on the device) for its
        copy; nothing here blocks the host unless the workers are behind.

        Raises:
            StopIteration: the stream has an end (a run of epochs) and every step before
                it was handed out.
        """
        step = self._ready if self._ready is not None else self._fetch()
        self._ready = None
        if step is None:
            raise StopIteration("the training stream has ended (every step of its epochs)")
        if step.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(step.ready)
            for f in fields(step.batch):
                v = getattr(step.batch, f.name)
                if torch.is_tensor(v):
                    # Allocated on the copy stream, used on the compute stream.
                    v.record_stream(current)
        self._consumed_state = self._states.pop(step.seq)
        for old in [s for s in self._states if s < step.seq]:
            del self._states[old]
        return step

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The stream's state after the last step handed out by :meth:`next` (before any:
        the state the loader started from)."""
        if self._consumed_state is not None:
            return self._consumed_state
        return self.stream.state_dict()

    def reset(self) -> None:
        """Forget everything read ahead (call after ``stream.load_state_dict``)."""
        self._stop()
        self._states.clear()
        self._consumed_state = None

    def close(self) -> None:
        """Stop the workers and drop prefetched batches; the stream goes back to right
        after the last step handed out, so a later :meth:`next` continues there."""
        self._stop()
        if self._states and self._consumed_state is not None:
            # Plans were drawn past the last step handed out: the stream stood after them
            # and the next iterator skipped their steps.
            self.stream.load_state_dict(copy.deepcopy(self._consumed_state))
        self._states.clear()

    def _stop(self) -> None:
        self._ready = None
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
