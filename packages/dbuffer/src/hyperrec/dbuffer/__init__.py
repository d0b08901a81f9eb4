"""hyperrec.dbuffer: one flat, rank-major, zero-copy buffer per parameter group.

- :class:`DBuffer` lays a group of same-dtype tensors out with
  :func:`hyperrec.raggedshard.plan_layout`; every shard and every full tensor is a view,
  so unsharding is one ``all_gather_into_tensor`` and gradient reduction one
  ``reduce_scatter_tensor``, with no copy-in and no copy-out.
- Group ops on the flat storage, one kernel per buffer: :func:`grad_norm`,
  :func:`clip_grad_norm_`, :func:`zero_grad_`, and :func:`flat_params` for fused
  optimizers.
"""

from hyperrec.dbuffer._version import __version__
from hyperrec.dbuffer.buffer import DBuffer, ReduceOptions
from hyperrec.dbuffer.ops import clip_grad_norm_, flat_params, grad_norm, zero_grad_

__all__ = [
    "DBuffer",
    "ReduceOptions",
    "__version__",
    "clip_grad_norm_",
    "flat_params",
    "grad_norm",
    "zero_grad_",
]
