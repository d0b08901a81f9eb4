"""Backend choice for the sparse update rules (the dialect's one resolver)."""

from __future__ import annotations

from typing import Literal

import torch

from hyperrec.parallel5d._validate import check_choice
from hyperrec.parallel5d.sparse._triton import available, interpreting

__all__ = ["BACKENDS", "Backend", "resolve_backend"]

Backend = Literal["auto", "torch", "triton"]
#: ``"auto"``: Triton on CUDA when it imports, the PyTorch reference otherwise.
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``.

    Raises:
        ValueError: an unknown backend; ``"triton"`` without Triton, or on CPU tensors
            outside the interpreter (``TRITON_INTERPRET=1``).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return "triton" if device.type == "cuda" and available() else "torch"
    if backend == "triton":
        if not available():
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}"
            )
    return backend
