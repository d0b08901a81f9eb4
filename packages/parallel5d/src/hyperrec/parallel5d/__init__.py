"""hyperrec.parallel5d: veScale-style FSDP on RaggedShard + DBuffer.

- :func:`fully_shard` — PyTorch FSDP2's call shape and behaviour (its whole public API:
  offload policies, grouped modules, ``FSDPModule`` setters, ...), with each parameter
  group in flat zero-copy :class:`hyperrec.dbuffer.DBuffer` s: one all-gather and one
  reduce-scatter per group and dtype, no copy-in, no copy-out; parameters are DTensors
  with ``RaggedShard`` placements so standard optimizers and DCP work unchanged.
- Structure-aware optimizers whose state does not depend on the mesh:
  :class:`Muon` (whole matrices) and :class:`AdamW8bit` (block-quantized states); their
  states are DTensors sharded like the parameters, so DCP saves them on N ranks and
  loads them on M.
- The 5-D mesh: :class:`Topology` (hosts, zones, link tiers) and :class:`ParallelMesh`
  (dense ``replicate x fsdp``, experts ``replicate x efsdp x ep``, sparse
  ``sparse_dp x sparse_shard x sparse_replicate``; each axis asserted on its tier);
  :class:`RoutedExperts` (expert parallelism); the cost model and ``plan_mesh`` in
  :mod:`hyperrec.parallel5d.cost`.
- Fully sharded sparse parallelism (:mod:`hyperrec.parallel5d.sparse`):
  :class:`ShardedEmbeddingCollection` keeps every embedding row and its optimizer state
  on exactly one rank of the job (ids routed inside the shard group, then across
  replicas); lazy owner-side optimizers :class:`RowWiseAdagrad`, :class:`LazyAdagrad`,
  :class:`LazyAdam`.
"""

from hyperrec.parallel5d._api import Granularity, MixedPrecisionPolicy
from hyperrec.parallel5d._compat import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from hyperrec.parallel5d._version import __version__
from hyperrec.parallel5d.experts import GroupedExperts, RoutedExperts, TopKRouter
from hyperrec.parallel5d.fsdp import (
    FSDPModule,
    dbuffers,
    full_state_dict,
    fully_shard,
    load_full_state_dict,
)
from hyperrec.parallel5d.mesh import (
    AXES,
    DEFAULT_AXIS_TIERS,
    MeshSpec,
    ParallelMesh,
    axis_placement,
    check_axis_tiers,
)
from hyperrec.parallel5d.optim import AdamW8bit, Muon
from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdagrad,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.parallel5d.topology import Link, Topology

__all__ = [
    "AXES",
    "DEFAULT_AXIS_TIERS",
    "AdamW8bit",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FeatureConfig",
    "Granularity",
    "GroupedExperts",
    "LazyAdagrad",
    "LazyAdam",
    "Link",
    "MeshSpec",
    "MixedPrecisionPolicy",
    "Muon",
    "OffloadPolicy",
    "ParallelMesh",
    "RoutedExperts",
    "RowWiseAdagrad",
    "ShardedEmbeddingCollection",
    "TableConfig",
    "TopKRouter",
    "Topology",
    "UnshardHandle",
    "__version__",
    "axis_placement",
    "check_axis_tiers",
    "dbuffers",
    "full_state_dict",
    "fully_shard",
    "load_full_state_dict",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
