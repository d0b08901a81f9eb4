"""Moving ids to their rows' owners and rows (forward) / row gradients (backward) back.

One lookup of one table group runs through ``stages``; each stage is an all-to-all over
one process group (a mesh axis). A stage receives *unique* keys and sends on unique
keys, so every duplicate of an id is merged the first time it meets another copy: on the
requesting rank (stage 0 input), inside the shard group (after the intra-group stage),
and on the owner. Forward, per stage: the number of keys to every peer (one small
all-to-all), then the keys (one all-to-all); backward runs the stages in reverse for the
rows, and forward again for the gradients, which are segment-summed (``index_add_``
over the stage's inverse index) wherever duplicates were merged. No dense gradient of a
table exists anywhere.

The stage plan (which peer each owner's keys go to) is built once per collection from
the mesh: see :class:`Stage`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommStats", "Stage", "StageRecord", "route_keys", "route_rows_back", "route_grads"]


@dataclass
class Stage:
    """One all-to-all hop: keys owned by owner ``o`` go to ``owner_to_peer[o]``."""

    label: str
    """``"intra_group"`` (inside one shard group) or ``"inter_group"`` (across replicas);
    a flat stage over the whole job mixes both and labels each peer."""
    group: dist.ProcessGroup
    """The process group of the hop."""
    size: int
    """Ranks in ``group``."""
    my_peer: int
    """This rank's index in ``group``."""
    owner_to_peer: torch.Tensor
    """int64 ``[world_size]`` on the compute device: the peer (group rank) that keys of
    each owner are sent to in this hop."""
    peer_labels: tuple[str, ...]
    """Tier label of each peer (``"intra_group"`` or ``"inter_group"``), for the byte
    counters."""


@dataclass
class StageRecord:
    """What one hop of one lookup did (kept for the return path and the backward)."""

    stage: Stage
    order: torch.Tensor
    """Permutation sorting the sender's unique keys by destination peer."""
    send_splits: list[int]
    recv_splits: list[int]
    inverse: torch.Tensor
    """For every received key, its index among the receiver's unique keys."""
    num_unique: int
    """Unique keys on the receiving side."""


@dataclass
class CommStats:
    """Bytes this rank sent to *other* ranks, by tier and phase (self-sends excluded).

    Phases: ``counts`` (the split sizes), ``ids`` (keys), ``rows`` (embeddings back),
    ``grads`` (row gradients to the owners). ``calls`` counts all-to-all launches.
    """

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    calls: int = 0

    def add(self, stage: Stage, phase: str, splits: list[int], row_bytes: int) -> None:
        self.calls += 1
        for peer, n in enumerate(splits):
            if peer == stage.my_peer or not n:
                continue
            tier = self.bytes.setdefault(stage.peer_labels[peer], {})
            tier[phase] = tier.get(phase, 0) + n * row_bytes

    def total(self, tier: str | None = None) -> int:
        """Bytes sent in ``tier`` (all tiers if ``None``)."""
        tiers = self.bytes.values() if tier is None else [self.bytes.get(tier, {})]
        return sum(sum(t.values()) for t in tiers)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls = 0

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": {k: dict(v) for k, v in self.bytes.items()}, "calls": self.calls}


def _all_to_all(
    stage: Stage,
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    stats: CommStats | None,
    phase: str,
) -> torch.Tensor:
    row_shape = tuple(send.shape[1:])
    out = send.new_empty((sum(recv_splits), *row_shape))
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=stage.group)
    if stats is not None:
        row_bytes = send.element_size() * (int(torch.tensor(row_shape).prod()) if row_shape else 1)
        stats.add(stage, phase, send_splits, row_bytes)
    return out


def route_keys(
    keys: torch.Tensor,
    stages: list[Stage],
    owner_of: Callable[[torch.Tensor], torch.Tensor],
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, list[StageRecord]]:
    """Send sorted unique ``keys`` through ``stages`` to their owners.

    Args:
        keys: int64 ``[U]``, sorted and unique.
        stages: the hops (empty on one rank).
        owner_of: key tensor -> owner index tensor.
        stats: byte counters to add to.

    Returns:
        ``(owned, records)``: the sorted unique keys this rank owns that some rank asked
        for, and one record per hop.
    """
    cur = keys
    records: list[StageRecord] = []
    for stage in stages:
        peer = stage.owner_to_peer[owner_of(cur)]
        order = torch.argsort(peer, stable=True)
        send_counts = torch.bincount(peer, minlength=stage.size)
        recv_counts = _all_to_all(
            stage, send_counts, [1] * stage.size, [1] * stage.size, stats, "counts"
        )
        # The only host syncs of a hop: NCCL needs the split sizes on the host.
        send_splits = send_counts.tolist()
        recv_splits = recv_counts.tolist()
        received = _all_to_all(stage, cur[order], send_splits, recv_splits, stats, "ids")
        nxt, inverse = torch.unique(received, sorted=True, return_inverse=True)
        records.append(
            StageRecord(stage, order, send_splits, recv_splits, inverse, int(nxt.numel()))
        )
        cur = nxt
    return cur, records


def route_rows_back(
    rows: torch.Tensor, records: list[StageRecord], stats: CommStats | None = None
) -> torch.Tensor:
    """Rows of the owner's unique keys -> rows of the requester's unique keys.

    Args:
        rows: ``[owned, dim]`` in the order :func:`route_keys` returned the owned keys.

    Returns:
        ``[U, dim]`` in the order of the ``keys`` given to :func:`route_keys`.
    """
    for rec in reversed(records):
        out = rows.index_select(0, rec.inverse)
        back = _all_to_all(rec.stage, out, rec.recv_splits, rec.send_splits, stats, "rows")
        rows = torch.empty_like(back)
        rows.index_copy_(0, rec.order, back)
    return rows


def route_grads(
    grad: torch.Tensor, records: list[StageRecord], stats: CommStats | None = None
) -> torch.Tensor:
    """Gradients of the requester's unique keys -> summed gradients of the owned keys.

    Duplicates merged by a hop are summed there (in float32, sent in ``grad``'s dtype).

    Args:
        grad: ``[U, dim]`` for the keys given to :func:`route_keys`.

    Returns:
        float32 ``[owned, dim]`` in the order of the owned keys.
    """
    g = grad
    for rec in records:
        recv = _all_to_all(
            rec.stage,
            g.index_select(0, rec.order),
            rec.send_splits,
            rec.recv_splits,
            stats,
            "grads",
        )
        acc = torch.zeros(
            (rec.num_unique, *recv.shape[1:]), dtype=torch.float32, device=recv.device
        )
        acc.index_add_(0, rec.inverse, recv.float())
        g = acc if rec is records[-1] else acc.to(grad.dtype)
    return g.float()
