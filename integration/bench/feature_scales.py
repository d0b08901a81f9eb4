"""Scale of each part of the model over the first training steps.

Trains a preset for ``--steps`` steps and records, every ``--every`` steps, the standard
deviation and mean absolute value of the outputs of the token norm, three tower layers,
the tower's final norm, the dense projection, the candidate attention, the PMA pooling,
the cross network, the MLP and the CTR head (whose standard deviation over the batch is
the spread of the logits: near zero means every candidate gets the same score), with
the step's loss and gradient norm.

This is how the 1,024-wide gem's failure to learn was found (integration README, "Why
the full-width gem did not learn"): its PMA output grew to 13-34x the scale of the
other feature groups within 25 steps and, under one LayerNorm over the concatenated
features, squashed the candidate's own features; the logit spread fell to 0.0004.

Usage::

    python integration/bench/feature_scales.py --preset gem --steps 41 --every 5 \
        --set model.dim=1024 --set model.heads=8 ... --out scales.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from hyperrec.integration.config import PRESETS, override
from hyperrec.integration.trainer import Trainer

#: Modules whose outputs are recorded (names on ``GEMModel``; missing ones are skipped).
MODULES = (
    "token_norm",
    "seq_norm",
    "dense_proj",
    "cross_attention",
    "pma",
    "interaction",
    "mlp",
    "ctr_head",
)


def _hook(stats: dict[str, list[float]], on: list[bool], name: str) -> Any:
    def record(mod: torch.nn.Module, args: Any, out: Any) -> None:
        o = out[0] if isinstance(out, tuple) else out
        # only on recorded steps: ``.item()`` waits for the device
        if on[0] and torch.is_tensor(o) and o.numel() > 1:
            o = o.detach().float()
            stats[name] = [o.std().item(), o.abs().mean().item()]

    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the trainer's run directory (default: beside --out)")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.every < 1:
        p.error("--every must be >= 1")
    sets = [*args.overrides, f"train.steps={args.steps}", "train.eval_every=0",
            "train.ckpt_every=0"]  # fmt: skip
    preset = override(PRESETS[args.preset](), sets)
    run_dir = args.run_dir or args.out.with_suffix(".run")
    trainer = Trainer(preset, out_dir=run_dir, device=args.device, progress=False)
    stats: dict[str, list[float]] = {}
    on = [False]
    model = trainer.model
    for name in MODULES:
        mod = getattr(model, name, None)
        if isinstance(mod, torch.nn.Module):
            mod.register_forward_hook(_hook(stats, on, name))
    n = len(model.seq_layers)
    for i in sorted({0, n // 2, n - 1}):
        model.seq_layers[i].register_forward_hook(_hook(stats, on, f"seq_layers.{i}"))
    rows = []
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            on[0] = step % args.every == 0 or step == args.steps - 1
            m = trainer.train_step()
            if on[0]:
                row = {"step": step, "wall_s": round(time.perf_counter() - t0, 1),
                       "loss": m.get("loss"), "grad_norm": m.get("grad_norm"),
                       "std_and_mean_abs": {k: list(v) for k, v in stats.items()}}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        trainer.close()
    out = {"preset": args.preset, "overrides": sets, "device": args.device,
           "torch": torch.__version__, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
