"""Triton kernels behind ``backend="triton"`` of :mod:`hyperrec.jagged_attn` (private).

Laid out like the reference backend: ``ops.py`` registers the ``torch.library`` ops,
``_launch.py`` runs one :class:`~hyperrec.jagged_attn._opschema.AttentionCall` (allocates
outputs, builds schedules, picks configurations, launches ``_kernels.py``). Importing this
subpackage does not import Triton; the launchers import it on first use.

* :func:`interpreting`: whether ``TRITON_INTERPRET`` runs the kernels on the CPU.
* :func:`attention_forward` / :func:`attention_backward`: jagged softmax attention and GDPA
  (element-wise activations), forward and backward, bf16/fp16 in, fp32 accumulation.
* :func:`flops`, :func:`flops_upper_bound`: useful-FLOP counts.
* :func:`supports`, :func:`hopper_features`: capability probes.
* :class:`KernelConfig`: a tile configuration (to pin one, e.g. in tests or tuning), with
  the forward's variants (``prefetch``, ``softmax_fma``, ``lazy_rescale``, ``tma`` with
  the ``TMA_*`` bits, on in the shipped Hopper entries, ``warp_specialize``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any


def interpreting() -> bool:
    """Whether the Triton interpreter runs the kernels on the CPU: ``TRITON_INTERPRET``
    holds one of the values Triton reads as true (``1``, ``true``, ``on``, ``yes``, ``y``,
    any case). Read the way Triton reads it: ``"false"`` or ``""`` here meant "on" while
    Triton compiled for a GPU, and a CPU call failed with "0 active drivers"."""
    value = os.environ.get("TRITON_INTERPRET", "")
    return value.lower() in ("1", "true", "on", "yes", "y")


from hyperrec.jagged_attn._triton._configs import (  # noqa: E402
    TMA_ALL,
    TMA_K_MASKED,
    TMA_KV,
    TMA_O,
    TMA_Q,
    KernelConfig,
)
from hyperrec.jagged_attn._triton._flops import flops, flops_upper_bound  # noqa: E402
from hyperrec.jagged_attn._triton._probe import (  # noqa: E402
    hopper_features,
    supports,
    triton_available,
)

if TYPE_CHECKING:
    from hyperrec.jagged_attn._triton._launch import attention_backward, attention_forward

__all__ = [
    "TMA_ALL",
    "TMA_KV",
    "TMA_K_MASKED",
    "TMA_O",
    "TMA_Q",
    "KernelConfig",
    "attention_backward",
    "attention_forward",
    "flops",
    "flops_upper_bound",
    "hopper_features",
    "interpreting",
    "supports",
    "triton_available",
]

_LAZY = {"attention_backward", "attention_forward"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from hyperrec.jagged_attn._triton import _launch

        return getattr(_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
