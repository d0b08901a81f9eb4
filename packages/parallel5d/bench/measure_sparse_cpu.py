"""Per-rank memory and per-step traffic of fully sharded sparse embeddings, measured on
CPU (bytes, not time), with the analytic model beside every figure.

Memory: bytes of embedding tables + optimizer state per rank, fully sharded sparse vs the
dense ``fully_shard`` path vs TorchRec-style replicated groups.

Tables: the integration model's ``h200`` preset with its two big tables scaled by 1/64
(items 131,072 x 256, hashed users 32,768 x 256, categories and tags 4,096 x 256,
actions 4 x 256, time buckets 32 x 256; fp32; 176 MB in all), so that eight processes
fit on a small machine. Per variant and rank:

- ``at_rest``: bytes of every storage the variant keeps between steps (rows or parameter
  shards, optimizer states, and for the dense path its sharded gradients);
- ``peak``: the state at the start of a step plus the largest net growth inside one
  step (forward, backward, optimizer step), from the profiler's allocator events.

Variants: ``sparse`` (:class:`ShardedEmbeddingCollection` on the whole job, row-wise
Adagrad or lazy Adam), ``torchrec_style`` (the same collection built on one shard group
only and replicated across the groups: TorchRec 2-D sparse parallelism's memory; its
weight all-reduce is not run), ``dense_fully_shard`` (the tables as ``nn.Embedding`` s
under ``hyperrec.parallel5d.fully_shard`` with fused AdamW: the integration's path).

Runs: 8 real gloo ranks as 2 replicas x 4 (``--ranks 8``), and 64 ranks as 8 x 8 on the
fake backend in one process playing rank 0 (same constructors; fake collectives move no
data, so the sparse variants report ``at_rest`` only there, while the dense path's
gathers allocate their real outputs and its peak is measured). Each figure is also
computed by :func:`hyperrec.parallel5d.sparse.traffic.sparse_memory` for comparison.

Traffic: bytes each rank sent to other ranks in one step (forward + backward), by tier
(inside a shard group / across groups), hierarchical vs flat routing on the 8 gloo
ranks, for a GEM-like batch per rank (4,096 history items drawn Zipf(1.05) and hashed,
512 candidates, 64 users, 256 tags), from the collection's counters (the tests check
them against bytes counted through ``all_to_all_single``) and from
:func:`~hyperrec.parallel5d.sparse.traffic.sparse_traffic` given the measured unique
counts. Plus the model alone for the unscaled ``h200`` preset (per-rank batch of 2,048
requests) on 8-GPU hosts.

    python packages/parallel5d/bench/measure_sparse_cpu.py --out packages/parallel5d/bench/results
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.parallel5d.sparse.traffic import TableTraffic, sparse_memory, sparse_traffic
from hyperrec.testing import fake_mesh, run_on_ranks
from hyperrec.testing.bench import write_result

DIM = 256
TABLES = [
    TableConfig(name="item", num_rows=131_072, dim=DIM),
    TableConfig(name="user", num_rows=32_768, dim=DIM),
    TableConfig(name="category", num_rows=4_096, dim=DIM),
    TableConfig(name="tag", num_rows=4_096, dim=DIM),
    TableConfig(name="action", num_rows=4, dim=DIM),
    TableConfig(name="time", num_rows=32, dim=DIM),
]
FEATURES = [
    FeatureConfig(name="history_items", table="item"),
    FeatureConfig(name="candidate_items", table="item"),
    FeatureConfig(name="history_categories", table="category"),
    FeatureConfig(name="history_actions", table="action"),
    FeatureConfig(name="history_time", table="time"),
    FeatureConfig(name="user", table="user"),
    FeatureConfig(name="tags", table="tag", pooling="mean"),
]
ROWS = {t.name: t.num_rows for t in TABLES}


HASH = 2654435761  # a prime: (rank * HASH) % rows spreads hot ids over the rows


def batch(rank: int) -> dict:
    """A GEM-like batch: Zipf(1.05) ids (hashed over the rows) for every feature."""
    g = torch.Generator().manual_seed(rank)
    t, c, b = 4096, 512, 64
    tag_offsets = torch.arange(0, 4 * b + 1, 4)

    def ids(name: str, n: int) -> torch.Tensor:
        rows = ROWS[name]
        u = torch.rand(n, generator=g, dtype=torch.float64)
        a = 1.0 - 1.05
        k = (((rows**a - 1.0) * u + 1.0) ** (1.0 / a) - 1.0).long().clamp_(0, rows - 1)
        return (k * HASH) % rows

    return {
        "history_items": ids("item", t),
        "candidate_items": ids("item", c),
        "history_categories": ids("category", t),
        "history_actions": ids("action", t),
        "history_time": ids("time", t),
        "user": ids("user", b),
        "tags": (ids("tag", 4 * b), tag_offsets),
    }


class DenseTables(nn.Module):
    """The dense path: the same tables as ``nn.Embedding`` / ``nn.EmbeddingBag``."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({t.name: nn.Embedding(t.num_rows, DIM) for t in TABLES})

    def forward(self, feats: dict) -> dict:
        out = {}
        for f in FEATURES:
            w = self.tables[f.table].weight
            v = feats[f.name]
            if f.pooling == "none":
                out[f.name] = torch.nn.functional.embedding(v, w)
            else:
                out[f.name] = torch.nn.functional.embedding_bag(
                    v[0], w, v[1], mode=f.pooling, include_last_offset=True
                )
        return out


def _storages_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t._local_tensor
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _peak_growth(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    deltas = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    live = growth = 0
    for _, n in deltas:
        live += n
        growth = max(growth, live)
    return growth


def _loss(out: dict) -> torch.Tensor:
    return sum((o * o).sum() for o in out.values())


def measure_sparse(mesh, optimizer: str, rank: int, run_step: bool) -> dict:
    coll = ShardedEmbeddingCollection(TABLES, FEATURES, mesh=mesh, validate=False)
    opt = RowWiseAdagrad(coll) if optimizer == "rowwise_adagrad" else LazyAdam(coll)
    at_rest = coll.local_bytes() + opt.state_bytes()
    rec = {"at_rest": at_rest, "rows": coll.local_bytes(), "optimizer_state": opt.state_bytes()}
    if run_step:
        feats = batch(rank)

        def step():
            _loss(coll(feats)).backward()
            opt.step()

        step()  # warm-up (lazy caches)
        rec["peak"] = at_rest + _peak_growth(step)
    return rec


def measure_dense(mesh, rank: int) -> dict:
    from hyperrec.parallel5d import fully_shard

    torch.manual_seed(0)
    model = fully_shard(DenseTables(), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    feats = batch(rank)

    def step():
        _loss(model(feats)).backward()
        opt.step()

    step()  # materialise AdamW states and the sharded gradients

    def live() -> int:
        ts = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
        ts += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return _storages_bytes(ts)

    at_rest = live()
    return {"at_rest": at_rest, "peak": at_rest + _peak_growth(step)}


def measure_traffic(mesh, routing: str, rank: int) -> dict:
    coll = ShardedEmbeddingCollection(TABLES, FEATURES, mesh=mesh, routing=routing, validate=False)
    feats = batch(rank)
    _loss(coll(feats)).backward()
    # unique ids of this rank per table, for the model
    uniq = {}
    for f in FEATURES:
        v = feats[f.name]
        ids = v[0] if isinstance(v, tuple) else v
        uniq.setdefault(f.table, []).append(ids)
    return {
        "bytes": {t: coll.comm_stats.total(t) for t in ("intra_group", "inter_group")},
        "detail": coll.comm_stats.as_dict(),
        "unique_ids": {t: torch.unique(torch.cat(v)).tolist() for t, v in uniq.items()},
    }


def _gloo(replicas: int, group: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (replicas, group), mesh_dim_names=("replicate", "shard"))
    out = {
        "traffic_hierarchical": measure_traffic(mesh, "hierarchical", rank),
        "traffic_flat": measure_traffic(mesh, "flat", rank),
    }
    out |= {
        "sparse_rowwise_adagrad": measure_sparse(mesh, "rowwise_adagrad", rank, True),
        "sparse_lazy_adam": measure_sparse(mesh, "adam", rank, True),
        "torchrec_style_rowwise_adagrad": measure_sparse(
            mesh["shard"], "rowwise_adagrad", rank, True
        ),
        "dense_fully_shard_adamw": measure_dense(
            init_device_mesh("cpu", (replicas * group,)), rank
        ),
    }
    return out


def _fake(replicas: int, group: int) -> dict:
    with fake_mesh((replicas, group), ("replicate", "shard")) as mesh:
        out = {
            "sparse_rowwise_adagrad": measure_sparse(mesh, "rowwise_adagrad", 0, False),
            "sparse_lazy_adam": measure_sparse(mesh, "adam", 0, False),
            "torchrec_style_rowwise_adagrad": measure_sparse(
                mesh["shard"], "rowwise_adagrad", 0, False
            ),
        }
        from torch.distributed.device_mesh import DeviceMesh

        flat = DeviceMesh("cpu", torch.arange(replicas * group))
        out["dense_fully_shard_adamw"] = measure_dense(flat, 0)
    return out


def analytic(replicas: int, group: int) -> dict:
    def traffic(state: int) -> list[TableTraffic]:
        return [
            TableTraffic(num_rows=t.num_rows, dim=DIM, ids_per_rank=0, state_bytes_per_row=state)
            for t in TABLES
        ]

    ada = sparse_memory(traffic(4), group_size=group, replicas=replicas)
    adam = sparse_memory(traffic(8 * DIM), group_size=group, replicas=replicas)
    return {
        "sparse_rowwise_adagrad": ada["hierarchical"],
        "sparse_lazy_adam": adam["hierarchical"],
        "torchrec_style_rowwise_adagrad": ada["torchrec_2d"],
        "dense_fully_shard_adamw": ada["dense_fully_shard"],
    }


def traffic_summary(per_rank: list[dict], replicas: int, group: int) -> dict:
    """Measured bytes per rank (mean and max over ranks) and the model's prediction from
    the measured unique counts, per routing and tier."""
    world = replicas * group
    tables = []
    for t in TABLES:
        uniq = [set(r["traffic_hierarchical"]["unique_ids"].get(t.name, [])) for r in per_rank]
        per_group = [len(set().union(*uniq[g * group : (g + 1) * group])) for g in range(replicas)]
        tables.append(
            TableTraffic(
                num_rows=t.num_rows,
                dim=DIM,
                ids_per_rank=0,
                unique_per_rank=sum(map(len, uniq)) / world,
                unique_per_group=sum(per_group) / replicas,
            )
        )
    model = sparse_traffic(tables, group_size=group, replicas=replicas)
    out = {}
    for routing in ("hierarchical", "flat"):
        rec = {}
        for tier in ("intra_group", "inter_group"):
            vals = [r[f"traffic_{routing}"]["bytes"][tier] for r in per_rank]
            rec[tier] = {
                "measured_mean": sum(vals) / world,
                "measured_max": max(vals),
                "model": model[routing][tier],
            }
        out[routing] = rec
    out["unique_ids_per_rank"] = {
        t.name: tt.unique_per_rank for t, tt in zip(TABLES, tables, strict=True)
    }
    out["unique_ids_per_group"] = {
        t.name: tt.unique_per_group for t, tt in zip(TABLES, tables, strict=True)
    }
    return out


def h200_preset_model() -> dict:
    """The model alone for the unscaled ``h200`` preset: 2,048 requests per rank and step
    (histories of about 480 events, 8.5 candidates and 8.5 tags per request), item ids
    Zipf(1.05), users Zipf(0.9) hashed into 2,097,152 rows; fp32 rows; 8-GPU hosts."""
    req, hist, per_req = 2048, 480, 8.5
    tables = [
        TableTraffic(
            num_rows=8_388_608, dim=256, ids_per_rank=req * (hist + per_req), zipf_exponent=1.05
        ),
        TableTraffic(num_rows=2_097_152, dim=256, ids_per_rank=req, zipf_exponent=0.9),
        TableTraffic(
            num_rows=4096, dim=256, ids_per_rank=req * (hist + per_req), zipf_exponent=0.6
        ),
        TableTraffic(num_rows=4096, dim=256, ids_per_rank=req * per_req, zipf_exponent=0.6),
        TableTraffic(num_rows=4, dim=256, ids_per_rank=req * hist),
        TableTraffic(num_rows=32, dim=256, ids_per_rank=req * hist),
    ]
    out = {}
    for replicas in (2, 8, 64):
        out[f"8x{replicas}"] = {
            "traffic_bytes_per_rank_per_step": sparse_traffic(
                tables, group_size=8, replicas=replicas
            ),
            "memory_bytes_per_rank_rowwise_adagrad": sparse_memory(
                tables, group_size=8, replicas=replicas
            ),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = {}
    per_rank = run_on_ranks(_gloo, 8, 2, 4, timeout_s=1200)
    variants = [v for v in per_rank[0] if not v.startswith("traffic_")]
    runs["gloo_8_ranks_2x4"] = {
        "memory_measured_max_over_ranks": {
            v: {k: max(r[v][k] for r in per_rank) for k in per_rank[0][v]} for v in variants
        },
        "memory_analytic": analytic(2, 4),
        "traffic_bytes_per_rank_per_step": traffic_summary(per_rank, 2, 4),
    }
    runs["fake_64_ranks_8x8_rank0"] = {
        "memory_measured": _fake(8, 8),
        "memory_analytic": analytic(8, 8),
    }
    total = sum(t.nbytes for t in TABLES)
    payload = {
        "benchmark": "measure_sparse_cpu.py",
        "tables": [
            {"name": t.name, "num_rows": t.num_rows, "dim": t.dim, "dtype": "float32"}
            for t in TABLES
        ],
        "table_bytes": total,
        "runs": runs,
        "model_h200_preset": h200_preset_model(),
        "elapsed_s": time.perf_counter() - t0,
    }
    out = write_result(Path(args.out) / "sparse_cpu.json", payload)
    for name, run in runs.items():
        meas = run.get("memory_measured_max_over_ranks", run.get("memory_measured"))
        for v, rec in meas.items():
            print(
                f"{name:26s} {v:32s} at rest {rec['at_rest'] / 2**20:9.2f} MiB"
                + (f"  peak {rec['peak'] / 2**20:9.2f} MiB" if "peak" in rec else "")
            )
    for routing in ("hierarchical", "flat"):
        t = runs["gloo_8_ranks_2x4"]["traffic_bytes_per_rank_per_step"][routing]
        print(
            f"traffic {routing:12s} "
            + "  ".join(
                f"{tier}: {t[tier]['measured_mean'] / 2**20:.2f} MiB (model {t[tier]['model'] / 2**20:.2f})"
                for tier in t
            )
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
