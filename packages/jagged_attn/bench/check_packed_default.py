"""Check the packed-rows default on a Hopper GPU: every call of the sweep must take the
packed forward, and its out/dq/dk/dv must be finite and within ``--max-ratio`` times the
error that the same computation in bf16 PyTorch makes, both measured against a float64
reference (the same convention as the kernel tests: an error ratio, not an absolute
tolerance).

    python bench/check_packed_default.py --out bench/results          # H200, ~40 s
    TRITON_INTERPRET=1 python bench/check_packed_default.py --smoke   # CPU, as sm90

Writes ``packed_default_check[_smoke].json``; exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hyperrec.jagged_attn import gdpa, jagged_attention
from hyperrec.jagged_attn._triton import _launch

HERE = Path(__file__).resolve().parent


def _count_packed_launches() -> list[bool]:
    """Wraps the packed forward so the sweep can see which calls took it."""
    taken: list[bool] = []
    real = _launch._forward_packed

    def spy(call, cfg, *rest):
        taken.append(bool(cfg.pack_rows))
        return real(call, cfg, *rest)

    _launch._forward_packed = spy
    return taken


def _call(q, k, v, off, max_len, causal, act, backend):
    if act == "softmax":
        return jagged_attention(q, k, v, off, max_len, causal=causal, backend=backend,
                                validate=backend == "triton")  # fmt: skip
    return gdpa(q, k, v, off, off, max_len, max_len, causal=causal, activation="silu",
                normalization="max_seqlen", backend=backend,
                validate=backend == "triton")  # fmt: skip


def check_case(lens, heads, dim, causal, act, seed, device, taken):
    g = torch.Generator(device=device).manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    total, max_len = int(off[-1]), max(lens)

    def rand():
        return torch.randn(total, heads, dim, device=device, generator=g, dtype=torch.bfloat16)

    qkv = [rand().requires_grad_() for _ in range(3)]
    do = rand()
    before = len(taken)
    out = _call(*qkv, off, max_len, causal, act, "triton")
    packed = len(taken) > before
    got = [out, *torch.autograd.grad(out, qkv, do)]
    q64 = [x.detach().double().requires_grad_() for x in qkv]
    ref_out = _call(*q64, off, max_len, causal, act, "torch")
    ref = [ref_out, *torch.autograd.grad(ref_out, q64, do.double())]
    q16 = [x.detach().clone().requires_grad_() for x in qkv]
    bf_out = _call(*q16, off, max_len, causal, act, "torch")
    bf = [bf_out, *torch.autograd.grad(bf_out, q16, do)]
    res = {}
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, ref, bf):
        ours = (a.double() - r).abs().max().item()
        base = (b.double() - r).abs().max().item()
        res[name] = {"err": ours, "bf16_torch_err": base, "ratio": ours / max(base, 1e-12),
                     "finite": bool(torch.isfinite(a).all())}  # fmt: skip
    return packed, res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="JSON directory")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter as sm90")
    parser.add_argument("--max-ratio", type=float, default=4.0)
    args = parser.parse_args()
    if args.smoke:
        device = "cpu"
        _launch._arch = lambda _device: "sm90"  # the interpreter stands in for Hopper
        caps, dims, n_seqs = (8,), (64,), (5, 7)
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
        device = "cuda"
        caps, dims, n_seqs = (8, 32, 64), (64, 128), (300, 1537)
    taken = _count_packed_launches()
    rows, start = [], time.perf_counter()
    for cap in caps:
        for dim in dims:
            for causal in (False, True):
                for act in ("softmax", "silu"):
                    for seed, n in enumerate(n_seqs):
                        g = torch.Generator().manual_seed(1000 * cap + 10 * dim + seed)
                        lens = torch.randint(0, cap + 1, (n,), generator=g).tolist()
                        lens[0] = cap  # the cap is reached, so it is the real max
                        packed, res = check_case(lens, 8, dim, causal, act, seed, device, taken)
                        worst = max(v["ratio"] for v in res.values())
                        ok = packed and worst < args.max_ratio and all(
                            v["finite"] for v in res.values())  # fmt: skip
                        rows.append({"cap": cap, "dim": dim, "causal": causal, "act": act,
                                     "seed": seed, "n_seq": n, "packed_taken": packed,
                                     "max_ratio": worst, "ok": ok, **res})  # fmt: skip
                        print(f"cap={cap} D={dim} causal={causal} {act} seed={seed} "
                              f"packed={packed} ratio={worst:.2f} {'OK' if ok else 'FAIL'}",
                              flush=True)  # fmt: skip
    fails = sum(not r["ok"] for r in rows)
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "max_ratio_allowed": args.max_ratio,
        "cases": len(rows),
        "fails": fails,
        "worst_ratio": max(r["max_ratio"] for r in rows),
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"packed_default_check{'_smoke' if args.smoke else ''}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"{fails} of {len(rows)} failed, worst ratio {summary['worst_ratio']:.2f}; wrote {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
