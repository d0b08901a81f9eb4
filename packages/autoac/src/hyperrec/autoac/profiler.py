"""Profile a training step: per region, per op output, bytes, cost, lifetime; the peak.

The profiled step runs with **every region fully checkpointed** (the least memory any
plan can use, so profiling fits wherever training fits) under a
:class:`~hyperrec.autoac.tracker.MemoryTracker`. That one trace holds everything a plan
needs: for each op output of a region, when it is allocated in the forward, when Python
lets go of it, when the recomputation allocates it again, when the backward first reads
it and frees it, and whether autograd needs it (alive after the recomputation ends).
Every plan is this trace with some lifetimes stretched (keep), shrunk to a packed copy
(quantize) or dropped (no checkpoint), which is how :mod:`hyperrec.autoac.planner`
predicts its peak at every position of the step.
"""

from __future__ import annotations

import inspect
import statistics
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperrec.autoac import regions as _regions
from hyperrec.autoac._exec import (
    INPUT,
    SAC_IGNORED_OPS,
    RegionDecisions,
    bind_kwargs,
    explicit_generator,
    input_storages,
    keep_module_state,
    no_compile,
    op_name,
    run_region,
    sac_context_fn,
)
from hyperrec.autoac._validate import check_choice, check_float, check_int
from hyperrec.autoac.formats import SAVE_FORMATS, can_pack, pack_storage, packed_nbytes
from hyperrec.autoac.tracker import MemoryTracker, OpRecord

__all__ = ["Profile", "ProfileConfig", "RegionProfile", "SavedOp", "StorageLife", "profile"]

#: ``step_fn(model) -> loss``: one forward of the step.
_StepFn = Callable[[nn.Module], torch.Tensor]

CostSource = Literal["time", "flops"]


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """How :func:`profile` measures a step.

    Raises:
        TypeError: a field of the wrong type (``formats`` not a tuple, a float ``steps``).
        ValueError: a field out of range, an unknown ``cost`` or format.
    """

    steps: int = 2
    """Profiled steps (>= 1). Op times are the median over the steps after the first
    (the first warms caches and allocators) when there are two or more."""

    cost: CostSource = "time"
    """Recompute cost of an op: ``"time"`` (measured: CUDA events on the GPU, wall
    clock on the CPU) or ``"flops"`` (``torch.utils.flop_counter`` FLOPs and bytes over
    a matmul / copy rate measured on the device: the same on every rank)."""

    formats: tuple[str, ...] = ()
    """Packed formats to consider for saved tensors (``"mxfp8"``, ``"fp8_e4m3"``,
    ``"fp8_e5m2"``, ``"mx4"``, ``"mxint8"``). Each is measured per tensor class (the producing op)
    and allowed only where the gradient error stays within ``max_grad_error``."""

    max_grad_error: float = 0.03
    """Bound on the relative L2 error of all parameter gradients,
    ``||g_packed - g|| / ||g||`` over the concatenation of every ``.grad``, that packing
    one tensor class may cause on the profiled step."""

    min_pack_bytes: int = 1 << 16
    """Storages smaller than this are never packed (scales and launches dominate)."""

    seed: int = 0
    """Seed of torch's generators for every profiled step (dropout masks agree across
    steps; the caller's RNG state is restored afterwards)."""

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        check_choice("cost", self.cost, ("time", "flops"))
        if not isinstance(self.formats, tuple):
            raise TypeError(f"formats must be a tuple, got {type(self.formats).__name__}")
        for f in self.formats:
            check_choice("formats entry", f, SAVE_FORMATS)
        check_float("max_grad_error", self.max_grad_error, minimum=0.0)
        check_int("min_pack_bytes", self.min_pack_bytes, minimum=0)
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True)
class StorageLife:
    """Lifetime of one storage an op created, as positions of the profiled trace.

    Positions index the trace's events (allocations and frees); a storage counts at
    positions ``[alloc, free)``. ``None`` means the event did not happen.

    Attributes:
        nbytes, dtype, numel: size of the storage.
        fwd_alloc: allocation in the region's forward.
        fwd_free: when Python released the forward copy (nothing else holds it).
        rc_alloc: allocation of its copy in the recomputation.
        rc_free: release of that copy in the backward.
        bwd_use: first backward op that read the recomputed copy.
        needed: autograd holds it for the backward (alive when recomputation ended).
    """

    nbytes: int
    dtype: torch.dtype
    numel: int
    fwd_alloc: int
    fwd_free: int
    rc_alloc: int | None
    rc_free: int | None
    bwd_use: int | None
    needed: bool


def packable(lv: StorageLife, fmt: str, min_pack_bytes: int) -> bool:
    """Whether the storage ``lv`` is large enough (``min_pack_bytes``, at least one
    byte) and of a dtype and size that ``fmt`` packs."""
    return lv.nbytes >= max(min_pack_bytes, 1) and can_pack(lv.dtype, lv.numel, fmt)


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // max(dtype.itemsize, 1)


@dataclass(frozen=True)
class SavedOp:
    """One op call in a region's forward whose outputs a plan can keep, pack or recompute.

    Attributes:
        ordinal: position among the ops a selective-checkpoint policy sees.
        key: ``(op name, occurrence)``, the key of plan decisions.
        op: op name (``"aten.mm.default"``).
        op_class: the tensor class used for packing errors: the op packet
            (``"aten.mm"``).
        nbytes: bytes of the storages it allocated.
        storages: their :class:`StorageLife`.
        time_s: recompute cost the planner uses (see :attr:`ProfileConfig.cost`).
        measured_s: measured time of the op.
        flops: FLOPs from ``torch.utils.flop_counter`` (0 where it has no formula).
        random: draws random numbers (always recomputed under checkpointing).
        collective: a c10d op (always kept under checkpointing).
        mutated: a later op of the step (in the region or after it) writes into its
            output (never kept).
        recomputed: replayed by the recomputation (ops after the last tensor autograd
            needs are not: early stop).
        needed: autograd needs one of its storages in the backward.
        formats: packed formats allowed for it (dtype, size and class error).
        shapes: output shapes of its storages.
        is_input: not an op but an input of the region (op and class ``"<input>"``),
            which the region may pack when it runs un-checkpointed (0.1.18); never
            recomputed by the region, and held by its checkpoint when checkpointed.
        none_held: the fraction of its needed bytes the region holds when it runs
            un-checkpointed (1.0: all, as the eager step held them; less where a
            compiled graph recomputes the op in its backward instead, see
            :func:`hyperrec.autoac.runtime.calibrate_none`).
    """

    ordinal: int
    key: tuple[str, int]
    op: str
    op_class: str
    nbytes: int
    storages: tuple[StorageLife, ...]
    time_s: float
    measured_s: float
    flops: float
    random: bool
    collective: bool
    mutated: bool
    recomputed: bool
    needed: bool
    formats: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    is_input: bool = False
    none_held: float = 1.0

    def none_held_bytes(self, lv: StorageLife) -> int:
        """Bytes of its storage ``lv`` the region holds when it runs un-checkpointed."""
        return round(lv.nbytes * self.none_held)


@dataclass(frozen=True)
class RegionProfile:
    """One region of the profiled step.

    Attributes:
        name: module name in the model (``"<root>"`` for the model itself).
        index: position in the forward.
        ops: the ops a plan decides for (allocating, replayed or saveable).
        fixed_recompute_s: recompute time a checkpoint of this region always pays
            (in-place and view ops, random ops, ops whose output is mutated later).
        input_bytes: bytes of the tensor inputs the step created (activations held by a
            checkpoint until its backward; parameters and other resident inputs are not
            counted).
        fwd_start, rc_start, rc_end: positions where its forward and its recomputation
            begin and where the backward resumes after the recomputation.
        modes: ``("sac", "none")``, or ``("none",)`` for a region that cannot be
            replayed (it runs an in-place collective, draws from an explicit generator
            or writes into its input) and is left as is.
        forward_s: measured time of its forward ops.
        plain_held_bytes: for a region left as is (``modes == ("none",)``), the bytes
            its forward allocated that stay live into the backward (what it saves for
            it): its held bytes beyond its inputs, which no plan can lower. 0 otherwise
            (a checkpointable region's held bytes come from its ops' decisions).
        none_backward_bytes: the most bytes its backward allocates beyond what was
            allocated when it started, when it runs un-checkpointed, as measured in a
            compiled step (see :func:`hyperrec.autoac.runtime.calibrate_none`); ``None``:
            as the profiled eager step allocated them (the default).
    """

    name: str
    index: int
    ops: tuple[SavedOp, ...]
    fixed_recompute_s: float
    input_bytes: int
    fwd_start: int
    rc_start: int | None
    rc_end: int | None
    modes: tuple[str, ...]
    forward_s: float
    plain_held_bytes: int = 0
    none_backward_bytes: int | None = None

    @property
    def full_recompute_s(self) -> float:
        """Recompute time of a full checkpoint of the region."""
        return self.fixed_recompute_s + sum(o.time_s for o in self.ops if o.recomputed)


@dataclass(frozen=True)
class Profile:
    """The profiled step (see :func:`profile`).

    Attributes:
        regions: per region, in forward order.
        live: live bytes after every event of the fully checkpointed step (int64).
        phase: per position, 0 forward, 1 recomputation, 2 backward.
        resident_bytes: storages that existed before the step and were used by it.
        tracked_peak: ``live.max()``.
        device: ``"cpu"`` or ``"cuda:N"``.
        allocator_peak: CUDA ``max_memory_allocated`` of the profiled step (``None`` on
            the CPU).
        device_offset: ``allocator_peak - tracked_peak`` on CUDA (workspaces, other
            tensors on the device, allocator rounding), 0 on the CPU; added to every
            predicted peak.
        step_s: time of one fully checkpointed step as profiled (instrumented).
        pack_errors: ``(op class, format) -> measured relative gradient error``.
        pack_costs: ``format -> (seconds per element, seconds per call)`` to pack and
            unpack, and ``(workspace bytes per element)``.
        config: the :class:`ProfileConfig` used.
        diagnostics: counts that show whether the trace saw what it should: ops per
            phase, threads per phase (on CUDA the backward runs on a device thread),
            ops the checkpoint policy numbered per region, recomputed ops per region.
        resident_at_backward: bytes of the resident storages still alive when the
            forward ended (a batch the step reduces and drops is resident but gone by
            then); ``None`` in profiles made before 0.1.17.
    """

    regions: tuple[RegionProfile, ...]
    live: np.ndarray
    phase: np.ndarray
    resident_bytes: int
    tracked_peak: int
    device: str
    allocator_peak: int | None
    device_offset: int
    step_s: float
    pack_errors: dict[tuple[str, str], float]
    pack_costs: dict[str, dict[str, float]]
    config: ProfileConfig = field(repr=False)
    diagnostics: dict[str, Any] = field(default_factory=dict, repr=False)
    resident_at_backward: int | None = None

    def saved_tensors(self) -> list[dict[str, Any]]:
        """One row per op output of every region (what the profiler saw)."""
        rows = []
        for r in self.regions:
            for o in r.ops:
                rows.append(
                    {
                        "region": r.name,
                        "ordinal": o.ordinal,
                        "op": o.op,
                        "bytes": o.nbytes,
                        "time_s": o.time_s,
                        "flops": o.flops,
                        "needed": o.needed,
                        "input": o.is_input,
                        "recomputed": o.recomputed,
                        "random": o.random,
                        "collective": o.collective,
                        "formats": list(o.formats),
                        "lifetime": [
                            (s.fwd_alloc, s.fwd_free, s.rc_alloc, s.rc_free) for s in o.storages
                        ],
                    }
                )
        return rows

    def timeline(self) -> dict[str, list[int]]:
        """The fully checkpointed step's memory timeline: positions, live bytes, phase."""
        return {
            "position": list(range(len(self.live))),
            "live_bytes": self.live.tolist(),
            "phase": self.phase.tolist(),
        }


# --------------------------------------------------------------------------- recording
class _ProfilingTracker(MemoryTracker):
    """The tracker of one profiled step, plus what the recording runner learns per region."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(record_ops=True, time_ops=True, device=device)
        #: region -> number of ops recorded when its recomputation ended
        self.rc_exit: dict[int, int] = {}
        #: region -> the ops its selective-checkpoint policy saw, in order
        self.policy_calls: defaultdict[int, list[Any]] = defaultdict(list)
        #: regions whose forward runs an in-place collective (replayed unchecked)
        self.inplace_collective: set[int] = set()
        #: regions whose forward draws from an explicit ``torch.Generator``
        #: (replayed unchecked: a checkpoint cannot restore it)
        self.explicit_generator: set[int] = set()
        #: regions whose forward writes into one of its inputs in place (replayed
        #: unchecked: the checkpoint saved the input before the write)
        self.inplace_input: set[int] = set()
        #: region -> its tensor inputs (weakly: holding them would move their frees
        #: in the measured timeline) and their versions when it returned: a later
        #: in-place write by the caller fails the checkpoint's backward the same way
        self.input_versions: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}
        #: region -> ``(k, storage id, dtype)`` of each input the step created, ``k``
        #: its position among the distinct storages of the call's tensor arguments (the
        #: key a plan packs it under, see ``_exec._run_none_packed``)
        self.input_storages: dict[int, list[tuple[int, int, torch.dtype]]] = {}

    def written_after(self) -> set[int]:
        """Regions one of whose inputs was written in place after the region returned."""
        out = set()
        for j, vs in self.input_versions.items():
            for ref, v in vs:
                t = ref()
                if t is not None and t._version != v:
                    out.add(j)
        return out


class _PhaseContext:
    """Enter ``inner`` with the tracker switched to a region (and phase)."""

    def __init__(
        self, tracker: _ProfilingTracker, phase: str | None, region: int, inner: Any
    ) -> None:
        self.tracker, self.phase, self.region, self.inner = tracker, phase, region, inner
        self.marks: dict[int, int] = {}

    def __enter__(self) -> Any:
        t = self.tracker
        self.prev = (t.phase, t.region)
        if self.phase is not None:
            t.phase = self.phase
        t.region = self.region
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.tracker.phase, self.tracker.region = self.prev
            if self.phase == "rc":
                self.tracker.rc_exit[self.region] = len(self.tracker.ops)


def _recording_runner(tracker: _ProfilingTracker, plain: set[int]) -> Callable[..., Any]:
    def runner(
        state: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        j = state.index
        # Inputs the step created (activations); resident ones (parameters, a shared
        # mask) are held anyway.
        keyed: list[tuple[int, int, torch.dtype]] = []
        for k, t in enumerate(input_storages((args, kwargs))):
            sid = tracker._live.get(t.untyped_storage()._cdata)
            if sid is not None and tracker.storages[sid].alloc >= 0:
                keyed.append((k, sid, t.dtype))
        tracker.input_storages[j] = keyed
        if j in plain or not torch.is_grad_enabled():
            prev = tracker.region
            tracker.region = j
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.region = prev

        calls = tracker.policy_calls[j]

        def on_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # Only the sequence of ops the policy saw: torch up to 2.11 asks the policy
            # *before* the op runs, later versions after it, so the op the tracker
            # recorded last is not necessarily this one (see _number_policy_ops).
            calls.append(func)
            if explicit_generator(func, args, kwargs):
                tracker.explicit_generator.add(j)

        inner = sac_context_fn(RegionDecisions(mode="sac"), on_op=on_op)

        def context_fn() -> tuple[Any, Any]:
            fwd, rc = inner()
            return _PhaseContext(tracker, None, j, fwd), _PhaseContext(tracker, "rc", j, rc)

        versions = [(t, t._version) for t in _regions.flat_tensors((args, kwargs))]
        out = checkpoint(
            bind_kwargs(keep_module_state(fn), kwargs),
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=True,
        )
        if any(t._version != v for t, v in versions):
            tracker.inplace_input.add(j)
        tracker.input_versions[j] = [(weakref.ref(t), t._version) for t, _ in versions]
        return out

    return runner


def _number_policy_ops(tracker: _ProfilingTracker) -> None:
    """Give every forward op of a checkpointed region its ``sac_ordinal``: its position
    among the ops the selective-checkpoint policy saw (the numbering plan decisions use).

    The policy's calls and the tracker's records are matched in order, op by op. This
    does not depend on when torch calls the policy (before the op up to torch 2.11,
    after it since the policy receives ``op_output``); matching on "the op recorded
    last" did, and on torch 2.11 it numbered nothing: every region looked empty, and
    the plan predicted the no-checkpoint peak equal to the full-recompute floor.

    Raises:
        RuntimeError: the policy saw an op the tracker did not record (the two would
            disagree on what each plan decision refers to).
    """
    by_region: dict[int, list[Any]] = defaultdict(list)
    for o in tracker.ops:
        if o.phase == "fwd" and o.region >= 0 and o.func not in SAC_IGNORED_OPS:
            by_region[o.region].append(o)
    for j, calls in tracker.policy_calls.items():
        i = 0
        for o in by_region.get(j, ()):
            if i < len(calls) and o.func is calls[i]:
                o.sac_ordinal = i
                i += 1
                if o.collective and _mutates(o.func, o):
                    tracker.inplace_collective.add(j)
        if not calls and any(o.new for o in by_region.get(j, ())):
            raise RuntimeError(
                f"autoac: region {j} ran under a selective checkpoint and allocated tensors, "
                "but the checkpoint policy saw no op; this torch version runs selective "
                "checkpointing in a way autoac does not know"
            )
        if i != len(calls):
            raise RuntimeError(
                f"autoac: the checkpoint policy of region {j} saw {len(calls)} ops but only "
                f"{i} match the ops the memory tracker recorded (next unmatched: "
                f"{op_name(calls[i])}); this torch version runs selective checkpointing "
                "in a way autoac does not know"
            )


def _mutates(func: Any, rec: Any) -> bool:
    """An in-place collective (``c10d.allreduce_``, ``_c10d_functional.all_reduce_``):
    replaying the region would skip its write, so the region cannot be checkpointed."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", str(func))
    return bool(rec.writes) or name.endswith("_")


def _decision_runner(
    decisions: dict[int, RegionDecisions], watch: _InputWatch | None = None
) -> Callable[..., Any]:
    def runner(
        state: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if watch is not None:
            watch.check()
        d = decisions.get(state.index)
        if d is None:
            return fn(*args, **kwargs)
        out = run_region(d, fn, args, kwargs)
        if watch is not None:
            watch.add(state.index, d, args, kwargs)
        return out

    return runner


class _InputWatch:
    """Which packed inputs outlive their region without the region holding them.

    The trace cannot tell a region's inputs that nothing else holds from inputs an
    autograd node outside the regions saved (a ReLU between layers saving its output,
    a gate multiplying the input by a parameter) or that the caller keeps referencing
    (unrolled locals, a list of hidden states): its checkpoints hold every input
    until their backward. In the run that measures the inputs' packing error, each
    packed input's storage is watched (weakly) from its region's return to the next
    region's call (or the backward, after the last region): still alive there, it is
    held elsewhere, and packing it would free nothing while the plan's peak assumed it
    gone (found by review: peaks 1.36-1.79x over the prediction).
    """

    def __init__(self) -> None:
        self.pending: list[tuple[int, tuple[str, int], weakref.ref[torch.UntypedStorage]]] = []
        self.held: set[tuple[int, tuple[str, int]]] = set()

    def add(self, region: int, d: RegionDecisions, args: Any, kwargs: Any) -> None:
        for k, t in enumerate(input_storages((args, kwargs))):
            key = (INPUT, k)
            if key in d.saves:
                self.pending.append((region, key, weakref.ref(t.untyped_storage())))

    def check(self) -> None:
        for region, key, ref in self.pending:
            if ref() is not None:
                self.held.add((region, key))
        self.pending.clear()


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _seed_all(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def _run_step(
    model: nn.Module,
    step_fn: _StepFn,
    tracker: MemoryTracker | None,
    before_backward: Callable[[], None] | None = None,
) -> float:
    """One forward (``step_fn``) + backward; returns the wall time."""
    t0 = time.perf_counter()
    if tracker is not None:
        with tracker:
            loss = step_fn(model)
            _check_loss(loss)
            tracker.phase = "bwd"
            backward_sparing_inputs(model, loss)
    else:
        loss = step_fn(model)
        _check_loss(loss)
        if before_backward is not None:
            before_backward()
        backward_sparing_inputs(model, loss)
    dev = loss.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _check_step_fn(step_fn: Any) -> None:
    """``step_fn`` must be a callable that takes the model as its one positional argument.

    Raises:
        TypeError: not callable, or its signature cannot take ``step_fn(model)``.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    try:
        sig = inspect.signature(step_fn)
    except (TypeError, ValueError):
        return  # no introspectable signature (a builtin): called as it is
    try:
        sig.bind(None)
    except TypeError:
        raise TypeError(
            f"step_fn must take the model as its one positional argument, got signature {sig}"
        ) from None


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            "step_fn must return a one-element loss tensor that requires grad, got "
            f"{type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )


def backward_sparing_inputs(model: nn.Module, loss: torch.Tensor) -> None:
    """``loss.backward()`` that leaves the ``.grad`` of every leaf outside ``model``'s
    parameters (inputs that require grad, tensors the step closes over) as it was:
    autoac's own steps must not accumulate into them (parameters are restored by the
    callers, from :func:`grads_of`)."""
    params = {id(p) for p in model.parameters()}
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(var, torch.Tensor) and id(var) not in params:
            leaves[id(var)] = var
        stack.extend(fn for fn, _ in node.next_functions)
    saved = [(t, t.grad) for t in leaves.values()]
    for t in leaves.values():
        t.grad = None  # else the backward accumulates into the saved tensor in place
    try:
        loss.backward()
    finally:
        for t, g in saved:
            t.grad = g


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    """Current ``.grad`` of every parameter (in ``model.parameters()`` order)."""
    return [p.grad for p in model.parameters()]


def set_grads(model: nn.Module, grads: list[torch.Tensor | None] | None) -> None:
    """Set every parameter's ``.grad`` (``None``: clear them)."""
    for i, p in enumerate(model.parameters()):
        p.grad = None if grads is None else grads[i]


def grad_error(ref: list[torch.Tensor | None], got: list[torch.Tensor | None]) -> float:
    """``||got - ref|| / ||ref||`` over all gradients (missing ones count as zero)."""
    num = den = 0.0
    for r, g in zip(ref, got):
        if r is None and g is None:
            continue
        r64 = torch.zeros(()) if r is None else r.detach().double()
        g64 = torch.zeros(()) if g is None else g.detach().double()
        num += float((g64 - r64).square().sum())
        den += float(r64.square().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


# --------------------------------------------------------------------------- building
def _build_regions(
    tracker: _ProfilingTracker,
    names: list[str],
    times: dict[int, float],
    config: ProfileConfig,
    plain: set[int],
    rates: tuple[float, float] | None,
) -> tuple[RegionProfile, ...]:
    end = len(tracker.deltas)
    st = tracker.storages
    out = []
    # Last op that writes into each storage, anywhere in the step: a forward output
    # that a later op mutates in place (in its region or after it, e.g. the caller
    # writing into a tensor the region returned) cannot be kept, since the kept copy
    # would no longer hold what the recomputation needs.
    written: dict[int, int] = {}
    for o in tracker.ops:
        for s in o.writes:
            written[s] = max(written.get(s, -1), o.index)
    # where the backward begins: a storage allocated before it and freed in it was
    # saved for it
    bwd_pos = next((o.position for o in tracker.ops if o.phase == "bwd"), end)
    # forward storages some region's backward needs (a plan may keep them there)
    needed_sids: set[int] = set()
    for j, name in enumerate(names):
        fwd = [o for o in tracker.ops if o.region == j and o.phase == "fwd"]
        rc = [o for o in tracker.ops if o.region == j and o.phase == "rc"]
        inputs = sum(st[sid].nbytes for _, sid, _ in tracker.input_storages.get(j, []))
        fwd_start = fwd[0].position if fwd else 0
        forward_s = sum(times.get(o.index, o.time_s) for o in fwd)
        if j in plain or not rc:
            # Its saves are in the step's timeline either way; counted here so that its
            # held bytes (and a budget of its own) are not read as its inputs alone.
            held = 0
            for o in fwd:
                for s in o.new:
                    free = st[s].free
                    if free is not None and st[s].alloc < bwd_pos <= free:
                        held += st[s].nbytes
            out.append(
                RegionProfile(
                    name, j, (), 0.0, inputs, fwd_start, None, None, ("none",), forward_s, held
                )
            )
            continue
        # Match the k-th call of each op in the recomputation to the forward's.
        # (op name, occurrence) -> (sac ordinal, forward op), for the ops the policy saw
        by_key: dict[tuple[str, int], tuple[int, OpRecord]] = {}
        occ: Counter[object] = Counter()
        for o in fwd:
            if o.sac_ordinal is None:
                continue
            by_key[(op_name(o.func), occ[o.func])] = (o.sac_ordinal, o)
            occ[o.func] += 1
        rc_of: dict[int, OpRecord] = {}
        occ = Counter()
        for o in rc:
            if o.func not in {f.func for _, f in by_key.values()}:
                continue
            k = (op_name(o.func), occ[o.func])
            occ[o.func] += 1
            if k in by_key:
                rc_of[by_key[k][1].index] = o
        rc_start = rc[0].position
        exit_op = tracker.rc_exit.get(j, len(tracker.ops))
        rc_end = tracker.ops[exit_op].position if exit_op < len(tracker.ops) else end
        stop = max(
            (ordinal for ordinal, f in by_key.values() if f.index in rc_of),
            default=-1,
        )
        ops: list[SavedOp] = []
        fixed = 0.0
        for key, (ordinal, o) in by_key.items():
            t_meas = times.get(o.index, o.time_s)
            if rates is not None:
                flops_rate, byte_rate = rates
                moved = sum(st[s].nbytes for s in o.inputs) + sum(st[s].nbytes for s in o.new)
                cost = max(o.flops / flops_rate, moved / byte_rate)
            else:
                cost = t_meas
            replayed = o.index in rc_of
            if not o.new:
                if replayed:
                    fixed += cost
                continue
            r = rc_of.get(o.index)
            lives = []
            for i, s in enumerate(o.new):
                fs = st[s]
                rs = st[r.new[i]] if r is not None and i < len(r.new) else None
                needed = rs is not None and (rs.free is None or rs.free >= rc_end)
                bwd_use = rs.first_use.get("bwd") if rs is not None else None
                shape, dtype, _, _ = o.outputs[i]
                lives.append(
                    StorageLife(
                        nbytes=fs.nbytes,
                        dtype=dtype,
                        numel=_numel(fs.nbytes, dtype),
                        fwd_alloc=fs.alloc,
                        fwd_free=end if fs.free is None else fs.free,
                        rc_alloc=None if rs is None else rs.alloc,
                        rc_free=None if rs is None else (end if rs.free is None else rs.free),
                        bwd_use=bwd_use,
                        needed=needed,
                    )
                )
            needed_sids.update(s for s, lv in zip(o.new, lives) if lv.needed)
            mutated = any(written.get(s, -1) > o.index for s in o.new)
            fmts = tuple(
                f
                for f in config.formats
                if not (o.random or o.collective or mutated)
                and any(packable(lv, f, config.min_pack_bytes) for lv in lives)
            )
            saved = SavedOp(
                ordinal=ordinal,
                key=key,
                op=op_name(o.func),
                op_class=str(getattr(o.func, "overloadpacket", o.func)),
                nbytes=sum(lv.nbytes for lv in lives),
                storages=tuple(lives),
                time_s=cost,
                measured_s=t_meas,
                flops=o.flops,
                random=o.random,
                collective=o.collective,
                mutated=mutated,
                recomputed=replayed,
                needed=any(lv.needed for lv in lives),
                formats=fmts,
                shapes=tuple(tuple(x[0]) for x in o.outputs),
            )
            if ordinal <= stop or saved.needed:
                ops.append(saved)
        ops.sort(key=lambda s: s.ordinal)
        out.append(
            RegionProfile(
                name=name,
                index=j,
                ops=tuple(ops),
                fixed_recompute_s=fixed,
                input_bytes=inputs,
                fwd_start=fwd_start,
                rc_start=rc_start,
                rc_end=rc_end,
                modes=("sac", "none"),
                forward_s=forward_s,
            )
        )
    return _with_input_ops(tracker, tuple(out), needed_sids, written, config)


def _with_input_ops(
    tracker: _ProfilingTracker,
    regions: tuple[RegionProfile, ...],
    needed_sids: set[int],
    written: dict[int, int],
    config: ProfileConfig,
) -> tuple[RegionProfile, ...]:
    """Add to every checkpointable region one :class:`SavedOp` per input an
    un-checkpointed run of it may pack (key ``(INPUT, k)``, ``is_input=True``).

    In the profiled (checkpointed) trace a region's checkpoint holds its inputs until
    its recomputation. Un-checkpointed, its ops save the inputs they need; packing those
    saves frees the input itself only if nothing else holds it, so an input is offered
    only where the trace shows no other holder: the input of this region alone, not a
    tensor a region's backward needs (a plan may keep it there), not written after the
    region ran, no backward use before this region's recomputation, and released by the
    trace before the next region's recomputation begins. Its packed copy is counted from
    the region's first op to the trace's release; the input itself is taken off from
    the position after the last forward op that read it up to the first backward op
    that reads it (where the backward unpacks it; stored as ``rc_alloc``).
    Holders the trace cannot show (an autograd node outside the regions that saved the
    input, the caller's own references) are found in the run that measures the inputs'
    packing error (:class:`_InputWatch`), which drops those offers.
    """
    if not config.formats:
        return regions
    st = tracker.storages
    count: Counter[int] = Counter(sid for v in tracker.input_storages.values() for _, sid, _ in v)
    rc_starts = sorted(r.rc_start for r in regions if r.rc_start is not None)
    # last forward read and every backward read (recomputation included) per storage
    last_read: dict[int, int] = {}
    bwd_reads: defaultdict[int, list[tuple[int, str]]] = defaultdict(list)
    first_fwd: dict[int, int] = {}
    next_pos = [o.position for o in tracker.ops[1:]] + [len(tracker.deltas)]
    for o, nxt in zip(tracker.ops, next_pos):
        if o.phase == "fwd":
            first_fwd.setdefault(o.region, o.index)
        for sid in o.inputs:
            if o.phase == "fwd":
                last_read[sid] = max(last_read.get(sid, -1), nxt)
            elif o.phase in ("rc", "bwd"):
                bwd_reads[sid].append((o.position, o.phase))
    out = []
    for r in regions:
        rc = r.rc_start
        if rc is None or "sac" not in r.modes:
            out.append(r)
            continue
        later = [p for p in rc_starts if p > rc]
        horizon = later[0] if later else len(tracker.deltas)
        first = first_fwd.get(r.index)
        extra = []
        for k, sid, dtype in tracker.input_storages.get(r.index, []):
            s = st[sid]
            release = last_read.get(sid)
            if (
                count[sid] != 1
                or sid in needed_sids
                or s.free is None
                or not rc <= s.free <= horizon
                or release is None
                or release >= rc
                or any(p < rc for p, _ in bwd_reads.get(sid, ()))
                or (first is not None and written.get(sid, -1) >= first)
            ):
                continue
            numel = _numel(s.nbytes, dtype)
            # Un-checkpointed, the input comes back when the first backward node that
            # saved it unpacks it: the trace's first backward (not recomputation) read.
            uses = [p for p, ph in bwd_reads.get(sid, ()) if ph == "bwd" and p >= rc]
            unpack = min(uses) if uses else rc
            life = StorageLife(
                nbytes=s.nbytes,
                dtype=dtype,
                numel=numel,
                fwd_alloc=r.fwd_start,
                fwd_free=release,
                rc_alloc=unpack,
                rc_free=max(s.free, unpack),
                bwd_use=unpack,
                needed=True,
            )
            fmts = tuple(f for f in config.formats if packable(life, f, config.min_pack_bytes))
            if not fmts:
                continue
            extra.append(
                SavedOp(
                    ordinal=-1 - k,
                    key=(INPUT, k),
                    op=INPUT,
                    op_class=INPUT,
                    nbytes=s.nbytes,
                    storages=(life,),
                    time_s=0.0,
                    measured_s=0.0,
                    flops=0.0,
                    random=False,
                    collective=False,
                    mutated=False,
                    recomputed=False,
                    needed=True,
                    formats=fmts,
                    shapes=((numel,),),
                    is_input=True,
                )
            )
        extra.sort(key=lambda o: o.ordinal)
        out.append(replace(r, ops=tuple(extra) + r.ops) if extra else r)
    return tuple(out)


def _phases(tracker: MemoryTracker) -> np.ndarray:
    n = max(len(tracker.deltas), 1)
    phase = np.zeros(n, dtype=np.int8)
    code = {"fwd": 0, "other": 0, "rc": 1, "bwd": 2}
    ops = tracker.ops
    for a, b in zip(ops, ops[1:] + [None]):
        stop = n if b is None else b.position
        phase[a.position : stop] = code.get(a.phase, 0)
    return phase


def _measure_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a square matmul, bytes/s of a copy) on ``device`` in ``dtype``."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.empty(1 << (24 if device.type == "cuda" else 20), device=device, dtype=dtype)
    y = torch.empty_like(x)

    def clock(fn: Callable[[], Any]) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    return 2 * n**3 / clock(lambda: a @ a), 2 * x.nbytes / clock(lambda: y.copy_(x))


def time_pack_back_to_back(x: torch.Tensor, fmt: str, reps: int) -> tuple[float, float]:
    """Seconds per call of ``reps`` packs of ``x``'s storage issued back to back (one
    synchronisation at the end), then as many unpacks of the last packed copy."""

    def sync() -> None:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        p = pack_storage(x, fmt)
    sync()
    t1 = time.perf_counter()
    for _ in range(reps):
        p.dequantize()
    sync()
    return (t1 - t0) / reps, (time.perf_counter() - t1) / reps


def _pack_costs(
    formats: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
    byte_rate: float | None = None,
) -> dict[str, dict[str, float]]:
    """Per format: time to pack + unpack a storage (linear in elements) and workspace.

    Each size is packed once to warm up (Triton compiles), then ``reps`` times back to
    back with one synchronisation at the end, and the packed copy unpacked the same way:
    the time per call is what a stream of such calls costs, the host's issue time where
    it exceeds the device's (small storages) and the device's time otherwise. Timing each
    call between synchronisations instead (before 0.1.7) added the launch latency and the
    host's whole Python path to every call: on the H200 that fitted ~1 ms per pack with no
    per-element term, about 5x what packing every eligible save added to a measured step,
    so the planner never chose a packed save.

    With ``byte_rate`` (``cost="flops"``) the times are the copy roofline instead, as for
    the ops they compete with: the bytes a pack reads and writes over ``byte_rate``, no
    per-call term; only the workspace is measured. Mixing measured pack times with
    roofline op costs priced packing in another currency: on the CPU the reference
    quantizer's wall time against FLOP counts, so the planner never packed there. Nothing
    is timed then.
    """
    sizes = (1 << 20, 1 << 26) if device.type == "cuda" else (1 << 12, 1 << 16)
    reps = 5 if device.type == "cuda" else 3
    out: dict[str, dict[str, float]] = {}
    for fmt in formats:
        meas = []
        ws = [0.0, 0.0]
        for n in sizes:
            x = torch.randn(n, device=device, dtype=torch.float32).to(dtype)
            if byte_rate is None:
                pack_storage(x, fmt).dequantize()  # warm-up: compiles
                meas.append((n, *time_pack_back_to_back(x, fmt, reps)))
            # Workspace beyond the inputs and outputs of each call, per element.
            tr = MemoryTracker(device=device)
            with tr:
                p = pack_storage(x, fmt)
            tr.finish()
            ws[0] = max(0.0, (tr.peak_bytes() - x.nbytes - p.nbytes) / n)
            tr = MemoryTracker(device=device)
            with tr:
                y = p.dequantize()
            tr.finish()
            ws[1] = max(0.0, (tr.peak_bytes() - p.nbytes - y.nbytes) / n)
        if byte_rate is None:
            (n0, p0, u0), (n1, p1, u1) = meas
            pb = max((p1 - p0) / (n1 - n0), 0.0)
            ub = max((u1 - u0) / (n1 - n0), 0.0)
            pc, uc = max(p0 - pb * n0, 0.0), max(u0 - ub * n0, 0.0)
        else:
            # read the storage, write the packed copy; the unpack the other way round
            moved = torch.finfo(dtype).bits / 8 + packed_nbytes(1 << 20, fmt) / (1 << 20)
            pb = ub = moved / byte_rate
            pc = uc = 0.0
        out[fmt] = {
            "pack_per_elem_s": pb,
            "pack_call_s": pc,
            "unpack_per_elem_s": ub,
            "unpack_call_s": uc,
            "pack_ws_per_elem": ws[0],
            "unpack_ws_per_elem": ws[1],
        }
    return out


# --------------------------------------------------------------------------- public
def profile(
    model: nn.Module,
    step_fn: Callable[[nn.Module], torch.Tensor],
    *,
    regions: Any = None,
    config: ProfileConfig | None = None,
) -> Profile:
    """Profile one training step of ``model`` with every region checkpointed.

    Args:
        model: the model (train mode as you train it; it is not changed).
        step_fn: ``step_fn(model) -> loss``: runs the forward and returns a
            one-element loss; autoac calls ``loss.backward()``. Use the largest batch
            you will train with: the plan is made for these sizes.
        regions: see :func:`hyperrec.autoac.regions.resolve_regions` (default: the
            blocks of the largest ``ModuleList``). Each region must run once per step.
        config: :class:`ProfileConfig`.

    Returns:
        :class:`Profile`.

    Raises:
        TypeError: ``model`` not a module, ``step_fn`` not callable, not taking the
            model as its one argument or not returning a one-element loss that requires
            grad, bad ``regions``/``config`` types.
        ValueError: bad ``regions``; a region that ran more than once in the step.

    Parameter gradients and the RNG state are restored afterwards. Buffers that the
    forward updates in place (e.g. batch-norm running statistics) are not restored: each
    profiled step updates them once, as a training step does (a recomputation's second
    update is undone, see :func:`~hyperrec.autoac.apply_plan`).
    ``torch.compile``'d functions inside the model run eagerly while profiling (see
    :func:`no_compile`): times and peaks are the eager ones.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_step_fn(step_fn)
    config = ProfileConfig() if config is None else config
    if not isinstance(config, ProfileConfig):
        raise TypeError(f"config must be a ProfileConfig, got {type(config).__name__}")
    mods, names = _regions.resolve_regions(model, regions)
    had = {id(m) for m in _regions.installed_regions(model)}
    states = _regions.install(mods, names)
    prev_runners = [s.runner for s in states]
    device = _device_of(model)
    saved_grads = grads_of(model)
    fork_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), no_compile():
            return _profile(model, step_fn, states, names, config, device)
    finally:
        for s, r in zip(states, prev_runners):
            s.runner = r
        _regions.uninstall([m for m in mods if id(m) not in had])
        set_grads(model, saved_grads)


def _profile(
    model: nn.Module,
    step_fn: _StepFn,
    states: list[_regions._RegionState],
    names: list[str],
    config: ProfileConfig,
    device: torch.device,
) -> Profile:
    plain: set[int] = set()
    for _attempt in range(3):
        traces: list[_ProfilingTracker] = []
        walls: list[float] = []
        alloc_peak = None
        for _ in range(config.steps):
            set_grads(model, None)
            tracker = _ProfilingTracker(device)
            runner = _recording_runner(tracker, plain)
            for s in states:
                s.runner = runner
                s.calls = 0
            _seed_all(config.seed, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            try:
                walls.append(_run_step(model, step_fn, tracker))
            except RuntimeError:
                # the backward of a region whose input was written in place, by the
                # region itself or by the caller after it returned (torch's version
                # error): replay with that region un-checkpointed
                tracker.inplace_input |= tracker.written_after()
                if not tracker.inplace_input - plain:
                    raise
                traces.append(tracker)
                break
            tracker.finish()
            _number_policy_ops(tracker)
            if device.type == "cuda":
                alloc_peak = int(torch.cuda.max_memory_allocated(device))
            for s in states:
                if s.calls > 1:
                    raise ValueError(
                        f"regions must run once per step; {s.name} ran {s.calls} times "
                        "(make each call its own region)"
                    )
            traces.append(tracker)
        t = traces[-1]
        new_plain = (t.inplace_collective | t.explicit_generator | t.inplace_input) - plain
        if not new_plain:
            break
        plain |= new_plain  # replay, these regions un-checkpointed
    else:  # pragma: no cover - every kind is found in the first step's forward
        raise RuntimeError("autoac: the regions that cannot be checkpointed did not settle")
    last = traces[-1]
    ref_grads = [None if g is None else g.detach().clone() for g in grads_of(model)]
    # Median op times over the steps after the first (same op sequence required).
    times: dict[int, float] = {}
    use = traces[1:] if len(traces) > 1 else traces
    if all(len(t.ops) == len(last.ops) for t in use):
        for i in range(len(last.ops)):
            times[i] = statistics.median(t.ops[i].time_s for t in use)
    rates = None
    if config.cost == "flops":
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        rates = _measure_rates(device, dtype)
    regions_p = _build_regions(last, names, times, config, plain, rates)
    live = last.live_bytes()
    tracked = int(live.max()) if len(live) else last.resident_bytes
    offset = 0 if alloc_peak is None else alloc_peak - tracked
    pack_errors: dict[tuple[str, str], float] = {}
    pack_costs: dict[str, dict[str, float]] = {}
    if config.formats:
        dtypes = Counter(
            lv.dtype for r in regions_p for o in r.ops for lv in o.storages if o.formats
        )
        dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
        pack_costs = _pack_costs(config.formats, device, dtype, None if rates is None else rates[1])
        pack_errors, held = _class_errors(
            model, step_fn, states, regions_p, config, device, ref_grads
        )
        regions_p = _drop_inputs(regions_p, held)
        regions_p = _restrict_formats(regions_p, pack_errors, config.max_grad_error)
    set_grads(model, None)
    fwd_threads = last.threads.get("fwd", set())
    diagnostics = {
        "ops_per_phase": dict(Counter(o.phase for o in last.ops)),
        "threads_per_phase": {ph: len(ids) for ph, ids in last.threads.items()},
        "backward_on_other_thread": bool(
            (last.threads.get("bwd", set()) | last.threads.get("rc", set())) - fwd_threads
        ),
        "policy_ops_per_region": [len(last.policy_calls.get(j, ())) for j in range(len(names))],
        "recompute_ops_per_region": [
            sum(1 for o in last.ops if o.region == j and o.phase == "rc") for j in range(len(names))
        ],
    }
    fwd_end = next((o.position for o in last.ops if o.phase != "fwd"), len(last.deltas))
    resident_at_bwd = sum(
        s.nbytes for s in last.storages if s.alloc == -1 and (s.free is None or s.free >= fwd_end)
    )
    return Profile(
        regions=regions_p,
        live=live,
        phase=_phases(last),
        resident_bytes=last.resident_bytes,
        tracked_peak=tracked,
        device=str(device),
        allocator_peak=alloc_peak,
        device_offset=offset,
        step_s=statistics.median(walls),
        pack_errors=pack_errors,
        pack_costs=pack_costs,
        config=config,
        diagnostics=diagnostics,
        resident_at_backward=resident_at_bwd,
    )


def _class_errors(
    model: nn.Module,
    step_fn: _StepFn,
    states: list[_regions._RegionState],
    regions_p: tuple[RegionProfile, ...],
    config: ProfileConfig,
    device: torch.device,
    ref_grads: list[torch.Tensor | None],
) -> tuple[dict[tuple[str, str], float], set[tuple[int, tuple[str, int]]]]:
    """Gradient error of packing every candidate of one op class in one format, and
    the ``(region, key)`` of the inputs found held elsewhere (see :class:`_InputWatch`)."""
    errors: dict[tuple[str, str], float] = {}
    held: set[tuple[int, tuple[str, int]]] = set()
    classes = sorted({o.op_class for r in regions_p for o in r.ops if o.formats})
    for cls in classes:
        for fmt in config.formats:
            decisions: dict[int, RegionDecisions] = {}
            any_op = False
            # Inputs are packed only by un-checkpointed regions: their class is measured
            # with every checkpointable region run un-checkpointed.
            mode = "none" if cls == INPUT else "sac"
            for r in regions_p:
                if "sac" not in r.modes:
                    continue
                saves = {o.key: fmt for o in r.ops if o.op_class == cls and fmt in o.formats}
                any_op = any_op or bool(saves)
                decisions[r.index] = RegionDecisions(
                    mode=mode if "none" in r.modes else "sac",
                    saves=saves,
                    min_pack_bytes=config.min_pack_bytes,
                )
            if not any_op:
                continue
            watch = _InputWatch() if cls == INPUT else None
            runner = _decision_runner(decisions, watch)
            for s in states:
                s.runner = runner
            set_grads(model, None)
            _seed_all(config.seed, device)
            _run_step(model, step_fn, None, None if watch is None else watch.check)
            errors[(cls, fmt)] = grad_error(ref_grads, grads_of(model))
            if watch is not None:
                held |= watch.held
    set_grads(model, None)
    return errors, held


def _drop_inputs(
    regions_p: tuple[RegionProfile, ...], held: set[tuple[int, tuple[str, int]]]
) -> tuple[RegionProfile, ...]:
    """``regions_p`` without the input ops in ``held``."""
    if not held:
        return regions_p
    return tuple(
        replace(r, ops=tuple(o for o in r.ops if not (o.is_input and (r.index, o.key) in held)))
        for r in regions_p
    )


def _restrict_formats(
    regions_p: tuple[RegionProfile, ...], errors: dict[tuple[str, str], float], bound: float
) -> tuple[RegionProfile, ...]:
    out = []
    for r in regions_p:
        ops = tuple(
            replace(
                o,
                formats=tuple(
                    f for f in o.formats if errors.get((o.op_class, f), float("inf")) <= bound
                ),
            )
            for o in r.ops
        )
        out.append(replace(r, ops=ops))
    return tuple(out)
