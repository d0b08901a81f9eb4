"""Where a (possibly sharded) parameter's local elements sit inside the full tensor, and
optimizer-state tensors sharded the way their parameter is."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from hyperrec.parallel5d._validate import check_float
from hyperrec.raggedshard import RaggedShard, from_local, wrap_local

__all__ = [
    "block_placements",
    "check_fraction",
    "element_ranges",
    "local_flat",
    "local_range",
    "state_tensor",
]


def check_fraction(name: str, value: object) -> float:
    """A hyper-parameter in ``[0, 1)`` (momentum, Adam's betas).

    Raises:
        TypeError: not a real number (bools rejected).
        ValueError: NaN, infinite or outside ``[0, 1)``.
    """
    out = check_float(name, value, minimum=0)
    if not out < 1:
        raise ValueError(f"{name} must be < 1, got {out}")
    return out


def _ragged_axis(p: torch.Tensor) -> tuple[int, RaggedShard] | None:
    """The mesh axis holding ``p``'s ``RaggedShard`` and the placement (``None``: none).

    Raises:
        TypeError: a DTensor whose placements are neither ``RaggedShard`` nor
            ``Replicate`` (e.g. PyTorch FSDP2's ``Shard(0)``): its local elements are not
            one flat range of the full tensor, which the block-wise states rely on.
    """
    if not isinstance(p, DTensor):
        return None
    found = None
    for axis, placement in enumerate(p.placements):
        if isinstance(placement, RaggedShard):
            found = (axis, placement)
        elif not placement.is_replicate():
            raise TypeError(
                f"cannot locate the local elements of a DTensor with {p.placements}: "
                "shard it with hyperrec.parallel5d.fully_shard (RaggedShard placements)"
            )
    return found


def element_ranges(p: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Per rank of ``p``'s sharded mesh axis, the ``(start, stop)`` flat elements of the
    full parameter it holds, in rank order; ``((0, numel),)`` for a plain tensor or a
    replicated DTensor.

    Raises:
        TypeError: see :func:`local_range`.
    """
    found = _ragged_axis(p)
    if found is None:
        return ((0, p.numel()),)
    return _element_bounds(found[1], tuple(p.shape))


def local_range(p: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)``: the flat elements of the full parameter held by this rank.

    Plain tensors and replicated DTensors hold everything; a ragged DTensor's range is
    its ``RaggedShard`` placement's (for ``fully_shard`` parameters that placement is
    the buffer layout's, so both agree by construction).

    Raises:
        TypeError: a DTensor with a placement other than ``RaggedShard``/``Replicate``.
    """
    found = _ragged_axis(p)
    if found is None:
        return 0, p.numel()
    axis, placement = found
    mesh = cast(DTensor, p).device_mesh  # only DTensors have a ragged axis
    return _element_bounds(placement, tuple(p.shape))[mesh.get_local_rank(axis)]


@functools.lru_cache(maxsize=4096)
def _element_bounds(placement: RaggedShard, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    # Optimizers ask once per parameter per step; placements and shapes are hashable
    # values, so the answer is computed once per distinct pair.
    return tuple(placement.element_bounds(shape))


def local_flat(t: torch.Tensor) -> torch.Tensor:
    """The local elements of ``t`` (a DTensor's local tensor or ``t``) as a flat view.

    Raises:
        ValueError: the local tensor is not contiguous (an in-place update through a
            flat view would then miss elements).
    """
    local = t.to_local() if isinstance(t, DTensor) else t
    if not local.is_contiguous():
        raise ValueError("optimizer state and parameters must be contiguous to update in place")
    return local.view(-1)


def block_placements(p: torch.Tensor, block_size: int) -> tuple[Placement, ...] | None:
    """Placements of a ``(ceil(numel / block_size),)`` per-block tensor of ``p`` (one
    entry per quantization block) that put every block's entry on the rank holding
    that block's elements: ``RaggedShard`` over blocks where ``p`` has its
    ``RaggedShard``, ``Replicate`` where ``p`` is replicated. ``None`` for a plain ``p``.

    Needs every rank's piece of ``p`` to start on a block boundary (callers check).
    """
    found = _ragged_axis(p)
    if found is None:
        return None if not isinstance(p, DTensor) else tuple(p.placements)
    axis, placement = found
    nblocks = -(-p.numel() // block_size)
    counts = [
        0 if stop == start else -(-stop // block_size) - start // block_size
        for start, stop in _element_bounds(placement, tuple(p.shape))
    ]
    out = list(cast(DTensor, p).placements)
    out[axis] = RaggedShard.from_numels((nblocks,), counts)
    return tuple(out)


def state_tensor(
    p: torch.Tensor,
    dtype: torch.dtype,
    *,
    shape: Sequence[int] | None = None,
    placements: Sequence[Placement] | None = None,
) -> torch.Tensor:
    """A zero optimizer-state tensor of ``p``, sharded like ``p``.

    For a plain ``p``: a zero tensor of ``shape`` (default ``p.shape``). For a DTensor
    ``p``: a DTensor of global ``shape`` (default ``p.shape``) on ``p``'s mesh with
    ``placements`` (default ``p.placements``), whose local tensor is a fresh contiguous
    zero tensor of the local shape those placements give this rank. On ``p``'s device.
    Building it communicates nothing.
    """
    shape = torch.Size(p.shape if shape is None else shape)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    mesh = p.device_mesh
    placements = tuple(p.placements if placements is None else placements)
    local_shape = list(shape)
    for axis, placement in enumerate(placements):
        if isinstance(placement, RaggedShard):
            local_shape = list(placement.local_shape(shape, mesh.get_local_rank(axis)))
    local = torch.zeros(local_shape, dtype=dtype, device=p.to_local().device)
    if local.device.type != mesh.device_type and not local.is_meta:
        # An offloaded parameter (CPUOffloadPolicy: host shards, CUDA mesh): its states
        # stay on the host too, where from_local would have moved them to the mesh's device.
        return wrap_local(local, mesh, placements, shape=shape)
    return from_local(local, mesh, placements, shape=shape)
