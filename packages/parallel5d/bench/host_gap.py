"""Where the full model's host time goes that its small host copy does not spend.

``validate_cost.py`` predicts a host-bound step from the issue time of a copy of the model
with the same layers, tensors and collectives but small dims (``host_copy``). On 64 fake
ranks the GEM tower's own host time stays 11-14% above its copy's; this script looks for
the difference. For the model and its copy (same process, same mesh, steps interleaved
as ``validate_cost.py --interleave`` takes them), it records:

* per step: host time (until ``train_step`` returns) and step time (until the device is
  done), medians and all values;
* one profiled step per model (CPU activity only, so the profiler adds no device work):
  self CPU time per event name, grouped into the CUDA runtime calls (``cudaLaunchKernel``,
  ``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ``cudaMalloc``, ...) and the rest; the
  events whose time grows most from the copy to the model are what the copy misses;
* synchronising calls per step (``torch.cuda.set_sync_debug_mode("warn")``, counted per
  warning site): a host sync inside the step waits for the device's queue, which a copy
  with little device work never does;
* the queued device time at each sync is not measured directly: if the model's extra
  host time sits in synchronising calls, ``step = sum over sync-separated segments of
  max(host, device)`` is the model to build, not ``max(host, device)`` over the step.

    python packages/parallel5d/bench/host_gap.py --fake-world-size 64 --out DIR
    python packages/parallel5d/bench/host_gap.py --smoke --out DIR   # CPU, tiny, code path

Writes ``host_gap_<mode>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


_spec = importlib.util.spec_from_file_location("p5d_validate_cost", HERE / "validate_cost.py")
validate = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(validate)  # type: ignore[union-attr]
bench = validate.bench  # validate_cost's own copy of bench_fsdp: one load, not two


def profiled_step(cfg, model, opt, device, rank, seed) -> tuple[dict, dict]:
    """Self CPU microseconds per event name over one step (CPU activity only), and
    :func:`runtime_parents` of the same step."""
    from torch.profiler import ProfilerActivity, profile

    batch = bench.make_batch(cfg, device, seed, rank)
    bench.sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench.train_step(model, opt, batch)
    bench.sync(device)
    out: dict[str, dict] = {}
    for e in prof.key_averages():
        out[e.key] = {"self_us": float(e.self_cpu_time_total), "count": int(e.count)}
    return out, runtime_parents(prof.events())


def runtime_parents(events) -> dict:
    """Per CUDA runtime call name, the op that issued it: the two nearest enclosing
    events (``parent < grandparent``), with call count and self CPU microseconds.
    Calls issued below the dispatcher (inside an op's kernel, a hook, a collective)
    show here under the op or Python span that encloses them."""
    table: dict[str, dict[str, dict]] = {}
    for e in events:
        if not e.name.startswith("cuda"):
            continue
        chain, p = [], e.cpu_parent
        while p is not None and len(chain) < 2:
            chain.append(p.name)
            p = p.cpu_parent
        key = " < ".join(chain) or "(top level)"
        row = table.setdefault(e.name, {}).setdefault(key, {"count": 0, "self_us": 0.0})
        row["count"] += 1
        row["self_us"] += float(e.self_cpu_time_total)
    return {name: dict(sorted(rows.items(), key=lambda kv: -kv[1]["self_us"])[:12])
            for name, rows in table.items()}  # fmt: skip


def sync_sites(cfg, model, opt, device, rank, seed) -> dict:
    """Synchronising calls in one step, counted per warning text (the call site)."""
    if device.type != "cuda":
        return {}
    batch = bench.make_batch(cfg, device, seed, rank)
    bench.sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            bench.train_step(model, opt, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    bench.sync(device)
    sites = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:160]}" for w in caught)
    return dict(sites.most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="gem", choices=sorted(bench.PRESETS))
    ap.add_argument("--fake-world-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims: checks the code path")
    args = ap.parse_args()
    if args.fake_world_size < 1:
        ap.error("--fake-world-size must be >= 1")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    os.environ.update(RANK="0", WORLD_SIZE=str(args.fake_world_size), LOCAL_RANK="0")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    mesh = init_device_mesh(device.type, (args.fake_world_size,))
    presets = bench.TINY if args.smoke else bench.PRESETS
    cfg = dict(presets[args.model], checkpoint=not args.no_checkpoint)
    small = validate.host_copy(cfg)
    if args.smoke:  # tiny already: shrink further so the copy differs from the model
        small = dict(cfg, **{k: max(1, v // 2) for k, v in cfg.items()
                             if k in ("dim", "batch") and isinstance(v, int)})  # fmt: skip
    run_args = SimpleNamespace(warmup=3, steps=args.steps, profile=None, gc_freeze=False)
    t0 = time.perf_counter()
    timed = bench.run_interleaved([cfg, small], "hyperrec", "flat", True, mesh, device, run_args)
    # profile and sync census on fresh instances (run_interleaved frees its models)
    per: dict[str, dict] = {}
    for label, c, t in (("model", cfg, timed[0]), ("copy", small, timed[1])):
        model = bench.build(c, device)
        bench.shard(model, "hyperrec", mesh, True)
        opt = bench.make_optimizer(model, "hyperrec", "flat")
        for s in range(3):
            bench.train_step(model, opt, bench.make_batch(c, device, s, 0))
        bench.sync(device)
        profile, parents = profiled_step(c, model, opt, device, 0, 10_000)
        per[label] = {
            "cfg": {k: v for k, v in c.items() if isinstance(v, (int, float, str, bool))},
            "host_ms": t["host_s"] * 1e3,
            "step_ms": t["step_s"] * 1e3,
            "host_ms_all": [x * 1e3 for x in t["host_s_all"]],
            "step_ms_all": [x * 1e3 for x in t["step_s_all"]],
            "profile": profile,
            "runtime_parents": parents,
            "sync_sites": sync_sites(c, model, opt, device, 0, 10_001),
        }
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    m, c = per["model"]["profile"], per["copy"]["profile"]
    grown = []
    for name in set(m) | set(c):
        a = m.get(name, {"self_us": 0.0, "count": 0})
        b = c.get(name, {"self_us": 0.0, "count": 0})
        grown.append({"event": name, "model_us": a["self_us"], "copy_us": b["self_us"],
                      "delta_us": a["self_us"] - b["self_us"], "model_count": a["count"],
                      "copy_count": b["count"]})  # fmt: skip
    grown.sort(key=lambda r: -r["delta_us"])
    total = {k: sum(v["self_us"] for v in per[k]["profile"].values()) for k in per}
    runtime = {k: sum(v["self_us"] for n, v in per[k]["profile"].items() if n.startswith("cuda"))
               for k in per}  # fmt: skip
    doc = {
        "benchmark": "host time of the model against its host copy",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fake_world_size": args.fake_world_size,
        "model_kind": args.model,
        "seconds": time.perf_counter() - t0,
        "host_gap_ms": per["model"]["host_ms"] - per["copy"]["host_ms"],
        "profiled_self_us_total": total,
        "profiled_cuda_runtime_us": runtime,
        "largest_growth": grown[:25],
        "model": per["model"],
        "copy": per["copy"],
    }
    for k in ("model", "copy"):  # the full per-event tables are long: keep the top 60
        top = sorted(per[k]["profile"].items(), key=lambda kv: -kv[1]["self_us"])[:60]
        doc[k]["profile"] = dict(top)
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if args.smoke else f"fake{args.fake_world_size}"
    path = args.out / f"host_gap_{args.model}_{mode}.json"
    from hyperrec.testing import write_result

    write_result(path, doc)
    print(f"host: model {per['model']['host_ms']:.1f} ms, copy {per['copy']['host_ms']:.1f} ms "
          f"(gap {doc['host_gap_ms']:+.1f}); profiled self CPU {total}; cuda runtime {runtime}")  # fmt: skip
    print("largest growth (us):")
    for r in grown[:15]:
        print(f"  {r['event'][:60]:60s} {r['model_us']:10.0f} {r['copy_us']:10.0f} "
              f"{r['delta_us']:+10.0f}  n {r['model_count']}/{r['copy_count']}")  # fmt: skip
    for k in ("model", "copy"):
        print(f"runtime calls by issuing op ({k}):")
        for name, rows in per[k]["runtime_parents"].items():
            for where, r in list(rows.items())[:4]:
                print(f"  {name[:24]:24s} {r['count']:5d} {r['self_us']:9.0f} us  {where[:90]}")
    for k in ("model", "copy"):
        print(f"sync sites ({k}): {sum(per[k]['sync_sites'].values())}")
        for s, n in list(per[k]["sync_sites"].items())[:8]:
            print(f"  {n:4d} {s}")
    print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
