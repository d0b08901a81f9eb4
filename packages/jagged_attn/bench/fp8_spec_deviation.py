"""How far the FP8 kernel's outputs lie from their specification on this GPU.

Runs the cases of the GPU-marked tests of ``tests/test_fp8_attention.py`` (same inputs,
same configurations) and, instead of asserting, records per case what those tests bound:
the share of outputs beyond bf16 rounding of ``reference_fp8``'s output, the RMS and
largest deviations relative to the specification's own error against the exact float64
attention, the kernel's error against the exact attention over the specification's, and
the log-sum-exp deviation. The FP8 tensor cores' coarse accumulation is what separates
kernel and specification on a GPU (the tests' ``MMA_*`` bounds say how).

    python bench/fp8_spec_deviation.py --out bench/results     # one GPU, ~1.5 minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the figures are about the FP8 tensor cores)")
    import test_fp8_attention as t

    from hyperrec.testing import write_result

    rows: list[dict] = []
    current: dict = {}

    def spec_stats(out, spec_out, exact, name="out", fp8_mma=False):
        o, s, e = out.double().cpu(), spec_out.double().cpu(), exact.double().cpu()
        fin = torch.isfinite(s)
        o, s, e = o[fin], s[fin], e[fin]
        d, q = (o - s).abs(), (s - e).abs()
        q_rms = q.pow(2).mean().sqrt().item()
        rows.append(dict(
            current, outputs=int(s.numel()), fp8_mma=fp8_mma,
            nan_pattern_equal=bool(torch.equal(torch.isnan(out.cpu()), torch.isnan(spec_out.cpu()))),
            share_beyond_bf16_rounding=(d > 2.0**-7 * s.abs() + 1e-5).double().mean().item(),
            rms_deviation_over_fp8_error=d.pow(2).mean().sqrt().item() / q_rms,
            max_deviation_over_max_fp8_error=d.max().item() / q.max().item(),
            kernel_error_over_spec_error=(o - e).pow(2).mean().sqrt().item() / q_rms,
        ))  # fmt: skip
        print(rows[-1], flush=True)

    def lse_stats(lse, ref_lse, fp8_mma=False):
        fin = torch.isfinite(ref_lse)
        rel = (lse[fin] - ref_lse[fin]).abs() / (ref_lse[fin].abs() + 1)
        rows[-1]["lse_relative_max"] = rel.max().item() if rel.numel() else 0.0
        rows[-1]["lse_finite_pattern_equal"] = bool(torch.equal(fin, torch.isfinite(lse)))

    t.check_spec, t.check_lse = spec_stats, lse_stats
    t0 = time.perf_counter()
    for cfg in t.GPU_CONFIGS:
        for causal in (False, True):
            current = dict(test="test_gpu_softmax", config=cfg.encode(), causal=causal)
            t.test_gpu_softmax(cfg, causal)
    current = dict(test="test_gpu_head_dim_64_fp16", config="default")
    t.test_gpu_head_dim_64_fp16()
    for cfg in t.GPU_CONFIGS[::3]:
        current = dict(test="test_gpu_gdpa_and_masks", config=cfg.encode())
        t.test_gpu_gdpa_and_masks(cfg)
    bounds = dict(MMA_RMS=t.MMA_RMS, MMA_MAX=t.MMA_MAX, MMA_ERR=t.MMA_ERR, MMA_LSE=t.MMA_LSE)
    path = write_result(args.out / "fp8_spec_deviation.json", dict(
        benchmark="fp8_spec_deviation", test_bounds=bounds, seconds=time.perf_counter() - t0,
        cases=rows))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
