"""``torch.library`` registrations, so ``torch.compile(fullgraph=True)`` traces the ops.

Two opaque ops, each with a fake (meta) kernel that allocates exactly the layouts the
real kernels produce:

* ``hyperrec_mxfp8::quantize_2d`` -- the fused row-/column-wise quantizer;
* ``hyperrec_mxfp8::mm`` -- the block-scaled GEMM.

Both take ``impl``: ``"torch"`` (the reference) or ``"triton"`` (the kernels). The public
functions in ``quantize.py`` and ``gemm.py`` validate inputs and choose ``impl``. Eager
calls on plain tensors run the implementations (``quantize_2d_impl``, ``mm_impl``)
directly, which saves the custom-op dispatch; anything that traces (``torch.compile``,
``make_fx``, fake tensors, dispatch modes) goes through the ops (see ``eager_ok``).
"""

from __future__ import annotations

from typing import cast

import torch

from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8.formats import E2M1, ElemFormat, get_format

__all__ = [
    "alloc_quantized",
    "eager_ok",
    "format_of_storage",
    "mm_impl",
    "mm_op",
    "quantize_2d_impl",
    "quantize_2d_op",
]


def format_of_storage(dtype: torch.dtype) -> ElemFormat:
    """The element format whose ``MXTensor.data`` has ``dtype`` (uint8 means MX4)."""
    return E2M1 if dtype == torch.uint8 else get_format(dtype)


def alloc_quantized(
    x: torch.Tensor,
    fmt: ElemFormat,
    block_size: int,
    rowwise: bool,
    colwise: bool,
    scale_fp32: bool = False,
    placeholder: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The output layouts of the quantizer (one source of truth for the real and fake
    kernels): ``(row data, row scale, col data, col scale)`` plus ``(row FP32 scale,
    col FP32 scale)`` when ``scale_fp32``. A copy not requested is an empty tensor, or
    ``placeholder`` when given (eager calls: no allocation for it)."""
    m, k = x.shape
    nbk, nbm = -(-k // block_size), -(-m // block_size)
    dt, dev = fmt.storage_dtype, x.device

    def empty() -> torch.Tensor:  # distinct tensors: op outputs must not alias
        if placeholder is not None:
            return placeholder
        return x.new_empty(0, dtype=torch.uint8)

    def strided(
        shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=dtype, device=dev)

    kp, mp = (k // 2, m // 2) if fmt.packed else (k, m)
    # Row scales are stored M-contiguous, column-wise data K-major: the layouts the
    # GEMMs read (cuBLAS's 1x128 operands included) without a copy.
    rd = torch.empty(m, kp, dtype=dt, device=dev) if rowwise else empty()
    rs = strided((m, nbk), (1, m), torch.uint8) if rowwise else empty()
    cd = strided((mp, k), (1, mp), dt) if colwise else empty()
    cs = torch.empty(nbm, k, dtype=torch.uint8, device=dev) if colwise else empty()
    if not scale_fp32:
        return rd, rs, cd, cs
    rsf = strided((m, nbk), (1, m), torch.float32) if rowwise else empty()
    csf = torch.empty(nbm, k, dtype=torch.float32, device=dev) if colwise else empty()
    return rd, rs, cd, cs, rsf, csf


def quantize_2d_impl(
    x: torch.Tensor,
    seed: torch.Tensor | None,
    elem: str,
    block_size: int,
    scale_mode: str,
    rowwise: bool,
    colwise: bool,
    activation: str,
    hadamard: int,
    hadamard_seed: int,
    impl: str,
    scale_fp32: bool = False,
    placeholder: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The quantizer behind the custom op; eager callers may call it directly."""
    fmt = get_format(elem)
    outs = alloc_quantized(x, fmt, block_size, rowwise, colwise, scale_fp32, placeholder)
    if impl == "triton":
        from hyperrec.mxfp8._triton.quantize import launch_quantize_2d

        return launch_quantize_2d(
            x,
            fmt=fmt,
            block_size=block_size,
            rceil=scale_mode == "rceil",
            rowwise=rowwise,
            colwise=colwise,
            act=activation,
            hadamard=hadamard,
            hadamard_seed=hadamard_seed,
            seed=seed,
            scale_fp32=scale_fp32,
            out=outs,
        )
    got = ref.quantize_2d(
        x,
        fmt=fmt,
        block_size=block_size,
        scale_mode=scale_mode,
        rowwise=rowwise,
        colwise=colwise,
        activation=activation,
        hadamard=hadamard,
        hadamard_seed=hadamard_seed,
        seed=None if seed is None else int(seed.reshape(-1)[0]),
    )
    wide = (None if s is None else ref.e8m0_to_fp32(s) for s in (got[1], got[3]))
    for dst, src in zip(outs, (*got, *wide) if scale_fp32 else got):
        if src is not None:
            dst.copy_(src)
    return outs


def eager_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may skip the custom-op dispatch and run the kernels directly: not
    under ``torch.compile``/export, no dispatch mode (fake tensors, ``make_fx``, a
    user's ``TorchDispatchMode``) or functorch transform active, plain tensors only.
    Every such trace still sees the registered ops."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is not None and active():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@torch.library.custom_op("hyperrec_mxfp8::quantize_2d", mutates_args=())
def quantize_2d_op(
    x: torch.Tensor,
    seed: torch.Tensor | None,
    elem: str,
    block_size: int,
    scale_mode: str,
    rowwise: bool,
    colwise: bool,
    activation: str,
    hadamard: int,
    hadamard_seed: int,
    impl: str,
    scale_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise and column-wise MX copies of ``act(x)`` (see ``reference.quantize_2d``),
    then the FP32 values of both scales (empty unless ``scale_fp32``)."""
    outs = quantize_2d_impl(
        x,
        seed,
        elem,
        block_size,
        scale_mode,
        rowwise,
        colwise,
        activation,
        hadamard,
        hadamard_seed,
        impl,
        scale_fp32,
    )
    return _six(x, outs)


_Six = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _six(x: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> _Six:
    if len(outs) == 6:
        return outs
    empty = x.new_empty(0, dtype=torch.float32)
    return cast(_Six, (*outs, empty, x.new_empty(0, dtype=torch.float32)))


@quantize_2d_op.register_fake
def _(
    x: torch.Tensor,
    seed: torch.Tensor | None,
    elem: str,
    block_size: int,
    scale_mode: str,
    rowwise: bool,
    colwise: bool,
    activation: str,
    hadamard: int,
    hadamard_seed: int,
    impl: str,
    scale_fp32: bool = False,
) -> _Six:
    outs = alloc_quantized(x, get_format(elem), block_size, rowwise, colwise, scale_fp32)
    return _six(x, outs)


def mm_impl(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_size: int,
    alpha: float,
    out_dtype: torch.dtype,
    impl: str,
    a_scale_fp32: torch.Tensor | None = None,
    b_scale_fp32: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMM behind the custom op; eager callers may call it directly. The optional
    FP32 scales (the E8M0 ones decoded, same layout) spare the cuBLAS path a conversion."""
    if impl == "torch":
        return ref.mx_mm(
            a,
            a_scale,
            format_of_storage(a.dtype),
            b,
            b_scale,
            format_of_storage(b.dtype),
            block_size,
            bias=bias,
            alpha=alpha,
            out_dtype=out_dtype,
        )
    if impl == "cublas":
        from hyperrec.mxfp8._cublas import blockwise_mm

        out = blockwise_mm(
            a,
            a_scale if a_scale_fp32 is None else a_scale_fp32,
            b,
            b_scale if b_scale_fp32 is None else b_scale_fp32,
            bias,
            alpha,
            out_dtype,
        )
        if out is not None:
            return out
        impl = "fixup"
    from hyperrec.mxfp8._triton.mm import launch_mm

    return launch_mm(
        a,
        a_scale,
        b,
        b_scale,
        block_size=block_size,
        kernel=impl,
        out_dtype=out_dtype,
        bias=bias,
        alpha=alpha,
    )


@torch.library.custom_op("hyperrec_mxfp8::mm", mutates_args=())
def mm_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_size: int,
    alpha: float,
    out_dtype: torch.dtype,
    impl: str,
    a_scale_fp32: torch.Tensor | None = None,
    b_scale_fp32: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * deq(a) @ deq(b) + bias``; ``impl`` in ``torch``, ``fixup``, ``upcast``,
    ``dot_scaled``, ``cublas``."""
    return mm_impl(
        a,
        a_scale,
        b,
        b_scale,
        bias,
        block_size,
        alpha,
        out_dtype,
        impl,
        a_scale_fp32,
        b_scale_fp32,
    )


@mm_op.register_fake
def _(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_size: int,
    alpha: float,
    out_dtype: torch.dtype,
    impl: str,
    a_scale_fp32: torch.Tensor | None = None,
    b_scale_fp32: torch.Tensor | None = None,
) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)
