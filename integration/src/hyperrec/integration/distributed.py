"""Process group, device, the device mesh and the one place where the model is parallelised.

:func:`init_distributed` works for a plain ``python`` process (world size 1), under
``torchrun`` (reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; NCCL on CUDA, gloo on CPU),
and inside a process group someone else already created (tests).

:func:`build_mesh` builds ``hyperrec.parallel5d``'s 5-D mesh (``TrainConfig.mesh``) on
any world size: the dense modules shard on its dense mesh (``replicate x fsdp``), the
sharded embedding tables on its sparse mesh.

:func:`parallelize` is the one place the model is sharded: ``hyperrec.parallel5d``'s
zero-copy ``fully_shard`` (default) or PyTorch FSDP2's, with the same units: one per
sequence layer, the PMA / cross-attention modules, the interaction tower, MLP and heads,
and the root, which also holds the dense embedding tables (sharded with everything
else; sharded tables are not parameters and are left alone).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hyperrec.integration.model import GEMModel

__all__ = [
    "DistributedContext",
    "build_mesh",
    "init_distributed",
    "parallelize",
    "resolve_device",
]


@dataclass(frozen=True)
class DistributedContext:
    """Where this process runs."""

    rank: int
    """Global rank (0 when not distributed)."""
    world_size: int
    """Number of data-parallel ranks (1 when not distributed)."""
    device: torch.device
    """The device of this rank's model and batches."""
    owns_process_group: bool
    """True if :func:`init_distributed` created the process group (and must destroy it)."""

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes metrics."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op on one rank or without a process group)."""
        if self.distributed and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Destroy the process group if this context created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` -> ``cuda:<local_rank>`` if CUDA is available else ``cpu``.

    Raises:
        ValueError: an unknown device string, or ``"cuda"`` without CUDA.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        return torch.device("cuda", local_rank)
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def init_distributed(
    device: str = "auto", *, timeout_s: float = 600.0, single_rank_group: bool = False
) -> DistributedContext:
    """Join (or create) the default process group and pick this rank's device.

    Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the group is created with
    NCCL when the device is CUDA and gloo otherwise. An existing default group is used
    as is. Otherwise the run is single-process, in a process group of one rank (created
    here, in memory) when ``single_rank_group`` is set (the 5-D mesh needs one).

    Raises:
        ValueError: as :func:`resolve_device`.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        dev = resolve_device(device, local_rank)
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=dev,
            owns_process_group=False,
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device, local_rank)
    if world > 1:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        store = _elastic_attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=world,
                timeout=timeout,
            )
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=dev,
            owns_process_group=True,
        )
    if single_rank_group:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistributedContext(rank=0, world_size=1, device=dev, owns_process_group=True)
    return DistributedContext(rank=0, world_size=1, device=dev, owns_process_group=False)


def _fully_shard_of(sharding: str) -> Callable[..., object]:
    if sharding == "hyperrec":
        from hyperrec.parallel5d import fully_shard

        return fully_shard
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp_fully_shard

        return fsdp_fully_shard
    raise ValueError(f"sharding must be 'hyperrec' or 'fsdp2', got {sharding!r}")


def _elastic_attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under ``torchrun --max-restarts``: the agent's store, prefixed by the attempt.

    A restarted attempt reuses the elastic agent's store, where the previous attempt's
    process-group keys (peer addresses) are still present; with gloo the new workers
    then try to connect to dead peers and hang (seen with torch 2.13 and
    ``--standalone``). A key prefix per attempt keeps each attempt's rendezvous apart.
    None outside torchelastic (the default ``env://`` initialisation is used).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"hyperrec/attempt_{attempt}", store)


def build_mesh(ctx: DistributedContext, *, replicate: int = 0, sparse_replicate: int = 0) -> Any:
    """``hyperrec.parallel5d.ParallelMesh`` of this job, for any world size from 1.

    The topology comes from the launcher's environment (``LOCAL_WORLD_SIZE``: GPUs per
    host, default every rank on one host; ``HYPERREC_HOSTS_PER_ZONE``) and the process
    group's world size. ``replicate``: dense replicas (0: FSDP inside a zone);
    ``sparse_replicate``: the sparse mesh's innermost (NVLink) axis (0: the GPUs per
    host). Needs a default process group (see :func:`init_distributed`).

    Raises:
        ValueError: degrees that do not fit the world size or the topology (as
            ``ParallelMesh``), or no process group.
    """
    from hyperrec.parallel5d import ParallelMesh, Topology

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("the 5-D mesh needs a process group: see init_distributed")
    world = dist.get_world_size()
    env = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE") or str(world),
    }
    if os.environ.get("HYPERREC_HOSTS_PER_ZONE"):
        env["HYPERREC_HOSTS_PER_ZONE"] = os.environ["HYPERREC_HOSTS_PER_ZONE"]
    topology = Topology.from_env(env=env)
    return ParallelMesh.from_env(
        replicate=replicate or None,
        sparse_replicate=sparse_replicate or topology.gpus_per_host,
        topology=topology,
        device_type=ctx.device.type,
        init_process_group=False,
    )


def parallelize(
    model: GEMModel,
    ctx: DistributedContext,
    sharding: str = "hyperrec",
    mesh: Any = None,
) -> GEMModel:
    """Shard ``model`` for data-parallel training on ``ctx`` (a no-op without a process group).

    ``sharding`` picks ``hyperrec.parallel5d.fully_shard`` ("hyperrec", default) or
    PyTorch's ("fsdp2"). Units: each sequence layer, the PMA and cross-attention modules, the
    interaction tower + MLP + heads, and the root (dense embedding tables, norms). Gradients
    are averaged over ranks by FSDP's reduce-scatter, so the loss given to ``backward``
    must be the rank's share of the *global* mean (see the trainer).

    Args:
        model: a :class:`~hyperrec.integration.model.GEMModel` on ``ctx.device``, with the
            same initial parameters on every rank.
        ctx: from :func:`init_distributed`.
        mesh: the ``DeviceMesh`` to shard on (e.g. ``ParallelMesh.dense_mesh``: 1-D FSDP
            or 2-D ``(replicate, fsdp)`` HSDP); default one flat axis over every rank.

    Returns:
        The same module object, sharded in place (parameters become DTensors).
    """
    if not ctx.distributed and not (dist.is_available() and dist.is_initialized()):
        # No process group: nothing to shard over. With a group of one rank the model is
        # still wrapped, so a single-GPU run measures what the sharding path costs.
        return model
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard_of(sharding)

    if mesh is None:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
    for layer in model.seq_layers:
        fully_shard(layer, mesh=mesh)
    for name in ("pma", "cross_attention"):
        sub = getattr(model, name, None)
        if sub is not None:
            fully_shard(sub, mesh=mesh)
    for sub in (model.interaction, model.mlp, model.ctr_head, model.cvr_head):
        if sub is not None:  # no CVR head for a CTR-only schema
            fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
