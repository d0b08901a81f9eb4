"""Triton kernels (private): the fused MX quantizer and the block-scaled GEMMs.

:func:`interpreting` is the package's one check for the Triton CPU interpreter.
"""

from __future__ import annotations

import os

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET`` set and
    not ``"0"``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
