"""The 5-D mesh: dense ``replicate x fsdp`` (experts: ``replicate x efsdp x ep``) and sparse
``sparse_dp x sparse_shard x sparse_replicate``, on a network ``Topology``.

Degrees follow torchtitan's ``ParallelDims`` rules: ``replicate * fsdp`` is the world
size; expert parallelism *borrows* its ranks from the dense FSDP axis (``ep`` divides
``fsdp``; it is not a factor of the world size), and the experts are FSDP-sharded over
the rest of it, ``efsdp = fsdp / ep``. The sparse (embedding) parameters use their own
factorisation of the same ranks: shard groups along ``sparse_shard`` and, innermost,
``sparse_replicate`` ranks that hold the same rows of a shard group (fully sharded
among themselves), optionally repeated ``sparse_dp`` times (TorchRec-style 2-D data
parallelism across shard groups).

Axes are laid out in slot order (see :mod:`hyperrec.parallel5d.topology`), innermost
fastest: ``ep`` is a block of consecutive slots, ``fsdp`` a larger block, ``replicate``
strides over blocks. Each axis has an intended tier (:data:`DEFAULT_AXIS_TIERS`): ``ep``
and ``sparse_replicate`` inside a host (NVLink), ``fsdp``/``efsdp`` inside a zone,
``replicate`` and ``sparse_shard`` anywhere. A group that crosses a slower tier than its
axis allows is an error naming the ranks and hosts involved.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyperrec.parallel5d._validate import check_bool, check_choice, check_int
from hyperrec.parallel5d.topology import TIERS, Tier, Topology

__all__ = [
    "AXES",
    "DEFAULT_AXIS_TIERS",
    "MeshSpec",
    "ParallelMesh",
    "axis_placement",
    "check_axis_tiers",
]

AXES: tuple[str, ...] = (
    "replicate",
    "fsdp",
    "ep",
    "efsdp",
    "sparse_dp",
    "sparse_shard",
    "sparse_replicate",
)
"""Named axes of a :class:`ParallelMesh`."""

DEFAULT_AXIS_TIERS: dict[str, Tier] = {
    "ep": "nvlink",
    "sparse_replicate": "nvlink",
    "fsdp": "rdma",
    "efsdp": "rdma",
    "replicate": "cross_zone",
    "sparse_shard": "cross_zone",
    "sparse_dp": "cross_zone",
}
"""Slowest tier each axis may cross (GEM's mapping: EP on NVLink, FSDP inside a zone,
replication across zones; sparse replicas on NVLink)."""

_VIEWS: dict[str, tuple[str, ...]] = {
    "dense": ("replicate", "fsdp"),
    "experts": ("replicate", "efsdp", "ep"),
    "sparse": ("sparse_dp", "sparse_shard", "sparse_replicate"),
}
_VIEW_OF = {axis: view for view, axes in _VIEWS.items() for axis in axes}

# DeviceMesh._unflatten (torch >= 2.10) keeps every view on one root mesh (shared rank
# map, flatten registry); older releases get one independent DeviceMesh per view.
_HAS_UNFLATTEN = hasattr(DeviceMesh, "_unflatten")


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Degrees of the mesh, validated once (pure data: no process group needed).

    ``world_size = replicate * fsdp``; ``efsdp = fsdp // ep``;
    ``sparse_shard = world_size // (sparse_replicate * sparse_dp)``.
    """

    replicate: int = 1
    """Dense replicas (HSDP's outer axis: gradients all-reduced across it)."""
    fsdp: int = 1
    """Dense FSDP shard degree (parameters all-gathered / gradients reduce-scattered)."""
    ep: int = 1
    """Expert-parallel degree: experts split over ``ep`` ranks of each FSDP group."""
    sparse_replicate: int = 1
    """Ranks (innermost, consecutive) holding the same shard-group position of the
    embedding tables, fully sharded among themselves."""
    sparse_dp: int = 1
    """Outermost sparse axis: independent copies of the whole sharded table set
    (TorchRec-style 2-D data parallelism across shard groups); 1 = fully sharded over
    every rank."""

    def __post_init__(self) -> None:
        for name in ("replicate", "fsdp", "ep", "sparse_replicate", "sparse_dp"):
            check_int(name, getattr(self, name), minimum=1)
        if self.fsdp % self.ep:
            raise ValueError(
                f"ep must divide fsdp (expert parallelism borrows its ranks from the dense "
                f"FSDP axis), got ep={self.ep}, fsdp={self.fsdp}"
            )
        if self.world_size % (self.sparse_replicate * self.sparse_dp):
            raise ValueError(
                f"sparse_replicate * sparse_dp must divide the world size {self.world_size}, "
                f"got {self.sparse_replicate} * {self.sparse_dp}"
            )

    @property
    def world_size(self) -> int:
        """``replicate * fsdp``."""
        return self.replicate * self.fsdp

    @property
    def efsdp(self) -> int:
        """Expert FSDP degree ``fsdp // ep``."""
        return self.fsdp // self.ep

    @property
    def sparse_shard(self) -> int:
        """Sparse shard-group size ``world_size // (sparse_replicate * sparse_dp)``."""
        return self.world_size // (self.sparse_replicate * self.sparse_dp)

    def size(self, axis: str) -> int:
        """Size of a named axis (see :data:`AXES`).

        Raises:
            ValueError: an unknown axis name.
        """
        check_choice("axis", axis, AXES)
        return int(getattr(self, axis))

    def view_shape(self, view: str) -> tuple[int, ...]:
        """Shape of view ``"dense"``, ``"experts"`` or ``"sparse"``."""
        check_choice("view", view, tuple(_VIEWS))
        return tuple(self.size(a) for a in _VIEWS[view])

    def groups(self, axis: str, world: np.ndarray | None = None) -> np.ndarray:
        """Every group of ``axis`` as rows of ranks, ``(world_size // size, size)``.

        ``world`` is the rank in each slot (:meth:`Topology.ranks_in_slot_order`);
        default the identity.
        """
        view = _VIEW_OF[check_choice("axis", axis, AXES)]
        w = np.arange(self.world_size) if world is None else np.asarray(world)
        if w.shape != (self.world_size,):
            raise ValueError(f"world must have {self.world_size} entries, got shape {w.shape}")
        arr = w.reshape(self.view_shape(view))
        pos = _VIEWS[view].index(axis)
        return np.moveaxis(arr, pos, -1).reshape(-1, self.size(axis))

    @classmethod
    def infer(
        cls,
        world_size: int,
        *,
        replicate: int | None = None,
        fsdp: int | None = None,
        ep: int = 1,
        sparse_replicate: int = 1,
        sparse_dp: int = 1,
        topology: Topology | None = None,
    ) -> MeshSpec:
        """Fill in the missing dense degree.

        With only one of ``replicate``/``fsdp`` given, the other is
        ``world_size // given``. With neither: FSDP over as many ranks as fit in one
        zone of ``topology`` (``gcd(world_size, GPUs per zone)``) and replication across
        the rest; without a topology, flat FSDP over every rank.

        Raises:
            ValueError: degrees that do not multiply to ``world_size`` or divide it.
        """
        world_size = check_int("world_size", world_size, minimum=1)
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        if replicate is None and fsdp is None:
            fsdp = world_size if topology is None else math.gcd(world_size, topology.gpus_per_zone)
        if replicate is None:
            fsdp = check_int("fsdp", fsdp, minimum=1)
            if world_size % fsdp:
                raise ValueError(f"fsdp must divide the world size {world_size}, got {fsdp}")
            replicate = world_size // fsdp
        elif fsdp is None:
            replicate = check_int("replicate", replicate, minimum=1)
            if world_size % replicate:
                raise ValueError(
                    f"replicate must divide the world size {world_size}, got {replicate}"
                )
            fsdp = world_size // replicate
        spec = cls(
            replicate=replicate,
            fsdp=fsdp,
            ep=ep,
            sparse_replicate=sparse_replicate,
            sparse_dp=sparse_dp,
        )
        if spec.world_size != world_size:
            raise ValueError(
                f"replicate * fsdp must equal the world size {world_size}, "
                f"got {replicate} * {fsdp} = {spec.world_size}"
            )
        return spec


def _resolve_tiers(axis_tiers: Mapping[str, str] | None) -> dict[str, Tier]:
    tiers = dict(DEFAULT_AXIS_TIERS)
    if axis_tiers is not None and not isinstance(axis_tiers, Mapping):
        raise TypeError(
            f"axis_tiers must be a mapping of axis to tier, got {type(axis_tiers).__name__}"
        )
    for axis, tier in (axis_tiers or {}).items():
        check_choice("axis_tiers key", axis, AXES)
        tiers[axis] = check_choice(f"axis_tiers[{axis!r}]", tier, TIERS[1:])
    return tiers


def axis_placement(spec: MeshSpec, topology: Topology) -> dict[str, dict[str, Any]]:
    """Per axis: the slowest tier its groups cross and how densely they sit on hosts/zones.

    Returns ``{axis: {"size", "tier", "ranks_per_host", "ranks_per_zone", "hosts",
    "zones"}}`` with the worst case over the axis's groups (``ranks_per_*``: the fewest
    ranks of a group on one host/zone; ``hosts``/``zones``: the most touched). This is
    what the cost model prices and what :func:`check_axis_tiers` checks.

    Raises:
        ValueError: ``spec`` and ``topology`` disagree on the world size.
    """
    _check_world(spec, topology)
    world = topology.ranks_in_slot_order()
    out: dict[str, dict[str, Any]] = {}
    for axis in AXES:
        span = topology.span(spec.groups(axis, world))
        out[axis] = {
            "size": spec.size(axis),
            "tier": TIERS[int(span.tier.max())],
            "ranks_per_host": int(span.ranks_per_host.min()),
            "ranks_per_zone": int(span.ranks_per_zone.min()),
            "hosts": int(span.hosts.max()),
            "zones": int(span.zones.max()),
        }
    return out


def _check_world(spec: MeshSpec, topology: Topology) -> None:
    if not isinstance(spec, MeshSpec):
        raise TypeError(f"spec must be a MeshSpec, got {type(spec).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if spec.world_size != topology.world_size:
        raise ValueError(
            f"the mesh has {spec.world_size} ranks (replicate={spec.replicate} x "
            f"fsdp={spec.fsdp}) but the topology has {topology.world_size} "
            f"({topology.hosts} hosts x {topology.gpus_per_host} GPUs)"
        )


def _violations(
    groups_by_axis: Mapping[str, np.ndarray], topology: Topology, tiers: Mapping[str, Tier]
) -> list[str]:
    problems = []
    for axis, groups in groups_by_axis.items():
        allowed = TIERS.index(tiers[axis])
        span = topology.span(groups)
        bad = np.flatnonzero(span.tier > allowed)
        if not len(bad):
            continue
        first = bad[0]
        crossed = TIERS[int(span.tier[first])]
        where = {"nvlink": "one host", "rdma": "one zone"}.get(tiers[axis], "the job")
        # Two ranks of that group linked over the tier crossed: the first rank and the
        # first one on another zone (cross_zone) or host (rdma). The group's first ranks
        # and hosts alone may all lie on one host.
        group = groups[first]
        hosts = topology.host_of(group)
        key = hosts // topology.zone_hosts if crossed == "cross_zone" else hosts
        j = int(np.flatnonzero(key != key[0])[0])
        pair = " and ".join(
            f"{int(group[i])} (host {int(hosts[i])}, zone {int(hosts[i]) // topology.zone_hosts})"
            for i in (0, j)
        )
        problems.append(
            f"axis {axis!r} (size {groups.shape[1]}) must stay inside {where} (tier "
            f"{tiers[axis]!r}), but {len(bad)} of its {len(groups)} groups cross tier "
            f"{crossed!r}: ranks {pair} are in one group; e.g. ranks {group.tolist()[:16]}"
            f"{' ...' if groups.shape[1] > 16 else ''} lie on "
            f"{topology.describe_group(group.tolist())}"
        )
    return problems


def check_axis_tiers(
    spec: MeshSpec, topology: Topology, *, axis_tiers: Mapping[str, str] | None = None
) -> None:
    """Raise if any axis of ``spec`` crosses a slower tier than it may (pure arithmetic).

    Args:
        axis_tiers: overrides of :data:`DEFAULT_AXIS_TIERS`, e.g.
            ``{"sparse_shard": "rdma"}`` to keep sparse shard groups inside a zone.

    Raises:
        ValueError: the world sizes differ, or the first misplaced axis (and any others),
            naming the ranks and the hosts/zones they sit on.
    """
    _check_world(spec, topology)
    tiers = _resolve_tiers(axis_tiers)
    world = topology.ranks_in_slot_order()
    problems = _violations({a: spec.groups(a, world) for a in AXES}, topology, tiers)
    if problems:
        raise ValueError("misplaced mesh axes: " + " | ".join(problems))


def _check_device_type(device_type: Any) -> None:
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str, got {type(device_type).__name__}")
    try:
        ok = torch.device(device_type).type == device_type  # no index: "cuda", not "cuda:0"
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"device_type must be a device type such as 'cuda' or 'cpu', got {device_type!r}"
        )


class ParallelMesh:
    """One object that validates the degrees once and hands out named sub-meshes.

    Built on ``DeviceMesh``: a 1-D world mesh in slot order, unflattened into three views
    over the same ranks (``dense``: ``(replicate, fsdp)``; ``experts``:
    ``(replicate, efsdp, ep)``; ``sparse``: ``(sparse_dp, sparse_shard,
    sparse_replicate)``). After building, the tier of every axis is asserted again on the
    process groups the ``DeviceMesh`` actually formed.

    Typical use::

        pm = ParallelMesh.from_env(ep=2)            # under torchrun, any world size
        for block in model.blocks:
            fully_shard(block.moe.experts, mesh=pm.expert_mesh)
            fully_shard(block, mesh=pm.dense_mesh)
        fully_shard(model, mesh=pm.dense_mesh)
        moe = RoutedExperts(..., ep_mesh=pm["ep"])

    Args:
        topology: where the ranks sit; its world size must equal the process group's.
        spec: the degrees; or give them as keywords (``replicate``, ``fsdp``, ``ep``,
            ``sparse_replicate``), completed by :meth:`MeshSpec.infer`.
        device_type: ``"cuda"`` or ``"cpu"``; default CUDA when available and the
            default group is not gloo.
        axis_tiers: overrides of :data:`DEFAULT_AXIS_TIERS`.
        check_tiers: ``False`` builds a misplaced mesh anyway (e.g. to measure the naive
            layout); the placement is still reported by :meth:`placement`.

    Raises:
        RuntimeError: no default process group.
        TypeError: arguments of the wrong type.
        ValueError: bad degrees, a world size other than the topology's, a misplaced
            axis (see :func:`check_axis_tiers`), a ``device_type`` that is not a device
            type, or a topology whose ``rank_order`` is not the identity.
    """

    def __init__(
        self,
        topology: Topology,
        spec: MeshSpec | None = None,
        *,
        device_type: str | None = None,
        axis_tiers: Mapping[str, str] | None = None,
        check_tiers: bool = True,
        **degrees: int | None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        check_bool("check_tiers", check_tiers)
        if device_type is not None:
            _check_device_type(device_type)
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh needs an initialised default process group "
                "(torch.distributed.init_process_group, or ParallelMesh.from_env)"
            )
        world = dist.get_world_size()
        if topology.world_size != world:
            raise ValueError(
                f"the topology has {topology.world_size} ranks ({topology.hosts} hosts x "
                f"{topology.gpus_per_host} GPUs) but the process group has {world}"
            )
        unknown = set(degrees) - {"replicate", "fsdp", "ep", "sparse_replicate", "sparse_dp"}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        if spec is None:
            kw = {k: v for k, v in degrees.items() if v is not None}
            spec = MeshSpec.infer(world, topology=topology, **kw)
        elif degrees:
            raise TypeError("give either spec or degree keywords, not both")
        if not isinstance(spec, MeshSpec):
            raise TypeError(f"spec must be a MeshSpec, got {type(spec).__name__}")
        _check_world(spec, topology)
        self.topology = topology
        self.spec = spec
        self._tiers = _resolve_tiers(axis_tiers)
        if check_tiers:
            check_axis_tiers(spec, topology, axis_tiers=axis_tiers)
        world_order = topology.ranks_in_slot_order()
        # Every named axis, then the world itself: the 'world', 'dp' and 'edp' meshes
        # hold the ranks in slot order too, so any order but the identity would give them
        # coordinates that disagree with their process groups (a DTensor sharded on them
        # would gather its shards permuted).
        candidates = [(f"axis {a!r}", spec.groups(a, world_order)) for a in AXES]
        candidates.append(("the 'world' and 'dp' meshes", world_order.reshape(1, -1)))
        for what, groups in candidates:
            down = np.diff(groups, axis=1) < 0
            unsorted = np.flatnonzero(down.any(axis=1))
            if len(unsorted):
                row = groups[unsorted[0]]
                k = int(np.flatnonzero(down[unsorted[0]])[0])
                raise ValueError(
                    f"rank_order puts the ranks of {what} out of increasing order "
                    f"(e.g. rank {int(row[k])} comes before rank {int(row[k + 1])} in "
                    f"{row.tolist()[:8]}{' ...' if len(row) > 8 else ''}): torch process "
                    "groups order their members by global rank, so collectives would "
                    "disagree with the mesh coordinates. Number the ranks in slot order "
                    "(zone, host, GPU) when launching instead; rank_order is for analysing "
                    "a placement (check_axis_tiers, the cost model)"
                )
        if device_type is None:
            device_type = (
                "cuda"
                if torch.cuda.is_available() and dist.get_backend() not in ("gloo", "fake")
                else "cpu"
            )
        self.device_type = device_type
        self._build()
        if check_tiers:
            # The same check on the groups DeviceMesh formed, not on our arithmetic.
            problems = _violations({a: self._mesh_groups(a) for a in AXES}, topology, self._tiers)
            if problems:  # pragma: no cover - would mean DeviceMesh laid ranks out otherwise
                raise ValueError("misplaced mesh axes: " + " | ".join(problems))

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        spec, dt = self.spec, self.device_type
        order = self.topology.ranks_in_slot_order()
        identity = bool((order == np.arange(len(order))).all())
        order_t = torch.as_tensor(order, dtype=torch.int64)
        if identity:
            self.world = init_device_mesh(dt, (spec.world_size,), mesh_dim_names=("world",))
        else:
            self.world = DeviceMesh(dt, order_t, mesh_dim_names=("world",))
        self.views: dict[str, DeviceMesh] = {}
        for view, names in _VIEWS.items():
            shape = spec.view_shape(view)
            if _HAS_UNFLATTEN:
                self.views[view] = self.world._unflatten(0, shape, names)
            else:  # pragma: no cover - torch without _unflatten
                self.views[view] = DeviceMesh(dt, order_t.reshape(shape), mesh_dim_names=names)
        self._flat: dict[str, DeviceMesh] = {}

    def _mesh_groups(self, axis: str) -> np.ndarray:
        view = self.views[_VIEW_OF[axis]]
        full = view.mesh.cpu().numpy()
        pos = _VIEWS[_VIEW_OF[axis]].index(axis)
        return np.moveaxis(full, pos, -1).reshape(-1, full.shape[pos])

    # ------------------------------------------------------------------ access
    @property
    def dense(self) -> DeviceMesh:
        """2-D ``(replicate, fsdp)`` view."""
        return self.views["dense"]

    @property
    def experts(self) -> DeviceMesh:
        """3-D ``(replicate, efsdp, ep)`` view."""
        return self.views["experts"]

    @property
    def sparse(self) -> DeviceMesh:
        """3-D ``(sparse_dp, sparse_shard, sparse_replicate)`` view."""
        return self.views["sparse"]

    @property
    def sparse_mesh(self) -> DeviceMesh:
        """2-D ``(sparse_shard, sparse_replicate)`` mesh of this rank's shard group (for
        the sparse embedding collection: the all-to-all axis and the fully-sharded
        replica axis)."""
        return self.sparse["sparse_shard", "sparse_replicate"]

    @property
    def dense_mesh(self) -> DeviceMesh:
        """Mesh for ``fully_shard`` of dense modules: ``(replicate, fsdp)`` (HSDP), or the
        1-D ``fsdp`` mesh when ``replicate`` is 1 (no all-reduce over a group of one)."""
        return self.dense if self.spec.replicate > 1 else self.dense["fsdp"]

    @property
    def expert_mesh(self) -> DeviceMesh:
        """Mesh for ``fully_shard`` of expert weights: ``(replicate, efsdp)``, or 1-D
        ``efsdp`` when ``replicate`` is 1."""
        if self.spec.replicate > 1:
            return self.experts["replicate", "efsdp"]
        return self.experts["efsdp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D ``ep`` mesh (the token all-to-all group)."""
        return self.experts["ep"]

    def __getitem__(self, axis: str) -> DeviceMesh:
        """1-D mesh of a named axis: one of :data:`AXES`, ``"world"``, ``"dp"`` (every
        data-parallel rank: ``replicate x fsdp`` flattened; for loss/metric averaging)
        or ``"edp"`` (``replicate x efsdp`` flattened: the ranks holding the same
        experts).

        Raises:
            KeyError: an unknown name.
        """
        if axis == "world":
            return self.world
        if axis in _VIEW_OF:
            return self.views[_VIEW_OF[axis]][axis]
        if axis in ("dp", "edp"):
            if axis not in self._flat:
                if axis == "dp":
                    sub = self.dense
                    trivial = self.spec.replicate == 1
                    self._flat[axis] = sub["fsdp"] if trivial else sub._flatten("dp")
                else:
                    sub = self.experts["replicate", "efsdp"]
                    trivial = self.spec.replicate == 1
                    self._flat[axis] = self.experts["efsdp"] if trivial else sub._flatten("edp")
            return self._flat[axis]
        raise KeyError(f"unknown mesh axis {axis!r}; choose one of {(*AXES, 'world', 'dp', 'edp')}")

    def size(self, axis: str) -> int:
        """Size of a named axis."""
        return self.spec.size(axis)

    def placement(self) -> dict[str, dict[str, Any]]:
        """Per axis: tier crossed and density (see :func:`axis_placement`)."""
        return axis_placement(self.spec, self.topology)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: degrees, topology, per-axis placement and intended tiers."""
        spec = self.spec
        return {
            "degrees": {a: spec.size(a) for a in AXES},
            "topology": self.topology.describe(),
            "placement": self.placement(),
            "axis_tiers": dict(self._tiers),
        }

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"ParallelMesh(world={s.world_size}, replicate={s.replicate}, fsdp={s.fsdp}, "
            f"ep={s.ep}, efsdp={s.efsdp}, sparse_dp={s.sparse_dp}, "
            f"sparse_shard={s.sparse_shard}, sparse_replicate={s.sparse_replicate})"
        )

    # ------------------------------------------------------------------ environment
    @classmethod
    def from_env(
        cls,
        *,
        replicate: int | None = None,
        fsdp: int | None = None,
        ep: int = 1,
        sparse_replicate: int = 1,
        sparse_dp: int = 1,
        topology: Topology | None = None,
        device_type: str | None = None,
        axis_tiers: Mapping[str, str] | None = None,
        check_tiers: bool = True,
        init_process_group: bool = True,
    ) -> ParallelMesh:
        """The mesh of this job, on any world size from 1 up.

        The topology comes from :meth:`Topology.from_env` unless given. If no default
        process group exists and ``init_process_group`` is true, one is created: for a
        single process (``WORLD_SIZE`` unset or 1) in-process (a ``HashStore``), else
        from the environment ``torchrun`` sets (``env://``); NCCL when CUDA is available,
        gloo otherwise. On one rank every axis has size 1 and collectives are no-ops.

        Raises:
            RuntimeError: no process group and ``init_process_group`` is false.
            ValueError: as :class:`ParallelMesh` and :meth:`Topology.from_env`.
        """
        topology = Topology.from_env() if topology is None else topology
        if not dist.is_initialized() and init_process_group:
            backend = "nccl" if torch.cuda.is_available() and device_type != "cpu" else "gloo"
            if topology.world_size == 1 and os.environ.get("WORLD_SIZE", "1") == "1":
                store = dist.HashStore()
                dist.init_process_group(backend, store=store, rank=0, world_size=1)
            else:
                dist.init_process_group(backend)
        return cls(
            topology,
            device_type=device_type,
            axis_tiers=axis_tiers,
            check_tiers=check_tiers,
            replicate=replicate,
            fsdp=fsdp,
            ep=ep,
            sparse_replicate=sparse_replicate,
            sparse_dp=sparse_dp,
        )
