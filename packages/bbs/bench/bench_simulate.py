"""Full BBS simulation grid + partition-algorithm comparison; writes the committed JSON.

    python packages/bbs/bench/bench_simulate.py            # a few minutes on 2 CPU cores
    python packages/bbs/bench/bench_simulate.py --quick    # smoke run -> runs/ (not committed)

Grid: log-normal, power-law and uniform lengths x world sizes {8, 64, 512, 4096} x
W in {1, 2, 4, 8, 16}; for each cell no balancing, per-rank BBS, the global oracle and
cost-budget batching on the same sub-batches (see ``hyperrec.bbs.simulate``). The
algorithm table compares the partitioners of ``hyperrec.bbs.partition`` as per-rank
BBS at W = 8, plus the wall time of one rank's ``shuffle_plan`` call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import numpy as np

from hyperrec.bbs import METHODS, ImbalanceStats, shuffle_plan
from hyperrec.bbs.plan import plan_windows
from hyperrec.bbs.simulate import SimulationConfig, simulate, sub_batch_costs, targets
from hyperrec.testing import write_result

RESULTS = Path(__file__).resolve().parent / "results"


def algorithm_comparison(cfg: SimulationConfig, world_size: int, w: int) -> list[dict]:
    """Per-rank BBS excess at window ``w`` for every partition method, same data."""
    k, s = cfg.sub_batches_per_step, cfg.samples_per_sub_batch
    steps = 256
    rows = []
    for dist in ("lognormal", "powerlaw"):
        rng = np.random.default_rng([cfg.seed, 99, world_size])
        c = sub_batch_costs(dist, world_size, steps * k, s, cfg.cost, rng, cfg.max_len)
        none = ImbalanceStats.from_step_costs(c.reshape(world_size, steps, k).sum(axis=2).T)
        windows = c.reshape(-1, w * k)
        for method in (m for m in METHODS if m != "auto"):
            t0 = time.perf_counter()
            plan = plan_windows(windows, k, w, method=method)
            batched_s = time.perf_counter() - t0
            loads = np.take_along_axis(windows, plan.reshape(len(windows), -1), 1)
            loads = loads.reshape(len(windows), w, k).sum(axis=2).reshape(world_size, steps).T
            st = ImbalanceStats.from_step_costs(loads)
            # One rank's real call: a single window through the public API.
            one = windows[0]
            reps = 200
            t0 = time.perf_counter()
            for _ in range(reps):
                shuffle_plan(one, sub_batches_per_step=k, window_steps=w, method=method)
            rows.append(
                {
                    "distribution": dist,
                    "world_size": world_size,
                    "window_steps": w,
                    "method": method,
                    "none": none.excess,
                    "bbs": st.excess,
                    "reduction": 1 - st.excess / none.excess,
                    "us_per_window_single_rank": (time.perf_counter() - t0) / reps * 1e6,
                    "us_per_window_batched": batched_s / len(windows) * 1e6,
                }
            )
    return rows


def markdown(path: Path) -> str:
    """The README's tables, rendered from a committed results JSON (numbers quoted as is)."""
    data = json.loads(Path(path).read_text())
    sim, m = data["simulation"], data["machine"]
    cfg = sim["config"]
    rows = sim["rows"]
    out = [
        f"From `bench/results/{Path(path).name}` ({m['date'][:10]}, {m['cpu_count']} CPU cores, "
        f"torch {m['torch']}, numpy simulation; regenerate with "
        "`python packages/bbs/bench/bench_simulate.py`). Each rank reads sub-batches of "
        f"{cfg['samples_per_sub_batch']} samples, {cfg['sub_batches_per_step']} per step; "
        f"sample cost `L + L^2/{1 / cfg['cost']['quadratic']:g}` with lengths in "
        f"`[1, {cfg['max_len']}]`: "
        + "; ".join(f"{k}: {v}" for k, v in sim["distributions"].items())
        + ". Excess = sum over steps of the slowest rank's cost / sum of the mean - 1; "
        "cut = share of the no-balancing excess removed. Steps per rank: "
        f"{cfg['steps']} at 4,096 ranks, more at smaller sizes (at least "
        f"{cfg['min_rank_steps']:,} rank-steps per cell).",
        "",
        "At W = 8 (every sub-batch within 7 steps of its natural step):",
        "",
        "| lengths | ranks | no balancing | per-rank BBS | global oracle | cost budget "
        "| sub-batches / step (budget) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r["window_steps"] == 8):
        out.append(
            f"| {r['distribution']} | {r['world_size']:,} | {r['none']:.3f} "
            f"| {r['bbs']:.3f} (-{r['bbs_reduction']:.0%}) "
            f"| {r['oracle']:.3f} (-{r['oracle_reduction']:.0%}) "
            f"| {r['budget']:.4f} (-{r['budget_reduction']:.1%}) "
            f"| {r['budget_sub_batches_mean']:.2f} +- {r['budget_sub_batches_std']:.2f} |"
        )
    windows = [w for w in cfg["windows"] if w > 1]
    out += [
        "",
        "Per-rank BBS: share of the excess removed, by window (W = 1 removes nothing), "
        "with the mean |delay| of a sub-batch in steps:",
        "",
        "| lengths | ranks | " + " | ".join(f"W={w}" for w in windows) + " |",
        "|---|---:|" + "---:|" * len(windows),
    ]
    for dist in sim["distributions"]:
        for size in cfg["world_sizes"]:
            cells = {
                r["window_steps"]: r
                for r in rows
                if r["distribution"] == dist and r["world_size"] == size
            }
            vals = " | ".join(f"{cells[w]['bbs_reduction']:.0%}" for w in windows)
            out.append(f"| {dist} | {size:,} | {vals} |")
    delays = {
        w: next(r["bbs_mean_abs_delay"] for r in rows if r["window_steps"] == w) for w in windows
    }
    out.append("| 1 - 1/sqrt(W) | | " + " | ".join(f"{1 - w**-0.5:.0%}" for w in windows) + " |")
    out.append(
        "| mean abs. delay (steps) | | " + " | ".join(f"{delays[w]:.2f}" for w in windows) + " |"
    )
    out += ["", "Targets (W = 8, every world size):", ""]
    for t in sim["targets"]:
        out.append(
            f"- {t['distribution']}, {t['mode']}: cut >= {t['goal_reduction']:.0%} -> "
            f"minimum {t['min_reduction_over_world_sizes']:.1%} ({'met' if t['met'] else 'MISSED'})"
        )
    algos = data["algorithms"]
    size = algos[0]["world_size"]
    out += [
        "",
        f"Partition algorithms as per-rank BBS at W = 8, {size} ranks, same sub-batches "
        "(time: one rank's `shuffle_plan` call for one window, on a shared machine):",
        "",
        "| lengths | method | excess | cut | us / window |",
        "|---|---|---:|---:|---:|",
    ]
    for a in algos:
        out.append(
            f"| {a['distribution']} | `{a['method']}` | {a['bbs']:.4f} | {a['reduction']:.1%} "
            f"| {a['us_per_window_single_rank']:.0f} |"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small grid, results not committed")
    p.add_argument("--out", default=None, help="JSON path (default results/simulate_<date>.json)")
    p.add_argument("--markdown", default=None, help="print README tables from this JSON, exit")
    args = p.parse_args()
    if args.markdown:
        print(markdown(Path(args.markdown)))
        return 0
    if args.quick:
        cfg = SimulationConfig(world_sizes=(8, 64), steps=16, min_rank_steps=256)
    else:
        cfg = SimulationConfig(
            world_sizes=(8, 64, 512, 4096), windows=(1, 2, 4, 8, 16), steps=64,
            min_rank_steps=32768,
        )  # fmt: skip
    t0 = time.perf_counter()
    result = simulate(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(result.table())
    algos = algorithm_comparison(cfg, world_size=64 if args.quick else 512, w=8)
    print("\npartition algorithms, per-rank BBS at W=8 (same sub-batches):")
    print(f"{'dist':>10} {'method':>9} {'excess':>8} {'cut':>6} {'us/window':>10}")
    for r in algos:
        print(
            f"{r['distribution']:>10} {r['method']:>9} {r['bbs']:>8.4f} {r['reduction']:>6.1%}"
            f" {r['us_per_window_single_rank']:>10.0f}"
        )
    for t in targets(result.rows):
        print(
            f"target {t['distribution']} {t['mode']} W=8 cut >= {t['goal_reduction']:.0%}: "
            f"min {t['min_reduction_over_world_sizes']:.1%} -> {'met' if t['met'] else 'MISSED'}"
        )
    payload = {
        "benchmark": "bbs.simulate",
        "quick": args.quick,
        "simulation": result.as_dict(),
        "algorithms": algos,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    default = Path("runs/bbs_bench_quick.json") if args.quick else RESULTS / f"simulate_{date}.json"
    out = write_result(args.out or default, payload)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
