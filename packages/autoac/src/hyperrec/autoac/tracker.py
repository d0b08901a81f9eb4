"""Exact accounting of live tensor storages during a training step.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every aten op that runs while it is
active (forward, checkpoint recomputation and backward, on any thread the autograd
engine uses) goes through it. It records

* an **allocation event** for every storage an op creates (an output whose storage is
  not an alias of an input per the op's schema and was not seen before),
* a **free event** when that storage is released (a ``weakref.finalize`` on the
  storage object, which PyTorch keeps alive exactly as long as the C++ storage),
* storages that existed before the step (parameters, inputs, gradients) the first time
  an op touches them, counted as **resident** from the start of the step,
* optionally one :class:`OpRecord` per op (phase, region, new storages, inputs, time).

"Live bytes" at a position are resident bytes plus the bytes of storages allocated and
not yet freed. On the CPU that is the whole memory model: the peak of a step is the
maximum of live bytes over its events. Workspace that a kernel allocates and frees
inside one op is invisible at this level (on CUDA the allocator's own counter
``torch.cuda.max_memory_allocated`` sees it; see :func:`hyperrec.autoac.measure_step`).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hyperrec.autoac._validate import check_bool

__all__ = ["MemoryTracker", "OpRecord", "StorageRecord"]

#: op namespaces whose ops talk to other ranks: never recomputed by autoac.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd", "c10d_functional")


def _plain_tensors(tree: Any) -> list[torch.Tensor]:
    """Leaves of ``tree`` that are tensors, wrapper subclasses flattened to their parts."""
    flat, _ = tree_flatten(tree)
    out: list[torch.Tensor] = []
    stack = [x for x in flat if isinstance(x, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            stack.extend(getattr(t, a) for a in attrs)
        else:
            out.append(t)
    return out


def _storage_of(t: torch.Tensor, device: torch.device | None = None) -> torch.UntypedStorage | None:
    if t.device.type == "meta":
        return None
    if device is not None and (
        t.device.type != device.type
        or (device.index is not None and t.device.index != device.index)
    ):
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return st if st.nbytes() > 0 else None


def is_collective(func: Any) -> bool:
    """True for ops of the c10d namespaces (functional and in-place collectives)."""
    return getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES


_SEEDED: dict[Any, int | None] = {}  # op -> index of its dropout_p argument (-1: none)


def is_random(func: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> bool:
    """True for ops that draw from a random generator.

    Ops tagged ``nondeterministic_seeded`` draw random numbers, except attention ops
    called with ``dropout_p == 0`` (every SDPA overload carries the tag).
    """
    idx = _SEEDED.get(func, -2)
    if idx == -2:
        idx = None
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            schema = getattr(func, "_schema", None)
            names = [a.name for a in schema.arguments] if schema is not None else []
            idx = names.index("dropout_p") if "dropout_p" in names else -1
        _SEEDED[func] = idx
    if idx is None:
        return False
    if idx < 0:
        return True
    p = (kwargs or {}).get("dropout_p", args[idx] if idx < len(args) else 0.0)
    try:
        return float(p) != 0.0
    except (TypeError, ValueError):
        return True


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    packet = getattr(func, "overloadpacket", None)
    formula = _FLOP_REGISTRY.get(packet) if packet is not None else None
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not cover this overload's arguments
        return 0.0


try:
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover - present in every supported torch
    _FLOP_REGISTRY = {}


@dataclass
class StorageRecord:
    """One storage seen during the tracked step.

    Attributes:
        sid: index of the storage in :attr:`MemoryTracker.storages`.
        nbytes: size in bytes.
        alloc: event index of its allocation (``-1``: resident before the step).
        free: event index of its release, ``None`` if alive at the end.
        op: index of the :class:`OpRecord` that allocated it (``-1`` for resident).
        first_use: for each phase, event position of the first op that read it.
    """

    sid: int
    nbytes: int
    alloc: int
    free: int | None = None
    op: int = -1
    first_use: dict[str, int] = field(default_factory=dict)


@dataclass
class OpRecord:
    """One aten op call seen by the tracker.

    Attributes:
        index: position in :attr:`MemoryTracker.ops`.
        func: the ``OpOverload``.
        phase: ``"fwd"``, ``"rc"`` (checkpoint recomputation), ``"bwd"`` or ``"other"``.
        region: index of the enclosing region, ``-1`` outside regions.
        position: number of events before the op ran (its allocations follow).
        new: storage ids the op allocated, in output order.
        outputs: for each new storage: ``(shape, dtype, whole, contiguous)``; ``whole``
            means the output tensor covers its whole storage from offset 0.
        inputs: storage ids of its tensor inputs.
        writes: storage ids the op mutates (schema ``(a!)`` arguments).
        time_s: wall time of the op (CUDA: event time, resolved by :meth:`finish`).
        random: the op draws random numbers (see :func:`is_random`).
        flops: FLOPs per ``torch.utils.flop_counter`` (0 for ops it has no formula for).
        collective: a c10d op.
        sac_ordinal: position among the ops a selective-checkpoint policy saw in the
            region's forward, else ``None``.
    """

    index: int
    func: Any
    phase: str
    region: int
    position: int
    new: list[int]
    outputs: list[tuple[tuple[int, ...], torch.dtype, bool, bool]]
    inputs: list[int]
    writes: list[int]
    time_s: float = 0.0
    random: bool = False
    collective: bool = False
    sac_ordinal: int | None = None
    flops: float = 0.0


class MemoryTracker(TorchDispatchMode):
    """Track storage allocations and frees of everything run while active.

    Args:
        record_ops: keep an :class:`OpRecord` per op (the profiler needs them; a plain
            peak measurement does not).
        time_ops: time each op (wall clock on the CPU; CUDA events on CUDA tensors).
        device: count only storages on this device (``None``: every device). A GPU
            budget should not count the host tensors a step touches.

    Use as a context manager around one step, then call :meth:`finish` once.

    Raises:
        TypeError: ``record_ops``/``time_ops`` not bools, ``device`` not a device or str.
        ValueError: ``device`` names no device type.
    """

    def __init__(
        self,
        *,
        record_ops: bool = False,
        time_ops: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        check_bool("record_ops", record_ops)
        check_bool("time_ops", time_ops)
        if device is not None and not isinstance(device, torch.device | str):
            raise TypeError(f"device must be a torch.device, a str or None, got {device!r}")
        try:
            if device is not None:
                torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must name a torch device, got {device!r}") from None
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.record_ops = record_ops
        self.time_ops = time_ops
        self.storages: list[StorageRecord] = []
        self.deltas: list[int] = []
        self.ops: list[OpRecord] = []
        self.phase = "fwd"
        self.region = -1
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._finalizers: list[weakref.finalize[[int, int], torch.UntypedStorage]] = []
        # Reentrant: a garbage collection inside a locked section can free a storage,
        # whose finalizer takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._cuda_events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._active = True
        self._resident = 0
        #: phase -> ids of the threads its ops ran on (diagnostics: on CUDA the
        #: autograd engine runs the backward on a device thread of its own).
        self.threads: dict[str, set[int]] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _on_free(self, key: int, sid: int) -> None:
        if not self._active:
            return
        with self._lock:
            if self._live.get(key) == sid:
                del self._live[key]
            rec = self.storages[sid]
            if rec.free is None:
                self.deltas.append(-rec.nbytes)
                rec.free = len(self.deltas) - 1

    def _register(self, st: torch.UntypedStorage, *, resident: bool, op: int) -> int:
        key = st._cdata
        nbytes = st.nbytes()
        with self._lock:
            sid = len(self.storages)
            if resident:
                rec = StorageRecord(sid, nbytes, -1, None, op)
                self._resident += nbytes
            else:
                self.deltas.append(nbytes)
                rec = StorageRecord(sid, nbytes, len(self.deltas) - 1, None, op)
            self.storages.append(rec)
            self._live[key] = sid
        self._finalizers.append(weakref.finalize(st, self._on_free, key, sid))
        return sid

    def _sid(self, st: torch.UntypedStorage, *, op: int) -> int:
        sid = self._live.get(st._cdata)
        return self._register(st, resident=True, op=op) if sid is None else sid

    @property
    def resident_bytes(self) -> int:
        """Bytes of the storages that existed before the step and were touched by it."""
        return self._resident

    def live_bytes(self) -> np.ndarray:
        """Live bytes after each event (resident included), as int64."""
        if not self.deltas:
            return np.full(1, self._resident, dtype=np.int64)
        return self._resident + np.cumsum(np.asarray(self.deltas, dtype=np.int64))

    def peak_bytes(self) -> int:
        """Largest live bytes over the step (resident bytes if nothing was allocated)."""
        return int(max(self._resident, self.live_bytes().max()))

    def position(self) -> int:
        """Number of events so far (the position an op starting now sees)."""
        return len(self.deltas)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(
        self,
        func: OpOverload[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        ins = _plain_tensors((args, kwargs))
        # Storages passed as such (``set_``) are inputs too.
        in_keys = {
            x._cdata for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.UntypedStorage)
        }
        in_sids: list[int] = []
        op_index = len(self.ops)
        for t in ins:
            st = _storage_of(t, self.device)
            if st is None:
                continue
            in_keys.add(st._cdata)
            in_sids.append(self._sid(st, op=op_index))
        pos = len(self.deltas)
        # Timing: CUDA events (resolved in ``finish``) for ops on CUDA tensors, the
        # wall clock otherwise.
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        cpu_start: float | None = None
        if self.time_ops:
            if any(t.is_cuda for t in ins):
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            else:
                cpu_start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = 0.0
        if events is not None:
            events[1].record()
        elif cpu_start is not None:
            elapsed = time.perf_counter() - cpu_start
        schema = getattr(func, "_schema", None)
        # An output storage that is neither an input's nor already known was created
        # by this op (even for ops whose schema says they *may* alias: ``to``,
        # ``reshape``, ``contiguous`` copy when they must).
        new: list[int] = []
        outputs = []
        for t in _plain_tensors(out):
            st = _storage_of(t, self.device)
            if st is None:
                continue
            key = st._cdata
            if key in self._live:
                continue
            if key in in_keys:
                continue
            sid = self._register(st, resident=False, op=op_index)
            new.append(sid)
            whole = t.storage_offset() == 0 and t.numel() * t.element_size() == st.nbytes()
            outputs.append((tuple(t.shape), t.dtype, whole, t.is_contiguous()))
        seen = self.threads.get(self.phase)
        if seen is None:
            seen = self.threads[self.phase] = set()
        seen.add(threading.get_ident())
        for sid in in_sids:
            fu = self.storages[sid].first_use
            if self.phase not in fu:
                fu[self.phase] = pos
        if self.record_ops:
            writes: list[int] = []
            if schema is not None:
                for a, v in zip(schema.arguments, args):
                    if a.alias_info is not None and a.alias_info.is_write:
                        for t in _plain_tensors(v):
                            st = _storage_of(t, self.device)
                            if st is not None and st._cdata in self._live:
                                writes.append(self._live[st._cdata])
                for name, v in kwargs.items():
                    a = next((x for x in schema.arguments if x.name == name), None)
                    if a is not None and a.alias_info is not None and a.alias_info.is_write:
                        for t in _plain_tensors(v):
                            st = _storage_of(t, self.device)
                            if st is not None and st._cdata in self._live:
                                writes.append(self._live[st._cdata])
            rec = OpRecord(
                index=op_index,
                func=func,
                phase=self.phase,
                region=self.region,
                position=pos,
                new=new,
                outputs=outputs,
                inputs=in_sids,
                writes=writes,
                time_s=elapsed,
                random=is_random(func, args, kwargs),
                collective=is_collective(func),
                flops=_flops(func, args, kwargs, out),
            )
            self.ops.append(rec)
            if events is not None:
                self._cuda_events.append((op_index, *events))
        return out

    def finish(self) -> None:
        """Stop counting frees, resolve CUDA timings and drop the finalizers."""
        if self._cuda_events:
            torch.cuda.synchronize()
            for i, start, end in self._cuda_events:
                self.ops[i].time_s = start.elapsed_time(end) / 1e3
            self._cuda_events.clear()
        self._active = False
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live.clear()
