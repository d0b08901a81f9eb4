"""Public quantization entry points: :func:`to_mx` and the fused :func:`mx_quantize`."""

from __future__ import annotations

import math

import torch

from hyperrec.mxfp8 import _cublas
from hyperrec.mxfp8._dispatch import Backend, check_float_tensor, resolve_backend
from hyperrec.mxfp8._ops import eager_ok, quantize_2d_impl, quantize_2d_op
from hyperrec.mxfp8._validate import check_bool, check_choice
from hyperrec.mxfp8.formats import E4M3, ElemFormat, ScaleMode, check_scale_mode, get_format
from hyperrec.mxfp8.hadamard import check_hadamard
from hyperrec.mxfp8.reference import ACTIVATIONS, Activation
from hyperrec.mxfp8.tensor import MXTensor

__all__ = ["BLOCK_SIZES", "mx_quantize", "to_mx"]

#: Supported block sizes: 32 is OCP MX; 128 is the fast Hopper GEMM path.
BLOCK_SIZES = (16, 32, 64, 128)


def _check_block_size(block_size: object) -> int:
    return int(check_choice("block_size", block_size, BLOCK_SIZES))


def _seed_tensor(
    stochastic_rounding: bool, seed: int | torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    if not check_bool("stochastic_rounding", stochastic_rounding):
        if seed is not None:
            raise ValueError("seed is only used with stochastic_rounding=True")
        return None
    if seed is None:
        # Drawn on the device from torch's generator: no host sync, reproducible under
        # torch.manual_seed.
        return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != device:
            raise ValueError(
                f"seed tensor must be one int64 element on {device}, got "
                f"{seed.dtype} {tuple(seed.shape)} on {seed.device}"
            )
        return seed.reshape(1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or an int64 tensor, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be a non-negative int or an int64 tensor, got {seed!r}")
    return torch.tensor([seed], dtype=torch.int64, device=device)


def _mx(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: ElemFormat,
    block_size: int,
    axis: int,
    shape: torch.Size,
    dtype: torch.dtype,
    scale_fp32: torch.Tensor | None = None,
) -> MXTensor:
    return MXTensor(
        data=data,
        scale=scale,
        fmt=fmt,
        block_size=block_size,
        axis=axis,
        shape=torch.Size(shape),
        orig_dtype=dtype,
        scale_fp32=scale_fp32,
    )


def _wants_fp32_scales(fmt: ElemFormat, block_size: int, impl: str, device: torch.device) -> bool:
    # The cuBLAS 1x128 path reads FP32 scales: the kernel writes them in the same pass.
    if impl != "triton" or block_size != 128 or fmt is not E4M3:
        return False
    return _cublas.blockwise_available(device)


def _need(t: MXTensor | None) -> MXTensor:
    """A copy the caller asked :func:`_quantize` for (never ``None`` then)."""
    if t is None:
        raise RuntimeError("the quantizer did not return a requested copy")
    return t


def _quantize(
    x: torch.Tensor,
    seed: torch.Tensor | None,
    fmt: ElemFormat,
    block_size: int,
    scale_mode: str,
    rowwise: bool,
    colwise: bool,
    activation: str,
    hadamard: int,
    hadamard_seed: int,
    impl: str,
) -> tuple[MXTensor | None, MXTensor | None]:
    """Validated 2-D quantization (the body of :func:`mx_quantize`, used by MXLinear)."""
    sf = _wants_fp32_scales(fmt, block_size, impl, x.device)
    args = (
        x,
        seed,
        fmt.name,
        block_size,
        scale_mode,
        rowwise,
        colwise,
        activation,
        hadamard,
        hadamard_seed,
        impl,
        sf,
    )
    # Eager calls skip the custom-op dispatch (~10 us each); traces still see the op.
    outs = quantize_2d_impl(*args, placeholder=x) if eager_ok(x, seed) else quantize_2d_op(*args)
    shape, dtype = x.shape, x.dtype
    row = col = None
    if rowwise:
        row = _mx(outs[0], outs[1], fmt, block_size, 1, shape, dtype, outs[4] if sf else None)
    if colwise:
        col = _mx(outs[2], outs[3], fmt, block_size, 0, shape, dtype, outs[5] if sf else None)
    return row, col


def to_mx(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype | str = torch.float8_e4m3fn,
    block_size: int = 32,
    scale_mode: ScaleMode = "rceil",
    axis: int = -1,
    stochastic_rounding: bool = False,
    seed: int | torch.Tensor | None = None,
    backend: Backend = "auto",
) -> MXTensor:
    """Quantize ``x`` to an MX format with blocks of ``block_size`` along ``axis``.

    Args:
        x: float32/bfloat16/float16 tensor, any shape (at least 1-D). A size along
            ``axis`` that is not a multiple of ``block_size`` leaves a short last block
            (treated as zero-padded).
        elem_dtype: ``torch.float8_e4m3fn`` (MXFP8, default), ``torch.float8_e5m2``, or
            ``torch.float4_e2m1fn_x2`` / ``"e2m1"`` (MX4; the size along ``axis`` must
            be even).
        block_size: elements per E8M0 scale: 32 (OCP MX) or 16/64/128.
        scale_mode: ``"rceil"`` (``amax / max_elem`` rounded up to a power of two: nothing
            saturates) or ``"floor"`` (OCP v1.0: ``floor(log2 amax) - emax_elem``; the
            largest elements may saturate).
        axis: the blocked dim.
        stochastic_rounding: round elements stochastically instead of to nearest-even.
        seed: int or one-element int64 tensor on ``x``'s device; drawn from torch's
            generator when ``None``. Only with ``stochastic_rounding``.
        backend: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"`` or
            ``"torch"``. Both give identical bytes.

    Returns:
        :class:`MXTensor` with ``.data``, ``.scale`` (uint8 E8M0) and ``.dequantize()``.

    Raises:
        TypeError: ``x`` not a float tensor; bad argument types (``axis``, ``seed``,
            ``block_size``, ``stochastic_rounding``).
        ValueError: bad ``elem_dtype``, ``block_size``, ``scale_mode``, ``axis``,
            ``backend``, an odd MX4 length, or a ``seed`` without stochastic rounding.
    """
    check_float_tensor("x", x)
    fmt = get_format(elem_dtype)
    block_size = _check_block_size(block_size)
    mode = check_scale_mode(scale_mode)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be an int in [{-x.dim()}, {x.dim()}), got {axis!r}")
    axis %= x.dim()
    if fmt.packed and x.shape[axis] % 2:
        raise ValueError(f"MX4 needs an even size along axis {axis}, got {x.shape[axis]}")
    impl = resolve_backend(backend, x.device)
    seed_t = _seed_tensor(stochastic_rounding, seed, x.device)
    if x.dim() == 2:
        row, col = _quantize(
            x, seed_t, fmt, block_size, mode, axis == 1, axis == 0, "none", 0, 0, impl
        )
        return _need(row if axis == 1 else col)
    xm = x.movedim(axis, -1)
    lead, n = xm.shape[:-1], xm.shape[-1]
    q = _need(
        _quantize(
            xm.reshape(math.prod(lead), n),
            seed_t,
            fmt,
            block_size,
            mode,
            True,
            False,
            "none",
            0,
            0,
            impl,
        )[0]
    )
    data = q.data.reshape(*lead, q.data.shape[-1]).movedim(-1, axis)
    scale = q.scale.reshape(*lead, q.scale.shape[-1]).movedim(-1, axis)
    return _mx(data, scale, fmt, block_size, axis, x.shape, x.dtype)


def mx_quantize(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype | str = torch.float8_e4m3fn,
    block_size: int = 32,
    scale_mode: ScaleMode = "rceil",
    rowwise: bool = True,
    colwise: bool = False,
    activation: Activation = "none",
    hadamard: int = 0,
    hadamard_seed: int = 0,
    stochastic_rounding: bool = False,
    seed: int | torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[MXTensor | None, MXTensor | None]:
    """Fused quantization of a 2-D ``(M, K)`` tensor: one read, both GEMM layouts.

    Computes ``a = activation(x)`` in FP32 and writes, in one pass:

    * the row-wise copy (blocks along K: the operand of ``a @ W^T``), and/or
    * the column-wise copy (blocks along M, stored K-major: the operand of the wgrad
      GEMM ``dY^T @ a``). With ``hadamard = n`` it holds ``H_n diag(s) a`` per group of
      ``n`` rows (unnormalised; divide a GEMM over two transformed operands by ``n``).

    Args:
        x: ``(M, K)`` float32/bfloat16/float16.
        elem_dtype, block_size, scale_mode, stochastic_rounding, seed, backend: as in
            :func:`to_mx`. The two copies use independent random streams.
        rowwise, colwise: which copies to write (at least one).
        activation: producer fused before quantizing: ``"none"``, ``"relu"``,
            ``"relu2"``, ``"silu"``, ``"gelu_tanh"``.
        hadamard: 0 (off), 16 or 32: block random Hadamard transform of the column-wise
            copy; must divide ``block_size``.
        hadamard_seed: selects the fixed random sign vector ``s``.

    Returns:
        ``(row, col)``: :class:`MXTensor` s of logical shape ``(M, K)`` with ``axis`` 1
        and 0, or ``None`` for a copy not requested.

    Raises:
        TypeError, ValueError: as :func:`to_mx`, plus a non-2-D ``x``, no copy requested,
        an unknown ``activation``, a bad ``hadamard``, or a ``hadamard_seed`` without
        ``hadamard``.
    """
    check_float_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    fmt = get_format(elem_dtype)
    block_size = _check_block_size(block_size)
    mode = check_scale_mode(scale_mode)
    if not isinstance(rowwise, bool) or not isinstance(colwise, bool):
        raise TypeError("rowwise and colwise must be bools")
    if not (rowwise or colwise):
        raise ValueError("at least one of rowwise and colwise must be True")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    hadamard = check_hadamard(hadamard, block_size)
    if hadamard and not colwise:
        raise ValueError("hadamard transforms the column-wise copy; set colwise=True")
    if isinstance(hadamard_seed, bool) or not isinstance(hadamard_seed, int):
        raise TypeError(f"hadamard_seed must be an int, got {hadamard_seed!r}")
    if hadamard_seed and not hadamard:
        raise ValueError("hadamard_seed is only used with hadamard > 0 (it would be ignored)")
    m, k = x.shape
    if fmt.packed and ((rowwise and k % 2) or (colwise and m % 2)):
        raise ValueError(f"MX4 needs even sizes along the blocked dims, got {(m, k)}")
    impl = resolve_backend(backend, x.device)
    seed_t = _seed_tensor(stochastic_rounding, seed, x.device)
    return _quantize(
        x,
        seed_t,
        fmt,
        block_size,
        mode,
        rowwise,
        colwise,
        activation,
        hadamard,
        hadamard_seed,
        impl,
    )
