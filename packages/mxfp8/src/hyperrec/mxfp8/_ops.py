"""``torch.library`` registrations, so ``torch.compile(fullgraph=True)`` traces the ops.

Two opaque ops, each with a fake (meta) kernel that allocates exactly the layouts the
real kernels produce:

* ``hyperrec_mxfp8::quantize_2d`` -- the fused row-/column-wise quantizer;
* ``hyperrec_mxfp8::mm`` -- the block-scaled GEMM.

Both take ``impl``: ``"torch"`` (the reference) or ``"triton"`` (the kernels). The public
functions in ``quantize.py`` and ``gemm.py`` validate inputs and choose ``impl``.
"""

from __future__ import annotations

import torch

from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8.formats import E2M1, ElemFormat, get_format

__all__ = ["format_of_storage", "mm_op", "quantize_2d_op"]


def format_of_storage(dtype: torch.dtype) -> ElemFormat:
    """The element format whose ``MXTensor.data`` has ``dtype`` (uint8 means MX4)."""
    return E2M1 if dtype == torch.uint8 else get_format(dtype)


def _alloc_quantized(
    x: torch.Tensor, fmt: ElemFormat, block_size: int, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # One source of truth for the output layouts (real and fake kernels).
    m, k = x.shape
    nbk, nbm = -(-k // block_size), -(-m // block_size)
    dt, dev = fmt.storage_dtype, x.device

    def empty() -> torch.Tensor:  # distinct tensors: op outputs must not alias
        return x.new_empty(0, dtype=torch.uint8)

    rd = torch.empty(m, k // 2 if fmt.packed else k, dtype=dt, device=dev) if rowwise else empty()
    rs = torch.empty(nbk, m, dtype=torch.uint8, device=dev).t() if rowwise else empty()
    cd = (
        torch.empty(k, m // 2 if fmt.packed else m, dtype=dt, device=dev).t()
        if colwise
        else empty()
    )
    cs = torch.empty(nbm, k, dtype=torch.uint8, device=dev) if colwise else empty()
    return rd, rs, cd, cs


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise and column-wise MX copies of ``act(x)`` (see ``reference.quantize_2d``)."""
    fmt = get_format(elem)
    if impl == "triton":
        from hyperrec.mxfp8._triton.quantize import launch_quantize_2d
        from hyperrec.mxfp8.hadamard import signs

        return launch_quantize_2d(
            x,
            fmt=fmt,
            block_size=block_size,
            rceil=scale_mode == "rceil",
            rowwise=rowwise,
            colwise=colwise,
            act=activation,
            hadamard=signs(hadamard, hadamard_seed) if hadamard else None,
            seed=seed,
        )
    outs = _alloc_quantized(x, fmt, block_size, rowwise, colwise)
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
    for dst, src in zip(outs, got):
        if src is not None:
            dst.copy_(src)
    return outs


@quantize_2d_op.register_fake
def _(
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
):
    return _alloc_quantized(x, get_format(elem), block_size, rowwise, colwise)


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
) -> torch.Tensor:
    """``alpha * deq(a) @ deq(b) + bias``; ``impl`` in ``torch``, ``fixup``, ``upcast``,
    ``dot_scaled``, ``cublas``."""
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

        out = blockwise_mm(a, a_scale, b, b_scale, bias, alpha, out_dtype)
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


@mm_op.register_fake
def _(a, a_scale, b, b_scale, bias, block_size, alpha, out_dtype, impl):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)
