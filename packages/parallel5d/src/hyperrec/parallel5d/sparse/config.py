"""Table and feature configs of a :class:`ShardedEmbeddingCollection`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import torch

from hyperrec.parallel5d._validate import check_choice, check_float, check_int

__all__ = [
    "DTYPES",
    "POOLINGS",
    "ROW_ORDERS",
    "SHARDINGS",
    "FeatureConfig",
    "Pooling",
    "Sharding",
    "TableConfig",
]

Pooling = Literal["none", "sum", "mean"]
#: ``"none"``: one embedding per id (sequence features); ``"sum"`` / ``"mean"``: one per bag.
POOLINGS: tuple[str, ...] = ("none", "sum", "mean")

Sharding = Literal["auto", "row", "table"]
#: ``"row"``: contiguous row blocks on every rank of the job; ``"table"``: the whole table
#: on one rank; ``"auto"``: ``"table"`` for tables of at most ``table_wise_max_bytes``.
SHARDINGS: tuple[str, ...] = ("auto", "row", "table")

#: ``"id"``: row ``i`` of the stored table is id ``i``; ``"hashed"``: id ``i`` is stored at
#: row ``(a * i) mod num_rows`` for a fixed ``a`` coprime with ``num_rows`` near
#: ``0.618 num_rows``, so runs of consecutive ids (hot low ids) spread over every owner.
ROW_ORDERS: tuple[str, ...] = ("id", "hashed")

#: Largest table a ``"hashed"`` order supports (``a * i`` must fit in int64).
MAX_HASHED_ROWS = 3_037_000_499

#: Table dtypes (the optimizer states are float32 whatever the table dtype).
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_name(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {type(value).__name__} {value!r}")
    if not _NAME.match(value):
        raise ValueError(
            f"{where} must be a Python identifier (it is a state-dict key), got {value!r}"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table: ``num_rows x dim`` rows of ``dtype``."""

    name: str
    """Table name (a Python identifier); the state-dict key is ``tables.<name>.weight``."""
    num_rows: int
    """Rows (ids ``0 .. num_rows - 1``); at least 1."""
    dim: int
    """Embedding width; at least 1. Tables of one ``(dim, dtype)`` share collectives."""
    dtype: torch.dtype = torch.float32
    """Storage and communication dtype of the rows: float32, bfloat16 or float16."""
    sharding: Sharding = "auto"
    """``"row"``, ``"table"`` or ``"auto"`` (see :data:`SHARDINGS`)."""
    init_std: float | None = None
    """Rows are initialised ``N(0, init_std**2)``; ``None`` means ``dim ** -0.5``."""
    row_order: Literal["id", "hashed"] = "id"
    """How ids map to stored rows (see :data:`ROW_ORDERS`). ``"hashed"`` balances owners
    when popular ids are clustered (e.g. low); the state dict then holds the rows (and
    optimizer states) in hashed order, the same for every world size."""

    def __post_init__(self) -> None:
        _check_name("TableConfig.name", self.name)
        check_int("TableConfig.num_rows", self.num_rows, minimum=1)
        check_int("TableConfig.dim", self.dim, minimum=1)
        if self.dtype not in DTYPES:
            raise TypeError(
                f"TableConfig.dtype must be one of {[str(d) for d in DTYPES]}, got {self.dtype!r}"
            )
        check_choice("TableConfig.sharding", self.sharding, SHARDINGS)
        if self.init_std is not None:
            check_float("TableConfig.init_std", self.init_std, minimum=0.0)
        check_choice("TableConfig.row_order", self.row_order, ROW_ORDERS)
        if self.row_order == "hashed" and self.num_rows > MAX_HASHED_ROWS:
            raise ValueError(
                f"TableConfig.num_rows must be <= {MAX_HASHED_ROWS} for row_order='hashed', "
                f"got {self.num_rows}"
            )

    @property
    def hash_multiplier(self) -> int:
        """``a`` of the ``"hashed"`` order: the integer nearest ``0.618 num_rows`` that is
        coprime with ``num_rows`` (1 for tables of at most 2 rows)."""
        n = self.num_rows
        if n <= 2:
            return 1
        a = max(1, round(n * 0.6180339887498949))
        while math.gcd(a, n) != 1:
            a += 1
        return a

    @property
    def std(self) -> float:
        """The initialisation standard deviation actually used."""
        return self.dim**-0.5 if self.init_std is None else float(self.init_std)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table's rows."""
        return self.num_rows * self.dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """One input feature: jagged ids looked up in ``table`` and pooled per ``pooling``."""

    name: str
    """Feature name: the key of the forward's input and output dicts."""
    table: str
    """Name of the :class:`TableConfig` it reads (several features may share one)."""
    pooling: Pooling = "none"
    """``"none"`` (``[num_ids, dim]`` out), ``"sum"`` or ``"mean"`` (``[num_bags, dim]``)."""

    def __post_init__(self) -> None:
        _check_name("FeatureConfig.name", self.name)
        _check_name("FeatureConfig.table", self.table)
        check_choice("FeatureConfig.pooling", self.pooling, POOLINGS)
