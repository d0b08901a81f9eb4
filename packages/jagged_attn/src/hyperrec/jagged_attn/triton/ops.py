"""``torch.library`` registration of the Triton backend.

Two custom ops, with fake (meta) implementations, FLOP formulas, and autograd tied
together by ``register_autograd``:

* ``hyperrec_jagged_attn::attention_triton_fwd`` -> ``(out, lse)``
* ``hyperrec_jagged_attn::attention_triton_bwd`` -> ``(dq, dk, dv)``

Both take the tensors followed by :func:`hyperrec.jagged_attn.ops.spec_args` of the spec,
exactly like the reference backend's ``attention_torch``; :func:`attention_triton` has the
reference op's call signature and returns only ``out``, so the dispatcher can treat the
two backends alike. To ``torch.compile`` each op is one opaque node with known output
shapes, so a block calling it traces with ``fullgraph=True``.

Importing this module registers the ops; it does not import Triton (the launchers do, on
the first real call).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from hyperrec.jagged_attn.triton._flops import flops_upper_bound
from hyperrec.jagged_attn.triton._probe import supports

__all__ = [
    "attention_triton",
    "attention_triton_bwd",
    "attention_triton_fwd",
    "unsupported_reason",
]

NAMESPACE = "hyperrec_jagged_attn"


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run this call, or None if they can.

    They need Triton, a CUDA GPU of compute capability >= 8.0 (or CPU tensors under
    ``TRITON_INTERPRET=1``), bf16/fp16 inputs and head dims in [16, 256].
    """
    if not supports(q.device, q.dtype):
        return (
            f"needs bf16/fp16 inputs on a CUDA GPU with compute capability >= 8.0 (or CPU "
            f"tensors under TRITON_INTERPRET=1) and Triton installed; got {q.dtype} on "
            f"{q.device}"
        )
    for name, d in (("q/k head_dim", q.shape[-1]), ("v head_dim", v.shape[-1])):
        if not 16 <= d <= 256:
            return f"{name} must be in [16, 256], got {d}"
    return None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op(f"{NAMESPACE}::attention_triton_fwd", mutates_args=())
def attention_triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    activation: str,
    scale: float,
    output_scale: float,
    normalization: str,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    causal: bool,
    window_left: int,
    window_right: int,
    contextual_len: int,
    block_size: int,
    block_previous: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``out`` ``(Tq, H, Dv)`` and ``lse`` (``(H, Tq)`` fp32 for softmax,
    empty otherwise), see :func:`hyperrec.jagged_attn.triton.attention_forward`."""
    from hyperrec.jagged_attn.triton._launch import attention_forward

    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return attention_forward(
        q, k, v, q_offsets, kv_offsets, kv_index, num_targets, activation, scale,
        output_scale, normalization, max_seqlen_q, max_seqlen_kv, causal, window_left,
        window_right, contextual_len, block_size, block_previous,
    )  # fmt: skip


@attention_triton_fwd.register_fake
def _attention_triton_fwd_fake(q, k, v, q_offsets, kv_offsets, kv_index, num_targets,
                               activation, *spec):  # fmt: skip
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse_shape = (q.shape[1], q.shape[0]) if activation == "softmax" else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::attention_triton_bwd", mutates_args=())
def attention_triton_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    activation: str,
    scale: float,
    output_scale: float,
    normalization: str,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    causal: bool,
    window_left: int,
    window_right: int,
    contextual_len: int,
    block_size: int,
    block_previous: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dq, dk, dv)``, see
    :func:`hyperrec.jagged_attn.triton.attention_backward`."""
    from hyperrec.jagged_attn.triton._launch import attention_backward

    grad_out, q, k, v = (_last_dim_contiguous(t) for t in (grad_out, q, k, v))
    return attention_backward(
        grad_out, q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets,
        activation, scale, output_scale, normalization, max_seqlen_q, max_seqlen_kv, causal,
        window_left, window_right, contextual_len, block_size, block_previous,
    )  # fmt: skip


@attention_triton_bwd.register_fake
def _attention_triton_bwd_fake(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *spec = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets)
    ctx.spec = spec


def _backward(ctx, grad_out, grad_lse):
    del grad_lse  # the log-sum-exp is an auxiliary output: nothing flows back through it
    q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets = ctx.saved_tensors
    dq, dk, dv = attention_triton_bwd(
        grad_out, q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets, *ctx.spec
    )
    return (dq, dk, dv) + (None,) * (4 + len(ctx.spec))


attention_triton_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    *spec,
) -> torch.Tensor:
    """The Triton backend with the reference op's signature: returns ``out`` only."""
    out, _ = attention_triton_fwd(q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *spec)
    return out


# FLOP counts for torch.utils.flop_counter. The counter sees shapes, not the offsets'
# values, so the count is the upper bound sum(Lq * Lk) <= min(Tq * max_kv, Tk * max_q)
# (exact for equal-length sequences); bench/ uses hyperrec.jagged_attn.triton.flops with the
# real lengths instead.
def _spec_flops(q_shape, k_shape, v_shape, max_seqlen_q, max_seqlen_kv, pass_: str) -> int:
    return int(flops_upper_bound(q_shape[0], k_shape[0], max_seqlen_q, max_seqlen_kv,
                                 q_shape[1], q_shape[2], v_shape[2], pass_=pass_))  # fmt: skip


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_triton_fwd)
def _fwd_flop_formula(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    max_seqlen_q, max_seqlen_kv = args[8], args[9]
    return _spec_flops(q_shape, k_shape, v_shape, max_seqlen_q, max_seqlen_kv, "fwd")


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_triton_bwd)
def _bwd_flop_formula(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                      **kwargs) -> int:  # fmt: skip
    max_seqlen_q, max_seqlen_kv = args[10], args[11]
    return _spec_flops(q_shape, k_shape, v_shape, max_seqlen_q, max_seqlen_kv, "bwd")
