"""Backend choice: the one place that turns ``backend="auto"`` into a concrete backend."""

from __future__ import annotations

from typing import Literal

import torch

from hyperrec.mxfp8._triton import interpreting
from hyperrec.mxfp8._validate import check_choice, check_tensor

__all__ = ["BACKENDS", "Backend", "check_float_tensor", "resolve_backend"]

Backend = Literal["auto", "torch", "triton"]
"""Which implementation runs: ``"torch"`` (the reference), ``"triton"`` (the kernels) or
``"auto"`` (Triton on CUDA, the reference elsewhere)."""
BACKENDS: tuple[Backend, ...] = ("auto", "torch", "triton")
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """``"auto"`` -> ``"triton"`` on CUDA, else ``"torch"``; ``"triton"`` also runs CPU
    tensors under the Triton interpreter (``TRITON_INTERPRET=1``).

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: unknown ``backend``, or ``"triton"`` for a CPU tensor without the
            Triton interpreter.
    """
    check_choice("backend", backend, BACKENDS)
    on_gpu = device.type == "cuda"
    if backend == "auto":
        return "triton" if on_gpu else "torch"
    if backend == "triton" and not (on_gpu or interpreting()):
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); "
            f"got a tensor on {device}"
        )
    return "triton" if backend == "triton" else "torch"


def check_float_tensor(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    """Check ``x`` is a float32/bfloat16/float16 tensor with at least ``min_dim`` dims.

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: too few dims.
    """
    t = check_tensor(name, x, dtypes=_FLOAT_INPUTS)
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    return t
