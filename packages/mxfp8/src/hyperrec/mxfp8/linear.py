"""``MXLinear``: a drop-in ``nn.Linear`` whose three GEMMs run on MX FP8 operands.

Per step (``x``: ``(M, K)`` tokens, ``W``: ``(N, K)``):

* forward ``y = x W^T``: one fused pass over ``act(x)`` writes its row-wise copy (for
  this GEMM) and its column-wise copy (kept for wgrad, FP8 instead of a BF16 activation);
  one pass over ``W`` writes both of its copies.
* dgrad ``dx = dY W``: one pass over ``dY`` writes both copies (optionally stochastically
  rounded); ``W``'s column-wise copy is the second operand.
* wgrad ``dW = dY^T x``: both operands are column-wise copies, blocked along the token
  dim, optionally random-Hadamard-transformed (the GEMM divides by ``n``).

The token dim ``M`` is the wgrad GEMM's reduction dim. ``x`` and ``dY`` are padded with
zero rows to whole 128-blocks before they are quantized (zero rows change no scale and
add nothing to any product), so that GEMM takes cuBLAS's 1x128 path on Hopper whatever
the number of tokens (:func:`padded_rows`); the Triton kernel reads its tile from a
static table, so a new token count costs it no tuning either.

Under ``torch.autocast`` the GEMMs compute in the autocast dtype, as ``nn.Linear``'s do:
the output has that dtype, and the input and weight gradients are cast to the input's
and weight's dtypes (bf16 GEMMs are the ones cuBLAS takes).

An optional ``input_activation`` is fused into the quantization of ``x`` (the producer):
the layer computes ``act(x) W^T`` and its gradient flows to the pre-activation ``x``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8._dispatch import check_float_tensor, resolve_backend
from hyperrec.mxfp8.formats import get_format
from hyperrec.mxfp8.gemm import _mm
from hyperrec.mxfp8.policy import PrecisionPolicy
from hyperrec.mxfp8.quantize import _mx, _need, _quantize, _seed_tensor
from hyperrec.mxfp8.reference import Activation
from hyperrec.mxfp8.tensor import MXTensor

__all__ = ["MXLinear", "mx_linear", "padded_rows"]


def padded_rows(m: int, block_size: int) -> int:
    """Rows (tokens) ``x`` and ``dY`` are zero-padded to before quantization: whole
    ``block_size`` blocks.

    The wgrad GEMM ``dY^T x`` reduces over the rows. cuBLAS's 1x128 path needs that
    reduction dim to be a multiple of 128, and zero rows add nothing (they change no
    scale either), so padding sends the GEMM there for any token count. The Triton GEMM
    takes the same padded operands (its tile comes from a static table keyed by size
    buckets, so a new token count costs no tuning).
    """
    return -(-m // block_size) * block_size


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    # nn.Linear under autocast computes in the autocast dtype whatever x's dtype is.
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt in (torch.bfloat16, torch.float16):
            return dt
    return None


def _pack(t: MXTensor | None) -> tuple[Any, ...]:
    if t is None:
        return (None, None, None, None)
    meta = (t.fmt, t.block_size, t.axis, t.shape, t.orig_dtype)
    return (t.data, t.scale, t.scale_fp32, meta)


def _unpack(
    data: torch.Tensor, scale: torch.Tensor, scale_fp32: torch.Tensor | None, meta: Any
) -> MXTensor:
    if meta is None:
        raise RuntimeError("backward needs a column-wise copy that forward did not save")
    fmt, block_size, axis, shape, dtype = meta
    return _mx(data, scale, fmt, block_size, axis, shape, dtype, scale_fp32)


def _act_backward(x: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    # d act(x) / dx of the reference activation (FP32 math), written out with the ops
    # autograd would run (same bits), not through torch.autograd.grad: torch.compile
    # (fullgraph) cannot trace autograd.grad inside a backward.
    xx, g = x.detach().float(), grad.float()
    pos = xx > 0
    if activation == "relu":
        out = torch.where(pos, g, torch.zeros_like(g))
    elif activation == "relu2":
        r = torch.where(pos, xx, torch.zeros_like(xx))
        out = torch.where(pos, g * r + g * r, torch.zeros_like(g))
    elif activation == "silu":
        sig = torch.sigmoid(xx)
        out = g * sig + torch.ops.aten.sigmoid_backward(g * xx, sig)
    elif activation == "gelu_tanh":
        out = torch.ops.aten.gelu_backward(g, xx, approximate="tanh")
    else:
        raise ValueError(f"no backward for activation {activation!r}")
    return out.to(grad.dtype)


class _MXLinearFunction(torch.autograd.Function):
    # The policy and the activation were validated when the layer (or mx_linear) took
    # them, so the steps below call the quantizer and the GEMM past their checks.
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        policy: PrecisionPolicy,
        activation: str,
    ) -> torch.Tensor:
        autocast = _autocast_dtype(x)
        # The GEMMs take the autocast dtype as their output dtype; nothing inside (the
        # reference GEMM's FP32 matmul, the pad) may be recast by autocast itself.
        with torch.autocast(x.device.type, enabled=False):
            return _MXLinearFunction._forward(ctx, x, weight, bias, policy, activation, autocast)

    @staticmethod
    def _forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        policy: PrecisionPolicy,
        activation: str,
        autocast: torch.dtype | None,
    ) -> torch.Tensor:
        p = policy
        k = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        m = x2.shape[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and not p.wgrad_high_precision
        h = p.hadamard if fp8_wgrad else 0
        impl = resolve_backend(p.backend, x.device)
        gemm_dtype = x.dtype if autocast is None else autocast
        # The weight gradient: in the autocast dtype under autocast (nn.Linear's bf16
        # GEMM, then cast to the weight's dtype), else directly in the weight's dtype.
        wgrad_dtype = weight.dtype if autocast is None else autocast
        # Zero rows (act(0) = 0 for every supported activation): whole blocks along the
        # token dim for the wgrad GEMM (and whole Hadamard groups, which divide a block).
        pad = padded_rows(m, p.block_size) - m if fp8_wgrad else 0
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        fmt, bs, mode = get_format(p.elem_dtype), p.block_size, p.scale_mode
        xr, xc = _quantize(
            x2, None, fmt, bs, mode, True, fp8_wgrad, activation, h, p.hadamard_seed, impl
        )
        wr, wc = _quantize(weight, None, fmt, bs, mode, True, need_dgrad, "none", 0, 0, impl)
        y = _mm(_need(xr), _need(wr).t(), gemm_dtype, bias, 1.0, p.kernel, impl)
        if pad:
            y = y[:m]
        xc_t, wc_t = _pack(xc), _pack(wc)
        keep_x = activation != "none" or (need_wgrad and p.wgrad_high_precision)
        ctx.save_for_backward(x if keep_x else None, *xc_t[:3], *wc_t[:3])
        ctx.meta = (xc_t[3], wc_t[3], m, pad, h, activation, p, x.shape, weight.dtype, impl)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, wgrad_dtype)
        ctx.has_bias = bias is not None
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable  # the quantized GEMMs have no derivative: a double backward raises
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, xc_d, xc_s, xc_f, wc_d, wc_s, wc_f = ctx.saved_tensors
        xc_meta, wc_meta, m, pad, h, activation, p, x_shape, w_dtype, impl = ctx.meta
        x_dtype, b_dtype, wgrad_dtype = ctx.dtypes
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and not p.wgrad_high_precision
        n = dy.shape[-1]
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, n)
        dx = dw = db = None
        if need_dgrad or fp8_wgrad:
            dyq = F.pad(dy2, (0, 0, 0, pad)) if pad else dy2
            # A new seed each step, drawn on the device (no host sync).
            seed = _seed_tensor(p.stochastic_rounding, None, dy.device)
            dyr, dyc = _quantize(
                dyq,
                seed,
                get_format(p.grad_dtype),
                p.block_size,
                p.scale_mode,
                need_dgrad,
                fp8_wgrad,
                "none",
                h,
                p.hadamard_seed,
                impl,
            )
        if need_dgrad:
            wc = _unpack(wc_d, wc_s, wc_f, wc_meta)
            dx = _mm(_need(dyr), wc, dy.dtype, None, 1.0, p.kernel, impl)
            if pad:
                dx = dx[:m]
            if activation != "none":
                dx = _act_backward(x.reshape(m, -1), dx, activation)
            if dx.dtype != x_dtype:
                dx = dx.to(x_dtype)
            if dx.shape != x_shape:
                dx = dx.reshape(x_shape)
        if fp8_wgrad:
            xc = _unpack(xc_d, xc_s, xc_f, xc_meta)
            dw = _mm(_need(dyc).t(), xc, wgrad_dtype, None, 1.0 / h if h else 1.0, p.kernel, impl)
            if dw.dtype != w_dtype:
                dw = dw.to(w_dtype)
        elif need_wgrad:
            a = ref.apply_activation(x.reshape(m, -1), activation).to(dy.dtype)
            dw = (dy2.t() @ a).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
            if db.dtype != b_dtype:
                db = db.to(b_dtype)
        return dx, dw, db, None, None


def _check_features(x: torch.Tensor, in_features: int) -> None:
    # Metadata only (no device sync). Without it a narrower input would be zero-padded
    # to whole MX blocks by the quantizer and silently multiplied as if it were wider.
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"x must have in_features={in_features} features in its last dim, got "
            f"x.shape={tuple(x.shape)} (last dim "
            f"{x.shape[-1] if x.dim() else 'missing: x is 0-d'})"
        )


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: PrecisionPolicy | None = None,
    input_activation: Activation = "none",
) -> torch.Tensor:
    """``act(x) @ weight.T + bias`` with MX FP8 forward, dgrad and wgrad GEMMs.

    Args:
        x: ``(..., K)`` float32/bfloat16/float16; the output has ``x``'s dtype.
        weight: ``(N, K)`` floating point (e.g. FP32 master weights); its gradient has
            its dtype.
        bias: optional ``(N,)``.
        policy: the recipe (default :class:`PrecisionPolicy()`); only its quantization
            fields apply here (``keep_*``/``min_features`` are for :func:`convert`).
        input_activation: producer fused into the cast of ``x`` (see ``mx_quantize``).

    Raises:
        TypeError: ``x``, ``weight`` or ``bias`` not a float32/bfloat16/float16 tensor
            (``bias``: any floating dtype); ``policy`` not a :class:`PrecisionPolicy`.
        ValueError: ``weight`` not 2-D, a 0-d ``x`` or a last dim of ``x`` different from
            ``weight.shape[1]`` (in_features), a ``bias`` of another shape or device, an
            unknown ``input_activation``.
    """
    policy = PrecisionPolicy() if policy is None else policy
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"policy must be a PrecisionPolicy, got {type(policy).__name__}")
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D (out_features, in_features) tensor, got shape "
            f"{tuple(weight.shape)}"
        )
    _check_features(x, weight.shape[1])
    if input_activation not in ref.ACTIVATIONS:
        raise ValueError(f"input_activation must be one of {ref.ACTIVATIONS}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating-point tensor")
        if bias.shape != (weight.shape[0],) or bias.device != x.device:
            raise ValueError(
                f"bias must be ({weight.shape[0]},) on {x.device}, got {tuple(bias.shape)}"
            )
    return _MXLinearFunction.apply(x, weight, bias, policy, input_activation)


class MXLinear(nn.Linear):
    """``nn.Linear`` with MX FP8 forward, dgrad and wgrad GEMMs (see :func:`mx_linear`).

    Same parameters and ``state_dict`` as ``nn.Linear``. Inputs with fewer than
    ``policy.min_tokens`` rows, or a dtype other than float32/bfloat16/float16, take the
    plain high-precision path.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        policy: the :class:`PrecisionPolicy` (default ``PrecisionPolicy()``).
        input_activation: producer fused into the cast of the input: the layer computes
            ``act(x) W^T + b`` (``"none"``, ``"relu"``, ``"relu2"``, ``"silu"``,
            ``"gelu_tanh"``).

    Raises:
        TypeError: ``in_features``/``out_features`` not ints, ``policy`` not a
            :class:`PrecisionPolicy`; in ``forward``, an input that is not a floating-point tensor.
        ValueError: negative ``in_features``/``out_features``, an unknown
            ``input_activation``; in ``forward``, an input whose last dim is not
            ``in_features`` (or a 0-d input).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        policy: PrecisionPolicy | None = None,
        input_activation: Activation = "none",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(policy, input_activation)

    def _configure(self, policy: PrecisionPolicy | None, input_activation: str) -> None:
        policy = PrecisionPolicy() if policy is None else policy
        if not isinstance(policy, PrecisionPolicy):
            raise TypeError(f"policy must be a PrecisionPolicy, got {type(policy).__name__}")
        if input_activation not in ref.ACTIVATIONS:
            raise ValueError(f"input_activation must be one of {ref.ACTIVATIONS}")
        self.policy = policy
        self.input_activation = input_activation

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        policy: PrecisionPolicy | None = None,
        *,
        input_activation: Activation = "none",
    ) -> MXLinear:
        """An ``MXLinear`` sharing ``linear``'s parameters (no copy; hooks not carried).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``; ``policy`` is not a
                :class:`PrecisionPolicy`.
            ValueError: an unknown ``input_activation``.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._configure(policy, input_activation)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            # The high-precision fallback would cast the weight to x's dtype: an integer x
            # would be multiplied by truncated weights.
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        _check_features(x, self.in_features)
        rows = x.numel() // max(x.shape[-1], 1)
        use_mx = x.dtype in (torch.float32, torch.bfloat16, torch.float16) and rows >= max(
            self.policy.min_tokens, 1
        )
        if not use_mx:
            a = ref.apply_activation(x, self.input_activation).to(x.dtype)
            return F.linear(
                a, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
            )
        return _MXLinearFunction.apply(
            x, self.weight, self.bias, self.policy, self.input_activation
        )

    def extra_repr(self) -> str:
        p = self.policy
        act = (
            f", input_activation={self.input_activation}" if self.input_activation != "none" else ""
        )
        return (
            f"{super().extra_repr()}, block_size={p.block_size}, "
            f"elem={p.elem_dtype}, grad={p.grad_dtype}{act}"
        )
