"""Topology, MeshSpec and ParallelMesh against an independent reference, and hostile inputs.

The reference below is written from the documented layout alone: rank ``world[s]`` sits
in slot ``s``; the dense view is ``(replicate, fsdp)``, the expert view ``(replicate,
efsdp, ep)`` and the sparse view ``(sparse_dp, sparse_shard, sparse_replicate)``, each
laid over the slots innermost fastest; slot ``s`` is on host ``s // gpus_per_host``,
host ``h`` in zone ``h // hosts_per_zone``. A group of an axis is the ranks that share
every other coordinate of its view, ordered along the axis. Random valid configurations
(world sizes up to 4,096, partial last zones, shuffled rank orders) are compared on the
pure arithmetic (``MeshSpec.groups``, ``axis_placement``, ``check_axis_tiers``) and on
real ``DeviceMesh`` objects of the fake backend (every named mesh of one random rank).
Then hostile inputs: each must raise a ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d.mesh import (
    AXES,
    DEFAULT_AXIS_TIERS,
    MeshSpec,
    ParallelMesh,
    axis_placement,
    check_axis_tiers,
)
from hyperrec.parallel5d.topology import TIERS, Link, Topology

_VIEWS = {
    "dense": ("replicate", "fsdp"),
    "experts": ("replicate", "efsdp", "ep"),
    "sparse": ("sparse_dp", "sparse_shard", "sparse_replicate"),
}
_VIEW_OF = {"ep": "experts", "efsdp": "experts", "fsdp": "dense", "replicate": "dense"}


def _view(axis: str) -> tuple[str, ...]:
    return _VIEWS[_VIEW_OF.get(axis, "sparse")]


def _coords(deg: dict[str, int], s: int) -> dict[str, int]:
    """Coordinates of slot ``s`` on every axis, from the documented layout."""
    w = deg["replicate"] * deg["fsdp"]
    shard_block = w // deg["sparse_dp"]  # slots of one sparse_dp copy
    rep, f = divmod(s, deg["fsdp"])
    ef, e = divmod(f, deg["ep"])
    sd, rest = divmod(s, shard_block)
    sh, sr = divmod(rest, deg["sparse_replicate"])
    return {
        "replicate": rep,
        "fsdp": f,
        "efsdp": ef,
        "ep": e,
        "sparse_dp": sd,
        "sparse_shard": sh,
        "sparse_replicate": sr,
    }


def _ref_groups(deg: dict[str, int], rank_in_slot: list[int]) -> dict[str, list[list[int]]]:
    """Every group of every axis (sorted list of rows; each row in axis order)."""
    rows: dict[str, dict[tuple[int, ...], list[tuple[int, int]]]] = {a: {} for a in AXES}
    for s, r in enumerate(rank_in_slot):
        c = _coords(deg, s)
        for a in AXES:
            key = tuple(c[b] for b in _view(a) if b != a)
            rows[a].setdefault(key, []).append((c[a], r))
    return {a: sorted([[r for _, r in sorted(v)] for v in rows[a].values()]) for a in AXES}


def _ref_tier(group: list[int], slot_of: list[int], gph: int, hpz: int) -> int:
    hosts = {slot_of[r] // gph for r in group}
    zones = {h // hpz for h in hosts}
    return 3 if len(zones) > 1 else 2 if len(hosts) > 1 else 1 if len(group) > 1 else 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _configs(draw: st.DrawFn, max_world: int = 4096, permute: bool = True) -> tuple:
    gph = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    hosts = draw(st.integers(1, max_world // gph))
    hpz = draw(st.integers(1, hosts))
    w = gph * hosts
    fsdp = draw(st.sampled_from(_divisors(w)))
    ep = draw(st.sampled_from(_divisors(fsdp)))
    sr = draw(st.sampled_from(_divisors(w)))
    sd = draw(st.sampled_from(_divisors(w // sr)))
    order = None
    if permute and draw(st.booleans()):
        slots = list(range(w))
        random.Random(draw(st.integers(0, 2**32))).shuffle(slots)
        order = tuple(slots)
    topo = Topology(gpus_per_host=gph, hosts=hosts, hosts_per_zone=hpz, rank_order=order)
    deg = {"replicate": w // fsdp, "fsdp": fsdp, "ep": ep, "sparse_replicate": sr}
    deg["sparse_dp"] = sd
    return topo, deg


_ONES = dict.fromkeys(("replicate", "fsdp", "ep", "sparse_replicate", "sparse_dp"), 1)


def _slot_of(topo: Topology) -> list[int]:
    return list(topo.rank_order or range(topo.world_size))


def _rank_in_slot(topo: Topology) -> list[int]:
    out = [0] * topo.world_size
    for r, s in enumerate(_slot_of(topo)):
        out[s] = r
    return out


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.slow  # this package's own mesh arithmetic (no sibling API): not in `nox -s lowest`
@settings(max_examples=120, deadline=None)
@given(cfg=_configs())
@example(cfg=(Topology(gpus_per_host=1, hosts=1), _ONES))
def test_groups_placement_and_tiers_match_reference(cfg: tuple) -> None:
    topo, deg = cfg
    spec = MeshSpec(**deg)
    slot_of, gph, hpz = _slot_of(topo), topo.gpus_per_host, topo.zone_hosts
    ref = _ref_groups({**deg, "efsdp": spec.efsdp}, _rank_in_slot(topo))
    placement = axis_placement(spec, topo)
    violated = []
    for axis in AXES:
        got = spec.groups(axis, topo.ranks_in_slot_order())
        assert sorted(got.tolist()) == ref[axis], axis
        # Placement: worst case over the groups, by brute force.
        per_host, per_zone, n_hosts, n_zones, worst = [], [], [], [], 0
        for g in ref[axis]:
            hosts = [slot_of[r] // gph for r in g]
            zones = [h // hpz for h in hosts]
            per_host.append(min(hosts.count(h) for h in hosts))
            per_zone.append(min(zones.count(z) for z in zones))
            n_hosts.append(len(set(hosts)))
            n_zones.append(len(set(zones)))
            worst = max(worst, _ref_tier(g, slot_of, gph, hpz))
        assert placement[axis] == {
            "size": len(ref[axis][0]),
            "tier": TIERS[worst],
            "ranks_per_host": min(per_host),
            "ranks_per_zone": min(per_zone),
            "hosts": max(n_hosts),
            "zones": max(n_zones),
        }, axis
        if worst > TIERS.index(DEFAULT_AXIS_TIERS[axis]):
            violated.append(axis)
    if not violated:
        check_axis_tiers(spec, topo)
        return
    with pytest.raises(ValueError, match="misplaced mesh axes") as err:
        check_axis_tiers(spec, topo)
    parts = str(err.value).split(" | ")
    assert [re.match(r"(?:misplaced mesh axes: )?axis '(\w+)'", p)[1] for p in parts] == violated
    for axis, part in zip(violated, parts):
        # The two ranks named must be in one group of the axis and linked over the tier
        # the message says they cross, which is slower than the axis allows.
        m = re.search(
            r"cross tier '(\w+)': ranks (\d+) \(host (\d+), zone (\d+)\) and (\d+) "
            r"\(host (\d+), zone (\d+)\) are in one group",
            part,
        )
        assert m, part
        tier, a, ha, za, b, hb, zb = m[1], *map(int, m.groups()[1:])
        assert TIERS.index(tier) > TIERS.index(DEFAULT_AXIS_TIERS[axis])
        assert any(a in g and b in g for g in ref[axis])
        assert (ha, za) == (slot_of[a] // gph, slot_of[a] // gph // hpz)
        assert (hb, zb) == (slot_of[b] // gph, slot_of[b] // gph // hpz)
        assert _ref_tier([a, b], slot_of, gph, hpz) == TIERS.index(tier)


# ----------------------------------------------------------------------------- fake backend


def _fake_pg(world: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@settings(max_examples=30, deadline=None)
@given(cfg=_configs(max_world=2048, permute=False), pick=st.integers(0, 2**31))
@example(cfg=(Topology(gpus_per_host=1, hosts=1), _ONES), pick=0)
def test_parallel_mesh_matches_reference(cfg: tuple, pick: int) -> None:
    """Every named mesh of one rank, from the process groups DeviceMesh built (misplaced
    layouts too, with ``check_tiers=False``), against the reference groups."""
    topo, deg = cfg
    spec = MeshSpec(**deg)
    w = topo.world_size
    rank = pick % w
    ref = _ref_groups({**deg, "efsdp": spec.efsdp}, list(range(w)))
    mine = {a: next(g for g in ref[a] if rank in g) for a in AXES}
    e = mine["ep"].index(rank)
    mine["dp"] = list(range(w))
    mine["edp"] = [q for g in ref["ep"] for q in g[e : e + 1]]  # same ep coordinate
    mine["world"] = list(range(w))
    _fake_pg(w, rank)
    try:
        pm = ParallelMesh(topo, spec, device_type="cpu", check_tiers=False)
        for name, group in mine.items():
            m = pm[name]
            assert m.mesh.tolist() == sorted(group) == group, name
            # Mesh coordinate == rank in the process group == index in the group.
            assert m.get_local_rank() == m.get_coordinate()[0] == group.index(rank), name
            assert dist.get_process_group_ranks(m.get_group()) == group, name
        rep = rank // spec.fsdp
        dense = np.arange(w).reshape(spec.replicate, spec.fsdp)
        experts = np.arange(w).reshape(spec.replicate, spec.efsdp, spec.ep)[..., e]
        if spec.replicate == 1:
            dense, experts = dense[rep], experts[rep]
        assert np.array_equal(pm.dense_mesh.mesh.numpy(), dense)
        assert np.array_equal(pm.expert_mesh.mesh.numpy(), experts)
        assert np.array_equal(pm.ep_mesh.mesh.numpy(), mine["ep"])
        sparse = np.arange(w).reshape(spec.sparse_dp, spec.sparse_shard, spec.sparse_replicate)
        assert np.array_equal(pm.sparse_mesh.mesh.numpy(), sparse[rank // (w // spec.sparse_dp)])
        # With the tier check on, the mesh is built exactly when the reference allows it.
        slot_of = list(range(w))
        ok = all(
            _ref_tier(g, slot_of, topo.gpus_per_host, topo.zone_hosts)
            <= TIERS.index(DEFAULT_AXIS_TIERS[a])
            for a in AXES
            for g in ref[a]
        )
        if ok:
            ParallelMesh(topo, spec, device_type="cpu")
        else:
            with pytest.raises(ValueError, match="misplaced mesh axes"):
                ParallelMesh(topo, spec, device_type="cpu")
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    ("gph", "hosts", "order", "degrees"),
    [
        # 2 hosts x 2 GPUs: rank r holds slot order[r]; every named axis keeps its ranks
        # increasing, but the world in slot order is [0, 2, 1, 3].
        (2, 2, (0, 2, 1, 3), {"replicate": 2, "fsdp": 2, "sparse_dp": 2}),
        # 4 hosts x 4 GPUs, the transpose: slot 4 * h + g holds rank 4 * g + h.
        (
            4,
            4,
            tuple(4 * (r % 4) + r // 4 for r in range(16)),
            {"replicate": 4, "fsdp": 4, "sparse_dp": 4},
        ),
    ],
)
def test_rank_order_that_permutes_the_world_mesh_is_rejected(
    gph: int, hosts: int, order: tuple, degrees: dict
) -> None:
    """Was a silent wrong result: the 'world', 'dp' and 'edp' meshes hold the ranks in
    slot order, so their coordinates disagreed with their process groups' ranks (rank 1
    at coordinate 2), and a DTensor sharded on them gathered its shards permuted
    ([0, 1, 4, 5, 2, 3, 6, 7] for arange(8) on 4 gloo ranks)."""
    topo = Topology(gpus_per_host=gph, hosts=hosts, rank_order=order)
    spec = MeshSpec(**degrees)
    check_axis_tiers(spec, topo)  # fine for analysis
    w = topo.world_size
    _fake_pg(w, 1)
    try:
        with pytest.raises(
            ValueError, match=r"rank_order puts the ranks of the 'world' and 'dp' meshes out"
        ):
            ParallelMesh(topo, spec, device_type="cpu")
    finally:
        dist.destroy_process_group()


def test_rank_order_error_names_the_misordered_pair() -> None:
    """The pair out of order may lie past the first 8 ranks the message shows."""
    t = Topology(gpus_per_host=8, hosts=64, rank_order=tuple(range(8, 512)) + tuple(range(8)))
    _fake_pg(512, 0)
    try:
        with pytest.raises(ValueError, match=r"axis 'fsdp' .*rank 511 comes before rank 0"):
            ParallelMesh(t, MeshSpec(fsdp=512), device_type="cpu")
    finally:
        dist.destroy_process_group()


def test_tier_error_names_ranks_that_cross() -> None:
    """An FSDP group of 4,096 ranks across two zones: the message used to show only its
    first 16 ranks and 3 hosts, all in zone 0."""
    t = Topology(gpus_per_host=8, hosts=512, hosts_per_zone=384)
    with pytest.raises(
        ValueError,
        match=r"axis 'fsdp' .* cross tier 'cross_zone': ranks 0 \(host 0, zone 0\) and "
        r"3072 \(host 384, zone 1\) are in one group",
    ):
        check_axis_tiers(MeshSpec(fsdp=4096), t)
    with pytest.raises(
        ValueError,
        match=r"axis 'ep' .* cross tier 'rdma': ranks 0 \(host 0, zone 0\) and "
        r"8 \(host 1, zone 0\) are in one group",
    ):
        check_axis_tiers(MeshSpec(replicate=4, fsdp=1024, ep=16), t)


def test_numpy_sizes_are_stored_as_python_numbers() -> None:
    """describe() is documented JSON-able; numpy sizes used to be kept as they came."""
    lk = Link(bandwidth_gbps=np.float32(300.0), latency_us=np.float32(3.0))
    t = Topology(
        gpus_per_host=np.int64(8),
        hosts=np.int32(4),
        hosts_per_zone=np.int64(2),
        nvlink=lk,
        nvls_bandwidth_gbps=np.float32(480.0),
        nvls_min_gpus=np.int16(5),
    )
    d = json.loads(json.dumps(t.describe()))
    assert (d["world_size"], d["zones"], d["nvlink"]["bandwidth_gbps"]) == (32, 2, 300.0)
    assert type(t.gpus_per_host) is int and type(lk.latency_us) is float


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda t: t.host_of([3.7]), TypeError, "ranks must be integer ranks"),
        (lambda t: t.slots(np.array([True, False])), TypeError, "ranks must be integer"),
        (lambda t: t.span([[0.5, 4.2]]), TypeError, "groups must be integer ranks"),
        (lambda t: t.tier_between(9, 9), ValueError, r"ranks must be in \[0, 8\)"),
        (lambda t: t.tier_between(-1, -1), ValueError, r"ranks must be in \[0, 8\)"),
    ],
    ids=["float-rank", "bool-ranks", "float-groups", "equal-out-of-range", "equal-negative"],
)
def test_topology_ranks_are_checked_not_truncated(call, exc: type, match: str) -> None:
    """Were silent: floats truncated to a rank, and an out-of-range rank paired with
    itself answered 'local'."""
    with pytest.raises(exc, match=match):
        call(Topology(gpus_per_host=4, hosts=2))


@pytest.mark.parametrize(
    ("order", "exc", "match"),
    [
        ((True, 0), TypeError, "rank_order must hold int slots, got bool True for rank 0"),
        ((0, np.True_), TypeError, "rank_order must hold int slots, got bool np.True_ for rank 1"),
        ((1.0, 0.0), TypeError, "rank_order must hold int slots, got float"),
        (("1", "0"), TypeError, "rank_order must hold int slots, got str"),
        ((1, 1), ValueError, r"rank_order must be a permutation of range\(2\)"),
        ((np.int64(1), 0), None, None),
    ],
)
def test_rank_order_entries(order: tuple, exc: type | None, match: str | None) -> None:
    if exc is None:
        assert Topology(gpus_per_host=2, hosts=1, rank_order=order).rank_order == (1, 0)
        return
    with pytest.raises(exc, match=match):
        Topology(gpus_per_host=2, hosts=1, rank_order=order)


_ENV = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}


@pytest.mark.parametrize(
    ("env", "kwargs", "exc", "match"),
    [
        # Were accepted: int() reads "1_6" as 16 and Arabic-Indic digits as 8; a float
        # hosts_per_zone was compared, clamped and kept; a str one failed inside '>'.
        ({**_ENV, "WORLD_SIZE": "1_6"}, {}, ValueError, "WORLD_SIZE must be a positive"),
        ({**_ENV, "LOCAL_WORLD_SIZE": "\u0668"}, {}, ValueError, "LOCAL_WORLD_SIZE must be"),
        ({**_ENV, "HYPERREC_HOSTS_PER_ZONE": "+1"}, {}, ValueError, "HYPERREC_HOSTS_PER_ZONE"),
        (_ENV, {"hosts_per_zone": 2.5}, TypeError, "hosts_per_zone must be an int"),
        (_ENV, {"hosts_per_zone": "2"}, TypeError, "hosts_per_zone must be an int"),
        (_ENV, {"hosts_per_zone": True}, TypeError, "hosts_per_zone must be an int"),
        (_ENV, {"hosts_per_zone": 0}, ValueError, "hosts_per_zone must be >= 1"),
        ({**_ENV, "WORLD_SIZE": 16}, {}, TypeError, "WORLD_SIZE must be a str"),
        # Was "WORLD_SIZE (1) must be a multiple ...": the 1 is a default, not a value.
        ({"LOCAL_WORLD_SIZE": "8"}, {}, ValueError, "WORLD_SIZE is not set .* are 8"),
        ({}, {"gpus_per_host": 4}, ValueError, "WORLD_SIZE is not set .* are 4"),
        # Already rejected; kept as part of the sweep.
        ({**_ENV, "WORLD_SIZE": "16.0"}, {}, ValueError, "WORLD_SIZE must be a positive"),
        ({**_ENV, "WORLD_SIZE": "-16"}, {}, ValueError, "WORLD_SIZE must be a positive"),
        ({**_ENV, "LOCAL_WORLD_SIZE": "0"}, {}, ValueError, "LOCAL_WORLD_SIZE must be a pos"),
        ({**_ENV, "LOCAL_WORLD_SIZE": "6"}, {}, ValueError, r"WORLD_SIZE \(16\) must be a mul"),
        ({**_ENV, "LOCAL_WORLD_SIZE": "32"}, {}, ValueError, r"WORLD_SIZE \(16\) must be a mul"),
        ({"WORLD_SIZE": "16"}, {}, ValueError, "LOCAL_WORLD_SIZE is not set"),
        (_ENV, {"gpus_per_host": 2.0}, TypeError, "gpus_per_host must be an int"),
    ],
)
def test_from_env_malformed(env: dict, kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        Topology.from_env(env=env, **kwargs)


def test_from_env_accepts_launcher_values() -> None:
    t = Topology.from_env(env={"WORLD_SIZE": " 16\n", "LOCAL_WORLD_SIZE": "8", "X": "y"})
    assert (t.world_size, t.gpus_per_host, t.zones) == (16, 8, 1)
    t = Topology.from_env(env={**_ENV, "HYPERREC_HOSTS_PER_ZONE": "64"})  # > hosts: one zone
    assert (t.hosts, t.zone_hosts) == (2, 2)
    assert Topology.from_env(env={"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": ""}).world_size == 1


# ----------------------------------------------------------------------------- hostile degrees

_T16 = Topology(gpus_per_host=4, hosts=4, hosts_per_zone=2)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: MeshSpec(fsdp=0), ValueError, "fsdp must be >= 1"),
        (lambda: MeshSpec(replicate=-2), ValueError, "replicate must be >= 1"),
        (lambda: MeshSpec(fsdp=True), TypeError, "fsdp must be an int, got bool"),
        (lambda: MeshSpec(fsdp=4.0), TypeError, "fsdp must be an int, got float"),
        (lambda: MeshSpec(fsdp=8, ep=3), ValueError, "ep must divide fsdp"),
        (lambda: MeshSpec(fsdp=4, ep=8), ValueError, "ep must divide fsdp"),
        (lambda: MeshSpec(fsdp=6, sparse_replicate=4), ValueError, "sparse_replicate"),
        (lambda: MeshSpec(fsdp=8, sparse_replicate=4, sparse_dp=4), ValueError, "sparse_dp"),
        (lambda: MeshSpec(fsdp=8, sparse_dp=1.0), TypeError, "sparse_dp must be an int"),
        (lambda: MeshSpec.infer(0), ValueError, "world_size must be >= 1"),
        (lambda: MeshSpec.infer(16, fsdp=3), ValueError, "fsdp must divide the world size"),
        (lambda: MeshSpec.infer(16, replicate=5), ValueError, "replicate must divide"),
        (lambda: MeshSpec.infer(16, replicate=2.0), TypeError, "replicate must be an int"),
        (lambda: MeshSpec.infer(16, fsdp=8, replicate=4), ValueError, "must equal the world"),
        (lambda: MeshSpec.infer(16, ep=3), ValueError, "ep must divide fsdp"),
        (lambda: MeshSpec.infer(16, topology="2 hosts"), TypeError, "topology must be a Top"),
        (lambda: check_axis_tiers(MeshSpec(fsdp=8), _T16), ValueError, "the mesh has 8 ranks"),
        (lambda: check_axis_tiers({"fsdp": 16}, _T16), TypeError, "spec must be a MeshSpec"),
        (lambda: axis_placement(MeshSpec(fsdp=16), 16), TypeError, "topology must be a Top"),
        # ep larger than a host; fsdp over two zones; replicate kept inside a zone.
        (
            lambda: check_axis_tiers(MeshSpec(replicate=2, fsdp=8, ep=8), _T16),
            ValueError,
            r"axis 'ep' \(size 8\) must stay inside one host .* cross tier 'rdma'",
        ),
        (
            lambda: check_axis_tiers(MeshSpec(fsdp=16), _T16),
            ValueError,
            r"axis 'fsdp' \(size 16\) must stay inside one zone .* cross tier 'cross_zone'",
        ),
        (
            lambda: check_axis_tiers(
                MeshSpec(replicate=2, fsdp=8), _T16, axis_tiers={"replicate": "rdma"}
            ),
            ValueError,
            r"axis 'replicate' \(size 2\) must stay inside one zone",
        ),
        (
            lambda: check_axis_tiers(MeshSpec(fsdp=16), _T16, axis_tiers=[("fsdp", "x")]),
            TypeError,
            "axis_tiers must be a mapping",
        ),
        (
            lambda: check_axis_tiers(MeshSpec(fsdp=16), _T16, axis_tiers={"ep": "local"}),
            ValueError,
            r"axis_tiers\['ep'\] must be one of",
        ),
        (lambda: Topology(gpus_per_host=8, hosts=0), ValueError, "hosts must be >= 1"),
        (lambda: Topology(gpus_per_host=-8, hosts=1), ValueError, "gpus_per_host must be >="),
        (lambda: Topology(gpus_per_host=8, hosts=2, hosts_per_zone=2.0), TypeError, "hosts_per"),
    ],
)
def test_hostile_degrees(call, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_replicate_across_zones_and_one_rank_are_fine() -> None:
    # Replication may cross zones (its default tier); partial last zone.
    t = Topology(gpus_per_host=4, hosts=6, hosts_per_zone=4)
    spec = MeshSpec.infer(24, topology=t, ep=4, sparse_replicate=4)
    assert (spec.replicate, spec.fsdp) == (3, 8)
    check_axis_tiers(spec, t)
    assert axis_placement(spec, t)["replicate"]["tier"] == "cross_zone"
    # One rank: every axis local.
    one = Topology(gpus_per_host=1, hosts=1)
    assert {p["tier"] for p in axis_placement(MeshSpec(), one).values()} == {"local"}


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"device_type": 5}, TypeError, "device_type must be a str, got int"),
        ({"device_type": "gpu"}, ValueError, "device_type must be a device type .* 'gpu'"),
        ({"device_type": "cuda:0"}, ValueError, "device_type must be a device type"),
        ({"axis_tiers": ["ep"]}, TypeError, "axis_tiers must be a mapping"),
        ({"check_tiers": 1}, TypeError, "check_tiers must be a bool"),
        ({"ep": 8}, ValueError, r"axis 'ep' \(size 8\) must stay inside one host"),
        ({"ep": 3}, ValueError, "ep must divide fsdp"),
        ({"fsdp": 5}, ValueError, "fsdp must divide the world size 16"),
        ({"replicate": 1.5}, TypeError, "replicate must be an int"),
        ({"sparse_replicate": 0}, ValueError, "sparse_replicate must be >= 1"),
        ({"spec": MeshSpec(fsdp=8)}, ValueError, "the mesh has 8 ranks"),
        ({"spec": MeshSpec(fsdp=16), "ep": 2}, TypeError, "either spec or degree keywords"),
        ({"tp": 2}, TypeError, r"unexpected keyword arguments \['tp'\]"),
    ],
)
def test_parallel_mesh_hostile_arguments(kwargs: dict, exc: type, match: str) -> None:
    _fake_pg(16, 3)
    try:
        with pytest.raises(exc, match=match):
            ParallelMesh(_T16, **kwargs)
    finally:
        dist.destroy_process_group()
