"""Launcher of the reference backend: one :class:`AttentionCall` through
:mod:`hyperrec.jagged_attn.reference` (outputs contiguous, as the ops promise)."""

from __future__ import annotations

import torch

from hyperrec.jagged_attn import reference
from hyperrec.jagged_attn._opschema import AttentionCall

__all__ = ["attention_backward", "attention_forward"]


def attention_forward(call: AttentionCall) -> torch.Tensor:
    """``(Tq, H, Dv)`` in ``q.dtype``."""
    out = reference.attention_forward(
        call.q, call.k, call.v, call.q_offsets, call.kv_offsets, call.spec,
        kv_index=call.kv_index, num_targets=call.num_targets,
    )  # fmt: skip
    return out.contiguous()


def attention_backward(
    grad_out: torch.Tensor, call: AttentionCall
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, each like its input."""
    grads = reference.attention_backward(
        grad_out, call.q, call.k, call.v, call.q_offsets, call.kv_offsets, call.spec,
        kv_index=call.kv_index, num_targets=call.num_targets,
    )  # fmt: skip
    dq, dk, dv = (g.contiguous() for g in grads)
    return dq, dk, dv
