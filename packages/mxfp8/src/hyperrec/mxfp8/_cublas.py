"""The fast 128-block path on cuBLAS: ``F.scaled_mm`` with 1x128 block scaling (Hopper).

cuBLAS (12.9+) multiplies FP8 operands with one FP32 scale per 128 elements along K for
each row of A and each column of B, promoting per block: the same math as our
``block_size=128`` Triton kernel. Our quantizer already writes the layouts it wants:
A row-major with scales ``(M, K/128)`` stored M-contiguous, B column-major with scales
``(N, K/128)`` stored N-contiguous, and on this path it also writes the scales as FP32
(``MXTensor.scale_fp32``), so a GEMM is one cuBLAS call. E8M0 bytes without their FP32
copy are widened here (exact, a few small kernels).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["blockwise_available", "blockwise_layouts_ok", "blockwise_mm"]

# layout: which B-scale layout cuBLAS took last; bias: 1 when it takes the bias fused,
# 0 when it refused it (then the bias is added after), None before the first try.
_STATE: dict[str, Any] = {"layout": 0, "broken": False, "bias": None}


@functools.cache
def _capable(device_index: int) -> bool:
    scaling = getattr(F, "ScalingType", None)
    if scaling is None or not hasattr(F, "scaled_mm") or not hasattr(scaling, "BlockWise1x128"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


def blockwise_available(device: torch.device) -> bool:
    """True on a Hopper GPU whose torch exposes ``F.scaled_mm`` 1x128 block scaling."""
    if device.type != "cuda" or _STATE["broken"]:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def blockwise_layouts_ok(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> bool:
    """Whether these operands can go to cuBLAS as they are (no copies)."""
    k = a.shape[1]
    return (
        block_size == 128
        and out_dtype == torch.bfloat16
        and k % 128 == 0
        and a.stride(1) == 1
        and b.stride(0) == 1
        and a.stride(0) % 16 == 0
        and b.stride(1) % 16 == 0
        and a_scale.stride(0) == 1
        and b_scale.stride(1) == 1
        and a.dtype == b.dtype == torch.float8_e4m3fn
    )


def _e8m0_to_fp32(s: torch.Tensor) -> torch.Tensor:
    b = s.to(torch.int32)
    bits = torch.where(b == 0, 1 << 22, b << 23)
    return torch.where(b == 255, float("nan"), bits.view(torch.float32))


def blockwise_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """``alpha * deq(a) @ deq(b) + bias`` on cuBLAS, or ``None`` if cuBLAS refuses.

    ``a_scale`` ``(M, K/128)`` and ``b_scale`` ``(K/128, N)`` are E8M0 bytes or their
    FP32 values (used as they are: no op before the GEMM unless ``alpha != 1``). A
    refusal disables this path for the process (with one warning) so callers fall back
    to the Triton kernel.
    """
    scaling = F.ScalingType
    # Widen on the stored (contiguous) layout so the views keep cuBLAS's strides.
    sa = a_scale if a_scale.dtype == torch.float32 else _e8m0_to_fp32(a_scale.t()).t()
    if alpha != 1.0:
        sa = sa * alpha  # elementwise ops keep the M-contiguous strides
    sb = b_scale if b_scale.dtype == torch.float32 else _e8m0_to_fp32(b_scale)
    fused = bias is not None and _STATE["bias"] != 0
    errors = []
    for i in (_STATE["layout"], 1 - _STATE["layout"]):
        try:
            out = F.scaled_mm(
                a,
                b,
                sa,
                scaling.BlockWise1x128,
                sb.t() if i == 0 else sb,
                scaling.BlockWise1x128,
                bias=_cast(bias, out_dtype) if fused and bias is not None else None,
                output_dtype=out_dtype,
            )
        except (RuntimeError, ValueError) as e:
            if fused and _STATE["bias"] is None:
                # Some builds take no bias with block scaling: retry without, add it after.
                _STATE["bias"] = 0
                return blockwise_mm(a, a_scale, b, b_scale, bias, alpha, out_dtype)
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        _STATE["layout"] = i
        if fused:
            _STATE["bias"] = 1
        elif bias is not None:
            out.add_(bias)  # in FP32, rounded once to out_dtype
        return out
    _STATE["broken"] = True
    warnings.warn(
        f"cuBLAS block-scaled GEMM refused ({'; '.join(errors)}); using the Triton kernel",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)
