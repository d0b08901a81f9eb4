"""Helpers shared by the integration benchmarks (dev-only)."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = [
    "ALLOCATOR_COUNTERS",
    "JitLog",
    "allocator_counters",
    "counter_delta",
    "jsonable",
    "run_steps",
    "single_rank_group",
    "write_json",
]


def single_rank_group(device: str) -> bool:
    """A process group of one rank (file store; NCCL on CUDA, gloo on a CPU), so that
    the sharding configurations really wrap the model on a single device. Returns
    whether it created one (False: a group already existed); a caller that runs in
    another program's process (a test) destroys what it created."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store_dir = tempfile.mkdtemp(prefix="hyperrec-bench-store-")
    # the store's directory outlives the group; without this every call leaves one behind
    atexit.register(shutil.rmtree, store_dir, ignore_errors=True)
    path = os.path.join(store_dir, "store")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
    return True


def run_steps(
    trainer: Any, n: int, before_step: Callable[[int], None] | None = None
) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """``n`` steps exactly as ``Trainer.fit`` runs them (step k + 1 queued before step k's
    metrics are read), then drained. Returns the steps' metrics, the host's seconds to
    queue each step (``launch_step``) and to read each back while the next is queued
    (``finish_step``, where the host waits for the GPU; the last step's read is not timed:
    nothing is queued behind it). ``before_step(k)``, if given, runs before step k is
    queued (k = 0 .. n - 1), outside the timed calls."""
    import time

    metrics: list[dict[str, float]] = []
    launch: list[float] = []
    finish: list[float] = []
    pending = None
    for k in range(n):
        if before_step is not None:
            before_step(k)
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


class JitLog:
    """Triton kernels compiled (or loaded from Triton's disk cache) in this process, with
    when: a kernel first met in a timed step is a stall no warm-up covered (a new
    specialisation, e.g. an integer argument that became divisible by 16). Uses Triton's
    ``knobs.runtime`` JIT hooks where they exist (Triton >= 3.4); otherwise records
    nothing (``available`` False). Kernels Inductor generates are compiled outside these
    hooks (see the dynamo counters for its recompiles)."""

    def __init__(self) -> None:
        import time

        self._clock = time.perf_counter
        self.events: list[tuple[float, float, str]] = []  # (start, end, kernel)
        self._open: dict[int, tuple[float, str]] = {}
        self.available = False
        try:
            from triton import knobs

            runtime = knobs.runtime
            prev_cache, prev_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return

        def name_of(kwargs: dict[str, Any]) -> str:
            fn = kwargs.get("fn")
            return str(getattr(fn, "name", None) or kwargs.get("repr", "?"))[:120]

        # A diagnostic must not break the run it watches: a hook that fails (another
        # Triton version's arguments) records nothing.
        def on_miss(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                self._open[id(kwargs.get("key"))] = (self._clock(), name_of(kwargs))
            # falsy return: Triton goes on to compile (a truthy one would skip it)
            return prev_cache(*args, **kwargs) if prev_cache else None

        def on_compiled(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                now = self._clock()
                start, name = self._open.pop(id(kwargs.get("key")), (now, name_of(kwargs)))
                self.events.append((start, now, name))
            return prev_post(*args, **kwargs) if prev_post else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled
        self.available = True

    def per_step(self, step_starts: list[float], end: float) -> list[dict[str, Any]]:
        """Events between ``step_starts[0]`` and ``end`` (when the last step finished),
        each with the index of the step it fell in."""
        out = []
        for start, stop, name in self.events:
            if step_starts and step_starts[0] <= start < end:
                k = sum(1 for t in step_starts if t <= start) - 1
                out.append({"step": k, "kernel": name, "seconds": stop - start})
        return out


#: The CUDA caching allocator's counters that say whether a step went past the cache:
#: ``cudaMalloc``/``cudaFree`` calls (``num_device_*``), frees of the whole cache after a
#: failed allocation followed by a retry (``num_alloc_retries``; each synchronises the
#: device), and the synchronisations for blocks in use on other streams.
ALLOCATOR_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
    "allocation.all.allocated",
    "segment.all.allocated",
    "segment.all.freed",
)


def allocator_counters() -> dict[str, int]:
    """The :data:`ALLOCATOR_COUNTERS` of the current CUDA device (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def counter_delta(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    """Per-step increase of each counter in both snapshots."""
    return {k: (after[k] - before[k]) / max(steps, 1) for k in after if k in before}


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as None, tuples as lists (JSON-ready)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(out_dir: Any, stem: str, doc: Any) -> Any:
    """Write ``doc`` to ``out_dir/stem.json`` (the directory made if missing), say so on
    stdout and return the path."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1))
    print("wrote", path)
    return path
