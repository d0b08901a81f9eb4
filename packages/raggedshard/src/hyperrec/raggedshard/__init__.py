"""hyperrec.raggedshard: uneven, block-granular DTensor sharding for flat-buffer FSDP.

- :class:`RaggedShard`: a DTensor placement; rank ``i`` holds ``local_units[i]``
  consecutive units of the flattened leading ``dims`` (zeros allowed).
- :func:`plan_layout`: tensors -> offsets in one flat rank-major buffer of equal shards
  that never cuts a block (:class:`Layout`, pluggable :class:`Strategy`).
- :func:`redistribute`: every placement pair, one collective per changed mesh axis,
  differentiable; :func:`from_local`, :func:`distribute_tensor`; :func:`wrap_local`
  (a DTensor around a local tensor as it is: no check, copy or device move).
- Local-shard ops: :func:`ragged_map`, :func:`ragged_foreach`, :func:`total_norm`,
  :func:`to_local`, :func:`full_tensor`.
- :func:`enable_local_ops` (explicit, process-global) and :func:`local_ops` (a ``with``
  block): stock pointwise/foreach/fused-optimizer ATen ops on ragged DTensors run
  shard-locally, so ``torch.optim`` works on them unchanged.
- Reductions (:mod:`hyperrec.raggedshard.reductions`, installed on import): ``sum``,
  ``mean``, p-norms, ``amax``/``amin``, ``any``/``all`` of ragged DTensors equal the
  same ops on the full tensors, without gathering them.
- DCP: :class:`RaggedSavePlanner`, :class:`RaggedLoadPlanner`, :func:`checkpointable`.
- :mod:`hyperrec.raggedshard.reference`: the single-process spec used by the tests.
"""

from hyperrec.raggedshard._implicit import local_piece
from hyperrec.raggedshard._version import __version__
from hyperrec.raggedshard.checkpoint import (
    RaggedLoadPlanner,
    RaggedSavePlanner,
    checkpointable,
    local_chunks,
)
from hyperrec.raggedshard.dtensor_ops import enable_local_ops, local_ops, local_ops_enabled
from hyperrec.raggedshard.granularity import GranularitySpec, block_numel
from hyperrec.raggedshard.ops import full_tensor, ragged_foreach, ragged_map, to_local, total_norm
from hyperrec.raggedshard.placement import RaggedShard
from hyperrec.raggedshard.planner import STRATEGIES, Layout, Strategy, plan_layout
from hyperrec.raggedshard.redistribute import (
    check_placements,
    distribute_tensor,
    from_local,
    redistribute,
    wrap_local,
)
from hyperrec.raggedshard.reductions import install as _install_reductions

_install_reductions()

__all__ = [
    "STRATEGIES",
    "GranularitySpec",
    "Layout",
    "RaggedLoadPlanner",
    "RaggedSavePlanner",
    "RaggedShard",
    "Strategy",
    "enable_local_ops",
    "__version__",
    "block_numel",
    "check_placements",
    "checkpointable",
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "local_chunks",
    "local_piece",
    "local_ops",
    "local_ops_enabled",
    "plan_layout",
    "ragged_foreach",
    "ragged_map",
    "redistribute",
    "to_local",
    "total_norm",
    "wrap_local",
]
