"""The spec in plain, single-process PyTorch/Python: what every rank holds, what a layout
must satisfy. Tests compare the distributed code against these functions; they are also
the most direct statement of the semantics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["layout_violations", "local_tensor", "ragged_split", "ragged_unsplit"]


def ragged_split(tensor: torch.Tensor, placement: RaggedShard) -> list[torch.Tensor]:
    """The local tensor of every rank of one mesh axis, in rank order.

    Rank ``i`` gets rows ``[sum(units[:i]) * u, sum(units[:i+1]) * u)`` of
    ``tensor.reshape(R, *shape[k:])``, where ``k = len(dims)``, ``R = prod(shape[:k])``
    and ``u = R / sum(units)``.
    """
    k = len(placement.dims)
    rows = tensor.reshape(math.prod(tensor.shape[:k]), *tensor.shape[k:])
    u = placement.unit_rows(tensor.shape)
    out, start = [], 0
    for units in placement.local_units:
        out.append(rows[start : start + units * u].clone())
        start += units * u
    return out


def ragged_unsplit(
    locals_: Sequence[torch.Tensor], placement: RaggedShard, shape: Sequence[int]
) -> torch.Tensor:
    """Inverse of :func:`ragged_split`: concatenate the rows and restore ``shape``."""
    for i, t in enumerate(locals_):
        expected = placement.local_shape(shape, i)
        if t.shape != expected:
            raise ValueError(f"rank {i} local shape {tuple(t.shape)} != expected {expected}")
    return torch.cat(list(locals_)).reshape(tuple(shape))


def local_tensor(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """What the rank at ``coordinate`` holds of ``full`` (mesh axes applied in order).

    ``Shard(d)`` takes the ``torch.chunk`` part (possibly empty), ``RaggedShard`` its
    rows, ``Replicate`` and ``Partial`` keep the tensor (a ``Partial`` rank's share is the
    caller's choice).
    """
    t = full
    for axis, p in enumerate(placements):
        c = coordinate[axis]
        if isinstance(p, RaggedShard):
            t = ragged_split(t, p)[c]
        elif isinstance(p, Shard):
            n = t.shape[p.dim]
            chunk = -(-n // mesh_shape[axis]) if n else 0
            start = min(c * chunk, n)
            t = t.narrow(p.dim, start, min(n, start + chunk) - start)
        elif not isinstance(p, Replicate | Partial):
            raise ValueError(f"unsupported placement {p!r}")
    return t.clone()


def layout_violations(
    offsets: Sequence[int],
    numels: Sequence[int],
    granularities: Sequence[int],
    shard_numel: int,
    world_size: int,
    alignment: int = 1,
) -> list[str]:
    """Every way a flat rank-major layout breaks the planner's contract (empty = valid).

    Checked, one tensor at a time with plain integer loops: offsets aligned; tensors
    inside ``[0, world_size * shard_numel)``; no two tensors overlap; every multiple of
    ``shard_numel`` strictly inside a tensor is a block start (``offset + j * granularity``).
    """
    bad = []
    end_of_buffer = world_size * shard_numel
    spans = []
    for i, (off, n, g) in enumerate(zip(offsets, numels, granularities)):
        if off % alignment:
            bad.append(f"tensor {i}: offset {off} is not a multiple of {alignment}")
        if off < 0 or off + n > end_of_buffer:
            bad.append(f"tensor {i}: [{off}, {off + n}) leaves the buffer of {end_of_buffer}")
        first = (off // shard_numel + 1) * shard_numel
        for b in range(first, off + n, shard_numel):
            if (b - off) % g:
                bad.append(f"tensor {i}: shard boundary {b} cuts a block of {g} elements")
        if n:
            spans.append((off, off + n, i))
    spans.sort()
    for (_, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            bad.append(f"tensors {i0} and {i1} overlap at [{s1}, {e0})")
    return bad
