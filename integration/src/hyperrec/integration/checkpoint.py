"""Distributed checkpoints (``torch.distributed.checkpoint``) that resume a run exactly.

A checkpoint is one DCP directory ``<run>/checkpoints/step_<N>/`` holding:

- ``model`` / ``optim``: from :func:`torch.distributed.checkpoint.state_dict.get_state_dict`,
  so plain modules and FSDP2-sharded ones (DTensor parameters) save the same way and
  every rank writes only its own shards (``optim``: one optimizer or several);
- ``extra``: other stateful objects by name (e.g. the sharded tables' optimizer, whose
  states are sharded DTensors but not of any parameter), each its ``state_dict()``,
  loaded in place and handed back to its ``load_state_dict``;
- ``meta``: one small object common to all ranks (step, world size, metric history);
- ``rank<r>``: what differs per rank: the data pipeline's state (the BBS window, the
  reader position), the RNG states (dropout), the popularity counts, the training-AUC
  window. Tensors of known shape stay tensors; the rest is one pickled blob.

DCP writes ``.metadata`` last, so a directory with it is complete; :func:`find_checkpoint`
ignores partial ones (a run killed while saving resumes from the previous checkpoint).
Exact resume needs the same world size (per-rank data state does not re-split), which
:func:`load_checkpoint` enforces.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyperrec.raggedshard import RaggedLoadPlanner, RaggedSavePlanner

__all__ = ["checkpoint_dir", "find_checkpoint", "load_checkpoint", "read_meta", "save_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step, 8 digits>``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    meta: dict[str, Any],
    rank_state: dict[str, Any],
    rank_tensors: dict[str, torch.Tensor] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint to ``path`` (collective: every rank calls it).

    Args:
        path: the checkpoint directory (created).
        model, optimizer: saved through ``get_state_dict`` (sharded DTensors: each rank
            writes its own pieces, ragged ones through the raggedshard planners);
            ``optimizer`` may be a list.
        extra: name -> object with ``state_dict()`` / ``load_state_dict()``.
        meta: picklable, identical on every rank; must hold ``"step"``.
        rank_state: picklable state of this rank.
        rank_tensors: this rank's tensors of a shape known before loading.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``meta`` lacks an int ``"step"``.
    """
    if not isinstance(meta.get("step"), int):
        raise ValueError("meta must hold the int 'step' of the checkpoint")
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    meta = {**meta, "world_size": _world()}
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "meta": pickle.dumps(meta),
        f"rank{_rank()}": {"blob": pickle.dumps(rank_state), "tensors": dict(rank_tensors or {})},
    }
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    # A resumed run re-writes the steps after its checkpoint; their content is identical,
    # so overwriting is intended (DCP warns about it even when asked to).
    writer = dcp.FileSystemWriter(str(path), overwrite=True)
    with _quiet_single_process(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(
            state, storage_writer=writer, planner=RaggedSavePlanner(), no_dist=not _distributed()
        )
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` object of the checkpoint at ``path`` (plus ``"world_size"``).

    Reads only that entry, so a caller can check compatibility before building
    anything. Collective under ``torch.distributed``.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete DCP checkpoint (no .metadata)")
    probe: dict[str, Any] = {"meta": b""}
    with _quiet_single_process():
        dcp.load(probe, checkpoint_id=str(path), no_dist=not _distributed())
    return pickle.loads(probe["meta"])


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    rank_tensors: dict[str, torch.Tensor] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load ``path`` into ``model``, ``optimizer``, ``extra`` and ``rank_tensors`` (in place).

    Collective under ``torch.distributed``. ``model`` and ``optimizer`` must be built
    (and parallelised) exactly as when saving.

    Returns:
        ``(meta, rank_state)`` as given to :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        ValueError: it was written by a different world size.
    """
    path = Path(path)
    # The world size is checked before touching the model: a mismatch would otherwise
    # surface as an obscure missing-key error for another rank's state.
    meta = read_meta(path)
    if meta["world_size"] != _world():
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has "
            f"{_world()}: exact resume (data order, BBS windows) needs the same world size"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    key = f"rank{_rank()}"
    state = {
        "model": model_sd,
        "optim": optim_sd,
        key: {"blob": b"", "tensors": dict(rank_tensors or {})},
    }
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    with _quiet_single_process():
        dcp.load(
            state,
            checkpoint_id=str(path),
            planner=RaggedLoadPlanner(),
            no_dist=not _distributed(),
        )
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for name, obj in (extra or {}).items():
        obj.load_state_dict(state["extra"][name])
    if rank_tensors:
        for name, t in rank_tensors.items():
            loaded = state[key]["tensors"][name]
            if loaded is not t:
                t.copy_(loaded)
    return meta, pickle.loads(state[key]["blob"])


def find_checkpoint(path: str | Path) -> Path | None:
    """Resolve ``path`` to a complete checkpoint directory.

    ``path`` may be a checkpoint (``.../step_00000100``), a run directory or its
    ``checkpoints/`` folder; for the latter two the highest complete step is returned,
    or None when there is none.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint or run directory: {path}")
    if (path / ".metadata").is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return max(done)[1] if done else None
