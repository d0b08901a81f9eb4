"""CPU offload: hyperrec ``fully_shard(offload_policy=CPUOffloadPolicy())`` vs PyTorch
FSDP2's ``CPUOffloadPolicy``, on one GPU, same run, same model, same batches.

The Llama-like stack of ``bench_fsdp.py`` (hidden 4096, FFN 11008, vocab 32000; 4 blocks
by default to keep the CPU optimizer steps within the time budget), bf16 compute with
fp32 reduction, ``fully_shard`` per block and at the root, ``reshard_after_forward=True``.
Both libraries keep the fp32 sharded parameters, gradients and AdamW states in pinned
host memory and step AdamW on the CPU; they differ in how the shards reach the GPU
(hyperrec: one host-to-device copy per group straight into its slot of the gathered
buffer, then the bf16 cast in place; FSDP2: per-parameter copies and its copy-in) and
how gradients come back. Reference rows without offload show what offloading saves.

For each variant: median step time (and its forward+backward / optimizer parts), peak
allocated and reserved GPU memory over the timed steps (after the allocator's cache is
emptied), pinned host memory where torch reports it, final loss.

Run (one H200, about 3 minutes, writes ``<out>/offload_1gpu.json``)::

    python packages/parallel5d/bench/bench_offload.py --out packages/parallel5d/bench/results

``--smoke`` runs a tiny model on the CPU (gloo, one process; no pinned memory) in seconds
to check the script end to end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import PRESETS, TINY, build, make_batch

VARIANTS = [
    # (library, optimizer, offload)
    ("fsdp2", "fused", True),
    ("hyperrec", "flat", True),
    ("fsdp2", "foreach", True),
    ("hyperrec", "foreach", True),
    ("fsdp2", "fused", False),
    ("hyperrec", "flat", False),
]


def _shard(model, impl: str, mesh, offload: bool, pin: bool) -> None:
    if impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from hyperrec.parallel5d import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {
        "mesh": mesh,
        "reshard_after_forward": True,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for block in model.blocks():
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _optimizer(model, impl: str, kind: str) -> torch.optim.Optimizer:
    lr = 1e-4
    if impl == "hyperrec" and kind == "flat":
        from hyperrec.dbuffer import flat_params
        from hyperrec.parallel5d import dbuffers

        # One fused AdamW kernel per flat buffer (on the host when offloaded).
        return torch.optim.AdamW(flat_params(dbuffers(model)), lr=lr, fused=True)
    if kind in ("fused", "flat"):
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _host_pinned_gib() -> float | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    s = stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in s:
            return s[key] / 2**30
    return None


def run_variant(cfg, impl, kind, offload, mesh, device, args) -> dict:
    model = build(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    pin = device.type == "cuda"
    _shard(model, impl, mesh, offload, pin)
    opt = _optimizer(model, impl, kind)
    where = {p.to_local().device.type for p in model.parameters()}

    def step(s: int, model=model, opt=opt) -> tuple[float, float, torch.Tensor]:
        batch = make_batch(cfg, device, s, 0)
        _sync(device)
        t0 = time.perf_counter()
        loss = model(batch)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return t1 - t0, time.perf_counter() - t1, loss.detach()

    for s in range(args.warmup):
        step(s)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fb, op, losses = [], [], []
    for s in range(args.steps):
        a, b, loss = step(args.warmup + s)
        fb.append(a)
        op.append(b)
        losses.append(float(loss))
    total = [a + b for a, b in zip(fb, op)]
    row = {
        "impl": impl,
        "optimizer": kind,
        "offload": offload,
        "pin_memory": pin and offload,
        "params": n_params,
        "sharded_param_device": sorted(where),
        "step_s": statistics.median(total),
        "step_s_min": min(total),
        "fwd_bwd_s": statistics.median(fb),
        "optimizer_s": statistics.median(op),
        "step_s_all": total,
        "final_loss": losses[-1],
        "host_pinned_gib": _host_pinned_gib(),
    }
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del step, model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    use_cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    cfg = dict((TINY if args.smoke else PRESETS)["llama"])
    cfg["layers"] = 2 if args.smoke else args.layers
    rows = []
    for impl, kind, offload in VARIANTS:
        try:
            row = run_variant(cfg, impl, kind, offload, mesh, device, args)
            row["error"] = None
        except Exception as e:  # keep the other rows
            row = {"impl": impl, "optimizer": kind, "offload": offload, "error": repr(e)[:500]}
            gc.collect()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
    _print_table(rows, device)
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
        from hyperrec.testing import write_result

        name = "offload_smoke_cpu.json" if args.smoke else "offload_1gpu.json"
        path = write_result(
            Path(args.out) / name,
            {
                "benchmark": "CPU offload: hyperrec fully_shard vs FSDP2 CPUOffloadPolicy",
                "device": device.type,
                "model": cfg,
                "mixed_precision": "bf16 params, fp32 reduce",
                "steps": args.steps,
                "warmup": args.warmup,
                "rows": rows,
            },
        )
        print(f"wrote {path}")
    dist.destroy_process_group()


def _print_table(rows: list[dict], device: torch.device) -> None:
    print(
        f"\n{'variant':26} {'step_ms':>9} {'fwd+bwd':>9} {'optim':>9} "
        f"{'alloc_GiB':>10} {'resv_GiB':>9} {'loss':>9}"
    )
    for r in rows:
        name = f"{r['impl']}:{r['optimizer']}:{'offload' if r['offload'] else 'gpu'}"
        if r.get("error"):
            print(f"{name:26} ERROR {r['error'][:80]}")
            continue
        alloc = r.get("peak_allocated_gib", float("nan"))
        resv = r.get("peak_reserved_gib", float("nan"))
        print(
            f"{name:26} {r['step_s'] * 1e3:9.1f} {r['fwd_bwd_s'] * 1e3:9.1f} "
            f"{r['optimizer_s'] * 1e3:9.1f} {alloc:10.2f} {resv:9.2f} {r['final_loss']:9.4f}"
        )


if __name__ == "__main__":
    main()
