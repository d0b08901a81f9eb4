"""``torch.library`` registration of the Triton backend.

Two custom ops with the argument list of :func:`hyperrec.jagged_attn._opschema.schema`,
fake (meta) implementations, FLOP formulas, and autograd tied by ``register_autograd``:

* ``hyperrec_jagged_attn::attention_triton_fwd`` -> ``(out, lse)``
* ``hyperrec_jagged_attn::attention_triton_bwd`` (``grad_out, out, lse`` first) ->
  ``(dq, dk, dv)``

:func:`attention_triton` takes the reference op's arguments and returns only ``out``, so
the dispatcher treats the two backends alike (the reference backend,
:mod:`hyperrec.jagged_attn._torch.ops`, has the same layout). To ``torch.compile`` each op
is one opaque node with known output shapes, so a block calling it traces with
``fullgraph=True``.

Importing this module registers the ops; it does not import Triton (the launchers do, on
the first real call).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from hyperrec.jagged_attn._opschema import NAMESPACE, AttentionCall, activation_of, schema
from hyperrec.jagged_attn._triton._flops import flops_upper_bound
from hyperrec.jagged_attn._triton._probe import supports

__all__ = [
    "attention_triton",
    "attention_triton_bwd",
    "attention_triton_call",
    "attention_triton_fwd",
    "unsupported_reason",
]


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


#: Byte alignment the kernels need of a (tokens, H, D) input's base address and of its row
#: and head strides: 16 bytes for vectorised loads and tensor descriptors (TMA).
ALIGNMENT = 16


def needs_copy(t: torch.Tensor) -> bool:
    """Whether the kernels should read a fresh contiguous copy of ``t`` (a ``(tokens, H,
    D)`` input or gradient) instead of ``t`` itself.

    Yes when its last dim is not contiguous (the kernels need it), and when its base
    address, or the stride of a dim of size > 1, is not a multiple of :data:`ALIGNMENT`
    bytes while a contiguous copy's would be. Such a view (e.g. ``q`` sliced out of a
    packed ``qkv`` buffer at an odd offset) compiles a kernel variant without vectorised
    loads and without tensor descriptors, which ran 2.2-2.3x slower on an H200
    (``bench/results/diagnose_variance_quick_h200_2026-12-01.json``); one copy costs a few
    percent of that. Empty tensors are never copied.
    """
    if t.numel() == 0:
        return False
    if t.stride(-1) != 1:
        return True
    item = t.element_size()
    if t.data_ptr() % ALIGNMENT:
        return True
    strides_ok = all(
        (st * item) % ALIGNMENT == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1
    )
    # a contiguous copy's strides are multiples of the last dim's bytes
    return not strides_ok and (t.shape[-1] * item) % ALIGNMENT == 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its contiguous copy in a fresh (hence aligned) buffer if
    :func:`needs_copy`. Differentiable (the copy is a ``clone``)."""
    return t.clone(memory_format=torch.contiguous_format) if needs_copy(t) else t


def _prepared(call: AttentionCall) -> AttentionCall:
    """``call`` with q, k and v as the kernels need them (see :func:`needs_copy`)."""
    q, k, v = call.q, call.k, call.v
    if not (needs_copy(q) or needs_copy(k) or needs_copy(v)):
        return call
    return call.with_tensors(q=_aligned(q), k=_aligned(k), v=_aligned(v))


@torch.library.custom_op(
    f"{NAMESPACE}::attention_triton_fwd",
    mutates_args=(),
    schema=schema(returns="(Tensor, Tensor)"),
)
def attention_triton_fwd(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``out`` ``(Tq, H, Dv)`` and ``lse`` (``(H, Tq)`` fp32 for softmax,
    empty otherwise), see :func:`hyperrec.jagged_attn._triton.attention_forward`."""
    from hyperrec.jagged_attn._triton._launch import attention_forward

    return attention_forward(_prepared(AttentionCall.from_op_args(args)))


@attention_triton_fwd.register_fake
def _attention_triton_fwd_fake(q, k, v, q_offsets, kv_offsets, kv_index, num_targets, spec,
                               *scalars):  # fmt: skip
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    softmax = activation_of(spec) == "softmax"
    lse_shape = (q.shape[1], q.shape[0]) if softmax else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(
    f"{NAMESPACE}::attention_triton_bwd",
    mutates_args=(),
    schema=schema(
        before="Tensor grad_out, Tensor out, Tensor lse, ", returns="(Tensor, Tensor, Tensor)"
    ),
)
def attention_triton_bwd(grad_out, out, lse, *args) -> tuple[torch.Tensor, ...]:
    """Triton backward: ``(dq, dk, dv)``, see
    :func:`hyperrec.jagged_attn._triton.attention_backward`."""
    from hyperrec.jagged_attn._triton._launch import attention_backward

    call = _prepared(AttentionCall.from_op_args(args))
    return attention_backward(_aligned(grad_out), out, lse, call)


@attention_triton_bwd.register_fake
def _attention_triton_bwd_fake(grad_out, out, lse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    tensors, ctx.spec_args = AttentionCall.split_op_args(inputs)
    ctx.n_tensors = len(tensors)
    ctx.save_for_backward(*output, *tensors)


def _backward(ctx, grad_out, grad_lse):
    del grad_lse  # the log-sum-exp is an auxiliary output: nothing flows back through it
    out, lse, *tensors = ctx.saved_tensors
    dq, dk, dv = attention_triton_bwd(grad_out, out, lse, *tensors, *ctx.spec_args)
    return (dq, dk, dv) + (None,) * (ctx.n_tensors - 3 + len(ctx.spec_args))


attention_triton_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_triton(*args) -> torch.Tensor:
    """The Triton backend with the reference op's arguments: returns ``out`` only.

    In plain eager mode (see :func:`_eager`) the launchers are called directly, through a
    ``torch.autograd.Function`` when a gradient is needed: the custom op's dispatch (the
    autograd wrapper, redispatch, the Dynamo guard around the implementation, alias checks)
    costs more host time than everything else in a call, and a call whose kernels take
    0.1 ms is bound by it. Under ``torch.compile``, a dispatch mode (``FlopCounterMode``,
    fake tensors), functorch transforms or tensor subclasses the custom op runs as before.
    Both paths compute the same thing with the same kernels.
    """
    if _eager(args[0], args[1], args[2]):
        return _eager_forward(AttentionCall.from_op_args(args))
    out, _ = attention_triton_fwd(*args)
    return out


def attention_triton_call(call: AttentionCall) -> torch.Tensor:
    """:func:`attention_triton` on an :class:`AttentionCall`: the public layer's entry,
    which in eager mode skips encoding the spec into op arguments and decoding it again."""
    if _eager(call.q, call.k, call.v):
        return _eager_forward(call)
    return attention_triton(*call.op_args())


def _eager_forward(call: AttentionCall) -> torch.Tensor:
    call = _prepared(call)
    q, k, v = call.q, call.k, call.v
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, call)
    from hyperrec.jagged_attn._triton._launch import attention_forward

    return attention_forward(call)[0]


_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call may skip the custom op: not tracing, no dispatch mode, no functorch
    transform, plain tensors (a torch without the probes always takes the op)."""
    if _dispatch_stack_len is None or _functorch_active is None:
        return False
    return (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and type(v) is torch.Tensor
        and not torch.compiler.is_compiling()
        and _dispatch_stack_len() == 0
        and not _functorch_active()
    )


class _EagerAttention(torch.autograd.Function):
    """The eager path's autograd: the custom op's forward and backward, minus its dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        from hyperrec.jagged_attn._triton._launch import attention_forward

        out, lse = attention_forward(call)
        ctx.spec = call.spec
        ctx.save_for_backward(out, lse, *call.tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from hyperrec.jagged_attn._triton._launch import attention_backward

        out, lse, *tensors = ctx.saved_tensors
        call = AttentionCall(**dict(zip(("q", "k", "v", "q_offsets", "kv_offsets", "kv_index",
                                         "num_targets"), tensors)), spec=ctx.spec)  # fmt: skip
        with torch.no_grad():
            dq, dk, dv = attention_backward(_aligned(grad_out), out, lse, call)
        if torch.is_grad_enabled():
            # create_graph=True: the gradients depend on q, k and v (and grad_out), but the
            # kernels' backward has no backward of its own. Not once_differentiable, which
            # only looks at grad_out: with a grad_out that needs no gradient (a loss linear
            # in the output) the gradients would come back detached and a gradient penalty
            # would be dropped silently. Give them a grad_fn that raises instead, as the
            # custom op (and the reference backend) does.
            dq, dk, dv = _FirstOrderOnly.apply(*(g.detach().requires_grad_() for g in (dq, dk, dv)))
        return dq, dk, dv, None


class _FirstOrderOnly(torch.autograd.Function):
    """Passes the eager backward's gradients through; differentiating them raises."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "hyperrec.jagged_attn: the attention backward is not differentiable "
            "(first-order gradients only: no double backward)"
        )


# FLOP counts for torch.utils.flop_counter. The counter sees shapes, not the offsets'
# values, so the count is the upper bound sum(Lq * Lk) <= min(Tq * max_kv, Tk * max_q)
# (exact for equal-length sequences); bench/ uses hyperrec.jagged_attn._triton.flops with
# the real lengths instead.
def _spec_flops(q_shape, k_shape, v_shape, args, pass_: str) -> int:
    max_q, max_kv = AttentionCall.max_lengths(args)
    return int(flops_upper_bound(q_shape[0], k_shape[0], max_q, max_kv, q_shape[1],
                                 q_shape[2], v_shape[2], pass_=pass_))  # fmt: skip


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_triton_fwd)
def _fwd_flop_formula(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _spec_flops(q_shape, k_shape, v_shape, args, "fwd")


@register_flop_formula(torch.ops.hyperrec_jagged_attn.attention_triton_bwd)
def _bwd_flop_formula(grad_shape, out_shape_, lse_shape, q_shape, k_shape, v_shape, *args,
                      out_shape=None, **kwargs) -> int:  # fmt: skip
    return _spec_flops(q_shape, k_shape, v_shape, args, "bwd")
