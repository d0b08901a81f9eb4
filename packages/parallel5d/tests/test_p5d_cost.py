"""Cost model: collectives against hand-computed alpha-beta cases, the overlap schedule on
a hand-traced timeline, predict/plan_mesh consistency, and monotonicity (hypothesis)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d.cost import (
    CostOptions,
    DeviceSpec,
    GroupShape,
    LayerSpec,
    ModelConfig,
    SparseSpec,
    bus_bandwidth,
    collective_time,
    gem_scale,
    plan_mesh,
    predict,
)
from hyperrec.parallel5d.mesh import MeshSpec, axis_placement
from hyperrec.parallel5d.topology import Link, Topology

US = 1e-6
BASE = 8.4 * US


def test_ring_all_gather_across_two_hosts() -> None:
    t = Topology(gpus_per_host=4, hosts=2)
    shape = GroupShape(size=8, ranks_per_host=4, ranks_per_zone=8, hosts=2, zones=1)
    # 4 ranks per host drive 4 NICs: min(NVLink 370, 4 x 48) = 192 GB/s.
    assert bus_bandwidth(t, shape) == 192.0
    got, algo = collective_time(t, shape, "all_gather", 1e9)
    want = BASE + (6 * 3.4 + 1 * 9.6) * US + 7 / 8 * 1e9 / 192e9
    assert algo == "ring" and got == pytest.approx(want, rel=1e-12)
    got, _ = collective_time(t, shape, "reduce_scatter", 1e9)
    assert got == pytest.approx(want, rel=1e-12)


def test_all_reduce_ring_tree_nvls() -> None:
    t = Topology(gpus_per_host=8, hosts=1)
    shape = GroupShape(size=8, ranks_per_host=8, ranks_per_zone=8)
    ring = BASE + 14 * 3.4 * US + 2 * 7 / 8 * 1e9 / 370e9
    tree = BASE + 2 * 7 * 3.4 * US + 2 * 1e9 / (0.9 * 370e9)
    nvls = BASE + 2 * 3.4 * US + 2 * 7 / 8 * 1e9 / 480e9
    assert collective_time(t, shape, "all_reduce", 1e9, algorithm="ring")[0] == pytest.approx(ring)
    assert collective_time(t, shape, "all_reduce", 1e9, algorithm="tree")[0] == pytest.approx(tree)
    assert collective_time(t, shape, "all_reduce", 1e9)[1] == "nvls"
    assert collective_time(t, shape, "all_reduce", 1e9)[0] == pytest.approx(nvls)
    assert collective_time(t, shape, "all_reduce", 1e9, nvls=False)[1] == "ring"
    # Four GPUs: below NVLS's threshold.
    small = GroupShape(size=4, ranks_per_host=4, ranks_per_zone=4)
    assert collective_time(t, small, "all_reduce", 1e9)[1] == "ring"
    with pytest.raises(ValueError, match="algorithm 'nvls' needs a group inside one host"):
        collective_time(t, small, "all_reduce", 1e9, algorithm="nvls")
    # Many hosts, tiny message: the tree's log latency wins.
    big = Topology(gpus_per_host=8, hosts=512)
    wide = GroupShape(size=512, ranks_per_host=1, ranks_per_zone=512, hosts=512)
    assert collective_time(big, wide, "all_reduce", 1024)[1] == "tree"
    tree_small = BASE + 2 * math.log2(512) * 9.6 * US + 2 * 1024 / (0.9 * 48e9)
    assert collective_time(big, wide, "all_reduce", 1024)[0] == pytest.approx(tree_small)


def test_cross_zone_and_all_to_all() -> None:
    t = Topology(gpus_per_host=2, hosts=4, hosts_per_zone=2)
    one_per_zone = GroupShape(size=2, ranks_per_host=1, ranks_per_zone=1, hosts=2, zones=2)
    assert bus_bandwidth(t, one_per_zone) == pytest.approx(48 / 7)
    got, _ = collective_time(t, one_per_zone, "all_gather", 7e9)
    assert got == pytest.approx(BASE + 19.2 * US + 0.5 * 7e9 / (48e9 / 7))
    # Pairwise all-to-all over 2 hosts x 2 GPUs in one zone, n bytes sent per rank:
    # 1/4 to the NVLink peer, 2/4 through this GPU's own NIC.
    shape = GroupShape(size=4, ranks_per_host=2, ranks_per_zone=4, hosts=2, zones=1)
    n = 1e9
    got, algo = collective_time(t, shape, "all_to_all", n)
    want = BASE + (3.4 + 2 * 9.6) * US + max(n / 4 / 370e9, n / 2 / 48e9)
    assert algo == "pairwise" and got == pytest.approx(want)
    assert collective_time(t, GroupShape(size=1), "all_reduce", 1e9) == (0.0, "none")
    with pytest.raises(ValueError, match="nbytes must be >= 0.0"):
        collective_time(t, shape, "all_gather", -1.0)
    with pytest.raises(ValueError, match="collective must be one of"):
        collective_time(t, shape, "broadcast", 1.0)  # type: ignore[arg-type]


def test_group_shape_from_placement() -> None:
    t = Topology(gpus_per_host=8, hosts=4, hosts_per_zone=2)
    p = axis_placement(MeshSpec(replicate=2, fsdp=16, ep=2), t)
    s = GroupShape.from_placement(p["replicate"])
    assert (s.size, s.ranks_per_host, s.hosts, s.zones, s.tier) == (2, 1, 2, 2, "cross_zone")
    assert GroupShape.from_placement(p["ep"]).tier == "nvlink"


def _one_layer(**kw: object) -> ModelConfig:
    layer = LayerSpec(
        name="l", params=1_000_000, flops_per_sample=2e9, hbm_bytes_per_sample=1e6, kernels=5
    )
    return ModelConfig(name="one", layers=(layer,), **kw)  # type: ignore[arg-type]


def test_predict_one_gpu_by_hand() -> None:
    dev = DeviceSpec(matmul_tflops=500.0, hbm_gbps=2000.0, launch_us=3.0)
    t = Topology(gpus_per_host=1, hosts=1)
    p = predict(_one_layer(), t, MeshSpec(), 4, device=dev)
    fwd = 4 * 2e9 / 500e12 + 4 * 1e6 / 2000e9 + 5 * 3e-6
    opt = 1_000_000 * 28 / 2000e9
    # fp32 shard -> bf16 at the forward's and the backward's unshard; bf16 gradients ->
    # fp32 reduction buffer once
    casts = 2 * 1_000_000 * (4 + 2) / 2000e9 + 1_000_000 * (2 + 4) / 2000e9
    compute = fwd + 2 * fwd + fwd + opt + casts  # forward, backward, recompute, AdamW
    assert p.compute_s == pytest.approx(compute)
    assert p.cast_s == pytest.approx(casts)
    assert p.step_s == pytest.approx(compute)  # one GPU: nothing to communicate
    assert p.scaling_ratio == pytest.approx(1.0)
    assert p.mfu == pytest.approx(3 * 2e9 * 4 / (compute * 989e12))
    assert p.mfu == pytest.approx(p.local_mfu * p.scaling_ratio)
    no_ac = predict(_one_layer(activation_checkpointing=False), t, MeshSpec(), 4, device=dev)
    assert no_ac.compute_s == pytest.approx(3 * fwd + opt + casts)
    # no mixed precision (fp32 throughout): no casts
    fp32 = predict(_one_layer(param_bytes=4), t, MeshSpec(), 4, device=dev)
    assert fp32.cast_s == 0.0
    assert fp32.compute_s == pytest.approx(4 * fwd + opt)
    with pytest.raises(ValueError, match="global_batch must be a multiple of the world size 2"):
        predict(_one_layer(), Topology(gpus_per_host=2, hosts=1), MeshSpec(fsdp=2), 3)


def _two_measured(**kw: object) -> ModelConfig:
    layers = tuple(
        LayerSpec(name=f"l{i}", params=1000, flops_per_sample=1e9,
                  measured_fwd_s=1e-3, measured_bwd_s=2e-3)
        for i in range(2)
    )  # fmt: skip
    return ModelConfig(name="two", layers=layers, **kw)  # type: ignore[arg-type]


def test_layer_recompute_overrides_the_model_policy() -> None:
    """``LayerSpec.recompute`` prices one layer's recompute apart from the model-wide
    ``activation_checkpointing``: a root that is not checkpointed among checkpointed
    blocks, or one checkpointed block in a model that checkpoints nothing; saved bytes
    follow (a recomputed layer's live only during its own backward)."""
    dev = DeviceSpec(hbm_gbps=2000.0)
    t = Topology(gpus_per_host=1, hosts=1)
    opts = CostOptions(casts=False, communication=False)
    opt = 2000 * 28 / 2000e9

    def model(ac: bool, first: bool | None, second: bool | None) -> ModelConfig:
        layers = tuple(
            LayerSpec(name=f"l{i}", params=1000, flops_per_sample=1e9, measured_fwd_s=f,
                      measured_bwd_s=2 * f, input_bytes_per_sample=10.0,
                      saved_bytes_per_sample=s, recompute=r)
            for i, (f, s, r) in enumerate([(1e-3, 1e6, first), (4e-3, 3e6, second)])
        )  # fmt: skip
        return ModelConfig(name="two", layers=layers, activation_checkpointing=ac)

    def run(m: ModelConfig):
        return predict(m, t, MeshSpec(), 1, device=dev, options=opts)

    fwd_bwd = 3 * (1e-3 + 4e-3)
    assert run(model(True, None, None)).step_s == pytest.approx(fwd_bwd + 5e-3 + opt)
    assert run(model(True, False, None)).step_s == pytest.approx(fwd_bwd + 4e-3 + opt)
    assert run(model(False, None, True)).step_s == pytest.approx(fwd_bwd + 4e-3 + opt)
    assert run(model(False, None, None)).step_s == pytest.approx(fwd_bwd + opt)
    assert run(model(True, False, False)).step_s == run(model(False, None, None)).step_s
    inputs = 20.0
    cases = [(True, None, None), (True, False, None), (False, None, None), (False, True, None)]
    mem = {k: run(model(*k)).memory_gb for k in cases}
    base = run(model(False, False, False)).memory_gb - (inputs + 4e6) / 1e9
    assert mem[(True, None, None)] == pytest.approx(base + (inputs + 3e6) / 1e9)
    assert mem[(True, False, None)] == pytest.approx(base + (inputs + 1e6 + 3e6) / 1e9)
    assert mem[(False, None, None)] == pytest.approx(base + (inputs + 4e6) / 1e9)
    assert mem[(False, True, None)] == pytest.approx(base + (inputs + 3e6 + 1e6) / 1e9)
    with pytest.raises(TypeError, match="recompute must be a bool"):
        LayerSpec(name="x", params=1, flops_per_sample=1.0, recompute=1)  # type: ignore[arg-type]
    # routed experts: a recomputed layer sends its dispatch and combine again in backward
    t8 = Topology(gpus_per_host=8, hosts=1)
    dense = LayerSpec(name="d", params=1000, flops_per_sample=1e9, measured_fwd_s=1e-3,
                      measured_bwd_s=2e-3)  # fmt: skip

    def moe(ac: bool, r: bool | None):
        experts = LayerSpec(name="e", params=8000, flops_per_sample=1e9, kind="experts",
                            a2a_bytes_per_sample=1e6, measured_fwd_s=1e-3,
                            measured_bwd_s=2e-3, recompute=r)  # fmt: skip
        m = ModelConfig(name="moe", layers=(dense, experts), activation_checkpointing=ac)
        return predict(m, t8, MeshSpec(fsdp=8, ep=8), 64, device=dev)

    on, off = moe(True, None), moe(False, None)
    a2a = off.breakdown["all_to_all/ep"] / 4  # dispatch + combine, forward and backward
    assert a2a > 0 and on.breakdown["all_to_all/ep"] == pytest.approx(6 * a2a)
    assert on.blocking_comm_s == pytest.approx(off.blocking_comm_s + 2 * a2a)
    for got, want in [(moe(False, True), on), (moe(True, False), off)]:
        assert got.breakdown["all_to_all/ep"] == pytest.approx(want.breakdown["all_to_all/ep"])
        assert got.blocking_comm_s == pytest.approx(want.blocking_comm_s)
        # the dense layer follows the model-wide policy: its recompute differs by 8 ms
        # (8 samples a rank x 1 ms) where the policies differ
        shift = 8e-3 * (want is off) - 8e-3 * (want is on)
        assert got.compute_s == pytest.approx(want.compute_s + shift)


def test_host_walked_layer_by_layer_by_hand() -> None:
    """host_forward_s walks the host's issue beside the GPU: a host-bound forward and a
    GPU-bound backward add up where max(host, GPU) hid one under the other."""
    dev = DeviceSpec(hbm_gbps=2000.0)
    t = Topology(gpus_per_host=2, hosts=1)
    spec = MeshSpec(fsdp=2)
    opts = CostOptions(casts=False, communication=False)
    opt = 1000 * 28 / 2000e9  # AdamW over this rank's 2 x 500 parameters
    # GPU alone: forward 1 ms per layer, backward 2 + 1 (recompute) ms per layer
    gpu = predict(_two_measured(), t, spec, 2, device=dev, options=opts)
    assert gpu.step_s == pytest.approx(8e-3 + opt) and gpu.exposed_comm_s == pytest.approx(0)
    old = predict(_two_measured(host_s=10e-3), t, spec, 2, device=dev, options=opts)
    assert old.step_s == pytest.approx(10e-3 + opt) and old.host_bound
    # Host: 3 ms per layer's forward, 2 ms per layer's backward. Forward: both layers
    # wait for the host (ends at 6 ms); backward: layer 1 runs 6-9 ms (issued by 8),
    # layer 0 9-12 ms (issued by 10); then the update.
    walk = predict(
        _two_measured(host_s=10e-3, host_forward_s=6e-3), t, spec, 2, device=dev, options=opts
    )
    assert walk.step_s == pytest.approx(12e-3 + opt) and walk.host_bound
    assert walk.compute_s == pytest.approx(gpu.compute_s)
    assert walk.exposed_comm_s == pytest.approx(0)  # the GPU's own schedule, no host
    # All of the host in the backward: the GPU's forward hides under nothing, the
    # backward's issue (5 ms per layer) sets the pace: 2 + 5 + max(3, 5) = 10 ms
    back = predict(
        _two_measured(host_s=10e-3, host_forward_s=0.0), t, spec, 2, device=dev, options=opts
    )
    assert back.step_s == pytest.approx(10e-3 + opt)
    # A host far faster than the GPU changes nothing
    fast = predict(
        _two_measured(host_s=1e-3, host_forward_s=0.5e-3), t, spec, 2, device=dev, options=opts
    )
    assert fast.step_s == pytest.approx(gpu.step_s) and not fast.host_bound
    assert _two_measured(host_s=1.0, host_forward_s=0.25).describe()["host_forward_s"] == 0.25
    # The optimizer's issue after the last layer (host_backward_s), on layers of unequal
    # backward: layer 0 takes 8 ms (7 + 1 recomputed), layer 1 1.5 ms; forward as above
    # at 1 ms of host per layer (ends at 2 ms); host 12 ms in all.
    uneven = tuple(
        LayerSpec(name=f"l{i}", params=1000, flops_per_sample=1e9,
                  measured_fwd_s=1e-3, measured_bwd_s=b)
        for i, b in enumerate((7e-3, 0.5e-3))
    )  # fmt: skip

    def step(**host: float) -> float:
        m = ModelConfig(name="uneven", layers=uneven, **host)  # type: ignore[arg-type]
        return predict(m, t, spec, 2, device=dev, options=opts).step_s - opt

    # Everything after the forward walked with the backward (5 ms per layer): layer 1
    # ends with its issue at 7 ms, layer 0 runs 7-15 ms.
    assert step(host_s=12e-3, host_forward_s=2e-3) == pytest.approx(15e-3)
    # Backward issued in 2 ms (1 per layer), the optimizer's 8 ms after it: layer 1 runs
    # 2-3.5 ms, layer 0 3.5-11.5 ms, the host's issue (12 ms) sets the end.
    assert step(host_s=12e-3, host_forward_s=2e-3, host_backward_s=2e-3) == pytest.approx(12e-3)
    # the whole-step rule: max(GPU 11.5, host 12)
    assert step(host_s=12e-3) == pytest.approx(12e-3)
    # serial collectives (no overlap) walk the host the same way
    serial = predict(
        _two_measured(host_s=10e-3, host_forward_s=6e-3), t, spec, 2, device=dev,
        options=replace(opts, overlap=False),
    )  # fmt: skip
    assert serial.step_s == pytest.approx(walk.step_s)


def test_no_communication_leaves_compute() -> None:
    """communication=False: the step of a sharded model is its compute alone, the
    collectives are still named (priced at zero)."""
    dev = DeviceSpec(matmul_tflops=500.0, hbm_gbps=2000.0, launch_us=3.0)
    t = Topology(gpus_per_host=8, hosts=2)
    spec = MeshSpec(fsdp=16)
    real = predict(_one_layer(), t, spec, 16, device=dev)
    free = predict(_one_layer(), t, spec, 16, device=dev,
                   options=CostOptions(communication=False))  # fmt: skip
    assert real.comm_s > 0 and free.comm_s == 0.0
    assert free.step_s == pytest.approx(free.compute_s) == pytest.approx(real.compute_s)
    assert set(free.breakdown) == set(real.breakdown)
    with pytest.raises((TypeError, ValueError), match="communication"):
        CostOptions(communication="no")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    fwd_ms=st.floats(0.1, 5.0),
    bwd_ms=st.floats(0.1, 5.0),
    host_ms=st.floats(0.0, 40.0),
    share=st.floats(0.0, 1.0),
    world=st.sampled_from([1, 2, 8, 16]),
)
def test_host_walk_between_the_two_bounds(
    fwd_ms: float, bwd_ms: float, host_ms: float, share: float, world: int
) -> None:
    """The walked step is never below max(GPU schedule, host + update) (the whole-step
    rule) nor above their sum, with or without communication."""
    layers = tuple(
        LayerSpec(name=f"l{i}", params=10**6, flops_per_sample=1e9,
                  measured_fwd_s=fwd_ms * 1e-3, measured_bwd_s=bwd_ms * 1e-3)
        for i in range(3)
    )  # fmt: skip
    t = Topology(gpus_per_host=min(world, 8), hosts=max(world // 8, 1))
    spec = MeshSpec(fsdp=world)
    gpu = predict(ModelConfig(name="m", layers=layers), t, spec, world)
    h = host_ms * 1e-3
    whole = predict(ModelConfig(name="m", layers=layers, host_s=h), t, spec, world)
    walk = predict(
        ModelConfig(name="m", layers=layers, host_s=h, host_forward_s=share * h), t, spec, world
    )
    assert walk.step_s >= whole.step_s * (1 - 1e-12)
    assert walk.step_s <= (gpu.step_s + h + gpu.optimizer_s) * (1 + 1e-12)
    assert walk.compute_s == pytest.approx(gpu.compute_s)


def test_host_issue_time_bounds_the_step() -> None:
    """A measured host issue time longer than the GPU schedule sets the step (and the
    MFU), with the optimizer's update after the host's last launch; a shorter one
    changes nothing; exposed communication stays the GPU's."""
    dev = DeviceSpec(matmul_tflops=500.0, hbm_gbps=2000.0, launch_us=3.0)
    t = Topology(gpus_per_host=2, hosts=1)
    spec = MeshSpec(fsdp=2)
    gpu = predict(_one_layer(), t, spec, 4, device=dev)
    assert gpu.host_s == 0.0 and not gpu.host_bound
    fast_host = predict(_one_layer(host_s=0.5 * gpu.step_s), t, spec, 4, device=dev)
    assert fast_host.step_s == gpu.step_s and not fast_host.host_bound
    assert fast_host.host_s == pytest.approx(0.5 * gpu.step_s)
    slow_host = predict(_one_layer(host_s=3 * gpu.step_s), t, spec, 4, device=dev)
    opt = 1_000_000 / 2 * 28 / 2000e9  # AdamW over this rank's half of the parameters
    want = 3 * gpu.step_s + opt
    assert slow_host.host_bound and slow_host.step_s == pytest.approx(want)
    assert slow_host.optimizer_s == pytest.approx(opt) and gpu.optimizer_s == pytest.approx(opt)
    assert slow_host.compute_s == gpu.compute_s
    assert slow_host.exposed_comm_s == pytest.approx(gpu.exposed_comm_s)
    assert slow_host.mfu == pytest.approx(gpu.mfu * gpu.step_s / want)
    assert slow_host.scaling_ratio == pytest.approx(gpu.scaling_ratio * gpu.step_s / want)
    # a host just under the GPU schedule is still bound once the update is added
    edge = predict(_one_layer(host_s=gpu.step_s - opt / 2), t, spec, 4, device=dev)
    assert edge.host_bound and edge.step_s == pytest.approx(gpu.step_s + opt / 2)
    assert _one_layer(host_s=0.01).describe()["host_s"] == 0.01
    # plan_mesh prices every candidate with it
    plan = plan_mesh(_one_layer(host_s=1.0), t, 4, device=dev)
    assert all(c.step_s >= 1.0 and c.host_bound for c in plan.candidates)


def test_overlap_schedule_hand_traced() -> None:
    # Two layers on 2 GPUs of one host, measured compute, communication slower than
    # compute so the timeline has waits; SM-free so nothing slows compute.
    t = Topology(gpus_per_host=2, hosts=1)
    f0, f1 = 1e-3, 2e-3
    layers = (
        LayerSpec(name="a", params=40_000_000, flops_per_sample=1.0, measured_fwd_s=f0),
        LayerSpec(name="b", params=20_000_000, flops_per_sample=1.0, measured_fwd_s=f1),
    )
    model = ModelConfig(
        name="two", layers=layers, activation_checkpointing=False, optimizer_traffic_per_param=0
    )
    spec = MeshSpec(fsdp=2)
    shape = GroupShape(size=2, ranks_per_host=2, ranks_per_zone=2)
    ag = [collective_time(t, shape, "all_gather", x.params * 2)[0] for x in layers]
    rs = [collective_time(t, shape, "reduce_scatter", x.params * 4)[0] for x in layers]
    p = predict(model, t, spec, 2, options=CostOptions(sm_free=True, casts=False))
    # forward: AG0 | F0 while AG1 | F1
    comm = ag[0]
    f0_start = comm
    comm = max(f0_start, comm) + ag[1]
    f1_start = max(f0_start + f0, comm)
    fwd_end = f1_start + f1
    # backward: AG1 again, B1 (AG0 prefetched at its start), RS1, B0, RS0
    comm = max(fwd_end, comm) + ag[1]
    b1_start = max(fwd_end, comm)
    comm = max(b1_start, comm) + ag[0]
    b0_ready = comm
    b1_end = b1_start + 2 * f1
    comm = max(b1_end, comm) + rs[1]
    b0_start = max(b1_end, b0_ready)
    b0_end = b0_start + 2 * f0
    comm = max(b0_end, comm) + rs[0]
    assert p.step_s == pytest.approx(max(b0_end, comm))
    assert p.compute_s == pytest.approx(3 * (f0 + f1))
    serial = predict(model, t, spec, 2, options=CostOptions(overlap=False, casts=False))
    assert serial.step_s == pytest.approx(3 * (f0 + f1) + 2 * sum(ag) + sum(rs))
    assert p.step_s < serial.step_s


def test_sm_contention_and_memory() -> None:
    t = Topology(gpus_per_host=8, hosts=2)
    model = gem_scale(seq_layers=2, embedding_rows=1000)
    spec = MeshSpec(replicate=1, fsdp=16, ep=2)
    sm = predict(model, t, spec, 16 * 32, device=DeviceSpec(sm_slowdown=0.5))
    free = predict(model, t, spec, 16 * 32, options=CostOptions(sm_free=True))
    assert free.step_s < sm.step_s
    assert free.compute_s == pytest.approx(sm.compute_s)
    tiny = DeviceSpec(memory_gb=1.0)
    p = predict(model, t, spec, 16 * 32, device=tiny)
    assert not p.feasible and "budget 0.9 GB" in p.reason
    assert plan_mesh(model, t, 16 * 32, device=tiny).best is None


def test_plan_mesh_picks_fastest_valid() -> None:
    t = Topology(gpus_per_host=8, hosts=8, hosts_per_zone=4)
    model = gem_scale(seq_layers=4, embedding_rows=10_000_000)
    plan = plan_mesh(model, t, 64 * 32)
    assert plan.best is not None and plan.best.feasible
    assert plan.best.step_s == min(c.step_s for c in plan.candidates if c.feasible)
    for c in plan.candidates:
        place = axis_placement(c.spec, t)
        assert place["ep"]["tier"] in ("local", "nvlink")
        assert place["fsdp"]["tier"] in ("local", "nvlink", "rdma")
    # Flat FSDP over both zones is not a candidate; priced directly it is slower.
    assert all(c.spec.fsdp <= 32 for c in plan.candidates)
    naive = predict(model, t, MeshSpec(fsdp=64), 64 * 32)
    assert naive.step_s > plan.best.step_s
    # num_experts restricts ep.
    assert all(c.spec.ep in (1, 2) for c in plan_mesh(model, t, 64 * 32, num_experts=2).candidates)


def test_device_spec_from_calibration(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "device": {
                    "name": "X",
                    "matmul_tflops": 600.0,
                    "hbm_gbps": 3000.0,
                    "sm_slowdown": 0.2,
                    "sources": {"sm_slowdown": "measured: test"},
                },
                "matmul": [{"layer": "seq", "tflops": 650.0}],
            }
        )
    )
    dev = DeviceSpec.from_calibration(path)
    assert (dev.name, dev.matmul_tflops, dev.hbm_gbps, dev.sm_slowdown) == ("X", 600.0, 3000.0, 0.2)
    assert dev.matmul_rate("seq") == 650e12 and dev.matmul_rate("other") == 600e12
    assert dict(dev.sources)["sm_slowdown"] == "measured: test"
    assert dict(dev.sources)["peak_tflops"].startswith("cited")
    with pytest.raises(ValueError, match="must have a 'device' section"):
        DeviceSpec.from_calibration({"matmul": []})


def test_config_bad_input() -> None:
    with pytest.raises(ValueError, match="params must be >= 0"):
        LayerSpec(name="x", params=-1, flops_per_sample=1.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        LayerSpec(name="x", params=1, flops_per_sample=1.0, kind="moe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layers must be a non-empty tuple"):
        ModelConfig(name="x", layers=())
    with pytest.raises(ValueError, match="dim must be >= 1"):
        SparseSpec(name="t", rows=1, dim=0, lookups_per_sample=1.0)
    with pytest.raises(TypeError, match="sm_free must be a bool"):
        CostOptions(sm_free=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_s must be >= 0"):
        _one_layer(host_s=-1.0)
    with pytest.raises(ValueError, match="host_forward_s needs host_s"):
        _one_layer(host_forward_s=0.1)
    with pytest.raises(ValueError, match=r"host_forward_s must be <= host_s \(0.1\)"):
        _one_layer(host_s=0.1, host_forward_s=0.2)
    with pytest.raises(ValueError, match="host_forward_s must be >= 0"):
        _one_layer(host_s=0.1, host_forward_s=-0.01)
    with pytest.raises(ValueError, match="host_backward_s needs host_forward_s"):
        _one_layer(host_s=0.1, host_backward_s=0.05)
    with pytest.raises(ValueError, match=r"host_backward_s must be <= host_s - host_forward_s"):
        _one_layer(host_s=0.1, host_forward_s=0.06, host_backward_s=0.05)
    with pytest.raises(ValueError, match="host_backward_s must be >= 0"):
        _one_layer(host_s=0.1, host_forward_s=0.06, host_backward_s=-0.01)
    with pytest.raises((TypeError, ValueError), match="host_s"):
        _one_layer(host_s="fast")
    with pytest.raises((TypeError, ValueError), match="host_s"):
        _one_layer(host_s=float("nan"))


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 64),
    gph=st.sampled_from([1, 2, 4, 8]),
    n1=st.floats(0, 1e10),
    n2=st.floats(0, 1e10),
    kind=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]),
)
def test_collective_time_monotone(p: int, gph: int, n1: float, n2: float, kind: str) -> None:
    hosts = max(1, math.ceil(p / gph))
    t = Topology(gpus_per_host=gph, hosts=hosts, hosts_per_zone=max(1, hosts // 2))
    g = p // hosts  # spread evenly: each host holds at least this many
    shape = GroupShape(
        size=p, ranks_per_host=g, ranks_per_zone=g, hosts=hosts, zones=t.zones if hosts > 1 else 1
    )
    lo, hi = sorted((n1, n2))
    assert collective_time(t, shape, kind, lo)[0] <= collective_time(t, shape, kind, hi)[0]
    fast = Topology(
        gpus_per_host=gph,
        hosts=hosts,
        hosts_per_zone=t.zone_hosts,
        rdma=Link(bandwidth_gbps=96.0, latency_us=9.6),
    )
    assert collective_time(fast, shape, kind, hi)[0] <= collective_time(t, shape, kind, hi)[0]


@settings(max_examples=15, deadline=None)
@given(
    hosts=st.sampled_from([1, 2, 4]),
    batch=st.sampled_from([1, 4, 16]),
    lat=st.floats(0.1, 100.0),
    slow=st.floats(0.0, 1.0),
)
def test_predict_sanity(hosts: int, batch: int, lat: float, slow: float) -> None:
    model = gem_scale(seq_layers=2, embedding_rows=1_000_000)
    t = Topology(gpus_per_host=8, hosts=hosts)
    spec = MeshSpec(fsdp=8 * hosts, ep=2, sparse_replicate=2)
    dev = DeviceSpec(sm_slowdown=slow)
    base = predict(model, t, spec, batch * 8 * hosts, device=dev)
    slower = Topology(
        gpus_per_host=8,
        hosts=hosts,
        rdma=Link(bandwidth_gbps=48.0, latency_us=9.6 + lat),
        nvlink=Link(bandwidth_gbps=370.0, latency_us=3.4 + lat),
    )
    worse = predict(model, slower, spec, batch * 8 * hosts, device=dev)
    assert worse.step_s >= base.step_s * (1 - 1e-12)
    assert base.step_s >= base.compute_s * (1 - 1e-12)  # exposed communication >= 0
    assert 0 < base.scaling_ratio <= 1 + 1e-12
    assert base.mfu == pytest.approx(base.local_mfu * base.scaling_ratio)
    serial = predict(
        model, t, spec, batch * 8 * hosts, device=dev, options=CostOptions(overlap=False)
    )
    assert base.step_s <= serial.step_s * (1 + 1e-9) + 1e-12
    bigger = predict(model, t, spec, 2 * batch * 8 * hosts, device=dev)
    assert bigger.compute_s > base.compute_s and bigger.memory_gb > base.memory_gb


def test_mixed_precision_casts_by_hand() -> None:
    """fp32 master shard -> bf16 at each unshard (this rank's 1/N), bf16 gradients ->
    fp32 reduction buffer (the whole layer) at each backward: compute on every rank."""
    dev = DeviceSpec(hbm_gbps=1000.0)
    t = Topology(gpus_per_host=8, hosts=1)
    model = _one_layer()
    spec = MeshSpec(fsdp=8)
    for reshard in (True, False):
        opts = CostOptions(reshard_after_forward=reshard, sm_free=True)
        on = predict(model, t, spec, 8, device=dev, options=opts)
        off = predict(model, t, spec, 8, device=dev, options=replace(opts, casts=False))
        cast = 1_000_000 / 8 * (4 + 2) / 1000e9
        land = 1_000_000 * (2 + 4) / 1000e9
        expect = (2 if reshard else 1) * cast + land
        assert on.cast_s == pytest.approx(expect) and off.cast_s == 0.0
        assert on.compute_s - off.compute_s == pytest.approx(expect)
    # bf16 reduction: gradients accumulate in place, only the parameter cast is left
    bf16_rs = predict(_one_layer(reduce_bytes=2), t, spec, 8, device=dev)
    assert bf16_rs.cast_s == pytest.approx(2 * 1_000_000 / 8 * 6 / 1000e9)
    # routed experts: this rank's experts (params / ep), each cast over its expert-FSDP
    # shard (fsdp * 1 / ep = 2 ranks here)
    experts = LayerSpec(
        name="e", params=8_000_000, flops_per_sample=1e9, kind="experts", a2a_bytes_per_sample=1e3
    )
    ep = predict(
        ModelConfig(name="moe", layers=(experts,)), t, MeshSpec(fsdp=8, ep=4), 8, device=dev
    )
    local = 8_000_000 / 4
    assert ep.cast_s == pytest.approx(2 * local / 2 * 6 / 1000e9 + local * 6 / 1000e9)
