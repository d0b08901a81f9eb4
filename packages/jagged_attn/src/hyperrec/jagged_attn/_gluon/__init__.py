"""Warp-specialised Hopper forward and backward of jagged attention, written in Gluon.

A FlashAttention-3-style forward for sm_90 written with ``triton.experimental.gluon``
(Triton 3.6's API): a producer warp streams K/V tiles through TMA into a multi-stage
shared-memory ring guarded by mbarriers, two consumer warpgroups run ``warpgroup_mma`` and
the softmax with intra-warpgroup overlap (softmax of tile ``j`` while the tensor cores
compute ``Q K_{j+1}^T`` and ``P_{j-1} V_{j-1}``) and optionally ping-pong their GEMM
issue, over a persistent, cost-sorted schedule of jagged (query tile, head) work items.
The output leaves through TMA stores (masked stores for a sequence's last partial tile),
with an fp32 base-2 LSE.

Status: the package's default forward on sm_90 with Triton 3.6 for the calls it can
serve whose longest sequence exceeds 256 tokens (``_triton._launch.GLUON_DEFAULT``,
``GLUON_MIN_SEQLEN``; ``JAGGED_ATTN_GLUON=0`` off, ``=1`` every call it can serve; see
``_triton._launch.gluon_unsupported``). Compiled ahead of time for sm_90 on a CPU machine
(``bench/compile_gluon.py``); its numerics and speed are checked on the GPU only
(``tests/test_gluon_forward.py``, ``bench/bench_gluon.py``): Gluon has no CPU interpreter.

The backward of the same calls (since 0.2.15, ``JAGGED_ATTN_GLUON_BWD``): a dK/dV kernel
over 128-key tiles and a dQ kernel over 128-row query tiles with the same producer /
consumer partitions (``_bwd_kernel.py``), launched by the package's backward through
``_bwd_launch.run_dkdv`` / ``run_dq``; checked on the GPU by
``tests/test_gluon_backward.py`` and timed by ``bench/bench_gluon_bwd.py``.

The FP8 forward (since 0.2.17, ``JAGGED_ATTN_GLUON_FP8``): the same structure with E4M3
operands and the FP8 path's scales (``_fp8_kernel.py``), launched by the package's FP8
launcher through ``_fp8_launch.run`` (the default for causal ``precision="fp8"`` calls
longer than 256 tokens); checked on the GPU by ``tests/test_gluon_fp8.py``.

Importing this subpackage imports neither Triton nor the kernels.

* :func:`jagged_attention_fwd_gluon`: ``(out, lse)`` for softmax (causal or not) or
  GDPA-SiLU, bf16/fp16, head dim 64 or 128.
* :class:`GluonConfig`, :func:`default_config`, :func:`shared_memory_bytes`.
* :func:`gluon_supported`, :func:`unsupported_reason`: capability probes.
"""

from __future__ import annotations

from hyperrec.jagged_attn._gluon._launch import (
    ACTIVATIONS,
    NORMALIZATIONS,
    GluonConfig,
    default_config,
    jagged_attention_fwd_gluon,
    shared_memory_bytes,
)
from hyperrec.jagged_attn._gluon._probe import (
    SUPPORTED_TRITON,
    gluon_supported,
    unsupported_reason,
)

__all__ = [
    "ACTIVATIONS",
    "NORMALIZATIONS",
    "SUPPORTED_TRITON",
    "GluonConfig",
    "default_config",
    "gluon_supported",
    "jagged_attention_fwd_gluon",
    "shared_memory_bytes",
    "unsupported_reason",
]
