"""Where the FP8 attention paths spend their time on a GPU: per-kernel CUDA time and the
compiled backward kernels' registers, spills and shared memory.

Two parts, one JSON each (H = 8, D = 128, fixed-length batches, one fresh instance):

* ``profile``: per-kernel time (``torch.profiler``, mean of 5 calls after 3 warm-up
  calls) of the bf16 forward and fwd+bwd, the default FP8 forward and fwd+bwd (bf16
  backward that recomputes the softmax statistics), and fwd+bwd with the FP8 backward,
  at 32 x 2,048 and 8 x 8,192 tokens. -> ``fp8_kernel_profile_<tag>.json``
* ``configs``: the FP8 backward (``attention_backward_fp8``) at 32 x 2,048 tokens under
  tile configurations (dQ: block_m, warps, stages; dK/dV: block_n, warps, stages; the
  streamed tile is the 64-token quantization group), with the token-reducing products'
  operands from the rows or the transposed copies and the Hadamard un-rotation in or
  after the kernels; per-kernel time (mean of 3 calls) and every compiled kernel's
  ``n_regs``, ``n_spills``, shared bytes. -> ``fp8_bwd_probe_<tag>.json``
  ``--configs transposed`` is the first sweep (the 0.2.6 default, transposed operands),
  ``--configs rows`` the second (rows operands, rotation on/off).
* ``quant`` (only when asked): ``quantize_qkv`` and ``key_shift`` alone under several warp
  counts of the quantization launch. -> ``fp8_quant_probe_<tag>.json``

    python bench/fp8_bwd_probe.py --out bench/results --tag h200_2026-12-02  # CUDA only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: (dQ (block_m, warps, stages), dK/dV (block_n, warps, stages), transposed, rotate in kernel)
CONFIGS = {
    "transposed": [
        ((128, 8, 3), (64, 4, 2), True, True),
        ((128, 8, 3), (64, 4, 2), False, True),
        ((64, 4, 2), (64, 4, 3), True, True),
        ((128, 8, 2), (128, 8, 2), True, True),
        ((64, 4, 3), (64, 8, 2), True, True),
        ((128, 4, 2), (128, 4, 2), True, True),
        ((64, 8, 2), (64, 4, 1), True, True),
        ((64, 4, 2), (64, 4, 2), False, True),
    ],
    "rows": [
        ((128, 8, 3), (64, 4, 2), False, True),
        ((128, 8, 3), (64, 4, 2), False, False),
        ((64, 8, 2), (64, 8, 2), False, True),
        ((128, 8, 3), (128, 8, 2), False, False),
        ((64, 8, 2), (64, 8, 2), False, False),
    ],
}


def _kernel_ms(prof, calls: int, keep=None) -> dict[str, float]:
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and (keep is None or any(w in ev.key for w in keep)):
            out[ev.key[:90]] = round(t / calls / 1000, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _profile(fn, calls: int, warm: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return _kernel_ms(prof, calls)


def run_profile() -> dict:
    import bench_fp8 as bf

    from hyperrec.jagged_attn import FP8Config

    res = {}
    for name, batch, length in (("fixed-B32-L2048", 32, 2048), ("fixed-B8-L8192", 8, 8192)):
        case = bf.Case(name, "fixed", batch, length)
        _, offsets, q, k, v, do = bf.make_inputs(case, 0, "cuda")
        for label, prec in (("bf16", "bf16"), ("fp8", "fp8"),
                            ("fp8_bwd", FP8Config(backward="fp8"))):  # fmt: skip
            fwd, fwd_bwd = bf.impl_public(case, q, k, v, do, offsets, prec, "auto")
            for kind, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                if label == "fp8_bwd" and kind == "fwd":
                    continue  # the same forward as "fp8"
                try:
                    kernels = _profile(fn, 5, 3)
                    entry = dict(total_ms=round(sum(kernels.values()), 4), kernels=kernels)
                except Exception as e:  # record and go on: one bad path must not hide the rest
                    entry = dict(error=f"{type(e).__name__}: {e}"[:400])
                res[f"{name}/{label}/{kind}"] = entry
                print(name, label, kind, entry.get("total_ms", entry.get("error")), flush=True)
    return res


def run_configs(which: str, budget_s: float) -> dict:
    import bench_fp8 as bf

    from hyperrec.jagged_attn import FP8Config
    from hyperrec.jagged_attn._opschema import AttentionCall
    from hyperrec.jagged_attn._triton import _fp8_launch, _launch
    from hyperrec.jagged_attn._triton._configs import KernelConfig

    t0 = time.time()
    case = bf.Case("fixed-B32-L2048", "fixed", 32, 2048)
    _, offsets, q, k, v, do = bf.make_inputs(case, 0, "cuda")
    call = AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=bf._spec(case))  # fmt: skip
    config = FP8Config(backward="fp8")
    saved = _fp8_launch._pick, _fp8_launch.FP8_BWD_ROTATE_IN_KERNEL
    rows = []
    try:
        for dq_cfg, kv_cfg, trans, rot in CONFIGS[which]:
            entry = dict(dq=dq_cfg, dkdv=kv_cfg, transposed=trans, rotate_in_kernel=rot)
            if time.time() - t0 > budget_s:
                rows.append(dict(entry, skipped_for_time=True))
                continue

            def pick(kernel, _call, _config, dq_cfg=dq_cfg, kv_cfg=kv_cfg):
                if kernel == "dq":
                    return KernelConfig(block_m=dq_cfg[0], block_n=64, num_warps=dq_cfg[1],
                                        num_stages=dq_cfg[2])  # fmt: skip
                return KernelConfig(block_m=64, block_n=kv_cfg[0], num_warps=kv_cfg[1],
                                    num_stages=kv_cfg[2])  # fmt: skip

            _fp8_launch._pick = pick
            _fp8_launch.FP8_BWD_ROTATE_IN_KERNEL = rot
            try:
                entry["kernels_ms"] = _profile(
                    lambda trans=trans: _fp8_launch.attention_backward_fp8(
                        do, call, config, transposed_b=trans), 3, 1)  # fmt: skip
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(entry)
            print(entry, flush=True)
    finally:
        _fp8_launch._pick, _fp8_launch.FP8_BWD_ROTATE_IN_KERNEL = saved
    # the default path's backward kernels too (bf16, statistics-recomputing dQ)
    bf.impl_public(case, q, k, v, do, offsets, "fp8", "auto")[1]()
    torch.cuda.synchronize()
    compiled = []
    for key, ck in _launch._COMPILED.items():
        kws = dict(key[3]) if len(key) > 3 else {}
        compiled.append(dict(kernel=str(key[0]), config=str(key[2]),
                             hadamard=kws.get("HADAMARD"), transposed=kws.get("TRANS_B"),
                             n_regs=ck.n_regs, n_spills=ck.n_spills,
                             shared=ck.metadata.shared, warps=ck.metadata.num_warps))  # fmt: skip
    return dict(rows=rows, compiled=compiled)


def run_quant() -> dict:
    """``quantize_qkv`` (the default config) and ``key_shift`` at 32 x 2,048 and
    8 x 8,192 tokens under several warp counts of the quantization launch: CUDA-event
    time, median of 20 calls, on 3 fresh instances each."""
    import bench_fp8 as bf

    from hyperrec.jagged_attn import FP8Config
    from hyperrec.jagged_attn._triton import _fp8_launch

    def ms(fn, reps: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[reps // 2]

    config = FP8Config()
    rows = []
    saved = _fp8_launch.QUANT_NUM_WARPS
    try:
        for name, batch, length in (("fixed-B32-L2048", 32, 2048), ("fixed-B8-L8192", 8, 8192)):
            case = bf.Case(name, "fixed", batch, length)
            for seed in range(3):
                _, offsets, q, k, v, _ = bf.make_inputs(case, seed, "cuda")
                row = dict(case=name, seed=seed,
                           key_shift_ms=ms(partial(_fp8_launch.key_mean, k, offsets)))  # fmt: skip
                for warps in (None, 2, 4, 8, 16):
                    _fp8_launch.QUANT_NUM_WARPS = warps
                    row[f"quantize_ms_warps_{warps or 'default'}"] = ms(
                        partial(_fp8_launch.quantize_qkv, q, k, v, offsets, offsets, config)
                    )
                rows.append(row)
                print(row, flush=True)
    finally:
        _fp8_launch.QUANT_NUM_WARPS = saved
    return dict(rows=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", default="h200")
    p.add_argument("--part", choices=("profile", "configs", "quant", "both"), default="both")
    p.add_argument("--configs", choices=tuple(CONFIGS), default="rows")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="no new configuration after this many seconds")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_bwd_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.part in ("profile", "both"):
        doc = dict(meta, part="profile", results=run_profile())
        (args.out / f"fp8_kernel_profile_{args.tag}.json").write_text(json.dumps(doc, indent=1))
    if args.part in ("configs", "both"):
        doc = dict(meta, part="configs", configs=args.configs,
                   **run_configs(args.configs, args.budget_s))  # fmt: skip
        (args.out / f"fp8_bwd_probe_{args.tag}.json").write_text(json.dumps(doc, indent=1))
    if args.part == "quant":
        doc = dict(meta, part="quant", **run_quant())
        (args.out / f"fp8_quant_probe_{args.tag}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
