"""autoac: batch-norm running statistics under full recomputation, against the same
model without checkpointing. On CUDA, cuDNN's batch norm writes the running statistics
without bumping their version counters (the CPU kernel too), so this is the path the
recomputation fix must cover. Three steps, the first two with both forwards before
either backward; momentum 0.1 and None (cumulative average). Exits non-zero on a
mismatch.

    python packages/autoac/bench/bn_stats_check.py --out DIR [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

import hyperrec.autoac as autoac


class Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.fc(x)))


class Tower(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def check(device: str, momentum: float | None) -> dict:
    torch.manual_seed(0)
    model = Tower().to(device)
    for b in model.layers:
        b.bn.momentum = momentum
    xs = [torch.randn(256, 64, device=device) for _ in range(3)]
    x0 = xs[0]
    prof = autoac.profile(
        model,
        lambda m: m(x0).square().mean(),
        config=autoac.ProfileConfig(steps=1, cost="flops"),
    )
    plain = Tower().to(device)
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        for b in m.layers:
            b.bn.reset_running_stats()
            b.bn.momentum = momentum
    plan = autoac.plan(prof, budget=autoac.plan(prof, budget=10**12).floor)  # full recompute
    handle = autoac.apply_plan(model, plan)
    try:
        for loss in [model(x).square().mean() for x in xs[:2]]:
            loss.backward()
        model(xs[2]).square().mean().backward()
    finally:
        handle.remove()
    for loss in [plain(x).square().mean() for x in xs[:2]]:
        loss.backward()
    plain(xs[2]).square().mean().backward()
    pairs = list(zip(model.layers, plain.layers))
    return {
        "modes": [r.mode for r in plan.regions],
        "max_abs_running_mean_diff": max(
            float((a.bn.running_mean - b.bn.running_mean).abs().max()) for a, b in pairs
        ),
        "max_abs_running_var_diff": max(
            float((a.bn.running_var - b.bn.running_var).abs().max()) for a, b in pairs
        ),
        "batches_tracked": [int(a.bn.num_batches_tracked) for a, _ in pairs],
        "max_abs_grad_diff": max(
            float((a.grad - b.grad).abs().max())
            for a, b in zip(model.parameters(), plain.parameters())
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    out = {str(m): check(args.device, m) for m in (0.1, None)}
    for k, v in out.items():
        print(f"momentum {k}: {v}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bn_check_{args.device}.json").write_text(json.dumps(out, indent=1))
    ok = all(
        v["max_abs_running_mean_diff"] == 0.0
        and v["max_abs_running_var_diff"] == 0.0
        and v["batches_tracked"] == [3, 3, 3]
        for v in out.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
