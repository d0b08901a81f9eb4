"""DTensors around local tensors that stay where they are, whatever the mesh's device.

``DTensor.from_local`` (and so ``hyperrec.raggedshard.from_local``) copies a local tensor
to the mesh's device type when it lives elsewhere. With ``CPUOffloadPolicy`` the shards
live on the host while the mesh, which runs the collectives, is a CUDA one: that copy
turned every sharded parameter into a GPU copy that no longer aliased the host buffer.
FSDP2 builds its offloaded DTensors without the move too. The buffers' own views come
from ``DBuffer.as_dtensors`` (which keeps them in place since hyperrec-dbuffer 0.2.1);
this module serves tensors that belong to no buffer (optimizer states).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

__all__ = ["local_dtensor"]


def local_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is ``local`` itself (no copy, no
    device move; not differentiable). The caller guarantees that ``local`` has the local
    shape ``placements`` give this rank."""
    size = torch.Size(shape)
    meta = TensorMeta(size, make_contiguous_strides_for(size), local.dtype)
    return DTensor(
        local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False
    )
