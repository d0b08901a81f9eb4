"""How much the sequence tower and its attention precision move the model's output.

A held-out AUC bound for a precision of the sequence tower's attention is only
informative if the tower matters to the predictions. For a preset's model at
initialisation (eval mode, one batch of training requests, seeds given), this records
the relative change of the CTR and CVR outputs when:

* the attention runs in another precision (``--precisions``; same weights), and
* every sequence layer is skipped (its output replaced by its input): the tower's whole
  contribution through those layers.

    python integration/bench/tower_influence.py --preset small --out DIR

Writes ``tower_influence_<preset>_<device>.json`` into ``--out``. On a CPU the FP8
paths run jagged_attn's pure-PyTorch emulation of the same quantization.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData
from hyperrec.integration.config import get_preset


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def measure(
    preset: str, precisions: list[str], seeds: list[int], requests: int, device: str
) -> list[dict]:
    p = get_preset(preset)
    batch = SyntheticRecsysData(p.data).batch(TRAIN, np.arange(requests)).to(torch.device(device))
    rows = []
    for seed in seeds:
        torch.manual_seed(seed)
        ref = GEMModel(p.model, p.data).to(device).eval()
        with torch.no_grad():
            ctr, cvr = ref(batch)
            # each sequence layer returns its input: the tower's layers contribute nothing
            hooks = [
                blk.register_forward_hook(
                    lambda m, i, o: (i[0], *o[1:]) if isinstance(o, tuple) else i[0]
                )
                for blk in ref.seq_layers
            ]
            try:
                ctr0, cvr0 = ref(batch)
            finally:
                for h in hooks:
                    h.remove()
            row = {"seed": seed, "ctr_std": float(ctr.float().std()),
                   "skip_seq_layers": {"ctr": _rel(ctr0, ctr), "cvr": _rel(cvr0, cvr)}}  # fmt: skip
            for prec in precisions:
                low = GEMModel(p.model, p.data, attention_precision=prec).to(device).eval()
                low.load_state_dict(ref.state_dict())
                c, v = low(batch)
                row[prec] = {"ctr": _rel(c, ctr), "cvr": _rel(v, cvr)}
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--precisions", nargs="+", default=["fp8"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    rows = measure(args.preset, args.precisions, args.seeds, args.requests, args.device)
    from hyperrec.testing.bench import write_result

    args.out.mkdir(parents=True, exist_ok=True)
    path = write_result(
        args.out / f"tower_influence_{args.preset}_{args.device}.json",
        {"benchmark": "relative change of the CTR/CVR outputs at initialisation (eval mode)",
         "preset": args.preset, "requests": args.requests, "rows": rows},
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
