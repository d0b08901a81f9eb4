"""``torch.distributed.checkpoint`` (DCP) for ragged DTensors, without gathering them.

DCP stores a tensor as rectangular chunks (offsets + sizes) and reshards on load by
intersecting the saved chunks with the chunks the loading ranks ask for. A ragged shard
is a flat range of rows, which is a union of at most ``2 (k - 1) + 1`` boxes of the
``k`` flattened dims, each a contiguous slice of the local tensor. This module presents
every ragged DTensor to DCP as those boxes (views into its local storage):

- save: each rank writes its boxes; replicas (``Replicate`` on another mesh axis) write
  identical boxes, which DCP de-duplicates;
- load: each rank asks for its boxes and DCP copies the overlapping saved bytes straight
  into the local storage, whatever mesh, world size or ``local_units`` wrote them (or a
  plain tensor, or an upstream ``Shard`` DTensor).

Use the planners (``dcp.save(sd, ..., planner=RaggedSavePlanner())`` and
``dcp.load(sd, ..., planner=RaggedLoadPlanner())``) or wrap the state dict yourself with
:func:`checkpointable`. Without them DCP treats the unknown placement as replicated and
writes each local shard as if it were the whole tensor: the checkpoint is unusable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from hyperrec.raggedshard._geometry import chunk_bounds, row_range_boxes
from hyperrec.raggedshard.placement import RaggedShard
from hyperrec.raggedshard.redistribute import check_placements

__all__ = ["RaggedLoadPlanner", "RaggedSavePlanner", "checkpointable", "local_chunks"]

Chunk = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


def local_chunks(dtensor: DTensor) -> list[Chunk]:
    """This rank's piece of a ragged DTensor as DCP boxes: ``[(offsets, sizes, view)]``.

    ``view`` aliases the local tensor (writing into it writes the DTensor). Ranks holding
    nothing return ``[]``; a tensor with no elements is one empty box at the origin.

    Raises:
        TypeError: not a DTensor.
        ValueError: no ``RaggedShard`` placement, a ``Partial`` placement, a
            non-contiguous local tensor, or placements that break the composition rules.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"dtensor must be a DTensor, got {type(dtensor).__name__}")
    mesh, shape = dtensor.device_mesh, tuple(dtensor.shape)
    placements = check_placements(dtensor.placements, shape, mesh)
    axes = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if not axes:
        raise ValueError("local_chunks needs a DTensor with a RaggedShard placement")
    if any(p.is_partial() for p in placements):
        raise ValueError("a DTensor with a Partial placement cannot be checkpointed; reduce it")
    local = dtensor.to_local()
    if not local.is_contiguous():
        raise ValueError("the local tensor must be contiguous to load into views of it")
    if math.prod(shape) == 0:
        return [((0,) * len(shape), shape, local.new_empty(shape))]
    ragged = cast(RaggedShard, placements[axes[0]])
    k = len(ragged.dims)
    # Trailing dims: upstream Shard(d) axes chunk them, in mesh-axis order.
    trail_off = [0] * (len(shape) - k)
    trail_len = list(shape[k:])
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            j = p.dim - k
            s, e = chunk_bounds(trail_len[j], mesh.size(axis))[mesh.get_local_rank(axis)]
            trail_off[j] += s
            trail_len[j] = e - s
    r0, r1 = ragged.row_bounds(shape)[mesh.get_local_rank(axes[0])]
    out = []
    for offs, sizes, first in row_range_boxes(shape[:k], r0, r1):
        lo = first - r0
        view = local[lo : lo + math.prod(sizes)].view((*sizes, *trail_len))  # () for 0-d
        if view.numel():
            out.append(((*offs, *trail_off), (*sizes, *trail_len), view))
    return out


class _RaggedCheckpointView(torch.Tensor):
    """A stand-in DCP sees instead of a ragged DTensor: global metadata + local boxes.

    It implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``) and holds no data of its own;
    any tensor op on it is an error.
    """

    _chunks: list[Chunk]

    @staticmethod
    def __new__(cls, dtensor: DTensor) -> _RaggedCheckpointView:
        chunks = local_chunks(dtensor)
        local = dtensor.to_local()
        view = torch.Tensor._make_wrapper_subclass(
            cls, dtensor.shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        view._chunks = chunks
        return view

    def __init__(self, dtensor: DTensor):
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise NotImplementedError(
            f"{func} on a checkpoint view of a ragged DTensor: use it only inside DCP"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RaggedCheckpointView(shape={tuple(self.shape)}, chunks={len(self._chunks)})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offs)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for offs, sizes, view in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes))
            for offs, sizes, _ in self._chunks
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offs, _, view in self._chunks:
            if index.offset is not None and tuple(index.offset) == offs:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {index.offset}")


def _is_ragged(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, RaggedShard) for p in value.placements)


def checkpointable(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` where every ragged DTensor is DCP-ready.

    Nested dicts, lists and tuples are copied; other values (tensors, DTensors without a
    ``RaggedShard``, Python objects) are kept as they are. Pass the result to
    ``dcp.save`` or ``dcp.load``; loading writes into the original DTensors' storage.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        ValueError: see :func:`local_chunks`.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")

    def convert(value: Any) -> Any:
        if _is_ragged(value):
            return _RaggedCheckpointView(value)
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            return type(value)(convert(v) for v in value)
        return value

    return convert(state_dict)


class RaggedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes ragged DTensors as their boxes (no gather)."""

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(checkpointable(state_dict), storage_meta, is_coordinator)


class RaggedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads ragged DTensors in place, box by box.

    Non-tensor values (e.g. step counters) are written back into the caller's dict, as
    with the default planner. Tensors must be materialised (not on the meta device).
    """

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(checkpointable(state_dict), metadata, is_coordinator)
        # Same nesting as the copy, so the default planner's paths address the caller's dict.
        self.original_state_dict = state_dict
