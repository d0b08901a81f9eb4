"""``fully_shard``: FSDP2's call shape on RaggedShard + DBuffer, with zero copy-in/copy-out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyperrec.dbuffer import DBuffer
from hyperrec.parallel5d._api import Granularity, MixedPrecisionPolicy, resolve_granularity
from hyperrec.parallel5d._group import ParamGroup
from hyperrec.parallel5d._state import FSDPState, get_state
from hyperrec.parallel5d._validate import check_bool, check_int
from hyperrec.raggedshard import enable_local_ops

__all__ = ["FSDPModule", "fully_shard", "full_state_dict", "dbuffers"]

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


def _ignored_ids(module: nn.Module, ignored_params: Any) -> set[int]:
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
    # A parameter the module does not have is almost always a mistake (a copy, or a
    # parameter of another model): ignoring it silently would shard what was meant to stay.
    own = {id(p) for p in module.parameters()}
    foreign = [tuple(p.shape) for p in ignored if id(p) not in own]
    if foreign:
        raise ValueError(
            f"ignored_params holds {len(foreign)} parameter(s) that are not parameters of the "
            f"module (shapes {foreign}); pass each fully_shard call only the parameter "
            "objects of the module it shards"
        )
    return {id(p) for p in ignored}


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    granularity: Granularity = None,
    ignored_params: set[nn.Parameter] | None = None,
    alignment: int = 64,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already sharded by a nested call).

    Call it bottom-up, like PyTorch FSDP2's ``fully_shard``: each call forms one group
    whose parameters are gathered by one ``all_gather_into_tensor`` per dtype before the
    module's forward and whose gradients are reduce-scattered by one
    ``reduce_scatter_tensor`` per dtype after its backward. The parameters of a group
    live in :class:`hyperrec.dbuffer.DBuffer` s laid out by the raggedshard planner; every
    sharded and unsharded parameter is a view, so there is no copy-in and no copy-out.

    Between iterations the module's parameters are ``nn.Parameter`` DTensors with
    ``RaggedShard`` placements (``(Replicate(), RaggedShard)`` on a 2-D HSDP mesh) whose
    local tensors are views into the shard storage: any ``torch.optim`` optimizer works on
    them unchanged, and ``module.state_dict()`` returns DTensors that
    ``torch.distributed.checkpoint`` saves and loads across world sizes.

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

    Args:
        module: the module to shard (in place; its class gains :class:`FSDPModule`).
        mesh: 1-D ``DeviceMesh`` (FSDP) or 2-D ``(replicate, shard)`` (HSDP). Default: all
            ranks of the default process group on CUDA if available, else the CPU.
        reshard_after_forward: free the gathered parameters after forward and gather them
            again in backward (``True``, default), or keep them until after backward.
        mp_policy: mixed precision; ``None`` = full precision. Torch's
            ``MixedPrecisionPolicy`` is accepted too.
        granularity: block size no shard boundary may cut (see
            :data:`hyperrec.parallel5d.Granularity`): ``"matrix"`` for Muon, an int such as
            2048 for 8-bit Adam blocks. Default element-wise.
        ignored_params: parameters to leave alone (not sharded, not reduced).
        alignment: every parameter starts at a multiple of this many elements in the
            flat buffer (aligned views for fast kernels). Default 64.

    Returns:
        ``module``, now an instance of :class:`FSDPModule`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``mesh`` not a ``DeviceMesh``;
            bad ``mp_policy``, ``granularity``, ``alignment`` or ``reshard_after_forward``
            types; ``ignored_params`` not an iterable of parameters.
        ValueError: ``module`` is already sharded; a mesh of more than 2 axes; a bad
            granularity or alignment; ``ignored_params`` holding a parameter that is not
            ``module``'s.
        RuntimeError: no mesh and no default process group.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if get_state(module) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    check_bool("reshard_after_forward", reshard_after_forward)
    check_int("alignment", alignment, minimum=1)
    ignored = _ignored_ids(module, ignored_params)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh must be a 1-D (FSDP) or 2-D (replicate, shard) DeviceMesh, got {mesh.ndim} axes"
        )
    policy = _as_policy(mp_policy)
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
    for sub in module.modules():
        state = get_state(sub)
        if state is not None and state.group is not None:
            nested.update(id(s.sharded) for s in state.group.slots)

    params: list[nn.Parameter] = []
    fqns: list[str] = []
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        if id(p) in ignored or id(p) in nested:
            continue
        params.append(p)
        fqns.append(name)
        regs[id(p)] = []
    for sub in module.modules():
        for pname, owned in sub._parameters.items():
            if owned is not None and id(owned) in regs and (sub, pname) not in regs[id(owned)]:
                regs[id(owned)].append((sub, pname))
    granularities = [resolve_granularity(granularity, f, p) for f, p in zip(fqns, params)]

    group = None
    if params:
        group = ParamGroup(
            params,
            fqns,
            [regs[id(p)] for p in params],
            granularities,
            mesh=mesh,
            device=device,
            mp_policy=policy,
            alignment=alignment,
            reshard_after_forward=reshard_after_forward,
        )
    FSDPState(module, group, device=device, mp_policy=policy)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        module.__class__ = new_cls
    return module


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard` (FSDP2's method names)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of `type(self)` (e.g. slicing nn.Sequential):
        # give them the original class, not an unsharded FSDP wrapper.
        orig: Any = cls.__mro__[2]  # [FSDP<Orig>, FSDPModule, Orig, ...]
        obj = orig.__new__(orig)
        obj.__init__(*args, **kwargs)
        return obj

    def _fsdp_state(self) -> FSDPState:
        return _state_of(cast(nn.Module, self))

    def _states(self, recurse: bool) -> Iterator[FSDPState]:
        if not recurse:
            yield self._fsdp_state()
            return
        for m in self.modules():  # type: ignore[attr-defined]
            if (s := get_state(m)) is not None:
                yield s

    def unshard(self) -> None:
        """All-gather this module's parameters now and register them (not recursive)."""
        group = self._fsdp_state().group
        if group is not None:
            group.unshard()
            group.wait_for_unshard()

    def reshard(self) -> None:
        """Free the gathered parameters and register the sharded ones (not recursive)."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: accumulate unreduced gradients across backward passes (no collective).

        Raises:
            TypeError: ``requires_gradient_sync`` or ``recurse`` is not a bool.
        """
        _check_bools(requires_gradient_sync=requires_gradient_sync, recurse=recurse)
        for s in self._states(recurse):
            if s.group is not None:
                s.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Change ``reshard_after_forward`` (see :func:`fully_shard`).

        Raises:
            TypeError: ``reshard_after_forward`` or ``recurse`` is not a bool.
        """
        _check_bools(reshard_after_forward=reshard_after_forward, recurse=recurse)
        for s in self._states(recurse):
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False``: keep parameters gathered after backward (e.g. between accumulation steps).

        Raises:
            TypeError: ``reshard_after_backward`` or ``recurse`` is not a bool.
        """
        _check_bools(reshard_after_backward=reshard_after_backward, recurse=recurse)
        for s in self._states(recurse):
            if s.group is not None:
                s.group.reshard_after_backward = reshard_after_backward

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


def _check_bools(**flags: Any) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")


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


def dbuffers(module: nn.Module) -> list[DBuffer]:
    """Every DBuffer of every ``fully_shard`` module in ``module``'s tree, in module order.

    Use with :func:`hyperrec.dbuffer.flat_params` for fused single-kernel optimizer
    steps, or :func:`hyperrec.dbuffer.clip_grad_norm_`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    _check_module(module)
    out = []
    for m in module.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
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
    for m in module.modules():
        state = get_state(m)
        if state is None or state.group is None:
            continue
        prefix = prefixes[id(m)]
        gathered = [buf.gather_full() for buf in state.group.buffers]
        for s in state.group.slots:
            key = f"{prefix}.{s.fqn}" if prefix else s.fqn
            out[key] = gathered[s.buffer][s.index].to(device)
    for name, p in module.named_parameters():
        if name not in out and not hasattr(p, "placements"):
            out[name] = p.detach().to(device)
    return out
