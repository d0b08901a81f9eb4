"""hyperrec.parallel5d: veScale-style FSDP on RaggedShard + DBuffer.

- :func:`fully_shard` — PyTorch FSDP2's call shape and behaviour, with each parameter
  group in flat zero-copy :class:`hyperrec.dbuffer.DBuffer` s: one all-gather and one
  reduce-scatter per group and dtype, no copy-in, no copy-out; parameters are DTensors
  with ``RaggedShard`` placements so standard optimizers and DCP work unchanged.
- Structure-aware optimizers whose state does not depend on the mesh:
  :class:`Muon` (whole matrices) and :class:`AdamW8bit` (block-quantized states); their
  states are DTensors sharded like the parameters, so DCP saves them on N ranks and
  loads them on M.
- Fully sharded sparse parallelism (:mod:`hyperrec.parallel5d.sparse`):
  :class:`ShardedEmbeddingCollection` keeps every embedding row and its optimizer state
  on exactly one rank of the job (ids routed inside the shard group, then across
  replicas); lazy owner-side optimizers :class:`RowWiseAdagrad`, :class:`LazyAdagrad`,
  :class:`LazyAdam`.
"""

from hyperrec.parallel5d._api import Granularity, MixedPrecisionPolicy
from hyperrec.parallel5d._version import __version__
from hyperrec.parallel5d.fsdp import FSDPModule, dbuffers, full_state_dict, fully_shard
from hyperrec.parallel5d.optim import AdamW8bit, Muon
from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdagrad,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)

__all__ = [
    "AdamW8bit",
    "FSDPModule",
    "FeatureConfig",
    "Granularity",
    "LazyAdagrad",
    "LazyAdam",
    "MixedPrecisionPolicy",
    "Muon",
    "RowWiseAdagrad",
    "ShardedEmbeddingCollection",
    "TableConfig",
    "__version__",
    "dbuffers",
    "full_state_dict",
    "fully_shard",
]
