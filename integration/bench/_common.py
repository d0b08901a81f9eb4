"""Helpers shared by the integration benchmarks (dev-only)."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

__all__ = ["jsonable", "single_rank_group"]


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


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as None, tuples as lists (JSON-ready)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
