"""The pack-cost fit the planner prices packed saves with (``profiler._pack_costs``):
a stand-in packer with a known cost per call and per element, a slow first call per
size (Triton's compile), and a check that the fitted line reproduces it."""

from __future__ import annotations

import time

import pytest
import torch

from hyperrec.autoac import profiler


class _FakePacked:
    def __init__(self, n: int, clock: list[float]) -> None:
        self.n, self.clock, self.nbytes = n, clock, n

    def dequantize(self) -> torch.Tensor:
        self.clock[0] += 20e-6 + 2e-9 * self.n
        return torch.empty(self.n)


@pytest.fixture
def fake_packer(monkeypatch):
    clock = [0.0]
    seen: set[int] = set()

    def pack(x, fmt):
        n = x.numel()
        if n not in seen:  # the first call of a size compiles: must not be timed
            seen.add(n)
            clock[0] += 5.0
        clock[0] += 100e-6 + 1e-8 * n
        return _FakePacked(n, clock)

    monkeypatch.setattr(profiler, "pack_storage", pack)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


def test_fit_recovers_call_and_element_costs(fake_packer):
    c = profiler._pack_costs(("mxfp8",), torch.device("cpu"), torch.bfloat16)["mxfp8"]
    assert c["pack_call_s"] == pytest.approx(100e-6, rel=1e-6)
    assert c["pack_per_elem_s"] == pytest.approx(1e-8, rel=1e-6)
    assert c["unpack_call_s"] == pytest.approx(20e-6, rel=1e-6)
    assert c["unpack_per_elem_s"] == pytest.approx(2e-9, rel=1e-6)


def test_real_packer_on_cpu_costs_more_for_more_elements():
    c = profiler._pack_costs(("mxfp8",), torch.device("cpu"), torch.bfloat16)["mxfp8"]
    assert c["pack_per_elem_s"] > 0 and c["unpack_per_elem_s"] > 0
