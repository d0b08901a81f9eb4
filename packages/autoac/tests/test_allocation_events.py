"""The CPU allocation events behind compiled peaks (``_backward_mem``): a free inside the
window of a block allocated before it must not lower the step's peak.

The profiler reports such a free whenever the block was allocated under an earlier
memory-profiling window (an earlier measurement of the same search); when a reference
cycle keeps it alive, the garbage collector frees it at a moment that depends on what
ran before, and a counted free lowered the measured peak at random (the likely cause of
a partitioner-search test failing once in CI: one plan's peak three activations low).
"""

from __future__ import annotations

import gc

import pytest
import torch

from hyperrec.autoac._backward_mem import BackwardProbe, allocation_peak
from hyperrec.autoac._compiled_saves import sequence_now

pytestmark = pytest.mark.skipif(
    not torch.profiler.kineto_available(), reason="the CPU peaks need the profiler"
)

N = 1 << 16  # float32 elements: 256 KiB


class _Cycle:
    """An object in a reference cycle: freed only by the garbage collector."""

    def __init__(self, t: torch.Tensor) -> None:
        self.me, self.t = self, t


def _step():
    y = torch.ones(N)
    gc.collect()  # the collector runs here, inside the measured window
    z = torch.ones(N)
    return y.sum() + z.sum()


def _cycle_from_an_earlier_window(numel: int) -> None:
    allocation_peak(lambda: _Cycle(torch.ones(numel)))


@pytest.mark.parametrize("numel", [N // 4, N, 4 * N])
def test_a_free_of_an_earlier_windows_block_leaves_the_peak(numel):
    gc.collect()
    clean = allocation_peak(_step)
    assert clean[0] >= 2 * 4 * N and clean[1] == 0
    _cycle_from_an_earlier_window(numel)
    assert allocation_peak(_step) == clean


def test_frees_of_the_windows_own_blocks_still_count():
    kept = []

    def step():
        a = torch.ones(N)
        del a
        kept.append(torch.ones(N))

    peak, end = allocation_peak(step)
    assert 4 * N <= peak < 2 * 4 * N  # the first block is freed before the second exists
    assert end >= 4 * N  # the second block outlives the step


def test_backward_probe_ignores_an_earlier_windows_block():
    l1, l2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def collect(grad: torch.Tensor) -> None:
        gc.collect()  # inside the region's backward

    def measure() -> dict[str, int]:
        probe = BackwardProbe(torch.device("cpu"))
        for t in (x, *l1.parameters(), *l2.parameters()):
            t.grad = None  # every measurement allocates its gradients afresh

        def step():
            since = sequence_now()
            mid = l1(x)
            mid.register_hook(collect)
            out = l2(torch.tanh(mid))
            probe.watch("block", [out], since)
            out.square().sum().backward()

        return probe.run(step)

    gc.collect()
    clean = measure()
    assert clean.get("block", 0) > 0
    _cycle_from_an_earlier_window(4 * N)
    assert measure() == clean
