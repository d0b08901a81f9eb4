"""DTensors around local tensors that stay where they are, whatever the mesh's device.

``DTensor.from_local`` (and so ``hyperrec.raggedshard.from_local`` and
``DBuffer.as_dtensors`` of hyperrec-dbuffer <= 0.2.0) copies a local tensor to the mesh's
device type when it lives elsewhere. With ``CPUOffloadPolicy`` the shards live on the host
while the mesh, which runs the collectives, is a CUDA one: that copy turned every sharded
parameter into a GPU copy that no longer aliased the host buffer (the optimizer stepped
the copy, forward gathered the buffer, and the first forward refused the "moved"
parameters). FSDP2 builds its offloaded DTensors without the move too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from hyperrec.dbuffer import DBuffer

__all__ = ["local_dtensor", "shard_dtensors"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def local_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is ``local`` itself (no copy, no
    device move; not differentiable). The caller guarantees that ``local`` has the local
    shape ``placements`` give this rank."""
    size = torch.Size(shape)
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(size, _contiguous_stride(size), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)


def shard_dtensors(buf: DBuffer, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``buf.as_dtensors(flat)`` with every local tensor a view of ``flat`` (default
    ``buf.shard``) on ``flat``'s own device, also when that is the host of an offloaded
    buffer and the mesh is a CUDA one."""
    flat = buf.shard if flat is None else flat
    mesh = buf.mesh
    if mesh is None:
        return buf.as_dtensors(flat)
    out: list[torch.Tensor] = []
    for i, shape in enumerate(buf.shapes):
        placement = buf.placement(i)
        local = buf.flat_view(flat, i).view(placement.local_shape(shape, buf.rank))
        placements = (placement,) if mesh.ndim == 1 else (Replicate(), placement)
        out.append(local_dtensor(local, mesh, placements, shape))
    return out
