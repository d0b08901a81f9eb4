"""Backend selection: ``backend="auto" | "torch" | "triton"``.

Each backend is a forward custom op (with its backward and fake implementations
registered) that takes the tensors followed by
:func:`~hyperrec.jagged_attn.ops.spec_args`. ``resolve_backend`` turns the user's choice
into one of them before any tracing, so ``torch.compile`` sees a single op per call.

PLACEHOLDER: the Triton kernels are not implemented yet. ``"triton"`` raises
``NotImplementedError`` and ``"auto"`` resolves to the reference everywhere. When the
kernels land, ``"auto"`` becomes "Triton on CUDA when the spec is supported, otherwise the
reference", and ``supported_by_triton(spec, ...)`` states the kernel's limits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperrec.jagged_attn._checks import check_choice
from hyperrec.jagged_attn.ops import attention_torch

__all__ = ["BACKENDS", "resolve_backend"]

#: Names accepted by ``backend=``.
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")

_OPS: dict[str, Callable[..., torch.Tensor]] = {"torch": attention_torch}


def resolve_backend(backend: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """The forward op for ``backend`` on ``device``.

    Raises:
        TypeError: ``backend`` is not a str.
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        NotImplementedError: ``backend="triton"`` (the kernels are not implemented yet).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "triton":
        raise NotImplementedError(
            "backend='triton': the jagged_attn Triton kernels are not implemented yet "
            "(planned); use backend='torch' or 'auto' (the pure-PyTorch reference)"
        )
    del device  # "auto" will look at it once the Triton backend exists.
    return _OPS["torch"]
