"""The network a job runs on: hosts of GPUs on NVLink, zones of hosts on RDMA, zones.

A :class:`Topology` says how many GPUs share a host (NVLink domain), how many hosts
share a zone (a non-blocking RDMA fabric, e.g. a RoCE "AI zone") and how many zones the
job spans (linked by an oversubscribed aggregation layer), the figures of each tier
(:class:`Link`), and where each rank sits. It is pure data plus vectorised arithmetic:
nothing here talks to a process group, so meshes of 100,000 ranks are analysed in
milliseconds.

Physical positions are *slots*: slot ``s`` is GPU ``s % gpus_per_host`` of host
``s // gpus_per_host``, and hosts are numbered zone by zone (host ``h`` is in zone
``h // hosts_per_zone``; the last zone may be partial). By default rank ``r`` sits in
slot ``r`` -- what ``torchrun`` gives when node ranks are assigned zone by zone
(``RANK = node_rank * LOCAL_WORLD_SIZE + LOCAL_RANK``). A scheduler that places nodes
otherwise passes ``rank_order`` (the slot of every rank).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hyperrec.parallel5d._validate import check_float, check_int

__all__ = [
    "CROSS_ZONE_ROCE",
    "NVLINK_H200",
    "ROCE_400G",
    "TIERS",
    "GroupSpan",
    "Link",
    "Tier",
    "Topology",
]

Tier = Literal["local", "nvlink", "rdma", "cross_zone"]
"""Network tiers, fastest first. ``"local"``: a group of one rank (no link used)."""
TIERS: tuple[Tier, ...] = ("local", "nvlink", "rdma", "cross_zone")


@dataclass(frozen=True, kw_only=True)
class Link:
    """The figures of one network tier, per GPU.

    ``bandwidth_gbps`` is a *bus bandwidth* in NCCL's sense (nccl-tests
    ``doc/PERFORMANCE.md``): the per-GPU rate at which a ring collective moves data
    when every GPU of the tier communicates at once, so that a ring all-gather of ``n``
    bytes over ``p`` ranks takes ``(p - 1) / p * n / bandwidth``.
    """

    bandwidth_gbps: float
    """Bus bandwidth per GPU and direction, GB/s (1e9 bytes/s)."""
    latency_us: float
    """Latency of one ring step on this tier, microseconds."""
    source: str = ""
    """Where the figures come from: ``"cited: ..."``, ``"measured: ..."`` or ``"assumed: ..."``."""

    def __post_init__(self) -> None:
        # Stored as Python floats: a numpy scalar would leave describe() not JSON-able.
        for name, minimum in (("bandwidth_gbps", 1e-9), ("latency_us", 0.0)):
            value = check_float(name, getattr(self, name), minimum=minimum)
            object.__setattr__(self, name, float(value))
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a str, got {type(self.source).__name__}")


NVLINK_H200 = Link(
    bandwidth_gbps=370.0,
    latency_us=3.4,
    source=(
        "cited: NCCL bus bandwidth on NVLink4 (H100/H200 SXM) ~370 GB/s per direction of "
        "450 line rate (nccl-tests#212, nccl#1442); ring-step latency 3.4 us = NCCL "
        "tuning.cc hwLat[NVLINK][RING][SIMPLE]"
    ),
)
"""H100/H200 SXM NVLink4 inside one 8-GPU host, as NCCL achieves it."""

ROCE_400G = Link(
    bandwidth_gbps=48.0,
    latency_us=9.6,
    source=(
        "cited: 400 Gb/s ConnectX-7 NIC per GPU, 46-48 GB/s achievable "
        "(nccl-tests#290, 48-49 in #267); ring-step latency 9.6 us = NCCL tuning.cc "
        "hwLat[NET][RING][SIMPLE]"
    ),
)
"""One 400 Gb/s RDMA NIC per GPU on a non-blocking (full-bisection) zone fabric."""

CROSS_ZONE_ROCE = Link(
    bandwidth_gbps=48.0 / 7.0,
    latency_us=19.2,
    source=(
        "cited+assumed: the 48 GB/s NIC share through an aggregation layer oversubscribed "
        "1:7 (Llama 3 paper, arXiv 2407.21783 sec. 3.3.1: pods of 3,072 GPUs at full "
        "bisection, 1:7 above them; recalled, not re-read); latency assumed 2x the "
        "in-zone ring step (two more switch tiers)"
    ),
)
"""Per-GPU share of the oversubscribed links between zones when every GPU crosses them."""


@dataclass(frozen=True)
class GroupSpan:
    """Where groups of ranks lie (one entry per group; arrays of equal length)."""

    tier: np.ndarray
    """Index into :data:`TIERS` of the slowest tier each group crosses (0: one rank)."""
    ranks_per_host: np.ndarray
    """Fewest of the group's ranks on any one of its hosts."""
    ranks_per_zone: np.ndarray
    """Fewest of the group's ranks in any one of its zones."""
    hosts: np.ndarray
    """Number of hosts each group touches."""
    zones: np.ndarray
    """Number of zones each group touches."""


def _count_distinct(a: np.ndarray) -> np.ndarray:
    s = np.sort(a, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


def _min_run(a: np.ndarray) -> np.ndarray:
    """Per row: the length of the shortest run of equal values once the row is sorted."""
    s = np.sort(a, axis=1)
    n, p = s.shape
    out = np.full(n, p, dtype=np.int64)
    if p == 0:
        return out
    edge = np.ones((n, p + 1), dtype=bool)  # run boundaries, both ends included
    edge[:, 1:p] = s[:, 1:] != s[:, :-1]
    rows, cols = np.nonzero(edge)
    same_row = rows[1:] == rows[:-1]
    np.minimum.at(out, rows[1:][same_row], (cols[1:] - cols[:-1])[same_row])
    return out


def _as_ranks(name: str, ranks: Any) -> np.ndarray:
    """``ranks`` as an int64 array; floats and bools are refused, not truncated."""
    r = np.asarray(ranks)
    if r.size and r.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer ranks, got an array of dtype {r.dtype}")
    return r.astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """GPUs per host, hosts per zone, zones; the figures of each tier; the rank order.

    Build one explicitly, or from the launcher's environment with :meth:`from_env`.
    """

    gpus_per_host: int
    """GPUs on one NVLink domain (``LOCAL_WORLD_SIZE`` under ``torchrun``)."""
    hosts: int
    """Hosts in the job."""
    hosts_per_zone: int | None = None
    """Hosts on one non-blocking RDMA fabric. ``None``: all hosts (one zone). The last
    zone holds the remainder when it does not divide ``hosts``."""
    nvlink: Link = NVLINK_H200
    """Links between GPUs of one host."""
    rdma: Link = ROCE_400G
    """Links between hosts of one zone."""
    cross_zone: Link = CROSS_ZONE_ROCE
    """Links between zones (per GPU, when every GPU crosses them at once)."""
    nvls_bandwidth_gbps: float | None = 480.0
    """All-reduce bus bandwidth with NVLink SHARP (in-switch reduction) for a group inside
    one host of at least ``nvls_min_gpus`` GPUs; ``None``: no NVLS. Default cited: ~480
    GB/s on 8 H100/H200 (nccl-tests#212, nccl#1442; 475 measured on H200, nccl-tests#272)."""
    nvls_min_gpus: int = 5
    """Smallest group NVLS helps (nccl#1455: 370 GB/s at 2-4 GPUs, 420-480 at 5-8)."""
    rank_order: tuple[int, ...] | None = field(default=None, repr=False)
    """Slot of every rank (a permutation of ``range(world_size)``); ``None``: rank ``r``
    in slot ``r``. For analysing a placement (``check_axis_tiers``, the cost model):
    :class:`~hyperrec.parallel5d.mesh.ParallelMesh` accepts only the identity order
    (torch process groups order their members by global rank, and its ``world`` and
    ``dp`` meshes hold every rank in slot order); number ranks in slot order at launch
    instead."""

    def __post_init__(self) -> None:
        # Sizes are stored as Python ints (numpy integers are accepted): describe() must
        # stay JSON-able.
        for name in ("gpus_per_host", "hosts", "nvls_min_gpus"):
            minimum = 2 if name == "nvls_min_gpus" else 1
            object.__setattr__(
                self, name, int(check_int(name, getattr(self, name), minimum=minimum))
            )
        if self.hosts_per_zone is not None:
            hpz = int(check_int("hosts_per_zone", self.hosts_per_zone, minimum=1))
            object.__setattr__(self, "hosts_per_zone", hpz)
            if self.hosts_per_zone > self.hosts:
                raise ValueError(
                    f"hosts_per_zone must be <= hosts ({self.hosts}), got {self.hosts_per_zone}"
                )
        for name in ("nvlink", "rdma", "cross_zone"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a Link, got {type(getattr(self, name)).__name__}")
        if self.nvls_bandwidth_gbps is not None:
            bw = check_float("nvls_bandwidth_gbps", self.nvls_bandwidth_gbps, minimum=1e-9)
            object.__setattr__(self, "nvls_bandwidth_gbps", float(bw))
        if self.rank_order is not None:
            order = tuple(self.rank_order)
            w = self.world_size
            if len(order) != w:
                raise ValueError(
                    f"rank_order must give a slot for each of the {w} ranks, got {len(order)}"
                )
            for i, x in enumerate(order):
                # np.asarray would silently read True as slot 1 and 2.0 as slot 2.
                if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral):
                    raise TypeError(
                        f"rank_order must hold int slots, got {type(x).__name__} {x!r} for rank {i}"
                    )
            if sorted(order) != list(range(w)):
                raise ValueError(f"rank_order must be a permutation of range({w})")
            object.__setattr__(self, "rank_order", tuple(int(x) for x in order))

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """``gpus_per_host * hosts``."""
        return self.gpus_per_host * self.hosts

    @property
    def zone_hosts(self) -> int:
        """Hosts per (full) zone."""
        return self.hosts if self.hosts_per_zone is None else self.hosts_per_zone

    @property
    def zones(self) -> int:
        """Zones the job spans (the last one may be partial)."""
        return math.ceil(self.hosts / self.zone_hosts)

    @property
    def gpus_per_zone(self) -> int:
        """GPUs in a full zone."""
        return self.zone_hosts * self.gpus_per_host

    def link(self, tier: Tier) -> Link:
        """The :class:`Link` of ``tier`` (``"nvlink"``, ``"rdma"`` or ``"cross_zone"``).

        Raises:
            ValueError: another name (``"local"`` has no link).
        """
        links = {"nvlink": self.nvlink, "rdma": self.rdma, "cross_zone": self.cross_zone}
        if tier not in links:
            raise ValueError(f"tier must be one of {tuple(links)}, got {tier!r}")
        return links[tier]

    # ------------------------------------------------------------------ placement
    def slots(self, ranks: Any = None) -> np.ndarray:
        """Slot of each rank in ``ranks`` (default: all ranks), as an int64 array.

        Raises:
            TypeError: ``ranks`` that are not integers (floats, bools).
            ValueError: a rank outside ``[0, world_size)``.
        """
        w = self.world_size
        table = np.arange(w) if self.rank_order is None else np.asarray(self.rank_order)
        if ranks is None:
            return table.astype(np.int64)
        r = _as_ranks("ranks", ranks)
        if r.size and (r.min() < 0 or r.max() >= w):
            raise ValueError(f"ranks must be in [0, {w}), got values in [{r.min()}, {r.max()}]")
        return table[r].astype(np.int64)

    def ranks_in_slot_order(self) -> np.ndarray:
        """The rank in each slot: ``out[s]`` sits in slot ``s``."""
        out = np.empty(self.world_size, dtype=np.int64)
        out[self.slots()] = np.arange(self.world_size)
        return out

    def host_of(self, ranks: Any) -> np.ndarray:
        """Host index of each rank."""
        return self.slots(ranks) // self.gpus_per_host

    def zone_of(self, ranks: Any) -> np.ndarray:
        """Zone index of each rank."""
        return self.host_of(ranks) // self.zone_hosts

    def tier_between(self, a: int, b: int) -> Tier:
        """The tier a message from rank ``a`` to rank ``b`` crosses.

        Raises:
            TypeError: a rank that is not an integer.
            ValueError: a rank outside ``[0, world_size)`` (even when ``a == b``).
        """
        ha, hb = self.host_of([a, b])  # validates both ranks, even when a == b
        if a == b:
            return "local"
        if ha == hb:
            return "nvlink"
        return "rdma" if ha // self.zone_hosts == hb // self.zone_hosts else "cross_zone"

    def span(self, groups: Any) -> GroupSpan:
        """Where each group of ranks lies; ``groups`` is ``(num_groups, group_size)``.

        Vectorised: analysing every group of a 100,000-rank axis takes milliseconds.

        Raises:
            TypeError: ``groups`` of floats or bools.
            ValueError: ``groups`` is not 2-D or holds ranks out of range.
        """
        g = _as_ranks("groups", groups)
        if g.ndim != 2:
            raise ValueError(f"groups must be 2-D (num_groups, group_size), got shape {g.shape}")
        hosts = self.host_of(g.reshape(-1)).reshape(g.shape)
        zones = hosts // self.zone_hosts
        n_hosts = _count_distinct(hosts)
        n_zones = _count_distinct(zones)
        tier = np.where(
            n_zones > 1, 3, np.where(n_hosts > 1, 2, np.where(g.shape[1] > 1, 1, 0))
        ).astype(np.int64)
        return GroupSpan(
            tier=tier,
            ranks_per_host=_min_run(hosts),
            ranks_per_zone=_min_run(zones),
            hosts=n_hosts,
            zones=n_zones,
        )

    def describe_group(self, ranks: Sequence[int], *, limit: int = 3) -> str:
        """Human-readable placement of one group: its zones, hosts and ranks per host."""
        ranks = [int(r) for r in ranks]
        hosts = self.host_of(ranks)
        by_host: dict[int, list[int]] = {}
        for r, h in zip(ranks, hosts):
            by_host.setdefault(int(h), []).append(r)
        zones = sorted({h // self.zone_hosts for h in by_host})
        zone_txt = ", ".join(map(str, zones[:4])) + (", ..." if len(zones) > 4 else "")
        parts = []
        for h, rs in list(by_host.items())[:limit]:
            shown = ", ".join(map(str, rs)) if len(rs) <= 6 else f"{rs[0]}, ..., {rs[-1]}"
            parts.append(f"host {h} (zone {h // self.zone_hosts}): ranks [{shown}]")
        more = f"; ... {len(by_host) - limit} more hosts" if len(by_host) > limit else ""
        return f"{len(by_host)} host(s) in zone(s) {zone_txt} -- " + "; ".join(parts) + more

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_env(
        cls,
        *,
        gpus_per_host: int | None = None,
        hosts_per_zone: int | None = None,
        env: Mapping[str, str] | None = None,
        **links: Any,
    ) -> Topology:
        """The topology of this job from the launcher's environment.

        Reads ``WORLD_SIZE`` (default 1) and ``LOCAL_WORLD_SIZE`` (set by ``torchrun``;
        GPUs per host), and ``HYPERREC_HOSTS_PER_ZONE`` (hosts on one RDMA fabric; default
        all hosts). Keyword arguments override the environment; ``links`` are passed to
        the constructor (``nvlink=``, ``rdma=``, ``cross_zone=``, ``nvls_bandwidth_gbps=``,
        ``rank_order=``).

        Raises:
            TypeError: ``gpus_per_host``/``hosts_per_zone`` that are not ints, or a
                variable of ``env`` that is not a str.
            ValueError: a variable that is not a positive decimal integer, ``WORLD_SIZE``
                or ``LOCAL_WORLD_SIZE`` missing while the other says several ranks, or a
                world size that is not a multiple of the GPUs per host.
        """
        env = os.environ if env is None else env

        def read(name: str) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return None
            if not isinstance(raw, str):
                raise TypeError(f"{name} must be a str, got {type(raw).__name__} {raw!r}")
            text = raw.strip()
            # Plain ASCII digits only: int() would also take "1_6", "+8" or non-ASCII digits.
            if not (text.isascii() and text.isdigit()) or int(text) < 1:
                raise ValueError(f"{name} must be a positive integer, got {raw!r}")
            return int(text)

        world_env = read("WORLD_SIZE")
        world = world_env or 1
        if gpus_per_host is None:
            gpus_per_host = read("LOCAL_WORLD_SIZE")
            if gpus_per_host is None:
                if world > 1:
                    raise ValueError(
                        f"LOCAL_WORLD_SIZE is not set but WORLD_SIZE is {world}: launch with "
                        "torchrun or pass gpus_per_host"
                    )
                gpus_per_host = 1
        gpus_per_host = check_int("gpus_per_host", gpus_per_host, minimum=1)
        if world_env is None and gpus_per_host > 1:
            raise ValueError(
                f"WORLD_SIZE is not set (one rank) but the GPUs per host (LOCAL_WORLD_SIZE / "
                f"gpus_per_host) are {gpus_per_host}: launch with torchrun or set WORLD_SIZE"
            )
        if world % gpus_per_host:
            raise ValueError(
                f"WORLD_SIZE ({world}) must be a multiple of the GPUs per host "
                f"(LOCAL_WORLD_SIZE / gpus_per_host = {gpus_per_host})"
            )
        if hosts_per_zone is None:
            hosts_per_zone = read("HYPERREC_HOSTS_PER_ZONE")
        else:  # checked before the comparison below (a float would be clamped silently)
            hosts_per_zone = check_int("hosts_per_zone", hosts_per_zone, minimum=1)
        hosts = world // gpus_per_host
        if hosts_per_zone is not None and hosts_per_zone > hosts:
            hosts_per_zone = hosts  # a job smaller than one zone lies in one zone
        return cls(gpus_per_host=gpus_per_host, hosts=hosts, hosts_per_zone=hosts_per_zone, **links)

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (sizes and link figures with their sources)."""

        def link(lk: Link) -> dict[str, Any]:
            return {
                "bandwidth_gbps": lk.bandwidth_gbps,
                "latency_us": lk.latency_us,
                "source": lk.source,
            }

        return {
            "world_size": self.world_size,
            "gpus_per_host": self.gpus_per_host,
            "hosts": self.hosts,
            "hosts_per_zone": self.zone_hosts,
            "zones": self.zones,
            "nvlink": link(self.nvlink),
            "rdma": link(self.rdma),
            "cross_zone": link(self.cross_zone),
            "nvls_bandwidth_gbps": self.nvls_bandwidth_gbps,
            "nvls_min_gpus": self.nvls_min_gpus,
            "rank_order": "identity" if self.rank_order is None else "custom",
        }
