"""Variants of the Gluon forwards' softmax code, timed against each other in one run on
one GPU.

* ``ptxas``: the wait for ``P V`` where ptxas puts it, the row max as one chain;
* ``fence``: ``GluonConfig(overlap_pv=True)`` / ``GluonFP8Config(overlap_pv=True)``: an
  instruction predicated on the softmax's row sum before that wait, which ptxas does not
  hoist the wait across (``bench/compile_gluon.py`` reports where it lands in the SASS);
* ``tree``: the row max through two rounds of register-local pairwise maxima
  (``_gluon._launch.ROW_MAX_TREE``): a chain of 8 dependent ``FMNMX`` instead of 32.

Kernels alone, bf16 inputs, H = 8, D = 128, 65,536 tokens per batch: the bf16 Gluon forward
(``jagged_attention_fwd_gluon``) on equal lengths 1,024 / 2,048 / 8,192, causal and not,
and HSTU (SiLU, causal, ``max_seqlen`` normalisation) on the GEM preset's power-law lengths
capped at 4,096; the Gluon FP8 forward (operands quantized beforehand) on 2,048 x 32,
8,192 x 8 and causal 4,096 x 16. Per case ``--instances`` fresh instances (new lengths,
offsets, tensors); per instance and variant the median of ``bench_gluon.time_ms``'s
CUDA-event timings (10 after 3 warm-ups; the committed runs took 20, recorded as ``reps``
in their files), the variants' order rotated between instances. Outputs are compared with
the first variant's (none changes the arithmetic: they must be bit-identical).

    python bench/probe_softmax.py --variants ptxas,tree --out bench/results/probe_softmax.json

``results/probe_overlap_pv_h100_2026-12-06.json`` came from this script's first revision
(``probe_overlap_pv.py``: the variants ``ptxas`` and ``fence`` only, as ``off`` / ``on``).
"""

# The closures below run within the loop iteration that defines them.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gluon import draw_lengths, offsets_of, time_ms, useful_flops
from probe_dynamic import GEM

from hyperrec.jagged_attn import FP8Config
from hyperrec.jagged_attn._gluon import _fp8_launch as g8
from hyperrec.jagged_attn._gluon import _launch as gluon_launch
from hyperrec.jagged_attn._gluon._launch import GluonConfig, _schedule, jagged_attention_fwd_gluon
from hyperrec.jagged_attn._triton._fp8_launch import quantize_qkv
from hyperrec.jagged_attn.fp8 import hadamard_scale

TOKENS, H, D = 65536, 8, 128
BF16_CASES = [
    *({"name": f"L{L}{'-causal' if c else ''}", "L": L, "causal": c, "act": "softmax"}
      for L in (1024, 2048, 8192) for c in (False, True)),
    {"name": "gem-hstu", "dist": GEM, "causal": True, "act": "silu"},
]  # fmt: skip
# name: (overlap_pv, ROW_MAX_TREE)
VARIANTS = {"ptxas": (False, False), "fence": (True, False), "tree": (False, True),
            "tree+fence": (True, True)}  # fmt: skip
FP8_CASES = [{"name": "fp8-L2048", "L": 2048, "causal": False},
             {"name": "fp8-L8192", "L": 8192, "causal": False},
             {"name": "fp8-L4096-causal", "L": 4096, "causal": True}]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_softmax.json")
    ap.add_argument(
        "--variants", default="ptxas,tree", help=f"comma-separated, of {list(VARIANTS)}"
    )
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}; choose from {list(VARIANTS)}")
    dev = torch.device("cuda")
    rows = []
    for case in BF16_CASES + FP8_CASES:
        if only and case["name"] not in only:
            continue
        fp8 = case["name"].startswith("fp8")
        for inst in range(args.instances):
            seed = 1000 * inst + 7
            if "dist" in case:
                lens = draw_lengths(case["dist"], TOKENS, seed)
            else:
                lens = [case["L"]] * (TOKENS // case["L"])
            off = offsets_of(lens, dev)
            g = torch.Generator(device=dev).manual_seed(seed)
            q, k, v = (torch.randn(TOKENS, H, D, generator=g, device=dev, dtype=torch.bfloat16)
                       for _ in range(3))  # fmt: skip
            max_len = max(lens)
            flops = useful_flops(lens, H, D, case["causal"])
            fns = {}
            if fp8:
                cfg8 = FP8Config()
                qkv = quantize_qkv(q, k, v, off, off, cfg8, v_mma_order=True)
                sched = _schedule(off, off, case["causal"], TOKENS, max_len)
                qk_scale = math.log2(math.e) / math.sqrt(D) / hadamard_scale(cfg8, D)
                out = torch.empty_like(q)
                lse = torch.empty(H, TOKENS, device=dev)
                for name in names:
                    ov, tree = VARIANTS[name]
                    gc = g8.GluonFP8Config(overlap_pv=ov)

                    def fn(gc=gc, tree=tree):
                        gluon_launch.ROW_MAX_TREE = tree
                        return g8.run(qkv, causal=case["causal"], qk_scale=qk_scale, coef=1.0,
                                      softmax=True, schedule=sched, out=out, lse=lse,
                                      config=gc)[0]  # fmt: skip

                    fns[name] = fn
            else:
                kw = dict(causal=case["causal"], activation=case["act"])
                if case["act"] == "silu":
                    kw["normalization"] = "max_seqlen"
                for name in names:
                    ov, tree = VARIANTS[name]
                    cfg = GluonConfig(overlap_pv=ov)

                    def fn(cfg=cfg, tree=tree):
                        gluon_launch.ROW_MAX_TREE = tree
                        return jagged_attention_fwd_gluon(q, k, v, off, max_len, config=cfg,
                                                          **kw)[0]  # fmt: skip

                    fns[name] = fn
            outs = {name: fn().clone() for name, fn in fns.items()}
            torch.cuda.synchronize()
            first = outs[names[0]].float()
            diff = max((o.float() - first).abs().max().item() for o in outs.values())
            k0 = inst % len(names)
            order = names[k0:] + names[:k0]
            ms = {name: time_ms(fns[name], dev) for name in order}
            row = dict(case=case["name"], inst=inst, max_abs_diff=diff, ms=ms,
                       tflops={n: flops / m * 1e-9 for n, m in ms.items()},
                       speedup={n: ms[names[0]] / m for n, m in ms.items()})  # fmt: skip
            rows.append(row)
            print(f"{case['name']:18s} inst {inst}: "
                  + "  ".join(f"{n} {row['tflops'][n]:6.1f}" for n in names)
                  + f" TFLOP/s; x{row['speedup'][names[-1]]:.3f}; diff {diff:.3g}",
                  flush=True)  # fmt: skip
    summary = {}
    for cname in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == cname]
        summary[cname] = dict(
            tflops_median={n: statistics.median(r["tflops"][n] for r in rs) for n in names},
            speedup_median={n: statistics.median(r["speedup"][n] for r in rs) for n in names},
            speedup_min={n: min(r["speedup"][n] for r in rs) for n in names},
            speedup_max={n: max(r["speedup"][n] for r in rs) for n in names},
            bit_identical=all(r["max_abs_diff"] == 0 for r in rs),
        )  # fmt: skip
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, instances=args.instances,
                   variants={n: dict(zip(("overlap_pv", "row_max_tree"), VARIANTS[n],
                                         strict=True)) for n in names},
                   rows=rows, summary=summary)  # fmt: skip
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
