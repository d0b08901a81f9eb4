"""Where a (possibly sharded) parameter's local elements sit inside the full tensor."""

from __future__ import annotations

import math

import torch

__all__ = ["local_flat", "local_range"]


def local_range(p: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)``: the flat elements of the full parameter held by this rank.

    Plain tensors hold everything. Parameters made by ``fully_shard`` carry their range;
    other DTensors are read from a ``RaggedShard`` placement (``dims``/``local_units``).

    Raises:
        TypeError: a DTensor whose placement is not understood.
    """
    rng = getattr(p, "_hyperrec_local_range", None)
    if rng is not None:
        return tuple(rng)
    if not hasattr(p, "placements"):
        return 0, p.numel()
    mesh = p.device_mesh
    for axis, placement in enumerate(p.placements):
        units = getattr(placement, "local_units", None)
        dims = getattr(placement, "dims", None)
        if units is None or dims is None:
            continue
        row = math.prod(p.shape[len(dims) :])
        total_rows = math.prod(p.shape[: len(dims)])
        unit = total_rows * row // max(sum(units), 1)
        r = mesh.get_local_rank(axis)
        start = sum(units[:r]) * unit
        return start, start + units[r] * unit
    if all(pl.is_replicate() for pl in p.placements):
        return 0, p.numel()
    raise TypeError(f"cannot locate the local elements of a DTensor with {p.placements}")


def local_flat(t: torch.Tensor) -> torch.Tensor:
    """The local elements of ``t`` (a DTensor's local tensor or ``t``) as a flat view."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if not local.is_contiguous():
        raise ValueError("optimizer state and parameters must be contiguous to update in place")
    return local.view(-1)
