"""Helpers shared by the integration benchmarks (dev-only)."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

__all__ = ["jsonable", "run_steps", "single_rank_group"]


def single_rank_group(device: str) -> bool:
    """A process group of one rank (file store; NCCL on CUDA, gloo on a CPU), so that
    the sharding configurations really wrap the model on a single device. Returns
    whether it created one (False: a group already existed); a caller that runs in
    another program's process (a test) destroys what it created."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    path = os.path.join(tempfile.mkdtemp(prefix="hyperrec-bench-store-"), "store")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
    return True


def run_steps(trainer: Any, n: int) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """``n`` steps exactly as ``Trainer.fit`` runs them (step k + 1 queued before step k's
    metrics are read), then drained. Returns the steps' metrics, the host's seconds to
    queue each step (``launch_step``) and to read each back while the next is queued
    (``finish_step``, where the host waits for the GPU; the last step's read is not timed:
    nothing is queued behind it)."""
    import time

    metrics: list[dict[str, float]] = []
    launch: list[float] = []
    finish: list[float] = []
    pending = None
    for _ in range(n):
        t = time.perf_counter()
        launched = trainer.launch_step()
        launch.append(time.perf_counter() - t)
        if pending is not None:
            t = time.perf_counter()
            metrics.append(trainer.finish_step(pending))
            finish.append(time.perf_counter() - t)
        pending = launched
    if pending is not None:
        metrics.append(trainer.finish_step(pending))
    trainer.drain()
    return metrics, launch, finish


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as None, tuples as lists (JSON-ready)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
