"""Ablation of the GEM-style model's training speed on one GPU, in the GEM paper's style.

    python integration/bench/ablation.py --out integration/results           # one H200, <= 10 min
    python integration/bench/ablation.py --out integration/results \
        --resume integration/results/ablation_gem_full_<date>.json             # the rows left out
    python integration/bench/ablation.py --out integration/results --quick   # <= 5 min
    python integration/bench/ablation.py --out /tmp/ablation --smoke         # CPU, < 1 min
    python integration/bench/ablation.py --print integration/results/<file>.json

Rows, each adding one technique to the previous row's configuration (same preset, data,
initial parameters, batch and number of steps):

    naive                   padded PyTorch attention (SDPA; HSTU SiLU attention on padded
                            tensors), arrival-order batches, PyTorch FSDP2 on a flat mesh,
                            nn.Linear in bf16, dense tables with AdamW, no checkpointing
    + jagged kernels        hyperrec.jagged_attn on unpadded tokens (validation moved to
                            data loading: no host sync in the step)
    + BBS                   Base Batch Shuffling (window of 8 steps)
    + MXFP8 MLPs            hyperrec.mxfp8.MXLinear on the interaction MLP's wide layers
    + hyperrec fully_shard  hyperrec.parallel5d's zero-copy fully_shard on its 5-D mesh
    + autoac                hyperrec.autoac per sequence layer, budget: this GPU's memory
    + FP8 attention         hyperrec.jagged_attn precision="fp8" on the sequence tower (FP8
                            forward, bf16 backward); "all" sets it back to bf16 because it
                            measured slower than bf16 on the H200 (see the package README)
    + sharded embeddings    parallel5d's ShardedEmbeddingCollection + row-wise Adagrad
    all                     every available technique plus the step engineering: one fused
                            embedding lookup, torch.compile'd small-op regions, fused AdamW
    all @ preset batch      "all" at the preset's own batch (the MFU figure of the preset)
    all @ 3x preset batch   (full mode) "all" at three times that batch: autoac keeps the
                            step within the GPU's memory by recomputing what does not fit

Each row's overrides are the previous row's plus its own, composed last-wins
(:func:`compose`: a field set again takes its new value), so a row may switch back a
field an earlier row set.

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
and ``speedup_vs_naive``. The held-out evaluation is the same for every row: the same
requests, scored by the jagged attention kernels (the naive row's model is switched to
them after training; both paths compute the same function with the same parameters,
tested), so the naive row does not spend minutes padding 8k-token histories for
evaluation. The naive row's padded attention work is estimated before it runs
(:func:`naive_estimate`) and recorded with it. Writes
``ablation_<preset>_<mode>_<date>.json`` and a markdown table next to it into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from _common import JitLog, jsonable, single_rank_group  # noqa: E402

RESULTS = _HERE.parent / "results"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    description: str
    overrides: tuple[str, ...]
    """Composed over the previous row's overrides, last wins (see :func:`compose`)."""


ROWS = (
    Row(
        "naive",
        "padded SDPA / padded HSTU attention, arrival order, FSDP2, bf16 nn.Linear, dense tables",
        (
            "train.impl=naive",
            "train.window_steps=1",
            "train.sharding=fsdp2",
            "train.mlp_precision=bf16",
            "train.fused_embeddings=false",
            "train.compile=off",
            "train.optimizer_impl=foreach",
            "train.mesh=flat",
            "train.sparse=dense",
            "train.embedding_optimizer=auto",
            "train.activation_checkpointing=off",
            "train.row_buckets=0",
            # autocast's layer norms return float32, so a plain model's residual is float32
            "train.residual_dtype=float32",
        ),
    ),
    Row("+ jagged kernels", "hyperrec.jagged_attn on unpadded tokens", ("train.impl=hyperrec",)),
    Row("+ BBS", "Base Batch Shuffling, window of 8 steps", ("train.window_steps=8",)),
    Row("+ MXFP8 MLPs", "MXLinear (128-blocks) on the wide MLP layers", ("train.mlp_precision=mxfp8",)),
    Row("+ hyperrec fully_shard", "zero-copy fully_shard on the 5-D mesh instead of FSDP2", ("train.sharding=hyperrec", "train.mesh=5d")),
    Row("+ autoac", "per-layer activation checkpointing planned within the GPU's memory", ("train.activation_checkpointing=autoac",)),
    Row("+ FP8 attention", "FP8 jagged attention kernels", ("train.attention_precision=fp8",)),
    # LazyAdam, not the trainer's default row-wise Adagrad: at equal steps on the CPU
    # (tiny, 500 steps) "all" with row-wise Adagrad on the tables was 0.009-0.013 CTR AUC
    # below the naive row's AdamW (0.003-0.010 with embedding_lr 0.1); with LazyAdam
    # -0.0007 to +0.0025 (results/ablation_quality_tiny*_2026-12-02.json): equal quality.
    Row("+ sharded embeddings", "ShardedEmbeddingCollection + lazy Adam on the big tables", ("train.sparse=sharded", "train.embedding_optimizer=adam")),
    Row(
        "all",
        "every available technique that is faster + fused lookup, compiled small ops, fused AdamW, bucketed row counts, bf16 residual",
        (
            "train.fused_embeddings=true",
            "train.compile=inductor",
            "train.optimizer_impl=fused",
            "train.attention_precision=bf16",
            "train.row_buckets=64",
            "train.residual_dtype=autocast",
        ),
    ),
)  # fmt: skip

MODES = {
    # warm-up steps (compilation, caches), timed steps, held-out requests, time budget (s),
    # the per-row limit (the naive row's grows with its estimated step time)
    # full: 5 warm-up steps since 2026-12-02 (3 before): a row once met a 4 s stall in
    # its second timed step that 3 warm-up steps had not covered
    "full": {"warmup": 5, "timed": 5, "eval": 1024, "budget": 570.0, "row_timeout": 200.0},
    "quick": {"warmup": 2, "timed": 3, "eval": 512, "budget": 285.0, "row_timeout": 150.0},
    # Smoke mode exists to run every row (a CPU check that each combination trains), so
    # its budget only guards against a hung row: the FP8 rows run Triton's interpreter
    # on the CPU and a loaded 2-core machine took 35 s for the rows before 'all'.
    "smoke": {"warmup": 1, "timed": 2, "eval": 128, "budget": 240.0, "row_timeout": 90.0},
}
QUICK_ROWS = ("naive", "+ jagged kernels", "all")
BIG_BATCH_FACTOR = 3
"""The full mode's last row trains "all" at this multiple of the preset's batch."""

# What the naive row's time limit assumes (an estimate to size the limit, not a claim):
_NAIVE_GEMM_TFLOPS = 350.0  # chunked padded bf16 GEMMs: ~35% of an H200's dense peak
_NAIVE_BYTES_PER_SCORE = 32.0  # elementwise traffic per padded score element and layer
_NAIVE_COPY_GBPS = 3000.0
# The estimate above against the measured naive row: on an H200 (2026-12-02, `gem`, batch
# 64, results/ablation_gem_full_syncfix_2026-12-02.json) 10 steps trained in 149 s for an
# estimate of 18 s (steps of 4.4-17.5 s at 117 GB, near the GPU's memory). The row's time
# limit and the choice of its batch use the estimate times this factor.
_NAIVE_MEASURED_OVER_ESTIMATE = 8.0
_NAIVE_SHARE_OF_BUDGET = 0.45
"""The naive row may take at most this share of an invocation's budget: above it, its
(and so every comparable row's) batch is halved before launching, as after an OOM."""
_ROW_STARTUP_S = 60.0  # process, model build, loader workers, first-step kernels


def compose(*override_lists: list[str] | tuple[str, ...]) -> list[str]:
    """Join ``"section.field=value"`` lists, later ones winning: a field assigned again
    takes its new value (``override`` itself refuses a field assigned twice in one
    list, so the cumulative rows must be composed, not concatenated). Order: each field
    where it was last assigned."""
    out: dict[str, str] = {}
    for items in override_lists:
        for item in items:
            key = item.partition("=")[0].strip()
            out.pop(key, None)
            out[key] = item
    return list(out.values())


def without_inductor(overrides: list[str]) -> list[str]:
    """``overrides`` for a CPU run: ``aot_eager`` instead of an Inductor build (minutes on
    a CPU; the same graphs are traced and the numerics are eager's)."""
    if "train.compile=inductor" in overrides:
        return compose(overrides, ["train.compile=aot_eager"])
    return list(overrides)


def row_configs(
    preset_name: str, common: list[str] | tuple[str, ...] = ()
) -> list[tuple[Row, list[str], str | None]]:
    """Each row with its composed overrides and ``None``, or why it is not available.

    A row that is not available is recorded with the overrides it would have had, and
    the next row builds on the last available one. ``common`` (eval size, CPU settings,
    ``--set``) is composed last into every row's check.
    """
    cumulative: list[str] = []
    out = []
    for row in ROWS:
        overrides = compose(cumulative, row.overrides)
        why = _available(preset_name, compose(overrides, common))
        if why is None:
            cumulative = overrides
        out.append((row, overrides, why))
    return out


def naive_estimate(preset: Any, batch: int, steps: int) -> dict[str, Any]:
    """The naive row's padded attention work for its first ``steps`` steps at ``batch``
    (one rank, arrival order: step ``s`` holds requests ``[s B, (s + 1) B)``), from the
    data's length law alone, and a rough time per step (see the assumptions above)."""
    import numpy as np

    from hyperrec.integration import TRAIN, SyntheticRecsysData
    from hyperrec.integration.flops import model_flops
    from hyperrec.integration.naive import padded_attention_work

    data, m = SyntheticRecsysData(preset.data), preset.model
    cands = np.full(batch, (1 + preset.data.max_candidates) / 2)
    per_step = []
    for s in range(steps):
        lens = data.history_lengths(TRAIN, np.arange(s * batch, (s + 1) * batch))
        work = padded_attention_work(
            lens,
            heads=m.heads,
            head_dim=m.head_dim,
            full_layers=m.seq_layers - m.block_attention_layers,
            block_layers=m.block_attention_layers,
            block_size=m.attn_block_size,
            pma_queries=m.pma_queries,
            max_candidates=preset.data.max_candidates,
        )
        useful = model_flops(m, preset.data, lens, cands)
        attention = sum(useful.training.get(k, 0.0) for k in ("attention_full", "attention_block"))
        naive_flop = useful.total_training - attention + work["hstu"] + work["softmax"]
        traffic = work["hstu_score_elements"] * (m.seq_layers - m.block_attention_layers)
        seconds = naive_flop / (_NAIVE_GEMM_TFLOPS * 1e12) + traffic * _NAIVE_BYTES_PER_SCORE / (
            _NAIVE_COPY_GBPS * 1e9
        )
        per_step.append(
            {
                "max_len": int(work["max_len"]),
                "useful_tflop": useful.total_training / 1e12,
                "padded_hstu_tflop": work["hstu"] / 1e12,
                "padded_softmax_tflop": work["softmax"] / 1e12,
                "naive_tflop": naive_flop / 1e12,
                "estimated_s": seconds,
            }
        )
    return {
        "batch": batch,
        "steps": per_step,
        "estimated_s_total": sum(p["estimated_s"] for p in per_step),
        "expected_s_total": _NAIVE_MEASURED_OVER_ESTIMATE * sum(p["estimated_s"] for p in per_step),
        "assumptions": f"GEMMs at {_NAIVE_GEMM_TFLOPS:.0f} TFLOP/s; {_NAIVE_BYTES_PER_SCORE:.0f} "
        f"bytes of elementwise traffic per padded HSTU score element and layer at "
        f"{_NAIVE_COPY_GBPS:.0f} GB/s; training = forward + recomputed scores + backward; "
        f"expected = {_NAIVE_MEASURED_OVER_ESTIMATE:g}x the estimate (measured on an H200)",
    }


# -- one row (runs in its own process on the GPU) --------------------------------------------
def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


@contextlib.contextmanager
def _own_group(device: str) -> Iterator[None]:
    """A one-rank process group for the row, destroyed afterwards if the row created it
    (smoke rows run in the caller's process, e.g. a test's)."""
    import torch.distributed as dist

    created = single_rank_group(device)
    try:
        yield
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _train_row(spec: dict[str, Any], batch: int) -> dict[str, Any]:
    import torch

    from hyperrec.integration import Trainer, get_preset, override

    device = spec["device"]
    n = spec["warmup"] + spec["timed"]
    # One step more than trained: stop_after=n then counts as interrupted, so fit skips
    # its own evaluation and the row evaluates below with the same code for every row.
    run = [f"train.steps={n + 1}", "train.warmup_steps=1", "train.eval_every=0",
           "train.ckpt_every=0", "train.log_every=1", f"train.global_batch_size={batch}",
           # Rows compare the model's configurations; the trainer's logistic-regression
           # baseline is the same in every row and would only spend the row's budget.
           "train.baseline_requests=0"]  # fmt: skip
    preset = override(get_preset(spec["preset"]), compose(spec["overrides"], run))
    with tempfile.TemporaryDirectory() as tmp, _own_group(device):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        jit = JitLog()
        start = time.perf_counter()
        trainer = Trainer(preset, out_dir=Path(tmp) / "run", device=device, progress=False)
        launches: list[float] = []  # when fit queued each step
        launch_step = trainer.launch_step

        def timed_launch(*args: Any, **kwargs: Any) -> Any:
            launches.append(time.perf_counter())
            return launch_step(*args, **kwargs)

        trainer.launch_step = timed_launch  # type: ignore[method-assign]
        try:
            build_s = time.perf_counter() - start
            metrics = trainer.fit(stop_after=n, plot=False).metrics
            trained = time.perf_counter()
            trained_s = trained - start
            # The same held-out evaluation for every row: jagged kernels (the naive path
            # computes the same function; padding 8k histories would take minutes).
            trainer.model.set_impl("hyperrec")
            final = trainer.evaluate()
            peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
            autoac_plan = trainer.autoac_summary()
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
    bbs = metrics["bbs"].get("balanced", {})
    return {
        "global_batch_size": batch,
        "requests_per_s": batch * len(times) / seconds,
        # the mean of the two middle steps for an even count (smoke mode times 2 steps)
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "tflops_per_gpu": per_gpu,
        "mfu": per_gpu / mfu["peak_tflops"] if per_gpu and mfu["peak_tflops"] else None,
        "fraction_of_measured_matmul": per_gpu / mfu["measured_matmul_tflops"]
        if per_gpu and mfu["measured_matmul_tflops"]
        else None,
        "peak_tflops": mfu["peak_tflops"],
        "measured_matmul_tflops": mfu["measured_matmul_tflops"],
        "peak_memory_gb": peak,
        "peak_memory_gb_training": metrics["peak_memory_gb"],
        "heldout_ctr_auc": final.get("ctr_auc"),
        "heldout_cvr_auc": final.get("cvr_auc"),
        "heldout_loss": final.get("loss"),
        "train_loss_last": hist["loss"][-1],
        "step_cost_cv": bbs.get("step_cost_cv"),
        "timed_step_s": times,
        "timed_step_tflop": tflop,
        # Triton kernels first compiled (or loaded from disk) while a timed step was queued
        # or ran, before training returned (the evaluation after it is not counted): a
        # one-off stall inside the timed window (None: no JIT hooks)
        "triton_jit_in_timed_steps": (
            jit.per_step(launches[w:], trained) if jit.available else None
        ),
        # what autoac chose per layer (and its added time): explains a row it slows down
        "autoac": autoac_plan,
        "build_s": build_s,
        "train_s": trained_s,
        "row_wall_s": wall,
    }


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration and measure it. ``spec``: preset, overrides, batch,
    warmup, timed, device and, for the naive row, ``halve_on_oom`` / ``min_batch``: on
    an out-of-memory error the batch is halved in this process (no new start-up) until
    it fits. Returns the row's measurements (raises on any other failure)."""
    import gc

    import torch

    batch, ooms = spec["batch"], []
    while True:
        result = None
        try:
            result = _train_row(spec, batch)
        except Exception as err:
            if not (spec.get("halve_on_oom") and _is_oom(err) and batch // 2 >= spec["min_batch"]):
                raise
        if result is not None:
            return {**result, "oom_at_batch": ooms}
        # Out of the except block: the exception and the frames holding the failed
        # trainer's tensors are gone, so their memory can be returned.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        ooms.append(batch)
        batch //= 2


def _row_main(spec_json: str, result: str) -> int:
    spec = json.loads(spec_json)
    try:
        out = {"status": "ok", **run_row(spec)}
    except Exception as err:  # recorded in the table; the parent carries on
        out = {
            "status": "oom" if _is_oom(err) else "error",
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
    from hyperrec.integration.trainer import ALLOCATOR_CONF

    env = dict(os.environ)
    # Fewer fragmentation failures near the memory limit, the same for every row. Set
    # here: the row process starts CUDA before its Trainer could (peak-memory reset).
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_row", json.dumps(spec)]
        cmd += ["--_result", str(result)]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, env=env)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"row exceeded its {timeout:.0f} s budget"}
        if result.exists():
            return json.loads(result.read_text())
        return {"status": "error", "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


def _mode_settings(args: argparse.Namespace) -> tuple[str, dict[str, Any], str, str]:
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = dict(MODES[mode])
    if getattr(args, "budget", None) is not None:
        if args.budget <= 0:
            raise SystemExit(f"--budget must be positive seconds, got {args.budget}")
        settings["budget"] = float(args.budget)
    device = "cpu" if args.smoke else "cuda"
    preset = args.preset or ("tiny" if args.smoke else "gem")
    return mode, settings, device, preset


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the ablation; returns the result document (also written to ``args.out``)."""
    from hyperrec.integration import get_preset
    from hyperrec.testing.bench import machine_info

    mode, settings, device, preset_name = _mode_settings(args)
    if device == "cuda" and not _cuda_available():
        raise SystemExit("the ablation needs a CUDA GPU (use --smoke on a CPU)")
    t_start = time.perf_counter()
    # Every row: the eval size and CPU settings first; --set last, so it wins.
    common = [f"data.eval_requests={settings['eval']}"]
    if args.smoke:
        # CPU: no Inductor build (minutes on a CPU; the graph capture still runs); autoac
        # needs an explicit budget off a GPU.
        common += ["train.data_workers=1", "train.cpu_threads=1", "train.ac_budget_gb=1"]
    common += list(args.set)
    preset = get_preset(preset_name)
    preset_batch = preset.train.global_batch_size
    batch = args.batch or preset_batch
    steps = settings["warmup"] + settings["timed"]
    estimate = naive_estimate(preset, batch, steps)
    batch_note = None
    if args.batch is None and not args.resume:
        # A naive row that cannot finish in its share of the budget leaves the table
        # without its baseline (2026-12-03: `gem` at 128 ran past 200 s): halve first.
        floor = 2 * preset.train.sub_batch_size
        while (batch // 2 >= floor
               and _ROW_STARTUP_S + estimate["expected_s_total"]
               > _NAIVE_SHARE_OF_BUDGET * settings["budget"]):  # fmt: skip
            batch //= 2
            estimate = naive_estimate(preset, batch, steps)
            batch_note = (f"batch halved to {batch} before the naive row: its expected time "
                          f"at the preset's batch exceeds {_NAIVE_SHARE_OF_BUDGET:.0%} of the "
                          "budget")  # fmt: skip
    rows: list[dict[str, Any]] = []
    cumulative: list[str] = []
    naive_rps = None
    # --resume: rows measured by an earlier invocation (same mode, preset and extra
    # overrides) are kept as they are; only the rest run now. One invocation must fit in
    # the budget; a full table on a GPU shared in time slices takes two.
    earlier: dict[str, dict[str, Any]] = {}
    invocations = 1
    if args.resume:
        prev = json.loads(Path(args.resume).read_text())
        for key, want in (
            ("mode", mode),
            ("preset", preset_name),
            ("extra_overrides", list(args.set)),
        ):
            if prev.get(key) != want:
                raise SystemExit(
                    f"--resume: {args.resume} has {key}={prev.get(key)!r}, this run {want!r}"
                )
        earlier = {r["name"]: r for r in prev["rows"] if r.get("status") == "ok"}
        invocations = int(prev.get("invocations", 1)) + 1
        if "naive" in earlier:
            batch = earlier["naive"]["global_batch_size"]
            naive_rps = earlier["naive"]["requests_per_s"]

    def keep_earlier(name: str) -> bool:
        """Take row ``name`` as an earlier invocation measured it, if it did."""
        if name not in earlier:
            return False
        record = {**earlier[name], "from_earlier_invocation": True}
        print(_row_line(record), flush=True)
        rows.append(record)
        return True

    def budget_left() -> float:
        return settings["budget"] - (time.perf_counter() - t_start)

    def spec_for(overrides: list[str], b: int, **extra: Any) -> dict[str, Any]:
        final = compose(overrides, common)
        if args.smoke:
            final = without_inductor(final)
        return {"preset": preset_name, "overrides": final, "batch": b,
                "warmup": settings["warmup"], "timed": settings["timed"], "device": device,
                **extra}  # fmt: skip

    machine = machine_info()

    def save() -> tuple[dict[str, Any], Path]:
        """Write the table so far: a row killed by the time limit loses only itself."""
        doc = {
            "benchmark": "integration ablation",
            "machine": machine,
            "mode": mode,
            "preset": preset_name,
            "device": device,
            "global_batch_size": batch,
            "preset_batch_size": preset_batch,
            "warmup_steps": settings["warmup"],
            "timed_steps": settings["timed"],
            "eval_requests": settings["eval"],
            "batch_note": batch_note,
            "extra_overrides": list(args.set),
            "peak_tflops": next((r.get("peak_tflops") for r in rows if r.get("peak_tflops")), None),
            "measured_matmul_tflops": next((r.get("measured_matmul_tflops") for r in rows if r.get("measured_matmul_tflops")), None),
            "rows": rows,
            "invocations": invocations,
            "total_wall_s": time.perf_counter() - t_start,
            "notes": [
                "MFU = analytic model FLOPs (matmuls on unpadded tokens, attention over allowed "
                "pairs, training = 3x forward, no recomputation, no padding) / step time / peak.",
                "On one GPU BBS cannot raise throughput (no rank waits for another); its effect "
                "is the step-cost spread (step_cost_cv).",
                "speedup_vs_naive compares requests/s at the same batch, data and steps.",
                "Held-out AUC: the same requests and evaluation code (jagged kernels) for every "
                "row; the naive row's model is switched to them after its timed steps.",
                "Rows run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless set.",
            ],
        }  # fmt: skip
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = dt.date.today().isoformat()
        path = out_dir / f"ablation_{preset_name}_{mode}_{stamp}.json"
        path.write_text(json.dumps(jsonable(doc), indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(doc) + "\n")
        return doc, path

    for row, overrides, why in row_configs(preset_name, common):
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
        if keep_earlier(row.name):
            continue
        limit = settings["row_timeout"]
        extra: dict[str, Any] = {}
        if row.name == "naive":
            # The naive row sets the batch of every comparable row: halve until it fits.
            extra = {"halve_on_oom": True, "min_batch": 2 * preset.train.sub_batch_size}
            limit = max(limit, _ROW_STARTUP_S + 1.5 * estimate["expected_s_total"])
        timeout = min(limit, budget_left())
        if timeout < 20:
            record.update(status="skipped (time budget)")
        else:
            record.update(_launch(spec_for(overrides, batch, **extra), timeout, args.smoke))
        if row.name == "naive":
            if record.get("status") == "ok":
                batch = record["global_batch_size"]
                naive_rps = record["requests_per_s"]
            record["naive_estimate"] = naive_estimate(preset, batch, steps)
        if record.get("status") == "ok":
            record["speedup_vs_naive"] = record["requests_per_s"] / naive_rps if naive_rps else None
        print(_row_line(record), flush=True)
        rows.append(record)
        save()

    # The full stack at the preset's own batch (the preset's MFU figure) and, in full
    # mode, at a batch only autoac fits: not comparable with the rows above.
    extra_rows = []
    if batch != preset_batch and not args.smoke:
        extra_rows.append(("all @ preset batch", preset_batch))
    if mode == "full":
        extra_rows.append(
            (f"all @ {BIG_BATCH_FACTOR}x preset batch", BIG_BATCH_FACTOR * preset_batch)
        )
    for name, b in extra_rows:
        record = {
            "name": name,
            "description": f"'all' at a batch of {b} (the preset's is {preset_batch})",
            "overrides": cumulative,
        }
        if keep_earlier(name):
            continue
        timeout = min(settings["row_timeout"], budget_left())
        record.update(
            _launch(spec_for(cumulative, b), timeout, False)
            if timeout >= 20
            else {"status": "skipped (time budget)"}
        )
        if record.get("status") == "ok":
            record["speedup_vs_naive"] = None  # a different batch: not comparable
        print(_row_line(record), flush=True)
        rows.append(record)
        save()

    doc, path = save()
    print(markdown(doc))
    print(f"wrote {path} and {path.with_suffix('.md')} in {doc['total_wall_s']:.0f} s")
    return doc


def _speedup(x: Any) -> str:
    # rows at another batch have none: "n/a", not "n/ax"
    s = _fmt(x, ".2f")
    return s if s == "n/a" else f"{s}x"


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _row_line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['name']:<24} {r.get('status')}: {str(r.get('error', ''))[:160]}"
    late = r.get("triton_jit_in_timed_steps")
    return (
        f"{r['name']:<24} {r['requests_per_s']:>10,.0f} req/s  MFU {_fmt(r['mfu'], '.1%')}  "
        f"{_fmt(r['tflops_per_gpu'], ',.3g')} TFLOP/s  peak {_fmt(r['peak_memory_gb'], '.1f')} GB  "
        f"AUC {_fmt(r['heldout_ctr_auc'], '.4f')}  x{_fmt(r.get('speedup_vs_naive'), '.2f')}"
        + (f"  [{len(late)} Triton kernel(s) compiled in timed steps]" if late else "")
    )


def markdown(doc: dict[str, Any]) -> str:
    """The ablation table of a result document, as markdown."""
    m = doc.get("machine", {})
    lines = [
        f"Ablation, `{doc['preset']}` preset, {doc['mode']} mode, batch {doc['global_batch_size']}, "
        f"{doc['timed_steps']} timed steps after {doc['warmup_steps']} warm-up; "
        f"{m.get('gpu') or m.get('cpu')}, torch {m.get('torch')}, triton {m.get('triton')}, {m.get('date')}. "
        f"Peak {_fmt(doc.get('peak_tflops'), ',.1f')} TFLOP/s (datasheet dense BF16), "
        f"measured BF16 GEMM {_fmt(doc.get('measured_matmul_tflops'), ',.0f')} TFLOP/s."
        + (f" Rows measured in {doc['invocations']} invocations (`--resume`; rows marked * come "
           "from an earlier one, possibly on another machine of the same kind)."
           if doc.get("invocations", 1) > 1 else ""),
        "",
        "| configuration | requests/s | speedup vs naive | MFU | model TFLOP/s | peak memory (GB) | held-out CTR AUC | step-cost CV |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["rows"]:
        if r.get("status") != "ok":
            status = r.get("status", "?")
            lines.append(f"| {r['name']} | {status} | | | | | | |")
            continue
        mark = "*" if r.get("from_earlier_invocation") else ""
        lines.append(
            f"| {r['name']}{mark} | {r['requests_per_s']:,.0f} | {_speedup(r.get('speedup_vs_naive'))} "
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
    p.add_argument("--quick", action="store_true", help="fewer steps and rows, <= 5 minutes")
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
        "--budget",
        type=float,
        help="seconds for this invocation's rows (default: the mode's; rows past it are "
        "recorded as skipped and can be run with --resume)",
    )
    p.add_argument(
        "--resume",
        metavar="JSON",
        help="an earlier result of the same mode: keep its measured rows, run the others",
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
