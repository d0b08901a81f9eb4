"""``bench/bench_autoac.py --smoke``: the benchmark's code paths on the CPU (tiny shapes),
so a GPU run does not find a broken point. Compiled mode with MXINT8: the compiled
packed points and their records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrec import autoac

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_autoac.py"

# Bench-script smoke runs (tens of seconds together): `nox -s lowest` leaves them to the
# normal session; they test this package's benchmark, not the siblings' APIs.
pytestmark = pytest.mark.slow


def _smoke_rows(tmp_path: Path, mode: str, model: str) -> dict[str, dict]:
    """Run the benchmark's ``--smoke`` in ``mode`` with MXINT8 on one model: its points
    by method."""
    cmd = [sys.executable, str(BENCH), "--smoke", mode, "--formats", "mxint8",
           "--models", model, "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    return {r["method"]: r for r in json.loads(path.read_text())["models"][model]["points"]}


@pytest.mark.skipif(not autoac.compiled_packing_supported(), reason="no inlined hooks")
def test_compiled_smoke_run_records_the_packed_points(tmp_path):
    rows = _smoke_rows(tmp_path, "--compiled", "hstu")
    for name in ("no_ac", "full_ac", "compiled_no_ac", "autoac_compiled@0.5"):
        assert "time_ms_median" in rows[name], rows.get(name)
    quant = [r for n, r in rows.items() if n.startswith("autoac_compiled_quant@")]
    assert quant and all("time_ms_median" in r for r in quant)
    # the compiled points carry the peak priced from their graphs beside the profile's
    assert all(r["predicted_peak_priced"] > 0 for r in quant)
    assert rows["autoac_compiled@0.5"]["predicted_peak_priced"] > 0
    applied = rows["autoac_apply_compiled_quant@0.5"]
    assert "time_ms_median" in applied, applied
    assert applied["verification"]["within_budget"] is not None
    packed = rows["pack_all_compiled_mxint8"]
    assert "time_ms_median" in packed and packed["activation_reduction_vs_compiled_no_ac"] > 0
    # every region of the pack-all plan packed saved nodes inside its graph
    assert packed["packed_in_graph"] and all(packed["packed_in_graph"].values())


@pytest.mark.skipif(not autoac.compiled_packing_supported(), reason="no inlined hooks")
def test_curve_smoke_run_pairs_each_torch_budget_with_autoac_at_its_peak(tmp_path):
    rows = _smoke_rows(tmp_path, "--curve", "llama")
    assert [p.name for p in tmp_path.glob("*.json")][0].startswith("smoke_curve_llama_")
    for peer_name in ("full_ac", "torch_budget@0.5", "torch_budget@0"):
        peer = rows[peer_name]
        for kind in ("", "_fused", "_quant", "_fused_quant"):
            r = rows[f"autoac_apply_compiled{kind}@{peer_name}"]
            assert "time_ms_median" in r, r
            # asked for the peer's measured peak (or autoac's floor, if above it)
            assert r["budget_bytes"] >= peer["peak_bytes"]
            assert r["predicted_peak_priced"] <= r["budget_bytes"] or r["peak_replans"]
            assert r["within_budget"] is not None
            assert bool(r["packed"]) == kind.endswith("_quant") or not r["packed"]


def test_span_free_bound_smoke_run_records_both_region_kinds(tmp_path):
    """``bench/span_free_bound.py``: layers and two spans per layer, the bound at each
    budget beside the region plan, and the plan at full AC's peak measured."""
    script = BENCH.parent / "span_free_bound.py"
    for spans in ([], ["--spans"]):
        cmd = [sys.executable, str(script), "--smoke", "--models", "llama",
               "--fractions", "0", "0.5", "--out", str(tmp_path), *spans]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    docs = {json.loads(p.read_text())["regions"]: json.loads(p.read_text())
            for p in tmp_path.glob("span_free_bound*.json")}  # fmt: skip
    assert set(docs) == {"layers", "two spans per layer"}
    for doc in docs.values():
        points = doc["models"]["llama"]["points"]
        assert len(points) == 4  # 2 budgets x (no format, mxint8)
        for row in points:
            assert row["lower_bound_ms"] is not None
            assert row["lower_bound_ms"] <= row["plan_added_ms"] + 1e-9
        measured = [r for r in points if r["budget_fraction"] == 0 or not r["formats"]]
        assert len(measured) == 3 and all("time_ms_median" in r["plan_measured"] for r in measured)


def test_pack_all_smoke_run_measures_with_and_without_inputs(tmp_path):
    """``--pack-all``: the baselines and each format's pack_all point with the regions'
    inputs packed (0.1.18) and without them, in one run."""
    cmd = [sys.executable, str(BENCH), "--smoke", "--pack-all", "--formats", "mxint8",
           "--models", "hstu,llama", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("smoke_pack_all_*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["pack_all_only"]
    for model in ("hstu", "llama"):
        rows = {r["method"]: r for r in doc["models"][model]["points"]}
        assert set(rows) == {"no_ac", "full_ac", "pack_all_mxint8", "pack_all_mxint8_no_inputs"}
        packed, kept = rows["pack_all_mxint8"], rows["pack_all_mxint8_no_inputs"]
        assert packed["regions_inputs_packed_bytes"] > 0 == kept["regions_inputs_packed_bytes"]
        assert packed["packed_ops"] > kept["packed_ops"]
        assert packed["activation_reduction_vs_no_ac"] > 1 and "time_ms_median" in kept
