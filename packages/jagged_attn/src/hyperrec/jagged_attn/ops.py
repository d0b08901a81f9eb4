"""``torch.library`` registration of the reference backend.

Two custom ops, ``hyperrec_jagged_attn::attention_torch`` and its backward, each with a
fake (meta) implementation, tied together by ``register_autograd``. To ``torch.compile``
each is one opaque node with known output shapes, so a model calling the public functions
traces with ``fullgraph=True``; the host sync inside the reference stays inside the op.

Every backend registers such a pair with the same argument list (the tensors, then
:func:`spec_args` of the spec); the Triton backend (planned) will add its own, and
:mod:`hyperrec.jagged_attn.backends` picks one by name.
"""

from __future__ import annotations

import torch

from hyperrec.jagged_attn import reference
from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = ["NAMESPACE", "attention_torch", "attention_torch_backward", "spec_args"]

NAMESPACE = "hyperrec_jagged_attn"

# Custom ops take primitives only, so a spec travels as this fixed tuple of fields.
_SpecArgs = tuple[str, float, float, str, int, int, bool, int, int, int, int, bool]


def spec_args(spec: AttentionSpec) -> _SpecArgs:
    """Flatten ``spec`` into the positional primitives the custom ops take."""
    m = spec.mask
    # float() on plain numbers only: under torch.compile(dynamic=True) the default scale is
    # a symbolic float, which the op accepts as is.
    scale = float(spec.scale) if type(spec.scale) is int else spec.scale
    return (
        spec.activation,
        scale,
        float(spec.output_scale),
        spec.normalization,
        spec.max_seqlen_q,
        spec.max_seqlen_kv,
        m.causal,
        m.window_left,
        m.window_right,
        m.contextual_len,
        m.block_size,
        m.block_previous,
    )


def _spec(
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
) -> AttentionSpec:
    return AttentionSpec(
        activation=activation,
        scale=scale,
        output_scale=output_scale,
        normalization=normalization,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        mask=MaskSpec(
            causal=causal,
            window_left=window_left,
            window_right=window_right,
            contextual_len=contextual_len,
            block_size=block_size,
            block_previous=block_previous,
        ),
    )


@torch.library.custom_op(f"{NAMESPACE}::attention_torch", mutates_args=())
def attention_torch(
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
) -> torch.Tensor:
    """Reference forward as a custom op: ``(Tq, H, Dv)`` in ``q.dtype``, contiguous."""
    spec = _spec(
        activation,
        scale,
        output_scale,
        normalization,
        max_seqlen_q,
        max_seqlen_kv,
        causal,
        window_left,
        window_right,
        contextual_len,
        block_size,
        block_previous,
    )
    out = reference.attention_forward(
        q, k, v, q_offsets, kv_offsets, spec, kv_index=kv_index, num_targets=num_targets
    )
    return out.contiguous()


@attention_torch.register_fake
def _attention_torch_fake(q, k, v, *args):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op(f"{NAMESPACE}::attention_torch_backward", mutates_args=())
def attention_torch_backward(
    grad_out: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward as a custom op: contiguous ``(dq, dk, dv)``."""
    spec = _spec(
        activation,
        scale,
        output_scale,
        normalization,
        max_seqlen_q,
        max_seqlen_kv,
        causal,
        window_left,
        window_right,
        contextual_len,
        block_size,
        block_previous,
    )
    dq, dk, dv = reference.attention_backward(
        grad_out, q, k, v, q_offsets, kv_offsets, spec, kv_index=kv_index, num_targets=num_targets
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_torch_backward.register_fake
def _attention_torch_backward_fake(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *spec = inputs
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, kv_index, num_targets)
    ctx.spec = spec


def _backward(ctx, grad_out):
    q, k, v, q_offsets, kv_offsets, kv_index, num_targets = ctx.saved_tensors
    dq, dk, dv = attention_torch_backward(
        grad_out, q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *ctx.spec
    )
    return (dq, dk, dv) + (None,) * (4 + len(ctx.spec))


attention_torch.register_autograd(_backward, setup_context=_setup_context)
