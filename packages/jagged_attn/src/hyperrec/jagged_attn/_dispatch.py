"""Backend selection: ``backend="auto" | "torch" | "triton"``.

Each backend is a forward custom op (its backward and fake implementations registered)
with the argument list of :func:`hyperrec.jagged_attn._opschema.schema`:
``_torch/ops.py`` (the pure-PyTorch reference, any device and dtype) and
``_triton/ops.py`` (the Triton kernels: bf16/fp16, head dims 16-256, CUDA GPUs of compute
capability >= 8.0, or CPU tensors under ``TRITON_INTERPRET=1``). :func:`resolve_backend`
turns the user's choice into one of them before any tracing, so ``torch.compile`` sees a
single op per call. ``"auto"`` picks Triton for CUDA tensors it supports and the reference
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from hyperrec.jagged_attn._fp8.ops import resolve_fp8_backend
from hyperrec.jagged_attn._torch.ops import attention_torch
from hyperrec.jagged_attn._triton.ops import attention_triton, unsupported_reason
from hyperrec.jagged_attn._validate import check_choice
from hyperrec.jagged_attn.fp8 import resolve_precision

__all__ = ["BACKENDS", "Backend", "resolve_backend"]

#: Names accepted by ``backend=``.
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
Backend = Literal["auto", "torch", "triton"]


def resolve_backend(
    backend: str, q: torch.Tensor, v: torch.Tensor, *, precision: object = "bf16"
) -> Callable[..., torch.Tensor]:
    """The forward op for ``backend`` and these inputs (``q``/``v`` give device, dtype and
    head dims); it takes :meth:`AttentionCall.op_args
    <hyperrec.jagged_attn._opschema.AttentionCall.op_args>` and returns the output.

    ``precision`` other than ``"bf16"`` selects the FP8 / MXFP8 forward
    (:mod:`hyperrec.jagged_attn.fp8`): ``"auto"`` runs its kernels on CUDA GPUs that
    support them and its pure-PyTorch emulation elsewhere.

    Raises:
        TypeError: ``backend`` is not a str, or ``precision`` neither a str nor an FP8Config.
        ValueError: ``backend`` is not one of :data:`BACKENDS`, ``precision`` is unknown or
            does not fit the head dims, or ``backend="triton"`` for inputs the kernels do
            not support (the message says why).
        ModuleNotFoundError: ``precision="mxfp8"`` without hyperrec-mxfp8 installed.
    """
    check_choice("backend", backend, BACKENDS)
    # --- precision (FP8 / MXFP8 forward) ---
    fp8 = resolve_precision(precision)
    if fp8 is not None:
        fp8.check_shapes(q.shape[2], v.shape[2])
        return resolve_fp8_backend(fp8, backend, q, v)
    # --- bf16 (the inputs' own precision) ---
    if backend == "torch":
        return attention_torch
    reason = unsupported_reason(q, v)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        return attention_triton
    # "auto": the kernels on CUDA when they support the inputs, else the reference
    return attention_triton if q.device.type == "cuda" and reason is None else attention_torch
