"""Triton kernels of the sparse subpackage (imported only when a Triton backend runs)."""

from __future__ import annotations

import os

__all__ = ["available", "interpreting"]


def interpreting() -> bool:
    """True when the kernels run on the CPU: ``TRITON_INTERPRET`` holds one of the values
    Triton reads as true (``1``, ``true``, ``on``, ``yes``, ``y``, any case; ``"false"`` or
    ``"off"`` used to count as on here while Triton compiled for a GPU)."""
    value = os.environ.get("TRITON_INTERPRET", "")
    return value.lower() in ("1", "true", "on", "yes", "y")


def available() -> bool:
    """True when ``triton`` imports (it is not a declared dependency of this package)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
