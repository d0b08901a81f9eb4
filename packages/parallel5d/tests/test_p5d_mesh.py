"""Topology, MeshSpec and ParallelMesh: validation, tier assertions, real group membership.

- Pure arithmetic (Topology.span, MeshSpec.groups) against brute-force Python.
- 8 real gloo ranks on a simulated 2-host x 4-GPU topology: an all-gather of the rank on
  every named axis returns exactly the group the arithmetic predicts.
- Fake backend at 4,096 and 100,000 ranks: the real DeviceMesh is built (groups of the
  fake backend are cheap: ~2 s at 100,000 ranks) and its group structure checked.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _p5d_moe import check_parity, moe_parity
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d import mesh as mesh_mod
from hyperrec.parallel5d.mesh import (
    AXES,
    MeshSpec,
    ParallelMesh,
    axis_placement,
    check_axis_tiers,
)
from hyperrec.parallel5d.topology import TIERS, Link, Topology
from hyperrec.testing import run_on_ranks

# ----------------------------------------------------------------------------- Topology


def test_topology_sizes_and_partial_zone() -> None:
    t = Topology(gpus_per_host=8, hosts=10, hosts_per_zone=4)
    assert (t.world_size, t.zones, t.gpus_per_zone) == (80, 3, 32)
    assert t.zone_of([0, 31, 32, 79]).tolist() == [0, 0, 1, 2]
    assert t.tier_between(0, 0) == "local"
    assert t.tier_between(0, 7) == "nvlink"
    assert t.tier_between(0, 8) == "rdma"
    assert t.tier_between(0, 32) == "cross_zone"
    assert Topology(gpus_per_host=2, hosts=3).zones == 1


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"gpus_per_host": 0, "hosts": 1}, ValueError, "gpus_per_host must be >= 1"),
        ({"gpus_per_host": 8, "hosts": 2.0}, TypeError, "hosts must be an int"),
        ({"gpus_per_host": 8, "hosts": 2, "hosts_per_zone": 3}, ValueError, "hosts_per_zone"),
        ({"gpus_per_host": 2, "hosts": 1, "rank_order": (0, 0)}, ValueError, "permutation"),
        ({"gpus_per_host": 2, "hosts": 1, "rank_order": (0,)}, ValueError, "slot for each"),
        ({"gpus_per_host": 2, "hosts": 1, "nvlink": 5}, TypeError, "nvlink must be a Link"),
        ({"gpus_per_host": 2, "hosts": 1, "nvls_min_gpus": 1}, ValueError, "nvls_min_gpus"),
    ],
)
def test_topology_bad_input(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        Topology(**kwargs)


def test_link_bad_input() -> None:
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        Link(bandwidth_gbps=0.0, latency_us=1.0)
    with pytest.raises(ValueError, match="latency_us must be finite"):
        Link(bandwidth_gbps=1.0, latency_us=float("nan"))


def test_topology_from_env() -> None:
    t = Topology.from_env(
        env={"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "HYPERREC_HOSTS_PER_ZONE": "2"}
    )
    assert (t.gpus_per_host, t.hosts, t.zone_hosts, t.zones) == (8, 4, 2, 2)
    assert Topology.from_env(env={}).world_size == 1
    # A zone larger than the job is the job.
    t = Topology.from_env(env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, hosts_per_zone=4)
    assert t.zones == 1
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set but WORLD_SIZE is 4"):
        Topology.from_env(env={"WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match=r"WORLD_SIZE \(12\) must be a multiple"):
        Topology.from_env(env={"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match="WORLD_SIZE must be a positive integer, got 'x'"):
        Topology.from_env(env={"WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="HYPERREC_HOSTS_PER_ZONE must be a positive"):
        Topology.from_env(
            env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "HYPERREC_HOSTS_PER_ZONE": "0"}
        )


def _span_brute(t: Topology, group: list[int]) -> tuple[int, int, int, int, int]:
    hosts = [int(t.host_of([r])[0]) for r in group]
    zones = [h // t.zone_hosts for h in hosts]
    tier = 3 if len(set(zones)) > 1 else 2 if len(set(hosts)) > 1 else 1 if len(group) > 1 else 0
    per_host = min(hosts.count(h) for h in set(hosts))
    per_zone = min(zones.count(z) for z in set(zones))
    return tier, per_host, per_zone, len(set(hosts)), len(set(zones))


@settings(max_examples=40, deadline=None)
@given(
    gph=st.integers(1, 4),
    hosts=st.integers(1, 6),
    hpz=st.integers(1, 6),
    size=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    permute=st.booleans(),
)
def test_span_matches_brute_force(
    gph: int, hosts: int, hpz: int, size: int, seed: int, permute: bool
) -> None:
    rng = np.random.default_rng(seed)
    w = gph * hosts
    order = tuple(int(x) for x in rng.permutation(w)) if permute else None
    t = Topology(gpus_per_host=gph, hosts=hosts, hosts_per_zone=min(hpz, hosts), rank_order=order)
    size = min(size, w)
    groups = np.stack([rng.choice(w, size=size, replace=False) for _ in range(5)])
    span = t.span(groups)
    for i, g in enumerate(groups.tolist()):
        got = (
            span.tier[i],
            span.ranks_per_host[i],
            span.ranks_per_zone[i],
            span.hosts[i],
            span.zones[i],
        )
        assert tuple(int(v) for v in got) == _span_brute(t, g)


# ----------------------------------------------------------------------------- MeshSpec


def test_meshspec_degrees_and_errors() -> None:
    s = MeshSpec(replicate=2, fsdp=8, ep=2, sparse_replicate=4)
    assert (s.world_size, s.efsdp, s.sparse_shard) == (16, 4, 4)
    with pytest.raises(ValueError, match="ep must divide fsdp .* got ep=3, fsdp=8"):
        MeshSpec(fsdp=8, ep=3)
    with pytest.raises(ValueError, match="sparse_replicate \\* sparse_dp must divide the world"):
        MeshSpec(fsdp=8, sparse_replicate=2, sparse_dp=3)
    with pytest.raises(TypeError, match="ep must be an int"):
        MeshSpec(fsdp=8, ep=True)
    with pytest.raises(ValueError, match="axis must be one of"):
        s.size("tp")
    assert MeshSpec.infer(16, replicate=2) == MeshSpec(replicate=2, fsdp=8)
    assert MeshSpec.infer(16, fsdp=4, ep=2).replicate == 4
    assert MeshSpec.infer(16).fsdp == 16
    # Default with a topology: FSDP inside a zone, replication across zones.
    t = Topology(gpus_per_host=8, hosts=4, hosts_per_zone=2)
    assert MeshSpec.infer(32, topology=t) == MeshSpec(replicate=2, fsdp=16)
    t = Topology(gpus_per_host=8, hosts=512, hosts_per_zone=384)  # 4,096 GPUs, zones 3,072
    assert MeshSpec.infer(4096, topology=t) == MeshSpec(replicate=4, fsdp=1024)
    with pytest.raises(ValueError, match="fsdp must divide the world size 16, got 5"):
        MeshSpec.infer(16, fsdp=5)
    with pytest.raises(ValueError, match="replicate \\* fsdp must equal the world size 16"):
        MeshSpec.infer(16, replicate=2, fsdp=4)


def test_meshspec_groups_brute_force() -> None:
    s = MeshSpec(replicate=2, fsdp=8, ep=2, sparse_replicate=2, sparse_dp=2)
    assert s.sparse_shard == 4
    coords = {}
    for r in range(16):
        rep, f = divmod(r, 8)
        ef, e = divmod(f, 2)
        sd, rest = divmod(r, 8)
        sh, sr = divmod(rest, 2)
        coords[r] = {
            "replicate": rep,
            "fsdp": f,
            "efsdp": ef,
            "ep": e,
            "sparse_dp": sd,
            "sparse_shard": sh,
            "sparse_replicate": sr,
        }
    others = {
        "replicate": ("fsdp",),
        "fsdp": ("replicate",),
        "efsdp": ("replicate", "ep"),
        "ep": ("replicate", "efsdp"),
        "sparse_dp": ("sparse_shard", "sparse_replicate"),
        "sparse_shard": ("sparse_dp", "sparse_replicate"),
        "sparse_replicate": ("sparse_dp", "sparse_shard"),
    }
    for axis in AXES:
        got = {tuple(g) for g in s.groups(axis).tolist()}
        want = set()
        for r in range(16):
            key = tuple(coords[r][o] for o in others[axis])
            want.add(
                tuple(q for q in range(16) if tuple(coords[q][o] for o in others[axis]) == key)
            )
        assert got == want, axis


def test_tier_check_names_ranks_and_hosts() -> None:
    t = Topology(gpus_per_host=4, hosts=4, hosts_per_zone=2)
    check_axis_tiers(MeshSpec(replicate=2, fsdp=8, ep=4, sparse_replicate=4), t)
    with pytest.raises(ValueError, match=r"axis 'ep' \(size 8\) must stay inside one host") as e:
        check_axis_tiers(MeshSpec(replicate=2, fsdp=8, ep=8), t)
    msg = str(e.value)
    assert "cross tier 'rdma'" in msg and "host 0 (zone 0): ranks [0, 1, 2, 3]" in msg
    assert "host 1 (zone 0): ranks [4, 5, 6, 7]" in msg
    with pytest.raises(ValueError, match=r"axis 'fsdp' \(size 16\) must stay inside one zone"):
        check_axis_tiers(MeshSpec(replicate=1, fsdp=16), t)
    # A stricter tier for the sparse shard groups, and a looser one for fsdp.
    with pytest.raises(ValueError, match="sparse_shard"):
        check_axis_tiers(MeshSpec(fsdp=8, replicate=2), t, axis_tiers={"sparse_shard": "rdma"})
    check_axis_tiers(MeshSpec(fsdp=16), t, axis_tiers={"fsdp": "cross_zone", "efsdp": "cross_zone"})
    with pytest.raises(ValueError, match="axis_tiers key must be one of"):
        check_axis_tiers(MeshSpec(fsdp=16), t, axis_tiers={"tp": "rdma"})
    with pytest.raises(ValueError, match="the mesh has 8 ranks .* the topology has 16"):
        check_axis_tiers(MeshSpec(fsdp=8), t)
    # Ranks handed out by a scheduler out of zone order: axes follow the slots, so the
    # fsdp groups are the ranks of each zone, not blocks of consecutive ranks.
    order = tuple(itertools.chain(range(0, 4), range(8, 12), range(4, 8), range(12, 16)))
    shuffled = Topology(gpus_per_host=4, hosts=4, hosts_per_zone=2, rank_order=order)
    spec = MeshSpec(replicate=2, fsdp=8)
    check_axis_tiers(spec, shuffled)
    fsdp_groups = spec.groups("fsdp", shuffled.ranks_in_slot_order()).tolist()
    assert fsdp_groups == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_axis_placement_density() -> None:
    t = Topology(gpus_per_host=8, hosts=8, hosts_per_zone=4)
    p = axis_placement(MeshSpec(replicate=2, fsdp=32, ep=2, sparse_replicate=8), t)
    assert p["ep"] == {
        "size": 2,
        "tier": "nvlink",
        "ranks_per_host": 2,
        "ranks_per_zone": 2,
        "hosts": 1,
        "zones": 1,
    }
    assert p["efsdp"]["ranks_per_host"] == 4 and p["efsdp"]["tier"] == "rdma"
    assert p["replicate"]["ranks_per_zone"] == 1 and p["replicate"]["tier"] == "cross_zone"
    assert p["sparse_shard"]["ranks_per_host"] == 1 and p["sparse_shard"]["hosts"] == 8


# ----------------------------------------------------------------------------- gloo ranks


def _eight_rank_worker() -> dict:
    t = Topology(gpus_per_host=4, hosts=2)
    spec = MeshSpec(replicate=2, fsdp=4, ep=2, sparse_replicate=4)
    pm = ParallelMesh(t, spec)
    rank = dist.get_rank()
    seen: dict = {}
    for axis in (*AXES, "dp", "edp", "world"):
        m = pm[axis]
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(m.size())]
        dist.all_gather(out, torch.tensor([rank]), group=m.get_group())
        seen[axis] = [int(x) for x in out]
        seen[axis + "_local_rank"] = m.get_local_rank()
    # fully_shard's meshes: 2-D (replicate, shard) with this rank's groups.
    seen["dense_mesh"] = pm.dense_mesh.mesh.tolist()
    seen["expert_mesh"] = pm.expert_mesh.mesh.tolist()
    try:
        ParallelMesh(t, replicate=1, fsdp=8, ep=8)
    except ValueError as e:
        seen["error"] = str(e)
    # Expert parallelism on the same spawn: 2 replicas x FSDP 4 (EP 2, expert FSDP 2),
    # uneven tokens, one rank without any.
    seen["parity"] = moe_parity(t, spec, [3, 6, 0, 4, 8, 2, 5, 1])
    return seen


@pytest.mark.slow  # tens of seconds; `nox -s lowest` leaves it to the normal session
def test_eight_gloo_ranks_on_two_hosts() -> None:
    """8 gloo ranks, simulated 2 hosts x 4 GPUs: group membership on every named axis
    from real collectives, a misplaced EP axis rejected, and EP + fully_shard parity with
    single-process training (2 replicas x FSDP 4, EP 2)."""
    results = run_on_ranks(_eight_rank_worker, 8)
    t = Topology(gpus_per_host=4, hosts=2)
    spec = MeshSpec(replicate=2, fsdp=4, ep=2, sparse_replicate=4)
    ep_groups = spec.groups("ep").tolist()
    ep_index = {q: g.index(q) for g in ep_groups for q in g}
    for rank, seen in enumerate(results):
        for axis in AXES:
            (group,) = [g for g in spec.groups(axis).tolist() if rank in g]
            assert seen[axis] == group, (rank, axis)
            assert seen[axis + "_local_rank"] == group.index(rank)
        assert sorted(seen["dp"]) == list(range(8))
        assert sorted(seen["edp"]) == [q for q in range(8) if ep_index[q] == ep_index[rank]]
        assert sorted(seen["world"]) == list(range(8))
        for axis in ("ep", "sparse_replicate"):  # stay on the rank's host
            assert len(set(t.host_of(seen[axis]).tolist())) == 1
        assert np.asarray(seen["dense_mesh"]).shape == (2, 4)
        assert np.asarray(seen["expert_mesh"]).shape == (2, 2)
        assert "axis 'ep' (size 8) must stay inside one host" in seen["error"]
    check_parity([seen["parity"] for seen in results])


def test_from_env_single_process_creates_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "HYPERREC_HOSTS_PER_ZONE"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        pm = ParallelMesh.from_env(device_type="cpu")
        assert pm.spec == MeshSpec() and pm["ep"].size() == 1
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- fake backend


def _fake_mesh(world: int, rank: int, topology: Topology, spec: MeshSpec) -> ParallelMesh:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return ParallelMesh(topology, spec, device_type="cpu")


@pytest.mark.parametrize(
    ("hosts", "hosts_per_zone", "spec", "rank"),
    [
        (512, 384, MeshSpec(replicate=4, fsdp=1024, ep=2, sparse_replicate=8), 3071),
        # 100,000 GPUs: 12,500 hosts in 50 zones of 250; FSDP over 2,000 GPUs of a zone.
        (12_500, 250, MeshSpec(replicate=50, fsdp=2000, ep=2, sparse_replicate=8), 54_321),
    ],
    ids=["4096", "100000"],
)
def test_fake_backend_large_meshes(
    hosts: int, hosts_per_zone: int, spec: MeshSpec, rank: int
) -> None:
    t = Topology(gpus_per_host=8, hosts=hosts, hosts_per_zone=hosts_per_zone)
    world = t.world_size
    try:
        pm = _fake_mesh(world, rank, t, spec)
        # This rank's groups, from the process groups DeviceMesh made.
        f = rank % spec.fsdp
        base = rank - f
        assert pm["fsdp"].mesh.tolist() == list(range(base, base + spec.fsdp))
        assert pm["ep"].mesh.tolist() == [rank - rank % 2, rank - rank % 2 + 1]
        assert pm["efsdp"].mesh.tolist() == list(range(base + rank % 2, base + spec.fsdp, 2))
        assert pm["replicate"].mesh.tolist() == list(range(f, world, spec.fsdp))
        assert pm["sparse_replicate"].mesh.tolist() == list(
            range(rank - rank % 8, rank - rank % 8 + 8)
        )
        assert pm["sparse_shard"].mesh.tolist() == list(range(rank % 8, world, 8))
        for axis in AXES:
            assert pm[axis].get_group().size() == spec.size(axis)
        assert pm.dense_mesh.shape == (spec.replicate, spec.fsdp)
        assert pm.expert_mesh.shape == (spec.replicate, spec.efsdp)
        # The full group structure of every axis, from the DeviceMesh tensors, lies on
        # its tiers.
        for axis in AXES:
            groups = pm._mesh_groups(axis)
            assert groups.shape == (world // spec.size(axis), spec.size(axis))
            assert np.array_equal(np.sort(groups, axis=None), np.arange(world))
        placement = pm.placement()
        assert placement["ep"]["tier"] == "nvlink"
        assert placement["fsdp"]["tier"] == "rdma" and placement["fsdp"]["zones"] == 1
        assert placement["replicate"]["tier"] == ("cross_zone" if t.zones > 1 else "rdma")
    finally:
        dist.destroy_process_group()


def test_fake_backend_misplaced_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Topology(gpus_per_host=8, hosts=512, hosts_per_zone=384)
    try:
        with pytest.raises(
            ValueError, match=r"axis 'fsdp' \(size 4096\) must stay inside one zone"
        ):
            _fake_mesh(4096, 0, t, MeshSpec(fsdp=4096))
        pm = ParallelMesh(t, MeshSpec(fsdp=4096), device_type="cpu", check_tiers=False)
        swapped = Topology(
            gpus_per_host=8,
            hosts=512,
            hosts_per_zone=384,
            rank_order=tuple(range(8, 4096)) + tuple(range(8)),
        )
        with pytest.raises(ValueError, match="rank_order puts the ranks of axis 'replicate' out"):
            ParallelMesh(swapped, MeshSpec(replicate=4, fsdp=1024), device_type="cpu")
        assert pm.placement()["fsdp"]["tier"] == "cross_zone"
        # Without DeviceMesh._unflatten (older torch) each view is its own DeviceMesh.
        monkeypatch.setattr(mesh_mod, "_HAS_UNFLATTEN", False)
        pm = ParallelMesh(t, MeshSpec(replicate=4, fsdp=1024, ep=8), device_type="cpu")
        assert pm["ep"].mesh.tolist() == list(range(8))
        assert pm["efsdp"].mesh.tolist() == list(range(0, 1024, 8))
    finally:
        dist.destroy_process_group()


def test_parallel_mesh_bad_input() -> None:
    t = Topology(gpus_per_host=4, hosts=1)
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        ParallelMesh(t)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="the topology has 8 ranks .* process group has 4"):
            ParallelMesh(Topology(gpus_per_host=4, hosts=2))
        with pytest.raises(TypeError, match="unexpected keyword arguments \\['tp'\\]"):
            ParallelMesh(t, tp=2)
        with pytest.raises(TypeError, match="topology must be a Topology"):
            ParallelMesh("8 gpus")  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="unknown mesh axis 'tp'"):
            ParallelMesh(t)["tp"]
        assert TIERS[0] == "local"
    finally:
        dist.destroy_process_group()
