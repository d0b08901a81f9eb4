"""Triton kernels (private): the fused MX quantizer and the block-scaled GEMMs.

:func:`interpreting` is the package's one check for the Triton CPU interpreter.
"""

from __future__ import annotations

import os

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter: ``TRITON_INTERPRET`` holds one
    of the values Triton reads as true (``1``, ``true``, ``on``, ``yes``, ``y``, any case;
    ``"false"`` or ``"off"`` used to count as on here while Triton compiled for a GPU)."""
    value = os.environ.get("TRITON_INTERPRET", "")
    return value.lower() in ("1", "true", "on", "yes", "y")
