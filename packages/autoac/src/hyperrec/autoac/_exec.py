"""How one call of a region runs under a decision set (eager and traced).

Decisions are keyed by ``(op name, occurrence)``: the k-th call of an op overload in
the region's forward, counting the ops a selective-checkpoint policy sees (everything
but ``SAC_IGNORED_OPS``). Keys survive changes of tensor sizes (jagged batches) and,
under ``torch.compile``, the insertion or removal of other ops.

Safety rules, applied here whatever a plan says:

* collectives (c10d ops) are always saved, never replayed;
* the recomputation leaves module state as it found it: buffers the region's forward
  wrote (batch norm's running statistics and batch counter, spectral norm's power
  iteration) are put back after a recomputation writes them again, so a checkpointed
  step updates them once, like an un-checkpointed one (``torch.utils.checkpoint``
  updates them twice). Buffers of modules outside the region module (a :class:`Span`
  closing over another module) are not covered;
* ops that draw random numbers are always recomputed, and checkpoints always restore
  the RNG state before recomputation (``preserve_rng_state=True``): every random op of
  the region is replayed in order from the same generator state, so dropout masks are
  the same as in the forward. Saving *one* random op would shift the generator for the
  ones after it.
  A random op that draws from an explicit ``torch.Generator`` (``generator=g``)
  cannot be replayed (a checkpoint restores only the default generators): it raises
  ``NotImplementedError`` in a checkpointed region, and the profiler leaves such
  regions un-checkpointed.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import PyTree, tree_leaves, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hyperrec.autoac.formats import SAVE_FORMATS, PackedStorage, can_pack, pack_storage
from hyperrec.autoac.tracker import is_collective, is_random

__all__ = ["RegionDecisions", "keep_module_state", "run_region"]

SAC_IGNORED_OPS = getattr(
    torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}
)

# The RNG guard (see module docstring). Only tests switch it off, to show what it
# protects against.
_RNG_GUARD = True


_NAMES: dict[Any, str] = {}


#: The op name of a region's inputs in decision keys: ``(INPUT, k)`` is the ``k``-th
#: distinct storage among the tensor arguments of the call (see :func:`input_storages`).
#: Only an un-checkpointed region packs its inputs (a checkpoint holds them as given).
INPUT = "<input>"


def input_storages(tree: PyTree) -> list[torch.Tensor]:
    """One tensor per distinct storage among the tensor leaves of ``tree``, in order
    (the numbering of :data:`INPUT` decision keys)."""
    seen: set[int] = set()
    out = []
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                out.append(x)
    return out


def op_name(func: Any) -> str:
    """Stable name of an op overload, e.g. ``"aten.mm.default"`` (cached: the policy
    asks for every op of every checkpointed region)."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


@dataclass(frozen=True)
class RegionDecisions:
    """What one region does with each op output.

    Attributes:
        mode: ``"sac"`` (checkpoint with a selective policy), ``"none"`` (no
            checkpoint; saved tensors may be packed) or ``"partitioner"`` (no
            checkpoint of autoac's: compiled, AOTAutograd's partitioner chooses what to
            recompute within ``activation_memory_budget = fraction``; eagerly it runs as
            ``"none"``).
        saves: ``(op name, occurrence) -> decision`` for ops that are not at the mode's
            default: ``"keep"`` or a :data:`~hyperrec.autoac.formats.SaveFormat`. The
            default is ``"recompute"`` under ``"sac"`` and ``"keep"`` under ``"none"``.
        min_pack_bytes: storages smaller than this are kept, never packed.
        fraction: the partitioner's budget of a ``"partitioner"`` region, else ``None``.
    """

    mode: str
    saves: Mapping[tuple[str, int], str] = field(default_factory=dict)
    min_pack_bytes: int = 0
    fraction: float | None = None

    @property
    def quantized(self) -> bool:
        """Whether any decision packs a saved tensor."""
        return any(d in SAVE_FORMATS for d in self.saves.values())


class _Counter:
    def __init__(self) -> None:
        self.n: dict[Any, int] = defaultdict(int)

    def key(self, func: Any) -> tuple[str, int]:
        k = self.n[func]
        self.n[func] = k + 1
        return (op_name(func), k)


def explicit_generator(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a random op draws from a ``torch.Generator`` passed to it
    (``generator=g``), which a checkpoint cannot restore."""
    passed = isinstance(kwargs.get("generator"), torch.Generator) or any(
        isinstance(a, torch.Generator) for a in args
    )
    return passed and is_random(func, args, kwargs)


def _check_replayable(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise for an op of a checkpointed region's forward that cannot be replayed."""
    if _RNG_GUARD and explicit_generator(func, args, kwargs):
        raise NotImplementedError(
            f"autoac: {op_name(func)} draws from an explicit torch.Generator "
            "(generator=...) inside a checkpointed region: a checkpoint restores only "
            "the default generators, so the recomputation would draw other numbers "
            "(wrong gradients) and advance the generator a second time; leave this "
            "region un-checkpointed (mode 'none', which autoac.profile chooses for "
            "such regions) or draw from the default generator"
        )


_MUTABLE: dict[Any, bool] = {}


def _mutates_input(func: Any) -> bool:
    """Whether an op writes into an argument (``add_``, ``relu_``, ``out=`` variants)."""
    m = _MUTABLE.get(func)
    if m is None:
        schema = getattr(func, "_schema", None)
        m = _MUTABLE[func] = bool(getattr(schema, "is_mutable", False))
    return m


def _policy(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], decision: str | None
) -> CheckpointPolicy:
    if is_collective(func):
        return CheckpointPolicy.MUST_SAVE
    if _RNG_GUARD and is_random(func, args, kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE
    if decision is not None and _mutates_input(func):
        # Its saved output would be returned instead of writing into the recomputed
        # input, which the forward goes on using: in-place ops are always replayed (a
        # plan never names them: they allocate nothing).
        return CheckpointPolicy.MUST_RECOMPUTE
    if decision is not None and decision != "recompute":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _sac_contexts(
    saves: tuple[str, ...],
    on_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None,
) -> tuple[Any, Any]:
    decisions = dict(_decode_save(s) for s in saves)
    fwd, rc = _Counter(), _Counter()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # Older torch versions also ask the policy during recomputation; answer the same.
        counter = rc if getattr(ctx, "is_recompute", False) else fwd
        key = counter.key(func)
        if counter is fwd:
            if on_op is not None:
                on_op(func, args, kwargs)
            else:  # the profiler (on_op) finds the regions that cannot be checkpointed
                _check_replayable(func, args, kwargs)
        return _policy(func, args, kwargs, decisions.get(key))

    return create_selective_checkpoint_contexts(policy)


def sac_context_fn(
    decisions: RegionDecisions,
    on_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint``: torch's selective checkpointing, our policy.

    It is a ``functools.partial`` over the decisions as a tuple of strings: Dynamo
    guards on them as constants, so two regions with the same code but different
    decisions get different compiled graphs (and regions with equal decisions share
    one). Strings, not ``(op, index)`` tuples: under ``torch.compile(dynamic=True)``
    Dynamo makes the indices symbolic ints, the tuple is then no constant, and the
    checkpoint falls back to an eager call (a graph break that also kept packed saves
    from being traced into the graph).
    ``on_op(func, args, kwargs)`` is called for every op the policy sees in the forward
    (the profiler uses it to number ops); with it, a random op drawing from an explicit
    generator is not an error (the profiler leaves its region un-checkpointed).
    """
    saves = tuple(sorted(f"{op}|{i}|{f}" for (op, i), f in decisions.saves.items()))
    return functools.partial(_sac_contexts, saves, on_op)


def _decode_save(text: str) -> tuple[tuple[str, int], str]:
    op, i, f = text.rsplit("|", 2)
    return (op, int(i)), f


def _detach(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


@dataclass
class _Kept:
    """A kept (unpacked) output and its version when it was saved: like torch's own
    selective checkpointing, a kept tensor that was mutated in place before the
    recomputation reads it is an error, not silently different data."""

    tensor: torch.Tensor
    version: int


def _keep(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return _Kept(_detach(x), x._version)


@dataclass
class _PackedView:
    packed: PackedStorage
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt


def _pack_output(x: Any, fmt: str, min_bytes: int) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    st = x.untyped_storage()
    numel = st.nbytes() // max(x.element_size(), 1)
    if st.nbytes() < max(min_bytes, 1) or not can_pack(x.dtype, numel, fmt):
        return _keep(x)
    return _PackedView(pack_storage(x, fmt), x.size(), x.stride(), x.storage_offset())


def _unpack_output(x: Any) -> Any:
    if isinstance(x, _PackedView):
        return x.packed.dequantize().as_strided(x.size, x.stride, x.offset)
    if isinstance(x, _Kept):
        if x.tensor._version != x.version:
            raise RuntimeError(
                "autoac: a tensor kept for the recomputation of a checkpointed region was "
                "mutated in place after it was saved (as torch's selective checkpointing "
                "reports it: 'Tensor cached during selective activation checkpoint has "
                "been mutated'); recompute that op instead of keeping it"
            )
        return x.tensor
    return x


_RECOMPUTE = object()
_CONSUMED = object()

#: ``(op name, occurrence)`` -> the op's saved outputs (a pytree whose tensors may be
#: :class:`_PackedView`), or ``_RECOMPUTE``.
_SavedOutputs = dict[tuple[str, int], PyTree]


class _PackingMode(TorchDispatchMode):
    """Forward half of selective checkpointing with packed saves."""

    def __init__(self, decisions: RegionDecisions, storage: _SavedOutputs) -> None:
        super().__init__()
        self.decisions = decisions
        self.storage = storage
        self.counter = _Counter()

    def __torch_dispatch__(
        self,
        func: OpOverload[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        key = self.counter.key(func)
        decision = self.decisions.saves.get(key)
        _check_replayable(func, args, kwargs)
        if _policy(func, args, kwargs, decision) is CheckpointPolicy.MUST_SAVE:
            if decision in SAVE_FORMATS and not is_collective(func):
                with torch.no_grad():
                    entry = tree_map(
                        lambda x: _pack_output(x, decision, self.decisions.min_pack_bytes), out
                    )
            else:
                entry = tree_map(_keep, out)
            self.storage[key] = entry
        else:
            self.storage[key] = _RECOMPUTE
        return out


class _UnpackingMode(TorchDispatchMode):
    """Recompute half: replays ops, returning saved (dequantized) outputs instead."""

    def __init__(self, storage: _SavedOutputs) -> None:
        super().__init__()
        self.storage = storage
        self.counter = _Counter()

    def __enter__(self) -> Any:
        # Each recomputation numbers the ops from the start (a second one, from a second
        # backward through the region, used to continue the first one's count).
        self.counter = _Counter()
        return super().__enter__()

    def __torch_dispatch__(
        self,
        func: OpOverload[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        key = self.counter.key(func)
        entry = self.storage.get(key)
        if entry is None:
            raise RuntimeError(
                f"autoac: {key[0]} call {key[1]} was not seen in the forward of this region; "
                "the region must run the same ops in its forward and its recomputation"
            )
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        if entry is _CONSUMED:
            raise NotImplementedError(
                "autoac: a second backward through a checkpointed region with packed saves "
                "(retain_graph=True, create_graph=True, or separate backward calls for its "
                "outputs) is not supported: the first recomputation released them (torch's "
                "selective checkpointing raises 'Trying to backward an extra time' for kept "
                "ones); plain recomputation and un-checkpointed regions support it"
            )
        self.storage[key] = _CONSUMED  # released as the recomputation goes
        with torch.no_grad():
            return tree_map(_unpack_output, entry)


def packing_context_fn(decisions: RegionDecisions) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint`` that keeps some outputs packed (eager only)."""

    def context_fn() -> tuple[Any, Any]:
        storage: _SavedOutputs = {}
        return _PackingMode(decisions, storage), _UnpackingMode(storage)

    return context_fn


#: storage key -> (the storage, the format its packed copy uses)
_Marks = dict[int, tuple[weakref.ref[torch.UntypedStorage], str]]


class _StorageMarker(TorchDispatchMode):
    """Remember which storages the ops to pack created (for saved-tensor hooks)."""

    def __init__(self, decisions: RegionDecisions, marks: _Marks) -> None:
        super().__init__()
        self.decisions = decisions
        self.marks = marks
        self.counter = _Counter()
        # > 0 while a pack hook quantizes: the quantizer's own ops are not the region's
        # (counted, they shifted the occurrence numbers of every op after the first pack,
        # so later decisions landed on the wrong tensors)
        self.paused = 0

    def __torch_dispatch__(
        self,
        func: OpOverload[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS or self.paused:
            return out
        decision = self.decisions.saves.get(self.counter.key(func))
        if decision in SAVE_FORMATS:
            for x in tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    self.marks[st._cdata] = (weakref.ref(st), decision)
        return out


def _run_none_packed(
    decisions: RegionDecisions,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    marks: _Marks = {}
    marker = _StorageMarker(decisions, marks)
    # storage key -> (the storage, its packed copy, the version it was packed at); weak:
    # a key may be reused by a new storage once the old one is freed, so the storage
    # itself is compared, and a copy made before an in-place write is not reused.
    packed: dict[
        int, tuple[weakref.ref[torch.UntypedStorage], weakref.ref[PackedStorage], int]
    ] = {}

    def pack(t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st._cdata
        mark = marks.get(key)
        if mark is None or mark[0]() is not st:
            return t
        fmt = mark[1]
        numel = st.nbytes() // t.element_size()
        if st.nbytes() < max(decisions.min_pack_bytes, 1) or not can_pack(t.dtype, numel, fmt):
            return t
        entry = packed.get(key)
        p = None
        if entry is not None and entry[0]() is st and entry[2] == t._version:
            p = entry[1]()
        if p is None:
            marker.paused += 1
            try:
                p = pack_storage(t, fmt)
            finally:
                marker.paused -= 1
            packed[key] = (weakref.ref(st), weakref.ref(p), t._version)
        return _PackedView(p, t.size(), t.stride(), t.storage_offset())

    def unpack(x: Any) -> Any:
        if not isinstance(x, _PackedView):
            return x
        with torch.no_grad():
            full = x.packed.dequantize_shared()
        return full.as_strided(x.size, x.stride, x.offset)

    for k, t in enumerate(input_storages((args, kwargs))):
        decision = decisions.saves.get((INPUT, k))
        if decision in SAVE_FORMATS:  # the pack hook checks size and dtype
            st = t.untyped_storage()
            marks[st._cdata] = (weakref.ref(st), decision)
    with saved_tensors_hooks(pack, unpack), marker:
        return fn(*args, **kwargs)


def run_region(
    decisions: RegionDecisions,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    traced: bool = False,
) -> Any:
    """Run one call of a region under ``decisions``.

    Args:
        decisions: the region's decisions.
        fn: the region's original forward.
        traced: running under ``torch.compile``: only keep/recompute decisions (torch's
            selective-checkpoint contexts, which the compiler understands).
    """
    if decisions.mode == "partitioner":
        return fn(*args, **kwargs)
    if decisions.mode == "none":
        if decisions.quantized and torch.is_grad_enabled() and not traced:
            return _run_none_packed(decisions, _eagerly(fn), args, kwargs)
        return fn(*args, **kwargs)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if decisions.quantized and not traced:
        ctx = packing_context_fn(decisions)
    else:
        ctx = sac_context_fn(decisions)
    if not traced:
        # Under torch.compile the compiler applies buffer writes once, outside the
        # recomputed graph.
        fn = keep_module_state(fn)
    if decisions.quantized and not traced:
        fn = _eagerly(fn)  # after keep_module_state, which looks for a bound method
    return checkpoint(
        bind_kwargs(fn, kwargs),
        *args,
        use_reentrant=False,
        context_fn=ctx,
        preserve_rng_state=_RNG_GUARD,
    )


def no_compile() -> contextlib.AbstractContextManager[Any]:
    """Run ``torch.compile``'d functions eagerly inside the block (torch >= 2.6's
    ``set_stance("force_eager")``; nothing on older torch).

    Profiling runs the model under a dispatch-mode tracker, inside checkpoints, in
    timing loops: compiled regions of the model would compile a variant for each of
    these contexts. Each variant counts against Dynamo's recompile limit, past which a
    function runs eagerly for the rest of the process; the training steps after
    profiling would pay for it. Under a dispatch mode Dynamo does not compile at all and
    skips the frame for good; ``force_eager`` does not mark frames skipped.
    """
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the model's compiled functions run eagerly (forward and recomputation).

    Packed saves run the region under autoac's dispatch modes; Dynamo does not compile a
    frame first called under a dispatch mode and then skips it for good, so a compiled
    function of the model called there would run eagerly in *every* region from then on.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with no_compile():
            return fn(*args, **kwargs)

    return run


def bind_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with the region's keyword arguments bound, for ``checkpoint``.

    ``checkpoint`` takes keyword arguments of its own (``debug``, ``early_stop``,
    ``determinism_check``, ``context_fn``, ...) and passes only the rest on: a region
    whose forward has a keyword argument of one of those names lost it (the forward ran
    with its default, silently) or made ``checkpoint`` raise. The non-reentrant
    checkpoint handles tensors a function closes over like its arguments.
    """
    return functools.partial(fn, **kwargs) if kwargs else fn


def keep_module_state(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a region module's bound ``forward``) for ``checkpoint``, made per call of
    the region: its first call is the forward; on a later call (a recomputation) every
    buffer of the module holds the values it had when the forward *started* while the
    recomputation runs, and is put back afterwards to the tensor and values it had
    before the recomputation, without bumping version counters (autograd nodes of the
    recomputation saved them at the current version). So the recomputation computes
    what the forward computed even where the forward reads a buffer it then updates
    (spectral norm's power iteration, running feature normalisation), and the step
    updates the buffers once. The cost: one copy of the region's buffers held from the
    forward to its recomputation, and one more per recomputation. Other callables are
    returned as they are."""
    module = getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return fn
    calls = [0]
    # buffers as the forward found them (module, name, values)
    start: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # traced: the compiler applies the buffer writes once, outside the
            # recomputed graph (if the checkpoint graph-breaks, it calls ``run`` eagerly
            # and the bookkeeping below applies)
            return fn(*args, **kwargs)
        calls[0] += 1
        # Outside the dispatch modes: the checkpoint's own (selective caching) and the
        # profiler's must not see these copies as ops of the region.
        if calls[0] == 1:
            with _disable_current_modes(), torch.no_grad():
                start[:] = [(m, n, b.detach().clone()) for m, n, b in _named_buffers(module)]
            return fn(*args, **kwargs)
        # A recomputation: run it on the buffers as the forward found them (it read
        # them before any update it made: recomputing on the updated ones gave other
        # values, silently wrong gradients), then put every buffer back as the forward
        # left it. All of them, by name and value: forwards also write buffers through
        # ``.data``, by re-assigning them or inside kernels (batch norm), none of which
        # moves a version counter.
        with _disable_current_modes(), torch.no_grad():
            snapshot = [(m, n, b, b.detach().clone()) for m, n, b in _named_buffers(module)]
            for m, n, old in start:
                cur = m._buffers.get(n)
                if (
                    isinstance(cur, torch.Tensor)
                    and cur.shape == old.shape
                    and cur.dtype == old.dtype
                    and cur.device == old.device
                ):
                    cur.data.copy_(old)  # through .data: no version bump
                else:
                    m._buffers[n] = old.clone()
        try:
            return fn(*args, **kwargs)
        finally:
            with _disable_current_modes(), torch.no_grad():
                for m, n, b, old in snapshot:
                    if m._buffers.get(n) is not b:  # re-assigned by the recomputation
                        m._buffers[n] = b
                    b.data.copy_(old)  # through .data: no version bump

    return run


def _named_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    return [
        (m, n, b)
        for m in module.modules()
        for n, b in m._buffers.items()
        if isinstance(b, torch.Tensor)
    ]
