"""Single-mesh-axis ragged transitions on local tensors: one collective (or none) each.

Every function takes the local tensor of one rank and returns its new local tensor; the
geometry arrives as per-rank row/element bounds so that this module knows nothing about
placements. ``shape`` is always the *logical* shape at this mesh axis: the global shape,
except for trailing dims that other mesh axes already shard.

Collective per transition (``W`` ranks on the axis, ``n_i`` elements on rank ``i``):

====================  ====================================================================
ragged -> replicate   one ``all_gather_into_tensor`` padded to ``max(n_i)``; no padding and
                      no compaction copy when shards are equal
replicate -> ragged   local slice (clone), no communication
partial -> ragged     one ``reduce_scatter_tensor``; the input is the partial tensor itself
                      when shards are equal, else one padded copy of it
ragged -> ragged      one ``all_to_all_single`` with per-peer splits; zero copies (the
                      send and receive pieces are contiguous and in rank order)
ragged <-> Shard(0)   same as ragged -> ragged (both are flat row ranges)
ragged <-> Shard(d)   one ``all_to_all_single``; pieces packed (d past the ragged dims) or
                      routed by flat index (d inside them)
ragged -> partial     local: own rows in place, the reduce op's identity elsewhere
====================  ====================================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hyperrec.raggedshard._geometry import Bounds, chunk_bounds, chunk_owner_count

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide by the axis size
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


# torch 2.13 renamed the single-tensor all-gather; 2.11 only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_stacked(flat: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Every rank's 1-D ``flat`` (same length on each) stacked as ``(size, n)``.

    For max/min-like combinations: reducing the stack with torch (``torch.amax``, ...)
    propagates NaN exactly like the op on the full tensor, where an all-reduce MAX/MIN
    drops it (gloo keeps the other operand)."""
    everyone = flat.new_empty(size * flat.numel())
    _all_gather_single(everyone, flat.contiguous(), group=group)
    return everyone.view(size, -1)


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One mesh axis as seen from this rank."""

    group: Any
    """The process group of the axis (ranks ordered by mesh coordinate)."""
    index: int
    """This rank's coordinate on the axis."""
    size: int
    """Ranks on the axis."""

    @staticmethod
    def of(mesh: Any, mesh_dim: int) -> Axis:
        return Axis(
            group=mesh.get_group(mesh_dim),
            index=int(mesh.get_local_rank(mesh_dim)),
            size=int(mesh.size(mesh_dim)),
        )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _check_local(local: torch.Tensor, expected: int, what: str) -> None:
    if local.numel() != expected:
        raise ValueError(
            f"local tensor of shape {tuple(local.shape)} does not match its {what} "
            f"({expected} elements expected on this rank)"
        )


def ragged_to_replicate(
    local: torch.Tensor, rows: Bounds, leading: Sequence[int], axis: Axis
) -> torch.Tensor:
    """All-gather ragged row ranges into the full logical tensor ``(*leading, *trailing)``."""
    trailing = tuple(local.shape[1:])
    row = math.prod(trailing)
    counts = [(e - s) * row for s, e in rows]
    _check_local(local, counts[axis.index], "ragged rows")
    out_shape = (*leading, *trailing)
    widest = max(counts)
    if widest == 0:
        return local.new_empty(out_shape)
    send = _flat(local)
    if send.numel() < widest:
        padded = local.new_zeros(widest)
        padded[: send.numel()] = send
        send = padded
    gathered = local.new_empty(axis.size * widest)
    dist.all_gather_into_tensor(gathered, send, group=axis.group)
    if any(c != widest for c in counts):
        gathered = torch.cat([gathered[j * widest : j * widest + c] for j, c in enumerate(counts)])
    return gathered.view(out_shape)


def replicate_to_ragged(replica: torch.Tensor, rows: Bounds, k: int, index: int) -> torch.Tensor:
    """This rank's rows of a replicated tensor (a copy, so the replica can be freed)."""
    trailing = tuple(replica.shape[k:])
    start, end = rows[index]
    as_rows = replica.reshape(math.prod(replica.shape[:k]), *trailing)
    return as_rows[start:end].clone(memory_format=torch.contiguous_format)


def partial_to_ragged(
    partial: torch.Tensor, rows: Bounds, k: int, reduce_op: str, axis: Axis
) -> torch.Tensor:
    """Reduce-scatter a partial tensor into ragged row ranges."""
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"unsupported Partial reduce_op {reduce_op!r}")
    if reduce_op == "avg" and not (partial.is_floating_point() or partial.is_complex()):
        # Sum-then-divide would turn the tensor into float32 behind the DTensor's back.
        raise ValueError(
            f"Partial('avg') -> RaggedShard needs a floating-point tensor, got {partial.dtype}"
        )
    trailing = tuple(partial.shape[k:])
    row = math.prod(trailing)
    counts = [(e - s) * row for s, e in rows]
    widest = max(counts)
    mine = counts[axis.index]
    out_shape = (rows[axis.index][1] - rows[axis.index][0], *trailing)
    if widest == 0:
        return partial.new_empty(out_shape)
    flat = _flat(partial)
    if all(c == widest for c in counts):
        send = flat
    else:
        send = partial.new_zeros(axis.size * widest)
        start = 0
        for j, c in enumerate(counts):
            send[j * widest : j * widest + c] = flat[start : start + c]
            start += c
    out = partial.new_empty(widest)
    dist.reduce_scatter_tensor(out, send, op=_REDUCE_OPS[reduce_op], group=axis.group)
    if reduce_op == "avg":
        out = out / axis.size
    return out[:mine].view(out_shape)


def ragged_to_partial(
    local: torch.Tensor, rows: Bounds, leading: Sequence[int], reduce_op: str, axis: Axis
) -> torch.Tensor:
    """A partial tensor whose reduction over the axis is the ragged tensor (no comms)."""
    trailing = tuple(local.shape[1:])
    row = math.prod(trailing)
    start, end = rows[axis.index]
    _check_local(local, (end - start) * row, "ragged rows")
    dtype = local.dtype
    if reduce_op in ("sum", "avg"):
        fill: float | int | bool = 0
    elif reduce_op == "product":
        fill = 1
    elif reduce_op in ("max", "min"):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        fill = info.min if reduce_op == "max" else info.max
        if dtype.is_floating_point:
            fill = -math.inf if reduce_op == "max" else math.inf
    else:
        raise ValueError(f"RaggedShard -> Partial({reduce_op!r}) is not supported")
    out = local.new_full((math.prod(leading) * row,), fill)
    mine = _flat(local)
    if reduce_op == "avg":
        mine = mine * axis.size
    out[start * row : end * row] = mine
    return out.view(*leading, *trailing)


def _chunk_of(g: torch.Tensor, stride: int, size: int, chunk: int) -> torch.Tensor:
    """Which ``torch.chunk`` part owns flat index ``g`` along a dim of ``size`` and ``stride``."""
    idx = torch.div(g, stride, rounding_mode="floor") % size
    return torch.div(idx, chunk, rounding_mode="floor")


def _all_to_all(
    send: torch.Tensor, send_counts: list[int], recv_counts: list[int], axis: Axis
) -> torch.Tensor:
    out = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(out, send, recv_counts, send_counts, group=axis.group)
    return out


def _overlaps(mine: tuple[int, int], theirs: Bounds) -> list[int]:
    lo, hi = mine
    return [max(0, min(hi, e) - max(lo, s)) for s, e in theirs]


def flat_ranges(
    local: torch.Tensor, src: Bounds, dst: Bounds, out_shape: Sequence[int], axis: Axis
) -> torch.Tensor:
    """Move between two layouts that both give each rank one flat element range."""
    _check_local(local, src[axis.index][1] - src[axis.index][0], "source range")
    send_counts = _overlaps(src[axis.index], dst)
    recv_counts = _overlaps(dst[axis.index], src)
    return _all_to_all(_flat(local), send_counts, recv_counts, axis).view(tuple(out_shape))


def ragged_to_ragged(
    local: torch.Tensor, src: Any, dst: Any, shape: Sequence[int], axis: Axis
) -> torch.Tensor:
    """Between two ``RaggedShard`` placements (any ``dims``): one all-to-all."""
    return flat_ranges(
        local,
        src.element_bounds(shape),
        dst.element_bounds(shape),
        dst.local_shape(shape, axis.index),
        axis,
    )


def _shard_dim_elements(shape: Sequence[int], dim: int, chunks: Bounds) -> Bounds:
    inner = math.prod(shape[dim + 1 :])
    return tuple((s * inner, e * inner) for s, e in chunks)


def ragged_to_shard(
    local: torch.Tensor, rows: Bounds, shape: Sequence[int], k: int, dim: int, axis: Axis
) -> torch.Tensor:
    """Ragged rows -> ``Shard(dim)`` (``torch.chunk`` of the logical ``shape``)."""
    shape = tuple(shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"Shard({dim}) is out of range for a tensor of shape {shape}")
    row = math.prod(shape[k:])
    elems = tuple((s * row, e * row) for s, e in rows)
    chunks = chunk_bounds(shape[dim], axis.size)
    c0, c1 = chunks[axis.index]
    out_shape = (*shape[:dim], c1 - c0, *shape[dim + 1 :])
    if math.prod(shape) == 0:
        return local.new_empty(out_shape)
    if dim == 0:
        return flat_ranges(local, elems, _shard_dim_elements(shape, 0, chunks), out_shape, axis)
    _check_local(local, elems[axis.index][1] - elems[axis.index][0], "ragged rows")
    stride = math.prod(shape[dim + 1 :])
    if dim >= k:
        # The chunked dim is a trailing dim of the local rows: pack one box per peer.
        ld = dim - k + 1
        my_rows = rows[axis.index][1] - rows[axis.index][0]
        per_row = row // shape[dim] if shape[dim] else 0
        pieces = [local.narrow(ld, s, e - s).reshape(-1) for s, e in chunks]
        send = torch.cat(pieces) if pieces else _flat(local)
        send_counts = [my_rows * (e - s) * per_row for s, e in chunks]
        recv_counts = [(e - s) * (c1 - c0) * per_row for s, e in rows]
        return _all_to_all(send, send_counts, recv_counts, axis).view(out_shape)
    # The chunked dim is inside the flattened rows: route every element by its index.
    lo, hi = elems[axis.index]
    chunk = chunks[0][1] - chunks[0][0]
    g = torch.arange(lo, hi, device=local.device)
    owner = _chunk_of(g, stride, shape[dim], chunk)
    order = torch.argsort(owner, stable=True)
    send = _flat(local)[order]
    send_counts = torch.bincount(owner, minlength=axis.size).tolist()
    recv_counts = [chunk_owner_count(s, e, stride, shape[dim], c0, c1) for s, e in elems]
    return _all_to_all(send, send_counts, recv_counts, axis).view(out_shape)


def shard_to_ragged(
    local: torch.Tensor, dim: int, rows: Bounds, shape: Sequence[int], k: int, axis: Axis
) -> torch.Tensor:
    """``Shard(dim)`` (``torch.chunk`` of the logical ``shape``) -> ragged rows."""
    shape = tuple(shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"Shard({dim}) is out of range for a tensor of shape {shape}")
    row = math.prod(shape[k:])
    elems = tuple((s * row, e * row) for s, e in rows)
    chunks = chunk_bounds(shape[dim], axis.size)
    c0, c1 = chunks[axis.index]
    my_rows = rows[axis.index][1] - rows[axis.index][0]
    out_shape = (my_rows, *shape[k:])
    if math.prod(shape) == 0:
        return local.new_empty(out_shape)
    _check_local(local, math.prod(shape) // shape[dim] * (c1 - c0), "Shard chunk")
    if dim == 0:
        return flat_ranges(local, _shard_dim_elements(shape, 0, chunks), elems, out_shape, axis)
    stride = math.prod(shape[dim + 1 :])
    if dim >= k:
        # My chunk, seen as rows, is already in peer order: send it as is.
        ld = dim - k + 1
        per_row = row // shape[dim] if shape[dim] else 0
        send_counts = [(e - s) * (c1 - c0) * per_row for s, e in rows]
        recv_counts = [my_rows * (e - s) * per_row for s, e in chunks]
        got = _all_to_all(_flat(local), send_counts, recv_counts, axis)
        parts = []
        start = 0
        for (s, e), n in zip(chunks, recv_counts):
            part_shape = list(out_shape)
            part_shape[ld] = e - s
            parts.append(got[start : start + n].view(part_shape))
            start += n
        return torch.cat(parts, dim=ld)
    # The chunked dim is inside the flattened rows: route every element by its index.
    inner = (c1 - c0) * stride
    period = shape[dim] * stride
    t = torch.arange(local.numel(), device=local.device)
    g = torch.div(t, inner, rounding_mode="floor") * period + c0 * stride + t % inner
    starts = torch.tensor([s for s, _ in elems[1:]], device=local.device)
    owner = torch.bucketize(g, starts, right=True)
    send_counts = torch.bincount(owner, minlength=axis.size).tolist()
    lo, hi = elems[axis.index]
    recv_counts = [chunk_owner_count(lo, hi, stride, shape[dim], s, e) for s, e in chunks]
    got = _all_to_all(_flat(local), send_counts, recv_counts, axis)
    mine = torch.arange(lo, hi, device=local.device)
    chunk = chunks[0][1] - chunks[0][0]
    out = torch.empty_like(got)
    out[torch.argsort(_chunk_of(mine, stride, shape[dim], chunk), stable=True)] = got
    return out.view(out_shape)
