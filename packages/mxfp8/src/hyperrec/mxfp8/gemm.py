"""Block-scaled GEMMs on MX tensors, and which of them is exact.

``mx_mm(a, b)`` computes ``alpha * a.dequantize() @ b.dequantize() (+ bias)`` with FP32
accumulation. Kernels (``kernel=``):

* ``"fixup"`` -- FP8 tensor cores (Hopper and later): one FP8 MMA per scale block along
  K, started from zero, then ``acc += mma * sa * sb`` in FP32. **Exact MX** for
  ``block_size=32``: every 32-wide block keeps its own scale; the tensor core only ever
  sums 32 products. The promotion costs two FP32 instructions per output element per
  block, about as much issue time as the FP8 MMA itself. ``block_size=128`` quantizes
  with one scale per 128 (a coarser format than MX, the DeepSeek-V3 recipe) and
  promotes four times less often.
* ``"upcast"`` -- **exact MX** for ``block_size=32`` on BF16 tensor cores: each FP8
  element times its power-of-two scale is a BF16 number (exact while the dequantized
  magnitude is >= 2**-130), BF16 products are exact in FP32 and the accumulator stays in
  the MMA.
* ``"cublas"`` -- ``block_size=128`` on cuBLAS's 1x128 block-scaled FP8 GEMM (Hopper,
  through ``torch.nn.functional.scaled_mm``); same math as ``fixup`` at 128, the bias
  added in cuBLAS's epilogue (or in FP32 right after, where cuBLAS refuses it), output
  rounded once. Operands from the quantizer carry FP32 scales, so a call is one cuBLAS
  launch. Falls back to ``fixup`` where unavailable.
* ``"dot_scaled"`` -- ``tl.dot_scaled`` with 32-wide scales: native MX MMA on Blackwell
  (sm100+); elsewhere Triton upcasts to BF16 (exact, slow).
* ``"auto"`` -- ``block_size=32``: ``dot_scaled`` where :func:`native_mx_supported`, else
  the exact Hopper kernel; ``block_size=128``: ``cublas`` where available, else ``fixup``.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from hyperrec.mxfp8 import _cublas
from hyperrec.mxfp8._dispatch import Backend, resolve_backend
from hyperrec.mxfp8._ops import eager_ok, mm_impl, mm_op
from hyperrec.mxfp8.tensor import MXTensor

__all__ = ["KERNELS", "mx_mm", "native_mx_supported"]

Kernel = Literal["auto", "fixup", "upcast", "cublas", "dot_scaled"]
"""GEMM implementation of :func:`mx_mm` (see its docstring)."""
KERNELS: tuple[Kernel, ...] = ("auto", "fixup", "upcast", "cublas", "dot_scaled")
#: The exact (block 32) kernel "auto" picks where MX MMA is not native (Hopper).
HOPPER_EXACT_KERNEL = "upcast"  # measured faster and more exact than "fixup" on H200
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _native_mx(device_index: int) -> bool:
    import triton.language as tl

    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 10 and hasattr(tl, "dot_scaled")


def native_mx_supported(device: torch.device | str | None = None) -> bool:
    """True when ``device`` has MX matrix instructions reachable from Triton
    (compute capability >= 10.0 and ``tl.dot_scaled``); False on Hopper and on CPU.

    ``device``: a ``torch.device``, a device string such as ``"cuda:1"``, or ``None``
    (the current CUDA device).

    Raises:
        TypeError: ``device`` is neither a device, a str nor ``None``.
        ValueError: ``device`` is a string that names no device.
    """
    # Checked first, so a bad argument fails the same way with or without a GPU.
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must name a device, got {device!r}") from None
    elif device is not None and not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, a str or None, got {type(device)}")
    if not torch.cuda.is_available():
        return False
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return False
    return _native_mx(device.index if device.index is not None else torch.cuda.current_device())


def _cublas_ok(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> bool:
    return _cublas.blockwise_available(a.device) and _cublas.blockwise_layouts_ok(
        a.data, a.scale, b.data, b.scale, a.block_size, out_dtype
    )


def _auto_kernel(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> str:
    if a.block_size == 32:
        return "dot_scaled" if native_mx_supported(a.device) else HOPPER_EXACT_KERNEL
    if a.block_size == 128 and _cublas_ok(a, b, out_dtype):
        return "cublas"
    return "fixup"


def _mm(
    a: MXTensor,
    b: MXTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    alpha: float,
    kernel: str,
    impl: str,
) -> torch.Tensor:
    """The body of :func:`mx_mm` after argument validation (used by MXLinear)."""
    if impl == "triton":
        if a.fmt.packed or b.fmt.packed:
            raise ValueError("MX4 GEMMs are only available with backend='torch'")
        if kernel == "auto":
            kernel = _auto_kernel(a, b, out_dtype)
        if kernel in ("dot_scaled", "upcast") and a.block_size != 32:
            raise ValueError(f"kernel={kernel!r} needs block_size=32 (the MX block)")
        if kernel == "cublas":
            if a.block_size != 128:
                raise ValueError("kernel='cublas' needs block_size=128")
            if not _cublas_ok(a, b, out_dtype):
                kernel = "fixup"
        if kernel == "fixup" and a.block_size < 32:
            raise ValueError("kernel='fixup' needs block_size >= 32 (FP8 MMA has K >= 32)")
        impl = kernel
    fp32 = impl == "cublas"
    args = (
        a.data,
        a.scale,
        b.data,
        b.scale,
        bias,
        a.block_size,
        float(alpha),
        out_dtype,
        impl,
        a.scale_fp32 if fp32 else None,
        b.scale_fp32 if fp32 else None,
    )
    # Eager calls skip the custom-op dispatch; traces still see the op.
    return mm_impl(*args) if eager_ok(a.data, b.data, bias) else mm_op(*args)


def mx_mm(
    a: MXTensor,
    b: MXTensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    alpha: float = 1.0,
    kernel: Kernel = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """``alpha * a.dequantize() @ b.dequantize() + bias`` with FP32 accumulation.

    Args:
        a: ``(M, K)`` MX tensor blocked along K (``axis=1``, e.g. ``to_mx(x)``).
        b: ``(K, N)`` MX tensor blocked along K (``axis=0``, e.g. ``to_mx(w).t()`` for a
            weight ``w`` of shape ``(N, K)``). Same ``block_size`` as ``a``. FP8 elements
            (E4M3 or E5M2, mixed allowed); MX4 only with ``backend="torch"``.
        out_dtype: bfloat16 (default), float16 or float32.
        bias: optional ``(N,)`` tensor added in FP32.
        alpha: FP32 factor on the product (e.g. ``1/n`` after a Hadamard transform).
        kernel: ``"auto"``, ``"fixup"``, ``"upcast"``, ``"cublas"`` or ``"dot_scaled"``
            (see the module docs).
        backend: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"``, ``"torch"``.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.

    Raises:
        TypeError: ``a``/``b`` not MX tensors; bad ``bias`` or ``out_dtype``.
        ValueError: wrong axes, mismatched K or block sizes, MX4 with Triton, unknown
            ``kernel``/``backend``, a NaN or infinite ``alpha``.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, MXTensor):
            raise TypeError(f"{name} must be an MXTensor, got {type(t).__name__}")
        if len(t.shape) != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.axis != 1:
        raise ValueError("a must be blocked along K (axis=1): use to_mx(x, axis=-1)")
    if b.axis != 0:
        raise ValueError("b must be blocked along K (axis=0): use to_mx(w).t() or axis=0")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.block_size != b.block_size:
        raise ValueError(f"block sizes differ: a {a.block_size}, b {b.block_size}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b on {b.device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating-point tensor")
        if bias.shape != (b.shape[1],) or bias.device != a.device:
            raise ValueError(f"bias must be ({b.shape[1]},) on {a.device}, got {tuple(bias.shape)}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"alpha must be a float, got {alpha!r}")
    # alpha is applied in FP32: a value that overflows there is as bad as an infinity.
    if not (math.isfinite(alpha) and abs(alpha) <= torch.finfo(torch.float32).max):
        raise ValueError(f"alpha must be finite in float32, got {alpha!r}")
    impl = resolve_backend(backend, a.device)
    return _mm(a, b, out_dtype, bias, alpha, kernel, impl)
