"""``ShardedEmbeddingCollection``: embedding tables fully sharded over the whole job.

Every row of every table, and its optimizer state, lives on exactly one rank (the
*owner*, see :mod:`~hyperrec.parallel5d.sparse.plan`), so table + optimizer memory per
rank is ``O(T / world_size)``. A lookup is one autograd op for all ``(dim, dtype)``
groups:

1. ids of all features of a group become keys; the rank keeps the unique ones;
2. *hierarchical* routing on a ``(replicate, shard)`` mesh: keys go to the rank of the
   owner's shard-group position inside this rank's shard group (the fast tier), which
   merges the duplicates of the whole group, then across replicas to the owner; on a
   1-D mesh, or with ``routing="flat"``, one all-to-all goes straight to the owner;
3. the owner reads its rows and the rows return along the same path, each hop sending
   one row per unique key;
4. the requester expands its unique rows to its ids (``"none"`` features) or pools its
   bags with ``embedding_bag`` over them (``"sum"`` / ``"mean"``);
5. backward sends row gradients along the forward path, summing duplicates at every
   merge point; the owner keeps ``(rows, summed gradients)`` for the optimizer
   (:mod:`~hyperrec.parallel5d.sparse.optim`). No dense gradient exists anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d._validate import check_bool, check_choice, check_int
from hyperrec.parallel5d.sparse._routing import (
    CommStats,
    Stage,
    route_grads,
    route_keys,
    route_rows_back,
)
from hyperrec.parallel5d.sparse.config import FeatureConfig, TableConfig
from hyperrec.parallel5d.sparse.plan import ShardingPlan, plan_sharding

if TYPE_CHECKING:
    from hyperrec.raggedshard import RaggedShard

__all__ = ["ROUTINGS", "Routing", "ShardedEmbeddingCollection", "init_rows"]

Routing = Literal["hierarchical", "flat"]
#: ``"hierarchical"``: intra-group hop, then inter-group hop; ``"flat"``: one hop over
#: the whole job (the same on a 1-D mesh).
ROUTINGS: tuple[str, ...] = ("hierarchical", "flat")

_INIT_BLOCK_ROWS = 1 << 16
_ID_DTYPES = (torch.int32, torch.int64)


def init_rows(
    table: TableConfig,
    table_index: int,
    row_lo: int,
    row_hi: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[row_lo, row_hi)`` of a table's initial value, independent of the mesh.

    The table is cut into blocks of 65,536 rows; block ``b`` is drawn from a generator
    seeded by ``(seed, table_index, b)``, so a rank draws only the blocks it overlaps and
    every world size produces the same global table (for one device type: CPU and CUDA
    generators differ).

    Args:
        out: write the rows here (``[row_hi - row_lo, table.dim]``) instead of a new
            tensor; at most one block of float32 is allocated on the side.

    Returns:
        ``[row_hi - row_lo, table.dim]`` in ``table.dtype`` on ``device`` (``out`` if given).
    """
    device = torch.device(device) if out is None else out.device
    if out is None:
        out = torch.empty((row_hi - row_lo, table.dim), dtype=table.dtype, device=device)
    if row_hi <= row_lo:
        return out
    for b in range(row_lo // _INIT_BLOCK_ROWS, (row_hi - 1) // _INIT_BLOCK_ROWS + 1):
        b_lo = b * _INIT_BLOCK_ROWS
        b_hi = min(b_lo + _INIT_BLOCK_ROWS, table.num_rows)
        state = np.random.SeedSequence([seed, table_index, b]).generate_state(1, np.uint64)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(state[0] >> np.uint64(1)))
        block = torch.randn(
            (b_hi - b_lo, table.dim), generator=gen, device=device, dtype=torch.float32
        )
        lo, hi = max(row_lo, b_lo), min(row_hi, b_hi)
        out[lo - row_lo : hi - row_lo] = (block[lo - b_lo : hi - b_lo] * table.std).to(table.dtype)
    return out


class _Table(nn.Module):
    """State-dict face of one table: ``weight`` is this rank's rows as a DTensor."""

    _collection: ShardedEmbeddingCollection

    def __init__(self, owner: ShardedEmbeddingCollection, name: str) -> None:
        super().__init__()
        # Not a submodule reference (that would recurse in module traversals).
        object.__setattr__(self, "_collection", owner)
        self.table_name = name

    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows: a ``RaggedShard`` DTensor of the global ``[num_rows, dim]``
        table (a plain tensor without a process group). A view of the storage."""
        return self._collection.weight(self.table_name)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        w = self.weight
        destination[prefix + "weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            self._collection._copy_into(self.weight, state_dict[key], key)
        except (TypeError, ValueError) as exc:
            error_msgs.append(str(exc))


def unique_padded(keys: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, sorted=True, return_inverse=True)`` without a host sync.

    Args:
        keys: int64 ``[N]``.
        pad: the value of the slots past the unique keys; larger than every key, so the
            result stays sorted.

    Returns:
        ``(unique, inverse)``: int64 ``[N]`` (the sorted unique keys, then ``pad``) and
        int64 ``[N]`` with ``unique[inverse] == keys``.
    """
    n = keys.numel()
    if n == 0:
        return keys.new_empty(0), keys.new_empty(0)
    ordered, perm = torch.sort(keys)
    first = torch.ones(n, dtype=torch.bool, device=keys.device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    slot = torch.cumsum(first, 0) - 1
    inverse = torch.empty_like(slot).index_copy_(0, perm, slot)
    # equal keys write the same value into their slot: the result is deterministic
    unique = torch.full_like(keys, pad).scatter_(0, slot, ordered)
    return unique, inverse


class _MarkUsed(torch.autograd.Function):
    """Identity on a feature's output; its backward marks the unique keys the feature
    looked up as used (``touched[inv] = True``, written as ``index_fill_``: on CUDA the
    indexed assignment synchronised the host with the device, once per feature and
    step). Autograd runs it only for outputs that reach the loss, so keys looked up by
    unused features only stay unmarked and their rows are not updated (as
    ``nn.Embedding(sparse=True)`` gives them no gradient)."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        touched: torch.Tensor,
        inv: torch.Tensor,
        used_tables: list[bool],
        t: int,
    ) -> torch.Tensor:
        ctx.touched, ctx.inv, ctx.used_tables, ctx.t = touched, inv, used_tables, t
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        ctx.touched.index_fill_(0, ctx.inv, True)
        ctx.used_tables[ctx.t] = True  # on the host: no device read
        return grad, None, None, None, None


class _Lookup(torch.autograd.Function):
    """Forward: unique keys of every group -> their rows. Backward: row gradients to the
    owners (kept for the optimizer), of the rows some used feature looked up (see
    :class:`_MarkUsed`); nothing flows to ``anchor``."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        module: ShardedEmbeddingCollection,
        unique_keys: list[torch.Tensor],
        touched: list[torch.Tensor],
        used_tables: list[bool],
    ) -> tuple[torch.Tensor, ...]:
        saved, outs = [], []
        for g, keys in enumerate(unique_keys):
            owned, records = route_keys(
                keys, module._stages, module._owner_fn(g), module.comm_stats
            )
            local = module._local_index(g, owned)
            storage = module._storage[g]
            if module.sync_free:
                # padding keys (>= the rows) -> the one-past-the-end row, which the
                # optimizers skip; they gather row 0, which no output reads
                n = storage.shape[0]
                local = torch.where(owned < n, local, n)
                rows = storage.index_select(0, local.clamp(max=max(n - 1, 0)))
            else:
                rows = storage.index_select(0, local)
            outs.append(route_rows_back(rows, records, module.comm_stats))
            saved.append((records, local))
        ctx.module, ctx.saved, ctx.touched, ctx.used_tables = module, saved, touched, used_tables
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None, None, None]:
        module = ctx.module
        names = list(module.table_configs)
        used_tables = {n for n, u in zip(names, module._agree_used(ctx.used_tables)) if u}
        module._used_tables |= used_tables
        # Groups in a fixed order on every rank: their collectives must pair up.
        for g, (records, local) in enumerate(ctx.saved):
            if not used_tables.intersection(module.plan.groups[g].tables):
                # No feature of this group reached the loss on any rank: no gradient, no
                # optimizer step for its tables (SparseAdam's rule for a missing grad).
                continue
            storage = module._storage[g]
            if records:
                # The used flags travel with the gradients as one more column: an owned
                # row is used if a used feature on any rank looked it up.
                flags = ctx.touched[g].to(storage.dtype).unsqueeze(1)
                payload = torch.cat([grads[g].to(storage.dtype), flags], dim=1)
                routed = route_grads(payload, records, module.comm_stats)
                used_rows, summed = routed[:, -1] > 0, routed[:, :-1]
            else:
                # Nothing travels (one rank): the same values without the column's
                # concatenation and the copies of the strided slice.
                used_rows = ctx.touched[g]
                summed = route_grads(grads[g].to(storage.dtype), records, module.comm_stats)
            if module.sync_free:
                # unused rows -> the one-past-the-end padding row the optimizers skip
                local = torch.where(used_rows, local, storage.shape[0])
            else:
                local, summed = local[used_rows], summed[used_rows]  # host sync: allowed here
            if module._grad_scale != 1.0:
                summed = summed * module._grad_scale
            module._pending[g].append((local, summed.contiguous()))
            module._backward_count[g] += 1
        return None, None, None, None, None


class ShardedEmbeddingCollection(nn.Module):
    """Embedding tables whose rows and optimizer states are sharded over all ranks.

    Args:
        tables: the :class:`TableConfig` s (unique names, at least one).
        features: the :class:`FeatureConfig` s; default: one unpooled feature per table,
            named like it.
        mesh: ``None`` (the default process group as one shard group, or a single
            process without one), a 1-D ``DeviceMesh`` (one shard group) or a 2-D
            ``DeviceMesh`` with a replica axis and a shard-group axis.
        shard_axis: name or index of the shard-group axis of a 2-D mesh: the axis whose
            groups share the fast tier (the GPUs of a host), where the first hop runs
            and duplicates merge; the other axis holds the replicas of that group.
            Default: the last axis (``(replicate, shard)``, as HSDP meshes are laid
            out). Either axis may be named, but the shard groups must be runs of
            consecutive ranks, replica after replica (else a ``ValueError``). With
            ``ParallelMesh``: ``mesh=pm.sparse_mesh,
            shard_axis="sparse_replicate"`` (its NVLink axis); its ``sparse_dp`` must be
            1 (copies of the tables would need a weight sync, not implemented).
        routing: ``"hierarchical"`` (default) or ``"flat"`` (see :data:`ROUTINGS`).
        device: where rows, states and inputs live; default: CUDA's current device for
            a CUDA mesh, else CPU.
        seed: seed of the mesh-independent initialisation (:func:`init_rows`).
        table_wise_max_bytes: ``sharding="auto"`` tables up to this size go whole on one
            rank (default 1 MiB).
        gradient_reduction: ``"mean"`` (default) divides the summed row gradients by the
            world size, as DDP / FSDP average dense gradients; ``"sum"`` does not.
        validate: check every input (dtypes, ranges, offsets; host syncs) and agree on
            failures across ranks (one tiny all-reduce per mesh axis) so that no rank is
            left waiting in a collective. Default True.
        sync_free: look up without a host synchronisation (one rank only). ``None``
            (default): on when the job has one rank and the rows are on CUDA. The ids
            are deduplicated by a sort into a buffer as long as the ids, padded past
            the unique ones with a key beyond every table (``torch.unique`` returns an
            exact-size result, which costs a device-to-host copy of its length and
            stalls the host until the GPU has drained). The padding slots gather a real
            row that no output reads, get zero gradients and are skipped by the
            optimizers. Several ranks need the split sizes on the host for their
            all-to-alls, so ``True`` there is an error. With ``validate=False`` an id
            ``>= num_rows`` is not caught here (it reads a wrong row rather than raising).

    ``forward(features)`` takes ``{feature name: ids}`` or ``{name: (ids, offsets)}``
    (every configured feature, on every rank; ids int32/int64 ``[n]``; offsets
    int32/int64 ``[num_bags + 1]``, starting at 0, non-decreasing, ending at ``n``;
    pooled features need offsets) and returns ``{name: tensor}``: ``[n, dim]`` for
    ``pooling="none"``, ``[num_bags, dim]`` for ``"sum"``/``"mean"`` (an empty bag gives
    zeros), in the table's dtype. The call is collective (every rank, same order), and
    so is the backward through its outputs.

    The tables are neither parameters nor buffers (dense optimizers, ``fully_shard``,
    DDP and gradient clipping leave them alone); ``state_dict()`` holds them as
    ``tables.<name>.weight``. Optimizers: :class:`RowWiseAdagrad`,
    :class:`LazyAdagrad`, :class:`LazyAdam`.

    Raises:
        TypeError / ValueError: bad configs, repeated names, a feature naming an
            unknown table, a mesh of more than two axes, a 2-D mesh not spanning every
            rank of the default process group or whose shard groups are not runs of
            consecutive ranks, a 1-D mesh whose ranks are not in increasing order, an
            unknown ``shard_axis``; ``sync_free=True`` with more than one rank.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        features: Sequence[FeatureConfig] | None = None,
        *,
        mesh: DeviceMesh | None = None,
        shard_axis: str | int = -1,
        routing: Routing = "hierarchical",
        device: torch.device | str | None = None,
        seed: int = 0,
        table_wise_max_bytes: int = 1 << 20,
        gradient_reduction: Literal["mean", "sum"] = "mean",
        validate: bool = True,
        sync_free: bool | None = None,
    ):
        super().__init__()
        check_choice("routing", routing, ROUTINGS)
        if sync_free is not None:
            check_bool("sync_free", sync_free)
        check_choice("gradient_reduction", gradient_reduction, ("mean", "sum"))
        self.validate = check_bool("validate", validate)
        self.seed = check_int("seed", seed, minimum=0)
        tables = tuple(tables)
        if features is None:
            features = tuple(FeatureConfig(name=t.name, table=t.name) for t in tables)
        features = tuple(features)
        for i, f in enumerate(features):
            if not isinstance(f, FeatureConfig):
                raise TypeError(f"features[{i}] must be a FeatureConfig, got {type(f).__name__}")
        fnames = [f.name for f in features]
        dup = sorted({n for n in fnames if fnames.count(n) > 1})
        if dup:
            raise ValueError(f"features must have unique names, got repeated {dup}")
        if not features:
            raise ValueError("features must hold at least one FeatureConfig, got none")
        self.routing = routing
        self._setup_mesh(mesh, shard_axis, device)
        self.plan: ShardingPlan = plan_sharding(
            tables, self.world_size, table_wise_max_bytes=table_wise_max_bytes
        )
        self.table_configs = {t.name: t for t in tables}
        if sync_free and self.world_size > 1:
            raise ValueError(
                f"sync_free=True needs a job of one rank, got {self.world_size} ranks (their "
                "all-to-alls need the split sizes on the host)"
            )
        self.sync_free = (
            bool(sync_free)
            if sync_free is not None
            else self.world_size == 1 and self.device.type == "cuda"
        )
        for f in features:
            if f.table not in self.table_configs:
                raise ValueError(
                    f"FeatureConfig {f.name!r} reads table {f.table!r}, which is not among "
                    f"tables {sorted(self.table_configs)}"
                )
        self.feature_configs = {f.name: f for f in features}
        self._grad_scale = 1.0 / self.world_size if gradient_reduction == "mean" else 1.0
        self.comm_stats = CommStats()
        self._build_stages()

        me, dev = self.owner_index, self.device
        self._storage: list[torch.Tensor] = []
        self._seg_key: list[torch.Tensor] = []
        self._seg_owner: list[torch.Tensor] = []
        self._own_key: list[torch.Tensor] = []
        self._own_local: list[torch.Tensor] = []
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._backward_count: list[int] = []
        # tables a feature of which reached the loss (on some rank) since the last step
        self._used_tables: set[str] = set()
        for gp in self.plan.groups:
            self._storage.append(
                torch.empty((gp.local_rows[me], gp.dim), dtype=gp.dtype, device=dev)
            )
            self._seg_key.append(torch.as_tensor(gp.seg_key_start, device=dev))
            self._seg_owner.append(torch.as_tensor(gp.seg_owner, device=dev))
            mine = gp.seg_owner == me
            self._own_key.append(torch.as_tensor(gp.seg_key_start[mine], device=dev))
            self._own_local.append(torch.as_tensor(gp.seg_local_start[mine], device=dev))
            self._pending.append([])
            self._backward_count.append(0)
        self._weights: dict[str, torch.Tensor] = {}
        self.tables = nn.ModuleDict({t.name: _Table(self, t.name) for t in tables})
        # Autograd needs one input that requires grad to record the lookup.
        self._anchor = torch.empty(0, requires_grad=True)
        self.reset_parameters()

    # ------------------------------------------------------------------ topology
    def _setup_mesh(self, mesh: DeviceMesh | None, shard_axis: str | int, device: Any) -> None:
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
        self.mesh = mesh
        if mesh is None:
            if dist.is_available() and dist.is_initialized():
                world = dist.get_world_size()
                grid = torch.arange(world).reshape(1, world)
                device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
                flat = DeviceMesh(device_type, torch.arange(world))
                self._axis_groups: tuple[Any, Any] = (None, flat.get_group(0))
            else:
                grid = torch.zeros((1, 1), dtype=torch.long)
                device_type, flat = "cpu", None
                self._axis_groups = (None, None)
        elif mesh.ndim == 1:
            grid = mesh.mesh.reshape(1, -1)
            order = grid.reshape(-1).tolist()
            if order != sorted(order):
                # Owners are numbered by position in the mesh, but the mesh's process
                # group (and so every DTensor of the rows) orders its ranks by global
                # rank: rows would be placed by one numbering and gathered by the other
                # (scrambled full weights and checkpoints, or a shape error).
                raise ValueError(
                    f"a 1-D mesh must list its ranks in increasing order (torch process "
                    f"groups order their members by global rank), got {order}"
                )
            device_type, flat = mesh.device_type, mesh
            self._axis_groups = (None, mesh.get_group(0))
        elif mesh.ndim == 2:
            names = mesh.mesh_dim_names or ()
            if isinstance(shard_axis, str):
                if shard_axis not in names:
                    raise ValueError(
                        f"shard_axis must name an axis of the mesh {names}, got {shard_axis!r}"
                    )
                sdim = names.index(shard_axis)
            else:
                sdim = check_int("shard_axis", shard_axis)
                if sdim not in (-2, -1, 0, 1):
                    raise ValueError(
                        f"shard_axis must be 0, 1, -1 or -2 for a 2-D mesh, got {sdim}"
                    )
                sdim %= 2
            rdim = 1 - sdim
            grid = mesh.mesh.permute(rdim, sdim).contiguous()
            if grid.numel() != dist.get_world_size():
                # Every rank builds the flattened mesh (a collective); a 2-D mesh over part
                # of the job would leave the other ranks out of it.
                raise ValueError(
                    f"a 2-D mesh must span every rank of the default process group "
                    f"({dist.get_world_size()}), got {grid.numel()} ranks"
                )
            order = grid.reshape(-1).tolist()
            if order != sorted(order):
                # Owners are numbered replica by replica (grid order), but a 1-D mesh
                # over the whole job takes its ranks' positions from the default group
                # (rank order), whatever order it is given: rows would be placed by one
                # numbering and gathered by the other (scrambled full weights and
                # checkpoints, or a shape error).
                raise ValueError(
                    f"the 2-D mesh's shard groups must be runs of consecutive ranks, one "
                    f"replica after the other (grid (replicate, shard) in rank order); got "
                    f"{grid.tolist()} with shard_axis={shard_axis!r}: lay the mesh out as "
                    f"(replicate, shard), e.g. init_device_mesh(..., (replicas, group_size))"
                )
            device_type = mesh.device_type
            flat = DeviceMesh(device_type, grid.reshape(-1))
            self._axis_groups = (mesh.get_group(rdim), mesh.get_group(sdim))
        else:
            raise ValueError(
                f"mesh must have 1 or 2 axes (replicate, shard), got {mesh.ndim}: pass the "
                "sparse sub-mesh of a larger mesh"
            )
        self._grid = grid  # [replicas, group size] global ranks; owner o = grid.flatten()[o]
        self.num_replicas, self.group_size = int(grid.shape[0]), int(grid.shape[1])
        self.world_size = int(grid.numel())
        self.flat_mesh: DeviceMesh | None = flat
        if flat is None:
            self.owner_index = 0
        else:
            me = dist.get_rank()
            hits = (grid.reshape(-1) == me).nonzero()
            if hits.numel() != 1:
                raise ValueError(f"this rank ({me}) is not in the mesh {grid.tolist()}")
            self.owner_index = int(hits.item())
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if device_type == "cuda"
                else torch.device("cpu")
            )
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # tensors always carry an index: "cuda" would never compare equal to them
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def _build_stages(self) -> None:
        R, G, W = self.num_replicas, self.group_size, self.world_size
        self._stages: list[Stage] = []
        if W == 1:
            return
        grid, me = self._grid, self.owner_index
        r_me, g_me = divmod(me, G)
        owners = torch.arange(W)

        def stage(label: str, group: Any, dest_ranks: torch.Tensor, labels: list[str]) -> Stage:
            peers = torch.tensor(
                [dist.get_group_rank(group, int(r)) for r in dest_ranks.tolist()],
                dtype=torch.long,
            )
            return Stage(
                label=label,
                group=group,
                size=dist.get_world_size(group),
                my_peer=dist.get_rank(group),
                owner_to_peer=peers.to(self.device),
                peer_labels=tuple(labels),
            )

        rep_group, shard_group = self._axis_groups
        if self.routing == "flat" and R > 1:
            flat_group = cast(DeviceMesh, self.flat_mesh).get_group(0)  # set for "flat"
            by_peer = ["intra_group"] * W
            for o in range(W):
                by_peer[dist.get_group_rank(flat_group, int(grid.reshape(-1)[o]))] = (
                    "intra_group" if o // G == r_me else "inter_group"
                )
            self._stages.append(stage("flat", flat_group, grid.reshape(-1)[owners], by_peer))
            return
        if G > 1:
            self._stages.append(
                stage("intra_group", shard_group, grid[r_me, owners % G], ["intra_group"] * G)
            )
        if R > 1:
            self._stages.append(
                stage("inter_group", rep_group, grid[owners // G, g_me], ["inter_group"] * R)
            )

    def _owner_fn(self, g: int) -> Callable[[torch.Tensor], torch.Tensor]:
        seg_key, seg_owner = self._seg_key[g], self._seg_owner[g]

        def owner_of(keys: torch.Tensor) -> torch.Tensor:
            return seg_owner[torch.searchsorted(seg_key, keys, right=True) - 1]

        return owner_of

    def _local_index(self, g: int, keys: torch.Tensor) -> torch.Tensor:
        if keys.numel() == 0:
            return keys
        own_key, own_local = self._own_key[g], self._own_local[g]
        seg = torch.searchsorted(own_key, keys, right=True) - 1
        return keys - own_key[seg] + own_local[seg]

    # ------------------------------------------------------------------ storage
    def weight(self, name: str) -> torch.Tensor:
        """Table ``name``'s rows on this rank: a ``RaggedShard`` DTensor over the job's
        flattened mesh (a plain tensor without a process group); a view of the storage.

        Raises:
            KeyError: unknown table.
        """
        if name not in self._weights:
            self._weights[name] = self._dtensor(name, self._table_view(name, self._storage))
        return self._weights[name]

    def _table_view(self, name: str, storages: Sequence[torch.Tensor]) -> torch.Tensor:
        if name not in self.table_configs:
            raise KeyError(f"unknown table {name!r}; tables are {sorted(self.table_configs)}")
        g, i = self.plan.group_of(name)
        start = int(self.plan.groups[g].table_local_start[self.owner_index, i])
        n = self.plan.table(name).rows_on(self.owner_index)
        return storages[g][start : start + n]

    def _dtensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Wrap a local row block of table ``name`` (``[rows, ...]``) as a DTensor."""
        if self.flat_mesh is None:
            return local
        from hyperrec.raggedshard import RaggedShard, from_local

        rows = self.plan.table(name).rows_per_owner
        shape = (self.table_configs[name].num_rows, *local.shape[1:])
        return from_local(local, self.flat_mesh, [RaggedShard((0,), rows)], shape=shape)

    def _copy_into(self, dest: torch.Tensor, src: Any, what: str) -> None:
        """Copy a saved value (same-layout DTensor, other DTensor, or full tensor) into a
        live DTensor / tensor."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(src).__name__}")
        if tuple(src.shape) != tuple(dest.shape):
            raise ValueError(f"{what} must have shape {tuple(dest.shape)}, got {tuple(src.shape)}")
        if src.dtype != dest.dtype:
            raise ValueError(f"{what} must have dtype {dest.dtype}, got {src.dtype}")
        d_local = dest._local_tensor if isinstance(dest, DTensor) else dest
        if isinstance(src, DTensor):
            if isinstance(dest, DTensor) and (
                src.placements != dest.placements or src.device_mesh != dest.device_mesh
            ):
                from hyperrec.raggedshard import redistribute

                src = redistribute(src, dest.placements)  # one all-to-all, nothing gathered
            s_local = src._local_tensor
        elif isinstance(dest, DTensor):
            placement = cast("RaggedShard", dest.placements[0])
            lo, hi = placement.row_bounds(tuple(dest.shape))[self.owner_index]
            s_local = src[lo:hi]
        else:
            s_local = src
        if s_local.numel() and s_local.data_ptr() != d_local.data_ptr():
            d_local.copy_(s_local)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every row afresh (:func:`init_rows` with ``self.seed``); clears pending
        gradients."""
        for ti, (name, cfg) in enumerate(self.table_configs.items()):
            p = self.plan.table(name)
            lo, hi = p.row_starts[self.owner_index], p.row_starts[self.owner_index + 1]
            init_rows(cfg, ti, lo, hi, seed=self.seed, out=self._table_view(name, self._storage))
        self.zero_grad_rows()

    @torch.no_grad()
    def load_full_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's rows out of full tables (e.g. a dense model's embeddings).

        Args:
            weights: ``{table name: [num_rows, dim] tensor}`` (any subset of the tables;
                any device; cast to the table dtype).

        Raises:
            KeyError: an unknown table. ValueError: a wrong shape.
        """
        for name, full in weights.items():
            cfg = self.table_configs.get(name)
            if cfg is None:
                raise KeyError(f"unknown table {name!r}; tables are {sorted(self.table_configs)}")
            if tuple(full.shape) != (cfg.num_rows, cfg.dim):
                raise ValueError(
                    f"weights[{name!r}] must have shape {(cfg.num_rows, cfg.dim)}, got "
                    f"{tuple(full.shape)}"
                )
            p = self.plan.table(name)
            lo, hi = p.row_starts[self.owner_index], p.row_starts[self.owner_index + 1]
            ids = self._id_of_stored(name, torch.arange(lo, hi, device=full.device))
            self._table_view(name, self._storage).copy_(full.index_select(0, ids))

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every table gathered whole on every rank, in id order (collective; for tests
        and export of small tables only: it is ``O(T)`` memory)."""
        return {name: self.gather(name, self.weight(name)) for name in self.table_configs}

    @torch.no_grad()
    def gather(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A row-sharded value of table ``name`` (its weight or an optimizer state) whole
        on every rank, in id order (collective, ``O(T)`` memory)."""
        from hyperrec.raggedshard import full_tensor

        full = full_tensor(value) if isinstance(value, DTensor) else value.clone()
        return self.unpermute(name, full)

    def _stored_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Stored row of each id of table ``name`` (the id itself unless hashed)."""
        cfg = self.table_configs[name]
        if cfg.row_order == "id":
            return ids
        return (ids * cfg.hash_multiplier) % cfg.num_rows

    def _id_of_stored(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_stored_rows`."""
        cfg = self.table_configs[name]
        if cfg.row_order == "id":
            return rows
        return (rows * pow(cfg.hash_multiplier, -1, cfg.num_rows)) % cfg.num_rows

    def unpermute(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """A full table (or state) in stored row order -> in id order (a gather; the
        identity for ``row_order="id"``)."""
        if self.table_configs[name].row_order == "id":
            return stored
        ids = torch.arange(stored.shape[0], device=stored.device)
        return stored.index_select(0, self._stored_rows(name, ids))

    def local_bytes(self) -> int:
        """Bytes of this rank's rows (all tables)."""
        return sum(s.numel() * s.element_size() for s in self._storage)

    def zero_grad_rows(self) -> None:
        """Drop row gradients kept since the last optimizer step."""
        for p in self._pending:
            p.clear()
        self._backward_count = [0] * len(self._pending)
        self._used_tables.clear()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # The rows are not module tensors, so moving the module would move nothing:
        # refuse the silent half-move.
        probe = fn(torch.empty(0, device=self.device))
        if probe.device != self.device:
            raise ValueError(
                f"ShardedEmbeddingCollection lives on {self.device}; build it with device= "
                f"instead of moving it to {probe.device}"
            )
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"tables={list(self.table_configs)}, world_size={self.world_size} "
            f"({self.num_replicas} replicas x {self.group_size}), routing={self.routing!r}"
        )

    # ------------------------------------------------------------------ forward
    def _parse(self, features: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        if not isinstance(features, Mapping):
            raise TypeError(
                "features must be a mapping {feature name: ids or (ids, offsets)}, got "
                f"{type(features).__name__}"
            )
        missing = sorted(set(self.feature_configs) - set(features))
        extra = sorted(set(features) - set(self.feature_configs))
        if missing or extra:
            raise ValueError(
                "features must have exactly the configured feature names: missing "
                f"{missing}, unexpected {extra}"
            )
        out = {}
        for name, cfg in self.feature_configs.items():
            value, where = features[name], f"features[{name!r}]"
            if isinstance(value, tuple | list):
                if len(value) != 2:
                    raise ValueError(
                        f"{where} must be ids or (ids, offsets), got {len(value)} items"
                    )
                ids, offsets = value
            else:
                ids, offsets = value, None
            if not isinstance(ids, torch.Tensor):
                raise TypeError(f"{where} ids must be a torch.Tensor, got {type(ids).__name__}")
            if ids.dtype not in _ID_DTYPES:
                raise TypeError(f"{where} ids must be an int32 or int64 tensor, got {ids.dtype}")
            if ids.dim() != 1:
                raise ValueError(f"{where} ids must be 1-D, got shape {tuple(ids.shape)}")
            if ids.device != self.device:
                raise ValueError(f"{where} ids must be on {self.device}, got {ids.device}")
            if offsets is None:
                if cfg.pooling != "none":
                    raise ValueError(
                        f"{where} is pooled (pooling={cfg.pooling!r}): pass (ids, offsets)"
                    )
            else:
                if not isinstance(offsets, torch.Tensor):
                    raise TypeError(
                        f"{where} offsets must be a torch.Tensor, got {type(offsets).__name__}"
                    )
                if offsets.dtype not in _ID_DTYPES:
                    raise TypeError(
                        f"{where} offsets must be an int32 or int64 tensor, got {offsets.dtype}"
                    )
                if offsets.dim() != 1 or offsets.numel() < 1:
                    raise ValueError(
                        f"{where} offsets must be 1-D with num_bags + 1 >= 1 entries, got "
                        f"shape {tuple(offsets.shape)}"
                    )
                if offsets.device != self.device:
                    raise ValueError(
                        f"{where} offsets must be on {self.device}, got {offsets.device}"
                    )
            out[name] = (ids, offsets)
        return out

    def _check_values(
        self, parsed: dict[str, tuple[torch.Tensor, torch.Tensor | None]]
    ) -> str | None:
        """The first value error among the inputs (one host sync for all of them)."""
        probes: list[torch.Tensor] = []
        layout: list[tuple[str, str]] = []
        for name, (ids, offsets) in parsed.items():
            if ids.numel():
                probes += [ids.min().long(), ids.max().long()]
                layout += [(name, "min"), (name, "max")]
            if offsets is not None:
                probes += [offsets[0].long(), offsets[-1].long()]
                layout += [(name, "first"), (name, "last")]
                if offsets.numel() > 1:
                    probes.append((offsets[1:] < offsets[:-1]).any().long())
                    layout.append((name, "decreasing"))
        if not probes:
            return None
        values = torch.stack(probes).tolist()
        for (name, what), v in zip(layout, values, strict=True):
            ids, offsets = parsed[name]
            table = self.feature_configs[name].table
            rows = self.table_configs[table].num_rows
            where = f"features[{name!r}]"
            if what == "min" and v < 0:
                return f"{where} ids must be >= 0, got a minimum of {v}"
            if what == "max" and v >= rows:
                return (
                    f"{where} ids must be < {rows} (rows of table {table!r}), got a maximum of {v}"
                )
            if what == "first" and v != 0:
                return f"{where} offsets must start at 0, got {v}"
            if what == "decreasing" and v:
                offsets = cast(torch.Tensor, offsets)  # probed only where there are offsets
                i = int((offsets[1:] < offsets[:-1]).nonzero()[0].item())
                return (
                    f"{where} offsets must be non-decreasing, got offsets[{i}] = "
                    f"{int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}"
                )
            if what == "last" and v != ids.numel():
                return f"{where} offsets must end at len(ids) = {ids.numel()}, got {v}"
        return None

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over every rank of the mesh (one small
        all-reduce per mesh axis); ``values`` itself on one rank."""
        if self.world_size <= 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        for group in self._axis_groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in t.tolist()]

    def _agree_used(self, used: list[bool]) -> list[bool]:
        """Per table, whether a feature of it reached the loss on any rank (the
        backward's all-to-alls synchronise the ranks anyway; no device read on one
        rank)."""
        return [bool(v) for v in self._max_over_ranks([int(u) for u in used])]

    def _agree(self, error: str | None, exc: BaseException | None = None) -> None:
        """Raise on every rank if any rank's input is bad (no rank waits in a hop)."""
        if self.world_size > 1:
            bad = self._max_over_ranks([dist.get_rank() + 1 if error else 0])[0] - 1
            if error is None and bad >= 0:
                raise ValueError(
                    f"features failed validation on rank {bad} (this rank's inputs are "
                    "valid; see that rank's error)"
                )
        if exc is not None:
            raise exc
        if error is not None:
            raise ValueError(error)

    def forward(
        self, features: Mapping[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Look up and pool every feature (collective). See the class docstring.

        Raises:
            TypeError: not a mapping; ids or offsets not int32/int64 tensors.
            ValueError: missing or unexpected feature names; ids not 1-D, on another
                device, negative or ``>= num_rows``; a pooled feature without offsets;
                offsets not starting at 0, decreasing, or not ending at ``len(ids)``; or
                (``validate=True``) another rank's input failed these checks.
        """
        try:
            parsed = self._parse(features)
            error = self._check_values(parsed) if self.validate else None
        except (TypeError, ValueError) as exc:
            if self.validate:
                self._agree(str(exc), exc)  # the other ranks raise too
            raise
        if self.validate:
            self._agree(error)

        unique_keys, inverses, spans = [], [], []
        for g, gp in enumerate(self.plan.groups):
            parts, span, start = [], {}, 0
            for name, cfg in self.feature_configs.items():
                gi, ti = self.plan.group_of(cfg.table)
                if gi != g:
                    continue
                ids = parsed[name][0]
                stored = self._stored_rows(cfg.table, ids.long())
                parts.append(stored + gp.key_offsets[ti])
                span[name] = (start, start + ids.numel())
                start += ids.numel()
            keys = (
                torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.device)
            )
            if self.sync_free:
                u, inv = unique_padded(keys, pad=gp.local_rows[self.owner_index])
            else:
                u, inv = torch.unique(keys, sorted=True, return_inverse=True)
            unique_keys.append(u)
            inverses.append(inv)
            spans.append(span)
        touched = [torch.zeros(u.shape[0], dtype=torch.bool, device=u.device) for u in unique_keys]
        used_tables = [False] * len(self.table_configs)
        rows = _Lookup.apply(self._anchor, self, unique_keys, touched, used_tables)

        table_index = {name: i for i, name in enumerate(self.table_configs)}
        out: dict[str, torch.Tensor] = {}
        for g in range(len(self.plan.groups)):
            for name, (a, b) in spans[g].items():
                inv = inverses[g][a:b]
                cfg = self.feature_configs[name]
                if cfg.pooling == "none":
                    looked_up = rows[g].index_select(0, inv)
                else:
                    looked_up = F.embedding_bag(
                        inv,
                        rows[g],
                        cast(torch.Tensor, parsed[name][1]).long(),  # pooled: has offsets
                        mode=cfg.pooling,
                        include_last_offset=True,
                    )
                t = table_index[cfg.table]
                out[name] = _MarkUsed.apply(looked_up, touched[g], inv, used_tables, t)
        return {name: out[name] for name in self.feature_configs}
