"""Bytes per tier per step and bytes per rank of sparse-parallel designs (analytic).

The job is ``replicas x group_size`` ranks. Tier ``"intra_group"`` is traffic between
ranks of one shard group (the fast tier when a group is a host: NVLink), tier
``"inter_group"`` between ranks of different groups (the slow tier: the NICs). Figures
are bytes *sent by one rank to other ranks* in one training step (forward + backward +
whatever synchronisation the design needs), expected values for ids spread evenly over
the owners (hashed ids); :func:`sparse_memory` gives rows + optimizer state bytes per
rank. Designs:

``"hierarchical"`` (this package, the default): rows sharded over all ranks; ids
    deduplicated per rank, routed inside the group to the owner's group position,
    deduplicated again over the whole group, then routed across replicas; rows and
    gradients retrace the path. Memory ``T / world``.
``"flat"``: rows sharded over all ranks, one all-to-all over the whole job (ids
    deduplicated per rank only). Memory ``T / world``.
``"torchrec_2d"``: TorchRec's 2-D sparse parallelism with the sharding group inside a
    host: rows sharded over the group, every group a full replica; the in-group
    all-to-all, plus an all-reduce of rows and optimizer state across replicas every
    ``sync_interval`` steps. Memory ``T / group_size``.
``"torchrec_2d_strided"``: the same with TorchRec's default strided groups (a group spans
    hosts, replicas share a host): the all-to-all crosses hosts, the all-reduce does not.
``"fully_sharded_2d_strided"``: GEM / TorchRec fully sharded 2-D on strided groups: the
    group's rows are further sharded over the replicas; each step all-gathers them on
    the fast tier before the lookup and reduce-scatters rows + state after the update;
    the all-to-all crosses hosts. Memory ``T / world`` at rest, ``T / group_size`` at peak.

Counted per step and rank (``U``: unique ids of a rank, ``U_g``: unique ids of a whole
group, ``s``: a row's bytes, ``c``: an id's bytes): the hierarchical design sends
``(G-1)/G * U * (c + 2 s)`` inside the group and ``(R-1)/R * U_g / G * (c + 2 s)`` across
groups (+ ``c * (G-1)`` and ``c * (R-1)`` split counts); flat sends ``(W-1)/W * U *
(c + 2 s)`` of which ``(W-G)/W`` across groups. Since ``U_g <= G * U``, hierarchical never
sends more across groups than flat, and sends less whenever ranks of one group share ids
(Zipf heads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperrec.parallel5d._validate import check_float, check_int

__all__ = [
    "SCHEMES",
    "TableTraffic",
    "expected_unique",
    "sparse_memory",
    "sparse_traffic",
]

#: The designs compared by :func:`sparse_traffic` / :func:`sparse_memory`.
SCHEMES: tuple[str, ...] = (
    "hierarchical",
    "flat",
    "torchrec_2d",
    "torchrec_2d_strided",
    "fully_sharded_2d_strided",
)

_CHUNK = 1 << 22


def expected_unique(num_draws: float, num_rows: int, zipf_exponent: float = 0.0) -> float:
    """Expected distinct ids among ``num_draws`` i.i.d. draws from ``num_rows`` ids with
    ``P(id = k) ~ (k + 1) ** -zipf_exponent`` (0: uniform): ``sum_k 1 - (1 - p_k)^n``.

    Exact (summed in chunks of 4 M ids; a 100 M-row table takes about a second).

    Raises:
        TypeError / ValueError: non-numbers, ``num_draws < 0``, ``num_rows < 1`` or a
            negative exponent.
    """
    n = check_float("num_draws", num_draws, minimum=0.0)
    rows = check_int("num_rows", num_rows, minimum=1)
    s = check_float("zipf_exponent", zipf_exponent, minimum=0.0)
    if n == 0:
        return 0.0
    if s == 0:
        return rows * -math.expm1(n * math.log1p(-1.0 / rows)) if rows > 1 else 1.0
    norm = 0.0
    for lo in range(0, rows, _CHUNK):
        k = np.arange(lo + 1, min(rows, lo + _CHUNK) + 1, dtype=np.float64)
        norm += float(np.sum(k**-s))
    total = 0.0
    for lo in range(0, rows, _CHUNK):
        k = np.arange(lo + 1, min(rows, lo + _CHUNK) + 1, dtype=np.float64)
        p = k**-s / norm
        total += float(np.sum(-np.expm1(n * np.log1p(-np.minimum(p, 1.0 - 1e-16)))))
    return total


@dataclass(frozen=True, kw_only=True)
class TableTraffic:
    """One table's size and per-step lookups, as :func:`sparse_traffic` needs them."""

    num_rows: int
    """Rows of the table."""
    dim: int
    """Embedding width."""
    ids_per_rank: float
    """Ids one rank looks up in one step (all features reading the table)."""
    row_bytes_per_element: int = 4
    """Bytes of one element of a row (4: fp32, 2: bf16); rows and gradients travel in it."""
    state_bytes_per_row: int = 4
    """Optimizer state bytes per row (4: row-wise Adagrad; ``8 * dim``: Adam)."""
    zipf_exponent: float = 0.0
    """Id distribution for the expected unique counts (0: uniform)."""
    unique_per_rank: float | None = None
    """Override: unique ids per rank per step (e.g. measured)."""
    unique_per_group: float | None = None
    """Override: unique ids of a whole shard group per step (e.g. measured)."""

    def __post_init__(self) -> None:
        check_int("TableTraffic.num_rows", self.num_rows, minimum=1)
        check_int("TableTraffic.dim", self.dim, minimum=1)
        check_float("TableTraffic.ids_per_rank", self.ids_per_rank, minimum=0.0)
        check_int("TableTraffic.row_bytes_per_element", self.row_bytes_per_element, minimum=1)
        check_int("TableTraffic.state_bytes_per_row", self.state_bytes_per_row, minimum=0)
        check_float("TableTraffic.zipf_exponent", self.zipf_exponent, minimum=0.0)

    @property
    def row_bytes(self) -> int:
        return self.dim * self.row_bytes_per_element

    def uniques(self, group_size: int) -> tuple[float, float]:
        """``(unique ids per rank, unique ids per group)`` per step."""
        u = self.unique_per_rank
        if u is None:
            u = expected_unique(self.ids_per_rank, self.num_rows, self.zipf_exponent)
        ug = self.unique_per_group
        if ug is None:
            ug = expected_unique(self.ids_per_rank * group_size, self.num_rows, self.zipf_exponent)
        return u, ug


def _check_job(group_size: int, replicas: int) -> tuple[int, int]:
    return (
        check_int("group_size", group_size, minimum=1),
        check_int("replicas", replicas, minimum=1),
    )


def sparse_traffic(
    tables: Sequence[TableTraffic],
    *,
    group_size: int,
    replicas: int,
    sync_interval: int = 1,
    id_bytes: int = 8,
) -> dict[str, dict[str, float]]:
    """Expected bytes one rank sends per step, per design and tier.

    Args:
        tables: one :class:`TableTraffic` per table, all of one ``(dim, dtype)`` group
            (one set of collectives: the split counts, ``id_bytes`` per peer and hop, are
            counted once; call once per group and add the results for several groups).
        group_size: ranks of one shard group (``G``).
        replicas: shard groups (``R``); the job has ``G * R`` ranks.
        sync_interval: TorchRec designs synchronise rows every this many steps.
        id_bytes: bytes of one id on the wire (8: int64).

    Returns:
        ``{scheme: {"intra_group": bytes, "inter_group": bytes}}`` for :data:`SCHEMES`.

    Raises:
        TypeError / ValueError: non-int sizes below 1, or a non-:class:`TableTraffic`.
    """
    G, R = _check_job(group_size, replicas)
    check_int("sync_interval", sync_interval, minimum=1)
    check_int("id_bytes", id_bytes, minimum=1)
    W = G * R
    out = {s: {"intra_group": 0.0, "inter_group": 0.0} for s in SCHEMES}
    # split counts: one int per peer and hop, once for the group
    counts_group = id_bytes * (G - 1)
    out["hierarchical"]["intra_group"] += counts_group
    out["hierarchical"]["inter_group"] += id_bytes * (R - 1)
    out["flat"]["intra_group"] += counts_group
    out["flat"]["inter_group"] += id_bytes * (W - G)
    for s in ("torchrec_2d",):
        out[s]["intra_group"] += counts_group
    for s in ("torchrec_2d_strided", "fully_sharded_2d_strided"):
        out[s]["inter_group"] += counts_group
    for i, t in enumerate(tables):
        if not isinstance(t, TableTraffic):
            raise TypeError(f"tables[{i}] must be a TableTraffic, got {type(t).__name__}")
        u, ug = t.uniques(G)
        per_key = id_bytes + 2 * t.row_bytes  # id out, row back, gradient out
        sync_rows = t.num_rows / G * (t.row_bytes + t.state_bytes_per_row)
        a2a_group = (G - 1) / G * u * per_key
        # hierarchical
        h = out["hierarchical"]
        h["intra_group"] += a2a_group
        h["inter_group"] += (R - 1) / R * (ug / G) * per_key
        # flat over the whole job
        f = out["flat"]
        f["intra_group"] += (G - 1) / W * u * per_key
        f["inter_group"] += (W - G) / W * u * per_key
        # TorchRec 2-D: ring all-reduce sends 2 (R-1)/R of the group shard per rank
        allreduce = 2 * (R - 1) / R * sync_rows / sync_interval
        tr = out["torchrec_2d"]
        tr["intra_group"] += a2a_group
        tr["inter_group"] += allreduce
        trs = out["torchrec_2d_strided"]
        trs["inter_group"] += a2a_group
        trs["intra_group"] += allreduce
        # fully sharded 2-D (strided): all-gather rows + reduce-scatter rows and state
        fs = out["fully_sharded_2d_strided"]
        fs["inter_group"] += a2a_group
        fs["intra_group"] += (
            (R - 1) / R * (t.num_rows / G * t.row_bytes + sync_rows / sync_interval)
        )
    return out


def sparse_memory(
    tables: Sequence[TableTraffic],
    *,
    group_size: int,
    replicas: int,
    dense_state_bytes_per_element: int = 8,
) -> dict[str, dict[str, float]]:
    """Rows + optimizer state bytes per rank, at rest and at the peak of a step.

    The sparse designs' step peak adds only per-step rows (not counted here: they scale
    with the batch, not the tables). ``"dense_fully_shard"`` is the dense path: a table as
    one parameter sharded over all ranks with a dense optimizer of
    ``dense_state_bytes_per_element`` per element (8: AdamW) and a dense gradient; the
    forward gathers the whole table and the backward materialises its whole gradient.

    Returns:
        ``{scheme: {"at_rest": bytes, "peak": bytes}}`` for :data:`SCHEMES` +
        ``"dense_fully_shard"`` (the worst rank: shards rounded up to whole rows).
    """
    G, R = _check_job(group_size, replicas)
    W = G * R
    out = {s: {"at_rest": 0.0, "peak": 0.0} for s in (*SCHEMES, "dense_fully_shard")}
    for t in tables:
        per_row = t.row_bytes + t.state_bytes_per_row
        full_w, full_g = math.ceil(t.num_rows / W), math.ceil(t.num_rows / G)
        for s in ("hierarchical", "flat"):
            out[s]["at_rest"] += full_w * per_row
            out[s]["peak"] += full_w * per_row
        for s in ("torchrec_2d", "torchrec_2d_strided"):
            out[s]["at_rest"] += full_g * per_row
            out[s]["peak"] += full_g * per_row
        out["fully_sharded_2d_strided"]["at_rest"] += full_w * per_row
        out["fully_sharded_2d_strided"]["peak"] += full_w * per_row + full_g * t.row_bytes
        elem = t.row_bytes_per_element
        shard = full_w * t.dim * (2 * elem + dense_state_bytes_per_element)  # param, grad, states
        out["dense_fully_shard"]["at_rest"] += shard
        out["dense_fully_shard"]["peak"] += shard + t.num_rows * t.dim * 2 * elem
    return out
