"""The caller writes a region's input in place after the region returned.

Without checkpointing this trains (the region's backward reads only what its ops saved,
here ``tanh``'s output), but a checkpoint keeps the input itself, and its recomputation
finds it at a later version: torch raises its version error. ``profile`` and ``apply``
raised it too (the profiler checkpoints every region); they now leave such a region
un-checkpointed, as they already did for a region that writes its own input.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from hyperrec import autoac


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x))


class _Net(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = self.layers[0](h)
        h.mul_(3.0)  # the caller writes layers.0's input after it returned
        y = self.layers[1](y + h)
        return self.layers[2](y).square().mean()


def _grads(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    m(x).backward()
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("at", ["floor", "no_ac"])
def test_a_region_whose_input_the_caller_writes_stays_unchecked(at):
    torch.manual_seed(int(torch.randint(0, 2**16, ())))
    ref = _Net()
    x = torch.randn(40, 24)
    expected = _grads(ref, x)

    prof = autoac.profile(copy.deepcopy(ref), lambda m: m(x))
    modes = {r.name: r.modes for r in prof.regions}
    assert modes["layers.0"] == ("none",)
    assert "sac" in modes["layers.1"] and "sac" in modes["layers.2"]
    p = autoac.plan(prof, budget=1e15)
    budget = p.floor if at == "floor" else p.no_ac_peak
    m = copy.deepcopy(ref)
    h = autoac.apply(m, budget=budget, step_fn=lambda m: m(x))
    try:
        got = {r.name: r.mode for r in h.plan.regions}
        assert got["layers.0"] == "none"
        if at == "floor":
            assert got["layers.1"] == got["layers.2"] == "sac"
        for a, b in zip(_grads(m, x), expected, strict=True):
            assert torch.equal(a, b)
    finally:
        h.remove()
