"""``fully_shard``: FSDP2's call shape on RaggedShard + DBuffer, with zero copy-in/copy-out."""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from hyperrec.dbuffer import DBuffer
from hyperrec.parallel5d._api import Granularity, MixedPrecisionPolicy, resolve_granularity
from hyperrec.parallel5d._compat import (
    DataParallelMeshDims,
    OffloadPolicy,
    UnshardHandle,
    check_dtensor_params,
    placement_granularities,
    post_forward_group,
    resolve_mesh,
    resolve_offload,
    resolve_reshard_after_forward,
)
from hyperrec.parallel5d._convert import resync_group
from hyperrec.parallel5d._group import ParamGroup
from hyperrec.parallel5d._state import FSDPState, get_state
from hyperrec.parallel5d._validate import check_bool, check_float, check_int
from hyperrec.raggedshard import enable_local_ops, local_piece

__all__ = ["FSDPModule", "fully_shard", "full_state_dict", "load_full_state_dict", "dbuffers"]

_CLASS_CACHE: dict[type, type] = {}


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised default process group or a mesh")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _as_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if all(hasattr(mp_policy, f) for f in fields):  # torch's FSDP2 policy
        return MixedPrecisionPolicy(**{f: getattr(mp_policy, f) for f in fields})
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")


#: The original parameter objects fully_shard has replaced, by id (weakly held): a later
#: call meeting one of them (a tie across calls) must not shard it a second time.
_SHARDED_ORIGINALS: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()

#: Call sites of fully_shard already warned about foreign ignored_params (once each).
_WARNED_SITES: set[tuple[str, int]] = set()


def _ignored_ids(modules: list[nn.Module], ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor | str) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            f"ignored_params must be a set of parameters, got {type(ignored_params).__name__}"
        )
    ignored = list(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameters, got {type(p).__name__}")
    # FSDP2 ignores parameters the module does not have, and FSDP2 code commonly passes one
    # global set to every nested call, so they are not an error here either. Say so once
    # per call site: a copy of a parameter (or one of another model) in the set would
    # otherwise leave the real one sharded without a word.
    own = {id(p) for m in modules for p in m.parameters()}
    foreign = sum(1 for p in ignored if id(p) not in own)
    if foreign:
        caller = sys._getframe(2)  # fully_shard's caller
        site = (caller.f_code.co_filename, caller.f_lineno)
        if site not in _WARNED_SITES:
            _WARNED_SITES.add(site)
            warnings.warn(
                f"ignored_params holds {foreign} parameter(s) that are not in this module; "
                "fully_shard ignores them (as FSDP2 does)",
                UserWarning,
                stacklevel=3,
            )
    return {id(p) for p in ignored}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    granularity: Granularity = None,
    alignment: int = 64,
) -> Any:
    """Shard ``module``'s parameters (those not already sharded by a nested call).

    Call it bottom-up, like PyTorch FSDP2's ``fully_shard``: each call forms one group
    whose parameters are gathered by one ``all_gather_into_tensor`` per dtype before the
    module's forward and whose gradients are reduce-scattered by one
    ``reduce_scatter_tensor`` per dtype after its backward. The parameters of a group
    live in :class:`hyperrec.dbuffer.DBuffer` s laid out by the raggedshard planner; every
    sharded and unsharded parameter is a view, so there is no copy-in and no copy-out.

    Between iterations the module's parameters are ``nn.Parameter`` DTensors with
    ``RaggedShard`` placements (``(Replicate(), RaggedShard)`` on a 2-D HSDP mesh) whose
    local tensors are views into the shard storage: ``torch.optim`` optimizers whose
    ops DTensor supports on them (SGD, Adam, AdamW, ... and the fused and foreach
    variants; not ``Rprop`` or ``Adafactor``, which fail as under FSDP2) work on them
    unchanged, and ``module.state_dict()`` returns DTensors that
    ``torch.distributed.checkpoint`` saves and loads across world sizes; full state dicts
    load with :func:`load_full_state_dict`.

    Process-global side effect: for the optimizer step above to run shard-locally this
    calls :func:`hyperrec.raggedshard.enable_local_ops`, which installs raggedshard's
    handlers for pointwise, foreach, fused-optimizer and norm ops on ragged DTensors in
    DTensor's op table for the rest of the process. Ops on DTensors without a
    ``RaggedShard`` placement are not affected.

    The first ``fully_shard`` module to run forward becomes the root: it owns the
    communication streams, prefetches the next group's all-gather during a group's
    forward (in the previous iteration's order) and the previous group's during backward,
    and finishes the gradient reductions when backward ends. Gradients are averaged over
    all data-parallel ranks.

    Every argument of PyTorch FSDP2's ``fully_shard`` is accepted with its meaning; the
    README's "differences from FSDP2" table lists where the flat buffer behaves
    differently.

    Args:
        module: the module to shard (in place; its class gains :class:`FSDPModule`), or a
            list of modules sharded as one group (FSDP2's grouped call: their forwards
            form one group forward, e.g. a norm and an output head, or tied weights).
        mesh: 1-D ``DeviceMesh`` (FSDP) or 2-D ``(replicate, shard)`` (HSDP); with
            ``dp_mesh_dims`` any mesh with named dims. Default: all ranks of the default
            process group on CUDA if available, else the CPU.
        reshard_after_forward: ``True``: free the gathered parameters after forward and
            gather them again in backward; ``False``: keep them until after backward;
            ``None`` (default, FSDP2's): ``True`` except for the root module, which
            keeps them; an int ``N`` dividing the shard axis: after forward each rank
            keeps ``1/N`` of the group (one copy out of the gathered buffer) and backward
            gathers over its ``N`` neighbouring ranks only.
        shard_placement_fn: FSDP2's per-parameter placement: ``None`` or ``Shard(d)``,
            here meaning that no rank boundary cuts one ``shape[d+1:]`` sub-tensor
            (``Shard(0)``: ranks hold whole rows); combined with ``granularity``.
        mp_policy: mixed precision; ``None`` = full precision. Torch's
            ``MixedPrecisionPolicy`` is accepted too.
        offload_policy: :class:`CPUOffloadPolicy` keeps sharded parameters, gradients
            and so optimizer states on the host; ``None`` / :class:`OffloadPolicy` (or
            torch's) keeps them on the mesh's device.
        ignored_params: parameters to leave alone (not sharded, not reduced).
        dp_mesh_dims: :class:`DataParallelMeshDims` (or torch's): shard over these named
            dims of ``mesh`` (flattened when several) and replicate over those.
        granularity: block size no shard boundary may cut (see
            :data:`hyperrec.parallel5d.Granularity`): ``"matrix"`` for Muon, an int such as
            2048 for 8-bit Adam blocks. Default element-wise.
        alignment: every parameter starts at a multiple of this many elements in the
            flat buffer (aligned views for fast kernels). Default 64.

    Returns:
        ``module`` (now an :class:`FSDPModule`), or the list of modules passed.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (or a list of them); ``mesh`` not a
            ``DeviceMesh``; bad ``mp_policy``, ``offload_policy``, ``granularity``,
            ``shard_placement_fn``, ``alignment`` or ``reshard_after_forward`` types;
            ``ignored_params`` not an iterable of parameters; a parameter that is not
            floating point (FSDP2 shards those too: ignore it or make it a buffer).
        ValueError: ``module`` is already sharded, or has a parameter tied to one that
            another ``fully_shard`` call sharded (shard the modules sharing it together);
            a bad mesh, granularity, alignment, ``dp_mesh_dims`` or integer
            ``reshard_after_forward``.
        NotImplementedError: an FSDP2 feature the flat buffer cannot provide (see the
            README's table), e.g. parameters that are DTensors sharded over another mesh
            dim, a per-parameter mesh from ``shard_placement_fn``, replicate-only
            ``dp_mesh_dims``.
        RuntimeError: no mesh and no default process group.

    Warns:
        UserWarning: ``ignored_params`` holds parameters that are not in ``module``
            (ignored, as FSDP2 does; once per call site).
    """
    modules = _as_modules(module)
    for m in modules:
        if get_state(m) is not None:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    check_int("alignment", alignment, minimum=1)
    ignored = _ignored_ids(modules, ignored_params)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    mesh = mesh if mesh is not None else _default_mesh()
    mesh = resolve_mesh(mesh, dp_mesh_dims)
    policy = _as_policy(mp_policy)
    offload, pin_memory = resolve_offload(offload_policy)
    shard_size = mesh.size(mesh.ndim - 1)
    reshard, keep, auto = resolve_reshard_after_forward(reshard_after_forward, shard_size)
    # Explicit and documented above: the sharded parameters must step under stock
    # torch.optim optimizers and clip_grad_norm_.
    enable_local_ops()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )

    # Parameters already owned by a nested fully_shard are skipped.
    nested: set[int] = set()
    subtree: list[nn.Module] = []
    seen_modules: set[int] = set()
    for m in modules:
        for sub in m.modules():
            if id(sub) not in seen_modules:
                seen_modules.add(id(sub))
                subtree.append(sub)
    for sub in subtree:
        state = get_state(sub)
        if state is not None and state.group is not None:
            nested.update(id(s.sharded) for s in state.group.slots)
    params: list[nn.Parameter] = []
    fqns: list[str] = []
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    for k, m in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"{k}."
        for name, p in m.named_parameters(remove_duplicate=True):
            if id(p) in ignored or id(p) in nested or id(p) in regs:
                continue
            params.append(p)
            fqns.append(prefix + name)
            regs[id(p)] = []
    for sub in subtree:
        for pname, owned in sub._parameters.items():
            if owned is not None and id(owned) in regs and (sub, pname) not in regs[id(owned)]:
                regs[id(owned)].append((sub, pname))
    for fqn, p in zip(fqns, params):
        if _SHARDED_ORIGINALS.get(id(p)) is p:
            # A parameter tied to one that an earlier call sharded (a module outside that
            # call's subtree still holds the original): sharding it again would make two
            # independent copies and silently untie them (FSDP2 raises at its first forward).
            raise ValueError(
                f"module's parameter {fqn!r} is shared with a parameter already sharded by "
                "another fully_shard call; for shared/tied parameters pass the modules "
                "together, fully_shard([module_a, module_b]), or leave them to their common "
                "parent's call"
            )
        if not p.dtype.is_floating_point:
            # DBuffer holds floating dtypes only; without this its error names no parameter.
            raise TypeError(
                f"module's parameter {fqn!r} has dtype {p.dtype}: fully_shard shards "
                "floating-point parameters only; pass it in ignored_params or register it "
                "as a buffer"
            )
    granularities = [resolve_granularity(granularity, f, p) for f, p in zip(fqns, params)]
    granularities = placement_granularities(shard_placement_fn, params, granularities)
    values = check_dtensor_params(params)
    # Every argument is valid from here on: the module is changed only now.
    # Module buffers (running statistics...) go to the mesh's device, as FSDP2 moves them
    # (parameters are copied into the flat buffers there); nested calls moved theirs.
    for sub in subtree:
        for name, b in list(sub._buffers.items()):
            if b is not None and not b.is_meta and b.device != device:
                sub._buffers[name] = b.to(device)

    group = None
    if params:
        group = ParamGroup(
            values,
            fqns,
            [regs[id(p)] for p in params],
            granularities,
            mesh=mesh,
            device=device,
            mp_policy=policy,
            alignment=alignment,
            reshard_after_forward=reshard,
            post_forward_group=post_forward_group(mesh, keep) if keep else None,
            offload=offload,
            pin_memory=pin_memory,
        )
        for p in params:
            _SHARDED_ORIGINALS[id(p)] = p
        # Slots are ordered by buffer (dtype, then trainable or frozen), not like
        # `params`: match them by name, or frozen and trainable parameters interleaved
        # in one module would swap their requires_grad.
        by_fqn = dict(zip(fqns, params))
        for s in group.slots:
            p = by_fqn[s.fqn]
            s.requires_grad = p.requires_grad
            s.sharded.requires_grad_(p.requires_grad)
    FSDPState(
        tuple(modules),
        group,
        device=device,
        mp_policy=policy,
        auto_reshard_after_forward=auto,
    )
    for m in modules:
        cls = type(m)
        if not issubclass(cls, FSDPModule):
            new_cls = _CLASS_CACHE.get(cls)
            if new_cls is None:
                new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
                _CLASS_CACHE[cls] = new_cls
            m.__class__ = new_cls
    return module


def _as_modules(module: Any) -> list[nn.Module]:
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, list | tuple) and module:
        for i, m in enumerate(module):
            if not isinstance(m, nn.Module):
                raise TypeError(f"module[{i}] must be an nn.Module, got {type(m).__name__}")
        if len({id(m) for m in module}) != len(module):
            raise ValueError("module lists the same module twice")
        return list(module)
    raise TypeError(
        f"module must be an nn.Module or a non-empty list of them, got {type(module).__name__}"
    )


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard` (FSDP2's method names)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of `type(self)` (e.g. slicing nn.Sequential):
        # give them the original class, not an unsharded FSDP wrapper.
        orig: Any = cls.__mro__[2]  # [FSDP<Orig>, FSDPModule, Orig, ...]
        obj = orig.__new__(orig)
        obj.__init__(*args, **kwargs)
        return obj

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise NotImplementedError(
            "copy.deepcopy of a fully_shard module is not supported (as in FSDP2): its "
            "parameters are views of distributed buffers; copy a state_dict instead"
        )

    def _fsdp_state(self) -> FSDPState:
        return _state_of(cast(nn.Module, self))

    def _states(self, recurse: bool) -> Iterator[FSDPState]:
        if not recurse:
            yield self._fsdp_state()
            return
        seen: set[int] = set()
        for m in self.modules():  # type: ignore[attr-defined]
            if (s := get_state(m)) is not None and id(s) not in seen:
                seen.add(id(s))
                yield s

    def _groups(self, recurse: bool = False) -> Iterator[ParamGroup]:
        for s in self._states(recurse):
            if s.group is not None:
                yield s.group

    # ------------------------------------------------------------ gather / free
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now and register them (not recursive).

        Args:
            async_op: ``True`` returns an :class:`UnshardHandle` whose ``wait()`` makes
                the parameters usable (the module's pre-forward also waits); on CUDA the
                gather runs on the all-gather stream meanwhile. ``False`` waits here.
        """
        check_bool("async_op", async_op)
        groups = list(self._groups())
        for group in groups:
            group.unshard()
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the gathered parameters and register the sharded ones (not recursive)."""
        for group in self._groups():
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted forward or backward (call on the root).

        Waits for pending collectives, drops this iteration's unreduced gradients (reduced
        ones stay), reshards every group and clears the per-iteration state, so the next
        iteration runs normally (FSDP2's ``reset_iter_state``).

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        self._fsdp_state().reset_iter_state()

    # ------------------------------------------------------ gradient reduction
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: accumulate unreduced gradients across backward passes (no collective;
        for HSDP neither the reduce-scatter nor the all-reduce).

        Raises:
            TypeError: ``requires_gradient_sync`` or ``recurse`` is not a bool.
        """
        _check_bools(requires_gradient_sync=requires_gradient_sync, recurse=recurse)
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters each backward but keeps the result as a partial
        sum, all-reduced (with the partial added) by the next backward with ``True``.

        Raises:
            TypeError: ``requires_all_reduce`` or ``recurse`` is not a bool.
        """
        # recurse too: a truthy non-bool ("no") would silently recurse.
        _check_bools(requires_all_reduce=requires_all_reduce, recurse=recurse)
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward does not wait for its reductions nor expose the
        gradients (microbatching, e.g. 1F1B); the next backward with ``True`` does."""
        check_bool("is_last_backward", is_last_backward)
        state = self._fsdp_state()
        (state.root or state).is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradient by ``factor`` instead of the number of data-parallel
        ranks (this module's group; FSDP2 semantics, incl. its SUM/AVG choices).

        Raises:
            TypeError / ValueError: ``factor`` is not a positive finite number.
        """
        factor = check_float("factor", factor, minimum=0, exclusive=True)
        for group in self._groups():
            group.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (as in FSDP2)."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Issue only ``SUM`` collectives and divide separately (NCCL zero-copy needs it)."""
        check_bool("enable", enable)
        for group in self._groups():
            group.force_sum = enable

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Call ``hook(reduced)`` on this rank's reduced gradient of the group (flat, reduce
        dtype) after the reduce-scatter (FSDP) or the HSDP all-reduce, before it is added
        to the sharded gradients; ``stream`` (not with HSDP): the CUDA stream it runs on.

        Raises:
            TypeError: ``hook`` is not callable; ``stream`` is neither ``None`` nor a stream.
            ValueError: ``stream`` with an HSDP mesh.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        groups = list(self._groups())
        if stream is not None and any(group.mesh.ndim == 2 for group in groups):
            raise ValueError("stream cannot be set when using native HSDP")
        if stream is not None and not isinstance(stream, _STREAM_TYPES):
            raise TypeError(
                f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        for group in groups:
            group.all_reduce_hook = (hook, stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Use ``comm(output_tensor=, input_tensor=, group=)`` (an FSDP2 ``AllGather``) for
        this group's gathers. Its ``allocate`` is not called: the output is the group's
        persistent flat buffer and the input this rank's slot of it."""
        if not callable(comm):
            raise TypeError(f"comm must be callable, got {type(comm).__name__}")
        for group in self._groups():
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Use ``comm(output_tensor=, input_tensor=, group=, op=)`` (an FSDP2
        ``ReduceScatter``) for this group's reductions (``allocate`` is not called)."""
        if not callable(comm):
            raise TypeError(f"comm must be callable, got {type(comm).__name__}")
        for group in self._groups():
            group.custom_reduce_scatter = comm

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility: the flat buffer always reduces the whole
        group, so unused parameters always get (zero) gradients and every rank issues the
        same collectives.

        Raises:
            TypeError: ``reduce_scatter_unused_params`` or ``recurse`` is not a bool.
        """
        _check_bools(reduce_scatter_unused_params=reduce_scatter_unused_params, recurse=recurse)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility; no effect: one group's gradient buffer is in
        flight at a time (the next group's reduction waits for the previous one so that
        the allocator reuses its block).

        Raises:
            TypeError / ValueError: ``max_input_buffers`` is not an int ``>= 1``;
                ``recurse`` is not a bool (TypeError).
        """
        check_int("max_input_buffers", max_input_buffers, minimum=1)
        check_bool("recurse", recurse)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run reduce-scatters on their own process group over the same ranks (so they can
        overlap all-gathers on the wire); ``False`` goes back to the shared one.
        Collective over the shard ranks the first time.

        Raises:
            TypeError: ``enable`` or ``recurse`` is not a bool.
        """
        _check_bools(enable=enable, recurse=recurse)
        for group in self._groups(recurse):
            group.reduce_scatter_group = separate_group(group.mesh) if enable else None

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not gather this group (its parameters' values are not
        needed to compute gradients, e.g. an embedding)."""
        check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's first gathers of the next forward wait for ``event`` (recorded after
        the optimizer step; discarded once used). ``None`` clears it (as in FSDP2).

        Raises:
            TypeError: ``event`` is neither ``None`` nor a ``torch.Event`` (or
                ``torch.cuda.Event``).
        """
        # Checked here: on the CPU it is never waited for, so a wrong object would pass
        # silently until the same code ran on a GPU.
        if event is not None and not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"event must be a torch.Event or None, got {type(event).__name__}")
        state = self._fsdp_state()
        (state.root or state).post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not supported with ``enable=True``: the collectives' buffers are the group's
        persistent flat storages (no staging buffers), allocated once by the caching
        allocator; re-allocating them from the process group per collective would
        give up the zero-copy views.

        Raises:
            NotImplementedError: ``enable=True``.
        """
        check_bool("enable", enable)
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): the flat buffers are "
                "the collectives' inputs and outputs (no staging buffers to allocate from the "
                "process group); not supported"
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: symmetric-memory allocation of the flat storages is not
        implemented (they come from the caching allocator).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "set_symm_mem_for_comm: allocating the DBuffer storages in symmetric memory is not "
            f"implemented (backend {backend!r})"
        )

    # --------------------------------------------------------- resharding
    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Change ``reshard_after_forward`` (a bool, as in FSDP2; see :func:`fully_shard`),
        e.g. ``True`` for the root (which ``None`` makes keep its parameters).

        Raises:
            TypeError: ``reshard_after_forward`` or ``recurse`` is not a bool.
        """
        _check_bools(reshard_after_forward=reshard_after_forward, recurse=recurse)
        for s in self._states(recurse):
            s.auto_reshard_after_forward = False
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward
                s.group.post_forward_group = None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False``: keep parameters gathered after backward (e.g. between accumulation steps).

        Raises:
            TypeError: ``reshard_after_backward`` or ``recurse`` is not a bool.
        """
        _check_bools(reshard_after_backward=reshard_after_backward, recurse=recurse)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's forward starts.

        Raises:
            TypeError: ``modules`` is not a list of modules.
            ValueError: a module in ``modules`` is not a ``fully_shard`` module.
        """
        self._fsdp_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's backward starts.

        Raises:
            TypeError: ``modules`` is not a list of modules.
            ValueError: a module in ``modules`` is not a ``fully_shard`` module.
        """
        self._fsdp_state().backward_prefetch = _states_of(modules)

    @property
    def dbuffers(self) -> list[DBuffer]:
        """The DBuffers of this module's own group (one per parameter dtype)."""
        group = self._fsdp_state().group
        return [] if group is None else list(group.buffers)

    # ------------------------------------------------------------- conversion
    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # model.to(dtype) / .half() / to_empty(device=): nn.Module replaces the sharded
        # parameters' contents; rebuild the group's buffers around the new values so that
        # forward gathers what the parameters report (FSDP2 supports this too).
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        if group is not None:
            resync_group(group)
        return out


_SEPARATE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
# What set_post_optim_event / set_all_reduce_hook accept (torch.cuda's classes derive from
# these generic ones where torch has them).
_EVENT_TYPES: tuple[type, ...] = tuple(
    t for t in (getattr(torch, "Event", None), torch.cuda.Event) if isinstance(t, type)
)
_STREAM_TYPES: tuple[type, ...] = tuple(
    t for t in (getattr(torch, "Stream", None), torch.cuda.Stream) if isinstance(t, type)
)


def separate_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    ranks = tuple(dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)))
    if ranks not in _SEPARATE_GROUPS:
        _SEPARATE_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _SEPARATE_GROUPS[ranks]


def _check_bools(**flags: Any) -> None:
    for name, v in flags.items():
        check_bool(name, v)


def _state_of(module: nn.Module) -> FSDPState:
    state = get_state(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard module")
    return state


def _states_of(modules: Any) -> list[FSDPState]:
    # Every entry is checked before the prefetch list is replaced.
    if isinstance(modules, nn.Module | str) or not isinstance(modules, Sequence):
        raise TypeError(f"modules must be a list of fully_shard modules, got {type(modules)}")
    states = []
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"modules[{i}] must be an nn.Module, got {type(m).__name__}")
        state = get_state(m)
        if state is None:
            raise ValueError(f"modules[{i}] ({type(m).__name__}) is not a fully_shard module")
        states.append(state)
    return states


def _check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")


def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    broadcast_from_rank0: bool = False,
    strict: bool = True,
) -> None:
    """Load full (unsharded) values into a ``fully_shard`` model: each rank copies its own
    rows of every parameter into its shard (the master values), and buffers whole.

    What ``set_model_state_dict(..., StateDictOptions(full_state_dict=True))`` does for
    FSDP2; torch's version cannot cut a ``RaggedShard`` parameter (it takes the unknown
    placement as replicated and fails on the first parameter split across ranks), so use
    this one here. Keys are ``module.state_dict()``'s (a tied parameter under any of its
    names); values any float dtype, cast to each parameter's dtype.

    Args:
        module: a model sharded with :func:`fully_shard` (parameters left out of it
            load as plain tensors).
        state_dict: FQN -> full tensor. With ``broadcast_from_rank0`` only rank 0's is
            read (other ranks may pass ``{}``).
        broadcast_from_rank0: rank 0 sends every value to all ranks (collective: every
            rank of the default group calls it with the same module structure).
        strict: missing or unexpected keys are an error (as in ``load_state_dict``).

    Raises:
        TypeError: ``module`` not an ``nn.Module``; a value not a tensor.
        ValueError: missing/unexpected keys (``strict``) or a value whose shape differs
            from the parameter's; with ``broadcast_from_rank0`` rank 0 checks and every
            rank raises the same error before any value is sent.
    """
    _check_module(module)
    check_bool("broadcast_from_rank0", broadcast_from_rank0)
    check_bool("strict", strict)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    targets: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_id: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    for name, t in named:
        if t is None:
            continue
        first = by_id.setdefault(id(t), name)
        aliases[name] = first
        targets.setdefault(first, t)
    sender = not broadcast_from_rank0 or dist.get_rank() == 0
    error = ""
    # one source name per distinct tensor (a tied parameter may come under any name)
    source: dict[str, str] = {}
    if sender:
        error = _full_state_dict_error(state_dict, targets, aliases, strict)
        for name, first in aliases.items():
            if name in state_dict:
                source.setdefault(first, name)
    if broadcast_from_rank0:  # rank 0's verdict and keys, in one collective
        box: list[Any] = [(error, source)]
        dist.broadcast_object_list(box, src=0)
        error, source = box[0]
    if error:
        raise ValueError(error)
    for first, t in targets.items():
        if first not in source:
            continue
        value = _full_value(t, state_dict.get(source[first]) if sender else None,
                            broadcast_from_rank0)  # fmt: skip
        with torch.no_grad():
            if isinstance(t, DTensor):
                piece = local_piece(value, t)
                if piece is None:  # not a single ragged placement: replicated dims only
                    raise ValueError(f"{first}: cannot place a full value on {t.placements}")
                t._local_tensor.copy_(piece)
            else:
                t.copy_(value)


def _full_state_dict_error(
    state_dict: Mapping[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    aliases: dict[str, str],
    strict: bool,
) -> str:
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            return f"state_dict[{k!r}] must be a tensor, got {type(v).__name__}"
    if strict:
        covered = {aliases[k] for k in state_dict if k in aliases}
        missing = sorted(k for k in targets if k not in covered)
        unexpected = sorted(k for k in state_dict if k not in aliases)
        if missing or unexpected:
            return f"state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
    for k, v in state_dict.items():
        if k in aliases and tuple(v.shape) != tuple(targets[aliases[k]].shape):
            return (f"state_dict[{k!r}] has shape {tuple(v.shape)}, the model's is "
                    f"{tuple(targets[aliases[k]].shape)}")  # fmt: skip
    return ""


def _full_value(t: torch.Tensor, value: torch.Tensor | None, broadcast: bool) -> torch.Tensor:
    """``t``'s full value: ``value`` itself, or rank 0's broadcast to every rank (sent
    on the default group, on the device its backend uses)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if not broadcast:
        assert value is not None
        return value.detach().to(device=local.device, dtype=local.dtype)
    device = local.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if value is not None:
        buf = value.detach().to(device=device, dtype=local.dtype).contiguous()
    else:
        buf = torch.empty(tuple(t.shape), dtype=local.dtype, device=device)
    dist.broadcast(buf, src=0)
    return buf.to(local.device)


def dbuffers(module: nn.Module) -> list[DBuffer]:
    """Every DBuffer of every ``fully_shard`` module in ``module``'s tree, in module order.

    Use with :func:`hyperrec.dbuffer.flat_params` for fused single-kernel optimizer
    steps, or :func:`hyperrec.dbuffer.clip_grad_norm_`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    _check_module(module)
    out, seen = [], set()
    for m in module.modules():
        state = get_state(m)
        # A grouped fully_shard([a, b]) shares one state between its modules.
        if state is not None and state.group is not None and id(state) not in seen:
            seen.add(id(state))
            out.extend(state.group.buffers)
    return out


def full_state_dict(
    module: nn.Module, *, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every parameter's full value in its master dtype, keyed by FQN (one all-gather per
    buffer). Collective: call it on every rank. Parameters left out of ``fully_shard``
    (``ignored_params``) are included as they are; module buffers are not.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``device`` is not a device.
        ValueError: ``device`` names an unknown device type.
    """
    _check_module(module)
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        err = ValueError if isinstance(device, str) else TypeError
        raise err(f"device must be a torch.device or a device string, got {device!r}") from e
    out: dict[str, torch.Tensor] = {}
    prefixes = {id(m): n for n, m in module.named_modules()}
    seen: set[int] = set()
    for m in module.modules():
        state = get_state(m)
        if state is None or state.group is None or id(state) in seen:
            continue
        seen.add(id(state))
        gathered = [buf.gather_full() for buf in state.group.buffers]
        for s in state.group.slots:
            # Named after the modules that register it (grouped calls span modules; a
            # tied parameter has several names, as in ``state_dict()``).
            regs = [r for r in s.registrations if id(r[0]) in prefixes] or s.registrations[:1]
            value = gathered[s.buffer][s.index].to(device)
            for owner, pname in regs:
                prefix = prefixes.get(id(owner), "")
                out[f"{prefix}.{pname}" if prefix else pname] = value
    for name, p in module.named_parameters():
        if name not in out and not hasattr(p, "placements"):
            out[name] = p.detach().to(device)
    return out
