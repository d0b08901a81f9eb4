"""Row-wise FP8 linear: one power-of-two scale per row, written for ``torch.compile``.

``rowwise_linear(x, w, b)`` computes ``x W^T + b`` with up to two of its three GEMMs in
FP8:

* forward ``y = x W^T``: ``x`` scaled per token row, ``W`` per output row (both along
  the reduction dim ``K``), E4M3;
* dgrad ``dx = dY W`` (``fp8_dgrad=True``, the default): ``dY`` per token row, ``W`` per
  input column (along ``N``), E4M3; with ``fp8_dgrad=False`` in the input precision;
* wgrad ``dW = dY^T x``: in the input precision (its reduction dim is the token dim, where
  a per-row scale does not apply; keeping it exact also keeps the weight update exact).

Why a second recipe beside :class:`~hyperrec.mxfp8.MXLinear`: its quantization is plain
PyTorch (an ``amax``, a power-of-two scale, a cast), so under ``torch.compile`` the
compiler fuses it into the kernel that produces the operand (a layer norm, a SiLU
backward) and the GEMM is one ``torch._scaled_mm`` call: no extra pass over the
activations and no per-call host work beyond the GEMM's. Scales are powers of two chosen
as torchao's row-wise recipe does (``ceil(log2(amax / 448))`` in float32, per row), so
scaling is exact and the only rounding is E4M3's; where that float32 log rounds down
(``amax`` a hair above ``448 * 2**k``) the row's largest element casts to 448.

On CUDA the FP8 GEMMs are ``torch._scaled_mm`` with row-wise scales (Hopper and newer);
elsewhere they are emulated in float32 from the same quantized operands (the same
numbers up to accumulation order), so CPU tests exercise the recipe's numerics.

When the FP8 dgrad does not pay: the row-wise scale of ``dY`` needs a reduction over its
whole row before any element can be cast. Where ``dY`` is itself produced by a fused
kernel over several tensors (a SiLU backward over four concatenated gradients), the
compiler computes it twice, once for the scale and once for the wgrad's high-precision
copy; on the H200 that cost more than the faster GEMM saved (the integration package's
``bench/seq_fp8.py``). ``fp8_dgrad=False`` keeps that GEMM in the input precision.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["quantize_rows", "rowwise_linear", "rowwise_linear_reference"]

_E4M3 = torch.float8_e4m3fn


def quantize_rows(t: torch.Tensor, dtype: torch.dtype = _E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``t`` with one power-of-two scale.

    Args:
        t: ``(M, K)`` floating tensor.
        dtype: FP8 element dtype (E4M3 default, or E5M2).

    Returns:
        ``(q, scale)``: ``q`` ``(M, K)`` in ``dtype`` and ``scale`` ``(M, 1)`` float32 with
        ``t ~= q * scale``. The scale is ``2**ceil(log2(max(amax(row), 1e-12) / max(dtype)))``
        in float32 (torchao's rule), the smallest power of two that keeps every element
        within ``max(dtype)`` except where that float32 division and log2 round down
        (amax a hair above ``max(dtype) * 2**k``): such an element lands a fraction of an
        ULP above the largest E4M3 value and casts to it (an all-zero row: scale
        ``2**-48``, zeros). A row with a NaN or Inf gets a NaN scale
        (its products are NaN, other rows are unaffected). Same bytes as torchao's
        row-wise float8 cast with power-of-two scales.
    """
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    # The amax floor 1e-12 (torchao's float8 recipes use it too): an all-zero row gets
    # scale 2**-48 and stays zero, instead of log2(0) = -inf, and 1 / scale stays finite
    # (a floor near float32's smallest normal would overflow 2**-e to inf, and 0 * inf is
    # NaN). Rows below ~1.6e-12 lose precision to E4M3's subnormals. A literal, not a
    # module constant: torch.compile(dynamic=True) lifts a float global to a graph input,
    # and then cannot trace this Function twice in one graph.
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-12) / fmax))
    # An infinite amax would give scale inf and q = x / inf = 0 for finite x: the row must
    # read as NaN instead, as the unquantized product would.
    exp = torch.where(torch.isfinite(amax), exp, torch.full_like(exp, float("nan")))
    q = (t.float() * torch.exp2(-exp)).to(dtype)
    return q, torch.exp2(exp)


def _scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)``: a ``(M, K)`` row-major, b ``(K, N)`` column-major,
    scales ``(M, 1)`` and ``(1, N)`` float32."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out)
    return ((a.float() * a_scale) @ (b.float() * b_scale)).to(out)


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"x's last dim must equal w's in_features {w.shape[1]}, got shape {tuple(x.shape)}"
        )
    for name, n in (("in_features", w.shape[1]), ("out_features", w.shape[0])):
        if n % 16:
            raise ValueError(f"{name} must be a multiple of 16 for FP8 GEMMs, got {n}")
    if b is not None and (not isinstance(b, torch.Tensor) or b.shape != (w.shape[0],)):
        raise ValueError(f"b must be a tensor of shape ({w.shape[0]},), got {b!r:.60}")


class _RowwiseLinear(torch.autograd.Function):
    # 2-D x only: the shape arithmetic of other ranks stays outside the Function, which
    # torch.compile (dynamic shapes) could not trace twice in one graph otherwise.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fp8_dgrad: bool) -> torch.Tensor:
        ctx.fp8_dgrad = fp8_dgrad
        # torch._scaled_mm takes a row-major first and a column-major second operand, and
        # the quantized copies keep their input's layout: a transposed view (of x, or a
        # weight held transposed) would be rejected on CUDA. A no-op when contiguous.
        xq, xs = quantize_rows(x.contiguous())
        wq, ws = quantize_rows(w.contiguous())
        ctx.save_for_backward(x, w)
        return _scaled_mm(xq, xs, wq.t(), ws.t(), x.dtype)

    @staticmethod
    @once_differentiable  # FP8 rounding has no derivative: a double backward raises
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0] and not ctx.fp8_dgrad:
            dx = (dy @ w.to(dy.dtype)).to(x.dtype)
        elif ctx.needs_input_grad[0]:
            dyq, dys = quantize_rows(dy.contiguous())  # e.g. the expanded gradient of a sum
            # W's copy scaled per input column: quantize the rows of W^T, then hand the
            # [K, N] row-major result over as the column-major [N, K] second operand.
            wtq, wts = quantize_rows(w.t().contiguous())
            dx = _scaled_mm(dyq, dys, wtq.t(), wts.t(), x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy.t() @ x.to(dy.dtype)).to(w.dtype)
        return dx, dw, None


def rowwise_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, fp8_dgrad: bool = True
) -> torch.Tensor:
    """``x W^T + b`` with the forward (and dgrad) GEMM in row-wise scaled FP8 (E4M3).

    Args:
        x: ``(..., K)`` float32/bfloat16/float16 activations.
        w: ``(N, K)`` weight (``nn.Linear`` layout); ``K`` and ``N`` multiples of 16.
        b: optional ``(N,)`` bias, added in the output dtype after the GEMM (a compiler
            fuses it with whatever consumes the output).
        fp8_dgrad: compute ``dx`` from an FP8 GEMM of row-scaled ``dY`` and
            column-scaled ``W`` (default); False: in the input precision.

    Returns:
        ``(..., N)`` in ``x``'s dtype. ``dW`` and ``db`` are always computed in the input
        precision.

    Raises:
        TypeError: ``x`` or ``w`` not a floating tensor of a supported dtype, or
            ``fp8_dgrad`` not a bool.
        ValueError: shapes that do not match, or ``K``/``N`` not multiples of 16.

    Meant for large linears inside ``torch.compile``d code (the quantization fuses into
    the producer); eager calls work too, with the quantization as separate kernels.
    """
    _check(x, w, b)
    if not isinstance(fp8_dgrad, bool):
        raise TypeError(f"fp8_dgrad must be a bool, got {type(fp8_dgrad).__name__}")
    if w.numel() == 0:
        # no features in or out: nothing to quantize (a row amax over no elements has no
        # value); the exact result is zeros (plus the bias) or an empty tensor
        return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
    y = _RowwiseLinear.apply(x.reshape(-1, x.shape[-1]), w, fp8_dgrad)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b.to(y.dtype)


def rowwise_linear_reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """The forward of :func:`rowwise_linear` in float64 from the same quantized operands
    (no autograd through the quantization): the kernel differs only in accumulation."""
    _check(x, w, b)
    if w.numel() == 0:
        return F.linear(x.double(), w.double(), None if b is None else b.double())
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2)
    wq, ws = quantize_rows(w)
    y = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    if b is not None:
        y = y + b.double()
    return y.reshape(*x.shape[:-1], w.shape[0])
