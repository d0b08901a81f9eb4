"""``bench/diagnose_check.py`` runs end to end on a tiny case (interpreter), so it does
not rot between GPU sessions: every variant and the per-stage timers are written, and
the patches it applies are undone."""

from __future__ import annotations

import gc
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


def test_diagnose_check_smoke_writes_every_variant_and_undoes_its_patches(tmp_path):
    from hyperrec.jagged_attn import _validate, interface
    from hyperrec.jagged_attn._triton import _launch, _tiles

    before = (interface.value_check_mode, interface._dispatch, _tiles.launch,
              _tiles._assert_options, _launch.forward_schedule,
              _validate._already_checked)  # fmt: skip
    module = __import__("diagnose_check")
    try:
        assert module.main(["--out", str(tmp_path), "--smoke"]) == 0
    finally:
        sys.modules.pop("diagnose_check", None)
    after = (interface.value_check_mode, interface._dispatch, _tiles.launch,
             _tiles._assert_options, _launch.forward_schedule,
             _validate._already_checked)  # fmt: skip
    assert all(a is b for a, b in zip(before, after)) and gc.isenabled()
    result = json.loads((tmp_path / "diagnose_check_smoke.json").read_text())
    (row,) = result["cases"].values()
    variants = row["variants"]
    assert set(variants) == {"none", "default", "flag_assert", "nodebug", "none_debug",
                             "nocache", "none_nogc", "default_nogc"}  # fmt: skip
    assert variants["none"]["over_none_us"] == 0.0
    assert all(len(v["rounds_us"]) == 2 and v["median_us"] > 0 for v in variants.values())
    assert variants["none"]["device_over_none_us"] == 0.0
    assert all(v["device_us"] > 0 and v["issue_us"] > 0 for v in variants.values())
    stages = row["stages"]
    # both modes pass through the public dispatch once per call; only the default checks
    assert stages["interface._dispatch (calls)"]["none"] == 1.0
    assert stages["interface._dispatch (calls)"]["default"] == 1.0
    assert stages["interface.run_value_checks"]["default"] > 0


def test_diagnose_check_rejects_zero_rounds(tmp_path):
    module = __import__("diagnose_check")
    try:
        with pytest.raises(SystemExit):
            module.main(["--out", str(tmp_path), "--smoke", "--rounds", "0"])
    finally:
        sys.modules.pop("diagnose_check", None)
