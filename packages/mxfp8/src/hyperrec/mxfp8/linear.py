"""``MXLinear``: a drop-in ``nn.Linear`` whose three GEMMs run on MX FP8 operands.

Per step (``x``: ``(M, K)`` tokens, ``W``: ``(N, K)``):

* forward ``y = x W^T``: one fused pass over ``act(x)`` writes its row-wise copy (for
  this GEMM) and its column-wise copy (kept for wgrad, FP8 instead of a BF16 activation);
  one pass over ``W`` writes both of its copies.
* dgrad ``dx = dY W``: one pass over ``dY`` writes both copies (optionally stochastically
  rounded); ``W``'s column-wise copy is the second operand.
* wgrad ``dW = dY^T x``: both operands are column-wise copies, blocked along the token
  dim, optionally random-Hadamard-transformed (the GEMM divides by ``n``).

An optional ``input_activation`` is fused into the quantization of ``x`` (the producer):
the layer computes ``act(x) W^T`` and its gradient flows to the pre-activation ``x``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8.gemm import mx_mm
from hyperrec.mxfp8.policy import PrecisionPolicy
from hyperrec.mxfp8.quantize import _mx, mx_quantize
from hyperrec.mxfp8.tensor import MXTensor

__all__ = ["MXLinear", "mx_linear"]


def _pack(t: MXTensor | None) -> tuple:
    if t is None:
        return (None, None, None)
    meta = (t.fmt, t.block_size, t.axis, t.shape, t.orig_dtype)
    return (t.data, t.scale, meta)


def _unpack(data: torch.Tensor | None, scale: torch.Tensor | None, meta) -> MXTensor | None:
    return None if meta is None else _mx(data, scale, *meta)


def _act_backward(x: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    # d act(x) / dx through autograd on the reference activation (FP32 math).
    with torch.enable_grad():
        xx = x.detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(ref.apply_activation(xx, activation), xx, grad.float())
    return g.to(grad.dtype)


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, policy: PrecisionPolicy, activation: str):
        p = policy
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and not p.wgrad_high_precision
        h = p.hadamard if fp8_wgrad else 0
        # The transform mixes groups of h tokens: pad the token dim with zero rows so every
        # group is whole (act(0) = 0 for every supported activation).
        pad = (-m) % h if h else 0
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        common = {"block_size": p.block_size, "scale_mode": p.scale_mode, "backend": p.backend}
        xr, xc = mx_quantize(
            x2,
            elem_dtype=p.elem_dtype,
            rowwise=True,
            colwise=fp8_wgrad,
            activation=activation,
            hadamard=h,
            hadamard_seed=p.hadamard_seed,
            **common,
        )
        wr, wc = mx_quantize(weight, elem_dtype=p.elem_dtype, colwise=need_dgrad, **common)
        y = mx_mm(xr, wr.t(), out_dtype=x.dtype, bias=bias, kernel=p.kernel, backend=p.backend)
        if pad:
            y = y[:m]
        xc_t, wc_t = _pack(xc), _pack(wc)
        keep_x = activation != "none" or (need_wgrad and p.wgrad_high_precision)
        ctx.save_for_backward(x if keep_x else None, xc_t[0], xc_t[1], wc_t[0], wc_t[1])
        ctx.meta = (xc_t[2], wc_t[2], m, pad, h, activation, p, x.shape, weight.dtype)
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, xc_d, xc_s, wc_d, wc_s = ctx.saved_tensors
        xc_meta, wc_meta, m, pad, h, activation, p, x_shape, w_dtype = ctx.meta
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and not p.wgrad_high_precision
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        dx = dw = db = None
        if need_dgrad or fp8_wgrad:
            dyq = F.pad(dy2, (0, 0, 0, pad)) if pad else dy2
            dyr, dyc = mx_quantize(
                dyq,
                elem_dtype=p.grad_dtype,
                block_size=p.block_size,
                scale_mode=p.scale_mode,
                rowwise=need_dgrad,
                colwise=fp8_wgrad,
                hadamard=h,
                hadamard_seed=p.hadamard_seed,
                stochastic_rounding=p.stochastic_rounding,
                backend=p.backend,
            )
        if need_dgrad:
            wc = _unpack(wc_d, wc_s, wc_meta)
            dx = mx_mm(dyr, wc, out_dtype=dy.dtype, kernel=p.kernel, backend=p.backend)
            if pad:
                dx = dx[:m]
            if activation != "none":
                dx = _act_backward(x.reshape(m, -1), dx, activation)
            dx = dx.reshape(x_shape)
        if fp8_wgrad:
            xc = _unpack(xc_d, xc_s, xc_meta)
            dw = mx_mm(
                dyc.t(),
                xc,
                out_dtype=w_dtype,
                alpha=1.0 / h if h else 1.0,
                kernel=p.kernel,
                backend=p.backend,
            )
        elif need_wgrad:
            a = ref.apply_activation(x.reshape(m, -1), activation).to(dy.dtype)
            dw = (dy2.t() @ a).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: PrecisionPolicy | None = None,
    input_activation: str = "none",
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
        TypeError, ValueError: bad tensors or shapes (as :func:`mx_quantize`), a last
        dim of ``x`` different from ``weight.shape[1]``.
    """
    policy = PrecisionPolicy() if policy is None else policy
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"policy must be a PrecisionPolicy, got {type(policy).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D (out_features, in_features) tensor")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must end in in_features={weight.shape[1]}, got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if input_activation not in ref.ACTIVATIONS:
        raise ValueError(f"input_activation must be one of {ref.ACTIVATIONS}")
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
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        policy: PrecisionPolicy | None = None,
        input_activation: str = "none",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
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
        input_activation: str = "none",
    ) -> MXLinear:
        """An ``MXLinear`` sharing ``linear``'s parameters (no copy; hooks not carried).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``.
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
