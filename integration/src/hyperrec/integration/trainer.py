"""The training loop: data -> model -> ESMM loss -> AdamW, with eval, checkpoints, metrics.

Data comes from any :class:`~hyperrec.integration.data.DataSource`: the one
``preset.data`` describes (the synthetic generator, or an event log prepared from CSV /
Parquet files) or one given as ``Trainer(preset, data=...)``. The model is built from
the source's schema. A finite source is trained for ``TrainConfig.epochs`` passes;
the validation split is scored every ``eval_every`` steps (early stopping watches it)
and the test split once, at the end, with the popularity and logistic-regression
baselines (and the ground truth where the source has one) on the same requests.

One :class:`Trainer` per process. With several ranks (``torchrun`` or an existing
process group) each rank reads its own requests (no data exchange), the model is
sharded by :func:`~hyperrec.integration.distributed.parallelize`, and the loss is
normalised by the *global* number of impressions of the step (one all-reduce), so a
run computes the same gradients on any world size for the same global batch.

The step reads no device value on the host: a :class:`~hyperrec.integration.loader.StepLoader`
builds, validates and copies batches ahead, :meth:`Trainer.launch_step` queues the device
work and :meth:`Trainer.finish_step` reads the step's loss, gradient norm and model FLOPs
(for MFU) after the next step is queued. The non-finite policy fits that pipeline:
``nonfinite="stop"`` is checked when the values are read, one step later, from
per-parameter flags recorded during the step; ``"skip"`` must decide before the update
and so reads the loss and gradient norm once per step (a host synchronisation).

Optimizers: AdamW for the dense parameters, in groups: dense embedding tables (their
own, higher learning rate; no weight decay, which would shrink the rows of rare items
whenever any row is touched), matrices (weight decay) and vectors (norms, biases; no
decay). The item, category, user and tag tables are either dense parameters (AdamW's
table group, or ``torch.optim.Adagrad``) or, with ``TrainConfig.sparse="sharded"``, a
``hyperrec.parallel5d.ShardedEmbeddingCollection`` trained by a lazy row optimizer
(row-wise Adagrad by default) on the rows' owners: no dense gradient, ``O(T / world)``
memory (:func:`build_table_optimizer`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist

from hyperrec.bbs import ImbalanceStats
from hyperrec.integration._version import __version__
from hyperrec.integration.baseline import LogisticRegressionBaseline, PopularityBaseline
from hyperrec.integration.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    read_meta,
    save_checkpoint,
    verify_checkpoint,
)
from hyperrec.integration.config import (
    DENSE_TABLE_OPTIMIZERS,
    EARLY_STOPPING_METRICS,
    SHARDED_TABLE_OPTIMIZERS,
    DataConfig,
    EventLogConfig,
    Preset,
    TrainConfig,
    check_model_fits,
)
from hyperrec.integration.data import SPLITS, TEST, TRAIN, VALID, DataSource, SyntheticRecsysData
from hyperrec.integration.distributed import (
    DistributedContext,
    build_mesh,
    init_distributed,
    parallelize,
)
from hyperrec.integration.faults import (
    FAULT_ENV,
    FaultInjector,
    ForwardOrder,
    NonFiniteError,
    NonFiniteReport,
    check_fault_modules,
    nonfinite_report,
    parse_faults,
)
from hyperrec.integration.flops import (
    FlopCount,
    StepShape,
    measure_matmul_tflops,
    model_flops,
    peak_tflops,
)
from hyperrec.integration.loader import LoadedStep, StepLoader, validate_batch
from hyperrec.integration.metrics import WindowedAUC, task_metrics
from hyperrec.integration.model import GEMModel, compile_kwargs, esmm_loss, sharded_tables
from hyperrec.integration.pipeline import (
    RequestOrder,
    TrainStream,
    default_cost_model,
    permute,
    reshard_streams,
)
from hyperrec.integration.progress import ProgressBar

__all__ = [
    "ALLOCATOR_CONF",
    "PendingStep",
    "RunResult",
    "StepRecord",
    "Trainer",
    "backward_and_update",
    "build_optimizer",
    "build_table_optimizer",
    "lr_factor",
    "prefer_expandable_segments",
    "resolve_tables",
    "task_loss",
]

_EVAL_CHUNK = 1024  # requests per eval forward
_EVAL_PADDED_TOKENS = 1 << 21  # ... and at most this many requests x history cap
# A CTR logit spread (standard deviation over a split's impressions) below this means the
# model predicts one value for everything: it collapsed (or never left its start), and
# its ~0.5 AUC is not "needs more steps". A model at initialisation spreads its logits by
# ~1e-2 and more; a trained one by ~0.5.
COLLAPSED_LOGIT_STD = 1e-3
_EMA_BETA = 0.95
# Fields a resumed run may change: how long and how often, not what is trained.
_CADENCE = {
    "steps",
    "epochs",
    "eval_every",
    "ckpt_every",
    "log_every",
    "early_stopping_patience",
    "early_stopping_metric",
    "nonfinite",
    "baseline_requests",
    # How batches are built, not which: the loader delivers the same batches either way.
    "data_workers",
    "prefetch_batches",
    # Padding rows that no real row reads: the same function, but the padded GEMMs
    # sum in another order (outputs and gradients equal to rounding, not bit for bit).
    "row_buckets",
}
_DATA_EXEMPT = {"path", "cache_dir", "reader", "valid_requests"}
_HISTORY_KEYS = (
    "step",
    "loss",
    "loss_ema",
    "ctr_loss",
    "ctr_auc",
    "lr",
    "grad_norm",
    "samples_per_s",
    "step_time_s",
    "cost_max_over_mean",
    "arrival_cost_max_over_mean",
    "step_tflop",
    "tflops_per_gpu",
    "mfu",
    "gpu_gap_s",
    "gpu_dry_at_launch",
    "skipped",
)


@dataclass(frozen=True)
class StepRecord:
    """What one rank did in one step (given to the ``on_step`` callback)."""

    step: int
    """1-based step number."""
    loss: float
    """Global mean loss of the step (identical on every rank)."""
    sample_ids: torch.Tensor
    """int64 [B]: the training requests this rank trained on."""
    sub_batches: tuple[int, ...]
    """The global reader sub-batches they came from."""
    skipped: bool = False
    """True when the step's update was dropped (non-finite, ``nonfinite="skip"``)."""


@dataclass(frozen=True)
class RunResult:
    """Outcome of :meth:`Trainer.fit`."""

    out_dir: Path
    """The run directory."""
    metrics: dict[str, Any]
    """The metrics written to ``metrics.json`` (empty on ranks other than 0)."""
    metrics_path: Path | None
    """``<out_dir>/metrics.json`` (rank 0), else None."""
    plot_path: Path | None
    """``<out_dir>/metrics.png`` (rank 0, unless plotting was off), else None."""
    last_checkpoint: Path | None
    """The newest checkpoint written by this run, if any."""
    interrupted: bool
    """True when ``stop_after`` ended the run before ``TrainConfig.steps``."""
    stopped_early: bool = False
    """True when early stopping ended the run."""


@dataclass
class PendingStep:
    """A step whose device work is queued and whose metrics are not read yet
    (:meth:`Trainer.launch_step` -> :meth:`Trainer.finish_step`)."""

    step: int
    loaded: LoadedStep
    flops: FlopCount
    # float64, host (pinned on CUDA): [(n,) ctr sum, ctcvr sum (global), gradient norm,
    # this rank's own loss sum, then 1.0 per parameter whose local gradient is non-finite]
    readout: torch.Tensor
    preds: torch.Tensor  # float32 [C] P(click), host
    rank_costs: torch.Tensor | list[list[float]]  # per rank: cost, arrival cost, FLOPs
    n_local: int
    param_names: list[str]  # the parameters the readout's flags refer to, in order
    skipped: bool  # the update was dropped (nonfinite="skip", decided in launch_step)
    start: Any  # CUDA event, or host time
    end: Any  # CUDA event, or host time
    previous_end: Any  # the previous step's end event when steps ran back to back
    # CUDA: whether the GPU had already finished the previous step when the host began
    # queuing this one (it then waited for the host); None on a CPU or for a first step
    gpu_dry_at_launch: bool | None = None
    # The step's learning rate (the "matrices" group's), taken at launch: by the time the
    # step is finished the next one may have set the optimizer's to its own
    lr: float = math.nan


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of device tensor ``t`` into pinned host memory."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier at 1-based ``step``: linear warm-up, cosine to 0.1."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _local_grad(g: torch.Tensor) -> tuple[torch.Tensor, Any, int] | None:
    """``(local shard, mesh, replicated copies)`` of a DTensor gradient without a
    ``Partial`` placement (its norm is then local work plus one sum over the mesh); None
    for anything else."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(g, DTensor) or any(pl.is_partial() for pl in g.placements):
        return None
    mesh = g.device_mesh
    copies = math.prod(
        mesh.size(a) for a, pl in enumerate(g.placements) if isinstance(pl, Replicate)
    )
    return g.to_local(), mesh, copies


def _grad_norms(
    params: Sequence[torch.Tensor], *, local_flags: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global L2 norm of the gradients of ``params``, bool [P]: whether each parameter's
    gradient, all of it over every rank, holds a NaN or Inf; with ``local_flags``, whether
    this rank's own part of it does).

    Both stay on the device: nothing is read on the host. The total equals
    ``torch.nn.utils.get_total_norm`` (a plain tensor also for DTensor gradients). It is
    computed on the local tensors: one ``_foreach_norm`` per (device, dtype) and, for
    DTensor gradients, one all-reduce of the per-parameter squared norms per mesh axis
    of more than one rank (replicated copies counted once). A norm per DTensor through
    DTensor dispatch costs the host ~1 ms each, which made the step host-bound. The
    per-parameter norms give the flags for free, so a non-finite step can name its first
    bad module after the gradients are gone (:meth:`Trainer.finish_step`); that report
    names the ranks holding the bad values, hence ``local_flags`` (a gradient with a
    ``Partial`` placement is flagged from its global norm, the only one computed).
    """
    grads: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            raise ValueError("params must all have a gradient, got one whose grad is None")
        grads.append(p.grad)
    if not grads:
        return torch.zeros(()), torch.zeros(0, dtype=torch.bool)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    squares: list[Any] = [None] * len(grads)
    local_squares: list[Any] = [None] * len(grads)  # this rank's part, before any all-reduce
    # (id of the mesh or 0, device, dtype, replicated copies) -> indices.
    groups: dict[tuple[int, torch.device, torch.dtype, int], list[int]] = {}
    locals_: dict[int, torch.Tensor] = {}
    meshes: dict[int, Any] = {}
    for i, g in enumerate(grads):
        copies = 1
        if type(g) is torch.Tensor and g.device.type in ("cpu", "cuda"):
            locals_[i], key_mesh = g, 0
        else:
            local = _local_grad(g)
            if local is None or local[0].device.type not in ("cpu", "cuda"):
                # Partial placements, meta tensors, subclasses: one norm each, as
                # get_total_norm does.
                n = torch.linalg.vector_norm(g)
                n = n.full_tensor() if hasattr(n, "full_tensor") else n
                squares[i] = local_squares[i] = n.to(acc).square()
                continue
            locals_[i], mesh, copies = local
            key_mesh = id(mesh)
            meshes[key_mesh] = mesh
        groups.setdefault((key_mesh, locals_[i].device, locals_[i].dtype, copies), []).append(i)
    by_mesh: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
    for (key_mesh, _, _, copies), idx in groups.items():
        sq = torch.stack(torch._foreach_norm([locals_[i] for i in idx], dtype=acc)).square()
        # Each replica adds its copy's share: the sum over the mesh counts it once.
        by_mesh.setdefault(key_mesh, []).append((idx, sq / copies if copies > 1 else sq))
    for key_mesh, parts in by_mesh.items():
        idx = [i for part_idx, _ in parts for i in part_idx]
        sq = torch.cat([t for _, t in parts])
        if local_flags:
            mine = sq.clone()  # the all-reduce below is in place
            for i, v in zip(idx, mine.unbind()):
                local_squares[i] = v
        if key_mesh:
            mesh = meshes[key_mesh]
            for axis in range(mesh.ndim):
                if mesh.size(axis) > 1:
                    dist.all_reduce(sq, group=mesh.get_group(axis))
        for i, v in zip(idx, sq.unbind()):
            squares[i] = v
    per_param = torch.stack(squares)
    flagged = torch.stack(local_squares) if local_flags else per_param
    return per_param.sum().sqrt(), ~torch.isfinite(flagged)


def _clip_grads_(params: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` on the local tensors of DTensor gradients
    (one ``_foreach_mul_`` per device and dtype, no DTensor dispatch per parameter)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    rest: list[torch.Tensor] = []
    for p in params:
        g = cast(torch.Tensor, p.grad)
        if type(g) is torch.Tensor:
            t: torch.Tensor | None = g
        else:
            local = _local_grad(g)
            t = None if local is None else local[0]
        if t is None or t.device.type not in ("cpu", "cuda"):
            rest.append(p)
            continue
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), ts in groups.items():
        torch._foreach_mul_(ts, coef.to(device))
    if rest:
        torch.nn.utils.clip_grads_with_norm_(rest, max_norm, total)


def backward_and_update(
    loss: torch.Tensor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
    extra: tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer] = (),
) -> torch.Tensor:
    """``loss.backward()``, global gradient-norm clipping (0: measure only), the optimizer
    steps (``optimizer`` and every ``extra`` one, e.g. the tables') and ``zero_grad``.
    Returns the pre-clipping gradient norm of the model's parameters as a device scalar:
    no value is read on the host (the steady-state step must not synchronise). Sharded
    tables are not parameters: their row gradients are neither measured nor clipped. The
    trainer runs the same sequence with its fault hooks and non-finite policy in between."""
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm, _ = _grad_norms(params)
    if grad_clip > 0:
        _clip_grads_(params, grad_clip, grad_norm)
    for opt in (optimizer, *extra):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grad_norm


def resolve_tables(
    cfg: TrainConfig,
    world_size: int,
    device: torch.device,
    *,
    saved: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """``(placement, optimizer)`` of the tables for a run: ``TrainConfig.sparse`` "auto" is
    "sharded" on more than one rank or on a GPU, "dense" on a single CPU process;
    ``embedding_optimizer`` "auto" is "adamw" for dense tables, "rowwise_adagrad" for
    sharded ones. ``saved``: the ``(placement, optimizer)`` of the checkpoint a run
    resumes from; an "auto" field then takes the checkpoint's value (so a run resumes on
    another world size or device with the tables it was trained with).

    Raises:
        ValueError: an optimizer that does not train the resolved placement.
    """
    placement = cfg.sparse
    if placement == "auto":
        if saved is not None:
            placement = saved[0]
        else:
            placement = "sharded" if world_size > 1 or device.type == "cuda" else "dense"
    opt = cfg.embedding_optimizer
    if opt == "auto":
        if saved is not None and saved[0] == placement:
            opt = saved[1]
        else:
            opt = "adamw" if placement == "dense" else "rowwise_adagrad"
    allowed = DENSE_TABLE_OPTIMIZERS if placement == "dense" else SHARDED_TABLE_OPTIMIZERS
    if opt not in allowed:
        raise ValueError(
            f"TrainConfig.embedding_optimizer={opt!r} does not train {placement} tables "
            f"(TrainConfig.sparse={cfg.sparse!r}): choose one of {allowed}"
        )
    return placement, opt


def build_optimizer(
    model: GEMModel, cfg: TrainConfig, *, table_optimizer: str = "adamw"
) -> torch.optim.Optimizer:
    """AdamW with groups for dense embedding tables, decayed matrices and undecayed vectors.

    Call it after :func:`~hyperrec.integration.distributed.parallelize` (sharding
    replaces the parameter objects). Each group's peak rate is kept in ``"base_lr"`` and
    its role in ``"name"`` ("tables", "matrices", "vectors"). The dense tables join
    unless ``table_optimizer="adagrad"`` (then :func:`build_table_optimizer`'s Adagrad
    trains them): with sharded tables under "rowwise_adagrad" or "adam", the action and
    time-bucket tables (a few dense rows) stay in AdamW's table group. Sharded tables are
    never parameters. ``cfg.optimizer_impl="fused"`` uses PyTorch's
    fused AdamW (one kernel per group, no full-size temporaries; it also runs on
    ``hyperrec.parallel5d``'s ragged DTensors, where it equals foreach).
    """
    embedding = {id(p) for p in model.embedding_parameters()}
    emb, decay, no_decay = [], [], []
    for p in model.parameters():
        if id(p) in embedding:
            emb.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "lr": cfg.lr, "base_lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "lr": cfg.lr, "base_lr": cfg.lr, "weight_decay": 0.0},
    ]
    groups[0]["name"], groups[1]["name"] = "matrices", "vectors"
    if table_optimizer != "adagrad" and emb:
        lr = cfg.embedding_lr
        groups.insert(
            0, {"params": emb, "lr": lr, "base_lr": lr, "weight_decay": 0.0, "name": "tables"}
        )
    fused = True if cfg.optimizer_impl == "fused" else None
    return torch.optim.AdamW(groups, betas=(0.9, 0.98), eps=1e-8, fused=fused)


def task_loss(
    ctr_logit: torch.Tensor,
    cvr_logit: torch.Tensor | None,
    click: torch.Tensor,
    conversion: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (CTR, CTCVR) losses: :func:`~hyperrec.integration.model.esmm_loss`, or the
    CTR log-loss and a zero when the model is CTR-only (``cvr_logit`` is None)."""
    if cvr_logit is None:
        ctr = torch.nn.functional.binary_cross_entropy_with_logits(
            ctr_logit, click, reduction="sum"
        )
        return ctr, torch.zeros_like(ctr)
    return esmm_loss(ctr_logit, cvr_logit, click, conversion)


def _check_out_dir(out_dir: str | Path | None) -> None:
    if out_dir is None:
        return
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a path, got {type(out_dir).__name__}")
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out_dir {str(path)!r} exists and is not a directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"out_dir {str(path)!r}: {str(parent)!r} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK) and not path.exists():
                raise ValueError(f"out_dir {str(path)!r}: {str(parent)!r} is not writable")
            break
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {str(path)!r} is not writable")


def _saved_tables(path: Path) -> tuple[str, str]:
    """``(placement, optimizer)`` of the tables of the checkpoint at ``path``, from its
    manifest (no collective); checkpoints without them trained dense tables with AdamW."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        manifest = None  # reported when the checkpoint is loaded
    tables = (manifest or {}).get("info", {}).get("tables") or ("dense", "adamw")
    return (str(tables[0]), str(tables[1]))


def _check_checkpoint_dir(out_dir: Path) -> None:
    """``<out_dir>/checkpoints`` must be a writable directory if it exists (else the first
    save, after ``ckpt_every`` steps of training, fails)."""
    ckpts = out_dir / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():
        raise ValueError(
            f"out_dir {str(out_dir)!r}: {str(ckpts)!r} exists and is not a directory "
            "(checkpoints are written there; TrainConfig.ckpt_every=0 writes none)"
        )
    if ckpts.is_dir() and not os.access(ckpts, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {str(out_dir)!r}: {str(ckpts)!r} is not writable")


def _resume_candidates(resume: str | Path) -> list[Path]:
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(
            f"resume must be a checkpoint or run directory (a path), got {type(resume).__name__}"
        )
    path = Path(resume)
    found = find_checkpoint(path)  # raises FileNotFoundError for a missing path
    if found is None:
        raise ValueError(f"resume={str(resume)!r} holds no complete checkpoint")
    if found == path:
        return [path]  # an explicit checkpoint: no fallback
    return list_checkpoints(path)


def build_table_optimizer(
    model: GEMModel, cfg: TrainConfig, kind: str
) -> tuple[torch.optim.Optimizer | None, torch.optim.Optimizer | None]:
    """``(dense, sharded)`` table optimizers of ``kind`` (see :func:`resolve_tables`).

    ``dense``: ``torch.optim.Adagrad`` over the dense tables when ``kind`` is "adagrad"
    (AdamW's table group trains them otherwise: ``None``). ``sharded``: for the sharded
    collection (``model.sharded``), ``hyperrec.parallel5d``'s ``RowWiseAdagrad``,
    ``LazyAdagrad`` (equal to ``torch.optim.Adagrad`` on the dense gradient) or
    ``LazyAdam``, updating the touched rows on their owners; ``None`` without one.
    Learning rate ``cfg.embedding_lr`` (kept in each group's ``"base_lr"``), no weight
    decay.
    """
    dense: torch.optim.Optimizer | None = None
    sharded: torch.optim.Optimizer | None = None
    lr = cfg.embedding_lr
    tables = model.embedding_parameters()
    if kind == "adagrad" and tables:
        dense = torch.optim.Adagrad([{"params": tables, "lr": lr, "base_lr": lr, "name": "tables"}])
    coll = getattr(model, "sharded", None)
    if coll is not None:
        from hyperrec.parallel5d import LazyAdagrad, LazyAdam, RowWiseAdagrad

        if kind == "rowwise_adagrad":
            sharded = RowWiseAdagrad(coll, lr=lr)
        elif kind == "adagrad":
            sharded = LazyAdagrad(coll, lr=lr)
        elif kind == "adam":
            sharded = LazyAdam(coll, lr=lr, betas=(0.9, 0.98), eps=1e-8)
        else:
            raise ValueError(f"sharded tables take no {kind!r} optimizer")
        for group in sharded.param_groups:
            group["base_lr"] = lr
    return dense, sharded


def _default_out_dir(preset: Preset) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{preset.name}-{stamp}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


ALLOCATOR_CONF = "expandable_segments:True"
"""PyTorch's CUDA caching-allocator setting the trainer asks for (see
:func:`prefer_expandable_segments`)."""

_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments(device: str) -> bool:
    """Ask PyTorch's CUDA caching allocator for expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) before CUDA starts.

    Jagged batches change the sizes of the step's tensors every step. With the
    allocator's fixed-size segments the cache then misses: on one H200 (``gem`` preset,
    batch 128, 8 steps, 2026-12-02) about 20 ``cudaMalloc`` and 23 ``cudaFree`` calls a
    step, and once in 8 steps a flush of the whole cache with a device synchronisation
    (that step took 395 ms against a 228 ms median); with expandable segments 3 and 0,
    no flush, median step 214 ms, same peak. Left alone when the user set
    ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, when ``device`` is not CUDA
    (``"auto"`` counts when a GPU is present), and when CUDA is already initialised in
    this process (the setting is read when CUDA starts; set the variable yourself then).

    Returns:
        Whether it set the variable.
    """
    if any(name in os.environ for name in _ALLOC_ENV):
        return False
    if device not in ("cuda", "auto") and not str(device).startswith("cuda:"):
        return False
    if device == "auto" and not torch.cuda.is_available():
        return False
    if torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_CONF
    return True


def _warn_if_collapsed(record: dict[str, Any], bar: ProgressBar) -> None:
    """Say so when an evaluation's CTR predictions are (nearly) one constant."""
    if record.get("collapsed"):
        bar.write(
            f"warning: the model's CTR predictions on the {record['split']} split are "
            f"constant (logit std {record['ctr_logit_std']:.2e} < {COLLAPSED_LOGIT_STD:g}) "
            f"at step {record['step']}: it has collapsed, and its AUC is chance by "
            f"construction; look at the grad-norm history and the learning rate"
        )


class Trainer:
    """Build everything for ``preset`` and train it.

    Args:
        preset: the run description.
        data: a :class:`~hyperrec.integration.data.DataSource` to train on instead of the
            one ``preset.data`` describes (``preset.data`` is then not used).
        out_dir: run directory (metrics, plot, checkpoints, a prepared event log).
            Default: the directory of the ``resume`` checkpoint's run, else
            ``runs/<preset>-<timestamp>/``.
        resume: a checkpoint, or a run directory to resume from its newest complete
            checkpoint (a corrupt one is reported and the one before it used). Another
            world size is fine: model and optimizer reshard, and the data position
            moves with :func:`~hyperrec.integration.pipeline.reshard_streams`.
        device: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.
        progress: draw the progress bar on stderr (rank 0).
        on_step: called on every rank after every step with a :class:`StepRecord`. With
            a callback, :meth:`fit` finishes each step before launching the next (no
            overlap), so the callback sees the model exactly as its step left it.
        sample_log: append every step's request ids to
            ``<out_dir>/samples/rank<r>.jsonl`` (an audit trail for fault drills).

    On CUDA, before anything starts CUDA, it asks the caching allocator for expandable
    segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (:func:`prefer_expandable_segments`).

    Built from ``preset.train``: the device mesh (``mesh``: ``hyperrec.parallel5d``'s
    5-D mesh on any world size, or a flat axis), where the tables live (``sparse``: a
    sharded collection with a lazy row optimizer, or dense parameters) and autoac's plan
    (``activation_checkpointing="autoac"``: one profiled step of the heaviest of the
    first steps' batches, at construction; a resumed run takes the checkpointed plan).
    Attributes ``mesh``, ``tables`` / ``table_optimizer_kind``, ``optimizer`` (AdamW),
    ``dense_table_optimizer`` / ``sparse_optimizer`` and ``autoac`` expose them.

    Raises:
        ValueError: ``out_dir`` (or, with ``ckpt_every``, its ``checkpoints``) is a file
            or not writable; the global batch does not split over the world size;
            ``resume`` has no complete checkpoint, is past ``TrainConfig.steps`` or was
            trained with another configuration, other data or another table placement;
            a model that does not fit the data's history cap; ``epochs`` with an endless
            source; bad device; a mesh that does not fit the world size; an optimizer
            that does not train the tables' placement; an autoac budget below the step's
            floor (naming the smallest feasible budget), or none on a CPU; a
            ``HYPERREC_FAULT`` that is malformed or whose ``nan_grad`` names a module
            without parameters.
        TypeError: ``data`` is not a DataSource; ``out_dir`` or ``resume`` not a path.
        FileNotFoundError: ``resume`` or the event log does not exist.
        CheckpointError: ``resume`` names a corrupt checkpoint.
    """

    def __init__(
        self,
        preset: Preset,
        *,
        data: DataSource | None = None,
        out_dir: str | Path | None = None,
        resume: str | Path | None = None,
        device: str = "auto",
        progress: bool = True,
        on_step: Callable[[StepRecord], None] | None = None,
        sample_log: bool = False,
    ):
        if not isinstance(preset, Preset):
            raise TypeError(f"preset must be a Preset, got {type(preset).__name__}")
        if data is not None and not isinstance(data, DataSource):
            raise TypeError(
                f"data must implement the DataSource protocol (schema, num_requests, "
                f"history_lengths, batch, truth, state_dict, load_state_dict), got "
                f"{type(data).__name__}"
            )
        # Everything that can be checked without work is checked before any.
        _check_out_dir(out_dir)
        candidates = _resume_candidates(resume) if resume is not None else []
        self._created = time.perf_counter()
        cfg = preset.train
        if cfg.ckpt_every and (out_dir is not None or candidates):
            _check_checkpoint_dir(
                Path(out_dir) if out_dir is not None else candidates[0].parents[1]
            )
        prefer_expandable_segments(device)
        # The 5-D mesh asks for a process group even on one process (one rank, in memory).
        self.ctx: DistributedContext = init_distributed(device, single_rank_group=cfg.mesh == "5d")
        if self.ctx.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self.sub_batches_per_rank = cfg.sub_batches_per_rank(self.ctx.world_size)
        if out_dir is None:
            out_dir = candidates[0].parent.parent if candidates else _default_out_dir(preset)
        self.out_dir = Path(self._broadcast(str(out_dir)))
        self.on_step = on_step
        self.progress_enabled = progress and self.ctx.is_main
        self.faults = FaultInjector.from_env(self.ctx.rank)
        self.sample_log = sample_log

        self.custom_source = data is not None
        self.source: DataSource = data if data is not None else self._open_source(preset)
        self.schema = self.source.schema
        check_model_fits(preset.model, self.schema.max_seqlen)
        n_train = self.source.num_requests(TRAIN)
        if cfg.epochs:
            if n_train is None:
                raise ValueError(
                    "TrainConfig.epochs needs a finite data source (an event log); this "
                    "one's training split is endless: use TrainConfig.steps"
                )
            steps = max(1, math.ceil(cfg.epochs * n_train / cfg.global_batch_size))
            preset = dataclasses.replace(preset, train=dataclasses.replace(cfg, steps=steps))
            cfg = preset.train
        self.preset = preset
        if self.ctx.is_main:  # only now: a configuration error leaves no empty run directory
            self.out_dir.mkdir(parents=True, exist_ok=True)
        log_cfg = preset.data if isinstance(preset.data, EventLogConfig) else None
        shuffle = log_cfg.shuffle if log_cfg is not None and not self.custom_source else True
        seed = log_cfg.seed if log_cfg is not None and not self.custom_source else cfg.seed
        self.order = RequestOrder(n_train, shuffle=shuffle, seed=seed)
        self._eval_ids = {s: self._split_ids(s, log_cfg) for s in (VALID, TEST)}

        grouped = dist.is_available() and dist.is_initialized()
        self.mesh = None
        """The ``hyperrec.parallel5d.ParallelMesh`` of the run (``TrainConfig.mesh``), or None."""
        if cfg.mesh == "5d" or (cfg.mesh == "auto" and grouped):
            self.mesh = build_mesh(
                self.ctx, replicate=cfg.mesh_replicate, sparse_replicate=cfg.sparse_replicate
            )
        self.tables, self.table_optimizer_kind = resolve_tables(
            cfg,
            self.ctx.world_size,
            self.ctx.device,
            saved=_saved_tables(candidates[0]) if candidates else None,
        )
        # Same seed on every rank: sharding splits parameters that start identical. Built on
        # the target device: the big presets' tables would be slow to initialise on a CPU.
        torch.manual_seed(cfg.seed)
        sharded = None
        if self.tables == "sharded":
            sparse_mesh = None if self.mesh is None else self.mesh.sparse_mesh
            sharded = sharded_tables(
                preset.model,
                self.schema,
                mesh=sparse_mesh,
                shard_axis="sparse_replicate" if sparse_mesh is not None else -1,
                device=self.ctx.device,
                seed=cfg.seed,
            )
        # The attention ops run without per-call validation (it would synchronise the
        # host every call): batches are validated once, on the CPU, by the loader.
        with torch.device(self.ctx.device):
            model = GEMModel.from_preset(
                preset, schema=self.schema, validate=False, sharded=sharded
            )
        dense_mesh = None if self.mesh is None else self.mesh.dense_mesh
        self.model = parallelize(model, self.ctx, cfg.sharding, mesh=dense_mesh)
        # Dropout draws differ per rank (they see different requests anyway).
        torch.manual_seed(cfg.seed + 1 + self.ctx.rank)
        self.optimizer = build_optimizer(self.model, cfg, table_optimizer=self.table_optimizer_kind)
        self.dense_table_optimizer, self.sparse_optimizer = build_table_optimizer(
            self.model, cfg, self.table_optimizer_kind
        )
        self._extra_optimizers = [
            o for o in (self.dense_table_optimizer, self.sparse_optimizer) if o is not None
        ]
        self.autoac: Any = None
        """The ``hyperrec.autoac.AutoAC`` plan in force (``activation_checkpointing="autoac"``)."""
        if cfg.activation_checkpointing == "autoac" and not candidates:
            # A resumed run takes the checkpointed plan instead (see load).
            self._apply_autoac()
        # Module order of the first forward pass, for non-finite reports (then no cost).
        self._forward_order = ForwardOrder(self.model)
        self._param_names = {id(p): name for name, p in self.model.named_parameters()}
        # The job's faults, not only this rank's: every rank refuses the same bad spec.
        check_fault_modules(parse_faults(os.environ.get(FAULT_ENV, "")), self.model)
        self.stream = self._build_stream()
        # Batches are built (and validated) ahead, pinned and copied on a side stream.
        self.loader = self._build_loader()
        # MFU denominators: the datasheet peak of this device and the GEMM rate measured here.
        self.peak_tflops, self.peak_source = peak_tflops(self.ctx.device)
        self.matmul_tflops = measure_matmul_tflops(self.ctx.device)
        self.popularity = PopularityBaseline(self.schema.num_items)
        self.auc_window = WindowedAUC(cfg.auc_window)
        self.step = 0
        self.history: dict[str, list[Any]] = {k: [] for k in _HISTORY_KEYS}
        self.evals: list[dict[str, Any]] = []
        self.test_record: dict[str, Any] | None = None
        self.nonfinite: list[dict[str, Any]] = []
        """Reports of non-finite steps (skipped under ``nonfinite="skip"``)."""
        self.stopped_early = False
        self.rank_costs: list[list[list[float]]] = []
        """Per step, per rank: [BBS step cost, arrival-order step cost]."""
        self.train_time_s = 0.0
        self.flops_total = 0.0
        """Model FLOPs (all ranks) of the steps this process trained."""
        self._ema = 0.0
        self._ema_steps = 0
        self._last_end: Any = None  # when (event or host time) the previous step ended
        self._last_auc = math.nan
        self.last_checkpoint: Path | None = None
        self.resume_notes: list[str] = []
        """Checkpoints skipped on resume (corrupt) and world-size changes."""
        if candidates:
            self._resume(candidates)

    # -- set-up helpers -----------------------------------------------------------------
    def _open_source(self, preset: Preset) -> DataSource:
        if isinstance(preset.data, DataConfig):
            return SyntheticRecsysData(preset.data)
        from hyperrec.integration.eventlog import EventLogSource, prepare_event_log

        cfg = preset.data
        cache = Path(cfg.cache_dir) if cfg.cache_dir else self.out_dir / "data"
        # Rank 0 prepares (or finds a matching preparation); the others wait for it and
        # raise the same error if it failed.
        error: BaseException | None = None
        if self.ctx.is_main:
            try:
                prepare_event_log(cfg, cache)
            except BaseException as err:  # re-raised below, on every rank
                error = err
        status = self._broadcast(None if error is None else (type(error), str(error)))
        if error is not None:
            raise error
        if status is not None:
            raise status[0](status[1])
        return EventLogSource(cfg, cache)

    def _split_ids(self, split: int, log_cfg: EventLogConfig | None) -> np.ndarray:
        n = self.source.num_requests(split) or 0
        if log_cfg is not None and split == VALID:
            limit = log_cfg.valid_requests
            if limit and limit < n:
                # A fixed pseudo-random subset, the same at every evaluation.
                return np.sort(permute(np.arange(limit), n, (log_cfg.seed, 0x7A11D)))
        return np.arange(n, dtype=np.int64)

    def _stream_end(self) -> int | None:
        """The global sub-batch index the training stream ends before: the sub-batches of
        ``TrainConfig.steps`` steps for a run of epochs (its last BBS window is then
        planned short, so every request of every pass trains), else None (endless)."""
        cfg = self.preset.train
        if not cfg.epochs:
            return None
        return cfg.steps * (cfg.global_batch_size // cfg.sub_batch_size)

    def _build_stream(self, backlog: tuple[int, ...] = (), frontier: int = 0) -> TrainStream:
        cfg = self.preset.train
        return TrainStream(
            self.source,
            sub_batch_size=cfg.sub_batch_size,
            sub_batches_per_step=self.sub_batches_per_rank,
            window_steps=cfg.window_steps,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            cost=default_cost_model(self.preset.model.dim),
            order=self.order,
            backlog=backlog,
            frontier=frontier,
            end=self._stream_end(),
        )

    def _build_loader(self) -> StepLoader:
        cfg = self.preset.train
        return StepLoader(
            self.stream,
            self.ctx.device,
            workers=cfg.data_workers,
            prefetch=cfg.prefetch_batches,
            validate=cfg.validate_inputs,
        )

    def _resume(self, candidates: list[Path]) -> None:
        for i, path in enumerate(candidates):
            try:
                self.load(path)
                return
            except CheckpointError as err:
                if i + 1 == len(candidates):
                    raise
                note = f"skipped {path}: {err}; trying {candidates[i + 1]}"
                self.resume_notes.append(note)
                if self.ctx.is_main:
                    print(f"hyperrec-train: warning: {note}", file=sys.stderr)

    # -- helpers ------------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if not self.ctx.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        amp = self.preset.train.amp
        if amp == "bf16" or (amp == "auto" and self.ctx.device.type == "cuda"):
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- activation checkpointing --------------------------------------------------------
    def _probe_batch(self, steps: int = 16) -> Any:
        """The heaviest (most history tokens) of this rank's first ``steps`` arrival-order
        step batches: what autoac profiles, so that its plan holds for the heavy steps
        (its memory model scales with the tokens). Built from the source directly, in the
        run's request order: the training stream is not advanced."""
        cfg = self.preset.train
        k, world, rank = self.sub_batches_per_rank, self.ctx.world_size, self.ctx.rank
        best, best_tokens = None, -1
        for step in range(steps):
            subs = rank + world * np.arange(step * k, (step + 1) * k)
            pos = (subs[:, None] * cfg.sub_batch_size + np.arange(cfg.sub_batch_size)).reshape(-1)
            ids = self.order(pos)
            tokens = int(self.source.history_lengths(TRAIN, ids).sum())
            if tokens > best_tokens:
                best, best_tokens = ids, tokens
        if best is None:
            raise ValueError(f"steps must be positive, got {steps}")
        batch = self.source.batch(TRAIN, best)
        if cfg.validate_inputs:
            validate_batch(batch, self.schema)
        return batch.to(self.ctx.device)

    def _probe_step_fn(self) -> Callable[[torch.nn.Module], torch.Tensor]:
        """``step(model) -> loss``: forward of the probe batch (what autoac profiles)."""
        batch = self._probe_batch()
        n = float(batch.num_candidates)

        def step(model: torch.nn.Module) -> torch.Tensor:
            # Each profiled / verified step starts as a training step does: with no row
            # gradients of the sharded tables pending. They piled up over autoac's
            # backwards (appended per backward until the optimizer's zero_grad), and a
            # GPU's measured peak counts them: the plan's step read as over budget.
            for opt in self._extra_optimizers:
                opt.zero_grad(set_to_none=True)
            with self._autocast():
                ctr, cvr = model(batch)
            ctr_sum, ctcvr_sum = task_loss(ctr, cvr, batch.click, batch.conversion)
            return (ctr_sum + ctcvr_sum) / n

        return step

    def step_memory(self) -> dict[str, Any]:
        """Memory of one forward + backward of the probe batch (the heaviest of the
        first steps' batches, which autoac plans on) with the model as it is now (autoac's
        plan in force, if any): ``{"base_gb", "peak_gb", "step_gb"}`` in GB (1e9 bytes),
        counted as ``hyperrec.autoac.measure_step`` counts them (CUDA: the allocator;
        CPU: live tensor storages). ``step_gb = peak_gb - base_gb``: what the step
        allocated at its peak (activations, gradients, workspaces). Collective: run it on
        every rank. Leaves parameter gradients and table rows as they were before the
        step is measured (none pending)."""
        from hyperrec import autoac

        m = autoac.measure_step(self.model, self._probe_step_fn(), seed=self.preset.train.seed)
        for opt in self._extra_optimizers:
            opt.zero_grad(set_to_none=True)
        assert m.base_bytes is not None and m.step_bytes is not None  # CUDA, or tracked
        return {
            "base_gb": m.base_bytes / 1e9,
            "peak_gb": m.peak_bytes / 1e9,
            "step_gb": m.step_bytes / 1e9,
        }

    def _ac_budgets(self) -> tuple[int | None, dict[str, int]]:
        cfg = self.preset.train
        budget: int | None
        if cfg.ac_budget_gb:
            budget = int(cfg.ac_budget_gb * 1e9)
        elif cfg.ac_strategy == "pack_all":
            budget = None  # packing is not searched: no budget to plan within
        elif self.ctx.device.type == "cuda":
            budget = int(0.9 * torch.cuda.get_device_properties(self.ctx.device).total_memory)
        else:
            raise ValueError(
                "TrainConfig.ac_budget_gb must be > 0 off a GPU: autoac needs a peak-memory "
                "budget (0 means 90% of the GPU's memory)"
            )
        regions = {
            f"seq_layers.{i}": int(gb * 1e9)
            for i, gb in enumerate(cfg.ac_layer_budgets_gb)
            if gb > 0
        }
        return budget, regions

    def _apply_autoac(self) -> None:
        """Profile one step of the probe batch and put autoac's plan in force on every
        sequence layer (collective: every rank runs the same profiled steps)."""
        from hyperrec import autoac

        cfg = self.preset.train
        budget, regions = self._ac_budgets()
        step = self._probe_step_fn()
        # FLOP costs on the CPU and on several ranks: measured times vary with the load
        # (tests would not be reproducible) and from rank to rank (plans would differ).
        cost: Literal["time", "flops"] = (
            "flops" if self.ctx.device.type == "cpu" or self.ctx.distributed else "time"
        )
        formats = tuple(cfg.ac_formats)
        # Packed saves under compilation: autoac compiles each layer itself (the model's
        # compiled regions inline into it) inside saved-tensor hooks that trace the
        # MXINT8 packing into its graphs; without formats the model compiles its own
        # regions and autoac wraps them eagerly, as before.
        compiled = bool(formats) and cfg.compile != "off"
        if compiled and not autoac.compiled_packing_supported():
            raise ValueError(
                f"TrainConfig.ac_formats={formats!r} with TrainConfig.compile={cfg.compile!r} "
                f"needs a torch that inlines saved-tensor hooks into compiled graphs "
                f"(torch {torch.__version__} does not): use TrainConfig.compile='off'"
            )
        try:
            self.autoac = autoac.apply(
                self.model,
                budget=budget,
                region_budgets=regions or None,
                regions=self.model.ac_regions(cfg.ac_regions),
                step_fn=step,
                formats=formats,
                profile_config=autoac.ProfileConfig(steps=1, cost=cost, seed=cfg.seed),
                # validated by TrainConfig against the same names
                plan_config=autoac.PlanConfig(
                    strategy=cast(Literal["fastest", "pack_all"], cfg.ac_strategy),
                    pack_inputs=cfg.ac_pack_inputs,
                ),
                # The verification replans until packing is within its error bound: a
                # number of steps that could differ between ranks, whose FSDP collectives
                # must pair.
                verify=not (formats and self.ctx.distributed),
                compile=compiled,
                # the model's own compile arguments: a layer compiles as it would without
                compile_kwargs=compile_kwargs(cfg.compile) if compiled else None,
            )
        except ValueError as err:
            if str(err).startswith(("budget", "region_budgets")):
                raise ValueError(
                    f"TrainConfig.ac_budget_gb={cfg.ac_budget_gb} / ac_layer_budgets_gb="
                    f"{cfg.ac_layer_budgets_gb} cannot hold this model's step: {err}"
                ) from err
            raise
        # The profiled backwards left row gradients with the sharded tables: drop them.
        for opt in self._extra_optimizers:
            opt.zero_grad(set_to_none=True)

    def autoac_summary(self) -> dict[str, Any] | None:
        """The plan in force (per layer: mode, held bytes, added time) and autoac's
        verification (predicted vs measured peak), or None without autoac."""
        if self.autoac is None:
            return None
        plan = self.autoac.plan
        return {
            "budget_gb": None if plan.budget is None else plan.budget / 1e9,
            "predicted_peak_gb": plan.predicted_peak / 1e9,
            "no_ac_peak_gb": plan.no_ac_peak / 1e9,
            "floor_gb": plan.floor / 1e9,
            "added_s": plan.added_s,
            "solver": plan.solver,
            "regions": {
                r.name: {
                    "mode": r.mode,
                    "held_gb": r.held_bytes / 1e9,
                    # what the layer would hold un-checkpointed and unpacked
                    "noac_held_gb": r.noac_held_bytes / 1e9,
                    "added_s": r.added_s,
                    # the op outputs off the mode's default ("sac": recompute, "none":
                    # keep) kept, and packed per format: the mode alone does not say
                    # whether anything was packed
                    "kept": sum(1 for d in r.saves.values() if d == "keep"),
                    "packed": dict(collections.Counter(d for d in r.saves.values() if d != "keep")),
                }
                for r in plan.regions
            },
            "verification": self.autoac.verification,
        }

    # -- one step -----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """Run one optimizer step; returns its metrics (identical on every rank).

        Synchronous: it waits for the step to finish. :meth:`fit` instead overlaps each
        step's bookkeeping with the next step's device work (see :meth:`launch_step`).

        A step whose global loss or gradient norm is not finite follows
        ``TrainConfig.nonfinite``: "stop" raises :class:`NonFiniteError`, "skip" drops
        the update (``metrics["skipped"]`` is 1.0) and records the report.
        """
        return self.finish_step(self.launch_step())

    def launch_step(self) -> PendingStep:
        """Enqueue one step's device work and return without waiting for it.

        Nothing here reads a device value: the batch arrives through the loader (built and
        validated ahead, copied on a side stream), sizes come from shapes and the CPU
        copy of the batch, and the values the host needs (loss sums, gradient norm, the
        per-parameter non-finite flags, predictions) are copied into pinned host buffers
        behind an event that :meth:`finish_step` waits on later, once the next step is
        queued.

        The one exception is ``TrainConfig.nonfinite="skip"``: dropping an update must be
        decided before the optimizer step, so that policy reads the step's global loss
        and gradient norm here (one host synchronisation per step). Under "stop" (the
        default) the check is made by :meth:`finish_step`, without synchronising.

        Raises:
            NonFiniteError: never here; see :meth:`finish_step`.
        """
        cfg = self.preset.train
        t0 = time.perf_counter()
        dev = self.ctx.device
        cuda = dev.type == "cuda"
        # cudaEventQuery: no wait. True means the GPU ran out of queued work before the
        # host started on this step (a host- or input-bound step).
        dry = self._last_end.query() if cuda and self._last_end is not None else None
        try:
            loaded = self.loader.next()
        except StopIteration:
            raise RuntimeError(
                f"the training stream ended before step {self.step + 1} of "
                f"TrainConfig.steps={cfg.steps} (from TrainConfig.epochs={cfg.epochs}): its "
                "checkpoint trained sub-batches past this run's last pass"
            ) from None
        batch, host = loaded.batch, loaded.host
        step = self.step + 1
        for opt in (self.optimizer, *self._extra_optimizers):
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_factor(step, cfg)
        step_lr = next(g["lr"] for g in self.optimizer.param_groups if g["name"] == "matrices")
        shape = StepShape.from_batch(host)
        flops = model_flops(
            self.preset.model, self.schema, shape.history_lengths, shape.candidate_counts
        )
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()

        with self._autocast():
            ctr_logit, cvr_logit = self.model(batch)
        ctr_sum, ctcvr_sum = task_loss(ctr_logit, cvr_logit, batch.click, batch.conversion)
        if self.faults:
            ctr_sum = self.faults.poison_loss(step, ctr_sum)
        local_loss = (ctr_sum + ctcvr_sum).detach().double().reshape(1)
        n_local = host.num_candidates
        local = [loaded.plan.cost, loaded.plan.arrival_cost, flops.total_training]
        if self.ctx.distributed:
            sums = torch.stack(
                [
                    torch.full((), float(n_local), device=dev, dtype=torch.float64),
                    ctr_sum.detach().double(),
                    ctcvr_sum.detach().double(),
                ]
            )
            dist.all_reduce(sums)
            mine = torch.tensor(local, dtype=torch.float64)
            costs = (mine.pin_memory() if cuda else mine).to(dev, non_blocking=True)
            gathered = [torch.empty_like(costs) for _ in range(self.ctx.world_size)]
            dist.all_gather(gathered, costs)
            rank_costs: torch.Tensor | list[list[float]] = torch.stack(gathered)
            # Each rank's share of the global mean; FSDP's reduce-scatter averages over ranks.
            loss = (ctr_sum + ctcvr_sum) * (self.ctx.world_size / sums[0].float())
            global_loss = sums[1] + sums[2]
        else:
            sums = torch.stack([ctr_sum.detach().double(), ctcvr_sum.detach().double()])
            rank_costs = [local]
            loss = (ctr_sum + ctcvr_sum) / float(n_local)
            global_loss = local_loss[0]
        loss.backward()
        if self.faults:
            self.faults.poison_grad(step, self.model)
            self.faults.kill("kill", step)  # mid-step: after backward, before the update
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Flags of this rank's own gradient (shards): the "stop" report names the ranks
        # that hold the non-finite values, as the "skip" one does from the gradients
        # themselves. Global flags named every rank, so rank 0, for a NaN on rank 1 only.
        grad_norm, bad = _grad_norms(params, local_flags=True)
        names = [self._param_names.get(id(p), "?") for p in params]
        skipped = False
        if cfg.nonfinite == "skip":
            # The policy's one host read: the update must not happen if this is False.
            skipped = not bool(torch.isfinite(global_loss) & torch.isfinite(grad_norm))
        if skipped:
            self._skip_step(step, local_loss, sums, n_local, grad_norm)
        elif cfg.grad_clip > 0:
            _clip_grads_(params, cfg.grad_clip, grad_norm)
        # The table optimizers (sharded rows, dense Adagrad) skip with AdamW: zero_grad
        # drops their row gradients.
        for opt in (self.optimizer, *self._extra_optimizers):
            if not skipped:
                opt.step()
            opt.zero_grad(set_to_none=True)
        readout = torch.cat(
            [sums, grad_norm.detach().double().reshape(1), local_loss, bad.to(sums.device).double()]
        )
        preds = torch.sigmoid(ctr_logit.detach().float())
        end = None
        if cuda:
            readout, preds = _to_host(readout), _to_host(preds)
            if isinstance(rank_costs, torch.Tensor):
                rank_costs = _to_host(rank_costs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.step = step
        # Host-side bookkeeping from the CPU copy of the batch: no device reads.
        self.popularity.update(host.candidate_items, host.click, host.conversion)
        if self.sample_log:  # here, not in finish_step: a step is logged once its update is
            # queued, whether or not the run lives to read its metrics
            self._log_samples(step, loaded, skipped)
        pending = PendingStep(
            step=step,
            loaded=loaded,
            flops=flops,
            readout=readout,
            preds=preds,
            rank_costs=rank_costs,
            n_local=n_local,
            param_names=names,
            skipped=skipped,
            start=start if cuda else t0,
            end=end,
            previous_end=self._last_end,
            gpu_dry_at_launch=dry,
            lr=step_lr,
        )
        # Start building/copying the next batch now, behind this step's device work.
        self.loader.prefetch()
        self._last_end = end if cuda else None
        if not cuda:
            pending.end = time.perf_counter()
        return pending

    def _skip_step(
        self,
        step: int,
        local_loss: torch.Tensor,
        sums: torch.Tensor,
        n_local: int,
        grad_norm: torch.Tensor,
    ) -> None:
        """Report a non-finite step whose update is dropped (``nonfinite="skip"``;
        collective: every rank reaches it for the same step)."""
        values = sums.tolist()
        n = values[0] if self.ctx.distributed else float(n_local)
        report: NonFiniteReport = nonfinite_report(
            step,
            self.model,
            local_loss=float(local_loss),
            loss=(values[-2] + values[-1]) / n,
            grad_norm=float(grad_norm),
            forward_order=self._forward_order.names,
        )
        self.nonfinite.append(report.as_dict())
        if self.ctx.is_main:
            print(f"hyperrec-train: skipped step {step}: {report.message()}", file=sys.stderr)

    def _auc(self, recompute: bool) -> float:
        if recompute:
            self._last_auc = self.auc_window.compute()
        return self._last_auc

    def drain(self) -> None:
        """Forget the previous step's end time: the next step is timed from its own start
        (evaluation or checkpointing ran in between)."""
        self._last_end = None

    def finish_step(self, p: PendingStep) -> dict[str, float]:
        """Wait for step ``p`` (from :meth:`launch_step`) and return its metrics.

        Call it once per launched step, in launch order; launching the next step first
        keeps the device busy while the host waits.

        Raises:
            NonFiniteError: the step's global loss or gradient norm is NaN or Inf under
                ``TrainConfig.nonfinite="stop"``. Its update has been applied (it was
                queued before the values could be read), so the parameters are no longer
                usable: the run ends without a checkpoint of them, and ``self.step`` is
                set back to the last good step. The report names the step, the ranks
                and the first module, in backward order, whose gradient was non-finite.
        """
        cfg = self.preset.train
        gap = math.nan
        if isinstance(p.end, torch.cuda.Event):
            p.end.synchronize()
            since = p.previous_end if p.previous_end is not None else p.start
            elapsed = since.elapsed_time(p.end) / 1e3
            if p.previous_end is not None:
                # GPU time between the previous step's last work and this step's first:
                # idle while the host (or the input copy) had not queued this step yet
                gap = p.previous_end.elapsed_time(p.start) / 1e3
        else:
            elapsed = float(p.end) - float(p.start)
        values = p.readout.tolist()
        k = 3 if self.ctx.distributed else 2
        grad_norm, local_loss, flags = values[k], values[k + 1], values[k + 2 :]
        # (a device tensor of every rank's costs when distributed, this rank's row else)
        rank_costs: list[list[float]] = (
            p.rank_costs.reshape(-1, 3).tolist()
            if isinstance(p.rank_costs, torch.Tensor)
            else p.rank_costs
        )
        if self.ctx.distributed:
            n, ctr_total, ctcvr_total = values[:k]
        else:
            ctr_total, ctcvr_total = values[:k]
            n = float(p.n_local)
        loss_value = (ctr_total + ctcvr_total) / n
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if not finite and not p.skipped:
            # "stop" (a "skip" step was reported when it was dropped).
            report = nonfinite_report(
                p.step,
                self.model,
                local_loss=local_loss,
                loss=loss_value,
                grad_norm=grad_norm,
                forward_order=self._forward_order.names,
                nonfinite_grads={name for name, bad in zip(p.param_names, flags) if bad},
            )
            self.nonfinite.append(report.as_dict())
            self.step = p.step - 1
            raise NonFiniteError(report)
        self.rank_costs.append([row[:2] for row in rank_costs])
        balanced, arrival = ([row[i] for row in rank_costs] for i in (0, 1))
        step_flops = float(sum(row[2] for row in rank_costs))
        self.train_time_s += elapsed
        self.flops_total += step_flops
        host = p.loaded.host
        if not p.skipped:  # a NaN score has no rank
            self.auc_window.update(p.preds, host.click)
            self._ema = _EMA_BETA * self._ema + (1.0 - _EMA_BETA) * loss_value
            self._ema_steps += 1
        log = p.step % cfg.log_every == 0 or p.step == cfg.steps
        tflops = step_flops / elapsed / self.ctx.world_size / 1e12 if elapsed > 0 else math.nan
        ema_norm = 1.0 - _EMA_BETA**self._ema_steps
        metrics = {
            "step": p.step,
            "loss": loss_value,
            "loss_ema": self._ema / ema_norm if self._ema_steps else math.nan,
            "ctr_loss": ctr_total / n,
            # The exact windowed AUC costs host time: recomputed only on recorded steps.
            "ctr_auc": self._auc(log),
            # Not the optimizer's: in fit's pipeline the next step has already set it (the
            # history showed each step's successor's rate, except at checkpoints and evals).
            "lr": p.lr,
            "grad_norm": grad_norm,
            "samples_per_s": cfg.global_batch_size / elapsed if elapsed > 0 else math.nan,
            "step_time_s": elapsed,
            "cost_max_over_mean": max(balanced) / (sum(balanced) / len(balanced)),
            "arrival_cost_max_over_mean": max(arrival) / (sum(arrival) / len(arrival)),
            "step_tflop": step_flops / 1e12,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else math.nan,
            "gpu_gap_s": gap,
            "gpu_dry_at_launch": (
                math.nan if p.gpu_dry_at_launch is None else float(p.gpu_dry_at_launch)
            ),
            "skipped": float(p.skipped),
        }
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    step=p.step,
                    loss=loss_value,
                    sample_ids=host.sample_ids.clone(),
                    sub_batches=p.loaded.plan.sub_batches,
                    skipped=p.skipped,
                )
            )
        return metrics

    def _log_samples(self, step: int, loaded: LoadedStep, skipped: bool) -> None:
        folder = self.out_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        line = {
            "step": step,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "sub_batches": list(loaded.plan.sub_batches),
            "ids": loaded.host.sample_ids.tolist(),
            "skipped": skipped,
        }
        with open(folder / f"rank{self.ctx.rank}.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self, split: int = VALID, *, logistic: LogisticRegressionBaseline | None = None
    ) -> dict[str, Any]:
        """Score a held-out split; returns the record on rank 0 (``{}`` elsewhere).

        The record holds the model's metrics (see
        :func:`~hyperrec.integration.metrics.task_metrics`: AUC, GAUC over users, NE,
        calibration, and the CVR metrics when there is a conversion label) and its loss,
        and under ``"baselines"`` the same metrics of the popularity baseline (counts of
        the training impressions so far, all ranks), of ``logistic`` when given, and of
        the ground truth where the source knows it. An empty split gives ``{}``.

        Raises:
            ValueError: ``split`` is not VALID or TEST.
        """
        if split not in (VALID, TEST):
            raise ValueError(f"split must be VALID ({VALID}) or TEST ({TEST}), got {split!r}")
        ids_all = self._eval_ids[split]
        if ids_all.size == 0:
            return {}
        world, rank = self.ctx.world_size, self.ctx.rank
        counts = self.popularity.global_counts(self.ctx.device)
        pop_ctr, pop_cvr = PopularityBaseline.rates(counts, self.popularity.prior_strength)
        local = ids_all[rank::world]
        # Every rank runs the same number of forwards (FSDP all-gathers are collective).
        # Padded (naive) attention at long caps needs smaller forwards: bound the chunk by
        # requests and by padded tokens.
        chunk = max(1, min(_EVAL_CHUNK, _EVAL_PADDED_TOKENS // self.schema.max_seqlen))
        n_chunks = max(1, math.ceil(math.ceil(ids_all.size / world) / chunk))
        two_tasks = self.schema.has_conversion
        both = getattr(self.source, "batch_and_truth", None)
        parts: dict[str, list[torch.Tensor]] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            for piece in np.array_split(local, n_chunks):
                ids = piece if piece.size else ids_all[:1]
                if both is not None:
                    batch, truth = both(split, ids)
                else:
                    batch, truth = self.source.batch(split, ids), self.source.truth(split, ids)
                if self.preset.train.validate_inputs:
                    validate_batch(batch, self.schema)
                with self._autocast():
                    ctr_logit, cvr_logit = self.model(batch.to(self.ctx.device))
                if not piece.size:
                    continue
                ctr_logit = ctr_logit.float().cpu()
                cvr_logit = cvr_logit.float().cpu() if cvr_logit is not None else None
                ctr_sum, ctcvr_sum = task_loss(ctr_logit, cvr_logit, batch.click, batch.conversion)
                items = batch.candidate_items
                owner = torch.repeat_interleave(
                    torch.arange(batch.num_requests), batch.candidate_offsets.diff()
                )
                values = {
                    "ctr_logit": ctr_logit.double(),
                    "p_ctr": torch.sigmoid(ctr_logit),
                    "click": batch.click,
                    "user": batch.user_ids[owner],
                    "pop_ctr": pop_ctr[items],
                    "loss_sum": (ctr_sum + ctcvr_sum).reshape(1).double(),
                }
                if two_tasks:
                    if cvr_logit is None:
                        raise RuntimeError(
                            "the model gave no conversion logits for a schema with conversions"
                        )
                    values.update(
                        cvr_logit=cvr_logit.double(),
                        p_cvr=torch.sigmoid(cvr_logit),
                        conversion=batch.conversion,
                        pop_cvr=pop_cvr[items],
                    )
                if logistic is not None:
                    values["lr_ctr"] = logistic.predict(batch)
                if truth is not None:
                    values["true_ctr"], values["true_cvr"] = truth
                for key, value in values.items():
                    parts.setdefault(key, []).append(value)
        finally:
            self.model.train(was_training)
        mine = {k: torch.cat(v) for k, v in parts.items()}
        if self.ctx.distributed:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if not self.ctx.is_main:
            return {}
        allp = {k: torch.cat([g[k] for g in gathered if g]) for k in mine}
        click, users = allp["click"], allp["user"]
        conv = allp.get("conversion")

        def metrics(ctr: str, cvr: str | None) -> dict[str, float]:
            return task_metrics(
                allp[ctr], allp[cvr] if cvr and two_tasks else None, click, conv, users
            )

        baselines = {"popularity": metrics("pop_ctr", "pop_cvr")}
        if "lr_ctr" in allp:
            baselines["logistic_regression"] = metrics("lr_ctr", None)
        if "true_ctr" in allp:
            baselines["ground_truth"] = metrics("true_ctr", "true_cvr")
        # The logits' spread tells a collapsed model (one prediction for every impression)
        # from one that has not learned yet; both score ~0.5 AUC.
        spread = {
            f"{task}_logit_std": float(allp[f"{task}_logit"].std(correction=0))
            for task in ("ctr", "cvr")
            if f"{task}_logit" in allp
        }
        return {
            "split": SPLITS[split],
            "step": self.step,
            "loss": float(allp["loss_sum"].sum() / click.numel()),
            **metrics("p_ctr", "p_cvr"),
            **spread,
            "collapsed": click.numel() > 1 and spread["ctr_logit_std"] < COLLAPSED_LOGIT_STD,
            "baselines": baselines,
            "requests": int(ids_all.size),
            "impressions": int(click.numel()),
        }

    def fit_logistic_baseline(self) -> LogisticRegressionBaseline | None:
        """Fit the logistic-regression baseline on the first training requests the run
        read (at most ``TrainConfig.baseline_requests``; rank 0 fits, the others receive
        the weights). ``None`` when disabled or before any step."""
        cfg = self.preset.train
        n = min(self.step * cfg.global_batch_size, cfg.baseline_requests)
        if self.order.num_requests is not None:
            n = min(n, self.order.num_requests)
        if n <= 0:
            return None
        lr = LogisticRegressionBaseline(self.schema)
        state = None
        if self.ctx.is_main:
            start = time.perf_counter()
            ids = self.order(np.arange(n))
            info = lr.fit(self.source.batch(TRAIN, c) for c in np.array_split(ids, -(-n // 4096)))
            info["fit_s"] = time.perf_counter() - start
            self.logistic_info = info
            state = lr.state_dict()
        state = self._broadcast(state)
        if not self.ctx.is_main:
            lr.load_state_dict(state)
        return lr

    # -- checkpoints --------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step (collective); returns its directory."""
        path = checkpoint_dir(self.out_dir, self.step)
        rng = {"cpu": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        step = self.step
        # Optimizers that have not updated anything yet (every step so far skipped, or a
        # save before the first step): get_state_dict creates their state with a zero-lr
        # step() (torch DCP's _init_optim_state), which counts one AdamW step more, so a
        # run that checkpointed then trained differently from one that did not (and than
        # its own resume would, were the state not put back the same way in load).
        optimizers = self._dense_optimizers()
        stateless = [i for i, opt in enumerate(optimizers) if not opt.state]
        save_checkpoint(
            path,
            model=self.model,
            optimizer=optimizers,
            extra=self._checkpointed_objects(),
            meta={
                "step": self.step,
                "preset": self.preset.to_dict(),
                "source": self.source.state_dict(),
                "history": self.history,
                "evals": self.evals,
                "rank_costs": self.rank_costs,
                "train_time_s": self.train_time_s,
                "flops_total": self.flops_total,
                "ema": self._ema,
                "ema_steps": self._ema_steps,
                "nonfinite": self.nonfinite,
                "stopped_early": self.stopped_early,
                "tables": [self.tables, self.table_optimizer_kind],
                "stateless_optimizers": stateless,
            },
            rank_state={
                "stream": self.loader.state_dict(),
                "rng": rng,
                "auc_window": self.auc_window.state_dict(),
                # Per rank: each rank profiled its own heaviest batch.
                "autoac": None if self.autoac is None else self.autoac.state_dict(),
            },
            rank_tensors={"popularity": self.popularity.counts},
            info={
                "preset": self.preset.to_dict(),
                "custom_source": self.custom_source,
                "tables": [self.tables, self.table_optimizer_kind],
            },
            before_commit=(lambda: self.faults.kill("kill_in_checkpoint", step))
            if self.faults
            else None,
        )
        for i in stateless:
            optimizers[i].state.clear()
        self.last_checkpoint = path
        return path

    def load(self, path: str | Path) -> None:
        """Restore the state saved by :meth:`save` (collective).

        On another world size the model and optimizer reshard, the data position moves
        with :func:`~hyperrec.integration.pipeline.reshard_streams` (no request lost or
        read twice), the popularity counts are summed onto rank 0 and the training-AUC
        window is rank 0's; dropout RNG streams start afresh. A checkpoint written when
        the run stopped early resumes stopped only if this run's early-stopping rule
        (patience, metric) stops it at that evaluation too.

        Raises:
            CheckpointError: the checkpoint is incomplete or corrupt.
            ValueError: the checkpoint's preset differs in a field that changes the run
                (anything but the cadence: steps, epochs, evaluation, checkpoint,
                logging, early stopping, non-finite policy, baseline size; for an event
                log also its path, cache and reader), or it was trained on other data;
                or the checkpoint's step is past ``TrainConfig.steps``.
        """
        verify_checkpoint(path)
        saved_meta = read_meta(path)
        saved, now = saved_meta["preset"], self.preset.to_dict()
        if saved_meta["step"] > self.preset.train.steps:
            # Nothing would be trained and the run would report the checkpoint's steps as
            # a complete run of fewer.
            raise ValueError(
                f"checkpoint {path} is at step {saved_meta['step']}, past this run's "
                f"TrainConfig.steps={self.preset.train.steps}"
                + (
                    f" (from TrainConfig.epochs={self.preset.train.epochs})"
                    if self.preset.train.epochs
                    else ""
                )
                + ": resume from an earlier checkpoint or train at least as many steps"
            )
        if not self.custom_source:
            # The kind of source first: else the first field of one that the other lacks
            # is reported (e.g. data.user_column=None against a synthetic run).
            kinds = (saved["data"].get("source", "synthetic"), now["data"]["source"])
            if kinds[0] != kinds[1]:
                raise ValueError(
                    f"checkpoint {path} was trained on data.source={kinds[0]!r}, this run "
                    f"has {kinds[1]!r}"
                )
        for section in ("data", "model", "train"):
            if section == "data" and self.custom_source:
                continue  # the source's own state_dict identifies its data (below)
            exempt = _CADENCE if section == "train" else _DATA_EXEMPT if section == "data" else ()
            for key, value in now[section].items():
                if key in exempt:
                    continue
                if saved[section].get(key) != value:
                    raise ValueError(
                        f"checkpoint {path} was trained with {section}.{key}="
                        f"{saved[section].get(key)!r}, this run has {value!r}"
                    )
        # Checkpoints before sharded tables (integration 0.2) trained dense tables with AdamW.
        tables = tuple(saved_meta.get("tables", ("dense", "adamw")))
        if tables != (self.tables, self.table_optimizer_kind):
            raise ValueError(
                f"checkpoint {path} trained {tables[0]} tables with {tables[1]}, this run has "
                f"{self.tables} tables with {self.table_optimizer_kind} (TrainConfig.sparse="
                f"{self.preset.train.sparse!r}, embedding_optimizer="
                f"{self.preset.train.embedding_optimizer!r}; 'auto' takes the checkpoint's)"
            )
        if "source" in saved_meta:
            self.source.load_state_dict(saved_meta["source"])
        old_world = saved_meta["world_size"]
        reshard = old_world != self.ctx.world_size
        meta, state = load_checkpoint(
            path,
            model=self.model,
            optimizer=self._dense_optimizers(),
            extra=self._checkpointed_objects(),
            rank_tensors={"popularity": self.popularity.counts},
            all_ranks=reshard,
            verify=False,  # verified above
        )
        # As save left them: without state (see save; the loaded one is DCP's zero-lr step).
        optimizers = self._dense_optimizers()
        for i in meta.get("stateless_optimizers", []):
            optimizers[i].state.clear()
        if self.preset.train.activation_checkpointing == "autoac":
            self._restore_autoac(None if reshard else state.get("autoac"))
        self.step = meta["step"]
        self.history = meta["history"]
        # A checkpoint written before a history key existed: NaN for its steps.
        for key in _HISTORY_KEYS:
            self.history.setdefault(key, [math.nan] * len(self.history.get("step", [])))
        self.evals = meta["evals"]
        self.rank_costs = meta["rank_costs"]
        self.train_time_s = meta["train_time_s"]
        self.flops_total = meta.get("flops_total", 0.0)
        self._ema = meta["ema"]
        self._ema_steps = meta.get("ema_steps", meta["step"])
        self.nonfinite = meta.get("nonfinite", [])
        # Early stopping is cadence, which a resume may change: a checkpoint written when
        # the run stopped early stays stopped only if this run's rule stops it too (before,
        # one resumed with the patience raised or set to 0 trained nothing and reported an
        # early stop). The same decision on every rank: the evaluations come from the meta.
        # Without evaluations to decide from (multi-rank checkpoints of earlier versions
        # may have lost them, see save_checkpoint) the saved decision stands unless early
        # stopping is now off.
        self.stopped_early = bool(meta.get("stopped_early", False))
        if self.stopped_early and (self.evals or not self.preset.train.early_stopping_patience):
            self.stopped_early = self._should_stop_early()
        if reshard:
            streams = [s["stream"] for s, _ in state]
            backlogs, frontier = reshard_streams(
                streams,
                self.source,
                world_size=self.ctx.world_size,
                cost=default_cost_model(self.preset.model.dim),
                order=self.order,
                end=self._stream_end(),
            )
            self.stream = self._build_stream(tuple(backlogs[self.ctx.rank]), frontier)
            self.loader.close()
            self.loader = self._build_loader()
            if self.ctx.is_main:
                self.popularity.counts.copy_(sum(t["popularity"] for _, t in state))
            else:
                self.popularity.counts.zero_()
            self.auc_window.load_state_dict(state[0][0]["auc_window"])
            self.resume_notes.append(
                f"resharded from {old_world} to {self.ctx.world_size} ranks: "
                f"{sum(map(len, backlogs))} sub-batches in the backlog, then from {frontier}"
            )
        else:
            # The loader's saved state is the stream's after the last trained step (not
            # where its read-ahead had got to).
            self.stream.load_state_dict(state["stream"])
            self.loader.reset()
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.ctx.device)
            self.auc_window.load_state_dict(state["auc_window"])
        self.last_checkpoint = Path(path)

    def _restore_autoac(self, saved: dict[str, Any] | None) -> None:
        """Put the checkpointed autoac plan back in force (same world size), or plan anew.

        The saved plan, not a new profile, on the same world size: quantized saves change
        the numerics, so an exact resume needs the same decisions. On another world size
        each rank's batch (and so its activation memory) differs from the one the plans
        were made for: profile again.
        """
        if saved is None:
            if self.autoac is None:
                self._apply_autoac()
            return
        from hyperrec import autoac

        plan = autoac.Plan.from_dict(saved["plan"])
        if self.autoac is None:
            self.autoac = autoac.apply_plan(self.model, plan)
        else:
            self.autoac.set_plan(plan)

    def _dense_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of parameters (saved through ``get_state_dict``)."""
        return [self.optimizer] + (
            [self.dense_table_optimizer] if self.dense_table_optimizer is not None else []
        )

    def _checkpointed_objects(self) -> dict[str, Any]:
        """Stateful objects outside the model's parameters: the sharded tables' optimizer
        (the rows themselves are in the model's ``state_dict``)."""
        return {"sparse_optim": self.sparse_optimizer} if self.sparse_optimizer is not None else {}

    # -- the run ------------------------------------------------------------------------
    def fit(self, *, stop_after: int | None = None, plot: bool = True) -> RunResult:
        """Train to ``TrainConfig.steps`` (or until step ``stop_after``), then report.

        Validates every ``eval_every`` steps and at the end (early stopping watches these
        evaluations), checkpoints every ``ckpt_every`` steps and at the end (when
        ``ckpt_every > 0``), scores the test split once with the baselines, and on rank
        0 writes ``metrics.json`` and ``metrics.png`` into the run directory.

        Args:
            stop_after: stop after this step as if interrupted (no final evaluation, no
                final checkpoint beyond the periodic ones); for resume tests.
            plot: draw the PNG (matplotlib is imported only then).

        Raises:
            ValueError: ``stop_after`` is not a positive int.
            NonFiniteError: a non-finite step under ``nonfinite="stop"``.
        """
        cfg = self.preset.train
        if stop_after is not None and (
            isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1
        ):
            raise ValueError(f"stop_after must be a positive int, got {stop_after!r}")
        last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        bar = ProgressBar(cfg.steps, enabled=self.progress_enabled)
        if self.step and self.ctx.is_main:
            bar.write(f"resumed at step {self.step} from {self.last_checkpoint}")
            for note in self.resume_notes:
                bar.write(note)
        # Pipelined: step n + 1 is queued before step n's metrics are read, so the device
        # never waits for the host's bookkeeping. Evaluation, checkpoints, early stopping
        # and the end of the run wait for the queued step first. With an ``on_step``
        # callback every step is finished before the next is launched, so the callback
        # sees the model exactly as its step left it.
        pipelined = self.on_step is None
        pending: PendingStep | None = None
        while self.step < last and not self.stopped_early:
            launched = self.launch_step()
            if pending is not None:
                self._log_step(self.finish_step(pending), bar)
            pending = launched
            step = launched.step
            evaluate = cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
            checkpoint = cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.steps)
            if evaluate or checkpoint or step == last or not pipelined:
                self._log_step(self.finish_step(pending), bar)
                pending = None
                if evaluate:
                    self._eval_and_log(bar)
                if checkpoint or (cfg.ckpt_every and self.stopped_early):
                    self.save()
                self.drain()
        bar.close()
        interrupted = self.step < cfg.steps and not self.stopped_early
        if not interrupted:
            if not self.evals or self.evals[-1]["step"] != self.step:
                self._eval_and_log(bar)
            logistic = self.fit_logistic_baseline()
            record = self.evaluate(TEST, logistic=logistic)
            if self.ctx.is_main:
                self.test_record = record or None
                if record:
                    _warn_if_collapsed(record, bar)
        result = self._report(interrupted=interrupted, plot=plot)
        # Every rank past its last collective before any of them can tear the group down
        # (CI once saw rank 1 abort in the gloo teardown after a run had trained every
        # step; not reproduced since, so this is a precaution, not a proven fix).
        self.ctx.barrier()
        return result

    def _log_step(self, m: dict[str, float], bar: ProgressBar) -> None:
        cfg = self.preset.train
        if m["step"] % cfg.log_every == 0 or m["step"] == cfg.steps:
            for key in _HISTORY_KEYS:
                self.history[key].append(m[key])
        bar.update(
            int(m["step"]),
            loss=m["loss_ema"],
            auc=m["ctr_auc"],
            samples_per_s=m["samples_per_s"],
            mfu=m["mfu"] if self.peak_tflops else math.nan,
        )

    def _eval_and_log(self, bar: ProgressBar) -> None:
        record = self.evaluate(VALID)
        stop = False
        if self.ctx.is_main and record:
            self.evals.append(record)
            b = record["baselines"]
            ref = ", ".join(f"{k.replace('_', ' ')} {v['ctr_auc']:.4f}" for k, v in b.items())
            cvr = f", CVR AUC {record['cvr_auc']:.4f}" if "cvr_auc" in record else ""
            bar.write(
                f"validation @ step {record['step']}: CTR AUC {record['ctr_auc']:.4f} "
                f"({ref}), GAUC {record['ctr_gauc']:.4f}{cvr}, NE {record['ctr_ne']:.4f}"
            )
            _warn_if_collapsed(record, bar)
            # after the last step there is nothing left to stop: a run that trained
            # every step was reported as stopped early
            stop = self.step < self.preset.train.steps and self._should_stop_early()
            if stop:
                bar.write(
                    f"early stopping at step {self.step}: "
                    f"{self.preset.train.early_stopping_metric} has not improved for "
                    f"{self.preset.train.early_stopping_patience} evaluations"
                )
        self.stopped_early = bool(self._broadcast(stop))

    def _should_stop_early(self) -> bool:
        cfg = self.preset.train
        if not cfg.early_stopping_patience:
            return False
        best = best_validation(self.evals, cfg.early_stopping_metric)
        return best is not None and len(self.evals) - 1 - best[0] >= cfg.early_stopping_patience

    def _report(self, *, interrupted: bool, plot: bool) -> RunResult:
        if not self.ctx.is_main:
            return RunResult(
                self.out_dir, {}, None, None, self.last_checkpoint, interrupted, self.stopped_early
            )
        cfg = self.preset.train
        requests = self.step * cfg.global_batch_size
        test = self.test_record
        best = best_validation(self.evals, cfg.early_stopping_metric)
        metrics: dict[str, Any] = {
            "preset": self.preset.name,
            "version": __version__,
            "machine": _machine(self.ctx.device),
            "device": str(self.ctx.device),
            "world_size": self.ctx.world_size,
            "steps_completed": self.step,
            "interrupted": interrupted,
            "stopped_early": self.stopped_early,
            "requests_trained": requests,
            "epochs_trained": self.order.epoch(requests) if self.order.num_requests else None,
            "train_time_s": self.train_time_s,
            # This process only (a resumed run counts from its restart), set-up to report.
            "wall_time_s": time.perf_counter() - self._created,
            "mean_samples_per_s": requests / self.train_time_s if self.train_time_s else None,
            "mfu": self._mfu_summary(),
            "peak_memory_gb": torch.cuda.max_memory_allocated(self.ctx.device) / 1e9
            if self.ctx.device.type == "cuda"
            else None,
            "final": None if test is None else {k: v for k, v in test.items() if k != "baselines"},
            "baselines": None if test is None else test["baselines"],
            "logistic_regression_fit": getattr(self, "logistic_info", None),
            "best_validation": None
            if best is None
            else {"step": self.evals[best[0]]["step"], cfg.early_stopping_metric: best[1]},
            "data": self._data_summary(),
            "nonfinite_steps": self.nonfinite,
            "resume_notes": self.resume_notes,
            "bbs": self._bbs_summary(),
            "parallel": {
                "mesh": None if self.mesh is None else repr(self.mesh),
                "tables": self.tables,
                "embedding_optimizer": self.table_optimizer_kind,
            },
            "autoac": self.autoac_summary(),
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "config": self.preset.to_dict(),
            "eval": self.evals,
            "test": test,
            "history": self.history,
        }
        metrics = _jsonable(metrics)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.out_dir / "metrics.json"
        metrics_path.write_text(json.dumps(metrics, indent=1) + "\n")
        plot_path = None
        if plot and self.history["step"]:
            from hyperrec.integration.plot import plot_metrics

            plot_path = plot_metrics(metrics, self.out_dir / "metrics.png")
        return RunResult(
            self.out_dir,
            metrics,
            metrics_path,
            plot_path,
            self.last_checkpoint,
            interrupted,
            self.stopped_early,
        )

    def _mfu_summary(self) -> dict[str, Any]:
        """Model FLOPs utilisation of the run (see :mod:`hyperrec.integration.flops`)."""
        per_gpu = (
            self.flops_total / self.train_time_s / self.ctx.world_size / 1e12
            if self.train_time_s
            else None
        )
        return {
            "model_tflop_total": self.flops_total / 1e12,
            "tflops_per_gpu": per_gpu,
            "peak_tflops": self.peak_tflops,
            "peak_source": f"datasheet dense BF16 ({self.peak_source})"
            if self.peak_source
            else "n/a (CPU or unlisted device)",
            "mfu": per_gpu / self.peak_tflops if per_gpu and self.peak_tflops else None,
            "measured_matmul_tflops": self.matmul_tflops,
            "fraction_of_measured_matmul": per_gpu / self.matmul_tflops
            if per_gpu and self.matmul_tflops
            else None,
            "counting": "matmul FLOPs on unpadded tokens, attention over allowed pairs, "
            "training = 3x forward, recomputation and padding not counted",
        }

    def _data_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": type(self.source).__name__,
            "schema": dataclasses.asdict(self.schema),
            "requests": {name: self.source.num_requests(s) for s, name in SPLITS.items()},
            "evaluated_requests": {SPLITS[s]: int(v.size) for s, v in self._eval_ids.items()},
        }
        info = getattr(self.source, "info", None)
        if isinstance(info, dict):
            out["event_log"] = {k: v for k, v in info.items() if k != "key"}
        return out

    def _bbs_summary(self) -> dict[str, Any]:
        """Step-cost balance with BBS and in arrival order, over every step so far.

        ``across_ranks``: :class:`hyperrec.bbs.ImbalanceStats` of the (step, rank) cost
        matrix (what synchronous data parallelism loses to its slowest rank).
        ``step_cost_cv``: coefficient of variation of a rank's step cost over steps (what
        BBS flattens even on one rank).
        """
        cfg = self.preset.train
        out: dict[str, Any] = {
            "window_steps": cfg.window_steps,
            "sub_batch_size": cfg.sub_batch_size,
            "sub_batches_per_rank_step": self.sub_batches_per_rank,
        }
        # Steps of the current world size only (a resume on another one changes the shape).
        rows = [r for r in self.rank_costs if len(r) == self.ctx.world_size]
        if not rows:
            return out
        out["steps_counted"] = len(rows)
        c = np.asarray(rows, dtype=np.float64)  # (steps, ranks, 2)
        for i, name in enumerate(("balanced", "arrival_order")):
            per_step = c[:, :, i]
            out[name] = {
                "across_ranks": ImbalanceStats.from_step_costs(per_step).as_dict(),
                "step_cost_cv": float(per_step.std(axis=0).mean() / per_step.mean()),
            }
        return out

    def close(self) -> None:
        """Stop the data workers; release the process group if this trainer created it."""
        self.loader.close()
        self.ctx.close()


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda_allocator_conf"] = next(
            (os.environ[n] for n in _ALLOC_ENV if n in os.environ), None
        )
    return info


def best_validation(evals: list[dict[str, Any]], metric: str) -> tuple[int, float] | None:
    """(index into ``evals``, value) of the best finite ``metric`` (the first on ties)."""
    sign = EARLY_STOPPING_METRICS[metric]
    best = None
    for i, e in enumerate(evals):
        v = e.get(metric)
        if (
            isinstance(v, float)
            and math.isfinite(v)
            and (best is None or sign * v > sign * best[1])
        ):
            best = (i, v)
    return best


def _mean(xs: list[float]) -> float | None:
    finite = [x for x in xs if isinstance(x, float) and math.isfinite(x)]
    return sum(finite) / len(finite) if finite else None
