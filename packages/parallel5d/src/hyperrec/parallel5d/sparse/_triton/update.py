"""Fused row updates: one program per touched row reads the row, its gradient and its
state once and writes the row and the state once (the PyTorch versions in
:mod:`hyperrec.parallel5d.sparse.optim` take about ten kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["adagrad_rows", "adam_rows", "num_warps_for", "rowwise_adagrad_rows"]

# (largest padded dim, warps): a pure function of the row width, no autotuning.
_WARPS = ((128, 1), (512, 2), (2048, 4))


def num_warps_for(block_d: int) -> int:
    """Warps for a row of ``block_d`` (power of two) elements."""
    for limit, warps in _WARPS:
        if block_d <= limit:
            return warps
    return 8


@triton.jit
def _cast_out(x, IS_BF16: tl.constexpr):
    """float32 -> the row dtype with round-to-nearest-even. bf16 is rounded by hand: the
    interpreter truncates on ``.to(bfloat16)``, the GPU rounds; this makes both equal to
    ``torch.Tensor.to(torch.bfloat16)``."""
    if IS_BF16:
        # int32 throughout (no literal needs 32 unsigned bits); finite values never carry
        # into the sign bit; NaN is kept as it is.
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x


@triton.jit
def _rowwise_adagrad_kernel(
    w_ptr, m_ptr, rows_ptr, g_ptr, n_rows, dim, stride_w, stride_g,
    lr, eps, wd, MODE: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i)
    d = tl.arange(0, BLOCK_D)
    # rows past the table are padding (sync-free lookups); the test is a vector because
    # the interpreter takes no scalar masks
    real = (r + d * 0) < n_rows
    mask = (d < dim) & real
    g = tl.load(g_ptr + i * stride_g + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + r * stride_w + d, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:  # L2: the decay joins the gradient
        g = g + wd * w
    lane0 = (d == 0) & real  # the row's one momentum value, through lane 0
    m_old = tl.sum(tl.load(m_ptr + r + d * 0, mask=lane0, other=0.0), axis=0)
    m = m_old + tl.sum(g * g, axis=0) / dim
    tl.store(m_ptr + r + d * 0, m + d * 0.0, mask=lane0)
    mult = lr / (tl.sqrt(m) + eps)
    if MODE == 2:  # decoupled
        w = w * (1.0 - lr * wd)
    w = w - mult * g
    tl.store(w_ptr + r * stride_w + d, _cast_out(w, IS_BF16).to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adagrad_kernel(
    w_ptr, s_ptr, rows_ptr, g_ptr, n_rows, dim, stride_w, stride_s, stride_g, lr, eps,
    IS_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i)
    d = tl.arange(0, BLOCK_D)
    mask = (d < dim) & ((r + d * 0) < n_rows)  # padding rows skipped
    g = tl.load(g_ptr + i * stride_g + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + r * stride_s + d, mask=mask, other=0.0) + g * g
    tl.store(s_ptr + r * stride_s + d, s, mask=mask)
    w = tl.load(w_ptr + r * stride_w + d, mask=mask, other=0.0).to(tl.float32)
    w = w - lr * g / (tl.sqrt(s) + eps)
    tl.store(w_ptr + r * stride_w + d, _cast_out(w, IS_BF16).to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_kernel(
    w_ptr, m_ptr, v_ptr, rows_ptr, g_ptr, ss_ptr, n_rows, dim, stride_w, stride_m, stride_g,
    b1, b2, eps, decay, step_size, PER_ROW_STEP: tl.constexpr, IS_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i)
    if PER_ROW_STEP:  # rows of tables at different step counts (one per row, float32)
        step_size = tl.load(ss_ptr + i)
    d = tl.arange(0, BLOCK_D)
    mask = (d < dim) & ((r + d * 0) < n_rows)  # padding rows skipped
    g = tl.load(g_ptr + i * stride_g + d, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + r * stride_m + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + r * stride_m + d, mask=mask, other=0.0)
    m = m + (g - m) * (1.0 - b1)
    v = v + (g * g - v) * (1.0 - b2)
    tl.store(m_ptr + r * stride_m + d, m, mask=mask)
    tl.store(v_ptr + r * stride_m + d, v, mask=mask)
    w = tl.load(w_ptr + r * stride_w + d, mask=mask, other=0.0).to(tl.float32) * decay
    w = w - step_size * (m / (tl.sqrt(v) + eps))
    tl.store(w_ptr + r * stride_w + d, _cast_out(w, IS_BF16).to(w_ptr.dtype.element_ty), mask=mask)


def _launch_shape(dim: int) -> tuple[int, int]:
    block = triton.next_power_of_2(max(dim, 1))
    return block, num_warps_for(block)


def rowwise_adagrad_rows(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: str,
) -> None:
    """Row-wise Adagrad on ``weight[rows]`` in place (``rows`` unique; rows
    ``>= weight.shape[0]`` are padding and skipped)."""
    if rows.numel() == 0:
        return
    mode = 0 if not weight_decay else (1 if weight_decay_mode == "l2" else 2)
    block, warps = _launch_shape(weight.shape[1])
    _rowwise_adagrad_kernel[(rows.numel(),)](
        weight, momentum, rows, grad, weight.shape[0], weight.shape[1], weight.stride(0),
        grad.stride(0),
        lr, eps, weight_decay, MODE=mode, IS_BF16=weight.dtype == torch.bfloat16,
        BLOCK_D=block, num_warps=warps,
    )  # fmt: skip


def adagrad_rows(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Element-wise Adagrad on ``weight[rows]`` in place (``rows`` unique; rows
    ``>= weight.shape[0]`` are padding and skipped)."""
    if rows.numel() == 0:
        return
    block, warps = _launch_shape(weight.shape[1])
    _adagrad_kernel[(rows.numel(),)](
        weight, state_sum, rows, grad, weight.shape[0], weight.shape[1], weight.stride(0),
        state_sum.stride(0),
        grad.stride(0), lr, eps, IS_BF16=weight.dtype == torch.bfloat16, BLOCK_D=block,
        num_warps=warps,
    )  # fmt: skip


def adam_rows(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    step_size: float | torch.Tensor,
) -> None:
    """Lazy Adam on ``weight[rows]`` in place (``rows`` unique; rows
    ``>= weight.shape[0]`` are padding and skipped). ``step_size``: one float, or a
    float32 tensor with one per row (rows of tables at different step counts)."""
    if rows.numel() == 0:
        return
    block, warps = _launch_shape(weight.shape[1])
    if isinstance(step_size, torch.Tensor):
        per_row, ss, scalar = True, step_size.contiguous(), 0.0
    else:
        per_row, ss, scalar = False, grad, step_size  # grad: a placeholder, not read
    _adam_kernel[(rows.numel(),)](
        weight, exp_avg, exp_avg_sq, rows, grad, ss, weight.shape[0], weight.shape[1],
        weight.stride(0),
        exp_avg.stride(0), grad.stride(0), beta1, beta2, eps, decay,
        scalar, PER_ROW_STEP=per_row,
        IS_BF16=weight.dtype == torch.bfloat16, BLOCK_D=block, num_warps=warps,
    )  # fmt: skip
