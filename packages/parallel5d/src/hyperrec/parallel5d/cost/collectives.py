"""Alpha-beta cost of one collective on one group of a mesh axis, per network tier.

Formulas (Thakur, Rabenseifner & Gropp 2005; nccl-tests ``doc/PERFORMANCE.md``; NCCL's
``src/graph/tuning.cc``), for ``p`` ranks and ``n`` bytes (the *full* buffer: gathered
output of an all-gather, input of a reduce-scatter, the buffer of an all-reduce, what
one rank sends in total for an all-to-all):

* ring all-gather / reduce-scatter: ``base + lat(p - 1 steps) + (p - 1) / p * n / B``
* ring all-reduce: ``base + lat(2 (p - 1) steps) + 2 (p - 1) / p * n / B``
* tree all-reduce (NCCL double binary tree): ``base + 2 ((p / hosts - 1) a_nvl +
  log2(hosts) a_net) + 2 n / (0.9 B)`` (tuning.cc: tree bus bandwidth x 0.9, algorithm
  bandwidth = bus / 2)
* NVLS all-reduce (NVLink SHARP, one host, >= ``nvls_min_gpus`` ranks):
  ``base + 2 a_nvl + 2 (p - 1) / p * n / B_nvls``
* pairwise all-to-all: ``base + sum over peers of a(tier to peer) + max(NVLink bytes /
  B_nvl, NIC bytes / B_nic + cross-zone bytes / B_xz)``: all-to-all cannot aggregate
  several NICs (nccl-tests#267), so each GPU's off-host traffic goes through its own NIC.

``lat(steps)`` splits a ring's steps as NCCL's tuning model does: ``hosts - 1`` of the
``p - 1`` steps cross hosts (``zones - 1`` of those cross zones), the rest are NVLink
steps. The bus bandwidth ``B`` of a group is the slowest of the tiers it spans, each
scaled by how many of the group's ranks share the tier's links: a group with ``g``
ranks on each host drives ``g`` NICs per host (``g * B_rdma``, capped by NVLink), one
with ``q`` ranks per zone gets ``q`` GPUs' share of the oversubscribed zone uplinks
(``q * B_cross_zone``). A ring crossing hosts with all 8 GPUs of each host so reaches
~8 x 48 GB/s, capped at NVLink's 370 (what NCCL achieves on 8-NIC hosts), and an
all-reduce across zones with one rank per zone gets one GPU's share of the uplink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from hyperrec.parallel5d._validate import check_bool, check_choice, check_float, check_int
from hyperrec.parallel5d.topology import TIERS, Topology

__all__ = [
    "BASE_LATENCY_US",
    "COLLECTIVES",
    "Collective",
    "GroupShape",
    "bus_bandwidth",
    "collective_time",
]

Collective = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
COLLECTIVES: tuple[Collective, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

BASE_LATENCY_US = 8.4
"""Fixed cost of launching one NCCL collective (tuning.cc ``baseLat[RING][SIMPLE]``)."""

_TREE_EFFICIENCY = 0.9  # tuning.cc: tree bus bandwidth = 0.9 x the graph's


@dataclass(frozen=True, kw_only=True)
class GroupShape:
    """Where one group of a mesh axis lies (see :func:`hyperrec.parallel5d.axis_placement`)."""

    size: int
    """Ranks in the group."""
    ranks_per_host: int = 1
    """Fewest of its ranks on one host."""
    ranks_per_zone: int = 1
    """Fewest of its ranks in one zone."""
    hosts: int = 1
    """Hosts it touches."""
    zones: int = 1
    """Zones it touches."""

    def __post_init__(self) -> None:
        check_int("size", self.size, minimum=1)
        for name in ("ranks_per_host", "ranks_per_zone", "hosts", "zones"):
            check_int(name, getattr(self, name), minimum=1)
        # Impossible placements priced silently before: more hosts than ranks gave a
        # ring a negative number of NVLink steps, more zones than hosts a negative
        # number of in-zone network steps.
        for name in ("ranks_per_host", "ranks_per_zone", "hosts"):
            if getattr(self, name) > self.size:
                raise ValueError(f"{name} must be <= size ({self.size}), got {getattr(self, name)}")
        if self.zones > self.hosts:
            raise ValueError(f"zones must be <= hosts ({self.hosts}), got {self.zones}")
        # Each host (zone) touched holds at least ranks_per_host (ranks_per_zone) of the
        # group's ranks: 4 per host on 2 hosts is 8 ranks, not 4 (priced as an NVLink-only
        # group before).
        for per, count in (("ranks_per_host", "hosts"), ("ranks_per_zone", "zones")):
            need = getattr(self, per) * getattr(self, count)
            if need > self.size:
                raise ValueError(
                    f"{per} x {count} must be <= size ({self.size}): {getattr(self, per)} x "
                    f"{getattr(self, count)} = {need} ranks"
                )

    @property
    def tier(self) -> str:
        """Slowest tier crossed."""
        if self.zones > 1:
            return TIERS[3]
        if self.hosts > 1:
            return TIERS[2]
        return TIERS[1] if self.size > 1 else TIERS[0]

    @classmethod
    def from_placement(cls, entry: dict[str, Any]) -> GroupShape:
        """From one entry of :func:`hyperrec.parallel5d.axis_placement`."""
        return cls(
            size=entry["size"],
            ranks_per_host=entry["ranks_per_host"],
            ranks_per_zone=entry["ranks_per_zone"],
            hosts=entry["hosts"],
            zones=entry["zones"],
        )


def bus_bandwidth(topology: Topology, shape: GroupShape) -> float:
    """Bus bandwidth (GB/s per rank) of a ring over the group: its slowest tier, scaled
    by the links the group's ranks share (module docstring). ``inf`` for one rank."""
    if shape.size == 1:
        return math.inf
    bws = []
    if shape.ranks_per_host > 1 or shape.hosts == 1:
        bws.append(topology.nvlink.bandwidth_gbps)
    if shape.hosts > 1:
        nics = min(shape.ranks_per_host, topology.gpus_per_host)
        bws.append(nics * topology.rdma.bandwidth_gbps)
    if shape.zones > 1:
        bws.append(shape.ranks_per_zone * topology.cross_zone.bandwidth_gbps)
    return min(bws)


def _ring_latency_s(topology: Topology, shape: GroupShape, steps: int, rounds: int) -> float:
    """Latency of ``steps`` ring steps, ``rounds`` passes around the ring."""
    inter = rounds * (shape.hosts - 1)
    cross = rounds * (shape.zones - 1)
    intra = steps - inter
    us = (
        intra * topology.nvlink.latency_us
        + (inter - cross) * topology.rdma.latency_us
        + cross * topology.cross_zone.latency_us
    )
    return us * 1e-6


def collective_time(
    topology: Topology,
    shape: GroupShape,
    collective: Collective,
    nbytes: float,
    *,
    algorithm: Literal["auto", "ring", "tree", "nvls"] = "auto",
    nvls: bool = True,
) -> tuple[float, str]:
    """Seconds one collective of ``nbytes`` takes on a group, and the algorithm priced.

    ``nbytes`` is the full buffer (module docstring). ``algorithm="auto"`` takes the
    fastest the group allows, as NCCL's tuner does: ring for all-gather/reduce-scatter,
    the best of ring, tree and (within one host, ``nvls=True``) NVLS for all-reduce,
    pairwise exchange for all-to-all. A group of one rank costs 0.

    Raises:
        TypeError: ``topology``/``shape`` of the wrong type, or a non-bool ``nvls``.
        ValueError: unknown collective/algorithm, negative bytes, or an algorithm the
            collective/group does not support.
    """
    # Wrong types failed with AttributeError ('int' object has no attribute 'size'), and a
    # truthy non-bool nvls (e.g. 1) was taken as True.
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if not isinstance(shape, GroupShape):
        raise TypeError(f"shape must be a GroupShape, got {type(shape).__name__}")
    check_choice("collective", collective, COLLECTIVES)
    check_choice("algorithm", algorithm, ("auto", "ring", "tree", "nvls"))
    check_bool("nvls", nvls)
    nbytes = check_float("nbytes", nbytes, minimum=0.0)
    p = shape.size
    if p == 1:
        return 0.0, "none"
    base = BASE_LATENCY_US * 1e-6
    bw = bus_bandwidth(topology, shape) * 1e9

    if collective == "all_to_all":
        if algorithm not in ("auto", "ring"):
            raise ValueError(f"algorithm must be 'auto' for all_to_all, got {algorithm!r}")
        g, q = shape.ranks_per_host, shape.ranks_per_zone
        # A group on one host (zone) has all its ranks there, whatever the per-host
        # (per-zone) counts say: price its peers on the tier ``hosts`` / ``zones`` name,
        # as the ring formulas and ``bus_bandwidth`` do.
        if shape.hosts == 1:
            g = p
        if shape.zones == 1:
            q = p
        g, q = min(g, p), min(max(q, g), p)
        nvl_bytes = (g - 1) / p * nbytes
        nic_bytes = (q - g) / p * nbytes
        xz_bytes = (p - q) / p * nbytes
        t_bw = max(
            nvl_bytes / (topology.nvlink.bandwidth_gbps * 1e9),
            nic_bytes / (topology.rdma.bandwidth_gbps * 1e9)
            + xz_bytes / (topology.cross_zone.bandwidth_gbps * 1e9),
        )
        lat_us = (
            (g - 1) * topology.nvlink.latency_us
            + (q - g) * topology.rdma.latency_us
            + (p - q) * topology.cross_zone.latency_us
        )
        return base + lat_us * 1e-6 + t_bw, "pairwise"

    if collective in ("all_gather", "reduce_scatter"):
        if algorithm not in ("auto", "ring"):
            raise ValueError(
                f"algorithm must be 'ring' or 'auto' for {collective}, got {algorithm!r}"
            )
        t = base + _ring_latency_s(topology, shape, p - 1, 1) + (p - 1) / p * nbytes / bw
        return t, "ring"

    options: dict[str, float] = {}
    if algorithm in ("auto", "ring"):
        options["ring"] = (
            base + _ring_latency_s(topology, shape, 2 * (p - 1), 2) + 2 * (p - 1) / p * nbytes / bw
        )
    if algorithm in ("auto", "tree"):
        a_net = topology.cross_zone.latency_us if shape.zones > 1 else topology.rdma.latency_us
        per_host = max(p // shape.hosts, 1)
        lat_us = 2 * ((per_host - 1) * topology.nvlink.latency_us + math.log2(shape.hosts) * a_net)
        options["tree"] = base + lat_us * 1e-6 + 2 * nbytes / (_TREE_EFFICIENCY * bw)
    nvls_ok = (
        nvls
        and shape.hosts == 1
        and p >= topology.nvls_min_gpus
        and topology.nvls_bandwidth_gbps is not None
    )
    if algorithm == "nvls" and not nvls_ok:
        raise ValueError(
            "algorithm 'nvls' needs a group inside one host of at least "
            f"{topology.nvls_min_gpus} ranks and a topology with nvls_bandwidth_gbps"
        )
    if algorithm in ("auto", "nvls") and nvls_ok:
        nvls_bw = float(topology.nvls_bandwidth_gbps or 0.0) * 1e9
        options["nvls"] = (
            base + 2 * topology.nvlink.latency_us * 1e-6 + 2 * (p - 1) / p * nbytes / nvls_bw
        )
    best = min(options, key=options.__getitem__)
    return options[best], best
