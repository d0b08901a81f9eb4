"""Run code on real gloo ranks, or build large meshes on the fake backend."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "fake_mesh", "run_on_ranks"]


class RankError(RuntimeError):
    """A rank raised; ``rank`` and the remote ``traceback`` text are attached."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    # One thread per rank: on a 2-core CI machine several ranks would otherwise
    # oversubscribe the cores and make collectives time out.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            out = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real processes of one process group.

    Each rank is a freshly spawned process that initialises the default process group
    (``backend``, a file store in a temporary directory, so no ports are involved) and
    then calls ``fn``; inside ``fn`` use ``torch.distributed.get_rank()``. ``fn`` and its
    arguments must be picklable (a module-level function).

    Returns:
        ``[result of rank 0, ..., result of rank world_size-1]`` (results must pickle).

    Raises:
        ValueError: ``world_size < 1``.
        RankError: the lowest failing rank's exception, with its traceback.
        TimeoutError: not every rank finished within ``timeout_s`` (hung collective).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hyperrec-gloo-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, backend, fn, args, kwargs, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outs: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(outs))} did not finish "
                        f"within {timeout_s}s"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if r not in outs and p.exitcode is not None
                    ]
                    if dead:
                        # Give a dying rank a moment to flush its result before blaming it.
                        time.sleep(0.5)
                        if results.empty():
                            raise RankError(
                                dead[0], f"process exited with code {procs[dead[0]].exitcode}"
                            ) from None
                    continue
                outs[rank] = (ok, payload)
                if not ok:
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if len(outs) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = sorted(r for r, (ok, _) in outs.items() if not ok)
    if failed:
        raise RankError(failed[0], outs[failed[0]][1])
    return [outs[r][1] for r in range(world_size)]


@contextlib.contextmanager
def fake_mesh(
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    rank: int = 0,
    device_type: str = "cpu",
) -> Iterator[torch.distributed.device_mesh.DeviceMesh]:
    """A ``DeviceMesh`` of ``prod(mesh_shape)`` ranks in this one process (fake backend).

    For structure-only checks of meshes far larger than the machine (e.g. 4,096 ranks):
    groups, coordinates and sizes are real; collectives return garbage. The default
    process group is created on entry and destroyed on exit.

    Raises:
        ValueError: empty or non-positive ``mesh_shape``, ``rank`` out of range, or
            ``mesh_dim_names`` of another length.
        RuntimeError: a default process group already exists.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be non-empty positive ints, got {mesh_shape!r}")
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise ValueError(
            f"mesh_dim_names has {len(mesh_dim_names)} names for a {len(shape)}-axis mesh"
        )
    world_size = math.prod(shape)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("fake_mesh needs no default process group to exist")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh(
            device_type, shape, mesh_dim_names=tuple(mesh_dim_names) if mesh_dim_names else None
        )
    finally:
        dist.destroy_process_group()
