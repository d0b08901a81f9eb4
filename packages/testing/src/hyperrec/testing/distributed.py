"""Run code on real gloo ranks, or build large meshes on the fake backend."""

from __future__ import annotations

import contextlib
import datetime
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

__all__ = ["TIMEOUT_ENV", "RankError", "default_timeout_s", "fake_mesh", "run_on_ranks"]

#: Environment variable: the default deadline of :func:`run_on_ranks` in seconds.
TIMEOUT_ENV = "HYPERREC_TEST_TIMEOUT_S"
#: Environment variable: a factor on every deadline (explicit ``timeout_s`` included), for
#: machines slower or busier than the one a test's explicit deadline was sized on.
TIMEOUT_SCALE_ENV = "HYPERREC_TEST_TIMEOUT_SCALE"
# Generous on purpose: a 2-core CI machine running several test processes at once
# spends minutes just starting 8 Python processes that import torch; a timeout is
# for hangs, not for slowness.
_DEFAULT_TIMEOUT_S = 900.0
# Starting the ranks (spawn, import torch, rendezvous) is bounded separately from
# ``timeout_s``: on a loaded machine it alone can take longer than a short deadline.
_STARTUP_S = 300.0
_READY, _OK, _FAILED = "ready", "ok", "failed"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {raw!r}")
    return value


def default_timeout_s() -> float:
    """The deadline :func:`run_on_ranks` uses when none is given: ``$HYPERREC_TEST_TIMEOUT_S``
    (default 900 s) times ``$HYPERREC_TEST_TIMEOUT_SCALE`` (default 1).

    Raises:
        ValueError: an environment variable that is not a positive number.
    """
    return _env_float(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S) * _env_float(TIMEOUT_SCALE_ENV, 1.0)


def _pg_timeout_s(deadline_s: float) -> float:
    # A collective stuck on a dead or hung peer raises inside its rank (with a traceback
    # naming the collective) shortly before the parent's deadline kills every rank.
    return max(0.8 * deadline_s, deadline_s - 60.0, 1.0)


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
    timeout_s: float,
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
        timeout = datetime.timedelta(seconds=timeout_s)
        # A file store in a private temporary directory: no TCP port, so any number of
        # test processes can run side by side without colliding.
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timeout)  # rendezvous: the last rank may start minutes late
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        results.put((rank, _READY, None))
        try:
            out = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, _OK, out))
    except BaseException:
        results.put((rank, _FAILED, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real processes of one process group.

    Each rank is a freshly spawned process that initialises the default process group
    (``backend``, a file store in a temporary directory, so no ports are involved) and
    then calls ``fn``; inside ``fn`` use ``torch.distributed.get_rank()``. ``fn`` and its
    arguments must be picklable (a module-level function).

    Timeouts: once every rank has joined the process group, ``fn`` must finish on all
    of them within ``timeout_s`` (default :func:`default_timeout_s`:
    ``$HYPERREC_TEST_TIMEOUT_S`` or 900 s), multiplied by
    ``$HYPERREC_TEST_TIMEOUT_SCALE`` (default 1). Starting the ranks (spawn, imports,
    rendezvous) has its own bound of ``max(timeout_s, 300 s)`` (also scaled), so a slow
    start on a busy machine does not eat a short deadline. The process group's own
    timeout (each collective, and the rendezvous) is a little shorter than the
    deadline, so a collective blocked on a dead peer fails inside its rank with a
    traceback first.

    Returns:
        ``[result of rank 0, ..., result of rank world_size-1]`` (results must pickle).

    Raises:
        TypeError: ``fn`` not callable, ``world_size``, ``backend`` or ``timeout_s`` of
            the wrong type.
        ValueError: ``world_size < 1``, a non-positive ``timeout_s``, a bad timeout
            environment variable.
        RankError: the lowest failing rank's exception, with its traceback.
        TimeoutError: not every rank finished within the deadline (hung collective).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a positive int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'gloo', got {type(backend).__name__}")
    if timeout_s is None:
        timeout_s = default_timeout_s()
    else:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s!r}")
        timeout_s = float(timeout_s) * _env_float(TIMEOUT_SCALE_ENV, 1.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hyperrec-gloo-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    store_path,
                    _pg_timeout_s(timeout_s),
                    backend,
                    fn,
                    args,
                    kwargs,
                    results,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outs: dict[int, tuple[bool, Any]] = {}
        ready: set[int] = set()
        startup_s = max(timeout_s, _STARTUP_S * _env_float(TIMEOUT_SCALE_ENV, 1.0))
        deadline = time.monotonic() + startup_s
        try:
            while len(outs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    started = len(ready) == world_size
                    late = sorted(set(range(world_size)) - (set(outs) if started else ready))
                    what = (
                        f"did not finish within {timeout_s:g}s"
                        if started
                        else f"did not join the process group within {startup_s:g}s"
                    )
                    raise TimeoutError(
                        f"ranks {late} {what} (raise ${TIMEOUT_SCALE_ENV} on a slow machine)"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
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
                if status == _READY:
                    ready.add(rank)
                    if len(ready) == world_size:
                        # Everyone is in: from now on only fn's own time counts.
                        deadline = time.monotonic() + timeout_s
                    continue
                ready.add(rank)  # a rank that failed during startup reports here directly
                outs[rank] = (status == _OK, payload)
                if status != _OK:
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
        TypeError: ``mesh_shape`` not a sequence of ints, ``mesh_dim_names`` not a
            sequence of strings, ``rank`` not an int, ``device_type`` not a str.
        ValueError: empty or non-positive ``mesh_shape``, ``rank`` out of range, or
            ``mesh_dim_names`` of another length or with duplicates.
        RuntimeError: a default process group already exists.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if isinstance(mesh_shape, str | bytes) or not isinstance(mesh_shape, Sequence):
        raise TypeError(f"mesh_shape must be a sequence of ints, got {mesh_shape!r}")
    shape = tuple(mesh_shape)
    if any(isinstance(s, bool) or not isinstance(s, int) for s in shape):
        raise TypeError(f"mesh_shape must hold ints, got {mesh_shape!r}")
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be non-empty positive ints, got {mesh_shape!r}")
    if mesh_dim_names is not None:
        if isinstance(mesh_dim_names, str) or not isinstance(mesh_dim_names, Sequence):
            raise TypeError(f"mesh_dim_names must be a sequence of str, got {mesh_dim_names!r}")
        if not all(isinstance(n, str) for n in mesh_dim_names):
            raise TypeError(f"mesh_dim_names must hold strings, got {mesh_dim_names!r}")
        if len(mesh_dim_names) != len(shape):
            raise ValueError(
                f"mesh_dim_names has {len(mesh_dim_names)} names for a {len(shape)}-axis mesh"
            )
        if len(set(mesh_dim_names)) != len(mesh_dim_names):
            raise ValueError(f"mesh_dim_names must be distinct, got {mesh_dim_names!r}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str, got {type(device_type).__name__}")
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
