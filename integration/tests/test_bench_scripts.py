"""The benchmark scripts' bookkeeping (the GPU measurements themselves are not tests)."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import ablation  # noqa: E402
import precision_quality  # noqa: E402
import profile_step  # noqa: E402
import step_variants  # noqa: E402

from hyperrec.integration import get_preset  # noqa: E402


def test_ablation_orchestration(tmp_path, monkeypatch):
    """Rows build on each other, unavailable techniques are recorded and skipped, the
    naive row's batch (halved in its process until it fits) is every comparable row's,
    speedups are against naive at one batch."""
    calls = []

    def measured(rps, mfu, memory, batch):
        return {
            "status": "ok",
            "global_batch_size": batch,
            "requests_per_s": rps,
            "mfu": mfu,
            "tflops_per_gpu": 989.4 * mfu,
            "peak_memory_gb": memory,
            "heldout_ctr_auc": 0.6,
            "step_cost_cv": 0.1,
        }

    def fake_launch(spec, timeout, in_process):
        calls.append(spec)
        assert len({o.split("=")[0] for o in spec["overrides"]}) == len(spec["overrides"])
        if spec.get("halve_on_oom"):  # the naive row: halved to 64 first, fits at 32
            assert spec["batch"] == 64 and spec["min_batch"] == 32
            return {**measured(100.0, 0.05, 120.0, 32), "oom_at_batch": [64]}
        return measured(100.0 + 50 * len(calls), 0.3, 60.0, spec["batch"])

    monkeypatch.setattr(ablation, "_launch", fake_launch)
    monkeypatch.setattr(ablation, "_cuda_available", lambda: True)
    args = ablation.build_parser().parse_args(["--out", str(tmp_path)])
    doc = ablation.run(args)
    rows = {r["name"]: r for r in doc["rows"]}
    assert doc["global_batch_size"] == 32 and rows["naive"]["oom_at_batch"] == [64]
    # gem's naive row is expected to take longer at 128 than its share of the budget
    assert doc["batch_note"].startswith("batch halved to 64 before the naive row")
    assert rows["naive"]["speedup_vs_naive"] == 1.0
    assert rows["naive"]["naive_estimate"]["batch"] == 32
    assert rows["naive"]["naive_estimate"]["steps"][0]["padded_hstu_tflop"] > 0
    assert all(c["batch"] == 32 for c in calls[1:-2])
    assert (
        rows["+ jagged kernels"]["speedup_vs_naive"]
        == rows["+ jagged kernels"]["requests_per_s"] / 100.0
    )
    # Rows switch fields an earlier row set: the later value wins.
    jagged = rows["+ jagged kernels"]["overrides"]
    assert "train.impl=hyperrec" in jagged and "train.impl=naive" not in jagged
    for name in ("+ autoac", "+ FP8 attention", "+ sharded embeddings"):
        assert rows[name]["status"] == "ok", name
    # "all" carries every earlier available override, none of the unavailable ones.
    all_overrides = rows["all"]["overrides"]
    for o in (
        "train.sharding=hyperrec",
        "train.mesh=5d",
        "train.compile=inductor",
        "train.mlp_precision=mxfp8",
        "train.activation_checkpointing=autoac",
        "train.sparse=sharded",
    ):
        assert o in all_overrides
    # FP8 attention is measured in its own row but "all" runs the (faster) bf16 attention.
    assert "train.attention_precision=bf16" in all_overrides
    assert "train.attention_precision=fp8" in rows["+ sharded embeddings"]["overrides"]
    assert rows["all @ preset batch"]["speedup_vs_naive"] is None
    assert calls[-2]["batch"] == 128 and calls[-1]["batch"] == 3 * 128
    assert rows["all @ 3x preset batch"]["overrides"] == all_overrides
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0].startswith("ablation_gem_full_") and files[0].endswith(".json")
    on_disk = json.loads((tmp_path / files[0]).read_text())
    assert [r["name"] for r in on_disk["rows"]] == [r["name"] for r in doc["rows"]]
    table = (tmp_path / files[1]).read_text()
    assert table.count("\n| ") == len(doc["rows"]) + 1
    assert "| + FP8 attention | " in table


def test_ablation_naive_batch_is_halved_only_when_not_given(tmp_path, monkeypatch):
    """The naive row starts at a batch whose expected time fits its share of the budget,
    unless --batch names one; the expected time is the estimate times the measured
    factor."""
    batches = []

    def fake_launch(spec, timeout, in_process):
        if spec.get("halve_on_oom"):
            batches.append(spec["batch"])
        return {"status": "timeout", "error": "fake"}

    monkeypatch.setattr(ablation, "_launch", fake_launch)
    monkeypatch.setattr(ablation, "_cuda_available", lambda: True)
    doc = ablation.run(ablation.build_parser().parse_args(["--out", str(tmp_path), "--quick"]))
    est = ablation.naive_estimate(get_preset("gem"), batches[0], 5)
    assert est["expected_s_total"] == pytest.approx(
        ablation._NAIVE_MEASURED_OVER_ESTIMATE * est["estimated_s_total"]
    )
    budget = ablation.MODES["quick"]["budget"] * ablation._NAIVE_SHARE_OF_BUDGET
    assert ablation._ROW_STARTUP_S + est["expected_s_total"] <= budget
    assert batches[0] < 128 and doc["batch_note"] is not None
    ablation.run(ablation.build_parser().parse_args(["--out", str(tmp_path), "--batch", "128"]))
    assert batches[1] == 128


def test_ablation_resume_runs_only_the_rows_left(tmp_path, monkeypatch):
    """A full table takes two invocations on a time-sliced GPU: the second keeps the
    first's measured rows (and the naive row's batch and rate) and runs only the rest."""
    launched: list[tuple[int, tuple[str, ...]]] = []
    invocation = [1]

    def fake_launch(spec, timeout, in_process):
        launched.append((invocation[0], tuple(spec["overrides"])))
        if invocation[0] == 1 and len(launched) > 3:
            return {"status": "timeout", "error": "row exceeded its budget"}
        batch = 64 if spec.get("halve_on_oom") else spec["batch"]
        rps = 10.0 if spec.get("halve_on_oom") else 40.0 + invocation[0]
        return {"status": "ok", "global_batch_size": batch, "requests_per_s": rps, "mfu": 0.1,
                "tflops_per_gpu": 98.9, "peak_memory_gb": 1.0, "heldout_ctr_auc": 0.6}  # fmt: skip

    monkeypatch.setattr(ablation, "_launch", fake_launch)
    monkeypatch.setattr(ablation, "_cuda_available", lambda: True)
    first = ablation.run(ablation.build_parser().parse_args(["--out", str(tmp_path)]))
    path = next(tmp_path.glob("ablation_gem_full_*.json"))
    ok_first = [r["name"] for r in first["rows"] if r.get("status") == "ok"]
    assert len(ok_first) == 3 and ok_first[0] == "naive"
    invocation[0] = 2
    args = ablation.build_parser().parse_args(["--out", str(tmp_path), "--resume", str(path)])
    second = ablation.run(args)
    rows = {r["name"]: r for r in second["rows"]}
    assert second["invocations"] == 2 and second["global_batch_size"] == 64
    assert all(rows[n].get("from_earlier_invocation") for n in ok_first)
    assert all(r["status"] == "ok" for r in second["rows"] if r["name"] not in ok_first
               and r.get("status") != "not available")  # fmt: skip
    # Nothing measured in the first invocation ran again; the rest ran against its naive row.
    assert len([1 for inv, _ in launched if inv == 2]) == len(second["rows"]) - 3 - sum(
        r.get("status") == "not available" for r in second["rows"])  # fmt: skip
    assert rows["all"]["speedup_vs_naive"] == pytest.approx(42.0 / 10.0)
    table = path.with_suffix(".md").read_text()
    assert "Rows measured in 2 invocations" in table
    assert "| naive* |" in table and "| all |" in table  # kept rows marked, new ones not
    # A result of another mode is refused, not merged.
    bad = ablation.build_parser().parse_args(
        ["--out", str(tmp_path), "--quick", "--resume", str(path)]
    )
    with pytest.raises(SystemExit, match="mode"):
        ablation.run(bad)


@pytest.mark.slow  # tens of seconds; `nox -s lowest` leaves it to the normal session
def test_ablation_smoke_runs_every_row(tmp_path):
    """Every row of the table trains on the CPU (tiny preset, in process): a combination
    of switches that breaks (autoac + FP8 attention did) fails here, not on the GPU."""
    doc = ablation.run(ablation.build_parser().parse_args(["--out", str(tmp_path), "--smoke"]))
    for r in doc["rows"]:
        assert r.get("status") in ("ok", "not available"), (r["name"], r.get("error"))
    assert sum(r.get("status") == "ok" for r in doc["rows"]) >= 8
    # The rows ran in this process: the one-rank group each made is gone again (a group
    # left behind turned later tests' trainers into sharded ones).
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_compose_is_last_wins():
    assert ablation.compose(["a.x=1", "a.y=2"], ["a.x=3"], [" a.z = 4"]) == [
        "a.y=2",
        "a.x=3",
        " a.z = 4",
    ]
    assert ablation.compose() == []


@pytest.mark.parametrize("preset", ["gem", "tiny"])
def test_every_ablation_row_composes_to_a_valid_config(preset):
    """Each row's composed overrides build a valid preset (or are "not available" for a
    technique not integrated), with the previous available row's values except the
    row's own fields."""
    from hyperrec.integration import get_preset, override

    base = get_preset(preset)
    previous = None
    configs = ablation.row_configs(preset, ["data.eval_requests=128"])
    assert [row.name for row, _, _ in configs] == [row.name for row in ablation.ROWS]
    for row, overrides, why in configs:
        keys = [o.partition("=")[0] for o in overrides]
        assert len(keys) == len(set(keys)), row.name
        if why is not None:
            assert "not available yet" in why, (row.name, why)
            with pytest.raises(ValueError, match="not available yet"):
                override(base, overrides)
            continue
        cfg = override(base, overrides).to_dict()
        for own in row.overrides:
            section, _, field = own.partition("=")[0].partition(".")
            assert str(cfg[section][field]).lower() == own.partition("=")[2].lower(), own
        if previous is not None:
            mine = {o.partition("=")[0] for o in row.overrides}
            for section in ("data", "model", "train"):
                for field, value in cfg[section].items():
                    if f"{section}.{field}" not in mine:
                        assert previous[section][field] == value, (row.name, field)
        previous = cfg
    assert previous["train"]["impl"] == "hyperrec" and previous["train"]["compile"] == "inductor"


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("_fwd_kernel", "attention"),
        ("_bwd_dkdv_kernel", "attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_TNT", "gemm"),
        ("_mx_quantize_2d_kernel", "mxfp8_quantize"),
        ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer"),
        ("void at::native::multi_tensor_apply_kernel<...>", "optimizer"),
        ("void at::native::compute_grad_weight<float, long>", "embedding"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("ncclDevKernel_AllGather_RING_LL", "nccl"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("something_else", "other"),
    ],
)
def test_profile_categories(name, category):
    assert profile_step.categorize(name) == category


def test_busy_time_is_the_union_of_intervals():
    assert profile_step._union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert profile_step._union_us([]) == 0


def test_profile_summary_skips_annotations_and_names_blocking_call_sites():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, start, end, device=DeviceType.CUDA, annotation=False, parent=None):
        return SimpleNamespace(
            name=name,
            time_range=SimpleNamespace(start=start, end=end),
            device_type=device,
            is_user_annotation=annotation,
            cpu_parent=parent,
        )

    bench = ev("triton/testing.py(120): do_bench", 0, 0, device=DeviceType.CPU)
    events = [
        ev("_mm_fixup_kernel", 0, 100),
        ev("FillFunctor<int>", 100, 110),
        ev("FillFunctor<int>", 120, 130),
        ev("Optimizer.step#AdamW.step", 0, 1000, annotation=True),  # spans the rest
        ev("cudaDeviceSynchronize", 0, 1, device=DeviceType.CPU, parent=bench),
        ev("cudaDeviceSynchronize", 2, 3, device=DeviceType.CPU),
        ev("cudaEventSynchronize", 4, 5, device=DeviceType.CPU),
    ]
    out = profile_step._summarize(SimpleNamespace(events=lambda: events), cuda=True)
    assert out["gpu"]["window_ms"] == 0.13 and out["gpu"]["kernel_launches"] == 3
    assert sum(c["ms"] for c in out["time_by_category"].values()) == pytest.approx(0.12)
    fills = next(k for k in out["top_kernels"] if k["name"] == "FillFunctor<int>")
    assert fills["launches"] == 2
    assert out["runtime_blocking_calls"]["cudaDeviceSynchronize"] == 2
    assert out["blocking_call_sites"]["cudaDeviceSynchronize"] == {
        "triton/testing.py(120): do_bench": 1,
        "(no enclosing op: a direct runtime call)": 1,
    }


def test_profile_attributes_kernels_to_the_enclosing_op_and_model_line():
    from types import SimpleNamespace

    def ev(name, start, end, thread=1, kernels=()):
        return SimpleNamespace(
            name=name,
            time_range=SimpleNamespace(start=start, end=end),
            thread=thread,
            kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
            cpu_parent=None,  # the GPU profiles left runtime calls without parents
        )

    events = [
        ev("hyperrec/integration/model.py(380): forward", 0, 100),
        ev("aten::add_", 10, 20),
        ev("cudaLaunchKernel", 12, 13, kernels=[("vectorized_elementwise_kernel add", 5.0)]),
        ev("aten::cat", 30, 40),
        ev("cudaLaunchKernel", 31, 32, kernels=[("CatArrayBatchedCopy", 7.0)]),
        # an Inductor kernel inside the frame but outside any ATen op
        ev("cuLaunchKernelEx", 50, 51, kernels=[("triton_poi_fused_silu_0", 2.0)]),
        # after the frame ended, and on another thread (the autograd engine's)
        ev("cuLaunchKernelEx", 150, 151, kernels=[("triton_poi_fused_add_1", 1.0)]),
        ev("aten::mul", 0, 500, thread=2),
        ev("cudaLaunchKernel", 200, 201, thread=2, kernels=[("elementwise mul", 3.0)]),
        ev("cudaLaunchKernel", 60, 61, kernels=[("nvjet_gemm", 9.0)]),  # not counted
    ]
    rows = {(r["category"], r["origin"]): (r["ms"], r["launches"])
            for r in profile_step._by_origin(events, ("elementwise", "copies"))}  # fmt: skip
    frame = "hyperrec/integration/model.py(380): forward"
    assert rows == {
        ("elementwise", f"aten::add_ @ {frame}"): (0.005, 1),
        ("copies", f"aten::cat @ {frame}"): (0.007, 1),
        ("elementwise", f"? @ {frame}"): (0.002, 1),
        ("elementwise", "?"): (0.001, 1),
        ("elementwise", "aten::mul"): (0.003, 1),
    }
    most = profile_step._by_origin(events + events[2:3], None, top=2, by="launches")
    assert [(r["origin"], r["launches"]) for r in most][0] == (f"aten::add_ @ {frame}", 2)


def test_step_variant_parsing():
    assert step_variants.parse_variant("base=") == ("base", [], {})
    assert step_variants.parse_variant("v=train.compile=off,@FOO=1,train.a=b") == (
        "v",
        ["train.compile=off", "train.a=b"],
        {"FOO": "1"},
    )
    for bad, match in (("=x", "NAME="), ("v=nothing", "no '='"), ("v=a=1", "neither")):
        with pytest.raises(ValueError, match=match):
            step_variants.parse_variant(bad)


def test_run_steps_hook_and_counter_delta():
    """``before_step`` sees every step index before that step is queued; counter deltas are
    per step and only over counters in both snapshots."""
    log: list[object] = []

    class Fake:
        def launch_step(self):
            log.append("launch")
            return len(log)

        def finish_step(self, pending):
            return {"step": pending}

        def drain(self):
            log.append("drain")

    metrics, launch, finish = _common.run_steps(Fake(), 3, log.append)
    assert log == [0, "launch", 1, "launch", 2, "launch", "drain"]
    assert len(metrics) == 3 and len(launch) == 3 and len(finish) == 2
    got = _common.counter_delta({"a": 1, "b": 5}, {"a": 7, "c": 1}, 3)
    assert got == {"a": 2.0}


def test_jit_log_attributes_compiles_to_timed_steps_only():
    # Compiles before the first timed step (warm-up) and after the last step finished
    # (evaluation) are not counted; the others land in the step queued before them.
    log = _common.JitLog()
    log.events = [(0.5, 0.9, "warmup"), (1.2, 1.3, "k1"), (2.7, 3.0, "k2"), (4.1, 4.2, "eval")]
    got = log.per_step([1.0, 2.0, 3.0], 4.0)
    assert got == [
        {"step": 0, "kernel": "k1", "seconds": pytest.approx(0.1)},
        {"step": 1, "kernel": "k2", "seconds": pytest.approx(0.3)},
    ]
    assert log.per_step([], 4.0) == []


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_step_variants_smoke(tmp_path):
    """Two variants in fresh processes on the CPU: figures recorded, the GIL switch
    interval set from the variant's environment, a failing variant recorded as failed
    without stopping the run."""
    assert step_variants.main(["--out", str(tmp_path), "--smoke", "--warmup", "1", "--steps",
                               "2", "--variant", "base=@STEP_VARIANTS_SWITCH_INTERVAL=0.0005",
                               "--variant", "broken=train.no_such_field=1"]) == 0  # fmt: skip
    (path,) = tmp_path.glob("step_variants_tiny_*.json")
    doc = json.loads(path.read_text())
    ok, broken = doc["variants"]
    assert ok["status"] == "ok" and len(ok["step_times_s"]) == 2
    assert ok["median_step_s"] > 0 and ok["launch_step_s_median"] > 0
    assert ok["switch_interval_s"] == pytest.approx(0.0005)
    assert ok["allocator_per_step"] == {}  # no CUDA allocator on a CPU
    assert broken["status"] == "failed" and "no_such_field" in broken["error"]


def run_step_variants_child(tmp_path, *, steps: int) -> dict:
    """``step_variants``' child on the CPU smoke preset, one warm-up step, in this process
    (its one-rank process group torn down after, if it made it)."""
    import argparse

    import torch.distributed as dist

    args = argparse.Namespace(smoke=True, preset=None, warmup=1, steps=steps, set=[],
                              out=str(tmp_path))  # fmt: skip
    created = not dist.is_initialized()
    try:
        return step_variants.run_child(args)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_step_variants_allocator_counters_per_step(tmp_path, monkeypatch):
    """The allocator counters are read before the first timed step and after the drain and
    reported per timed step (a CPU has no CUDA allocator: a counting stand-in replaces it;
    the dynamo counters read at the end once shadowed these and the field came out empty
    on the GPU)."""

    reads = iter([{"num_device_alloc": 10, "num_alloc_retries": 0},
                  {"num_device_alloc": 16, "num_alloc_retries": 4}])  # fmt: skip
    monkeypatch.setattr(step_variants, "allocator_counters", lambda: next(reads))
    got = run_step_variants_child(tmp_path, steps=2)
    assert got["allocator_per_step"] == {"num_device_alloc": 3.0, "num_alloc_retries": 2.0}


def test_precision_quality_pairs_runs_by_seed(tmp_path, monkeypatch):
    """Differences against bf16 are paired by seed, a failed run is recorded and makes
    the exit status 1 without hiding the others, and the bf16 seed spread is reported."""
    auc = {("bf16", 0): 0.70, ("fp8", 0): 0.69, ("bf16", 1): 0.72, ("fp8", 1): 0.73}

    def fake_run(args, overrides, seed, out):
        (precision,) = [o.split("=")[1] for o in overrides if "attention_precision" in o]
        if (precision, seed) not in auc:
            return {"status": "failed", "error": "boom", "wall_s": 0.1}
        v = auc[(precision, seed)]
        return {"status": "ok", "wall_s": 1.0, "ctr_auc": v, "cvr_auc": v, "ctcvr_auc": v,
                "ctr_ne": 1 - v, "loss": 1 - v, "steps": 5}  # fmt: skip

    monkeypatch.setattr(precision_quality, "run_one", fake_run)
    rc = precision_quality.main(["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "1"])
    assert rc == 1  # fp8_bwd failed
    (path,) = tmp_path.glob("precision_quality_*.json")
    doc = json.loads(path.read_text())
    assert doc["baseline"] == "bf16"
    d = doc["difference_vs_baseline"]["fp8"]["ctr_auc"]
    assert d["min"] == pytest.approx(-0.01) and d["max"] == pytest.approx(0.01)
    assert d["mean"] == pytest.approx(0.0)
    assert doc["baseline_seed_spread"]["ctr_auc"] == pytest.approx(0.02)
    assert [r["status"] for r in doc["runs"] if r["variant"] == "fp8_bwd"] == ["failed"] * 2
    with pytest.raises(SystemExit):
        precision_quality.main(["--out", str(tmp_path), "--steps", "0"])


def _record_quality_runs(monkeypatch):
    """Replace precision_quality's training run by one that records each run's overrides
    (by output directory name) and reports fixed metrics; returns the record."""
    seen = {}

    def fake_run(args, overrides, seed, out, env=None):
        seen[out.name] = overrides if env is None else (overrides, env)
        return {"status": "ok", "wall_s": 1.0, "ctr_auc": 0.7, "cvr_auc": 0.6,
                "ctcvr_auc": 0.8, "ctr_ne": 0.9, "loss": 0.5, "steps": 5}  # fmt: skip

    monkeypatch.setattr(precision_quality, "run_one", fake_run)
    return seen


def test_quality_of_ablation_rows_uses_the_rows_overrides(tmp_path, monkeypatch):
    """``--rows naive all``: each run gets its row's composed overrides (on the CPU with
    aot_eager for Inductor and an autoac budget); the first row is the baseline; an
    unknown row is refused with the list of rows."""
    seen = _record_quality_runs(monkeypatch)
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "--rows", "naive", "all"]
    assert precision_quality.main(argv) == 0
    naive, full = seen["run-naive-seed0"], seen["run-all-seed0"]
    assert "train.impl=naive" in naive and "train.sharding=fsdp2" in naive
    assert "train.impl=hyperrec" in full and "train.window_steps=8" in full
    assert "train.compile=aot_eager" in full and "train.compile=inductor" not in full
    assert "train.ac_budget_gb=1" in full
    doc = json.loads(next(tmp_path.glob("ablation_quality_*.json")).read_text())
    assert doc["baseline"] == "naive" and set(doc["difference_vs_baseline"]) == {"all"}
    with pytest.raises(SystemExit, match="no ablation row"):
        precision_quality.main(["--out", str(tmp_path), "--rows", "naive", "fastest"])


def test_quality_of_given_variants_and_seq_linears(tmp_path, monkeypatch):
    """``--variant NAME=...`` runs exactly the given overrides, the first as baseline;
    ``--seq-linears`` compares the two linear precisions; the modes exclude each other;
    a variant's environment items reach its run (they were refused before)."""
    seen = _record_quality_runs(monkeypatch)
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0",
            "--variant", "f32=", "--variant", "bf=train.residual_dtype=autocast"]  # fmt: skip
    assert precision_quality.main(argv) == 0
    assert seen == {"run-f32-seed0": [], "run-bf-seed0": ["train.residual_dtype=autocast"]}
    doc = json.loads(next(tmp_path.glob("variants_quality_*.json")).read_text())
    assert doc["baseline"] == "f32" and set(doc["difference_vs_baseline"]) == {"bf"}
    seen.clear()
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "1", "--seq-linears"]
    assert precision_quality.main(argv) == 0
    assert seen == {"run-bf16-seed1": ["train.seq_linear_precision=bf16"],
                    "run-fp8-seed1": ["train.seq_linear_precision=fp8"]}  # fmt: skip
    assert next(tmp_path.glob("seq_linear_quality_*.json"))
    with pytest.raises(SystemExit):
        precision_quality.main(["--out", str(tmp_path), "--seq-linears", "--variant", "a="])
    seen.clear()
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "--variant", "a=@X=1"]
    assert precision_quality.main(argv) == 0
    assert seen == {"run-a-seed0": ([], {"X": "1"})}


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_cublas_host_smoke_writes_its_result(tmp_path):
    import cublas_host

    assert cublas_host.main(["--out", str(tmp_path), "--smoke"]) == 0
    (path,) = tmp_path.glob("cublas_host_cpu_*.json")
    doc = json.loads(path.read_text())
    case = doc["results"]["mm_NT (forward, x W^T)"]
    assert set(case) == {"same_M", "new_M_each_call", "M_rounded_up_to_256"}
    assert all(v["min_us"] <= v["median_us"] <= v["max_us"] for v in case.values())


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_ac_same_memory_trains_longer_histories_within_the_no_ac_peak(tmp_path):
    """``bench/ac_same_memory.py`` on ``tiny``: twice the history lengths train under the
    no-AC peak of the preset's own (autoac's measured peak within it), three times do
    not fit (their floor is above it)."""
    import ac_same_memory

    path = ac_same_memory.main(["--out", str(tmp_path), "--factors", "2", "3", "--steps", "3"])
    doc = json.loads(path.read_text())
    base, x2, x3 = doc["rows"]
    assert doc["budget_gb"] == base["no_ac_peak_gb"]
    assert x2["fits"] and x2["no_ac_peak_gb"] > doc["budget_gb"]
    v = x2["autoac"]["verification"]
    assert v["measured_peak"] <= doc["budget_gb"] * 1e9 * 1.001 and x2["steps"] == 3
    assert not x3["fits"] and x3["floor_gb"] > doc["budget_gb"]


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_ac_pack_cut_measures_both_variants_alike(tmp_path):
    """``bench/ac_pack_cut.py`` on ``tiny`` (CPU, float32 saves): both variants start from
    the same held bytes, pack_all allocates less in the step, and its cuts are the
    ratios of the recorded bytes."""
    import ac_pack_cut

    path = ac_pack_cut.main(["--out", str(tmp_path), "--repeats", "1", "--warm", "1"])
    doc = json.loads(path.read_text())
    off, packed = doc["no_ac"], doc["pack_all"]
    assert packed["base_gb"] == pytest.approx(off["base_gb"], rel=0.02)
    assert packed["packed_ops"] > 0 and "autoac" not in off
    assert (
        doc["step_cut"] == pytest.approx(off["step_gb"] / packed["step_gb"])
        and doc["step_cut"] > 1.2
    )
    assert doc["layers_held_cut"] == pytest.approx(
        packed["layers_noac_held_gb"] / packed["layers_held_gb"]
    )
    assert doc["layers_held_cut"] > doc["step_cut"]


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_feature_scales_records_every_module_each_interval(tmp_path):
    import feature_scales

    out = tmp_path / "scales.json"
    assert feature_scales.main(["--preset", "micro", "--steps", "3", "--every", "2",
                                "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [0, 2]  # every 2nd step and the last
    for r in rows:
        seen = r["std_and_mean_abs"]
        assert {"pma", "ctr_head", "interaction", "seq_layers.0"} <= set(seen)
        assert all(len(v) == 2 and v[0] >= 0 and v[1] >= 0 for v in seen.values())
        assert r["loss"] > 0


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_tower_influence_measures_both_changes(tmp_path):
    import tower_influence

    assert tower_influence.main(["--preset", "tiny", "--seeds", "0", "--requests", "16",
                                 "--out", str(tmp_path)]) == 0  # fmt: skip
    (row,) = json.loads((tmp_path / "tower_influence_tiny_cpu.json").read_text())["rows"]
    for key in ("ctr", "cvr"):
        # both really change the output; the precision far less than skipping the layers
        assert 0 < row["fp8"][key] < row["skip_seq_layers"][key]
