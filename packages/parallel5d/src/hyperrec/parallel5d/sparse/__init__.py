"""hyperrec.parallel5d.sparse: embedding tables fully sharded over the whole job.

- :class:`ShardedEmbeddingCollection`: many tables (row-wise, or whole on one rank for
  small ones), pooled bags (sum/mean) and sequence features over jagged ids; every row
  lives on exactly one rank; ids travel to the owners by all-to-all (inside the shard
  group first, then across replicas), rows come back, row gradients go to the owners
  (no dense gradient anywhere).
- Lazy owner-side optimizers with sharded states: :class:`RowWiseAdagrad`,
  :class:`LazyAdagrad`, :class:`LazyAdam`.
- DCP: rows and states are ``RaggedShard`` DTensors (save on N ranks, load on M).
- :func:`sparse_traffic`, :func:`sparse_memory`: bytes per tier per step and per-rank
  memory of this design against TorchRec-style 2-D and flat row-wise sharding.
"""

from hyperrec.parallel5d.sparse.collection import (
    ROUTINGS,
    Routing,
    ShardedEmbeddingCollection,
    init_rows,
)
from hyperrec.parallel5d.sparse.config import (
    POOLINGS,
    ROW_ORDERS,
    SHARDINGS,
    FeatureConfig,
    Pooling,
    Sharding,
    TableConfig,
)
from hyperrec.parallel5d.sparse.optim import LazyAdagrad, LazyAdam, RowWiseAdagrad
from hyperrec.parallel5d.sparse.plan import ShardingPlan, TablePlacement, plan_sharding

__all__ = [
    "POOLINGS",
    "ROUTINGS",
    "ROW_ORDERS",
    "SHARDINGS",
    "FeatureConfig",
    "LazyAdagrad",
    "LazyAdam",
    "Pooling",
    "Routing",
    "RowWiseAdagrad",
    "ShardedEmbeddingCollection",
    "Sharding",
    "ShardingPlan",
    "TableConfig",
    "TablePlacement",
    "init_rows",
    "plan_sharding",
]
