"""``torch.library`` registration of the FP8 / MXFP8 forward, and its backend choice.

Two forward ops with the package's argument list
(:func:`hyperrec.jagged_attn._opschema.schema`) preceded by ``str precision`` (the encoded
:class:`~hyperrec.jagged_attn.fp8.FP8Config`):

* ``hyperrec_jagged_attn::attention_fp8_triton_fwd`` -> ``(out, lse)``: the quantization
  kernel and the FP8 forward kernel. Its backward is ``attention_fp8_triton_bwd`` on the
  saved bf16 inputs: with ``backward="bf16"`` the package's bf16 backward (the Gluon
  kernels where they serve the call, after a bf16 forward that supplies the softmax
  statistics; else the Triton kernels with their statistics pass), with ``"fp8"`` the FP8
  backward kernels; neither reads the FP8 forward's log-sum-exp or output.
* ``hyperrec_jagged_attn::attention_fp8_torch`` -> ``out``: the pure-PyTorch emulation
  (:func:`hyperrec.jagged_attn.reference_fp8.attention_forward`). Its backward is the
  reference backward of the unquantized attention (``attention_torch_backward``), or with
  ``backward="fp8"`` the emulated FP8 backward (``attention_fp8_torch_bwd``,
  :func:`hyperrec.jagged_attn.reference_fp8.attention_backward`).

All have fake implementations, so ``torch.compile(fullgraph=True)`` traces them. Importing
this module does not import Triton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from hyperrec.jagged_attn._fp8.quantize import fp8_kernels_supported
from hyperrec.jagged_attn._opschema import NAMESPACE, AttentionCall, activation_of, schema
from hyperrec.jagged_attn._torch.ops import attention_torch_backward
from hyperrec.jagged_attn._triton.ops import _spec_flops
from hyperrec.jagged_attn.fp8 import FP8Config, QuantizedJagged, QuantizedQKV
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = [
    "attention_fp8_torch",
    "attention_fp8_torch_bwd",
    "attention_fp8_triton",
    "attention_fp8_triton_bwd",
    "attention_fp8_triton_fwd",
    "attention_fp8_triton_fwd_quantized",
    "attention_fp8_triton_quantized",
    "bind_quantized",
    "resolve_fp8_backend",
    "unsupported_reason_fp8",
]

_PRECISION = "str precision, "


def unsupported_reason_fp8(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the FP8 Triton forward cannot run this call, or None."""
    if not fp8_kernels_supported(q.device) or q.dtype not in (torch.bfloat16, torch.float16):
        return (
            f"the FP8 kernels need bf16/fp16 inputs on a CUDA GPU of compute capability "
            f">= 8.9 (or CPU tensors under TRITON_INTERPRET=1) and Triton installed; got "
            f"{q.dtype} on {q.device}"
        )
    for name, d in (("q/k head_dim", q.shape[-1]), ("v head_dim", v.shape[-1])):
        if not 16 <= d <= 256:
            return f"the FP8 kernels need {name} in [16, 256], got {d}"
    return None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _contiguous(call: AttentionCall) -> AttentionCall:
    return call.with_tensors(q=_last_dim_contiguous(call.q), k=_last_dim_contiguous(call.k),
                             v=_last_dim_contiguous(call.v))  # fmt: skip


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------


@torch.library.custom_op(
    f"{NAMESPACE}::attention_fp8_triton_fwd",
    mutates_args=(),
    schema=schema(before=_PRECISION, returns="(Tensor, Tensor)"),
)
def attention_fp8_triton_fwd(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 forward: ``out`` ``(Tq, H, Dv)`` and ``lse`` (``(H, Tq)`` fp32 for softmax, empty
    otherwise)."""
    from hyperrec.jagged_attn._triton._fp8_launch import attention_forward_fp8

    call = _contiguous(AttentionCall.from_op_args(args[1:]))
    return attention_forward_fp8(call, FP8Config.decode(args[0]))


@attention_fp8_triton_fwd.register_fake
def _fp8_triton_fwd_fake(
    precision: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    spec: str,
    *scalars: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse_shape = (q.shape[1], q.shape[0]) if activation_of(spec) == "softmax" else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(
    f"{NAMESPACE}::attention_fp8_triton_bwd",
    mutates_args=(),
    schema=schema(
        before=_PRECISION + "Tensor grad_out, Tensor out, Tensor lse, ",
        returns="(Tensor, Tensor, Tensor)",
    ),  # fmt: skip
)
def attention_fp8_triton_bwd(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``attention_fp8_triton_fwd``: ``(dq, dk, dv)``. ``backward="fp8"``: the
    FP8 backward kernels; ``"bf16"``: the bf16 backward kernels. Neither uses the FP8
    forward's ``out`` / ``lse`` (kept in the schema for the op's history): both recompute
    the softmax statistics from the inputs they differentiate (``recompute_stats``), so
    that ``P``, ``lse`` and ``rowsum(P * dP)`` agree (mixing the FP8 forward's made dQ
    wrong on inputs with outlier channels)."""
    from hyperrec.jagged_attn._triton._fp8_launch import attention_backward_fp8
    from hyperrec.jagged_attn._triton._launch import attention_backward

    precision, grad_out, out, lse = args[:4]
    call = _contiguous(AttentionCall.from_op_args(args[4:]))
    config = FP8Config.decode(precision)
    if config.backward == "fp8":
        return attention_backward_fp8(grad_out, call, config)
    return attention_backward(grad_out, out, lse, call, recompute_stats=True)


@attention_fp8_triton_bwd.register_fake
def _fp8_triton_bwd_fake(
    precision: str,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _triton_setup_context(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ctx.precision = inputs[0]
    tensors, ctx.spec_args = AttentionCall.split_op_args(inputs[1:])
    ctx.n_tensors = len(tensors)
    ctx.save_for_backward(*output, *tensors)


def _triton_backward(
    ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    del grad_lse  # auxiliary output: nothing flows back through it
    out, lse, *tensors = ctx.saved_tensors
    grads = attention_fp8_triton_bwd(ctx.precision, grad_out.contiguous(), out, lse, *tensors,
                                     *ctx.spec_args)  # fmt: skip
    return (None, *grads) + (None,) * (ctx.n_tensors - 3 + len(ctx.spec_args))


attention_fp8_triton_fwd.register_autograd(_triton_backward, setup_context=_triton_setup_context)


def attention_fp8_triton(*args: Any) -> torch.Tensor:
    """:func:`attention_fp8_triton_fwd` returning ``out`` only."""
    out, _ = attention_fp8_triton_fwd(*args)
    return out


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_fp8_triton_fwd)
def _fp8_flop_formula(
    precision: str,
    q_shape: torch.Size,
    k_shape: torch.Size,
    v_shape: torch.Size,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _spec_flops(q_shape, k_shape, v_shape, args, "fwd")


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_fp8_triton_bwd)
def _fp8_bwd_flop_formula(
    precision: str,
    grad_shape: torch.Size,
    out_shape_: torch.Size,
    lse_shape: torch.Size,
    q_shape: torch.Size,
    k_shape: torch.Size,
    v_shape: torch.Size,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _spec_flops(q_shape, k_shape, v_shape, args, "bwd")


# ----------------------------------------------------------------------------------------
# Triton, with operands quantized beforehand (``quantized=``)
# ----------------------------------------------------------------------------------------

_QUANTIZED = ("Tensor q8, Tensor qs, Tensor k8, Tensor ks, Tensor v8, Tensor vs, "
              "Tensor v_pad_offsets, bool v_mma_order, ")  # fmt: skip
_N_QUANTIZED = 8


@torch.library.custom_op(
    f"{NAMESPACE}::attention_fp8_triton_fwd_quantized",
    mutates_args=(),
    schema=schema(before=_PRECISION + _QUANTIZED, returns="(Tensor, Tensor)"),
)
def attention_fp8_triton_fwd_quantized(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_fp8_triton_fwd` on operands quantized beforehand (the call's
    ``q``/``k``/``v`` are what the backward differentiates)."""
    from hyperrec.jagged_attn._triton._fp8_launch import attention_forward_fp8

    q8, qs, k8, ks, v8, vs, poff, mma = args[1 : 1 + _N_QUANTIZED]
    config = FP8Config.decode(args[0])
    qkv = QuantizedQKV(
        q=QuantizedJagged(data=q8, scale=qs, layout="rows"),
        k=QuantizedJagged(data=k8, scale=ks, layout="rows"),
        v=QuantizedJagged(data=v8, scale=vs, layout="cols", pad_offsets=poff, mma_order=mma),
        config=config,
    )
    call = _contiguous(AttentionCall.from_op_args(args[1 + _N_QUANTIZED :]))
    return attention_forward_fp8(call, config, qkv=qkv)


@attention_fp8_triton_fwd_quantized.register_fake
def _fp8_quantized_fake(precision: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_triton_fwd_fake(precision, *args[_N_QUANTIZED:])


def _quantized_setup_context(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
) -> None:
    _triton_setup_context(ctx, (inputs[0], *inputs[1 + _N_QUANTIZED :]), output)


def _quantized_backward(
    ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    grads = _triton_backward(ctx, grad_out, grad_lse)
    return (grads[0], *(None,) * _N_QUANTIZED, *grads[1:])


attention_fp8_triton_fwd_quantized.register_autograd(
    _quantized_backward, setup_context=_quantized_setup_context
)


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_fp8_triton_fwd_quantized)
def _fp8_quantized_flop_formula(precision: str, *args: Any, out_shape: Any = None,
                                **kwargs: Any) -> int:  # fmt: skip
    q_shape, k_shape, v_shape, *rest = args[_N_QUANTIZED:]
    return _spec_flops(q_shape, k_shape, v_shape, tuple(rest), "fwd")


def bind_quantized(
    op: Callable[..., torch.Tensor],
    quantized: object,
    precision: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
) -> Callable[..., torch.Tensor]:
    """The forward ``op`` (from :func:`resolve_fp8_backend`) reading ``quantized`` instead
    of quantizing ``q``/``k``/``v``: the Triton op gets the operands bound; the emulation
    is returned as is (it re-quantizes ``q``/``k``/``v``, which gives the same operands
    when ``quantized`` is their quantization, the contract of ``quantized=``).

    Raises:
        TypeError: ``quantized`` is not a :class:`QuantizedQKV`.
        ValueError: ``precision`` is ``"bf16"`` or not ``quantized.config``; softmax with
            ``smooth_k``; shapes, layouts or devices that do not match ``q``/``k``/``v``.
    """
    from hyperrec.jagged_attn.fp8 import resolve_precision
    from hyperrec.jagged_attn.reference_fp8 import cols_width

    if not isinstance(quantized, QuantizedQKV):
        raise TypeError(f"quantized must be a QuantizedQKV, got {type(quantized).__name__}")
    config = resolve_precision(precision)
    if config is None:
        raise ValueError("quantized= needs an FP8 precision ('fp8', 'mxfp8' or an FP8Config); "
                         "the call's precision is 'bf16'")  # fmt: skip
    if config != quantized.config:
        raise ValueError(f"quantized was made with precision {quantized.config}, the call's "
                         f"is {config}")  # fmt: skip
    if spec.activation == "softmax" and config.smooth_k:
        raise ValueError(
            "quantized= with softmax needs FP8Config(smooth_k=False): the key shift of "
            "smooth_k (each sequence's mean key) is not in operands quantized beforehand"
        )
    (total_k, heads, dim_v), n_kv = v.shape, kv_offsets.numel() - 1
    width = cols_width(total_k, n_kv, config.v_pad)
    want = {
        "quantized.q.data": (quantized.q.data, tuple(q.shape)),
        "quantized.k.data": (quantized.k.data, tuple(k.shape)),
        "quantized.v.data": (quantized.v.data, (heads, dim_v, width)),
    }
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} must be a float8_e4m3fn tensor")
        if tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"{name} must have shape {shape} on {q.device} (this call's "
                             f"q/k/v), got {tuple(t.shape)} on {t.device}")  # fmt: skip
    if quantized.q.layout != "rows" or quantized.k.layout != "rows" \
            or quantized.v.layout != "cols" or quantized.v.pad_offsets is None:  # fmt: skip
        raise ValueError("quantized must hold Q and K in the 'rows' layout and V in 'cols' "
                         "with pad_offsets, as quantize_qkv returns them")  # fmt: skip
    partial = op if isinstance(op, functools.partial) else None
    if partial is None or partial.func is not attention_fp8_triton:
        return op
    qq, kq, vq = quantized.q, quantized.k, quantized.v
    return functools.partial(
        attention_fp8_triton_quantized, partial.args[0], qq.data, qq.scale, kq.data, kq.scale,
        vq.data, vq.scale, vq.pad_offsets, vq.mma_order,
    )  # fmt: skip


def attention_fp8_triton_quantized(*args: Any) -> torch.Tensor:
    """:func:`attention_fp8_triton_fwd_quantized` returning ``out`` only."""
    out, _ = attention_fp8_triton_fwd_quantized(*args)
    return out


# ----------------------------------------------------------------------------------------
# Reference (emulation)
# ----------------------------------------------------------------------------------------


@torch.library.custom_op(
    f"{NAMESPACE}::attention_fp8_torch", mutates_args=(), schema=schema(before=_PRECISION)
)
def attention_fp8_torch(*args: Any) -> torch.Tensor:
    """The emulated FP8 forward: ``(Tq, H, Dv)`` in ``q.dtype``, contiguous."""
    from hyperrec.jagged_attn import reference_fp8

    c = AttentionCall.from_op_args(args[1:])
    out = reference_fp8.attention_forward(
        c.q, c.k, c.v, c.q_offsets, c.kv_offsets, c.spec, FP8Config.decode(args[0]),
        kv_index=c.kv_index, num_targets=c.num_targets,
        dtype=torch.promote_types(c.q.dtype, torch.float32),
    )  # fmt: skip
    return out.contiguous()


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_fp8_torch)
def _fp8_torch_flop_formula(
    precision: str,
    q_shape: torch.Size,
    k_shape: torch.Size,
    v_shape: torch.Size,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _spec_flops(q_shape, k_shape, v_shape, args, "fwd")


@attention_fp8_torch.register_fake
def _fp8_torch_fake(
    precision: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op(
    f"{NAMESPACE}::attention_fp8_torch_bwd",
    mutates_args=(),
    schema=schema(before=_PRECISION + "Tensor grad_out, ", returns="(Tensor, Tensor, Tensor)"),
)
def attention_fp8_torch_bwd(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The emulated FP8 backward (``backward="fp8"``): contiguous ``(dq, dk, dv)``."""
    from hyperrec.jagged_attn import reference_fp8

    precision, grad_out = args[:2]
    c = AttentionCall.from_op_args(args[2:])
    grads = reference_fp8.attention_backward(
        c.q, c.k, c.v, grad_out, c.q_offsets, c.kv_offsets, c.spec,
        FP8Config.decode(precision), kv_index=c.kv_index, num_targets=c.num_targets,
        dtype=torch.promote_types(c.q.dtype, torch.float32),
    )  # fmt: skip
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_fp8_torch_bwd)
def _fp8_torch_bwd_flop_formula(
    precision: str,
    grad_shape: torch.Size,
    q_shape: torch.Size,
    k_shape: torch.Size,
    v_shape: torch.Size,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _spec_flops(q_shape, k_shape, v_shape, args, "bwd")


@attention_fp8_torch_bwd.register_fake
def _fp8_torch_bwd_fake(
    precision: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _torch_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.precision = inputs[0]
    tensors, ctx.spec_args = AttentionCall.split_op_args(inputs[1:])
    ctx.save_for_backward(*tensors)


def _torch_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # Unpack once: under non-reentrant (selective) checkpointing a saved tensor may be
    # unpacked only once per backward.
    saved = ctx.saved_tensors
    if FP8Config.decode(ctx.precision).backward == "fp8":
        grads = attention_fp8_torch_bwd(ctx.precision, grad_out.contiguous(), *saved,
                                        *ctx.spec_args)  # fmt: skip
    else:
        grads = attention_torch_backward(grad_out, *saved, *ctx.spec_args)
    return (None, *grads) + (None,) * (len(saved) - 3 + len(ctx.spec_args))


attention_fp8_torch.register_autograd(_torch_backward, setup_context=_torch_setup_context)


# ----------------------------------------------------------------------------------------
# Backend choice
# ----------------------------------------------------------------------------------------


def resolve_fp8_backend(
    config: FP8Config, backend: str, q: torch.Tensor, v: torch.Tensor
) -> Callable[..., torch.Tensor]:
    """The FP8 forward for ``backend`` (already checked) as a function of the op arguments
    of :meth:`AttentionCall.op_args <hyperrec.jagged_attn._opschema.AttentionCall.op_args>`.

    Raises:
        ValueError: ``backend="triton"`` for inputs the FP8 kernels cannot run.
    """
    text = config.encode()
    if backend == "torch":
        return functools.partial(attention_fp8_torch, text)
    reason = unsupported_reason_fp8(q, v)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        return functools.partial(attention_fp8_triton, text)
    use_triton = q.device.type == "cuda" and reason is None
    return functools.partial(attention_fp8_triton if use_triton else attention_fp8_torch, text)
