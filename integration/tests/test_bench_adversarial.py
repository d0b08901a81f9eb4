"""Adversarial checks of the benchmark scripts' statistics (the figures READMEs quote)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_bench_scripts import run_step_variants_child

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import ablation  # noqa: E402
import precision_quality  # noqa: E402
import profile_step  # noqa: E402
import step_variants  # noqa: E402


class _FakeTrainer:
    """What ``ablation._train_row`` uses of a Trainer, with known step times and FLOPs:
    one warm-up step (slow: compilation) and two timed steps."""

    times = [9.0, 0.1, 0.3]
    tflop = [5.0, 0.02, 0.04]

    def __init__(self, preset, out_dir=None, device=None, progress=True):
        self.preset = preset
        self.model = SimpleNamespace(set_impl=lambda impl: None)

    def launch_step(self):
        return None

    def fit(self, stop_after=None, plot=True):
        hist = {"step_time_s": list(self.times), "step_tflop": list(self.tflop),
                "loss": [0.7] * len(self.times)}  # fmt: skip
        metrics = {
            "history": hist,
            "mfu": {"peak_tflops": 1.0, "measured_matmul_tflops": 0.5},
            "bbs": {"balanced": {"step_cost_cv": 0.1}},
            "peak_memory_gb": None,
        }
        return SimpleNamespace(metrics=metrics)

    def evaluate(self):
        return {"ctr_auc": 0.5, "cvr_auc": 0.5, "loss": 0.7}

    def autoac_summary(self):
        return None

    def close(self):
        pass


def test_ablation_row_median_of_an_even_number_of_timed_steps(monkeypatch):
    """``median_step_s`` is the median of the timed steps: the mean of the two middle ones
    for an even count (it was the upper one: the slower of smoke mode's two steps); the
    warm-up step is excluded; requests/s, TFLOP/s and MFU are totals over the timed steps."""
    import hyperrec.integration as integration

    monkeypatch.setattr(integration, "Trainer", _FakeTrainer)
    spec = {"preset": "tiny", "overrides": [], "warmup": 1, "timed": 2, "device": "cpu"}
    row = ablation._train_row(spec, 64)
    assert row["timed_step_s"] == [0.1, 0.3]
    assert row["median_step_s"] == pytest.approx(0.2)
    assert row["median_step_s"] == pytest.approx(statistics.median(row["timed_step_s"]))
    assert row["min_step_s"] == pytest.approx(0.1)
    assert row["requests_per_s"] == pytest.approx(64 * 2 / 0.4)
    assert row["tflops_per_gpu"] == pytest.approx(0.06 / 0.4)
    assert row["mfu"] == pytest.approx(0.06 / 0.4 / 1.0)
    assert row["fraction_of_measured_matmul"] == pytest.approx(0.06 / 0.4 / 0.5)


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_step_variants_one_timed_step(tmp_path):
    """With ``--steps 1`` the only timed step's read-back is the untimed last one: no
    ``finish_step`` median (the child died on ``statistics.median([])`` of an empty
    slice), the other figures from that one step."""
    got = run_step_variants_child(tmp_path, steps=1)
    assert len(got["step_times_s"]) == 1
    assert got["median_step_s"] == got["min_step_s"] == got["step_times_s"][0]
    assert got["finish_step_s_median"] is None
    assert got["launch_step_s_median"] > 0


def test_step_variants_reports_a_variant_without_a_timed_read(tmp_path, monkeypatch, capsys):
    """The parent prints and saves a variant whose ``finish_step_s_median`` is None (one
    timed step) instead of failing on ``None * 1e3`` after the child succeeded; a variant
    without an MFU (a CPU) prints "n/a", not "0.0%"."""
    record = {"median_step_s": 0.2, "min_step_s": 0.2, "step_times_s": [0.2],
              "requests_per_s": 640.0, "median_mfu": None, "launch_step_s_median": 0.15,
              "finish_step_s_median": None, "gpu_gap_s_median": None,
              "gpu_dry_at_launch_fraction": None, "allocator_per_step": {},
              "triton_jit_in_timed_steps": None}  # fmt: skip

    def fake_run(cmd, **kwargs):
        Path(cmd[cmd.index("--_child") + 1]).write_text(json.dumps(record))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    # the script's own view of the module only (machine_info runs real subprocesses)
    fake = SimpleNamespace(run=fake_run, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(step_variants, "subprocess", fake)
    argv = ["--out", str(tmp_path), "--smoke", "--steps", "1", "--variant", "base="]
    assert step_variants.main(argv) == 0
    (path,) = tmp_path.glob("step_variants_tiny_*.json")
    (variant,) = json.loads(path.read_text())["variants"]
    assert variant["status"] == "ok" and variant["finish_step_s_median"] is None
    out = capsys.readouterr().out
    assert "finish n/a ms" in out and "MFU n/a," in out and "0.0%" not in out


def test_precision_quality_skips_a_metric_a_run_could_not_score(tmp_path, monkeypatch):
    """An AUC a run cannot compute (one class in the split) is None in its metrics.json;
    the comparison pairs only the seeds where both runs scored it (it failed on the
    None, after every run had trained, and wrote nothing)."""
    cvr = {("bf16", 0): 0.60, ("fp8", 0): None, ("bf16", 1): 0.62, ("fp8", 1): 0.63,
           ("bf16", 2): None, ("fp8", 2): 0.64}  # fmt: skip

    def fake_run(args, overrides, seed, out):
        (precision,) = [o.split("=")[1] for o in overrides if "attention_precision" in o]
        return {"status": "ok", "wall_s": 1.0, "ctr_auc": 0.7 + seed / 100,
                "cvr_auc": cvr[(precision, seed)], "ctcvr_auc": 0.8, "ctr_ne": 0.9,
                "loss": 0.5, "steps": 5}  # fmt: skip

    monkeypatch.setattr(precision_quality, "run_one", fake_run)
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "1", "2",
            "--precisions", "bf16", "fp8"]  # fmt: skip
    assert precision_quality.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("precision_quality_*.json")).read_text())
    d = doc["difference_vs_baseline"]["fp8"]
    assert d["cvr_auc"]["min"] == d["cvr_auc"]["max"] == pytest.approx(0.01)  # seed 1 only
    assert d["ctr_auc"]["mean"] == pytest.approx(0.0)
    assert doc["baseline_seed_spread"]["cvr_auc"] == pytest.approx(0.02)  # seeds 0, 1
    assert doc["baseline_seed_spread"]["ctr_auc"] == pytest.approx(0.02)


def test_precision_quality_parallel_runs_keep_the_order_and_record_partial_results(
    tmp_path, monkeypatch
):
    """``--parallel 2``: runs overlap but the record lists them in job order, with the same
    differences as one at a time; the JSON is rewritten after every run, so a caller
    stopped mid-way (a device call's time limit) keeps the runs that finished."""
    import threading
    import time

    seen_partial = []
    running = {"now": 0, "max": 0}
    lock = threading.Lock()

    def fake_run(args, overrides, seed, out):
        (precision,) = [o.split("=")[1] for o in overrides if "attention_precision" in o]
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
            files = list(tmp_path.glob("precision_quality_*.json"))
            if files:
                seen_partial.append(json.loads(files[0].read_text())["complete"])
        time.sleep(0.05 if precision == "bf16" else 0.01)
        with lock:
            running["now"] -= 1
        return {"status": "ok", "wall_s": 1.0, "ctr_auc": 0.7 + seed / 100
                + (0.003 if precision == "fp8" else 0.0), "cvr_auc": 0.6, "ctcvr_auc": 0.8,
                "ctr_ne": 0.9, "loss": 0.5, "steps": 5}  # fmt: skip

    monkeypatch.setattr(precision_quality, "run_one", fake_run)
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "1",
            "--precisions", "bf16", "fp8", "--parallel", "2"]  # fmt: skip
    assert precision_quality.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("precision_quality_*.json")).read_text())
    assert running["max"] == 2
    assert [(r["variant"], r["seed"]) for r in doc["runs"]] == [
        ("bf16", 0), ("fp8", 0), ("bf16", 1), ("fp8", 1)]  # fmt: skip
    assert doc["complete"] is True and doc["parallel"] == 2
    assert False in seen_partial  # an incomplete record existed while runs were going
    d = doc["difference_vs_baseline"]["fp8"]["ctr_auc"]
    assert d["min"] == pytest.approx(0.003) and d["max"] == pytest.approx(0.003)
    with pytest.raises(SystemExit):
        precision_quality.main(argv[:-1] + ["0"])


def test_profile_host_times_are_per_timed_call(tmp_path, capsys):
    """``--host``: ``launch_step`` is timed for every step, ``finish_step`` for all but the
    last (nothing is queued behind it): with one step there is no timed read, reported as
    None (it was 0.0 s, a measurement that never happened)."""
    host_s = {"launch": 0.0, "finish": 0.0}

    def run(n, metrics):  # as profile()'s run: run_steps' sums added to host_s
        host_s["launch"] += 0.2 * n
        host_s["finish"] += 0.01 * (n - 1)
        metrics.extend({"step_time_s": 0.25} for _ in range(n))

    three = profile_step._host_profile(run, 3, host_s)
    assert three["launch_step_s"] == pytest.approx(0.2)
    assert three["finish_step_s"] == pytest.approx(0.01)
    assert three["step_times_s"] == [0.25] * 3
    one = profile_step._host_profile(run, 1, host_s)
    assert one["launch_step_s"] == pytest.approx(0.2)
    assert one["finish_step_s"] is None
    doc = {"gpu": None, "implicit_host_syncs": {"count": 0}, "runtime_blocking_calls": {},
           "blocking_call_sites": {}, "host": one, "time_basis": "CPU self time of ops",
           "time_by_category": {}, "steps": []}  # fmt: skip
    profile_step._print(doc, tmp_path / "p.json")
    assert "finish_step n/a ms" in capsys.readouterr().out


def test_precision_quality_passes_a_variants_environment_to_its_run_only(tmp_path, monkeypatch):
    """``--variant NAME=@ENV=VALUE,...``: the variable reaches that variant's process
    alone (a kernel switch compared at equal steps) and is recorded."""
    seen = {}

    def fake_run(args, overrides, seed, out, env=None):
        seen[out.name] = (list(overrides), env)
        return {"status": "ok", "wall_s": 1.0, "ctr_auc": 0.7, "cvr_auc": 0.6,
                "ctcvr_auc": 0.8, "ctr_ne": 0.9, "loss": 0.5, "steps": 5}  # fmt: skip

    monkeypatch.setattr(precision_quality, "run_one", fake_run)
    nogluon = "nogluon=@JAGGED_ATTN_GLUON=0,train.lr=3e-4"
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0",
            "--variant", "base=", "--variant", nogluon]  # fmt: skip
    assert precision_quality.main(argv) == 0
    assert seen["run-base-seed0"] == ([], None)
    assert seen["run-nogluon-seed0"] == (["train.lr=3e-4"], {"JAGGED_ATTN_GLUON": "0"})
    doc = json.loads(next(tmp_path.glob("variants_quality_*.json")).read_text())
    assert doc["variant_env"] == {"nogluon": {"JAGGED_ATTN_GLUON": "0"}}


@pytest.mark.slow  # a bench script's smoke run: not in `nox -s lowest`
def test_precision_quality_real_runs_record_gradient_norms(tmp_path):
    """Two real training runs (micro preset, 4 steps, side by side): the record holds each
    run's test metrics and the gradient norms of its logged steps."""
    argv = ["--preset", "micro", "--steps", "4", "--seeds", "0", "--smoke", "--parallel", "2",
            "--variant", "a=", "--variant", "b=@HYPERREC_UNUSED=1,train.lr=1e-3",
            "--out", str(tmp_path)]  # fmt: skip
    assert precision_quality.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("variants_quality_*.json")).read_text())
    assert doc["complete"] is True
    for run in doc["runs"]:
        assert run["status"] == "ok" and run["steps"] == 4
        g = run["grad_norm"]
        assert g["logged"] >= 1 and 0.0 < g["median"] <= g["max"]
        assert 0 <= g["above_1"] <= g["logged"]


def test_precision_quality_parallel_runs_split_the_host_cores(monkeypatch):
    """Side by side, each run's process gets a share of the cores (unless the caller set
    the thread count), and a variant's own environment items still win."""
    monkeypatch.setattr(precision_quality.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert precision_quality.child_env(1) is None
    env = precision_quality.child_env(4, {"X_SWITCH": "0"})
    assert env["OMP_NUM_THREADS"] == "4" and env["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    assert env["X_SWITCH"] == "0"
    assert precision_quality.child_env(32)["OMP_NUM_THREADS"] == "1"
    assert precision_quality.child_env(1, {"X_SWITCH": "1"})["X_SWITCH"] == "1"
    assert "OMP_NUM_THREADS" not in precision_quality.child_env(1, {"X_SWITCH": "1"})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert precision_quality.child_env(4)["OMP_NUM_THREADS"] == "3"
    assert precision_quality.child_env(4, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"
