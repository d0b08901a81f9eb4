"""Backend selection: ``backend="auto" | "torch" | "triton"``.

Each backend is a forward custom op (with its backward and fake implementations
registered) that takes the tensors followed by
:func:`~hyperrec.jagged_attn.ops.spec_args`. ``resolve_backend`` turns the user's choice
into one of them before any tracing, so ``torch.compile`` sees a single op per call.

``"torch"`` is the pure-PyTorch reference (any device and dtype). ``"triton"`` is the
Triton kernels of :mod:`hyperrec.jagged_attn.triton` (bf16/fp16, head dims 16-256, CUDA
GPUs of compute capability >= 8.0, or CPU tensors under ``TRITON_INTERPRET=1``);
``"auto"`` picks Triton for CUDA tensors it supports and the reference otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperrec.jagged_attn._validate import check_choice
from hyperrec.jagged_attn.ops import attention_torch
from hyperrec.jagged_attn.triton.ops import attention_triton, unsupported_reason

__all__ = ["BACKENDS", "resolve_backend"]

#: Names accepted by ``backend=``.
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


def resolve_backend(backend: str, q: torch.Tensor, v: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The forward op for ``backend`` and these inputs (``q``/``v`` give device, dtype and
    head dims).

    Raises:
        TypeError: ``backend`` is not a str.
        ValueError: ``backend`` is not one of :data:`BACKENDS`, or ``backend="triton"`` for
            inputs the kernels do not support (the message says why).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return attention_torch
    reason = unsupported_reason(q, v)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        return attention_triton
    # "auto": the kernels on CUDA when they support the inputs, else the reference
    return attention_triton if q.device.type == "cuda" and reason is None else attention_torch
