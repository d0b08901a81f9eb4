"""Lookup + backward + update throughput of one GEM-scale embedding table on one GPU.

Variants, same table size, same batches (jagged Zipf histories as a sequence feature,
plus mean-pooled bags over the same table), same seeds:

- ``sparse_rowwise_adagrad``: :class:`ShardedEmbeddingCollection` on a 1-rank mesh +
  :class:`RowWiseAdagrad` (``validate=False``, fused Triton update on CUDA);
  ``..._torch_update``: the same with the PyTorch update (``backend="torch"``);
  ``..._validated``: the same with input validation (its host syncs);
- ``sparse_lazy_adam``: the collection + :class:`LazyAdam` (fp32 tables only: its states
  are 2x the table);
- ``dense_adamw``: ``nn.Embedding`` weights with dense gradients and fused ``AdamW`` (the
  integration model's current path, where ``fully_shard`` adds only communication);
- ``torch_sparse_adam``: ``F.embedding(..., sparse=True)`` + ``torch.optim.SparseAdam``
  (PyTorch's own lazy path; same update rule as ``sparse_lazy_adam``).

A step = forward (lookups, pooling) + backward of ``sum(out * G)`` (a fixed random
upstream gradient) + optimizer step, timed with CUDA events over several freshly drawn
batches (median and minimum). Figures: lookups/s, unique rows updated/s, and effective
GB/s = the *minimal* bytes of a sparse step (read the unique rows, write the outputs:
one row per history id and per bag, read their gradients, read + write the updated rows
and their states) / time, against the H200 copy ceiling (4.2 TB/s). The same byte count is used for every variant, so the
GB/s ratios are the speed ratios; the dense variant also moves the whole table and its
AdamW states every step (``dense_bytes`` in the JSON).

Run (one H200, torch 2.11; at most 4 minutes, ``--quick`` at most 1.5)::

    python packages/parallel5d/bench/bench_sparse.py --out packages/parallel5d/bench/results

``--smoke`` runs a tiny CPU version (gloo) to check the script.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.testing.bench import write_result

COPY_CEILING_GBS = 4200.0
HASH = 2654435761  # Knuth's multiplicative constant (a prime): spreads hot ids over rows


def zipf_ids(n: int, rows: int, s: float, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` ids with P(rank k) ~ k^-s (continuous inverse-CDF approximation), hashed so
    hot ids land on rows all over the table, as hashed production ids do."""
    u = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    a = 1.0 - s
    rank = ((rows**a - 1.0) * u + 1.0) ** (1.0 / a) - 1.0
    rank = rank.long().clamp_(0, rows - 1)
    return (rank * HASH) % rows


def make_batch(cfg: dict, step: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(1000 + step)
    b = cfg["sequences"]
    # power-law history lengths (Pareto, alpha 1.5), capped
    u = torch.rand(b, generator=gen, device=device)
    lengths = (cfg["min_len"] * (1.0 - u) ** (-1.0 / 1.5)).long().clamp_(max=cfg["max_len"])
    n = int(lengths.sum())
    bag_lengths = torch.randint(0, 2 * cfg["bag_len"], (cfg["bags"],), generator=gen, device=device)
    bag_offsets = torch.zeros(cfg["bags"] + 1, dtype=torch.long, device=device)
    bag_offsets[1:] = bag_lengths.cumsum(0)
    m = int(bag_offsets[-1])
    rows = cfg["rows"]
    hist = zipf_ids(n, rows, cfg["zipf"], gen, device)
    bag_ids = zipf_ids(m, rows, cfg["zipf"], gen, device)
    unique = int(torch.unique(torch.cat([hist, bag_ids])).numel())
    return {
        "step": step,
        "hist": hist,
        "bag_ids": bag_ids,
        "bag_offsets": bag_offsets,
        "lookups": n + m,
        "outputs": n + cfg["bags"],
        "unique": unique,
    }


def upstream_grads(cfg: dict, batch: dict, device) -> dict:
    """The fixed random output gradients of a batch, drawn just before its step (not
    kept for all batches: they are as large as the outputs)."""
    gen = torch.Generator(device=device).manual_seed(5000 + batch["step"])
    n, dim = batch["hist"].numel(), cfg["dim"]
    return {
        **batch,
        "g_hist": torch.randn(n, dim, generator=gen, device=device) * 1e-3,
        "g_bag": torch.randn(cfg["bags"], dim, generator=gen, device=device) * 1e-3,
    }


# ---------------------------------------------------------------------------- variants
class SparseVariant:
    def __init__(self, cfg, dtype, device, optimizer: str, validate: bool, backend="auto"):
        table = TableConfig(name="item", num_rows=cfg["rows"], dim=cfg["dim"], dtype=dtype)
        feats = [
            FeatureConfig(name="hist", table="item"),
            FeatureConfig(name="bag", table="item", pooling="mean"),
        ]
        mesh = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (1,))
        self.coll = ShardedEmbeddingCollection(
            [table], feats, mesh=mesh, device=device, validate=validate
        )
        if optimizer == "rowwise_adagrad":
            self.opt = RowWiseAdagrad(self.coll, lr=0.01, backend=backend)
            self.state_bytes_per_row = 4
        else:
            self.opt = LazyAdam(self.coll, lr=1e-3, backend=backend)
            self.state_bytes_per_row = 8 * cfg["dim"]

    def step(self, batch, events):
        events[0].record()
        out = self.coll({"hist": batch["hist"], "bag": (batch["bag_ids"], batch["bag_offsets"])})
        events[1].record()
        loss = (out["hist"].float() * batch["g_hist"]).sum() + (
            out["bag"].float() * batch["g_bag"]
        ).sum()
        loss.backward()
        events[2].record()
        self.opt.step()
        events[3].record()


class TorchVariant:
    def __init__(self, cfg, dtype, device, sparse: bool):
        self.weight = torch.nn.Parameter(
            torch.empty(cfg["rows"], cfg["dim"], dtype=dtype, device=device).normal_(
                std=cfg["dim"] ** -0.5
            )
        )
        self.sparse = sparse
        if sparse:
            self.opt = torch.optim.SparseAdam([self.weight], lr=1e-3)
            self.state_bytes_per_row = 2 * cfg["dim"] * self.weight.element_size()
        else:
            fused = device.type == "cuda"
            self.opt = torch.optim.AdamW([self.weight], lr=1e-3, fused=fused)
            self.state_bytes_per_row = 2 * cfg["dim"] * self.weight.element_size()

    def step(self, batch, events):
        events[0].record()
        h = F.embedding(batch["hist"], self.weight, sparse=self.sparse)
        b = F.embedding_bag(
            batch["bag_ids"],
            self.weight,
            batch["bag_offsets"],
            mode="mean",
            sparse=self.sparse,
            include_last_offset=True,
        )
        events[1].record()
        loss = (h.float() * batch["g_hist"]).sum() + (b.float() * batch["g_bag"]).sum()
        loss.backward()
        events[2].record()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        events[3].record()


def build(name: str, cfg, dtype, device):
    if name == "sparse_rowwise_adagrad":
        return SparseVariant(cfg, dtype, device, "rowwise_adagrad", validate=False)
    if name == "sparse_rowwise_adagrad_torch_update":
        return SparseVariant(cfg, dtype, device, "rowwise_adagrad", validate=False, backend="torch")
    if name == "sparse_rowwise_adagrad_validated":
        return SparseVariant(cfg, dtype, device, "rowwise_adagrad", validate=True)
    if name == "sparse_lazy_adam":
        return SparseVariant(cfg, dtype, device, "adam", validate=False)
    if name == "dense_adamw":
        return TorchVariant(cfg, dtype, device, sparse=False)
    if name == "torch_sparse_adam":
        return TorchVariant(cfg, dtype, device, sparse=True)
    raise ValueError(name)


class _CpuEvent:
    def __init__(self):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def run_case(cfg: dict, dtype: torch.dtype, variants: list[str], device, args) -> list[dict]:
    cuda = device.type == "cuda"
    batches = [make_batch(cfg, s, device) for s in range(args.warmup + args.steps)]
    elem = torch.empty((), dtype=dtype).element_size()
    results = []
    for name in variants:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rec: dict = {"variant": name, "dtype": str(dtype).removeprefix("torch."), **cfg}
        v = None
        try:
            t0 = time.perf_counter()
            v = build(name, cfg, dtype, device)
            if cuda:
                torch.cuda.synchronize()
            rec["build_s"] = time.perf_counter() - t0
            times, phases = [], []
            for i, ids in enumerate(batches):
                batch = upstream_grads(cfg, ids, device)
                if cuda:
                    torch.cuda.synchronize()
                events = (
                    [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    if cuda
                    else [_CpuEvent() for _ in range(4)]
                )
                v.step(batch, events)
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(events[0].elapsed_time(events[3]))
                    phases.append([events[j].elapsed_time(events[j + 1]) for j in range(3)])
            med = statistics.median(times)
            lookups = statistics.mean(b["lookups"] for b in batches[args.warmup :])
            outputs = statistics.mean(b["outputs"] for b in batches[args.warmup :])
            unique = statistics.mean(b["unique"] for b in batches[args.warmup :])
            row = cfg["dim"] * elem
            # minimal sparse step: read the unique rows, write the outputs (one row per
            # history id, one per bag), read their gradients, read + write the updated
            # rows and their states
            minimal = (
                unique * row + 2 * outputs * row + unique * (2 * row + 2 * v.state_bytes_per_row)
            )
            rec.update(
                {
                    "step_ms_median": med,
                    "step_ms_min": min(times),
                    "forward_ms_median": statistics.median(p[0] for p in phases),
                    "backward_ms_median": statistics.median(p[1] for p in phases),
                    "optimizer_ms_median": statistics.median(p[2] for p in phases),
                    "lookups_per_step": lookups,
                    "unique_rows_per_step": unique,
                    "lookups_per_s": lookups / (med / 1e3),
                    "rows_updated_per_s": unique / (med / 1e3),
                    "minimal_bytes_per_step": minimal,
                    "effective_gb_per_s": minimal / (med / 1e3) / 1e9,
                    "fraction_of_copy_ceiling": minimal / (med / 1e3) / 1e9 / COPY_CEILING_GBS,
                    "state_bytes_per_row": v.state_bytes_per_row,
                    "table_bytes": cfg["rows"] * row,
                }
            )
            if name == "dense_adamw":
                # what the dense step really streams: gradient zero-fill + write, AdamW reads
                # param, grad, 2 states and writes param + 2 states
                rec["dense_bytes_per_step"] = cfg["rows"] * cfg["dim"] * elem * 9
            if cuda:
                rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError as exc:
            rec["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        except RuntimeError as exc:  # e.g. an unsupported dtype in a torch peer
            rec["error"] = str(exc).splitlines()[0]
        finally:
            v = batch = None
        print(
            f"{name:34s} {rec['dtype']:8s} rows={cfg['rows']:>11,d} "
            + (
                f"step {rec['step_ms_median']:8.2f} ms (min {rec['step_ms_min']:.2f}) "
                f"fwd/bwd/opt {rec['forward_ms_median']:.2f}/{rec['backward_ms_median']:.2f}/"
                f"{rec['optimizer_ms_median']:.2f}  {rec['lookups_per_s'] / 1e6:8.1f} M lookups/s "
                f"{rec['effective_gb_per_s']:7.1f} GB/s ({100 * rec['fraction_of_copy_ceiling']:.1f}% of copy)"
                if "error" not in rec
                else rec["error"]
            ),
            flush=True,
        )
        results.append(rec)
    base = {r["variant"]: r for r in results if "error" not in r}
    for r in results:
        for peer in ("dense_adamw", "torch_sparse_adam"):
            if "error" not in r and peer in base:
                r[f"speedup_vs_{peer}"] = base[peer]["step_ms_median"] / r["step_ms_median"]
    return results


ALL = [
    "sparse_rowwise_adagrad",
    "sparse_rowwise_adagrad_torch_update",
    "sparse_rowwise_adagrad_validated",
    "sparse_lazy_adam",
    "torch_sparse_adam",
    "dense_adamw",
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for the JSON result")
    ap.add_argument("--quick", action="store_true", help="one smaller fp32 case, fewer steps")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (gloo)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    args = ap.parse_args()

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no GPU: run with --smoke for the CPU check")
    store_dir = tempfile.mkdtemp(prefix="bench-sparse-")
    dist.init_process_group(
        "gloo" if device.type == "cpu" else "nccl",
        store=dist.FileStore(os.path.join(store_dir, "store"), 1),
        rank=0,
        world_size=1,
    )
    if device.type == "cuda":
        torch.cuda.set_device(0)
    seq = {
        "sequences": 4096,
        "min_len": 64,
        "max_len": 4096,
        "bags": 4096,
        "bag_len": 32,
        "zipf": 1.05,
        "dim": 128,
    }
    if args.smoke:
        cases = [
            (
                {
                    **seq,
                    "rows": 20_000,
                    "sequences": 16,
                    "min_len": 4,
                    "max_len": 64,
                    "bags": 8,
                    "bag_len": 4,
                },
                torch.float32,
                ALL,
            )
        ]
        args.steps, args.warmup = args.steps or 2, args.warmup or 1
    elif args.quick:
        cases = [({**seq, "rows": 10_000_000}, torch.float32, ALL)]
        args.steps, args.warmup = args.steps or 5, args.warmup or 2
    else:
        cases = [
            ({**seq, "rows": 50_000_000}, torch.float32, ALL),
            (
                {**seq, "rows": 100_000_000},
                torch.bfloat16,
                [v for v in ALL if v != "sparse_lazy_adam"],
            ),
        ]
        args.steps, args.warmup = args.steps or 10, args.warmup or 3
    t0 = time.perf_counter()
    results = []
    for cfg, dtype, variants in cases:
        results += run_case(cfg, dtype, variants, device, args)
    elapsed = time.perf_counter() - t0
    name = (
        "sparse_smoke_cpu.json"
        if args.smoke
        else ("sparse_h200_quick.json" if args.quick else "sparse_h200.json")
    )
    out = write_result(
        Path(args.out) / name,
        {
            "benchmark": "bench_sparse.py",
            "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine paths
            "copy_ceiling_gb_per_s": COPY_CEILING_GBS,
            "elapsed_s": elapsed,
            "results": results,
        },
    )
    print(f"wrote {out} ({elapsed:.0f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
