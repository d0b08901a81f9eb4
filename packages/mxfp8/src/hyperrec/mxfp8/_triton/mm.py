"""Block-scaled FP8 GEMMs: ``C = alpha * deq(A) @ deq(B) (+ bias)``.

``fixup`` kernel (Hopper and later): each K step is one FP8 tensor-core product of a
``[BM, SB] x [SB, BN]`` tile pair (``SB`` = the scale block, 32 or 128) started from zero,
then promoted to the FP32 accumulator with the two E8M0 scales:
``acc += dot * (sa[:, None] * sb[None, :])``. With ``SB = 32`` this is exact MX: every
32-wide block keeps its own scale; the tensor core only ever sums 32 products. The
fix-up costs two FP32 ops per output element per 32 K (as much issue time as the FP8
MMA itself), which bounds this path near BF16 speed. With ``SB = 128`` the fix-up runs a
quarter as often (DeepSeek-V3-style promotion) and the GEMM approaches FP8 speed.

``dot_scaled`` kernel: ``tl.dot_scaled`` with 32-wide E8M0 scales; native MX MMA on
Blackwell (sm100+), an upcast to BF16 elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from hyperrec.mxfp8._triton import interpreting
from hyperrec.mxfp8._triton._configs import MMConfig, device_arch, select_mm_config
from hyperrec.mxfp8._triton.common import e8m0_to_f32

__all__ = ["launch_mm"]


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: consecutive programs share B tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _epilogue(
    acc,
    c_ptr,
    bias_ptr,
    alpha,
    pid_m,
    pid_n,
    M,
    N,
    s_cm,
    s_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = acc * alpha
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(
        c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _mm_fixup_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    alpha,
    s_am,
    s_ak,
    s_asm,
    s_ask,
    s_bk,
    s_bn,
    s_bsk,
    s_bsn,
    s_cm,
    s_cn,
    SB: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Wrapped row/col indices keep every load in bounds without masks; the store masks.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, SB)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    as_ptrs = as_ptr + rm * s_asm
    bs_ptrs = bs_ptr + rn * s_bsn
    nbk = tl.cdiv(K, SB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # SUB scale blocks per iteration: fewer loop trips, same one-promotion-per-block math.
    for it in range(0, tl.cdiv(nbk, SUB)):
        for j in tl.static_range(SUB):
            kb = it * SUB + j
            if EVEN_K:
                a = tl.load(a_ptrs + j * SB * s_ak)
                b = tl.load(b_ptrs + j * SB * s_bk)
                sa = tl.load(as_ptrs + kb * s_ask)
                sb = tl.load(bs_ptrs + kb * s_bsk)
            else:
                kmask = rk < K - kb * SB
                a = tl.load(a_ptrs + j * SB * s_ak, mask=kmask[None, :], other=0.0)
                b = tl.load(b_ptrs + j * SB * s_bk, mask=kmask[:, None], other=0.0)
                # Past the last block: an in-bounds load, then scale 1 (the data is 0).
                kc = tl.minimum(kb, nbk - 1)
                sa = tl.where(kb < nbk, tl.load(as_ptrs + kc * s_ask), 127)
                sb = tl.where(kb < nbk, tl.load(bs_ptrs + kc * s_bsk), 127)
            fa = e8m0_to_f32(sa)
            fb = e8m0_to_f32(sb)
            acc += tl.dot(a, b) * (fa[:, None] * fb[None, :])
        a_ptrs += SB * SUB * s_ak
        b_ptrs += SB * SUB * s_bk
    _epilogue(
        acc, c_ptr, bias_ptr, alpha, pid_m, pid_n, M, N, s_cm, s_cn, HAS_BIAS, BLOCK_M, BLOCK_N
    )


@triton.jit
def _e8m0_to_bf16(s):
    # E8M0 byte -> bf16 2**(s - 127) by bits: byte 0 is the BF16 subnormal 2**-127.
    b = s.to(tl.int32)
    bits = tl.where(b == 0, 64, tl.where(b == 255, 32704, b << 7))
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mm_upcast_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    alpha,
    s_am,
    s_ak,
    s_asm,
    s_ask,
    s_bk,
    s_bn,
    s_bsk,
    s_bsn,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Exact MX through BF16 tensor cores: every FP8 element times its power-of-two scale
    # is a BF16 number (exact while |value| >= 2**-130), BF16 x BF16 products are exact
    # in FP32, and the accumulator stays in the MMA (no per-block promotion).
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    NS: tl.constexpr = BLOCK_K // 32
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, NS)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    as_ptrs = as_ptr + rm[:, None] * s_asm + rs[None, :] * s_ask
    bs_ptrs = bs_ptr + rs[:, None] * s_bsk + rn[None, :] * s_bsn
    nbk = tl.cdiv(K, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sa = tl.load(as_ptrs)
            sb = tl.load(bs_ptrs)
        else:
            kmask = rk < K - kb * BLOCK_K
            smask = rs < nbk - kb * NS
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
            sa = tl.load(as_ptrs, mask=smask[None, :], other=127)
            sb = tl.load(bs_ptrs, mask=smask[:, None], other=127)
        if DOT_F32:
            # The interpreter's BF16 arithmetic is broken; FP32 holds the same exact values.
            fa = e8m0_to_f32(sa)
            fb = e8m0_to_f32(sb)
            up: tl.constexpr = tl.float32
        else:
            fa = _e8m0_to_bf16(sa)
            fb = _e8m0_to_bf16(sb)
            up: tl.constexpr = tl.bfloat16  # type: ignore[no-redef]
        a16 = tl.reshape(
            tl.reshape(a.to(up), [BLOCK_M, NS, 32]) * fa[:, :, None], [BLOCK_M, BLOCK_K]
        )
        b16 = tl.reshape(
            tl.reshape(b.to(up), [NS, 32, BLOCK_N]) * fb[:, None, :], [BLOCK_K, BLOCK_N]
        )
        if DOT_F32:
            acc = tl.dot(a16, b16, acc, input_precision="ieee")
        else:
            acc = tl.dot(a16, b16, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
        as_ptrs += NS * s_ask
        bs_ptrs += NS * s_bsk
    _epilogue(
        acc, c_ptr, bias_ptr, alpha, pid_m, pid_n, M, N, s_cm, s_cn, HAS_BIAS, BLOCK_M, BLOCK_N
    )


@triton.jit
def _mm_dot_scaled_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    alpha,
    s_am,
    s_ak,
    s_asm,
    s_ask,
    s_bk,
    s_bn,
    s_bsk,
    s_bsn,
    s_cm,
    s_cn,
    A_FMT: tl.constexpr,
    B_FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    as_ptrs = as_ptr + rm[:, None] * s_asm + rs[None, :] * s_ask
    bs_ptrs = bs_ptr + rn[:, None] * s_bsn + rs[None, :] * s_bsk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sa = tl.load(as_ptrs)
            sb = tl.load(bs_ptrs)
        else:
            kmask = rk < K - kb * BLOCK_K
            smask = rs < tl.cdiv(K - kb * BLOCK_K, 32)
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
            sa = tl.load(as_ptrs, mask=smask[None, :], other=127)
            sb = tl.load(bs_ptrs, mask=smask[None, :], other=127)
        acc = tl.dot_scaled(a, sa, A_FMT, b, sb, B_FMT, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
        as_ptrs += (BLOCK_K // 32) * s_ask
        bs_ptrs += (BLOCK_K // 32) * s_bsk
    _epilogue(
        acc, c_ptr, bias_ptr, alpha, pid_m, pid_n, M, N, s_cm, s_cn, HAS_BIAS, BLOCK_M, BLOCK_N
    )


_FMT_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def launch_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    block_size: int,
    kernel: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    alpha: float,
    config: MMConfig | dict[str, int] | None = None,
) -> torch.Tensor:
    """Launch a block-scaled GEMM. ``a`` ``(M, K)`` FP8 with scales ``(M, nbK)``; ``b``
    ``(K, N)`` FP8 with scales ``(nbK, N)``; any strides. Returns ``(M, N)`` ``out_dtype``.

    The tile is :func:`~._configs.select_mm_config`'s (the committed table) unless
    ``config`` forces one (an :class:`~._configs.MMConfig` or its launch kwargs; the
    benchmark's candidate sweep uses this)."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        c.zero_()
        if bias is not None:
            c += bias.to(out_dtype)
        return c
    args = [
        a,
        a_scale,
        b,
        b_scale,
        c,
        bias if bias is not None else c,
        m,
        n,
        k,
        float(alpha),
        a.stride(0),
        a.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
        b.stride(0),
        b.stride(1),
        b_scale.stride(0),
        b_scale.stride(1),
        c.stride(0),
        c.stride(1),
    ]
    meta: dict[str, Any]
    if kernel == "fixup":
        # EVEN_K must hold for every SUB a table entry or forced config may use (1, 2, 4).
        even = k % (4 * block_size) == 0
        meta = {"SB": block_size, "HAS_BIAS": bias is not None, "EVEN_K": even}
        fn = _mm_fixup_kernel
    elif kernel == "upcast":
        meta = {"HAS_BIAS": bias is not None, "EVEN_K": k % 128 == 0, "DOT_F32": interpreting()}
        fn = _mm_upcast_kernel
    else:
        meta = {
            "A_FMT": _FMT_NAMES[a.dtype],
            "B_FMT": _FMT_NAMES[b.dtype],
            "HAS_BIAS": bias is not None,
            # EVEN_K depends on BLOCK_K: every candidate uses 128 (or 64 when interpreted).
            "EVEN_K": k % 128 == 0,
        }
        fn = _mm_dot_scaled_kernel
    if config is None:
        config = select_mm_config(
            arch=device_arch(a.device),
            kernel=kernel,
            block_size=block_size,
            m=m,
            n=n,
            k=k,
            interpret=interpreting(),
        )
    cfg = config.launch_kwargs() if isinstance(config, MMConfig) else dict(config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    fn[grid](*args, **meta, **cfg)
    return c
