"""A small CPU training run: the MXFP8 MLP's loss tracks the BF16 one."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hyperrec.mxfp8 import MXMLP, PrecisionPolicy

STEPS = 60
#: The stated tolerance: over the last 10 steps, the mean |loss_mx - loss_bf16| is below
#: 2% of the initial loss (BF16 itself drops the loss by ~90% here), and the final MXFP8
#: loss is within 25% of the final BF16 loss.
TOL_OF_INITIAL = 0.02
FINAL_RATIO = 1.25


@functools.cache
def _bf16_losses() -> tuple[float, ...]:
    return tuple(_train(PrecisionPolicy(min_tokens=10**9)))  # every layer runs plain BF16


def _train(policy: PrecisionPolicy, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    model = nn.Sequential(
        MXMLP(64, 256, activation="gelu_tanh", policy=policy),
        nn.LayerNorm(64),
        MXMLP(64, 256, activation="relu", policy=policy),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 64, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        out = model(x.bfloat16()).float()  # activations in BF16, FP32 master weights
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        PrecisionPolicy(),
        PrecisionPolicy(block_size=128, hadamard=16, stochastic_rounding=True),
    ],
    ids=["mxfp8", "bs128+rht+sr"],
)
def test_mxfp8_loss_tracks_bf16(policy):
    bf16 = _bf16_losses()
    mx = _train(policy)
    assert bf16[-1] < 0.3 * bf16[0] and mx[-1] < 0.3 * mx[0], "both must learn"
    gap = sum(abs(a - b) for a, b in zip(mx[-10:], bf16[-10:])) / 10
    assert gap < TOL_OF_INITIAL * bf16[0], f"mean gap {gap:.3g} vs initial {bf16[0]:.3g}"
    assert mx[-1] < FINAL_RATIO * bf16[-1], (mx[-1], bf16[-1])
