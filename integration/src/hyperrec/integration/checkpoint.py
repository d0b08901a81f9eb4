"""Distributed checkpoints (``torch.distributed.checkpoint``) that resume a run exactly.

A checkpoint is one directory ``<run>/checkpoints/step_<N>/`` holding:

- ``model`` / ``optim``: from :func:`torch.distributed.checkpoint.state_dict.get_state_dict`,
  so plain modules and FSDP2-sharded ones (DTensor parameters) save the same way and
  every rank writes only its own shards (``optim``: one optimizer or several);
- ``extra``: other stateful objects by name (e.g. the sharded tables' optimizer, whose
  states are sharded DTensors but not of any parameter), each its ``state_dict()``,
  loaded in place and handed back to its ``load_state_dict``;
- ``meta``: one small object common to all ranks (step, world size, metric history);
- ``rank<r>``: what differs per rank: the data pipeline's state (the BBS window, the
  reader position), the RNG states (dropout), the popularity counts, the training-AUC
  window. Tensors of known shape stay tensors; the rest is one pickled blob;
- ``MANIFEST.json``: every file's size and SHA-256, plus a small ``info`` record (the
  trainer's: the run's preset, data source and table placement, readable without DCP).

**Atomic commit**: the ranks write into ``.step_<N>.partial/``; then each rank hashes
its share of the files, rank 0 writes the manifest (fsynced) and renames the directory
to ``step_<N>`` (fsynced), and only then do the ranks go on. A run killed while saving
leaves a ``.partial`` directory that nothing reads (the next save replaces it); a
``step_<N>`` directory always had a complete manifest when it was renamed. A save that
replaces an existing ``step_<N>`` first moves it to ``.step_<N>.old`` (removed after the
rename); a run killed in between finds the old one there (:func:`list_checkpoints`).
**Verification**: :func:`verify_checkpoint` checks every file against the manifest
(missing, truncated or changed files raise :class:`CheckpointError` naming the file);
:func:`load_checkpoint` verifies before reading, and :func:`list_checkpoints` /
:func:`find_checkpoint` skip directories that cannot be complete, so a resume from a run
directory falls back to the previous complete checkpoint (see the trainer).
Checkpoints of 0.1.x (no manifest, DCP's ``.metadata`` as the completeness mark) still
load, unverified.

**World size**: the model, the optimizers and ``extra`` objects whose states are
DTensors (the sharded tables' rows and row states) reshard through DCP. The per-rank data
position does not split, so :func:`load_checkpoint` with ``all_ranks=True`` returns
every old rank's state for :func:`~hyperrec.integration.pipeline.reshard_streams`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as _DCPError
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyperrec.raggedshard import RaggedLoadPlanner, RaggedSavePlanner

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "checkpoint_dir",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "read_meta",
    "save_checkpoint",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_DIR = re.compile(r"^\.step_(\d+)\.old$")
MANIFEST = "MANIFEST.json"
"""Name of the manifest file of a checkpoint directory."""
_MANIFEST_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, truncated or corrupt."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step, 8 digits>``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    meta: dict[str, Any],
    rank_state: dict[str, Any],
    rank_tensors: dict[str, torch.Tensor] | None = None,
    extra: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write a checkpoint to ``path`` atomically (collective: every rank calls it).

    Args:
        path: the checkpoint directory; replaced if it exists (a resumed run re-writes
            the steps after its checkpoint; their content is identical).
        model, optimizer: saved through ``get_state_dict`` (sharded DTensors: each rank
            writes its own pieces, ragged ones through the raggedshard planners);
            ``optimizer`` may be a list.
        extra: name -> object with ``state_dict()`` / ``load_state_dict()``.
        meta: picklable; must hold ``"step"``. Rank 0's is saved (what the other ranks
            pass is ignored).
        rank_state: picklable state of this rank.
        rank_tensors: this rank's tensors of a shape known before loading.
        info: JSON-ready, identical on every rank: stored in the manifest, readable
            with :func:`read_manifest` without loading anything else.
        before_commit: called on every rank after the files are written and before
            the manifest and the rename (fault-injection tests kill a rank there).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``meta`` lacks an int ``"step"``.
    """
    if not isinstance(meta.get("step"), int):
        raise ValueError("meta must hold the int 'step' of the checkpoint")
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    if _rank() == 0:
        if partial.exists():  # left by a run killed while saving
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    meta = {**meta, "world_size": _world()}
    state = {
        "model": model_sd,
        "optim": optim_sd,
        f"rank{_rank()}": {"blob": pickle.dumps(rank_state), "tensors": dict(rank_tensors or {})},
    }
    if _rank() == 0:
        # Rank 0's meta only. Given by every rank, DCP's dedup keeps the copy of whichever
        # rank has planned the fewest bytes so far (rank 1 in the trainer's two-rank runs),
        # and a meta that is not quite identical then loses rank 0's part: the trainer's
        # validation records (kept on rank 0 only) and its training-AUC history vanished
        # from every resumed multi-rank run.
        state["meta"] = pickle.dumps(meta)
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    writer = dcp.FileSystemWriter(str(partial), overwrite=True)
    with _quiet_single_process():
        dcp.save(
            state, storage_writer=writer, planner=RaggedSavePlanner(), no_dist=not _distributed()
        )
    # dcp.save returns once every rank's files and the metadata are written.
    names = sorted(p.name for p in partial.iterdir() if p.is_file())
    mine = {
        n: [(partial / n).stat().st_size, _sha256(partial / n)] for n in names[_rank() :: _world()]
    }
    hashed: dict[str, list[Any]] = {}
    for part in _all_gather(mine):
        hashed.update(part)
    if before_commit is not None:
        before_commit()
    if _rank() == 0:
        manifest = {
            "format": _MANIFEST_FORMAT,
            "step": meta["step"],
            "world_size": _world(),
            "files": {n: {"bytes": hashed[n][0], "sha256": hashed[n][1]} for n in names},
            "info": info or {},
        }
        with open(partial / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(partial)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        partial.rename(path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint at ``path``, or ``None`` for a 0.1.x checkpoint.

    Raises:
        CheckpointError: no manifest and no DCP metadata (not a complete checkpoint), or
            an unreadable manifest.
    """
    path = Path(path)
    m = path / MANIFEST
    if not m.is_file():
        if (path / ".metadata").is_file():
            return None
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST} (was the run killed "
            "while writing it?)"
        )
    try:
        manifest = json.loads(m.read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON object was expected, got {type(manifest).__name__}")
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(manifest["files"], dict):
            raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
        for name, entry in manifest["files"].items():
            # A damaged entry would otherwise fail in verify_checkpoint with a bare
            # KeyError / TypeError, which no resume falls back from.
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)
            ):
                raise ValueError(f"the entry of file {name!r} is damaged: {entry!r}")
        if not isinstance(manifest.get("info", {}), dict):
            raise ValueError(f"its info is not an object: {manifest['info']!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MANIFEST}: {err}") from None
    return manifest


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> dict[str, Any] | None:
    """Check every file of the checkpoint at ``path`` against its manifest.

    Collective under ``torch.distributed`` when ``checksums`` (each rank hashes a share
    of the files; every rank raises the same error).

    Args:
        checksums: also compare SHA-256 digests (reads every byte); else sizes only.

    Returns:
        The manifest (``None`` for an unverifiable 0.1.x checkpoint).

    Raises:
        CheckpointError: incomplete (no manifest), a file missing, truncated or grown,
            or with another digest; the message names the checkpoint and the file.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return None
    problems: list[str] = []
    names = sorted(manifest["files"])
    for n in names:
        want = manifest["files"][n]
        f = path / n
        if not f.is_file():
            problems.append(f"file {n} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(
                f"file {n} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
            )
    if checksums and not problems:
        for n in names[_rank() :: _world()]:
            if _sha256(path / n) != manifest["files"][n]["sha256"]:
                problems.append(f"file {n} does not match its SHA-256 in the manifest")
        problems = [p for part in _all_gather(problems) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(sorted(problems))}")
    return manifest


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` object of the checkpoint at ``path`` (plus ``"world_size"``).

    Reads only that entry, so a caller can check compatibility before building
    anything. Collective under ``torch.distributed``. Verify the checkpoint first
    (:func:`verify_checkpoint`): a corrupt file may fail here obscurely.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        CheckpointError: its ``meta`` entry cannot be read (a corrupt file).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete DCP checkpoint (no .metadata)")
    probe: dict[str, Any] = {"meta": b""}
    try:
        with _quiet_single_process():
            dcp.load(probe, checkpoint_id=str(path), no_dist=not _distributed())
        meta = pickle.loads(probe["meta"])
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError(f"meta is not a dict with an int 'step': {type(meta).__name__}")
    except (Exception, _DCPError) as err:  # DCP wraps the reader's errors (a BaseException)
        if not isinstance(_inner(err), Exception):
            raise  # e.g. KeyboardInterrupt: not a damaged file
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its meta entry cannot be read ({_cause(err)})"
        ) from err
    return meta


def _inner(err: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException``, else ``err``."""
    if isinstance(err, _DCPError) and err.failures:
        inner = next(iter(err.failures.values()))  # (exception, traceback)
        return inner[0] if isinstance(inner, tuple) else inner
    return err


def _cause(err: BaseException) -> str:
    """``Type: first line`` of ``err`` (of the first rank's error inside DCP's
    ``CheckpointException``, whose own message is a list of ranks)."""
    err = _inner(err)
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    rank_tensors: dict[str, torch.Tensor] | None = None,
    extra: dict[str, Any] | None = None,
    all_ranks: bool = False,
    verify: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Load ``path`` into ``model``, ``optimizer``, ``extra`` and ``rank_tensors`` (in place).

    Collective under ``torch.distributed``. ``model`` and ``optimizer`` must be built
    (and parallelised) as when saving, on any world size when ``all_ranks``.

    Args:
        extra: name -> object with ``state_dict()`` / ``load_state_dict()``, as saved;
            loaded in place where its state is DTensors / tensors (resharded like the
            model's), then handed to its ``load_state_dict``.
        all_ranks: load on another world size: return every old rank's state and
            tensors instead of this rank's (``rank_tensors`` are then left alone).
        verify: check the files against the manifest first (:func:`verify_checkpoint`).

    Returns:
        ``(meta, rank_state)`` as given to :func:`save_checkpoint`; with ``all_ranks``,
        ``(meta, [(rank_state, rank_tensors) of old rank 0, 1, ...])``.

    Raises:
        CheckpointError: incomplete or corrupt (with ``verify``; without a manifest, a
            file that cannot be read).
        FileNotFoundError: ``path`` is not a complete checkpoint.
        ValueError: written by another world size (without ``all_ranks``).
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    # Without a manifest (0.1.x) nothing was verified: a damaged file is reported as a
    # CheckpointError (a resume from a run directory then falls back to the previous
    # checkpoint) instead of DCP's or pickle's own error.
    unverified = not (path / MANIFEST).is_file()
    # The world size is checked before touching the model: a mismatch would otherwise
    # surface as an obscure missing-key error for another rank's state.
    meta = read_meta(path)
    if meta["world_size"] != _world() and not all_ranks:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has "
            f"{_world()}: exact resume (data order, BBS windows) needs the same world size"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if all_ranks:
        for r in range(meta["world_size"]):
            tensors = {k: torch.empty_like(t) for k, t in (rank_tensors or {}).items()}
            state[f"rank{r}"] = {"blob": b"", "tensors": tensors}
    else:
        state[f"rank{_rank()}"] = {"blob": b"", "tensors": dict(rank_tensors or {})}
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    try:
        with _quiet_single_process():
            dcp.load(
                state,
                checkpoint_id=str(path),
                planner=RaggedLoadPlanner(),
                no_dist=not _distributed(),
            )
    except (Exception, _DCPError) as err:
        if not unverified or not isinstance(_inner(err), Exception):
            raise  # verified files: a mismatch with the model, not a damaged file
        raise CheckpointError(
            f"checkpoint {path} (no {MANIFEST}, unverified) cannot be read: {_cause(err)}"
        ) from err
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for name, obj in (extra or {}).items():
        obj.load_state_dict(state["extra"][name])
    if all_ranks:
        return meta, [
            (pickle.loads(state[f"rank{r}"]["blob"]), state[f"rank{r}"]["tensors"])
            for r in range(meta["world_size"])
        ]
    key = f"rank{_rank()}"
    if rank_tensors:
        for name, t in rank_tensors.items():
            loaded = state[key]["tensors"][name]
            if loaded is not t:
                t.copy_(loaded)
    return meta, pickle.loads(state[key]["blob"])


def _looks_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / ".metadata").is_file()


def list_checkpoints(path: str | Path) -> list[Path]:
    """Checkpoints of a run directory (or its ``checkpoints/``), newest first.

    Only directories that can be complete (a manifest, or a 0.1.x ``.metadata``) are
    listed; ``.partial`` directories of an interrupted save never are. A ``.step_<N>.old``
    directory (the previous ``step_<N>``, moved aside by a save of the same step that was
    killed before it renamed its own into place) stands for ``step_<N>`` when that is
    missing. Whether their
    files are intact is for :func:`verify_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint or run directory: {path}")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not root.is_dir():
        return []
    done: dict[int, Path] = {}
    for p in root.iterdir():
        if (m := _STEP_DIR.match(p.name)) and _looks_complete(p):
            done[int(m.group(1))] = p
    for p in root.iterdir():
        # A save that replaced step_<N> and was killed between moving the old directory
        # aside and renaming the new one into place: the old one is still complete.
        if (m := _OLD_DIR.match(p.name)) and int(m.group(1)) not in done and _looks_complete(p):
            done[int(m.group(1))] = p
    return [done[s] for s in sorted(done, reverse=True)]


def find_checkpoint(path: str | Path) -> Path | None:
    """Resolve ``path`` to a checkpoint directory.

    ``path`` may be a checkpoint (``.../step_00000100``), a run directory or its
    ``checkpoints/`` folder; for the latter two the newest checkpoint that can be
    complete is returned (see :func:`list_checkpoints`), or None when there is none.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint or run directory: {path}")
    if _looks_complete(path):
        return path
    found = list_checkpoints(path)
    return found[0] if found else None
