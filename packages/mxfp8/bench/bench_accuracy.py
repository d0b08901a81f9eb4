"""Numerics of MXLinear and a small training run (runs on the CPU; no GPU needed).

* MXLinear forward / dgrad / wgrad SQNR (dB) against an FP64 ``nn.Linear`` on Gaussian
  data, for several precision policies;
* the loss of a small MLP regression trained with MXFP8 vs the same model in BF16.

Usage: ``python bench_accuracy.py [--out PATH]``; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import torch
from torch import nn

from hyperrec.mxfp8 import MXMLP, MXLinear, PrecisionPolicy
from hyperrec.testing import snr_db, write_result

RESULTS = Path(__file__).resolve().parent / "results"

POLICIES = {
    "mxfp8 (bs32, e4m3, rceil)": PrecisionPolicy(),
    "mxfp8 floor scales": PrecisionPolicy(scale_mode="floor"),
    "bs128 (fast Hopper path)": PrecisionPolicy(block_size=128),
    "mxfp8 + RHT16": PrecisionPolicy(hadamard=16),
    "mxfp8 + RHT16 + SR": PrecisionPolicy(hadamard=16, stochastic_rounding=True),
    "mxfp8, e5m2 grads": PrecisionPolicy(grad_dtype=torch.float8_e5m2),
    "mxfp8, wgrad in the input precision (fp32 here)": PrecisionPolicy(wgrad_high_precision=True),
}


def linear_sqnr(policy: PrecisionPolicy, tokens=1024, k=1024, n=1024, outliers=False) -> dict:
    torch.manual_seed(0)
    lin = MXLinear(k, n, policy=policy)
    hp = nn.Linear(k, n, dtype=torch.float64)
    hp.load_state_dict({key: v.double() for key, v in lin.state_dict().items()})
    x = torch.randn(tokens, k)
    if outliers:  # a few outlier tokens: they set the scale of their wgrad blocks
        x[torch.randperm(tokens)[:16]] *= 100
    g = torch.randn(tokens, n)
    xa, xb = x.clone().requires_grad_(), x.double().clone().requires_grad_()
    y = lin(xa)
    y.backward(g)
    yb = hp(xb)
    yb.backward(g.double())
    return {
        "fwd": round(snr_db(y, yb), 2),
        "dgrad": round(snr_db(xa.grad, xb.grad), 2),
        "wgrad": round(snr_db(lin.weight.grad, hp.weight.grad), 2),
    }


def train(policy: PrecisionPolicy, steps=150, seed=0) -> list[float]:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128))
    model = nn.Sequential(
        MXMLP(128, 512, policy=policy), nn.LayerNorm(128), MXMLP(128, 512, policy=policy)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 128, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for name, pol in POLICIES.items():
        rows.append({"policy": name, **linear_sqnr(pol)})
        rows.append(
            {"policy": name + " (16 outlier tokens x100)", **linear_sqnr(pol, outliers=True)}
        )
    for r in rows:
        print(
            f"{r['policy']:<48} fwd {r['fwd']:6.2f}  dgrad {r['dgrad']:6.2f}  "
            f"wgrad {r['wgrad']:6.2f} dB"
        )
    runs = {
        "bf16": train(PrecisionPolicy(min_tokens=10**9)),
        "mxfp8": train(PrecisionPolicy()),
        "bs128 + RHT16 + SR": train(
            PrecisionPolicy(block_size=128, hadamard=16, stochastic_rounding=True)
        ),
    }
    base = runs["bf16"]
    training = {}
    for name, losses in runs.items():
        tail = losses[-20:]
        training[name] = {
            "first loss": round(losses[0], 5),
            "mean loss, last 20 steps": round(sum(tail) / 20, 6),
            "mean |loss - bf16| / bf16, last 20 steps": round(
                sum(abs(a - b) / b for a, b in zip(tail, base[-20:])) / 20, 4
            ),
            "every 10th loss": [round(v, 5) for v in losses[::10]],
        }
        print(name, training[name]["mean loss, last 20 steps"])
    out = args.out or RESULTS / f"cpu_accuracy_{dt.date.today().isoformat()}.json"
    payload = {
        "benchmark": "mxfp8 numerics (CPU reference backend)",
        "linear_sqnr_db_vs_fp64": {"tokens": 1024, "in": 1024, "out": 1024, "rows": rows},
        "training": {
            "steps": 150,
            "batch": 256,
            "model": "2 x MXMLP(128, 512) + LayerNorm",
            "runs": training,
        },
    }
    print("wrote", write_result(out, payload))


if __name__ == "__main__":
    main()
