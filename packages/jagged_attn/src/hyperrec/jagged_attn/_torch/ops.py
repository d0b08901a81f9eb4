"""``torch.library`` registration of the reference backend.

Two custom ops with the argument list of :func:`hyperrec.jagged_attn._opschema.schema`,
fake (meta) implementations and autograd tied by ``register_autograd``:

* ``hyperrec_jagged_attn::attention_torch`` -> ``out``
* ``hyperrec_jagged_attn::attention_torch_backward`` (``grad_out`` first) -> ``(dq, dk, dv)``

To ``torch.compile`` each is one opaque node with known output shapes, so a model calling
the public functions traces with ``fullgraph=True``; the host sync inside the reference
stays inside the op. The Triton backend (:mod:`hyperrec.jagged_attn._triton.ops`) has the
same layout.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperrec.jagged_attn._opschema import NAMESPACE, AttentionCall, schema
from hyperrec.jagged_attn._torch import _launch

__all__ = ["attention_torch", "attention_torch_backward"]


@torch.library.custom_op(f"{NAMESPACE}::attention_torch", mutates_args=(), schema=schema())
def attention_torch(*args: Any) -> torch.Tensor:
    """Reference forward: ``(Tq, H, Dv)`` in ``q.dtype``, contiguous."""
    return _launch.attention_forward(AttentionCall.from_op_args(args))


@attention_torch.register_fake
def _attention_torch_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op(
    f"{NAMESPACE}::attention_torch_backward",
    mutates_args=(),
    schema=schema(before="Tensor grad_out, ", returns="(Tensor, Tensor, Tensor)"),
)
def attention_torch_backward(
    grad_out: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward: contiguous ``(dq, dk, dv)``."""
    return _launch.attention_backward(grad_out, AttentionCall.from_op_args(args))


@attention_torch_backward.register_fake
def _attention_torch_backward_fake(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    tensors, ctx.spec_args = AttentionCall.split_op_args(inputs)
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # Read saved_tensors once: under non-reentrant checkpointing each saved tensor may be
    # unpacked only once.
    saved = ctx.saved_tensors
    dq, dk, dv = attention_torch_backward(grad_out, *saved, *ctx.spec_args)
    return (dq, dk, dv) + (None,) * (len(saved) - 3 + len(ctx.spec_args))


attention_torch.register_autograd(_backward, setup_context=_setup_context)
