"""How long packing a saved activation takes on this device, measured three ways, next
to the fit the profiler makes (``profiler._pack_costs``): each call between
synchronisations (the profiler before 0.1.7), calls back to back (0.1.7), and the
device's time alone (CUDA events, the host kept ahead by a sleep kernel).

    python bench/pack_timing.py --out bench/results      # one GPU, ~20 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hyperrec.autoac import profiler
from hyperrec.autoac.formats import pack_storage

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--formats", default="mxfp8,fp8_e4m3,mx4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    rows = []
    for fmt in args.formats.split(","):
        fit = profiler._pack_costs((fmt,), dev, torch.bfloat16)[fmt]
        for n in (1 << 20, 1 << 23, 1 << 25, 1 << 27):
            x = torch.randn(n, device=dev, dtype=torch.bfloat16)
            p = pack_storage(x, fmt)
            p.dequantize()
            sync()
            synced_p, synced_u = [], []
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                p = pack_storage(x, fmt)
                sync()
                t1 = time.perf_counter()
                p.dequantize()
                sync()
                synced_p.append(t1 - t0)
                synced_u.append(time.perf_counter() - t1)
            reps = 10
            b2b_p, b2b_u = profiler.time_pack_back_to_back(x, fmt, reps)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda._sleep(50_000_000)  # the host queues everything behind this
            ev[0].record()
            for _ in range(reps):
                p = pack_storage(x, fmt)
            ev[1].record()
            for _ in range(reps):
                p.dequantize()
            ev[2].record()
            sync()
            model_p = fit["pack_call_s"] + fit["pack_per_elem_s"] * n
            model_u = fit["unpack_call_s"] + fit["unpack_per_elem_s"] * n
            row = {
                "format": fmt,
                "numel": n,
                "synced_pack_us": statistics.median(synced_p) * 1e6,
                "synced_unpack_us": statistics.median(synced_u) * 1e6,
                "back_to_back_pack_us": b2b_p * 1e6,
                "back_to_back_unpack_us": b2b_u * 1e6,
                "device_pack_us": ev[0].elapsed_time(ev[1]) / reps * 1e3,
                "device_unpack_us": ev[1].elapsed_time(ev[2]) / reps * 1e3,
                "fit_pack_us": model_p * 1e6,
                "fit_unpack_us": model_u * 1e6,
            }
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"pack_timing_{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
