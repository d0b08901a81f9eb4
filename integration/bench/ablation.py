"""Ablation of the GEM-style model's training speed on one GPU, in the GEM paper's style.

    python integration/bench/ablation.py --out integration/results           # one H200, <= 9 min
    python integration/bench/ablation.py --out integration/results --quick   # <= 4 min
    python integration/bench/ablation.py --out /tmp/ablation --smoke         # CPU, < 1 min
    python integration/bench/ablation.py --print integration/results/<file>.json

Rows, each adding one technique to the previous row's configuration (same preset, data,
initial parameters, batch and number of steps):

    naive                   padded PyTorch attention (SDPA; HSTU SiLU attention on padded
                            tensors), arrival-order batches, PyTorch FSDP2, nn.Linear in bf16
    + jagged kernels        hyperrec.jagged_attn on unpadded tokens (validation moved to
                            data loading: no host sync in the step)
    + BBS                   Base Batch Shuffling (window of 8 steps)
    + MXFP8 MLPs            hyperrec.mxfp8.MXLinear on the interaction MLP's wide layers
    + hyperrec fully_shard  hyperrec.parallel5d's zero-copy fully_shard instead of FSDP2
    + autoac                \\
    + FP8 attention          > recorded as "not available" until integrated
    + sharded embeddings    /
    all                     every available technique plus the step engineering: one fused
                            embedding lookup, torch.compile'd small-op regions, fused AdamW
    all @ preset batch      "all" at the preset's own batch (the MFU figure of the preset)

Every row trains in a fresh subprocess (clean memory statistics and compile caches; an
out-of-memory row is recorded, not fatal) with a single-rank process group so that the
sharding rows really shard. The batch of the comparable rows is the preset's, halved until
the naive row fits in memory (its padded attention is what runs out first). Input data is
built by DataLoader workers in every row (as any PyTorch user would), so the comparison
is of the model's compute path, not of the synthetic generator.

Per row: requests/s and step times over the timed steps (after the warm-up steps, which
include compilation), model TFLOP/s and MFU (analytic FLOPs, see
``hyperrec.integration.flops``) against the datasheet peak and the GEMM rate measured
on the machine, peak allocated memory, the step-cost spread (what BBS flattens; on one GPU
it cannot raise throughput: no rank waits for another), held-out AUC after the same steps,
and ``speedup_vs_naive``. Writes ``ablation_<preset>_<mode>_<date>.json`` and a markdown
table next to it into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from _common import jsonable, single_rank_group  # noqa: E402

RESULTS = _HERE.parent / "results"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    description: str
    overrides: tuple[str, ...]
    """Added to the previous row's overrides (cumulative)."""


ROWS = (
    Row(
        "naive",
        "padded SDPA / padded HSTU attention, arrival order, FSDP2, bf16 nn.Linear",
        (
            "train.impl=naive",
            "train.window_steps=1",
            "train.sharding=fsdp2",
            "train.mlp_precision=bf16",
            "train.fused_embeddings=false",
            "train.compile=off",
            "train.optimizer_impl=foreach",
        ),
    ),
    Row("+ jagged kernels", "hyperrec.jagged_attn on unpadded tokens", ("train.impl=hyperrec",)),
    Row("+ BBS", "Base Batch Shuffling, window of 8 steps", ("train.window_steps=8",)),
    Row("+ MXFP8 MLPs", "MXLinear (128-blocks) on the wide MLP layers", ("train.mlp_precision=mxfp8",)),
    Row("+ hyperrec fully_shard", "zero-copy fully_shard instead of FSDP2", ("train.sharding=hyperrec",)),
    Row("+ autoac", "per-region activation-checkpointing budgets", ("train.activation_checkpointing=autoac",)),
    Row("+ FP8 attention", "FP8 jagged attention kernels", ("train.attention_precision=fp8",)),
    Row("+ sharded embeddings", "row-wise sparse table updates", ("train.embedding_optimizer=sparse",)),
    Row(
        "all",
        "every available technique + fused lookup, compiled small ops, fused AdamW",
        ("train.fused_embeddings=true", "train.compile=inductor", "train.optimizer_impl=fused"),
    ),
)  # fmt: skip

MODES = {
    # warm-up steps (compilation, caches), timed steps, held-out requests, time budget (s)
    "full": {"warmup": 3, "timed": 6, "eval": 1024, "budget": 530.0, "row_timeout": 170.0},
    "quick": {"warmup": 2, "timed": 3, "eval": 512, "budget": 235.0, "row_timeout": 150.0},
    "smoke": {"warmup": 1, "timed": 2, "eval": 128, "budget": 55.0, "row_timeout": 40.0},
}
QUICK_ROWS = ("naive", "+ jagged kernels", "all")


# -- one row (runs in its own process on the GPU) --------------------------------------------
def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration and measure it. ``spec``: preset, overrides, warmup, timed,
    device. Returns the row's measurements (raises on failure)."""
    import torch

    from hyperrec.integration import Trainer, get_preset, override

    device = spec["device"]
    preset = override(get_preset(spec["preset"]), list(spec["overrides"]))
    steps = spec["warmup"] + spec["timed"]
    preset = dataclasses.replace(
        preset,
        train=dataclasses.replace(
            preset.train,
            steps=steps,
            warmup_steps=1,
            eval_every=0,
            ckpt_every=0,
            log_every=1,
            # Rows compare the model's configurations; the trainer's logistic-regression
            # baseline is the same in every row and would only spend the row's budget.
            baseline_requests=0,
        ),
    )
    with tempfile.TemporaryDirectory() as tmp:
        single_rank_group(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer = Trainer(preset, out_dir=Path(tmp) / "run", device=device, progress=False)
        try:
            metrics = trainer.fit(plot=False).metrics
        finally:
            trainer.close()
        wall = time.perf_counter() - start
    hist = metrics["history"]
    w = spec["warmup"]
    times = hist["step_time_s"][w:]
    tflop = hist["step_tflop"][w:]
    seconds = float(sum(times))
    per_gpu = sum(tflop) / seconds if seconds else None
    mfu = metrics["mfu"]
    final = metrics["final"] or {}
    bbs = metrics["bbs"].get("balanced", {})
    return {
        "global_batch_size": preset.train.global_batch_size,
        "requests_per_s": preset.train.global_batch_size * len(times) / seconds,
        "median_step_s": sorted(times)[len(times) // 2],
        "min_step_s": min(times),
        "tflops_per_gpu": per_gpu,
        "mfu": per_gpu / mfu["peak_tflops"] if per_gpu and mfu["peak_tflops"] else None,
        "fraction_of_measured_matmul": per_gpu / mfu["measured_matmul_tflops"]
        if per_gpu and mfu["measured_matmul_tflops"]
        else None,
        "peak_tflops": mfu["peak_tflops"],
        "measured_matmul_tflops": mfu["measured_matmul_tflops"],
        "peak_memory_gb": metrics["peak_memory_gb"],
        "heldout_ctr_auc": final.get("ctr_auc"),
        "heldout_cvr_auc": final.get("cvr_auc"),
        "heldout_loss": final.get("loss"),
        "train_loss_last": hist["loss"][-1],
        "step_cost_cv": bbs.get("step_cost_cv"),
        "timed_step_s": times,
        "row_wall_s": wall,
    }


def _row_main(spec_json: str, result: str) -> int:
    spec = json.loads(spec_json)
    try:
        out = {"status": "ok", **run_row(spec)}
    except Exception as err:  # recorded in the table; the parent carries on
        import torch

        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        out = {
            "status": "oom" if oom else "error",
            "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(result).write_text(json.dumps(out))
    return 0


# -- the parent ----------------------------------------------------------------------------------
def _available(preset_name: str, overrides: list[str]) -> str | None:
    """None if the overrides make a valid config, else why not (e.g. "not available yet")."""
    from hyperrec.integration import get_preset, override

    try:
        override(get_preset(preset_name), overrides)
    except ValueError as err:
        return str(err)
    return None


def _launch(spec: dict[str, Any], timeout: float, in_process: bool) -> dict[str, Any]:
    if in_process:
        try:
            return {"status": "ok", **run_row(spec)}
        except Exception as err:
            return {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000]}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_row", json.dumps(spec)]
        cmd += ["--_result", str(result)]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"row exceeded its {timeout:.0f} s budget"}
        if result.exists():
            return json.loads(result.read_text())
        return {"status": "error", "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


def _mode_settings(args: argparse.Namespace) -> tuple[str, dict[str, Any], str, str]:
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = dict(MODES[mode])
    device = "cpu" if args.smoke else "cuda"
    preset = args.preset or ("tiny" if args.smoke else "gem")
    return mode, settings, device, preset


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _compose(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """Override lists joined in order, a later value of a field replacing an earlier one
    (``override`` rejects a field assigned twice; rows switch fields earlier rows set)."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            key = item.partition("=")[0].strip()
            out.pop(key, None)
            out[key] = item
    return list(out.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the ablation; returns the result document (also written to ``args.out``)."""
    from hyperrec.testing.bench import machine_info

    mode, settings, device, preset_name = _mode_settings(args)
    if device == "cuda" and not _cuda_available():
        raise SystemExit("the ablation needs a CUDA GPU (use --smoke on a CPU)")
    t_start = time.perf_counter()
    common = [f"data.eval_requests={settings['eval']}", *args.set]
    if args.smoke:
        # CPU: no Inductor build (minutes on a CPU); the graph capture still runs.
        common += ["train.data_workers=1", "train.cpu_threads=1"]
    from hyperrec.integration import get_preset

    preset_batch = get_preset(preset_name).train.global_batch_size
    batch = args.batch or preset_batch
    rows: list[dict[str, Any]] = []
    cumulative: list[str] = []
    naive_rps = None

    def budget_left() -> float:
        return settings["budget"] - (time.perf_counter() - t_start)

    for row in ROWS:
        overrides = _compose(cumulative, row.overrides)
        if args.smoke and row.name == "all":
            overrides = [
                o if o != "train.compile=inductor" else "train.compile=aot_eager" for o in overrides
            ]
        why = _available(preset_name, _compose(common, overrides))
        record: dict[str, Any] = {
            "name": row.name,
            "description": row.description,
            "overrides": overrides,
        }
        if why is not None:
            record.update(status="not available", error=why)
            rows.append(record)
            continue  # the next rows build on the last available configuration
        cumulative = overrides
        if mode == "quick" and row.name not in QUICK_ROWS:
            record.update(status="skipped (--quick)")
            rows.append(record)
            continue
        while True:
            spec = {
                "preset": preset_name,
                "overrides": _compose(common, [f"train.global_batch_size={batch}"], overrides),
                "warmup": settings["warmup"],
                "timed": settings["timed"],
                "device": device,
            }
            timeout = min(settings["row_timeout"], budget_left())
            if timeout < 20:
                record.update(status="skipped (time budget)")
                break
            out = _launch(spec, timeout, in_process=args.smoke)
            # The naive row sets the batch every comparable row uses: halve until it fits.
            if (
                row.name == "naive"
                and out["status"] == "oom"
                and batch > 2 * _sub_batch(preset_name)
            ):
                record.setdefault("oom_at_batch", []).append(batch)
                batch //= 2
                continue
            record.update(out)
            break
        if record.get("status") == "ok":
            if row.name == "naive":
                naive_rps = record["requests_per_s"]
            record["speedup_vs_naive"] = record["requests_per_s"] / naive_rps if naive_rps else None
        print(_row_line(record), flush=True)
        rows.append(record)

    # The full stack at the preset's own batch: the preset's MFU figure.
    if batch != preset_batch and not args.smoke:
        spec = {
            "preset": preset_name,
            "overrides": _compose(common, cumulative),
            "warmup": settings["warmup"],
            "timed": settings["timed"],
            "device": device,
        }
        record = {
            "name": "all @ preset batch",
            "description": f"'all' at the preset's batch of {preset_batch}",
            "overrides": cumulative,
        }
        timeout = min(settings["row_timeout"], budget_left())
        record.update(
            _launch(spec, timeout, False) if timeout >= 20 else {"status": "skipped (time budget)"}
        )
        if record.get("status") == "ok":
            record["speedup_vs_naive"] = None  # a different batch: not comparable
        print(_row_line(record), flush=True)
        rows.append(record)

    doc = {
        "benchmark": "integration ablation",
        "machine": machine_info(),
        "mode": mode,
        "preset": preset_name,
        "device": device,
        "global_batch_size": batch,
        "preset_batch_size": preset_batch,
        "warmup_steps": settings["warmup"],
        "timed_steps": settings["timed"],
        "eval_requests": settings["eval"],
        "extra_overrides": list(args.set),
        "peak_tflops": next((r.get("peak_tflops") for r in rows if r.get("peak_tflops")), None),
        "measured_matmul_tflops": next((r.get("measured_matmul_tflops") for r in rows if r.get("measured_matmul_tflops")), None),
        "rows": rows,
        "total_wall_s": time.perf_counter() - t_start,
        "notes": [
            "MFU = analytic model FLOPs (matmuls on unpadded tokens, attention over allowed "
            "pairs, training = 3x forward, no recomputation, no padding) / step time / peak.",
            "On one GPU BBS cannot raise throughput (no rank waits for another); its effect "
            "is the step-cost spread (step_cost_cv).",
            "speedup_vs_naive compares requests/s at the same batch, data and steps.",
        ],
    }  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    path = out_dir / f"ablation_{preset_name}_{mode}_{stamp}.json"
    path.write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(doc) + "\n")
    print(markdown(doc))
    print(f"wrote {path} and {path.with_suffix('.md')} in {doc['total_wall_s']:.0f} s")
    return doc


def _sub_batch(preset_name: str) -> int:
    from hyperrec.integration import get_preset

    return get_preset(preset_name).train.sub_batch_size


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _row_line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['name']:<24} {r.get('status')}: {str(r.get('error', ''))[:160]}"
    return (
        f"{r['name']:<24} {r['requests_per_s']:>10,.0f} req/s  MFU {_fmt(r['mfu'], '.1%')}  "
        f"{_fmt(r['tflops_per_gpu'], ',.3g')} TFLOP/s  peak {_fmt(r['peak_memory_gb'], '.1f')} GB  "
        f"AUC {_fmt(r['heldout_ctr_auc'], '.4f')}  x{_fmt(r.get('speedup_vs_naive'), '.2f')}"
    )


def markdown(doc: dict[str, Any]) -> str:
    """The ablation table of a result document, as markdown."""
    m = doc.get("machine", {})
    lines = [
        f"Ablation, `{doc['preset']}` preset, {doc['mode']} mode, batch {doc['global_batch_size']}, "
        f"{doc['timed_steps']} timed steps after {doc['warmup_steps']} warm-up; "
        f"{m.get('gpu') or m.get('cpu')}, torch {m.get('torch')}, triton {m.get('triton')}, {m.get('date')}. "
        f"Peak {_fmt(doc.get('peak_tflops'), ',.1f')} TFLOP/s (datasheet dense BF16), "
        f"measured BF16 GEMM {_fmt(doc.get('measured_matmul_tflops'), ',.0f')} TFLOP/s.",
        "",
        "| configuration | requests/s | speedup vs naive | MFU | model TFLOP/s | peak memory (GB) | held-out CTR AUC | step-cost CV |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["rows"]:
        if r.get("status") != "ok":
            status = r.get("status", "?")
            lines.append(f"| {r['name']} | {status} | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['requests_per_s']:,.0f} | {_fmt(r.get('speedup_vs_naive'), '.2f')}x "
            f"| {_fmt(r['mfu'], '.1%')} | {_fmt(r['tflops_per_gpu'], ',.4g')} "
            f"| {_fmt(r['peak_memory_gb'], '.1f')} | {_fmt(r['heldout_ctr_auc'], '.4f')} "
            f"| {_fmt(r.get('step_cost_cv'), '.3f')} |"
        )  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(RESULTS), help=f"result directory (default {RESULTS})")
    p.add_argument("--quick", action="store_true", help="fewer steps and rows, <= 4 minutes")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, < 1 minute")
    p.add_argument("--preset", help="default: gem (smoke: tiny)")
    p.add_argument(
        "--batch", type=int, help="global batch of the comparable rows (default: the preset's)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="extra overrides for every row",
    )
    p.add_argument(
        "--print", metavar="JSON", help="print the markdown table of a result file and exit"
    )
    p.add_argument("--_row", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._row is not None:
        return _row_main(args._row, args._result)
    if args.print:
        print(markdown(json.loads(Path(args.print).read_text())))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
