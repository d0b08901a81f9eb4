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
from hyperrec.jagged_attn.fp8 import FP8Config

__all__ = [
    "attention_fp8_torch",
    "attention_fp8_torch_bwd",
    "attention_fp8_triton",
    "attention_fp8_triton_bwd",
    "attention_fp8_triton_fwd",
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
