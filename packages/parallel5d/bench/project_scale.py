"""PROJECTION (not a measurement): the GEM-scale preset on 8 to 100,000 GPUs.

CPU only, about a minute. For each job size on a 3-tier topology (8 H200 per host on
NVLink, zones of 384 hosts = 3,072 GPUs on 400 Gb/s RoCE, zones linked 1:7
oversubscribed; every figure cited in ``hyperrec.parallel5d.topology``), it asks
``plan_mesh`` for the best mesh and prices it, the naive alternative (flat FSDP over all
ranks, no EP, embedding rows sharded over all ranks) and the best mesh with SM-free
collectives and without NVLink SHARP, so the table says what each is worth.

    python packages/parallel5d/bench/project_scale.py --out packages/parallel5d/bench/results
    python packages/parallel5d/bench/project_scale.py --calibration cal.json  # measured device

Writes ``projection_gem_scale.json`` and ``projection_gem_scale.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hyperrec.parallel5d.cost import CostOptions, DeviceSpec, gem_scale, plan_mesh, predict
from hyperrec.parallel5d.mesh import AXES, MeshSpec
from hyperrec.parallel5d.topology import Topology

SIZES = (8, 64, 512, 1024, 3072, 4096, 16384, 32768, 65536, 100_000)
PER_GPU_BATCH = 1024  # GEM: "local batches of 1K+ samples" (Meta GEM blog, 2026-08)
HOSTS_PER_ZONE = 384  # 3,072-GPU pods at full bisection (Llama 3 paper, sec. 3.3.1)


def _row(p) -> dict:
    return {
        "mesh": {a: p.spec.size(a) for a in AXES},
        "step_ms": p.step_s * 1e3,
        "compute_ms": p.compute_s * 1e3,
        "exposed_comm_ms": p.exposed_comm_s * 1e3,
        "mfu": p.mfu,
        "local_mfu": p.local_mfu,
        "scaling_ratio": p.scaling_ratio,
        "memory_gb": p.memory_gb,
        "feasible": p.feasible,
        "breakdown_ms": {k: v * 1e3 for k, v in p.breakdown.items()},
        "algorithms": p.algorithms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--calibration", help="JSON from calibrate_cost.py (default: cited figures)")
    ap.add_argument("--per-gpu-batch", type=int, default=PER_GPU_BATCH)
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    args = ap.parse_args()

    device = DeviceSpec.from_calibration(args.calibration) if args.calibration else DeviceSpec()
    model = gem_scale()
    rows = []
    t0 = time.time()
    for w in args.sizes:
        topo = Topology(gpus_per_host=8, hosts=w // 8, hosts_per_zone=min(HOSTS_PER_ZONE, w // 8))
        batch = args.per_gpu_batch * w
        plan = plan_mesh(model, topo, batch, device=device, num_experts=16)
        naive = predict(model, topo, MeshSpec(fsdp=w), batch, device=device)
        row = {
            "gpus": w,
            "zones": topo.zones,
            "candidates": len(plan.candidates),
            "naive_flat_fsdp": _row(naive),
        }
        if plan.best is not None:
            best = plan.best
            row["best"] = _row(best)
            free = predict(
                model, topo, best.spec, batch, device=device, options=CostOptions(sm_free=True)
            )
            no_nvls = predict(
                model, topo, best.spec, batch, device=device, options=CostOptions(nvls=False)
            )
            row["best_sm_free_mfu"] = free.mfu
            row["best_without_nvls_mfu"] = no_nvls.mfu
        rows.append(row)
        b = row.get("best")
        print(
            f"{w:>7} GPUs  best {b and b['mesh']}  MFU {b and round(b['mfu'], 4)}  "
            f"scaling {b and round(b['scaling_ratio'], 4)}  | naive MFU "
            f"{naive.mfu:.4f} scaling {naive.scaling_ratio:.4f}  ({time.time() - t0:.0f}s)",
            flush=True,
        )

    from hyperrec.testing import write_result

    out = Path(args.out)
    payload = {
        "kind": "PROJECTION: cost-model output computed on a CPU from cited inputs, not a measurement",
        "model": model.describe(),
        "per_gpu_batch": args.per_gpu_batch,
        "topology": Topology(gpus_per_host=8, hosts=HOSTS_PER_ZONE).describe()
        | {"hosts_per_zone": HOSTS_PER_ZONE},
        "device": {
            "name": device.name,
            "peak_tflops": device.peak_tflops,
            "matmul_tflops": device.matmul_tflops,
            "hbm_gbps": device.hbm_gbps,
            "launch_us": device.launch_us,
            "sm_slowdown": device.sm_slowdown,
            "sources": dict(device.sources),
        },
        "options": "FSDP prefetch overlap, SM-based NCCL collectives, NVLS where possible, "
        "sparse input distribution pipelined (TrainPipelineSparseDist)",
        "rows": rows,
    }
    path = write_result(out / "projection_gem_scale.json", payload)
    print(f"wrote {path}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    gpus = [r["gpus"] for r in rows]
    best_mfu = [r["best"]["mfu"] if "best" in r else float("nan") for r in rows]
    best_scal = [r["best"]["scaling_ratio"] if "best" in r else float("nan") for r in rows]
    ax[0].plot(gpus, best_mfu, "o-", label="plan_mesh best")
    ax[0].plot(gpus, [r["naive_flat_fsdp"]["mfu"] for r in rows], "s--", label="flat FSDP (naive)")
    ax[0].plot(
        gpus,
        [r.get("best_sm_free_mfu", float("nan")) for r in rows],
        "^:",
        label="best, SM-free collectives",
    )
    ax[0].set(
        xscale="log",
        xlabel="GPUs",
        ylabel="MFU (of 989 TFLOP/s)",
        ylim=(0, None),
        title="GEM-scale preset: predicted MFU",
    )
    ax[1].plot(gpus, best_scal, "o-", label="plan_mesh best")
    ax[1].plot(
        gpus,
        [r["naive_flat_fsdp"]["scaling_ratio"] for r in rows],
        "s--",
        label="flat FSDP (naive)",
    )
    ax[1].axhline(0.9, color="grey", lw=0.8)
    ax[1].set(
        xscale="log",
        xlabel="GPUs",
        ylabel="scaling ratio (compute / step)",
        ylim=(0, 1.05),
        title="predicted scaling ratio",
    )
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle("PROJECTION from cited bandwidths (cost model, not measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "projection_gem_scale.png", dpi=110)
    print(f"wrote {out / 'projection_gem_scale.png'}")


if __name__ == "__main__":
    main()
