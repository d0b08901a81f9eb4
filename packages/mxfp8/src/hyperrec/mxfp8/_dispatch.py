"""Backend resolution and the argument checks shared by the public functions."""

from __future__ import annotations

import torch

from hyperrec.mxfp8._triton.common import interpreting

__all__ = ["BACKENDS", "check_float_tensor", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA (or under ``TRITON_INTERPRET=1``), else ``"torch"``.

    Raises:
        ValueError: unknown ``backend``, or ``"triton"`` for a CPU tensor without the
            Triton interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_gpu = device.type == "cuda"
    if backend == "auto":
        return "triton" if on_gpu else "torch"
    if backend == "triton" and not (on_gpu or interpreting()):
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); "
            f"got a tensor on {device}"
        )
    return backend


def check_float_tensor(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    """Check ``x`` is a float32/bfloat16/float16 tensor with at least ``min_dim`` dims.

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: too few dims.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    return x
