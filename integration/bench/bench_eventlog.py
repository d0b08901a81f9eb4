"""Event-log reader: preparation time, peak memory, disk, and batch-serving speed.

Generates a synthetic interaction log (Zipf users and items, 90 days of timestamps, a
click label and an item category) as Parquet and CSV, then measures, each in a fresh
process so peak memory is the preparation's own:

- ``prepare_event_log`` on the Parquet file, on the CSV file with the pyarrow parser, and
  (on a tenth of the events: it is slow) on the CSV file with the standard-library
  parser: wall time, peak resident memory (``ru_maxrss``) over the interpreter's
  baseline, events per second, and the prepared directory's size;
- ``EventLogSource.batch`` on random training requests (1,024 per batch) with history
  caps of 64 and 512: requests and history events per second (page cache warm).

CPU only (the reader is host code). Usage::

    python integration/bench/bench_eventlog.py --out integration/bench/results --events 10000000
    python integration/bench/bench_eventlog.py --out /tmp/x --smoke     # 200k events, seconds

Writes ``eventlog_<events>_<date>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_CHILD = r"""
import json, resource, sys, time
from hyperrec.integration import EventLogConfig, prepare_event_log
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = EventLogConfig(**json.loads(sys.argv[1]))
t0 = time.perf_counter()
info = prepare_event_log(cfg, sys.argv[2], force=True)
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"wall_s": wall, "read_s": info["read_s"], "peak_rss_mib": peak / 1024,
                  "baseline_rss_mib": base / 1024, "events": info["events"],
                  "splits": info["splits"], "vocab_sizes": info["vocab_sizes"]}))
"""


def _generate(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    users = max(1000, n // 20)  # 20 events per user on average
    items = max(1000, n // 50)
    # Zipf-like ranks through a bounded power law (numpy's zipf is unbounded).
    u = np.minimum((rng.pareto(1.1, n) * users / 20).astype(np.int64), users - 1)
    i = np.minimum((rng.pareto(1.05, n) * items / 50).astype(np.int64), items - 1)
    perm_u, perm_i = rng.permutation(users), rng.permutation(items)
    t = 1_700_000_000 + rng.integers(0, 90 * 86_400, n)
    return {
        "user_id": perm_u[u],
        "item_id": perm_i[i],
        "timestamp": t,
        "label": (rng.random(n) < 0.2).astype(np.int8),
        "category": perm_i[i] % 997,
    }


def _write(cols: dict[str, np.ndarray], folder: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pa.table(cols)
    paths = {"parquet": folder / "log.parquet", "csv": folder / "log.csv"}
    pq.write_table(table, str(paths["parquet"]))
    pacsv.write_csv(table, str(paths["csv"]))
    return paths


def _prepare(cfg: dict, cache: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cfg), str(cache)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["prepared_mib"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**20
    out["events_per_s"] = out["events"] / out["wall_s"]
    out["peak_over_baseline_mib"] = out["peak_rss_mib"] - out["baseline_rss_mib"]
    out["bytes_per_event_peak"] = out["peak_over_baseline_mib"] * 2**20 / out["events"]
    return out


def _serve(cfg: dict, cache: Path, cap: int, batches: int) -> dict:
    from hyperrec.integration import TRAIN, EventLogConfig, EventLogSource

    src = EventLogSource(EventLogConfig(**{**cfg, "max_seqlen": cap}), cache)
    n = src.num_requests(TRAIN)
    rng = np.random.default_rng(1)
    src.batch(TRAIN, rng.integers(0, n, 1024))  # warm-up
    times, events = [], 0
    for _ in range(batches):
        ids = rng.integers(0, n, 1024)
        t0 = time.perf_counter()
        b = src.batch(TRAIN, ids)
        times.append(time.perf_counter() - t0)
        events += b.num_history_events
    med = float(np.median(times))
    return {
        "cap": cap,
        "batch_requests": 1024,
        "batches": batches,
        "median_batch_s": med,
        "min_batch_s": float(np.min(times)),
        "requests_per_s_median": 1024 / med,
        "history_events_per_request": events / (1024 * batches),
        "history_events_per_s_median": events / batches / med,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the result JSON")
    p.add_argument("--events", type=float, default=1e7, help="events in the log (default 1e7)")
    p.add_argument("--smoke", action="store_true", help="200,000 events: checks the script")
    p.add_argument("--workdir", help="where the log and caches go (default: a temp dir)")
    args = p.parse_args()
    n = 200_000 if args.smoke else int(args.events)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-eventlog-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        paths = _write(_generate(n), work)
        gen_s = time.perf_counter() - t0
        sizes = {k: v.stat().st_size / 2**20 for k, v in paths.items()}
        base = {"category_column": "category"}
        results = {}
        for name, path, reader in (
            ("parquet", paths["parquet"], "auto"),
            ("csv_pyarrow", paths["csv"], "pyarrow"),
        ):
            cfg = {**base, "path": str(path), "reader": reader}
            results[name] = _prepare(cfg, work / f"cache_{name}")
            print(name, json.dumps(results[name]), flush=True)
        # The standard-library parser on a tenth of the log (it is the slow fallback).
        small = max(n // 10, 10_000)
        (work / "small").mkdir(exist_ok=True)
        small_path = _write(_generate(small, seed=2), work / "small")["csv"]
        cfg = {**base, "path": str(small_path), "reader": "python"}
        results["csv_python_tenth"] = _prepare(cfg, work / "cache_python")
        print("csv_python_tenth", json.dumps(results["csv_python_tenth"]), flush=True)
        serve_cfg = {**base, "path": str(paths["parquet"])}
        serving = [_serve(serve_cfg, work / "cache_parquet", cap, 100) for cap in (64, 512)]
        for s in serving:
            print("serve", json.dumps(s), flush=True)
        from hyperrec.testing.bench import write_result

        date = datetime.date.today().isoformat()
        out = Path(args.out) / f"eventlog_{'smoke' if args.smoke else n}_{date}.json"
        write_result(
            out,
            {
                "benchmark": "event-log reader: prepare (stream + sort + split + remap + write) "
                "and serve (memory-mapped batches)",
                "events": n,
                "input_mib": sizes,
                "generate_s": gen_s,
                "prepare": results,
                "serve": serving,
                "notes": "prepare runs in a fresh process; peak_rss_mib is that process's "
                "ru_maxrss (includes the interpreter and imports: baseline_rss_mib); serving "
                "reads a warm page cache; one thread (OMP_NUM_THREADS=1).",
            },
        )
        print(f"wrote {out}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
