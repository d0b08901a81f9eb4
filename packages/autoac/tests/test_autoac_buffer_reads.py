"""A checkpointed region that reads a buffer and then updates it in its forward.

Spectral norm's power iteration (``torch.nn.utils.spectral_norm`` on a submodule of
the region) and running feature normalisation read a buffer, then update it in place.
The recomputation ran on the *updated* buffers, so it computed another weight / other
activations than the forward did: silently wrong gradients (relative error ~1e-2 on
spectral norm), although the buffers themselves ended the step right. The
recomputation must see the buffers as the forward found them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import spectral_norm

from hyperrec import autoac


class _SpectralBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = spectral_norm(nn.Linear(d, d))  # pre-forward hook inside the region
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc(x)))


class _RunningNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x - self.mean)  # reads the buffer (the subtraction saves nothing)
        with torch.no_grad():
            self.count += 1
            self.mean += (x.mean(0) - self.mean) / self.count
        return self.fc(h)


class _Net(nn.Module):
    def __init__(self, block: type[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("block", [_SpectralBlock, _RunningNorm])
def test_recomputation_reads_the_buffers_the_forward_read(block):
    torch.manual_seed(int(torch.randint(0, 2**16, ())))
    ref = _Net(block)
    x = torch.randn(32, 16) + 2.0

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    prof = autoac.profile(copy.deepcopy(ref), step, config=autoac.ProfileConfig(steps=1))
    p = autoac.plan(prof, budget=1e15)
    full = dataclasses.replace(
        p, regions=tuple(dataclasses.replace(r, mode="sac", saves={}) for r in p.regions)
    )
    m = copy.deepcopy(ref)
    h = autoac.apply_plan(m, full)
    try:
        for _ in range(2):
            ref.zero_grad(set_to_none=True)
            m.zero_grad(set_to_none=True)
            step(ref).backward()
            step(m).backward()
            for a, b in zip(ref.parameters(), m.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad), (a.grad - b.grad).abs().max()
            for (name, a), b in zip(ref.named_buffers(), m.buffers(), strict=True):
                assert torch.equal(a, b), name
    finally:
        h.remove()
