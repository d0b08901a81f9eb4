"""Adversarial checks of the benchmark result writer: what lands in a committed JSON file."""

import json
import math

import numpy as np
import torch

from hyperrec.testing import write_result


def _strict(text):
    """Parse as RFC 8259 JSON: ``NaN``/``Infinity`` tokens are refused."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_not_as_invalid_json(tmp_path):
    """``json.dumps`` writes ``NaN``/``Infinity`` by default, which no strict JSON reader
    accepts; the integration benchmarks' own writers record them as null."""
    out = write_result(
        tmp_path / "r.json",
        {"mfu": float("nan"), "rows": [{"t": float("inf")}, {"t": 1.5}], "pair": (2.0, -math.inf)},
    )
    data = _strict(out.read_text())
    assert data["mfu"] is None
    assert data["rows"] == [{"t": None}, {"t": 1.5}]
    assert data["pair"] == [2.0, None]


def test_numpy_and_tensor_scalars_are_numbers_not_strings(tmp_path):
    """``default=str`` turned a numpy or tensor scalar into a string ("0.5", "tensor(2.)"),
    so a statistic computed with numpy (a median, a count) came out as text."""
    payload = {
        "median_s": np.float32(0.5),
        "count": np.int64(3),
        "ok": np.bool_(True),
        "median_ms": np.median(np.array([1.0, 2.0, 4.0])),  # a numpy float64
        "percentiles": np.percentile(np.arange(5.0), [50, 100]),
        "tflop": torch.tensor(2.5),
        "bad": np.float32("nan"),
    }
    data = _strict(write_result(tmp_path / "r.json", payload).read_text())
    assert data["median_s"] == 0.5 and isinstance(data["median_s"], float)
    assert data["count"] == 3 and isinstance(data["count"], int)
    assert data["ok"] is True
    assert data["median_ms"] == 2.0
    assert data["percentiles"] == [2.0, 4.0]
    assert data["tflop"] == 2.5
    assert data["bad"] is None
    assert data["machine"]["torch"] == torch.__version__
