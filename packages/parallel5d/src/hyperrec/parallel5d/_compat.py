"""PyTorch FSDP2's remaining ``fully_shard`` surface: policies, mesh selection, handles.

Everything here maps one FSDP2 argument or module function onto the flat-buffer
implementation (or says clearly why it cannot): offload policies, ``dp_mesh_dims``,
``reshard_after_forward`` as an int or ``None``, ``shard_placement_fn``, the handle of
``unshard(async_op=True)``, ``register_fsdp_forward_method`` and ``share_comm_ctx``.
torch's own policy objects are accepted wherever ours are.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "OffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


@dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """No offloading: FSDP2's default ``offload_policy`` (``torch.distributed.fsdp``'s
    ``OffloadPolicy()`` is accepted too)."""


@dataclass(frozen=True, kw_only=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, their gradients and so the optimizer states live on the host.

    Before each all-gather the shard is copied host-to-device (on the gather's CUDA
    stream) into its slot of the gathered buffer; each reduced gradient is copied
    device-to-host, and the optimizer steps on the CPU, as with PyTorch FSDP2's
    ``CPUOffloadPolicy`` (whose objects are accepted too).

    Raises:
        TypeError: ``pin_memory`` is not a bool.
    """

    pin_memory: bool = True
    """Pin the host storages (when CUDA is available) so the copies run asynchronously
    and overlap compute; ``False`` saves pinned host memory."""

    def __post_init__(self) -> None:
        # As MixedPrecisionPolicy checks its fields: "no" would otherwise pin (truthy).
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {self.pin_memory!r}")


@dataclass(frozen=True, kw_only=True)
class DataParallelMeshDims:
    """Which named dims of a larger ``DeviceMesh`` are data parallel (FSDP2's
    ``dp_mesh_dims``; torch's ``DataParallelMeshDims`` is accepted too where it exists).

    ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``
    shards over ``spmd_mesh["dp"]``; several names are flattened into one axis.

    Raises:
        TypeError: ``shard`` or ``replicate`` is neither ``None``, a str nor a sequence
            of str.
        ValueError: neither is given.
    """

    shard: str | tuple[str, ...] | None = None
    """Mesh dim name(s) parameters are sharded over (flattened when several)."""
    replicate: str | tuple[str, ...] | None = None
    """Mesh dim name(s) parameters are replicated over (HSDP; flattened when several)."""

    def __post_init__(self) -> None:
        _names(self.shard, "shard")  # the types now, not at the first fully_shard
        _names(self.replicate, "replicate")
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard or replicate (or both)")


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"dp_mesh_dims.{what} must be a str or a tuple of str, got {value!r}")


def resolve_offload(offload_policy: Any) -> tuple[bool, bool]:
    """``(offload, pin_memory)`` from ours or torch's offload policy (``None``: none).

    Raises:
        TypeError: anything else.
    """
    if offload_policy is None:
        return False, False
    if isinstance(offload_policy, CPUOffloadPolicy):
        return True, offload_policy.pin_memory
    if isinstance(offload_policy, OffloadPolicy):
        return False, False
    name = type(offload_policy).__name__
    module = type(offload_policy).__module__ or ""
    if module.startswith("torch.distributed.fsdp") and name in (
        "CPUOffloadPolicy",
        "OffloadPolicy",
    ):
        if name == "CPUOffloadPolicy":
            return True, bool(getattr(offload_policy, "pin_memory", True))
        return False, False
    raise TypeError(f"offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}")


def resolve_mesh(mesh: DeviceMesh, dp_mesh_dims: Any) -> DeviceMesh:
    """The 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh to shard over.

    Raises:
        TypeError: ``dp_mesh_dims`` is not a ``DataParallelMeshDims`` (ours or torch's),
            or a malformed one.
        ValueError: names missing from the mesh; without ``dp_mesh_dims``, a mesh of
            another number of axes.
        NotImplementedError: replicate-only ``dp_mesh_dims`` (DDP through fully_shard), or
            an HSDP pair this torch cannot concatenate.
    """
    if dp_mesh_dims is not None and not (
        hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")
    ):
        # A bare name or tuple would otherwise read as "neither shard nor replicate".
        raise TypeError(
            f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dp_mesh_dims).__name__}"
        )
    if dp_mesh_dims is None:
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"mesh must be a 1-D (FSDP) or 2-D (replicate, shard) DeviceMesh, got "
                f"{mesh.ndim} axes (or pass dp_mesh_dims)"
            )
        return mesh
    shard = _names(getattr(dp_mesh_dims, "shard", None), "shard")
    replicate = _names(getattr(dp_mesh_dims, "replicate", None), "replicate")
    if not shard and not replicate:
        raise ValueError("dp_mesh_dims needs shard or replicate (or both)")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("dp_mesh_dims needs a mesh with mesh_dim_names")
    for n in (*shard, *replicate):
        if n not in names:
            raise ValueError(f"dp_mesh_dims names {n!r}, not a dim of the mesh {names}")
    if not shard:
        raise NotImplementedError(
            "dp_mesh_dims with replicate only (DDP through fully_shard) is not supported: "
            "hyperrec.parallel5d.fully_shard always shards; use torch's replicate() or DDP"
        )

    def sub(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    if not replicate:
        return sub(shard)
    if (
        len(shard) == 1
        and len(replicate) == 1
        and names.index(replicate[0]) < names.index(shard[0])
    ):
        return mesh[(replicate[0], shard[0])]
    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is None:
        raise NotImplementedError(
            f"dp_mesh_dims replicate={replicate} shard={shard} needs DeviceMesh._concatenate, "
            "which this torch lacks; pass mesh=spmd_mesh[(replicate, shard)] instead"
        )
    return concat([sub(replicate), sub(shard)])


def resolve_reshard_after_forward(value: Any, shard_size: int) -> tuple[bool, int | None, bool]:
    """``(reshard, keep_ranks, auto)`` for ``reshard_after_forward``.

    ``None`` (FSDP2's default): reshard, except the root (resolved at its first forward).
    An int ``N``: keep parameters sharded over groups of ``N`` ranks after forward (``1``
    means keep them whole, ``shard_size`` means reshard fully).

    Raises:
        TypeError: not a bool, an int or ``None``.
        ValueError: an int that does not divide the shard axis size.
    """
    if value is None:
        return True, None, True
    if isinstance(value, bool):
        return value, None, False
    if not isinstance(value, int):
        raise TypeError(
            f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}"
        )
    if value < 1 or shard_size % value:
        raise ValueError(
            f"reshard_after_forward as an int must divide the shard axis size {shard_size}, "
            f"got {value}"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 keeps the whole parameters after forward (same as "
            "False); pass True to reshard fully",
            stacklevel=3,
        )
        return False, None, False
    if value == shard_size:
        return True, None, False
    return True, value, False


_SUBGROUPS: dict[tuple[tuple[int, ...], int], dist.ProcessGroup] = {}


def post_forward_group(mesh: DeviceMesh, size: int) -> dist.ProcessGroup:
    """The group of ``size`` consecutive ranks of this rank's shard axis (cached per axis
    and size). Only the members create it, so it works on any sub-mesh."""
    axis_group = mesh.get_group(mesh.ndim - 1)
    ranks = tuple(dist.get_process_group_ranks(axis_group))
    key = (ranks, size)
    if key not in _SUBGROUPS:
        me = mesh.get_local_rank(mesh.ndim - 1)
        start = (me // size) * size
        members = list(ranks[start : start + size])
        _SUBGROUPS[key] = dist.new_group(members, use_local_synchronization=True)
    return _SUBGROUPS[key]


def placement_granularities(
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    params: Sequence[nn.Parameter],
    granularities: Sequence[int],
) -> list[int]:
    """Granularities after ``shard_placement_fn``: ``Shard(d)`` means no rank boundary may
    cut one ``shape[d + 1:]`` sub-tensor (every rank holds whole index-``d`` slices:
    whole rows for ``Shard(0)``), combined (lcm) with the ``granularity`` block.

    Raises:
        TypeError: the function returns something other than ``None`` or ``Shard``.
        NotImplementedError: FSDP2's ``ShardPlacementResult`` (another mesh per parameter).
        ValueError: a ``Shard`` dim outside the parameter's dims.
    """
    if shard_placement_fn is None:
        return list(granularities)
    if not callable(shard_placement_fn):
        raise TypeError(
            f"shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}"
        )
    out = []
    for p, g in zip(params, granularities):
        placement = shard_placement_fn(p)
        if placement is None:
            out.append(g)
            continue
        if type(placement).__name__ == "ShardPlacementResult":
            raise NotImplementedError(
                "shard_placement_fn returned a ShardPlacementResult (a mesh per parameter): "
                "one fully_shard group is one flat buffer on one mesh; shard those "
                "parameters with their own fully_shard call on that mesh"
            )
        if not isinstance(placement, Shard) or type(placement) is not Shard:
            raise TypeError(f"shard_placement_fn must return None or Shard(dim), got {placement!r}")
        dim = placement.dim if placement.dim >= 0 else placement.dim + p.dim()
        if not 0 <= dim < max(p.dim(), 1):
            raise ValueError(
                f"shard_placement_fn returned Shard({placement.dim}) for a parameter of shape "
                f"{tuple(p.shape)}"
            )
        block = max(math.prod(p.shape[dim + 1 :]), 1)
        out.append(g * block // math.gcd(g, block))
    return out


def check_dtensor_params(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Plain values of parameters: DTensors replicated on every mesh dim become their
    local tensor (``dp_mesh_dims``' input), anything else sharded is refused.

    Raises:
        NotImplementedError: a DTensor parameter sharded on some mesh dim (FSDP x TP/EP
            needs a strided ragged placement, which the flat buffer does not implement).
    """
    from torch.distributed.tensor import DTensor

    out = []
    for p in params:
        if isinstance(p, DTensor):
            if not all(isinstance(pl, Replicate) for pl in p.placements):
                raise NotImplementedError(
                    "fully_shard of a parameter that is already a DTensor sharded over "
                    f"{tuple(p.placements)} (FSDP x TP/EP composition on one parameter) is "
                    "not supported by the flat buffer; shard the TP/EP dims yourself and "
                    "pass plain (or fully replicated) parameters"
                )
            out.append(p.to_local())
        else:
            out.append(p)
    return out


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: :meth:`wait` makes the gathered
    parameters usable on the current stream and registers them on the module.

    The module's pre-forward waits too, so calling :meth:`wait` is only needed to use the
    parameters before forward. Waiting twice is harmless.
    """

    def __init__(self, groups: list[Any]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gathers issued by ``unshard(async_op=True)``."""
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` gather and free parameters like ``forward`` does.

    FSDP only hooks ``forward``; this wraps another method (e.g. ``forward_features``)
    with the same pre/post-forward logic. A no-op for modules that ``fully_shard`` did not
    touch, so code can call it unconditionally.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``method_name`` is not a str.
        ValueError: the module has no such method.
    """
    from hyperrec.parallel5d._state import get_state

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {type(method_name).__name__}")
    state = get_state(module)
    if state is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    original = getattr(module, method_name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        out = original(*args, **kwargs)
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """Share one set of communication streams between several roots (e.g. pipeline
    stages' model chunks), as FSDP2's ``share_comm_ctx``.

    Raises:
        TypeError: ``modules`` is not a list (a module is iterable over its children).
        ValueError: an element is not a ``fully_shard`` module.
    """
    from hyperrec.parallel5d._group import _Comm
    from hyperrec.parallel5d._state import get_state

    if isinstance(modules, nn.Module | str) or not isinstance(modules, Sequence):
        raise TypeError(
            f"modules must be a list of fully_shard modules, got {type(modules).__name__}"
        )
    states = []
    for i, m in enumerate(modules):
        state = get_state(m) if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(f"modules[{i}] is not a fully_shard module: {type(m).__name__}")
        states.append(state)
    if not states:
        return
    first = states[0]
    comm = first.comm or first.shared_comm or _Comm(first.device)
    for state in states:
        # Roots not yet run take it at their first forward; running ones switch now.
        state.shared_comm = comm
        if state.is_root:
            for s in state.all_states:
                s.comm = comm
                if s.group is not None:
                    s.group.comm = comm
