"""Keep a group's DBuffers in step with parameters replaced after ``fully_shard``.

``model.to(torch.float64)``, ``model.to_empty(device=...)`` and
``load_state_dict(..., assign=True)`` replace a sharded module's parameters (or their
local tensors) with new ones that no longer live in the group's flat buffer: forward would
then gather the old buffer. :func:`resync_group` finds such parameters and rebuilds the
buffer around them: a new :class:`~hyperrec.dbuffer.DBuffer` of the new dtype with the
same layout (the layout depends only on sizes, granularities and the mesh), this rank's
values copied in (no communication), held gradients carried over, and the parameter
objects kept (their contents are swapped for views of the new buffer), so optimizers
created before or after keep working. PyTorch FSDP2 does the same in its
``reset_sharded_param``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from hyperrec.dbuffer import DBuffer
from hyperrec.parallel5d._group import ParamGroup, _Slot
from hyperrec.raggedshard import wrap_local

__all__ = ["relayout_loaded", "resync_group"]


def _registered(s: _Slot) -> torch.Tensor:
    module, name = s.registrations[0]
    p = module._parameters[name]
    if p is None:  # fully_shard registered a parameter here; someone removed it
        raise RuntimeError(f"{type(module).__name__}.{name} is no longer a parameter")
    return p


def _aliases(p: torch.Tensor, s: _Slot, buf: DBuffer) -> bool:
    if p is not s.sharded or not isinstance(p, DTensor):
        return False
    local = p._local_tensor
    return (
        local.dtype == buf.dtype
        and local.device == buf.shard.device
        and local.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
    )


def _local_piece(p: torch.Tensor, buf: DBuffer, i: int) -> torch.Tensor | None:
    """This rank's flat elements of tensor ``i`` taken from parameter ``p`` (``None``:
    nothing to copy, e.g. a meta tensor)."""
    lo, hi = buf.local_range(i)
    if isinstance(p, DTensor):
        local = p._local_tensor
        if local.is_meta:
            return None
        # Whether the local tensor is this rank's piece must be decided from global
        # metadata (this layout's placements on this mesh), never from the local size:
        # with another layout (FSDP2's Shard(0)) one rank's count can match while the
        # others' do not, and that rank would skip the collective below (a hang) or,
        # at another offset, copy the wrong elements.
        placement = buf.placement(i)
        mine = (placement,) if buf.mesh is None or buf.mesh.ndim == 1 else (Replicate(), placement)
        if (
            p.device_mesh == buf.mesh
            and tuple(p.placements) == mine
            and tuple(p.shape) == tuple(buf.shapes[i])
        ):
            return local.detach().reshape(-1)
        full = p.full_tensor()  # another layout: the one gather this path needs
        return full.detach().reshape(-1)[lo:hi]
    if p.is_meta:
        return None
    if tuple(p.shape) != tuple(buf.shapes[i]):
        raise ValueError(
            f"parameter {buf.names[i]!r} was replaced by a tensor of shape {tuple(p.shape)}, "
            f"expected {tuple(buf.shapes[i])}"
        )
    return p.detach().reshape(-1)[lo:hi]


def relayout_loaded(
    group: ParamGroup, module: nn.Module, state_dict: dict[str, Any], prefix: str
) -> None:
    """``load_state_dict`` pre-hook of ``module``: turn the entries for its parameters that
    are DTensors of another layout (FSDP2's ``Shard(0)``, another mesh) into DTensors of
    this group's layout, so the ``copy_`` of ``load_state_dict`` runs between equal
    placements (a copy across placements is not supported: it raised). The choice is
    made from global metadata (placements, mesh, shape), the same on every rank, so every
    rank joins the ``full_tensor()`` each converted entry needs. Entries of another shape
    are left for ``load_state_dict`` to report."""
    for s in group.slots:
        p = s.sharded
        for m, name in s.registrations:
            v = state_dict.get(prefix + name) if m is module else None
            if not isinstance(v, DTensor) or not isinstance(p, DTensor):
                continue
            if v.device_mesh == p.device_mesh and tuple(v.placements) == tuple(p.placements):
                continue
            if tuple(v.shape) != tuple(p.shape):
                continue
            piece = _local_piece(v, group.buffers[s.buffer], s.index)
            if piece is None:  # a meta entry: no values to lay out
                continue
            local = piece.reshape(p._local_tensor.shape).to(p._local_tensor.device)
            state_dict[prefix + name] = wrap_local(
                local, p.device_mesh, tuple(p.placements), shape=tuple(p.shape)
            )


def _views_into(group: ParamGroup, b: int, buf: DBuffer, targets: list[torch.Tensor]) -> None:
    """Make every slot of buffer ``b`` a view of ``buf`` again, keeping parameter objects."""
    views = buf.as_dtensors()
    grads = buf.as_dtensors(buf.grad_shard) if buf.has_grad else None
    for s, target in zip(group._slots_of(b), targets):
        # The replaced parameter's flag, not the slot's: a parameter frozen after
        # fully_shard (synced into the slot only at the next unshard) must stay frozen.
        if isinstance(target, nn.Parameter):
            s.requires_grad = target.requires_grad
        new = nn.Parameter(views[s.index], requires_grad=s.requires_grad)
        had_grad = getattr(target, "grad", None) is not None or s.sharded.grad is not None
        if isinstance(target, nn.Parameter) and isinstance(target, DTensor):
            target.grad = None
            torch.utils.swap_tensors(target, new)
            new = target
        s.sharded = new
        s.unsharded = None
        s.grad_view = None
        s.written = False
        s.grad_dtensor = None if grads is None else grads[s.index]
        if grads is not None and had_grad and s.requires_grad:
            new.grad = s.grad_dtensor
        for module, name in s.registrations:
            module._parameters[name] = new
    if grads is not None:
        buf.shard.grad = buf.grad_shard


def resync_group(group: ParamGroup, *, partial_ok: bool = True) -> None:
    """Rebuild every buffer of ``group`` some of whose registered parameters are no longer
    views of it.

    Args:
        group: a resharded group.
        partial_ok: leave a buffer alone when only some of its parameters changed (one
            module of a grouped ``fully_shard([a, b])`` converted before the other);
            ``False`` rebuilds it from whatever is registered.

    Raises:
        RuntimeError: the group is unsharded (call ``reshard()`` first), or parameters
            moved to a device the buffer cannot live on (the old ones are restored).
        ValueError / TypeError: parameters of one buffer now have different or
            non-floating dtypes, or a replaced parameter has another shape.
    """
    if not group.is_sharded:
        raise RuntimeError(
            "cannot replace the parameters of a fully_shard module while they are unsharded "
            "(between forward and backward, or after unshard()); call reshard() first"
        )
    for b, buf in enumerate(list(group.buffers)):
        slots = group._slots_of(b)
        current = [_registered(s) for s in slots]
        stale = [not _aliases(p, s, buf) for p, s in zip(current, slots)]
        if not any(stale) or (partial_ok and not all(stale)):
            continue
        devices = {(p._local_tensor if isinstance(p, DTensor) else p).device for p in current}
        # Offloaded, the values of parameters moved to the mesh's device (model.cuda(),
        # to_empty(device="cuda")) go back to the host buffer, as FSDP2 does with pinned
        # memory; other devices cannot serve the buffer.
        allowed = {buf.shard.device.type}
        if group.offload:
            allowed.add(group.device.type)
        if any(d.type not in allowed for d in devices):
            _views_into(group, b, buf, current)  # put the old parameters back
            where = "the host (CPUOffloadPolicy)" if group.offload else f"{buf.device}"
            raise RuntimeError(
                f"fully_shard keeps these sharded parameters on {where}; moving them to "
                f"{sorted(str(d) for d in devices)} is not supported (the mesh's device runs "
                "the collectives): shard the model on a mesh of that device instead"
            )
        pieces = [_local_piece(p, buf, s.index) for p, s in zip(current, slots)]
        dtypes = {p.dtype for p in pieces if p is not None} or {buf.dtype}
        if len(dtypes) != 1:
            raise ValueError(
                "parameters sharded together by one fully_shard call must keep one dtype "
                f"each buffer, got {sorted(str(d) for d in dtypes)} for {buf.names}"
            )
        dtype = dtypes.pop()
        if not dtype.is_floating_point:
            raise TypeError(f"fully_shard parameters must stay floating point, got {dtype}")
        policy = group.mp_policy
        param_dtype = policy.param_dtype or dtype
        new = DBuffer(
            buf.shapes,
            mesh=buf.mesh,
            dtype=dtype,
            param_dtype=param_dtype,
            reduce_dtype=policy.reduce_dtype or param_dtype,
            device=buf.device,
            granularities=buf.granularities,
            alignment=group.alignment,
            names=buf.names,
            offload=group.offload,
            pin_memory=group.pin_memory,
            # A frozen parameters' buffer stays out of flat_params (else a fused optimizer
            # over it moves them by weight decay after .to(dtype) or assign=True).
            trainable=buf.trainable,
        )
        with torch.no_grad():
            for s, piece in zip(slots, pieces):
                if piece is not None:
                    new.shard_view(s.index).copy_(piece)
            if buf.has_grad:
                buf.wait_reduce()
                new.set_grad_(buf.grad_shard.to(dtype))
        group.buffers[b] = new
        group._in_place[b] = new.reduce_dtype == new.param_dtype
        _views_into(group, b, new, current)
