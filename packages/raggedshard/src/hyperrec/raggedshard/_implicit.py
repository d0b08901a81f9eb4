"""Plain-tensor operands of shard-local ops under ``implicit_replication``.

Upstream DTensor treats a plain ``torch.Tensor`` operand as ``Replicate`` when
``torch.distributed.tensor.experimental.implicit_replication()`` is active (and always for
one-element tensors). For an elementwise op on a ragged DTensor a replicated operand
means: every rank uses the elements of its own rows. :func:`localize` cuts those out (a
view of the operand broadcast to the global shape, no copy in the common cases), so
``ragged.add_(plain)`` runs shard-locally instead of being rejected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["implicit_replication_enabled", "local_piece", "localize"]


def implicit_replication_enabled() -> bool:
    """Whether upstream's ``implicit_replication()`` context is active (feature-detected)."""
    return bool(getattr(DTensor._op_dispatcher, "_allow_implicit_replication", False))


def local_piece(plain: torch.Tensor, ref: DTensor) -> torch.Tensor | None:
    """This rank's piece of ``plain`` (taken as replicated, broadcast to ``ref``'s global
    shape) laid out like ``ref``'s local tensor; ``None`` when it does not broadcast.

    ``ref`` must have exactly one ``RaggedShard`` placement (others ``Replicate``).
    """
    shape = tuple(ref.shape)
    try:
        full = plain.expand(shape) if tuple(plain.shape) != shape else plain
    except RuntimeError:
        return None
    found = [(a, p) for a, p in enumerate(ref.placements) if isinstance(p, RaggedShard)]
    if len(found) != 1:
        return None
    axis, placement = found[0]
    k = len(placement.dims)
    rank = ref.device_mesh.get_local_rank(axis)
    r0, r1 = placement.row_bounds(shape)[rank]
    # (rows, *shape[k:]); a view unless broadcasting over the flattened leading dims.
    rows = full.reshape(-1, *shape[k:]) if k else full.unsqueeze(0)
    piece = rows[r0:r1]
    target = ref._local_tensor
    if piece.shape != target.shape:
        return None
    return piece.to(device=target.device)


def localize(values: list[Any], ref: DTensor) -> list[Any] | None:
    """``values`` with every plain non-scalar tensor replaced by its :func:`local_piece`.

    ``None`` when such a tensor is present but implicit replication is off (upstream
    then raises its own error) or when one does not broadcast to ``ref``.
    """
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() != 0:
            if not (implicit_replication_enabled() or v.numel() == 1):
                return None
            v = local_piece(v, ref)
            if v is None:
                return None
        out.append(v)
    return out
