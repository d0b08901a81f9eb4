"""Triton kernels of the sparse subpackage (imported only when a Triton backend runs)."""

from __future__ import annotations

import os

__all__ = ["available", "interpreting"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set and not ``"0"`` (kernels run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """True when ``triton`` imports (it is not a declared dependency of this package)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
