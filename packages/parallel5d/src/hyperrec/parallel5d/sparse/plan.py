"""Where every row lives: a pure, deterministic sharding plan over the whole job.

Rows are placed over ``world_size`` *owners* (the ranks of the job, in the mesh's
replica-major order: owner ``o`` is replica ``o // group_size``, shard-group position
``o % group_size``). Row-wise tables are cut into ``world_size`` contiguous blocks, the
first ``num_rows % world_size`` one row longer (owners beyond ``num_rows`` hold none);
table-wise tables sit whole on one owner, chosen greedily (largest first, onto the owner
holding the fewest bytes). So replica ``r`` — one host when the shard group is a host —
holds a contiguous slice of every row-wise table.

Tables of one ``(dim, dtype)`` form a *group*: their ids share one key space
(``key = key_offset[table] + id``), one local storage per owner and one set of
collectives per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hyperrec.parallel5d._validate import check_int
from hyperrec.parallel5d.sparse.config import TableConfig

__all__ = ["GroupPlan", "ShardingPlan", "TablePlacement", "plan_sharding"]


@dataclass(frozen=True)
class TablePlacement:
    """One table's rows over the owners."""

    name: str
    """The table."""
    kind: str
    """``"row"`` or ``"table"``."""
    row_starts: tuple[int, ...]
    """``world_size + 1`` boundaries: owner ``o`` holds rows
    ``[row_starts[o], row_starts[o + 1])``."""

    def rows_on(self, owner: int) -> int:
        """Rows held by ``owner``."""
        return self.row_starts[owner + 1] - self.row_starts[owner]

    @property
    def rows_per_owner(self) -> tuple[int, ...]:
        """Rows held by each owner."""
        return tuple(b - a for a, b in zip(self.row_starts[:-1], self.row_starts[1:], strict=True))


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """Tables of one ``(dim, dtype)``: their key space and per-owner local storage."""

    dim: int
    dtype: torch.dtype
    tables: tuple[str, ...]
    """Table names in config order."""
    key_offsets: tuple[int, ...]
    """Key of row 0 of each table (``len(tables) + 1`` entries, the last = total rows)."""
    seg_key_start: np.ndarray
    """int64 ``[S]``: first key of each non-empty (table, owner) segment, ascending."""
    seg_owner: np.ndarray
    """int64 ``[S]``: the owner of each segment."""
    seg_local_start: np.ndarray
    """int64 ``[S]``: the segment's first row inside its owner's local storage."""
    local_rows: tuple[int, ...]
    """Rows of the local storage of each owner (the sum over the group's tables)."""
    table_local_start: np.ndarray
    """int64 ``[world_size, len(tables)]``: where each table's rows start in each owner's
    local storage (its rows there are ``rows_on(owner)`` long)."""


@dataclass(frozen=True, eq=False)
class ShardingPlan:
    """The placement of every table over ``world_size`` owners."""

    world_size: int
    tables: tuple[TablePlacement, ...]
    groups: tuple[GroupPlan, ...]

    def table(self, name: str) -> TablePlacement:
        """The placement of table ``name``."""
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def group_of(self, name: str) -> tuple[int, int]:
        """``(group index, position inside the group)`` of table ``name``."""
        for g, group in enumerate(self.groups):
            if name in group.tables:
                return g, group.tables.index(name)
        raise KeyError(name)


def _row_starts(num_rows: int, world_size: int) -> tuple[int, ...]:
    base, extra = divmod(num_rows, world_size)
    sizes = [base + (1 if o < extra else 0) for o in range(world_size)]
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))


def plan_sharding(
    tables: Sequence[TableConfig],
    world_size: int,
    *,
    table_wise_max_bytes: int = 1 << 20,
) -> ShardingPlan:
    """Place ``tables`` over ``world_size`` owners (pure; same result on every rank).

    Args:
        tables: the table configs (unique names).
        world_size: owners (ranks of the job); at least 1.
        table_wise_max_bytes: ``sharding="auto"`` tables of at most this many bytes of
            rows go whole on one owner; larger ones are row-wise. Default 1 MiB.

    Returns:
        The :class:`ShardingPlan`.

    Raises:
        TypeError: a table is not a :class:`TableConfig`, or a non-int count.
        ValueError: no tables, repeated names, ``world_size < 1``, or
            ``table_wise_max_bytes < 0``.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    table_wise_max_bytes = check_int("table_wise_max_bytes", table_wise_max_bytes, minimum=0)
    tables = tuple(tables)
    if not tables:
        raise ValueError("tables must hold at least one TableConfig, got none")
    for i, t in enumerate(tables):
        if not isinstance(t, TableConfig):
            raise TypeError(f"tables[{i}] must be a TableConfig, got {type(t).__name__}")
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tables must have unique names, got repeated {dup}")

    def kind(t: TableConfig) -> str:
        if t.sharding != "auto":
            return t.sharding
        return "table" if t.nbytes <= table_wise_max_bytes else "row"

    starts: dict[str, tuple[int, ...]] = {}
    load = np.zeros(world_size, dtype=np.int64)
    for t in tables:
        if kind(t) == "row":
            starts[t.name] = _row_starts(t.num_rows, world_size)
            rows = np.diff(np.asarray(starts[t.name], dtype=np.int64)).astype(np.int64)
            load += rows * (t.nbytes // t.num_rows)
    # Greedy, largest first: a deterministic balance of bytes (ties: config order, then
    # the lowest owner).
    whole = sorted((t for t in tables if kind(t) == "table"), key=lambda t: -t.nbytes)
    for t in whole:
        owner = int(np.argmin(load))
        load[owner] += t.nbytes
        starts[t.name] = tuple([0] * (owner + 1) + [t.num_rows] * (world_size - owner))
    placements = tuple(TablePlacement(t.name, kind(t), starts[t.name]) for t in tables)

    groups: list[GroupPlan] = []
    keys: dict[tuple[int, torch.dtype], list[TableConfig]] = {}
    for t in tables:
        keys.setdefault((t.dim, t.dtype), []).append(t)
    for (dim, dtype), members in keys.items():
        key_offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in members])])
        per_owner = np.array(
            [np.diff(np.asarray(starts[t.name], dtype=np.int64)) for t in members]
        )  # [tables, owners]
        table_local_start = np.zeros((world_size, len(members)), dtype=np.int64)
        if len(members) > 1:
            table_local_start[:, 1:] = np.cumsum(per_owner.T, axis=1)[:, :-1]
        seg_key, seg_owner, seg_local = [], [], []
        for i, t in enumerate(members):
            for o in range(world_size):
                if per_owner[i, o]:
                    seg_key.append(key_offsets[i] + starts[t.name][o])
                    seg_owner.append(o)
                    seg_local.append(table_local_start[o, i])
        groups.append(
            GroupPlan(
                dim=dim,
                dtype=dtype,
                tables=tuple(t.name for t in members),
                key_offsets=tuple(int(k) for k in key_offsets),
                seg_key_start=np.asarray(seg_key, dtype=np.int64),
                seg_owner=np.asarray(seg_owner, dtype=np.int64),
                seg_local_start=np.asarray(seg_local, dtype=np.int64),
                local_rows=tuple(int(x) for x in per_owner.sum(axis=0)),
                table_local_start=table_local_start,
            )
        )
    return ShardingPlan(world_size=world_size, tables=placements, groups=tuple(groups))
