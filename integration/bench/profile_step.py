"""Profile steady-state training steps of one configuration; write a compact JSON summary.

    python integration/bench/profile_step.py --out integration/results             # gem, one GPU
    python integration/bench/profile_step.py --out DIR --set train.impl=naive      # any overrides
    python integration/bench/profile_step.py --out DIR --trace                     # + Chrome trace
    python integration/bench/profile_step.py --out /tmp/p --smoke                  # CPU, tiny

After ``--warmup`` steps (compilation, allocator, caches) the next ``--steps`` steps run
exactly as :meth:`Trainer.fit` runs them (step n + 1 queued before step n's metrics are
read) under ``torch.profiler`` with CUDA's sync debug mode set to "warn". The summary:

- GPU time: the profiled window (first to last device activity), the busy time (union of
  kernel and copy intervals) and the idle fraction;
- device time by category (attention, GEMM, embedding, optimizer, elementwise,
  mxfp8_quantize, copies, NCCL, other; the rules are :data:`CATEGORIES`, regexes on kernel
  names) and the top kernels;
- host synchronisation: implicit syncs flagged by the sync debug mode (``.item()``, D2H
  copies to pageable memory, ...), and the CUDA runtime's blocking calls seen by the
  profiler (stream/device/event synchronize, blocking memcpy), each with where it came
  from (the enclosing ops; with ``--stacks`` the Python frames). The trainer waits on
  one event per step on purpose: step n's metrics, read while step n + 1 is queued;
- each profiled step's time, model TFLOP/s and MFU.

Device time counts kernels and copies only: the profiler's GPU-side copies of
``record_function`` ranges (user annotations such as ``Optimizer.step#AdamW.step``) span
other kernels and are left out (before 2026-12-02 they were counted, e.g. 81 ms of
"optimizer" time in ``profiles/profile_gem_all_before_2026-12-01.json``). The window
ends with one ``torch.cuda.synchronize()`` of this script (one ``cudaDeviceSynchronize``
that is not the trainer's).

Writes ``profile_<preset>_<tag>_<date>.json`` (and the trace with ``--trace``) into ``--out``.
Takes about a minute on one H200 for the gem preset (model build, warm-up, profiling).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from _common import (  # noqa: E402
    allocator_counters,
    counter_delta,
    jsonable,
    run_steps,
    single_rank_group,
)

RESULTS = _HERE.parent / "results"

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl"),
    # jagged_attn's Triton kernels, PyTorch's SDPA kernels (flash, memory-efficient, cuDNN)
    ("attention", r"_fwd_kernel|_bwd_delta_kernel|_bwd_dkdv_kernel|_bwd_dq_kernel|flash|fmha|"
     r"attention|attn|sdpa|_efficient_"),
    ("mxfp8_quantize", r"mx_quantize|quantize_2d"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|wgmma|cublas|sm90_|sm80_|scaled_mm|_mm_|matmul|"
     r"aten::mm|aten::addmm|aten::bmm|aten::baddbmm|splitk"),
    ("optimizer", r"adam|multi_tensor|foreach_|_foreach"),
    ("embedding", r"embedding|EmbeddingBag|index_select|indexSelect|indexing_backward|"
     r"partials_per_segment|partial_segment|grad_weight|sum_and_scatter|radix|sort"),
    ("copies", r"memcpy|memset|copy_|direct_copy|catarray|cat_|aten::copy|aten::to|"
     r"aten::_to_copy|aten::cat"),
    ("elementwise", r"elementwise|vectorized|reduce|norm|softmax|triton_|silu|gelu|where|"
     r"unrolled|aten::"),
)  # fmt: skip
"""(category, regex) in priority order; a kernel gets the first match, else "other"."""

_BLOCKING = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous variant (the async one is cudaMemcpyAsync)
)


def categorize(name: str) -> str:
    """The category of a kernel or op ``name`` (see :data:`CATEGORIES`)."""
    for category, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return category
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _site(e: Any, depth: int = 4) -> str:
    """Where a runtime call came from: its enclosing ops / Python frames, innermost first
    (frames inside torch's own modules skipped), joined by " < "."""
    names, p = [], e.cpu_parent
    while p is not None and len(names) < depth:
        name = p.name
        internal = "torch/" in name and ("profiler" in name or "autograd/" in name)
        if name and not name.startswith("ProfilerStep") and not internal:
            names.append(name[:120])
        p = p.cpu_parent
    return " < ".join(names) or "(no enclosing op: a direct runtime call)"


def _is_frame(name: str) -> bool:
    return "hyperrec/" in name and ".py(" in name


def _origins(events: list[Any]) -> dict[int, str]:
    """For each CPU event that launched kernels (a runtime call): the innermost ATen op
    and, with ``--stacks``, the innermost hyperrec frame whose time span contains it on
    the same thread ("op @ hyperrec/.../file.py(line): fn"; "?" where there is neither:
    e.g. an Inductor kernel launched from generated code outside any hyperrec frame).
    Found by containment, not the profiler's parent links, which on a GPU left the
    runtime calls of the compiled regions with no parent."""
    threads: dict[Any, list[Any]] = {}
    for e in events:
        name = e.name or ""
        if name.startswith("aten::") or _is_frame(name) or getattr(e, "kernels", None):
            threads.setdefault(getattr(e, "thread", 0), []).append(e)
    out: dict[int, str] = {}
    for evs in threads.values():
        # enclosing spans first: by start, then the longer one, launches last
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end,
                                bool(getattr(e, "kernels", None))))  # fmt: skip
        stack: list[Any] = []
        for e in evs:
            while stack and stack[-1].time_range.end <= e.time_range.start:
                stack.pop()
            if getattr(e, "kernels", None):
                op = next((x.name for x in reversed(stack) if x.name.startswith("aten::")), "")
                frame = next((x.name for x in reversed(stack) if _is_frame(x.name)), "")
                frame = frame[frame.rindex("hyperrec/") :][:120] if frame else ""
                out[id(e)] = f"{op or '?'} @ {frame}" if frame else (op or "?")
            if (e.name or "").startswith("aten::") or _is_frame(e.name or ""):
                stack.append(e)
    return out


def _by_origin(
    events: list[Any], categories: tuple[str, ...] | None, top: int = 30, by: str = "ms"
) -> list[dict[str, Any]]:
    """Device time and launches of the kernels in ``categories`` (None: all) per
    (category, launching op / model line), the ``top`` rows by ``by`` ("ms" or
    "launches"): which code the element-wise work and the copies come from, and which
    launches the most kernels (each kernel is attached to the runtime call that launched
    it; see :func:`_origins`)."""
    origins = _origins(events)
    acc: dict[tuple[str, str], list[float]] = {}
    for e in events:
        for k in getattr(e, "kernels", ()) or ():
            cat = categorize(k.name)
            if categories is None or cat in categories:
                slot = acc.setdefault((cat, origins.get(id(e), "?")), [0.0, 0])
                slot[0] += k.duration
                slot[1] += 1
    rank = 0 if by == "ms" else 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][rank])[:top]
    return [
        {"category": c, "origin": o, "ms": us / 1e3, "launches": int(n)} for (c, o), (us, n) in rows
    ]


def _summarize(prof: Any, cuda: bool) -> dict[str, Any]:
    from torch.autograd import DeviceType

    events = prof.events()
    device = []
    if cuda:
        # Kernels and copies; not the GPU-side spans of record_function annotations.
        device = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
    blocking: dict[str, int] = {name: 0 for name in _BLOCKING}
    sites: dict[str, dict[str, int]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in blocking:
            blocking[e.name] += 1
            where = sites.setdefault(e.name, {})
            site = _site(e)
            where[site] = where.get(site, 0) + 1
    out: dict[str, Any] = {"runtime_blocking_calls": blocking, "blocking_call_sites": sites}
    if device:
        intervals = [(e.time_range.start, e.time_range.end) for e in device]
        window = max(b for _, b in intervals) - min(a for a, _ in intervals)
        busy = _union_us(intervals)
        by_kernel: dict[str, float] = {}
        launches: dict[str, int] = {}
        for e in device:
            by_kernel[e.name] = by_kernel.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
            launches[e.name] = launches.get(e.name, 0) + 1
        out["gpu"] = {
            "window_ms": window / 1e3,
            "busy_ms": busy / 1e3,
            "busy_fraction": busy / window if window else None,
            "idle_fraction": 1.0 - busy / window if window else None,
            "kernel_launches": len(device),
        }
    else:
        # CPU run: the ops' own (self) CPU time stands in for kernel time.
        by_kernel, launches = {}, {}
        for avg in prof.key_averages():
            by_kernel[avg.key] = by_kernel.get(avg.key, 0.0) + avg.self_cpu_time_total
            launches[avg.key] = launches.get(avg.key, 0) + avg.count
        out["gpu"] = None
    total = sum(by_kernel.values()) or 1.0
    categories: dict[str, float] = {}
    for name, us in by_kernel.items():
        categories[categorize(name)] = categories.get(categorize(name), 0.0) + us
    out["time_by_category"] = {
        k: {"ms": v / 1e3, "fraction": v / total}
        for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
    }
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]
    out["top_kernels"] = [
        {
            "name": n[:160],
            "category": categorize(n),
            "ms": us / 1e3,
            "fraction": us / total,
            "launches": launches.get(n, 0),
        }
        for n, us in top
    ]
    out["time_basis"] = "device kernel time" if device else "CPU self time of ops"
    if device:
        cpu = [e for e in events if e.device_type == DeviceType.CPU]
        out["elementwise_and_copies_by_origin"] = _by_origin(cpu, ("elementwise", "copies"))
        # which code launches the most kernels (each launch costs host time and a gap)
        out["launches_by_origin"] = _by_origin(cpu, None, top=40, by="launches")
    return out


def _where(key: tuple[str, int, str]) -> str:
    file, line, func = key
    for marker in ("site-packages/", "/src/", "/bench/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}:{line}({func})"


def _host_profile(run: Any, steps: int, host_s: dict[str, float]) -> dict[str, Any]:
    """Host time of ``steps`` more steps, outside the torch profiler: how long enqueueing a
    step takes (``launch_step``; if it approaches the step time the GPU waits for the
    host) and cProfile's top functions by own and cumulative time (cProfile slows Python
    down, so its times are shares, not absolute costs)."""
    import cProfile
    import pstats

    host_s.update(launch=0.0, finish=0.0)
    plain: list[dict[str, float]] = []
    before = allocator_counters()
    t = time.perf_counter()
    run(steps, plain)
    wall = time.perf_counter() - t
    allocator = counter_delta(before, allocator_counters(), steps)
    # run_steps times steps - 1 reads (the last step's is not timed): none for one step
    launch = host_s["launch"] / steps
    finish = host_s["finish"] / (steps - 1) if steps > 1 else None
    prof = cProfile.Profile()
    prof.enable()
    run(steps, [])
    prof.disable()
    st = pstats.Stats(prof)
    entries = [(k, v) for k, v in st.stats.items()]  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in entries) or 1.0

    def top(index: int) -> list[dict[str, Any]]:
        rows = sorted(entries, key=lambda kv: -kv[1][index])[:40]
        return [{"where": _where(k), "calls": v[1], "own_s": v[2], "cum_s": v[3],
                 "own_share": v[2] / total} for k, v in rows]  # fmt: skip

    return {
        "steps": steps,
        "wall_s_per_step": wall / steps,
        "launch_step_s": launch,
        "finish_step_s": finish,
        "step_times_s": [m["step_time_s"] for m in plain],
        "allocator_per_step": allocator,
        "cprofile_top_own": top(2),
        "cprofile_top_cumulative": top(3),
    }


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Run the profile; returns the summary (also written into ``args.out``)."""
    import torch

    from hyperrec.integration import Trainer, get_preset, override
    from hyperrec.testing.bench import machine_info

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("profiling needs a CUDA GPU (use --smoke on a CPU)")
    name = args.preset or ("tiny" if args.smoke else "gem")
    overrides = [f"train.steps={args.warmup + args.steps * (3 if args.host else 1) + 1}", "train.eval_every=0",
                 "train.ckpt_every=0", "train.warmup_steps=1", *args.set]  # fmt: skip
    if args.smoke:
        overrides += ["train.data_workers=1"]
    preset = override(get_preset(name), overrides)
    device = "cuda" if cuda else "cpu"
    if not args.no_group:
        single_rank_group(device)
    t0 = time.perf_counter()
    trainer = Trainer(preset, out_dir=Path(args.out) / "profile-run", device=device, progress=False)
    build_s = time.perf_counter() - t0

    host_s = {"launch": 0.0, "finish": 0.0}

    def run(n: int, metrics: list[dict[str, float]]) -> None:
        done, launch, finish = run_steps(trainer, n)
        metrics.extend(done)
        host_s["launch"] += sum(launch)
        host_s["finish"] += sum(finish)

    warm: list[dict[str, float]] = []
    t1 = time.perf_counter()
    run(args.warmup, warm)
    warmup_s = time.perf_counter() - t1
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    profiled: list[dict[str, float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.profiler.profile(activities=activities, with_stack=args.stacks) as prof:
                run(args.steps, profiled)
                if cuda:
                    torch.cuda.synchronize()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    summary = _summarize(prof, cuda)
    summary["implicit_host_syncs"] = {"count": len(syncs), "messages": sorted(set(syncs))[:10]}
    summary["autoac"] = trainer.autoac_summary()
    if args.host:
        summary["host"] = _host_profile(run, args.steps, host_s)
    trainer.close()

    stamp = dt.date.today().isoformat()
    tag = args.tag or ("custom" if args.set else "default")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = None
    if args.trace:
        trace = out_dir / f"trace_{name}_{tag}_{stamp}.json"
        prof.export_chrome_trace(str(trace))
    doc = {
        "benchmark": "integration profile_step",
        "machine": machine_info(),
        "preset": name,
        "overrides": list(args.set),
        "config": preset.to_dict(),
        "warmup_steps": args.warmup,
        "profiled_steps": args.steps,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "steps": [
            {
                k: m[k]
                for k in (
                    "step",
                    "step_time_s",
                    "samples_per_s",
                    "step_tflop",
                    "tflops_per_gpu",
                    "mfu",
                )
            }
            for m in profiled
        ],  # fmt: skip
        **summary,
        "trace": trace.name if trace else None,
        "notes": "cudaEventSynchronize once per step is the trainer's lagged metrics readout "
        "(it waits for step n while step n + 1 is queued); one cudaDeviceSynchronize closes "
        "the profiled window (this script); any other blocking call or implicit sync is a "
        "stall of the steady-state step. FillFunctor<int> launches of 256 MB and "
        "cudaDeviceSynchronize calls come from triton.testing.do_bench (an autotuner "
        "benchmarking configs: it clears the L2 cache with a 256 MB int fill before every "
        "timed run and synchronises around them).",
    }
    path = out_dir / f"profile_{name}_{tag}_{stamp}.json"
    path.write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    _print(doc, path)
    return doc


def _print(doc: dict[str, Any], path: Path) -> None:
    gpu = doc.get("gpu")
    if gpu:
        print(f"GPU busy {gpu['busy_fraction']:.1%} of {gpu['window_ms']:.1f} ms "
              f"({gpu['kernel_launches']} kernels)")  # fmt: skip
    print(f"implicit host syncs: {doc['implicit_host_syncs']['count']}; "
          f"runtime blocking calls: {doc['runtime_blocking_calls']}")  # fmt: skip
    for name, where in doc["blocking_call_sites"].items():
        for site, n in sorted(where.items(), key=lambda kv: -kv[1])[:3]:
            print(f"  {n:4d} x {name} from {site}")
    host = doc.get("host")
    if host:
        fin = host["finish_step_s"]
        print(f"host: launch_step {host['launch_step_s'] * 1e3:.1f} ms/step, finish_step "
              f"{'n/a' if fin is None else f'{fin * 1e3:.1f}'} ms, wall {host['wall_s_per_step'] * 1e3:.1f} ms/step")  # fmt: skip
        if host.get("allocator_per_step"):
            print(
                "allocator per step: "
                + ", ".join(f"{k} {v:g}" for k, v in host["allocator_per_step"].items())
            )
        for r in host["cprofile_top_own"][:12]:
            print(
                f"  {r['own_share']:6.1%} own {r['cum_s']:8.3f} s cum {r['calls']:7d} x {r['where']}"
            )
    print(f"time by category ({doc['time_basis']}):")
    for k, v in doc["time_by_category"].items():
        print(f"  {k:<15} {v['ms']:10.2f} ms  {v['fraction']:6.1%}")
    if doc.get("elementwise_and_copies_by_origin"):
        print("element-wise and copy kernels by origin:")
        for r in doc["elementwise_and_copies_by_origin"][:12]:
            print(f"  {r['ms']:9.2f} ms {r['launches']:6d} x {r['category']:<11} {r['origin']}")
    for s in doc["steps"]:
        mfu = s["mfu"]
        print(f"  step {s['step']}: {s['step_time_s'] * 1e3:.1f} ms, "
              f"MFU {'n/a' if mfu is None or mfu != mfu else f'{mfu:.1%}'}")  # fmt: skip
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(RESULTS), help=f"result directory (default {RESULTS})")
    p.add_argument("--preset", help="default: gem (smoke: tiny)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling (default 4)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    p.add_argument("--tag", help="name part of the output file (default: default/custom)")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace")
    p.add_argument(
        "--host",
        action="store_true",
        help="also time the host: launch_step per step and cProfile's top functions",
    )
    p.add_argument(
        "--stacks",
        action="store_true",
        help="record Python stacks: blocking calls are attributed to Python frames "
        "(slows the host side of the profiled steps)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset")
    p.add_argument(
        "--no-group", action="store_true", help="no single-rank process group (no sharding wrapper)"
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
