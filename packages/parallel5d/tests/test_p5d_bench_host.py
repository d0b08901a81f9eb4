"""The host term's measurement in the benchmarks: ``bench_fsdp.run_variant`` records the
host's issue time per step, and ``validate_cost.host_copy`` keeps a model's structure
while shrinking its work (fake process group, CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"p5d_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _on_fake_group(run, bench):
    """``run(mesh, cfg, args)`` on a 4-rank fake process group (the tiny GEM tower, one
    warm-up and three timed steps)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        cfg = dict(bench.TINY["gem"], checkpoint=True)
        args = SimpleNamespace(warmup=1, steps=3, profile=None, gc_freeze=False)
        return run(mesh, cfg, args)
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["gem", "llama", "moe"])
def test_host_copy_keeps_structure_and_shrinks_work(kind: str) -> None:
    vc = _load("validate_cost")
    bench = vc.bench
    cfg = dict(bench.PRESETS[kind], checkpoint=True)
    small = vc.host_copy(cfg)
    for key, value in cfg.items():
        if key in vc.HOST_COPY_DIMS[kind]:
            assert value >= small[key]  # never grown
        else:
            assert small[key] == value, key  # layers, experts, features, heads kept
    big = bench.build(dict(cfg), torch.device("meta"))
    little = bench.build(dict(small), torch.device("meta"))
    shapes = [tuple(p.shape) for p in big.parameters()]
    assert len(shapes) == len(list(little.parameters()))  # same tensors, so same hooks
    assert sum(p.numel() for p in little.parameters()) < sum(p.numel() for p in big.parameters())
    tiny = dict(bench.TINY[kind], checkpoint=True)
    assert all(vc.host_copy(tiny)[k] <= tiny[k] for k in vc.HOST_COPY_DIMS[kind])


def test_run_variant_records_host_time() -> None:
    """``host_s`` is the time until the step returned, before the device sync: on a CPU
    (synchronous) it is the step, and every timed step has one."""
    bench = _load("bench_fsdp")

    def run(mesh, cfg, args):
        return bench.run_variant(cfg, "hyperrec", "flat", True, mesh, torch.device("cpu"), args)

    r = _on_fake_group(run, bench)
    assert len(r["host_s_all"]) == 3 and len(r["step_s_all"]) == 3
    assert all(0 < h <= s for h, s in zip(r["host_s_all"], r["step_s_all"]))
    assert r["host_s"] == sorted(r["host_s_all"])[1]
    phases = zip(r["host_forward_s_all"], r["host_backward_s_all"], r["host_s_all"])
    assert all(f > 0 and b > 0 and f + b < h for f, b, h in phases)
    assert r["host_forward_s"] == sorted(r["host_forward_s_all"])[1]


def test_run_interleaved_times_the_models_in_turn(monkeypatch) -> None:
    """The model and its host copy take their steps alternately: step ``i`` of each is
    taken back to back, so both sample the same stretch of the host's speed."""
    bench = _load("bench_fsdp")
    vc = _load("validate_cost")
    order = []
    step = bench.train_step

    def spy(model, opt, batch, marks=None):
        order.append(id(model))
        return step(model, opt, batch, marks)

    monkeypatch.setattr(bench, "train_step", spy)

    def run(mesh, cfg, args):
        models = [cfg, vc.host_copy(cfg)]
        return bench.run_interleaved(
            models, "hyperrec", "flat", True, mesh, torch.device("cpu"), args
        )

    big, small = _on_fake_group(run, bench)
    a, b = order[0], order[1]
    assert a != b and order == [a, b] * 4  # one warm-up and three timed steps each, in turn
    for r in (big, small):
        assert len(r["host_s_all"]) == 3 and len(r["step_s_all"]) == 3
        assert all(0 < h <= s for h, s in zip(r["host_s_all"], r["step_s_all"]))
        assert r["step_s"] == sorted(r["step_s_all"])[1]
        # the forward's share of the host time: issued before the step returned
        assert len(r["host_forward_s_all"]) == 3 == len(r["host_backward_s_all"])
        phases = zip(r["host_forward_s_all"], r["host_backward_s_all"], r["host_s_all"])
        assert all(f > 0 and b > 0 and f + b < h for f, b, h in phases)


def test_host_gap_smoke_compares_the_model_with_its_copy(tmp_path) -> None:
    """``host_gap.py --smoke`` (fake 4 ranks, CPU): both models timed and profiled, the
    per-event growth table sorted, and the record written; the copy is the smaller one."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "host_gap.py"), "--smoke", "--fake-world-size", "4",
         "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "host_gap_gem_smoke.json").read_text())
    assert doc["fake_world_size"] == 4
    assert doc["model"]["cfg"]["dim"] > doc["copy"]["cfg"]["dim"]
    assert len(doc["model"]["host_ms_all"]) == len(doc["copy"]["host_ms_all"]) == 2
    deltas = [r["delta_us"] for r in doc["largest_growth"]]
    assert deltas == sorted(deltas, reverse=True) and deltas
    assert doc["model"]["profile"] and doc["copy"]["profile"]


def test_host_ops_records_shaped_calls_in_forward_and_backward_and_prices_the_difference():
    """``host_ops``: GEMMs and copies of a step counted per (op, shapes, strides, dtypes),
    the backward's too; each distinct call replays on fresh tensors; the delta is the
    model's sum of count x seconds minus the copy's."""
    host_ops = _load("host_ops")

    def step(n: int):
        w = torch.randn(n, n, requires_grad=True)
        x = torch.randn(4, n)
        y = (x @ w).sum()
        y.backward()
        dst = [torch.empty(n), torch.empty(3)]
        torch._foreach_copy_(dst, [torch.ones(n), torch.ones(3)])
        torch.empty(4, n).copy_(torch.ones(n).expand(4, n))  # a zero-stride source

    big = host_ops.record_ops(lambda: step(32))
    small = host_ops.record_ops(lambda: step(8))
    names = {k[0] for k in big}
    assert "aten.mm.default" in names and "aten._foreach_copy_.default" in names
    n_mm = sum(n for k, n in big.items() if k[0] == "aten.mm.default")
    assert n_mm >= 2  # the forward's and at least one of the backward's
    assert sum(big.values()) == sum(small.values())  # same structure, other shapes
    for key in big:  # every recorded call can be replayed
        assert host_ops.time_op(key, torch.device("cpu"), reps=2, rounds=2) > 0.0

    # arithmetic with a fake timer: seconds = elements of the first operand
    def fake_timer(key, device):
        first = key[1][0]
        first = first[0] if isinstance(first, tuple) and first and first[0] != "T" else first
        return float(torch.Size(first[1]).numel())

    d = host_ops.host_op_delta(big, small, torch.device("cpu"), timer=fake_timer)
    want_big = sum(n * fake_timer(k, None) for k, n in big.items())
    want_small = sum(n * fake_timer(k, None) for k, n in small.items())
    assert d["model_s"] == pytest.approx(want_big) and d["copy_s"] == pytest.approx(want_small)
    assert d["delta_s"] == pytest.approx(want_big - want_small) and d["delta_s"] > 0
    with pytest.raises(ValueError, match="reps"):
        host_ops.time_op(next(iter(big)), torch.device("cpu"), reps=0)


def test_host_ops_replays_the_fake_backends_collectives_on_their_group_when_asked():
    """With ``collectives=True`` the step's all-gather is recorded with its group and
    replayed on it: the fake backend's all-gather writes its input into each rank's chunk
    of the output (the host work the copy's small shards under-price); without the flag
    collectives are not recorded (a real backend would need every rank to replay)."""
    host_ops = _load("host_ops")
    created = not dist.is_initialized()
    if created:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        # as hyperrec.dbuffer gathers (all_gather_into_tensor is deprecated in newer torch)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def step(n: int):
            out = torch.zeros(4 * n)
            gather(out, torch.full((n,), 2.0))
            return out

        assert step(3).tolist() == [2.0] * 12  # the fake backend's per-chunk copies
        plain = host_ops.record_ops(lambda: step(16))
        big = host_ops.record_ops(lambda: step(16), collectives=True)
        small = host_ops.record_ops(lambda: step(4), collectives=True)
        assert not [k for k in plain if k[0].startswith("c10d.")]
        gathers = [k for k in big if k[0].startswith("c10d.") and "allgather" in k[0]]
        assert len(gathers) == 1 and big[gathers[0]] == 1
        assert host_ops.time_op(gathers[0], torch.device("cpu"), reps=2, rounds=2) > 0.0

        def fake_timer(key, device):  # seconds = elements of the gathered output
            return float(torch.Size(key[1][0][1]).numel())

        d = host_ops.host_op_delta(big, small, torch.device("cpu"), timer=fake_timer)
        name = gathers[0][0]
        assert d["per_op"][name]["model_s"] == 64.0 and d["per_op"][name]["copy_s"] == 16.0
    finally:
        if created:
            dist.destroy_process_group()


def test_shaped_delta_splits_like_the_copy() -> None:
    """``validate_cost``'s shaped-launch delta is added to the copy's host time and split
    between forward and backward in the copy's own proportion; a negative one adds
    nothing."""
    vc = _load("validate_cost")
    host = {"host_s": 0.040, "host_forward_s": 0.010, "host_backward_s": 0.020}
    got = vc._with_delta(host, 0.004)
    assert got == (pytest.approx(0.044), pytest.approx(0.011), pytest.approx(0.022))
    assert vc._with_delta(host, -0.002) == (0.040, 0.010, 0.020)
    zero = {"host_s": 0.0, "host_forward_s": 0.0, "host_backward_s": 0.0}
    assert vc._with_delta(zero, 0.001) == (0.001, 0.0, 0.0)


def _recorded_run(
    vc, prof: dict, world: int, fake: bool, host_ops: float | None, checkpoint: bool = True
) -> dict:
    """A ``validate_cost`` record of one model, its errors computed the way ``main`` does."""
    from hyperrec.parallel5d.cost import CostOptions, DeviceSpec
    from hyperrec.parallel5d.mesh import MeshSpec

    dev = DeviceSpec(hbm_gbps=2500.0)
    topo = vc._compute_only_topology(world)
    rounds = []
    for i, step in enumerate([0.030, 0.034]):
        host = {"host_s": 0.02 + 0.01 * i, "host_forward_s": 0.012, "host_backward_s": 0.01}
        args = (prof, checkpoint, topo, MeshSpec(fsdp=world), world, dev,
                CostOptions(communication=False))  # fmt: skip
        pr = vc.predict_variants(*args, host["host_s"], host["host_forward_s"],
                                 host["host_backward_s"], kinds=("measured_layers",))  # fmt: skip
        if host_ops is not None:
            pr.update({k.replace("_with_host", "_with_host_ops"): v for k, v in
                       vc.predict_variants(*args, *vc._with_delta(host, host_ops),
                                           kinds=("measured_layers",)).items()})  # fmt: skip
        errors = {f"error_{k}_pct": 100 * (v - step) / step for k, v in pr.items()}
        rounds.append({"measured_step_ms": step * 1e3, "host_copy_ms": host["host_s"] * 1e3,
                       "host_copy_forward_ms": 12.0, "host_copy_backward_ms": 10.0,
                       **errors})  # fmt: skip
    return {
        "device_spec": {"hbm_gbps": 2500.0},
        "rows": [{"model": "gem", "world_size": world, "fake_backend": fake,
                  "activation_checkpointing": checkpoint, "per_layer": prof,
                  "host_ops": None if host_ops is None else {"delta_s": host_ops},
                  "rounds": rounds}],
    }  # fmt: skip


def test_reprice_reproduces_a_run_and_prices_no_root_recompute(tmp_path) -> None:
    """``validate_cost --reprice`` recomputes a recorded run's per-layer predictions with
    the installed cost model: on a record the installed model wrote it gives back every
    recorded error; the root (embeddings, heads: what the blocks leave of the step) is
    not checkpointed by the benchmark, so only the blocks' forwards are priced again."""
    import json

    vc = _load("validate_cost")
    prof = {
        "full_s": 0.040,
        "params": 3000,
        "flops": 9e9,
        "blocks": [{"params": 1000, "fwd_s": 0.004, "bwd_s": 0.008, "flops": 4e9}] * 2,
    }
    for world, fake, ops, ac in [(1, False, None, True), (8, True, 0.003, True),
                                 (12, True, 0.002, False)]:  # fmt: skip
        path = tmp_path / f"run{world}.json"
        path.write_text(json.dumps(_recorded_run(vc, prof, world, fake, ops, ac)))
        got = vc.reprice(path)["rows"][0]["rounds"]
        assert len(got) == 2
        for r in got:
            assert r["recorded"]  # every recorded error given back, equal
            for k, v in r["recorded"].items():
                assert r[k] == pytest.approx(v, abs=1e-9), k
    # root: 16 ms of the 40 (fwd a third); blocks: 4 ms forward each
    cfg = vc.to_model_config(prof, True, measured=True)
    assert cfg.layers[0].name == "root" and cfg.layers[0].recompute is False
    assert all(x.recompute is None for x in cfg.layers[1:])
    from hyperrec.parallel5d.cost import CostOptions, DeviceSpec, predict
    from hyperrec.parallel5d.mesh import MeshSpec
    from hyperrec.parallel5d.topology import Topology

    def step(ac: bool) -> float:
        return predict(vc.to_model_config(prof, ac, measured=True), Topology(gpus_per_host=1,
                       hosts=1), MeshSpec(), 1, device=DeviceSpec(),
                       options=CostOptions(communication=False)).step_s  # fmt: skip

    assert step(True) - step(False) == pytest.approx(2 * 0.004)
    bad = _recorded_run(vc, prof, 2, False, None)
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="one GPU and the fake backend only"):
        vc.reprice(tmp_path / "bad.json")
    old = _recorded_run(vc, prof, 8, True, None)
    for r in old["rows"][0]["rounds"]:
        del r["host_copy_forward_ms"]  # a record from before 0.2.18
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="recorded before 0.2.18"):
        vc.reprice(tmp_path / "old.json")


@pytest.mark.parametrize("run", ["both_1gpu", "gem_fake8", "gem_fake64"])
def test_reprice_gives_back_a_committed_run(run) -> None:
    """A run ``main()`` recorded with 0.2.19 (run i, one H100): ``reprice`` recomputes
    every recorded error of every round, and the rule the run was judged by."""
    vc = _load("validate_cost")
    path = vc.HERE / "results" / f"validate_cost_{run}_walk_rule_run_i_h100_2026-12-06.json"
    got = vc.reprice(path)
    import json

    rows = json.loads(path.read_text())["rows"]
    assert len(got["rows"]) == len(rows)
    for new, old in zip(got["rows"], rows):
        assert new["validation_rule"] == old["validation_rule"] == vc.RULE
        rule = [r[f"error_{vc.RULE}_pct"] for r in new["rounds"]]
        assert rule == pytest.approx(old["validation_rule_errors_pct"], abs=1e-9)
        for r in new["rounds"]:
            assert len(r["recorded"]) >= 6
            for k, v in r["recorded"].items():
                assert r[k] == pytest.approx(v, abs=1e-9), k
