"""One long sequence: the public call against dense SDPA and FlexAttention.

A batch of one sequence of ``--length`` tokens (default 16,384), H = 8, D = 128, bf16,
softmax, causal and not. Per instance (fresh q/k/v/dO each), in an order that rotates
with the instance: our public call (the package default, ``validate=False``), the same
call with dQ fused into the dK/dV kernel (``ours_fused``: ``DQ_KERNEL = "fused"``), PyTorch's
``scaled_dot_product_attention`` on the same tokens as a dense ``(1, H, L, D)`` batch (its
default backend choice), and compiled FlexAttention (no mask, or a causal block mask);
forward and forward + backward, ``bench_gluon.time_split`` (``device_ms``: the GPU alone).
Median and minimum over instances, and per-instance ratios.

    python bench/bench_long.py --out results/bench_long_h200_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_gluon as bg  # noqa: E402  (same directory)

H, D = 8, 128


def impls(length: int, causal: bool, device, flex_fn, flex_mask):
    """name -> (forward(q, k, v), layout) where layout 'jagged' is (L, H, D)."""
    import torch.nn.functional as F

    scale = 1.0 / math.sqrt(D)
    off = torch.tensor([0, length], device=device, dtype=torch.int64)
    kind = "softmax_causal" if causal else "softmax"

    def ours(q, k, v):
        return bg.public_call(kind, q, k, v, off, length)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def flex(q, k, v):
        return flex_fn(q, k, v, block_mask=flex_mask, scale=scale)

    # "ours_fused": the same call with dQ fused into the dK/dV kernel (the switch is set
    # around each timed call: the backward reads it when it runs)
    return {"ours": (ours, "jagged"), "ours_fused": (ours, "jagged"),
            "sdpa": (sdpa, "dense"), "flex": (flex, "dense")}  # fmt: skip


class _DqKernel:
    """``with _DqKernel(name):`` the Gluon backward's dQ switch for the ``ours*`` entries."""

    def __init__(self, name: str):
        self.value = "fused" if name.endswith("_fused") else None

    def __enter__(self):
        from hyperrec.jagged_attn._gluon import _bwd_launch

        self.saved = _bwd_launch.DQ_KERNEL
        if self.value is not None:
            _bwd_launch.DQ_KERNEL = self.value

    def __exit__(self, *exc):
        from hyperrec.jagged_attn._gluon import _bwd_launch

        _bwd_launch.DQ_KERNEL = self.saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--instances", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny, CPU (plumbing only)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    length = 64 if args.smoke else args.length
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex_fn = flex_attention if args.smoke else torch.compile(flex_attention, dynamic=False)
    rows = []
    for causal in (False, True):
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, length, length,
                                     device=device)  # fmt: skip
        fns = impls(length, causal, device, flex_fn, mask)
        flops = bg.useful_flops([length], H, D, causal)
        for inst in range(args.instances):
            q, k, v = bg.fresh(length, H, D, device, 900 + 17 * inst + int(causal))
            do = bg.fresh(length, H, D, device, 901 + 17 * inst + int(causal))[0]
            names = list(fns)
            names = names[inst % len(names) :] + names[: inst % len(names)]
            row = {"causal": causal, "instance": inst, "length": length, "order": names,
                   "timings": {}}  # fmt: skip
            for name in names:
                fn, layout = fns[name]
                if layout == "dense":
                    xs = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)]
                    g = do.transpose(0, 1).unsqueeze(0).contiguous()
                else:
                    xs, g = [q, k, v], do
                leaves = [x.detach().clone().requires_grad_() for x in xs]

                def fwd(fn=fn, leaves=leaves):
                    with torch.no_grad():
                        return fn(*leaves)

                def fwd_bwd(fn=fn, leaves=leaves, g=g, name=name):
                    with _DqKernel(name):
                        return torch.autograd.grad(fn(*leaves), leaves, g)

                for pass_, f, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, bg.FWD_BWD_FLOPS)):
                    try:
                        t = bg.time_split(f, device)
                        t["tflops_device"] = mult * flops / t["device_ms"] * 1e-9
                        row["timings"].setdefault(name, {})[pass_] = t
                    except Exception as e:  # record and go on
                        row["timings"].setdefault(name, {})[pass_] = bg._error(e)
            rows.append(row)
            line = " ".join(
                f"{n} {row['timings'][n][p].get('tflops_device', float('nan')):.0f}"
                for n in fns for p in ("fwd", "fwd_bwd")
            )  # fmt: skip
            print(f"causal={causal:d} inst {inst}: TFLOP/s (GPU) {line}", flush=True)
    summary = []
    for causal in (False, True):
        rs = [r for r in rows if r["causal"] == causal]
        s: dict = {"causal": causal}
        for p in ("fwd", "fwd_bwd"):
            for n in fns:
                vals = [r["timings"][n][p]["tflops_device"] for r in rs
                        if "tflops_device" in r["timings"][n][p]]  # fmt: skip
                if vals:
                    s[f"{n}/{p}/tflops_device"] = bg._stats(vals)
            pairs = [("ours", "sdpa"), ("ours", "flex")]
            pairs += [("ours_fused", peer) for peer in ("sdpa", "flex", "ours")]
            for me, peer in pairs:
                ratios = [r["timings"][peer][p]["device_ms"] / r["timings"][me][p]["device_ms"]
                          for r in rs if "device_ms" in r["timings"][peer][p]
                          and "device_ms" in r["timings"][me][p]]  # fmt: skip
                if ratios:
                    s[f"{me}_over_{peer}/{p}"] = bg._stats(ratios)
        summary.append(s)
        print(json.dumps(s))
    payload = {"machine": bg.machine(), "heads": H, "head_dim": D, "length": length,
               "instances": args.instances, "rows": rows, "summary": summary,
               "note": "ratio = peer device_ms / ours (above 1: we are faster)"}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
