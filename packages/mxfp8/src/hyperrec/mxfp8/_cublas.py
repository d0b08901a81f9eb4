"""The fast 128-block path on cuBLAS: ``F.scaled_mm`` with 1x128 block scaling (Hopper).

cuBLAS (12.9+) multiplies FP8 operands with one FP32 scale per 128 elements along K for
each row of A and each column of B, promoting per block: the same math as our
``block_size=128`` Triton kernel. Our quantizer already writes the layouts it wants:
A row-major with scales ``(M, K/128)`` stored M-contiguous, B column-major with scales
``(N, K/128)`` stored N-contiguous. Only the E8M0 bytes are widened to FP32 (exact).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

__all__ = ["blockwise_available", "blockwise_layouts_ok", "blockwise_mm"]

_STATE = {"layout": 0, "broken": False}


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

    A refusal disables this path for the process (with one warning) so callers fall
    back to the Triton kernel.
    """
    scaling = F.ScalingType
    # Widen on the stored (contiguous) layout so the views keep cuBLAS's strides.
    sa = (_e8m0_to_fp32(a_scale.t()) * alpha).t()
    sb_stored = _e8m0_to_fp32(b_scale)
    candidates = (sb_stored.t(), sb_stored)
    errors = []
    for i in (_STATE["layout"], 1 - _STATE["layout"]):
        try:
            out = F.scaled_mm(
                a,
                b,
                sa,
                scaling.BlockWise1x128,
                candidates[i],
                scaling.BlockWise1x128,
                output_dtype=out_dtype,
            )
        except (RuntimeError, ValueError) as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        _STATE["layout"] = i
        return out if bias is None else out + bias.to(out.dtype)
    _STATE["broken"] = True
    warnings.warn(
        f"cuBLAS block-scaled GEMM refused ({'; '.join(errors)}); using the Triton kernel",
        RuntimeWarning,
        stacklevel=3,
    )
    return None
