"""The ``RaggedShard`` DTensor placement: uneven, block-granular sharding of flattened rows.

``RaggedShard(dims, local_units)`` on a mesh axis of size ``W``: the leading
``k = len(dims)`` dims (``dims`` must be ``(0, 1, ..., k-1)``) are flattened into
``R = prod(shape[:k])`` rows; the rows are cut into ``U = sum(local_units)`` equal units
of ``R / U`` rows; rank ``i`` holds ``local_units[i]`` consecutive units. Its local tensor
has shape ``(local_units[i] * R / U, *shape[k:])``. Zeros are allowed; ``dims=()`` with
one-hot units puts the whole tensor on one rank (local shape ``(1, *shape)`` there and
``(0, *shape)`` elsewhere).

Upstream DTensor integration: the class subclasses the public ``Placement`` type and
implements the placement protocol that ``DTensor.redistribute`` dispatches on
(``_to_replicate_tensor``, ``_replicate_to_shard``, ``_reduce_shard_tensor``,
``_to_new_shard_dim``), so ``full_tensor()`` and most ``DTensor.redistribute`` pairs run
upstream's own autograd with the ragged collectives of :mod:`._collectives`. The one
pair upstream cannot route (``Shard(d) -> RaggedShard``) raises a clear error;
:func:`hyperrec.raggedshard.redistribute` handles every pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement

from hyperrec.raggedshard import _collectives as coll
from hyperrec.raggedshard._geometry import Bounds, prefix_bounds
from hyperrec.raggedshard._validate import check_int
from hyperrec.raggedshard.granularity import GranularitySpec, _shape_tuple, block_numel

__all__ = ["RaggedShard"]

_SHARD_TO_RAGGED = (
    "DTensor.redistribute cannot route Shard(d) -> RaggedShard: upstream calls "
    "Shard._to_new_shard_dim with an int target dim. Use "
    "hyperrec.raggedshard.redistribute(dtensor, placements), which handles every pair."
)


class _RaggedDim:
    """What ``RaggedShard.dim`` returns: a token that is not a tensor dim.

    Upstream ``redistribute_local_tensor`` treats any ``is_shard()`` placement as a
    ``Shard`` and compares ``current.dim != target.dim`` before calling
    ``current._to_new_shard_dim(..., target.dim)``. The token compares unequal to every
    int and to other placements' tokens, so ragged -> ragged and ragged -> Shard(d) reach
    our ``_to_new_shard_dim`` (which unwraps the token); used as an int anywhere else
    (``Shard(d) -> RaggedShard`` inside upstream code) it raises a clear error instead of
    silently mis-indexing.
    """

    __slots__ = ("placement",)

    def __init__(self, placement: RaggedShard):
        self.placement = placement

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _RaggedDim) and other.placement == self.placement

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("ragged-dim", self.placement))

    def __repr__(self) -> str:
        return f"<ragged dims of {self.placement!r}>"

    def _not_an_int(self, *_: Any) -> Any:
        raise NotImplementedError(_SHARD_TO_RAGGED)

    __index__ = __int__ = __lt__ = __le__ = __gt__ = __ge__ = _not_an_int
    __add__ = __radd__ = __sub__ = __rsub__ = __mod__ = __neg__ = _not_an_int


def _int_tuple(values: Any, name: str) -> tuple[int, ...]:
    if isinstance(values, int | str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}")
    out = tuple(values)
    for i, v in enumerate(out):
        check_int(f"{name}[{i}]", v)
    return tuple(int(v) for v in out)


class RaggedShard(Placement):
    """Uneven, block-granular sharding of the flattened leading ``dims`` of a tensor.

    Args:
        dims: the leading tensor dims flattened into rows; must be ``(0, 1, ..., k-1)``
            (``()`` makes the whole tensor one row).
        local_units: per rank of the mesh axis, how many consecutive units it holds
            (non-negative ints, at least one positive). Units are relative: the tensor's
            ``R`` rows are cut into ``sum(local_units)`` units of ``R / sum`` rows each,
            so ``R`` must be divisible by the sum. Stored in lowest terms
            (``(2, 6)`` becomes ``(1, 3)``: same split, accepted for more shapes).

    Raises:
        TypeError: ``dims`` or ``local_units`` are not sequences of ints.
        ValueError: ``dims`` is not a prefix ``0..k-1``, a unit is negative, or all are 0.

    Example::

        # (6, 4) tensor on 3 ranks: rows 0-1 | none | rows 2-5
        p = RaggedShard((0,), (1, 0, 2))
        p.local_shape((6, 4), 2)  # torch.Size([4, 4])
    """

    _dims: tuple[int, ...]
    _units: tuple[int, ...]

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]):
        super().__init__()
        dims_t = _int_tuple(dims, "dims")
        if dims_t != tuple(range(len(dims_t))):
            raise ValueError(f"dims must be the leading dims (0, 1, ..., k-1), got {dims_t}")
        units = _int_tuple(local_units, "local_units")
        if not units:
            raise ValueError("local_units must have one entry per rank of the mesh axis")
        if any(u < 0 for u in units):
            raise ValueError(f"local_units must be non-negative, got {units}")
        g = math.gcd(*units)
        if g == 0:
            raise ValueError(f"local_units must have at least one positive entry, got {units}")
        object.__setattr__(self, "_dims", dims_t)
        object.__setattr__(self, "_units", tuple(u // g for u in units))

    # -- immutable value semantics -------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RaggedShard is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("RaggedShard is immutable")

    @property
    def dims(self) -> tuple[int, ...]:
        """The flattened leading tensor dims, ``(0, ..., k-1)``."""
        return self._dims

    @property
    def local_units(self) -> tuple[int, ...]:
        """Units per rank of the mesh axis, in lowest terms."""
        return self._units

    @property
    def dim(self) -> _RaggedDim:
        """Not a tensor dim: a token that lets upstream redistribution reach this class.

        See :class:`_RaggedDim`; use :attr:`dims` for the flattened dims.
        """
        return _RaggedDim(self)

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``dim=None`` (the tensor is split across the axis), False for any dim.

        Upstream redistribution asks ``is_shard()`` to route a transition to this class's
        protocol methods; asking about a specific dim is answered False because no single
        tensor dim is chunked the ``Shard(dim)`` way.
        """
        return dim is None

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedShard) and (self._dims, self._units) == (
            other._dims,
            other._units,
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("RaggedShard", self._dims, self._units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self._dims}, local_units={self._units})"

    def __str__(self) -> str:
        return f"RS({','.join(map(str, self._dims))};{','.join(map(str, self._units))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RaggedShard, (self._dims, self._units))

    def __copy__(self) -> RaggedShard:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RaggedShard:
        return self

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return repr(self), {"RaggedShard": RaggedShard}

    # -- geometry ------------------------------------------------------------------------

    def _shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        dims = _shape_tuple(shape)
        if len(self._dims) > len(dims):
            raise ValueError(
                f"{self!r} flattens {len(self._dims)} dims but the tensor has shape {dims}"
            )
        return dims

    def num_rows(self, shape: Sequence[int]) -> int:
        """Rows of a tensor of ``shape``: ``prod(shape[:len(dims)])``."""
        return math.prod(self._shape(shape)[: len(self._dims)])

    def unit_rows(self, shape: Sequence[int]) -> int:
        """Rows per unit for a tensor of ``shape``.

        Raises:
            TypeError: ``shape`` is not a sequence of ints.
            ValueError: the rows are not divisible by ``sum(local_units)``, or a negative
                size.
        """
        rows = self.num_rows(shape)
        total = sum(self._units)
        if rows % total:
            raise ValueError(
                f"{self!r} cannot split shape {tuple(shape)}: its {rows} rows over dims "
                f"{self._dims} are not divisible into {total} equal units"
            )
        return rows // total

    def row_bounds(self, shape: Sequence[int]) -> Bounds:
        """Per rank, the ``(start, end)`` rows it holds (flattened leading dims)."""
        return prefix_bounds(self._units, self.unit_rows(shape))

    def element_bounds(self, shape: Sequence[int]) -> Bounds:
        """Per rank, the ``(start, end)`` elements it holds in row-major order."""
        dims = self._shape(shape)
        row = math.prod(dims[len(self._dims) :])
        return tuple((s * row, e * row) for s, e in self.row_bounds(dims))

    def local_shape(self, shape: Sequence[int], index: int) -> torch.Size:
        """Shape of the local tensor of rank ``index`` (its coordinate on the mesh axis).

        Raises:
            TypeError: ``index`` is not an int; ``shape`` is not a sequence of ints.
            ValueError: ``index`` outside ``[0, len(local_units))`` or an impossible split.
        """
        dims = self._shape(shape)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__} {index!r}")
        if not 0 <= index < len(self._units):
            raise ValueError(f"index must be in [0, {len(self._units)}), got {index}")
        rows = self._units[index] * self.unit_rows(dims)
        return torch.Size((rows, *dims[len(self._dims) :]))

    # -- constructors ----------------------------------------------------------------------

    @classmethod
    def from_numels(cls, shape: Sequence[int], numels: Sequence[int]) -> RaggedShard:
        """The placement giving rank ``i`` the next ``numels[i]`` elements of ``shape``.

        ``dims`` is chosen as short as possible: the fewest leading dims such that every
        rank boundary falls between rows (e.g. row boundaries of a matrix give
        ``dims=(0,)``; a single owner among several ranks gives ``dims=()``). An axis of
        one rank gets ``dims=(0,)`` (for tensors of 1 dim or more) so that the local shape
        is the global one, as upstream DTensor assumes on such an axis, empty tensors
        included. A 0-d tensor has no dim to shard: it keeps ``dims=()`` and a local shape
        ``(1,)`` there (a known limitation: ``full_tensor()`` of such a DTensor on a mesh
        of one rank has shape ``(1,)``).

        Args:
            shape: the global tensor shape.
            numels: elements per rank, in rank order; must sum to ``prod(shape)``.

        Raises:
            TypeError / ValueError: bad ``shape`` or ``numels`` (negative, wrong sum).
        """
        dims = _shape_tuple(shape)
        counts = _int_tuple(numels, "numels")
        if not counts:
            raise ValueError("numels must have one entry per rank of the mesh axis")
        if any(c < 0 for c in counts):
            raise ValueError(f"numels must be non-negative, got {counts}")
        total = math.prod(dims)
        if sum(counts) != total:
            raise ValueError(
                f"numels sum to {sum(counts)} but a tensor of shape {dims} has {total} elements"
            )
        if total == 0:
            if len(counts) == 1 and dims:
                # One rank: its local tensor must be the global (empty) one, as below.
                return cls((0,), (1,))
            # Nothing to hold: by convention rank 0 owns the (empty) tensor.
            return cls((), (1,) + (0,) * (len(counts) - 1))
        cuts = [b for b, _ in prefix_bounds(counts)[1:]]
        # On an axis of one rank upstream DTensor skips the placement's redistribute
        # methods and treats the local tensor as the global one, so the local shape must
        # be the global shape: dims=(0,), never the (1, *shape) of dims=().
        first = 1 if len(counts) == 1 and dims else 0
        for k in range(first, len(dims) + 1):
            row = math.prod(dims[k:])
            if all(c % row == 0 for c in cuts):
                return cls(tuple(range(k)), [c // row for c in counts])
        raise AssertionError("unreachable: k = ndim always divides")  # pragma: no cover

    @classmethod
    def from_granularity(
        cls, shape: Sequence[int], granularity: GranularitySpec, blocks: Sequence[int]
    ) -> RaggedShard:
        """The placement giving rank ``i`` the next ``blocks[i]`` whole blocks of ``shape``.

        Args:
            shape: the global tensor shape.
            granularity: a block spec (see :func:`~hyperrec.raggedshard.block_numel`):
                ``"rows"``, ``"32 rows"``, ``"2048 elements"``, ``"matrix"``,
                ``"tensor"``, or an int number of elements.
            blocks: whole blocks per rank; must sum to ``ceil(numel / block)`` (the last
                block may be partial and belongs to whichever rank holds it).

        Raises:
            TypeError: ``shape``/``blocks`` not sequences of ints, ``granularity`` not an
                int or a str.
            ValueError: the blocks do not add up to the tensor (an impossible split, e.g.
                a whole tensor split over two ranks), or bad inputs.
        """
        dims = _shape_tuple(shape)
        counts = _int_tuple(blocks, "blocks")
        if any(c < 0 for c in counts):
            raise ValueError(f"blocks must be non-negative, got {counts}")
        block = block_numel(dims, granularity)
        total = math.prod(dims)
        n_blocks = -(-total // block)
        if sum(counts) != n_blocks:
            raise ValueError(
                f"impossible split: a tensor of shape {dims} has {n_blocks} block(s) of "
                f"{block} element(s) for granularity {granularity!r}, but blocks sum to "
                f"{sum(counts)}"
            )
        numels = []
        start = 0
        for c in counts:
            end = min((start + c) * block, total)
            numels.append(end - min(start * block, total))
            start += c
        return cls.from_numels(dims, numels)

    @classmethod
    def whole(cls, owner: int, world_size: int) -> RaggedShard:
        """The whole tensor on rank ``owner`` of an axis of ``world_size`` (``dims=()``).

        Raises:
            TypeError: ``owner`` or ``world_size`` is not an int.
            ValueError: ``world_size < 1`` or ``owner`` outside ``[0, world_size)``.
        """
        check_int("world_size", world_size, minimum=1)
        check_int("owner", owner, minimum=0)
        if owner >= world_size:
            raise ValueError(f"owner must be in [0, {world_size}), got {owner}")
        units = [0] * world_size
        units[owner] = 1
        return cls((), units)

    # -- upstream DTensor placement protocol ---------------------------------------------
    # Called by torch.distributed.tensor._redistribute.redistribute_local_tensor (and thus
    # by DTensor.redistribute / full_tensor and their autograd) with the same signatures
    # as Shard's methods in torch 2.11-2.13.

    def _axis(self, mesh: Any, mesh_dim: int) -> coll.Axis:
        axis = coll.Axis.of(mesh, mesh_dim)
        if axis.size != len(self._units):
            raise ValueError(
                f"{self!r} has {len(self._units)} units but mesh axis {mesh_dim} has "
                f"{axis.size} ranks"
            )
        return axis

    def _to_replicate_tensor(
        self,
        local_tensor: torch.Tensor,
        mesh: Any,
        mesh_dim: int,
        current_logical_shape: Sequence[int],
    ) -> torch.Tensor:
        axis = self._axis(mesh, mesh_dim)
        leading = tuple(current_logical_shape[: len(self._dims)])
        shape = (*leading, *local_tensor.shape[1:])
        return coll.ragged_to_replicate(local_tensor, self.row_bounds(shape), leading, axis)

    def _replicate_to_shard(
        self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int, shard_index: int
    ) -> torch.Tensor:
        self._axis(mesh, mesh_dim)
        return coll.replicate_to_ragged(
            local_tensor, self.row_bounds(local_tensor.shape), len(self._dims), int(shard_index)
        )

    def _reduce_shard_tensor(
        self, tensor: torch.Tensor, mesh: Any, reduce_op: str, mesh_dim: int
    ) -> torch.Tensor:
        axis = self._axis(mesh, mesh_dim)
        return coll.partial_to_ragged(
            tensor, self.row_bounds(tensor.shape), len(self._dims), reduce_op, axis
        )

    def _to_new_shard_dim(
        self,
        local_tensor: torch.Tensor,
        mesh: Any,
        mesh_dim: int,
        current_logical_shape: Sequence[int],
        new_shard_dim: Any,
    ) -> torch.Tensor:
        axis = self._axis(mesh, mesh_dim)
        leading = tuple(current_logical_shape[: len(self._dims)])
        shape = (*leading, *local_tensor.shape[1:])
        if isinstance(new_shard_dim, _RaggedDim):
            return coll.ragged_to_ragged(local_tensor, self, new_shard_dim.placement, shape, axis)
        rows = self.row_bounds(shape)
        return coll.ragged_to_shard(
            local_tensor, rows, shape, len(self._dims), int(new_shard_dim), axis
        )
