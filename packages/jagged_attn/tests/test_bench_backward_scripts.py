"""The backward tuning scripts run end to end on tiny shapes (interpreter), so they do
not rot between GPU sessions: each writes its JSON with a finalist table whose first
row is the shipped configuration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kernel_check import kernels_available

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.parametrize("script", ["tune_backward", "grid_backward", "confirm_backward"])
def test_backward_script_smoke(tmp_path, script):
    module = __import__(script)
    assert module.main(["--out", str(tmp_path), "--smoke"]) == 0
    (path,) = tmp_path.glob(f"{script}_cpu_*.json")
    result = json.loads(path.read_text())
    summary = result["summary"]
    assert summary and all(row["tflops_median"] > 0 for row in summary)
    if script != "confirm_backward":
        assert summary[0]["shipped"] and summary[0]["x_shipped_median"] == 1.0
    sys.modules.pop(script, None)
