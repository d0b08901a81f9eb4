"""FP8 over bf16 forward as a function of how long each measurement keeps the GPU busy.

The same pair timed two ways gave two answers on 2026-12-04: the Gluon FP8 kernel alone
ran 1.21-1.23x the bf16 Gluon forward in ``probe_gluon_fp8.py`` (200 ms per
measurement, bf16 timed last) and 1.00-1.15x the public bf16 call in ``bench_fp8.py``
(25 ms, order alternating). The H200 holds its 700 W cap by lowering the SM clock under
sustained load, and the two kernels draw different power per FLOP, so the window decides
how much each is throttled. This script times, on fresh instances, the FP8 kernel alone
(operands quantized beforehand), the public FP8 call and the public bf16 call with
``triton.testing.do_bench`` windows of 25, 200 and 1,000 ms, alternating the order, and
samples the SM clock and power with ``nvidia-smi`` meanwhile; each row carries the mean
clock and power over its window.

    python bench/fp8_timing_window.py --out bench/results/fp8_timing_window.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton

from hyperrec.jagged_attn import FP8Config, jagged_attention
from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton import _fp8_launch
from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.spec import AttentionSpec

CASES = [(32, 2048, False), (8, 8192, False), (16, 4096, True)]
WINDOWS_MS = (25, 200, 1000)


def _clock_log(path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "20"],
        stdout=path.open("w"), stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _samples(path: Path) -> list[tuple[float, float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            rows.append((stamp, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return rows


def _impls(batch: int, length: int, causal: bool, inst: int, config: FP8Config):
    """The three timed calls on one fresh instance, and whether the Gluon FP8 forward runs."""
    g = torch.Generator(device="cuda").manual_seed(100 * inst + length)
    total = batch * length
    q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    off = torch.arange(0, total + 1, length, device="cuda")
    spec = AttentionSpec(scale=1 / math.sqrt(128), max_seqlen_q=length, max_seqlen_kv=length,
                         mask=MaskSpec(causal=causal))  # fmt: skip
    call = AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip
    gluon = _fp8_launch._use_gluon_fp8(call, config, None, spec.scale, True)
    qkv = _fp8_launch.quantize_qkv(q, k, v, off, off, config, v_mma_order=gluon)
    fns = {
        "fp8_kernel": lambda: _fp8_launch.attention_forward_fp8(call, config, qkv=qkv),
        "fp8": lambda: jagged_attention(q, k, v, off, length, causal=causal, precision="fp8"),
        "bf16": lambda: jagged_attention(q, k, v, off, length, causal=causal),
    }
    return fns, gluon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instances", type=int, default=2)
    args = parser.parse_args()
    log = Path(tempfile.mkstemp(suffix=".csv")[1])
    smi = _clock_log(log)
    rows = []
    config = FP8Config()
    try:
        for batch, length, causal in CASES:
            name = f"B{batch}-L{length}" + ("-causal" if causal else "")
            flops = 4 * batch * length * length * 8 * 128 * (0.5 if causal else 1.0)
            for inst in range(args.instances):
                fns, gluon = _impls(batch, length, causal, inst, config)
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                for w, window in enumerate(WINDOWS_MS):
                    order = list(fns.items())
                    for impl, fn in order if (inst + w) % 2 == 0 else order[::-1]:
                        t0 = time.time()
                        ms = triton.testing.do_bench(fn, warmup=min(window, 50), rep=window)
                        rows.append(dict(case=name, inst=inst, impl=impl, window_ms=window,
                                         ms=ms, tflops=flops / ms * 1e-9, t0=t0,
                                         t1=time.time(), gluon_fp8=gluon))  # fmt: skip
                del fns
                torch.cuda.empty_cache()
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
    samples = _samples(log)
    for r in rows:
        inside = [s for s in samples if r["t0"] <= s[0] <= r["t1"]]
        r["clock_mhz"] = sum(s[1] for s in inside) / len(inside) if inside else None
        r["power_w"] = sum(s[2] for s in inside) / len(inside) if inside else None
        r["clock_samples"] = len(inside)
    by: dict[tuple[str, int, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["case"], r["window_ms"], r["impl"]), []).append(r)
    summary = []
    for (case, window, impl), rs in sorted(by.items()):
        tf = sorted(r["tflops"] for r in rs)
        clocks = [r["clock_mhz"] for r in rs if r["clock_mhz"]]
        power = [r["power_w"] for r in rs if r["power_w"]]
        line = dict(case=case, window_ms=window, impl=impl, tflops_median=tf[len(tf) // 2],
                    tflops_min=tf[0], clock_mhz=sum(clocks) / len(clocks) if clocks else None,
                    power_w=sum(power) / len(power) if power else None)  # fmt: skip
        summary.append(line)
        print(f"{case:16s} {window:5d} ms {impl:11s} {line['tflops_median']:6.0f} TFLOP/s "
              f"clock {line['clock_mhz'] or 0:6.0f} MHz power {line['power_w'] or 0:5.0f} W")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                        torch=torch.__version__, triton=triton.__version__,
                                        date=time.strftime("%Y-%m-%d"), summary=summary,
                                        rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
