"""Ragged-aware DTensor construction and redistribution, differentiable.

:func:`redistribute` is the documented entry that handles every pair of placements on
every mesh axis: ``RaggedShard``, ``Shard(d)``, ``Replicate`` and ``Partial``. A
transition that involves a ``RaggedShard`` runs one collective from
:mod:`._collectives` on that mesh axis; every other axis is handed to upstream
``DTensor.redistribute``. The backward of a redistribution is the redistribution of the
gradient back to the source placements (``Partial`` sources get a ``Replicate``
gradient, as upstream does), so gradients of ragged inputs keep their ragged placement.

Composition rules (checked, ``ValueError`` otherwise): at most one ``RaggedShard`` per
placement list; another mesh axis may hold ``Replicate`` or ``Partial`` freely, and
``Shard(d)`` only if the ragged placement has ``dims=(0,)`` and ``d >= 1`` (then local
and global dims line up, so upstream code handles that axis unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _upstream_distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from hyperrec.raggedshard import _collectives as coll
from hyperrec.raggedshard._geometry import contiguous_stride
from hyperrec.raggedshard.granularity import _shape_tuple
from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["check_placements", "distribute_tensor", "from_local", "redistribute", "wrap_local"]


class _FromLocal0d(torch.autograd.Function):
    """``DTensor.from_local`` of a 0-d tensor (differentiable): upstream reads an empty
    global ``shape`` as "not given" and then rejects the ragged placement."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh, placements: Any) -> DTensor:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(torch.Size(()), (), local.dtype)
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor | None, None, None]:
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None, None


def dtensor_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)``, also for
    a 0-d global ``shape`` (internal)."""
    if len(shape) == 0:
        return cast(DTensor, _FromLocal0d.apply(local, mesh, tuple(placements)))
    return DTensor.from_local(
        local, mesh, placements, shape=torch.Size(shape), stride=tuple(stride)
    )


def wrap_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    shape: Sequence[int],
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is ``local_tensor`` itself.

    Unlike :func:`from_local`: no copy and no move to the mesh's device (a host shard on
    a CUDA mesh, as CPU offloading keeps its parameters, stays on the host), no check of
    ``placements`` against ``shape`` or of the local shape (the caller guarantees them:
    e.g. placements a :class:`~hyperrec.raggedshard.Layout` made; this runs per tensor per
    step in sharding code), contiguous global stride, not differentiable.

    Raises:
        TypeError: ``local_tensor`` is not a plain tensor, ``device_mesh`` not a
            ``DeviceMesh``, ``shape`` not a sequence of ints.
        ValueError: a negative size in ``shape``.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
        raise TypeError(f"local_tensor must be a plain torch.Tensor, got {type(local_tensor)}")
    _check_mesh(device_mesh)
    size = torch.Size(_shape_tuple(shape))
    meta = TensorMeta(size, contiguous_stride(size), local_tensor.dtype)
    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local_tensor, spec, requires_grad=False)


def _normalize(placements: Sequence[Placement], ndim: int, name: str) -> tuple[Placement, ...]:
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(f"{name} must be a sequence of Placement, got {placements!r}")
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"{name} must hold Placement objects, got {p!r}")
        if isinstance(p, Shard) and type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def _check_mesh(device_mesh: object) -> None:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")


def _ragged_axis(placements: Sequence[Placement]) -> int | None:
    axes = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    return axes[0] if axes else None


def _touches_ragged(src: Placement, dst: Placement) -> bool:
    return isinstance(src, RaggedShard) or isinstance(dst, RaggedShard)


def _composition_error(placements: Sequence[Placement], shape: Sequence[int]) -> str | None:
    axes = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(axes) > 1:
        return f"at most one RaggedShard per placement list, got {tuple(placements)}"
    if not axes:
        return None
    ragged = cast(RaggedShard, placements[axes[0]])
    if len(ragged.dims) > len(shape):
        return f"{ragged!r} flattens more dims than the tensor of shape {tuple(shape)} has"
    for i, p in enumerate(placements):
        if i == axes[0] or isinstance(p, Replicate | Partial):
            continue
        if type(p) is not Shard:
            return f"{p!r} cannot be combined with {ragged!r}"
        if ragged.dims != (0,) or p.dim < 1:
            return (
                f"{p!r} on mesh axis {i} cannot be combined with {ragged!r}: Shard(d) on "
                "another axis needs RaggedShard(dims=(0,)) and d >= 1"
            )
    return None


def check_placements(
    placements: Sequence[Placement], shape: Sequence[int], mesh: DeviceMesh | None = None
) -> tuple[Placement, ...]:
    """Validate a placement list that may hold a ``RaggedShard``; returns it normalized.

    Args:
        placements: one placement per mesh axis.
        shape: the global tensor shape.
        mesh: if given, the placement count and each ``RaggedShard``'s unit count are
            checked against it. The split of ``shape`` into each ``RaggedShard``'s units
            is checked with or without a mesh.

    Raises:
        TypeError: ``placements`` not a sequence of ``Placement``, ``shape`` not a
            sequence of ints, ``mesh`` not a ``DeviceMesh``.
        ValueError: a broken composition rule (module docstring), a ``Shard(d)`` with
            ``d`` outside the tensor's dims, a negative size, a count mismatch, or a
            ``RaggedShard`` that cannot split ``shape``.
    """
    shape = _shape_tuple(shape)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    out = _normalize(placements, len(shape), "placements")
    for i, p in enumerate(out):
        if type(p) is Shard and not 0 <= p.dim < len(shape):
            raise ValueError(
                f"placements[{i}] = {p} shards a dim the tensor of shape {shape} does not have"
            )
    err = _composition_error(out, shape)
    if err:
        raise ValueError(err)
    for p in out:
        if isinstance(p, RaggedShard):
            p.unit_rows(shape)  # the split needs no mesh: sum(local_units) must divide the rows
    if mesh is not None:
        if len(out) != mesh.ndim:
            raise ValueError(f"placements has {len(out)} entries for a {mesh.ndim}-axis mesh")
        for i, p in enumerate(out):
            if isinstance(p, RaggedShard) and len(p.local_units) != mesh.size(i):
                raise ValueError(
                    f"{p!r} has {len(p.local_units)} units but mesh axis {i} has "
                    f"{mesh.size(i)} ranks"
                )
    return out


def _local_shape(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[int, ...]:
    """This rank's local shape (mesh axes applied in order; ``Shard`` = ``torch.chunk``)."""
    local = list(shape)
    ragged = _ragged_axis(placements)
    for i, p in enumerate(placements):
        if isinstance(p, Shard) and type(p) is Shard:
            n, w, c = local[p.dim], mesh.size(i), mesh.get_local_rank(i)
            chunk = -(-n // w) if n else 0
            local[p.dim] = max(0, min(n, (c + 1) * chunk) - min(n, c * chunk))
    if ragged is not None:
        rs = cast(RaggedShard, placements[ragged])
        rows = rs.local_shape(shape, mesh.get_local_rank(ragged))[0]
        local = [rows, *local[len(rs.dims) :]]
    return tuple(local)


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
) -> DTensor:
    """``DTensor.from_local`` with the global ``shape`` required and the layout checked.

    Differentiable like upstream (the gradient of the DTensor flows to ``local_tensor``).

    Args:
        local_tensor: this rank's shard, shaped as the placements dictate (for a
            ``RaggedShard``: ``(rows_i, *shape[k:])``).
        device_mesh: the mesh.
        placements: one per mesh axis (composition rules in the module docstring).
        shape: the global shape (required: ragged shards cannot be inferred from one rank).
        stride: the global stride; defaults to contiguous.

    Raises:
        TypeError: ``local_tensor`` is not a plain tensor, ``device_mesh`` not a
            ``DeviceMesh``, ``shape``/``stride`` not sequences of ints, bad placements.
        ValueError: placements break the rules, the local shape is not this rank's, or
            ``stride`` has another length than ``shape``.
    """
    if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
        raise TypeError(f"local_tensor must be a plain torch.Tensor, got {type(local_tensor)}")
    _check_mesh(device_mesh)
    shape = _shape_tuple(shape)
    if stride is not None:
        stride = _shape_tuple(stride, "stride")
        if len(stride) != len(shape):
            raise ValueError(f"stride {stride} must have one entry per dim of shape {shape}")
    out = check_placements(placements, shape, device_mesh)
    expected = _local_shape(shape, device_mesh, out)
    if tuple(local_tensor.shape) != expected:
        raise ValueError(
            f"local_tensor has shape {tuple(local_tensor.shape)} but rank "
            f"{device_mesh.get_coordinate()} of {out} on a global {shape} holds {expected}"
        )
    stride = contiguous_stride(shape) if stride is None else stride
    return dtensor_from_local(local_tensor, device_mesh, out, shape, stride)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a full tensor (like upstream ``distribute_tensor``) onto ragged placements.

    Upstream distributes with the ragged axis replaced by ``Replicate`` (broadcast from
    ``src_data_rank``, or no communication if ``None``); each rank then keeps its ragged
    rows (a local slice). Not differentiable (neither is upstream's for sharding).

    Raises:
        TypeError: ``tensor`` is not a plain tensor, ``device_mesh`` not a
            ``DeviceMesh``, bad placements.
        ValueError: placements break the rules or cannot split ``tensor``.
    """
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
        raise TypeError(f"tensor must be a plain torch.Tensor, got {type(tensor)}")
    _check_mesh(device_mesh)
    out = check_placements(placements, tensor.shape, device_mesh)
    ragged = _ragged_axis(out)
    if ragged is None:
        return _upstream_distribute_tensor(tensor, device_mesh, out, src_data_rank=src_data_rank)
    base = list(out)
    base[ragged] = Replicate()
    replicated = _upstream_distribute_tensor(tensor, device_mesh, base, src_data_rank=src_data_rank)
    p = cast(RaggedShard, out[ragged])
    local = coll.replicate_to_ragged(
        replicated.to_local().detach(),
        p.row_bounds(tensor.shape),
        len(p.dims),
        device_mesh.get_local_rank(ragged),
    )
    return dtensor_from_local(
        local.requires_grad_(tensor.requires_grad), device_mesh, out, tensor.shape,
        tensor.stride(),
    )  # fmt: skip


# -- the engine ------------------------------------------------------------------------------


def _ragged_step(
    local: torch.Tensor, src: Placement, dst: Placement, shape: tuple[int, ...], axis: coll.Axis
) -> torch.Tensor:
    """One mesh axis, one collective; at least one of ``src``/``dst`` is a RaggedShard."""
    if isinstance(src, RaggedShard):
        k = len(src.dims)
        logical = (*shape[:k], *local.shape[1:])
        rows = src.row_bounds(logical)
        if isinstance(dst, RaggedShard):
            return coll.ragged_to_ragged(local, src, dst, logical, axis)
        if isinstance(dst, Replicate):
            return coll.ragged_to_replicate(local, rows, shape[:k], axis)
        if isinstance(dst, Partial):
            return coll.ragged_to_partial(local, rows, shape[:k], dst.reduce_op, axis)
        return coll.ragged_to_shard(local, rows, logical, k, cast(Shard, dst).dim, axis)
    # Here the destination is the RaggedShard (the caller's contract).
    rdst = cast(RaggedShard, dst)
    k = len(rdst.dims)
    if isinstance(src, Replicate):
        return coll.replicate_to_ragged(local, rdst.row_bounds(local.shape), k, axis.index)
    if isinstance(src, Partial):
        return coll.partial_to_ragged(local, rdst.row_bounds(local.shape), k, src.reduce_op, axis)
    d = cast(Shard, src).dim
    full = list(local.shape)
    full[d] = shape[d]
    return coll.shard_to_ragged(local, d, rdst.row_bounds(full), full, k, axis)


def _plan(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], shape: tuple[int, ...]
) -> list[tuple[str, int | None, tuple[Placement, ...]]]:
    """Order the single-axis ragged steps and one upstream step so every state is legal.

    Returns ``[(kind, axis, placements_after), ...]`` with kind ``"ragged"`` or
    ``"upstream"``. Preference: shrink data before moving it (ragged additions first,
    ragged removals last), falling back to other orders when an intermediate would break
    the composition rules.
    """
    a, b = _ragged_axis(src), _ragged_axis(dst)
    upstream_axes = [
        i for i in range(len(src)) if src[i] != dst[i] and not _touches_ragged(src[i], dst[i])
    ]

    def with_axes(state: tuple[Placement, ...], axes: Sequence[int]) -> tuple[Placement, ...]:
        s = list(state)
        for i in axes:
            s[i] = dst[i]
        return tuple(s)

    moves: dict[str, list[int]] = {"U": upstream_axes}
    orders: list[tuple[str, ...]]
    if a is not None and a == b:
        moves["swap"] = [a] if src[a] != dst[a] else []
        orders = [("swap", "U"), ("U", "swap")]
    else:
        moves["remove"] = [a] if a is not None else []
        moves["add"] = [b] if b is not None else []
        orders = [("remove", "add", "U"), ("U", "remove", "add"), ("remove", "U", "add")]
        if a is None:
            orders = [("add", "U"), ("U", "add")]
        elif b is None:
            orders = [("U", "remove"), ("remove", "U")]
    for order in orders:
        steps: list[tuple[str, int | None, tuple[Placement, ...]]] = []
        state, ok = src, True
        for name in order:
            axes = moves[name]
            if not axes:
                continue
            state = with_axes(state, axes)
            if _composition_error(state, shape):
                ok = False
                break
            if name == "U":
                steps.append(("upstream", None, state))
            else:
                steps.append(("ragged", axes[0], state))
        if ok:
            return steps
    raise ValueError(f"no legal sequence of steps redistributes {src} -> {dst}")


def _engine(dt: DTensor, dst: tuple[Placement, ...]) -> DTensor:
    """Redistribute without autograd (callers run it under ``no_grad`` or in backward)."""
    mesh = dt.device_mesh
    shape = tuple(dt.shape)
    stride = tuple(dt.stride())
    src = tuple(dt.placements)
    if src == dst:
        return dt
    if _ragged_axis(src) is None and _ragged_axis(dst) is None:
        return dt.redistribute(mesh, dst)
    cur = dt
    for _kind, axis, state in _plan(src, dst, shape):
        if axis is None:  # the upstream step
            cur = cur.redistribute(mesh, state)
            continue
        ax = coll.Axis.of(mesh, axis)
        local = _ragged_step(cur.to_local(), cur.placements[axis], state[axis], shape, ax)
        cur = dtensor_from_local(local, mesh, state, shape, stride)
    return cur


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, dst: tuple[Placement, ...]) -> DTensor:
        ctx.src = tuple(dt.placements)
        ctx.set_materialize_grads(False)
        return _engine(dt, dst)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[DTensor | None, None]:
        if grad is None:
            return None, None
        target = tuple(Replicate() if p.is_partial() else p for p in ctx.src)
        return _engine(grad, target), None


def redistribute(dtensor: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Redistribute ``dtensor`` to ``placements`` on its mesh; handles every pair.

    Differentiable: the gradient is redistributed back to the source placements
    (``Partial`` sources receive a ``Replicate`` gradient), so a ragged input's gradient
    is ragged. Eager only (not traceable by ``torch.compile``).

    Cost per changed mesh axis: one collective (see :mod:`._collectives`) or none
    (``Replicate -> RaggedShard`` is a local slice). Changes on axes without a
    ``RaggedShard`` are one upstream ``DTensor.redistribute`` call.

    Args:
        dtensor: the input DTensor.
        placements: target placements, one per mesh axis. ``Partial`` targets are
            accepted only from ``RaggedShard`` (or unchanged), as upstream refuses others.

    Returns:
        A new DTensor (``dtensor`` itself if nothing changes).

    Raises:
        TypeError: ``dtensor`` is not a DTensor or placements are not Placements.
        ValueError: a wrong number of placements, broken composition rules, an
            unsupported ``Partial`` target, or a ``RaggedShard`` that cannot split the tensor.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"dtensor must be a DTensor, got {type(dtensor).__name__}")
    mesh = dtensor.device_mesh
    shape = tuple(dtensor.shape)
    src = check_placements(dtensor.placements, shape, mesh)
    dst = check_placements(placements, shape, mesh)
    for i, (p, q) in enumerate(zip(src, dst)):
        if q.is_partial() and p != q and not isinstance(p, RaggedShard):
            raise ValueError(
                f"redistributing {p} -> {q} on mesh axis {i} is not supported: Partial "
                "targets are accepted only from RaggedShard"
            )
        if (
            isinstance(q, Partial)
            and isinstance(p, RaggedShard)
            and q.reduce_op
            not in (
                "sum",
                "avg",
                "min",
                "max",
                "product",
            )
        ):
            raise ValueError(f"RaggedShard -> {q} is not supported")
    for i in range(len(src)):
        if src[i] == dst[i] or not _touches_ragged(src[i], dst[i]):
            continue
        for p in (src[i], dst[i]):
            if type(p) is not Shard:
                continue
            for j in range(len(src)):
                if j != i and any(type(q) is Shard and q.dim == p.dim for q in (src[j], dst[j])):
                    raise ValueError(
                        f"{p} <-> RaggedShard on mesh axis {i} needs tensor dim {p.dim} "
                        f"unsharded on every other mesh axis (axis {j} shards it)"
                    )
    if src == dst:
        return dtensor
    return _Redistribute.apply(dtensor, dst)
