"""Cost of the input checks: ``validate=True`` (default), ``"full"`` and ``False``.

On CUDA the default checks the offsets' values on the device (no host sync), once per
offsets object; ``"full"`` reads them on the host (a sync per call). Each case times the
public forward in two regimes:

* ``same``: the same tensors call after call (a model's layers sharing one batch's
  offsets: the device checks ran at the first call and are cached);
* ``fresh``: new offsets objects every call (a new batch at every call: the device checks,
  and the kernels' tile schedules, run every time; the copy that makes the new object is
  in every mode's time);
* ``step12``: a model step: one new offsets object shared by 12 calls (12 attention layers
  of one batch; the checks and schedules run at the first, the others hit the caches),
  reported per call (the step's time / 12).

Each regime runs ``--rounds`` rounds (default 5) in which the three modes alternate in a
rotated order; the ratios are medians over rounds of the ratio within a round, so a drift
of the host's speed during the run does not enter them. Reports the median time per call (``triton.testing.do_bench``, ``ms``; the host's time
counts where it exceeds the GPU's), the GPU's time alone (``device_ms``: the host's issue
time hidden, see ``bench_attention.device_and_host``) and the host's time to issue a call
(``host_us``), and the ratios of the default and of ``"full"`` to ``validate=False``;
the target is the default within 5% of ``validate=False``.

    python bench/bench_validate.py --out bench/results        # ~1 minute on one H200
    python bench/bench_validate.py --out /tmp/x --quick       # 2 cases, ~30 s
    python bench/bench_validate.py --out /tmp/x --smoke       # CPU interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))

from bench_attention import device_and_host, lengths  # noqa: E402

# (name, kind, distribution, batch, max length, heads, head dim)
CASES = [
    ("softmax-u-B256-L1024-H8-D128", "softmax", "uniform", 256, 1024, 8, 128),
    ("softmax-u-B64-L512-H4-D128", "softmax", "uniform", 64, 512, 4, 128),
    ("softmax-p-B1024-L256-H4-D64", "softmax", "powerlaw", 1024, 256, 4, 64),
    ("softmax-u-B16-L128-H2-D64", "softmax", "uniform", 16, 128, 2, 64),
    ("hstu-targets-p-B256-L1024-H4-D128", "hstu", "powerlaw", 256, 1024, 4, 128),
]
QUICK = [CASES[1], CASES[4]]
SMOKE = [("softmax-smoke", "softmax", "uniform", 3, 20, 1, 16),
         ("hstu-smoke", "hstu", "uniform", 3, 20, 1, 16)]  # fmt: skip
MODES = (False, True, "full")


def _call(kind, q, k, v, off, max_len, targets, validate):
    from hyperrec.jagged_attn import gdpa, jagged_attention

    if kind == "softmax":
        return jagged_attention(q, k, v, off, max_len, validate=validate)
    return gdpa(q, k, v, off, off, max_len, max_len, causal=True, normalization="max_seqlen",
                num_targets=targets, validate=validate)  # fmt: skip


def _time_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=60, return_mode="median")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def case_inputs(case, device: str):
    """(kind, q, k, v, offsets, max_len, num_targets) of a case: seed-0 lengths and values."""
    name, kind, dist, batch, max_len, heads, dim = case
    lens = lengths(dist, batch, max_len, seed=0)
    off = torch.zeros(batch + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    off = off.to(device)
    t = int(lens.sum())
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, heads, dim, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    targets = lens.clamp(max=4).to(device) if kind == "hstu" else None
    return kind, q, k, v, off, max_len, targets


def run_case(case, device: str, reps: int, rounds: int) -> dict:
    name, kind, dist, batch, max_len, heads, dim = case
    kind, q, k, v, off, max_len, targets = case_inputs(case, device)
    t = int(q.shape[0])
    row: dict = dict(name=name, kind=kind, dist=dist, batch=batch, max_len=max_len,
                     heads=heads, head_dim=dim, tokens=t, ms={})  # fmt: skip
    for mode in MODES:
        _call(kind, q, k, v, off, max_len, targets, mode)  # compile, fill the caches
    row["device_ms"], row["host_us"], row["rounds"] = {}, {}, {}
    for regime, per_fn in (("same", 1), ("fresh", 1), ("step12", 12)):
        fns = {}
        for mode in MODES:
            if regime == "same":

                def fn(mode=mode):
                    return _call(kind, q, k, v, off, max_len, targets, mode)
            elif regime == "fresh":

                def fn(mode=mode):
                    return _call(kind, q, k, v, off.clone(), max_len, targets, mode)
            else:

                def fn(mode=mode):
                    step = off.clone()
                    return [_call(kind, q, k, v, step, max_len, targets, mode)
                            for _ in range(12)]  # fmt: skip

            fns[mode] = fn
        # The modes alternate within each round, in a rotated order: the host's speed
        # drifts by more than the check costs (up to 1.4x between runs of one machine),
        # so modes timed one after the other would compare drift, not checks.
        samples: dict[str, dict[str, list[float]]] = {
            what: {str(m): [] for m in MODES} for what in ("ms", "device_ms", "host_us")
        }
        for r in range(rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                fn = fns[mode]
                samples["ms"][str(mode)].append(_time_ms(fn, device, reps) / per_fn)
                dev = device_and_host(fn, device=device)
                samples["device_ms"][str(mode)].append(dev["device_ms"] / per_fn)
                samples["host_us"][str(mode)].append(dev["host_us"] / per_fn)
        for what in ("ms", "device_ms", "host_us"):
            suffix = "" if what == "ms" else f"_{what}"
            per_mode = samples[what]
            for mode in MODES:
                row[what][f"{regime}/{mode}"] = statistics.median(per_mode[str(mode)])
            row["rounds"][f"{regime}{suffix}"] = per_mode
            base = per_mode["False"]
            # median over rounds of the ratio within a round (same host speed)
            for label, mode in (("default", "True"), ("full", "full")):
                ratios = [a / b for a, b in zip(per_mode[mode], base)]
                row[f"{regime}_{label}_over_none{suffix}"] = statistics.median(ratios)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="JSON directory")
    parser.add_argument("--quick", action="store_true", help="two cases")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    parser.add_argument("--case", action="append", default=[], metavar="NAME",
                        help="only the cases of these names (repeatable)")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds per regime; the modes alternate within each (CUDA)",
    )
    args = parser.parse_args()
    from hyperrec.testing import write_result

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, cases, reps, rounds = "cpu", SMOKE, 3, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_validate.py needs a CUDA GPU (or --smoke)")
        device, cases, reps, rounds = "cuda", QUICK if args.quick else CASES, 0, args.rounds
    if args.case:
        unknown = sorted(set(args.case) - {c[0] for c in CASES + SMOKE})
        if unknown:
            parser.error(f"--case: unknown case(s) {unknown}")
        cases = [c for c in CASES + SMOKE if c[0] in args.case]
    rows = []
    t0 = time.perf_counter()
    for case in cases:
        rows.append(run_case(case, device, reps, rounds))
        r = rows[-1]
        print(f"{r['name']:36s} default/none: same {r['same_default_over_none']:.3f} "
              f"fresh {r['fresh_default_over_none']:.3f} step12 "
              f"{r['step12_default_over_none']:.3f} (device {r['same_default_over_none_device_ms']:.3f}"
              f"/{r['fresh_default_over_none_device_ms']:.3f}"
              f"/{r['step12_default_over_none_device_ms']:.3f}) | full/none fresh "
              f"{r['fresh_full_over_none']:.3f} | none {r['ms']['same/False']:.3f} ms, host "
              f"{r['host_us']['same/False']:.0f} us/call", flush=True)  # fmt: skip
    worst = max(max(r["same_default_over_none"], r["fresh_default_over_none"],
                    r["step12_default_over_none"]) for r in rows)  # fmt: skip
    suffix = "smoke" if args.smoke else ("quick" if args.quick else "full")  # the GPU: in "machine"
    if args.case:
        suffix = "cases"
    from hyperrec.jagged_attn._triton._direct import direct_requested

    direct = direct_requested()
    if not direct and not args.smoke:
        suffix += "_no_direct_launch"
    path = write_result(args.out / f"validate_{suffix}.json", {
        "benchmark": "jagged_attn input checks: validate=True (default) / 'full' / False, "
                     "public forward, bf16, median ms per call",
        "device": device,
        "target": "default within 5% of validate=False (ratio <= 1.05)",
        "direct_launch": direct,
        "fused_schedule_check": True,
        "worst_default_over_none": worst,
        "seconds": time.perf_counter() - t0,
        "cases": rows,
    })  # fmt: skip
    print(f"worst default/none ratio {worst:.3f} (target <= 1.05); wrote {path}")


if __name__ == "__main__":
    main()
