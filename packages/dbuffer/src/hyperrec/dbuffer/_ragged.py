"""Expose a tensor's local piece of a flat buffer as a DTensor with a RaggedShard placement."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from hyperrec.raggedshard import RaggedShard, enable_local_ops

__all__ = ["dtensor_view"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def dtensor_view(
    local: torch.Tensor,
    shape: Sequence[int],
    ranges: Sequence[tuple[int, int]],
    mesh: DeviceMesh,
) -> DTensor:
    """``local`` (1-D, this rank's piece) as a DTensor of global ``shape``; zero copy.

    ``ranges[r]`` are the flat elements rank ``r`` holds. The placement is
    ``RaggedShard.from_numels`` of those counts (fewest flattened leading dims), on a
    2-D ``(replicate, shard)`` mesh ``(Replicate(), RaggedShard)``.
    """
    enable_local_ops()  # so stock torch.optim steps these views without a gather
    shape = torch.Size(int(s) for s in shape)
    placement = RaggedShard.from_numels(shape, [b - a for a, b in ranges])
    rank = mesh.get_local_rank(mesh.ndim - 1)
    local = local.view(placement.local_shape(shape, rank))
    placements = (placement,) if mesh.ndim == 1 else (Replicate(), placement)
    return DTensor.from_local(
        local, mesh, placements, shape=shape, stride=_contiguous_stride(shape), run_check=False
    )
