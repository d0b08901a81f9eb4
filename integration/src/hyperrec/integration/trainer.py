"""The training loop: data -> model -> ESMM loss -> AdamW, with eval, checkpoints, metrics.

One :class:`Trainer` per process. With several ranks (``torchrun`` or an existing
process group) each rank reads its own requests (no data exchange), the model is
sharded by :func:`~hyperrec.integration.distributed.parallelize`, and the loss is
normalised by the *global* number of impressions of the step (one all-reduce), so a
run computes the same gradients on any world size for the same global batch.

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

import contextlib
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hyperrec.bbs import ImbalanceStats
from hyperrec.integration._version import __version__
from hyperrec.integration.baseline import PopularityBaseline
from hyperrec.integration.checkpoint import (
    checkpoint_dir,
    find_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from hyperrec.integration.config import (
    DENSE_TABLE_OPTIMIZERS,
    SHARDED_TABLE_OPTIMIZERS,
    Preset,
    TrainConfig,
)
from hyperrec.integration.data import EVAL, SyntheticRecsysData
from hyperrec.integration.distributed import (
    DistributedContext,
    build_mesh,
    init_distributed,
    parallelize,
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
from hyperrec.integration.model import GEMModel, esmm_loss, sharded_tables
from hyperrec.integration.pipeline import TrainStream, default_cost_model
from hyperrec.integration.progress import ProgressBar

__all__ = [
    "PendingStep",
    "RunResult",
    "StepRecord",
    "Trainer",
    "backward_and_update",
    "build_optimizer",
    "build_table_optimizer",
    "lr_factor",
    "resolve_tables",
]

_EVAL_CHUNK = 1024  # requests per eval forward
_EVAL_PADDED_TOKENS = 1 << 21  # ... and at most this many requests x history cap
_EMA_BETA = 0.95
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


@dataclass
class PendingStep:
    """A step whose device work is queued and whose metrics are not read yet
    (:meth:`Trainer.launch_step` -> :meth:`Trainer.finish_step`)."""

    step: int
    loaded: LoadedStep
    flops: FlopCount
    readout: torch.Tensor  # float64 [(n,) ctr sum, ctcvr sum, grad norm], host (pinned)
    preds: torch.Tensor  # float32 [C] P(click), host
    rank_costs: torch.Tensor | list[list[float]]  # per rank: cost, arrival cost, FLOPs
    n_local: int
    start: Any  # CUDA event, or host time
    end: Any  # CUDA event, or host time
    previous_end: Any  # the previous step's end event when steps ran back to back


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
    tables are not parameters: their row gradients are neither measured nor clipped."""
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    for opt in (optimizer, *extra):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grad_norm


def resolve_tables(cfg: TrainConfig, world_size: int, device: torch.device) -> tuple[str, str]:
    """``(placement, optimizer)`` of the tables for a run: ``TrainConfig.sparse`` "auto" is
    "sharded" on more than one rank or on a GPU, "dense" on a single CPU process;
    ``embedding_optimizer`` "auto" is "adamw" for dense tables, "rowwise_adagrad" for
    sharded ones.

    Raises:
        ValueError: an optimizer that does not train the resolved placement.
    """
    placement = cfg.sparse
    if placement == "auto":
        placement = "sharded" if world_size > 1 or device.type == "cuda" else "dense"
    opt = cfg.embedding_optimizer
    if opt == "auto":
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
    its role in ``"name"`` ("tables", "matrices", "vectors"). The dense tables join only
    with ``table_optimizer="adamw"`` (else :func:`build_table_optimizer` trains them);
    sharded tables are never parameters. ``cfg.optimizer_impl="fused"`` uses PyTorch's
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
    if table_optimizer == "adamw" and emb:
        lr = cfg.embedding_lr
        groups.insert(
            0, {"params": emb, "lr": lr, "base_lr": lr, "weight_decay": 0.0, "name": "tables"}
        )
    fused = True if cfg.optimizer_impl == "fused" else None
    return torch.optim.AdamW(groups, betas=(0.9, 0.98), eps=1e-8, fused=fused)


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
    dense = sharded = None
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


class Trainer:
    """Build everything for ``preset`` and train it.

    Args:
        preset: the run description.
        out_dir: run directory (metrics, plot, checkpoints). Default: the directory of
            the ``resume`` checkpoint's run, else ``runs/<preset>-<timestamp>/``.
        resume: a checkpoint or run directory to resume from (latest complete step).
        device: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.
        progress: draw the progress bar on stderr (rank 0).
        on_step: called on every rank after every step with a :class:`StepRecord`.

    Built from ``preset.train``: the device mesh (``mesh``: ``hyperrec.parallel5d``'s
    5-D mesh on any world size, or a flat axis), where the tables live (``sparse``: a
    sharded collection with a lazy row optimizer, or dense parameters) and autoac's plan
    (``activation_checkpointing="autoac"``: one profiled step of the heaviest of the
    first steps' batches, at construction; a resumed run takes the checkpointed plan).
    Attributes ``mesh``, ``tables`` / ``table_optimizer_kind``, ``optimizer`` (AdamW),
    ``dense_table_optimizer`` / ``sparse_optimizer`` and ``autoac`` expose them.

    Raises:
        ValueError: the global batch does not split over the world size; ``resume``
            has no complete checkpoint, another world size or another configuration; bad
            device; a mesh that does not fit the world size; an optimizer that does not
            train the tables' placement; an autoac budget below the step's floor (naming
            the smallest feasible budget), or none on a CPU.
    """

    def __init__(
        self,
        preset: Preset,
        *,
        out_dir: str | Path | None = None,
        resume: str | Path | None = None,
        device: str = "auto",
        progress: bool = True,
        on_step: Callable[[StepRecord], None] | None = None,
    ):
        if not isinstance(preset, Preset):
            raise TypeError(f"preset must be a Preset, got {type(preset).__name__}")
        self.preset = preset
        self._created = time.perf_counter()
        cfg = preset.train
        # The 5-D mesh asks for a process group even on one process (one rank, in memory).
        self.ctx: DistributedContext = init_distributed(device, single_rank_group=cfg.mesh == "5d")
        if self.ctx.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self.sub_batches_per_rank = cfg.sub_batches_per_rank(self.ctx.world_size)
        ckpt = None
        if resume is not None:
            ckpt = find_checkpoint(resume)
            if ckpt is None:
                raise ValueError(f"resume={str(resume)!r} holds no complete checkpoint")
        if out_dir is None:
            out_dir = ckpt.parent.parent if ckpt is not None else _default_out_dir(preset)
        self.out_dir = Path(self._broadcast(str(out_dir)))
        self.on_step = on_step
        self.progress_enabled = progress and self.ctx.is_main

        self.data = SyntheticRecsysData(preset.data)
        grouped = dist.is_available() and dist.is_initialized()
        self.mesh = None
        """The ``hyperrec.parallel5d.ParallelMesh`` of the run (``TrainConfig.mesh``), or None."""
        if cfg.mesh == "5d" or (cfg.mesh == "auto" and grouped):
            self.mesh = build_mesh(
                self.ctx, replicate=cfg.mesh_replicate, sparse_replicate=cfg.sparse_replicate
            )
        self.tables, self.table_optimizer_kind = resolve_tables(
            cfg, self.ctx.world_size, self.ctx.device
        )
        # Same seed on every rank: sharding splits parameters that start identical. Built on
        # the target device: the big presets' tables would be slow to initialise on a CPU.
        torch.manual_seed(cfg.seed)
        sharded = None
        if self.tables == "sharded":
            sparse_mesh = None if self.mesh is None else self.mesh.sparse_mesh
            sharded = sharded_tables(
                preset.model,
                preset.data,
                mesh=sparse_mesh,
                shard_axis="sparse_replicate" if sparse_mesh is not None else -1,
                device=self.ctx.device,
                seed=cfg.seed,
            )
        # The attention ops run without per-call validation (it would synchronise the
        # host every call): batches are validated once, on the CPU, by the loader.
        with torch.device(self.ctx.device):
            model = GEMModel.from_preset(preset, validate=False, sharded=sharded)
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
        if cfg.activation_checkpointing == "autoac" and ckpt is None:
            self._apply_autoac()
        self.stream = TrainStream(
            self.data,
            sub_batch_size=cfg.sub_batch_size,
            sub_batches_per_step=self.sub_batches_per_rank,
            window_steps=cfg.window_steps,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            cost=default_cost_model(preset.model.dim),
        )
        self.loader = StepLoader(
            self.stream,
            self.ctx.device,
            workers=cfg.data_workers,
            prefetch=cfg.prefetch_batches,
            validate=cfg.validate_inputs,
        )
        # MFU denominators: the datasheet peak of this device and the GEMM rate measured here.
        self.peak_tflops, self.peak_source = peak_tflops(self.ctx.device)
        self.matmul_tflops = measure_matmul_tflops(self.ctx.device)
        self.popularity = PopularityBaseline(preset.data.num_items)
        self.auc_window = WindowedAUC(cfg.auc_window)
        self.step = 0
        self.history: dict[str, list[Any]] = {k: [] for k in _HISTORY_KEYS}
        self.evals: list[dict[str, Any]] = []
        self.rank_costs: list[list[list[float]]] = []
        """Per step, per rank: [BBS step cost, arrival-order step cost]."""
        self.train_time_s = 0.0
        self.flops_total = 0.0
        """Model FLOPs (all ranks) of the steps this process trained."""
        self._ema = 0.0
        self._last_end: Any = None  # when (event or host time) the previous step ended
        self._last_auc = math.nan
        self.last_checkpoint: Path | None = None
        if ckpt is not None:
            self.load(ckpt)

    # -- helpers ------------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if not self.ctx.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _autocast(self) -> contextlib.AbstractContextManager:
        amp = self.preset.train.amp
        if amp == "bf16" or (amp == "auto" and self.ctx.device.type == "cuda"):
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- activation checkpointing --------------------------------------------------------
    def _probe_batch(self, steps: int = 16) -> Any:
        """The heaviest (most history tokens) of this rank's first ``steps`` arrival-order
        step batches: what autoac profiles, so that its plan holds for the heavy steps
        (its memory model scales with the tokens). Built from the data directly: the
        training stream is not advanced."""
        from hyperrec.integration.data import TRAIN

        cfg = self.preset.train
        k, world, rank = self.sub_batches_per_rank, self.ctx.world_size, self.ctx.rank
        best, best_tokens = None, -1
        for step in range(steps):
            subs = rank + world * np.arange(step * k, (step + 1) * k)
            ids = (subs[:, None] * cfg.sub_batch_size + np.arange(cfg.sub_batch_size)).reshape(-1)
            tokens = int(self.data.history_lengths(TRAIN, ids).sum())
            if tokens > best_tokens:
                best, best_tokens = ids, tokens
        batch = self.data.batch(TRAIN, best)
        if cfg.validate_inputs:
            validate_batch(batch, self.preset.data)
        return batch.to(self.ctx.device)

    def _ac_budgets(self) -> tuple[int, dict[str, int]]:
        cfg = self.preset.train
        if cfg.ac_budget_gb:
            budget = int(cfg.ac_budget_gb * 1e9)
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
        batch = self._probe_batch()
        n = float(batch.num_candidates)

        def step(model: torch.nn.Module) -> torch.Tensor:
            with self._autocast():
                ctr, cvr = model(batch)
            ctr_sum, ctcvr_sum = esmm_loss(ctr, cvr, batch.click, batch.conversion)
            return (ctr_sum + ctcvr_sum) / n

        # FLOP costs on the CPU and on several ranks: measured times vary with the load
        # (tests would not be reproducible) and from rank to rank (plans would differ).
        cost = "flops" if self.ctx.device.type == "cpu" or self.ctx.distributed else "time"
        formats = tuple(cfg.ac_formats)
        try:
            self.autoac = autoac.apply(
                self.model,
                budget=budget,
                region_budgets=regions or None,
                regions=[f"seq_layers.{i}" for i in range(len(self.model.seq_layers))],
                step_fn=step,
                formats=formats,
                profile_config=autoac.ProfileConfig(steps=1, cost=cost, seed=cfg.seed),
                # The verification replans until packing is within its error bound: a
                # number of steps that could differ between ranks, whose FSDP collectives
                # must pair.
                verify=not (formats and self.ctx.distributed),
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
            "regions": {
                r.name: {"mode": r.mode, "held_gb": r.held_bytes / 1e9, "added_s": r.added_s}
                for r in plan.regions
            },
            "verification": self.autoac.verification,
        }

    # -- one step -----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """Run one optimizer step; returns its metrics (identical on every rank).

        Synchronous: it waits for the step to finish. :meth:`fit` instead overlaps each
        step's bookkeeping with the next step's device work (see :meth:`launch_step`).
        """
        return self.finish_step(self.launch_step())

    def launch_step(self) -> PendingStep:
        """Enqueue one step's device work and return without waiting for it.

        Nothing here reads a device value: the batch arrives through the loader (built and
        validated ahead, copied on a side stream), sizes come from shapes and the CPU
        copy of the batch, and the values the host needs (loss sums, gradient norm,
        predictions) are copied into pinned host buffers behind an event that
        :meth:`finish_step` waits on later, once the next step is queued.
        """
        cfg = self.preset.train
        t0 = time.perf_counter()
        dev = self.ctx.device
        cuda = dev.type == "cuda"
        loaded = self.loader.next()
        batch, host = loaded.batch, loaded.host
        step = self.step + 1
        for opt in (self.optimizer, *self._extra_optimizers):
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_factor(step, cfg)
        shape = StepShape.from_batch(host)
        flops = model_flops(
            self.preset.model, self.preset.data, shape.history_lengths, shape.candidate_counts
        )
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()

        with self._autocast():
            ctr_logit, cvr_logit = self.model(batch)
        ctr_sum, ctcvr_sum = esmm_loss(ctr_logit, cvr_logit, batch.click, batch.conversion)
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
        else:
            sums = torch.stack([ctr_sum.detach().double(), ctcvr_sum.detach().double()])
            rank_costs = [local]
            loss = (ctr_sum + ctcvr_sum) / float(n_local)
        grad_norm = backward_and_update(
            loss, self.model, self.optimizer, cfg.grad_clip, self._extra_optimizers
        )
        readout = torch.cat([sums, grad_norm.detach().double().reshape(1)])
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
        pending = PendingStep(
            step=step,
            loaded=loaded,
            flops=flops,
            readout=readout,
            preds=preds,
            rank_costs=rank_costs,
            n_local=n_local,
            start=start if cuda else t0,
            end=end,
            previous_end=self._last_end,
        )
        # Start building/copying the next batch now, behind this step's device work.
        self.loader.prefetch()
        self._last_end = end if cuda else None
        if not cuda:
            pending.end = time.perf_counter()
        return pending

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
        keeps the device busy while the host waits."""
        cfg = self.preset.train
        if isinstance(p.end, torch.cuda.Event):
            p.end.synchronize()
            since = p.previous_end if p.previous_end is not None else p.start
            elapsed = since.elapsed_time(p.end) / 1e3
        else:
            elapsed = float(p.end) - float(p.start)
        values = p.readout.tolist()
        if self.ctx.distributed:
            n, ctr_total, ctcvr_total, grad_norm = values
            rank_costs = p.rank_costs.reshape(-1, 3).tolist()  # type: ignore[union-attr]
        else:
            ctr_total, ctcvr_total, grad_norm = values
            n = float(p.n_local)
            rank_costs = p.rank_costs  # type: ignore[assignment]
        self.rank_costs.append([row[:2] for row in rank_costs])
        balanced, arrival = ([row[i] for row in rank_costs] for i in (0, 1))
        step_flops = float(sum(row[2] for row in rank_costs))
        self.train_time_s += elapsed
        self.flops_total += step_flops
        host = p.loaded.host
        self.auc_window.update(p.preds, host.click)
        loss_value = (ctr_total + ctcvr_total) / n
        self._ema = _EMA_BETA * self._ema + (1.0 - _EMA_BETA) * loss_value
        log = p.step % cfg.log_every == 0 or p.step == cfg.steps
        tflops = step_flops / elapsed / self.ctx.world_size / 1e12 if elapsed > 0 else math.nan
        metrics = {
            "step": p.step,
            "loss": loss_value,
            "loss_ema": self._ema / (1.0 - _EMA_BETA**p.step),
            "ctr_loss": ctr_total / n,
            # The exact windowed AUC costs host time: recomputed only on recorded steps.
            "ctr_auc": self._auc(log),
            "lr": next(g["lr"] for g in self.optimizer.param_groups if g["name"] == "matrices"),
            "grad_norm": float(grad_norm),
            "samples_per_s": cfg.global_batch_size / elapsed if elapsed > 0 else math.nan,
            "step_time_s": elapsed,
            "cost_max_over_mean": max(balanced) / (sum(balanced) / len(balanced)),
            "arrival_cost_max_over_mean": max(arrival) / (sum(arrival) / len(arrival)),
            "step_tflop": step_flops / 1e12,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else math.nan,
        }
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    step=p.step,
                    loss=loss_value,
                    sample_ids=host.sample_ids.clone(),
                    sub_batches=p.loaded.plan.sub_batches,
                )
            )
        return metrics

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Score the held-out split; returns the record on rank 0 (``{}`` elsewhere).

        The record holds the model's metrics (see
        :func:`~hyperrec.integration.metrics.task_metrics`) and its held-out loss, plus the
        same metrics for the popularity baseline (counts so far, all ranks) and for the
        hidden ground truth (the Bayes-optimal ceiling).
        """
        world, rank = self.ctx.world_size, self.ctx.rank
        total = self.preset.data.eval_requests
        counts = self.popularity.global_counts(self.ctx.device)
        pop_ctr, pop_cvr = PopularityBaseline.rates(counts, self.popularity.prior_strength)
        local = np.arange(rank, total, world)
        # Every rank runs the same number of forwards (FSDP all-gathers are collective).
        # Padded (naive) attention at long caps needs smaller forwards: bound the chunk by
        # requests and by padded tokens.
        chunk = max(1, min(_EVAL_CHUNK, _EVAL_PADDED_TOKENS // self.preset.data.max_seqlen))
        n_chunks = max(1, math.ceil(math.ceil(total / world) / chunk))
        parts: dict[str, list[torch.Tensor]] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            for piece in np.array_split(local, n_chunks):
                ids = piece if piece.size else np.zeros(1, dtype=np.int64)
                batch, (true_ctr, true_cvr) = self.data.batch_and_truth(EVAL, ids)
                if self.preset.train.validate_inputs:
                    validate_batch(batch, self.preset.data)
                with self._autocast():
                    ctr_logit, cvr_logit = self.model(batch.to(self.ctx.device))
                if not piece.size:
                    continue
                ctr_sum, ctcvr_sum = esmm_loss(
                    ctr_logit.cpu(), cvr_logit.cpu(), batch.click, batch.conversion
                )
                items = batch.candidate_items
                for key, value in (
                    ("p_ctr", torch.sigmoid(ctr_logit.float()).cpu()),
                    ("p_cvr", torch.sigmoid(cvr_logit.float()).cpu()),
                    ("click", batch.click),
                    ("conversion", batch.conversion),
                    ("pop_ctr", pop_ctr[items]),
                    ("pop_cvr", pop_cvr[items]),
                    ("true_ctr", true_ctr),
                    ("true_cvr", true_cvr),
                    ("loss_sum", (ctr_sum + ctcvr_sum).reshape(1).double()),
                ):
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
        click, conv = allp["click"], allp["conversion"]
        record: dict[str, Any] = {
            "step": self.step,
            "loss": float(allp["loss_sum"].sum() / click.numel()),
            **task_metrics(allp["p_ctr"], allp["p_cvr"], click, conv),
            "popularity": task_metrics(allp["pop_ctr"], allp["pop_cvr"], click, conv),
            "ground_truth": task_metrics(allp["true_ctr"], allp["true_cvr"], click, conv),
            "impressions": int(click.numel()),
        }
        return record

    # -- checkpoints --------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step (collective); returns its directory."""
        path = checkpoint_dir(self.out_dir, self.step)
        rng = {"cpu": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        save_checkpoint(
            path,
            model=self.model,
            optimizer=self._dense_optimizers(),
            extra=self._checkpointed_objects(),
            meta={
                "step": self.step,
                "preset": self.preset.to_dict(),
                "history": self.history,
                "evals": self.evals,
                "rank_costs": self.rank_costs,
                "train_time_s": self.train_time_s,
                "flops_total": self.flops_total,
                "ema": self._ema,
            },
            rank_state={
                "stream": self.loader.state_dict(),
                "rng": rng,
                "auc_window": self.auc_window.state_dict(),
                "autoac": None if self.autoac is None else self.autoac.state_dict(),
                "tables": (self.tables, self.table_optimizer_kind),
            },
            rank_tensors={"popularity": self.popularity.counts},
        )
        self.last_checkpoint = path
        return path

    def load(self, path: str | Path) -> None:
        """Restore the state saved by :meth:`save` (collective).

        Raises:
            ValueError: the checkpoint's preset differs in a field that changes the run
                (anything but steps / eval / checkpoint / logging cadence), or its world
                size differs.
        """
        saved, now = read_meta(path)["preset"], self.preset.to_dict()
        cadence = {"steps", "eval_every", "ckpt_every", "log_every"}
        for section in ("data", "model", "train"):
            for key, value in now[section].items():
                if section == "train" and key in cadence:
                    continue
                if saved[section].get(key) != value:
                    raise ValueError(
                        f"checkpoint {path} was trained with {section}.{key}="
                        f"{saved[section].get(key)!r}, this run has {value!r}"
                    )
        meta, state = load_checkpoint(
            path,
            model=self.model,
            optimizer=self._dense_optimizers(),
            extra=self._checkpointed_objects(),
            rank_tensors={"popularity": self.popularity.counts},
        )
        tables = state.get("tables", ("dense", "adamw"))
        if tuple(tables) != (self.tables, self.table_optimizer_kind):
            raise ValueError(
                f"checkpoint {path} trained {tables[0]} tables with {tables[1]}, this run has "
                f"{self.tables} tables with {self.table_optimizer_kind}"
            )
        if state.get("autoac") is not None:
            # The saved plan, not a new profile: quantized saves change the numerics, so an
            # exact resume needs the same decisions.
            from hyperrec import autoac

            plan = autoac.Plan.from_dict(state["autoac"]["plan"])
            if self.autoac is None:
                self.autoac = autoac.apply_plan(self.model, plan)
            else:
                self.autoac.set_plan(plan)
        self.step = meta["step"]
        self.history = meta["history"]
        self.evals = meta["evals"]
        self.rank_costs = meta["rank_costs"]
        self.train_time_s = meta["train_time_s"]
        self.flops_total = meta.get("flops_total", 0.0)
        self._ema = meta["ema"]
        self.stream.load_state_dict(state["stream"])
        self.loader.reset()
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.ctx.device)
        self.auc_window.load_state_dict(state["auc_window"])
        self.last_checkpoint = Path(path)

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

        Evaluates every ``eval_every`` steps and at the end, checkpoints every
        ``ckpt_every`` steps and at the end (when ``ckpt_every > 0``), and on rank 0
        writes ``metrics.json`` and ``metrics.png`` into the run directory.

        Args:
            stop_after: stop after this step as if interrupted (no final eval, no
                final checkpoint beyond the periodic ones); for resume tests.
            plot: draw the PNG (matplotlib is imported only then).
        """
        cfg = self.preset.train
        if stop_after is not None and (not isinstance(stop_after, int) or stop_after < 1):
            raise ValueError(f"stop_after must be a positive int, got {stop_after!r}")
        last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        bar = ProgressBar(cfg.steps, enabled=self.progress_enabled)
        if self.step and self.ctx.is_main:
            bar.write(f"resumed at step {self.step} from {self.last_checkpoint}")
        # Pipelined: step n + 1 is queued before step n's metrics are read, so the device
        # never waits for the host's bookkeeping. Evaluation, checkpoints and the end of
        # the run wait for the queued step first.
        pending: PendingStep | None = None
        while self.step < last:
            launched = self.launch_step()
            if pending is not None:
                self._log_step(self.finish_step(pending), bar)
            pending = launched
            step = launched.step
            evaluate = cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
            checkpoint = cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.steps)
            if evaluate or checkpoint or step == last:
                self._log_step(self.finish_step(pending), bar)
                pending = None
                if evaluate:
                    self._eval_and_log(bar)
                if checkpoint:
                    self.save()
                self.drain()
        bar.close()
        interrupted = self.step < cfg.steps
        if not interrupted and (not self.evals or self.evals[-1]["step"] != self.step):
            self._eval_and_log(bar)
        return self._report(interrupted=interrupted, plot=plot)

    def _log_step(self, m: dict[str, float], bar: ProgressBar) -> None:
        cfg = self.preset.train
        if m["step"] % cfg.log_every == 0 or m["step"] == cfg.steps:
            for key in _HISTORY_KEYS:
                self.history[key].append(m[key])
        bar.update(
            m["step"],
            loss=m["loss_ema"],
            auc=m["ctr_auc"],
            samples_per_s=m["samples_per_s"],
            mfu=m["mfu"] if self.peak_tflops else math.nan,
        )

    def _eval_and_log(self, bar: ProgressBar) -> None:
        record = self.evaluate()
        if self.ctx.is_main:
            self.evals.append(record)
            bar.write(
                f"eval @ step {record['step']}: CTR AUC {record['ctr_auc']:.4f} "
                f"(popularity {record['popularity']['ctr_auc']:.4f}, "
                f"ground truth {record['ground_truth']['ctr_auc']:.4f}), "
                f"CVR AUC {record['cvr_auc']:.4f}, NE {record['ctr_ne']:.4f}"
            )

    def _report(self, *, interrupted: bool, plot: bool) -> RunResult:
        if not self.ctx.is_main:
            return RunResult(self.out_dir, {}, None, None, self.last_checkpoint, interrupted)
        cfg = self.preset.train
        requests = self.step * cfg.global_batch_size
        final = self.evals[-1] if self.evals else None
        metrics: dict[str, Any] = {
            "preset": self.preset.name,
            "version": __version__,
            "machine": _machine(self.ctx.device),
            "device": str(self.ctx.device),
            "world_size": self.ctx.world_size,
            "steps_completed": self.step,
            "interrupted": interrupted,
            "requests_trained": requests,
            "train_time_s": self.train_time_s,
            # This process only (a resumed run counts from its restart), set-up to report.
            "wall_time_s": time.perf_counter() - self._created,
            "mean_samples_per_s": requests / self.train_time_s if self.train_time_s else None,
            "mfu": self._mfu_summary(),
            "peak_memory_gb": torch.cuda.max_memory_allocated(self.ctx.device) / 1e9
            if self.ctx.device.type == "cuda"
            else None,
            "final": None
            if final is None
            else {k: v for k, v in final.items() if k not in ("popularity", "ground_truth")},
            "baselines": None
            if final is None
            else {"popularity": final["popularity"], "ground_truth": final["ground_truth"]},
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
            self.out_dir, metrics, metrics_path, plot_path, self.last_checkpoint, interrupted
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
        if not self.rank_costs:
            return out
        c = np.asarray(self.rank_costs, dtype=np.float64)  # (steps, ranks, 2)
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
    return info


def _mean(xs: list[float]) -> float | None:
    finite = [x for x in xs if isinstance(x, float) and math.isfinite(x)]
    return sum(finite) / len(finite) if finite else None
