"""The public functions: validate, build the spec, dispatch to a backend.

Tensors use the jagged layout of flash-attn's varlen API: all sequences concatenated along
dim 0, ``(total_tokens, heads, head_dim)``, plus ``offsets`` of length ``B + 1`` with
sequence ``b`` at rows ``offsets[b]:offsets[b+1]``. Zero-length sequences are valid (their
queries produce nothing, their empty key sets give zero outputs), and so is ``B = 0``
(``offsets == [0]``): a rank can receive an empty batch and still take part in training.
"""

from __future__ import annotations

import math

import torch

from hyperrec.jagged_attn._dispatch import BACKENDS, Backend, resolve_backend
from hyperrec.jagged_attn._opschema import AttentionCall, make_spec
from hyperrec.jagged_attn._triton.ops import attention_triton, attention_triton_call
from hyperrec.jagged_attn._validate import (
    Names,
    Validate,
    check_bool,
    check_choice,
    check_float,
    check_index_tensor,
    check_int,
    check_qkv,
    check_validate,
    run_value_checks,
    set_pending_check,
    value_check_mode,
)
from hyperrec.jagged_attn.activations import ACTIVATIONS
from hyperrec.jagged_attn.fp8 import FP8Config, Precision, QuantizedQKV
from hyperrec.jagged_attn.spec import NORMALIZATIONS, AttentionSpec

__all__ = ["block_attention", "gdpa", "jagged_attention"]


def _window(window_size: object) -> tuple[int, int]:
    if not isinstance(window_size, tuple | list) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = window_size
    check_int("window_size[0]", left, minimum=-1)
    check_int("window_size[1]", right, minimum=-1)
    return left, right


def _scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return float(check_float("scale", scale))


def _dispatch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    spec: AttentionSpec,
    backend: str,
    validate: Validate,
    names: Names,
    precision: Precision | FP8Config = "bf16",
    quantized: QuantizedQKV | None = None,
) -> torch.Tensor:
    check_choice("backend", backend, BACKENDS)
    # The Triton kernels (attention, schedules, the device value check) index the offsets,
    # kv_index and num_targets as dense arrays: a strided view (e.g. ``offsets[::2]``) would
    # be read as the wrong values. contiguous() returns a contiguous tensor itself, so the
    # per-object caches keep working; one offsets object for queries and keys stays one.
    same = kv_offsets is q_offsets
    q_offsets = q_offsets.contiguous()
    kv_offsets = q_offsets if same else kv_offsets.contiguous()
    kv_index = None if kv_index is None else kv_index.contiguous()
    num_targets = None if num_targets is None else num_targets.contiguous()
    mode = value_check_mode(check_validate(validate), q.device)
    op = resolve_backend(backend, q, v, precision=precision)
    if quantized is not None:
        from hyperrec.jagged_attn._fp8.ops import bind_quantized

        op = bind_quantized(op, quantized, precision, q, k, v, kv_offsets, spec)
    # The Triton forward takes the device check over (one launch fewer: it runs inside the
    # tile-schedule kernel of a new offsets object, else before the attention kernel).
    check = run_value_checks(
        mode,
        q,
        k,
        q_offsets,
        kv_offsets,
        spec.max_seqlen_q,
        spec.max_seqlen_kv,
        kv_index=kv_index,
        num_targets=num_targets,
        names=names,
        defer=op is attention_triton,
    )
    call = AttentionCall(q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=kv_offsets,
                         kv_index=kv_index, num_targets=num_targets, spec=spec)  # fmt: skip
    if op is not attention_triton:
        return op(*call.op_args())
    if check is None:
        return attention_triton_call(call)
    outer = set_pending_check(check)
    try:
        out = attention_triton_call(call)
    finally:
        left = set_pending_check(outer)
    if left is not None:  # a path that launched no attention kernel: check all the same
        left.run()
    return out


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen: int,
    *,
    kv_offsets: torch.Tensor | None = None,
    max_seqlen_kv: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    backend: Backend = "auto",
    validate: Validate = True,
    precision: Precision | FP8Config = "bf16",
    quantized: QuantizedQKV | None = None,
) -> torch.Tensor:
    """Softmax attention over jagged sequences, without padding.

    ``o_i = sum_j softmax_j(scale * <q_i, k_j>) v_j`` over the keys of query ``i``'s own
    sequence that the mask allows.

    Args:
        q: ``(Tq, H, D)`` float16/bfloat16/float32/float64, all query sequences concatenated.
        k: ``(Tk, H, D)``, same dtype and device. ``Tk == Tq`` without ``kv_offsets``.
        v: ``(Tk, H, Dv)``; ``Dv`` may differ from ``D``.
        offsets: ``(B + 1,)`` int32/int64, non-decreasing, ``offsets[0] == 0``,
            ``offsets[-1] == Tq``: query sequence ``b`` is ``q[offsets[b]:offsets[b+1]]``.
            Also the key offsets unless ``kv_offsets`` is given.
        max_seqlen: int >= the longest query sequence (flash-attn's ``max_seqlen_q``).
        kv_offsets: ``(B + 1,)`` key/value offsets for key lengths that differ from the
            query lengths (sequence ``b`` of queries attends to sequence ``b`` of keys).
        max_seqlen_kv: int >= the longest key sequence; required with ``kv_offsets``.
        causal: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees keys
            ``j <= i + Lk - Lq`` (bottom-right alignment, as flash-attn >= 2.1). With
            ``Lq > Lk`` the first ``Lq - Lk`` queries see no key and output zeros.
        scale: score multiplier; default ``1 / sqrt(D)``.
        window_size: ``(left, right)``: keys within ``left`` positions before and
            ``right`` after the query's aligned position; -1 = unbounded (flash-attn's
            convention).
        backend: ``"auto"`` (the Triton kernels for supported CUDA inputs, else the
            reference), ``"torch"`` (the reference) or ``"triton"`` (the kernels; bf16/fp16,
            head dims 16-256).
        validate: how to check the values of the offsets and ``max_seqlen`` (shapes,
            dtypes and devices are always checked). ``True`` (default): on CPU tensors a
            ValueError; on CUDA a device-side check with no host sync, whose failure is an
            asynchronous device-side assert. ``"full"``: a ValueError on any device (one
            host sync per call). ``False``: no value checks (invalid offsets then give
            undefined results). Skipped while ``torch.compile`` traces.
        precision: ``"bf16"`` (default: the inputs' own precision), ``"fp8"`` or
            ``"mxfp8"`` (an FP8 forward: Q/K/V block-quantized to E4M3, P quantized
            online, float32 accumulation; the backward stays bf16), or an
            :class:`~hyperrec.jagged_attn.fp8.FP8Config`. See :mod:`hyperrec.jagged_attn.fp8`.
        quantized: Q/K/V already quantized with this ``precision`` (by
            :func:`~hyperrec.jagged_attn.fp8.linear_quantize_qkv`, the projection with the
            quantization in its epilogue, or :func:`~hyperrec.jagged_attn.fp8.quantize_qkv`;
            softmax only with ``FP8Config(smooth_k=False)``): the FP8 kernels read them instead of
            quantizing ``q``/``k``/``v`` again. They must be the quantization of these
            ``q``/``k``/``v`` (not checked value by value: the backward differentiates
            ``q``/``k``/``v``, and the ``"torch"`` emulation re-quantizes them). Default
            None.

    Returns:
        ``(Tq, H, Dv)`` in ``q.dtype``. A query with no visible key (empty key sequence,
        or masked out) gets zeros, never NaN. Differentiable in ``q``, ``k``, ``v``.

    Raises:
        TypeError: a non-tensor, unsupported or mismatched dtype, non-int arguments, a
            ``validate`` that is neither a bool nor a str.
        ValueError: wrong ranks/shapes, mismatched heads or head dims, a bad
            ``window_size``, ``backend`` or ``validate``; bad offsets or a ``max_seqlen``
            below the longest sequence (CPU tensors, or ``validate="full"``; on CUDA the
            default check is a device-side assert instead).
        ValueError: also ``backend="triton"`` for inputs the kernels do not support.
        TypeError, ValueError: a ``precision`` that is not a known name or an
            ``FP8Config``, an FP8 config that does not fit the head dims (MX: q/k head
            dim not a multiple of 32; ``hadamard=True``: not a power of two), or
            ``backend="triton"`` with FP8 and head dims outside [16, 256].
        ModuleNotFoundError: ``precision="mxfp8"`` without hyperrec-mxfp8 installed.
        TypeError, ValueError: a ``quantized`` that is not a ``QuantizedQKV``, was made
            with another config, does not match the shapes or device of ``q``/``k``/``v``,
            or softmax with ``smooth_k`` (its key shift is not in operands quantized by a
            projection: pass ``FP8Config(smooth_k=False)``).
    """
    check_qkv(q, k, v)
    offsets = check_index_tensor("offsets", offsets, q.device, what="(B + 1 offsets)")
    check_int("max_seqlen", max_seqlen, minimum=0)
    if kv_offsets is None:
        if max_seqlen_kv is not None:
            raise ValueError("max_seqlen_kv is only meaningful together with kv_offsets")
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"without kv_offsets, k.shape[0] must equal q.shape[0] = {q.shape[0]}, "
                f"got {k.shape[0]}"
            )
        kv_offsets, max_seqlen_kv = offsets, max_seqlen
        names = Names(
            q_offsets="offsets",
            kv_offsets="offsets",
            max_seqlen_q="max_seqlen",
            max_seqlen_kv="max_seqlen",
        )
    else:
        kv_offsets = check_index_tensor(
            "kv_offsets", kv_offsets, q.device, length=offsets.numel(), what="(like offsets)"
        )
        if max_seqlen_kv is None:
            raise ValueError("max_seqlen_kv is required when kv_offsets is given")
        check_int("max_seqlen_kv", max_seqlen_kv, minimum=0)
        names = Names(q_offsets="offsets", max_seqlen_q="max_seqlen")
    check_bool("causal", causal)
    left, right = _window(window_size)
    spec = make_spec(
        activation="softmax",
        scale=_scale(scale, q.shape[2]),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen_kv,
        causal=causal,
        window_left=left,
        window_right=right,
    )
    return _dispatch(
        q,
        k,
        v,
        offsets,
        kv_offsets,
        kv_index=None,
        num_targets=None,
        spec=spec,
        backend=backend,
        validate=validate,
        names=names,
        precision=precision,
        quantized=quantized,
    )


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    activation: str = "silu",
    scale: float | None = None,
    output_scale: float = 1.0,
    normalization: str = "none",
    kv_index: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    backend: Backend = "auto",
    validate: Validate = True,
    precision: Precision | FP8Config = "bf16",
    quantized: QuantizedQKV | None = None,
) -> torch.Tensor:
    """Generalized Dot-Product Attention: an activation in place of the softmax.

    For query sequence ``b``, its kv sequence ``m = kv_index[b]`` (default ``m = b``)
    of length ``Lk``, query ``i`` and visible key ``j``::

        o_i = output_scale * norm * sum_j act(scale * <q_i, k_j>) v_j

    ``norm`` is 1 (``"none"``), ``1 / max_seqlen_kv`` (``"max_seqlen"``, HSTU's 1/N) or
    ``1 / Lk`` (``"length"``). With ``activation="softmax"`` the weights are the softmax
    over the visible keys instead. Examples: HSTU is ``activation="silu",
    scale=alpha, normalization="max_seqlen", causal=True``; Meta's GDPA kernels are
    ``scale=1.0, output_scale=qk_scale``.

    Args:
        q: ``(Tq, H, D)`` float16/bfloat16/float32/float64, query sequences concatenated.
        k: ``(Tk, H, D)``; v: ``(Tk, H, Dv)``, same dtype and device.
        q_offsets: ``(Bq + 1,)`` int32/int64 query offsets (0 first, ``Tq`` last,
            non-decreasing).
        kv_offsets: ``(Bk + 1,)`` int32/int64 key/value offsets. ``Bk == Bq`` unless
            ``kv_index`` is given.
        max_seqlen_q, max_seqlen_kv: ints >= the longest query / key sequence.
        activation: one of ``softmax, silu, gelu, gelu_tanh, gelu_poly, relu, sigmoid,
            identity``. ``gelu_poly`` is the ALU-only GELU of
            :func:`~hyperrec.jagged_attn.activations.gelu_poly` (max error 1e-4).
        scale: multiplies the scores before the activation; default ``1 / sqrt(D)``.
        output_scale: multiplies the output (after the activation); default 1.
        normalization: ``"none"`` (default), ``"max_seqlen"`` or ``"length"``.
        kv_index: ``(Bq,)`` int32/int64 in ``[0, Bk)``: the kv sequence each query
            sequence attends to; several query sequences may share one (candidates
            attending to one user history). For PMA pooling, give every sequence a copy of
            the learned queries (``q_offsets = arange(B + 1) * num_queries``).
        causal: key ``j`` visible to query ``i`` iff ``j <= i + Lk - Lq`` (bottom-right).
        window_size: ``(left, right)`` around the query's aligned position; -1 = unbounded.
        num_targets: ``(Bq,)`` int32/int64, HSTU targets: the last ``num_targets[b]`` keys
            of the pair are targets, visible only to the query at the same position;
            target queries act as if at the first target position, so they see the
            history (subject to causal/window) and themselves, never each other.
        contextual_len: the first ``contextual_len`` positions are global: every query
            sees them and they see every non-target key, whatever causal/window say.
        backend: ``"auto"`` (the Triton kernels for supported CUDA inputs, else the
            reference), ``"torch"`` (the reference) or ``"triton"`` (the kernels).
        validate: how to check the values of the offsets, maxima, ``kv_index`` and
            ``num_targets``: as in :func:`jagged_attention` (``True``: ValueError on CPU,
            a sync-free device-side assert on CUDA; ``"full"``: ValueError everywhere, one
            host sync; ``False``: none).
        precision: ``"bf16"`` (default: the inputs' own precision), ``"fp8"`` or
            ``"mxfp8"`` (an FP8 forward: Q/K/V block-quantized to E4M3, P quantized
            online, float32 accumulation; the backward stays bf16), or an
            :class:`~hyperrec.jagged_attn.fp8.FP8Config`. See :mod:`hyperrec.jagged_attn.fp8`.
        quantized: Q/K/V quantized beforehand, as in :func:`jagged_attention` (GDPA never
            smooths its keys, so any FP8 config). Default None.

    The mask composition is given in :mod:`hyperrec.jagged_attn.masks`. It equals HSTU's
    for causal masks with targets and contextual tokens; unlike HSTU, contextual keys stay
    visible under a window, and without ``causal`` history keys never see targets.

    Returns:
        ``(Tq, H, Dv)`` in ``q.dtype``; queries with no visible key output zeros.
        Differentiable in ``q``, ``k`` and ``v`` (first order).

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, non-int/float/str
            arguments.
        ValueError: shapes, heads or head dims that do not match; an unknown
            activation, normalization, backend or validate mode; bad offsets, a max length
            below the longest sequence, ``kv_index`` out of range, ``num_targets`` negative
            or longer than its kv sequence (CPU tensors or ``validate="full"``; on CUDA
            the default check is a device-side assert instead).
        ValueError: also ``backend="triton"`` for inputs the kernels do not support.
        TypeError, ValueError: a ``precision`` that is not a known name or an
            ``FP8Config``, an FP8 config that does not fit the head dims (MX: q/k head
            dim not a multiple of 32; ``hadamard=True``: not a power of two), or
            ``backend="triton"`` with FP8 and head dims outside [16, 256].
        ModuleNotFoundError: ``precision="mxfp8"`` without hyperrec-mxfp8 installed.
        TypeError, ValueError: a ``quantized`` that is not a ``QuantizedQKV``, was made
            with another config, does not match the shapes or device of ``q``/``k``/``v``,
            or softmax with ``smooth_k`` (its key shift is not in operands quantized by a
            projection: pass ``FP8Config(smooth_k=False)``).
    """
    check_qkv(q, k, v)
    q_offsets = check_index_tensor("q_offsets", q_offsets, q.device, what="(Bq + 1 offsets)")
    num_q = q_offsets.numel() - 1
    if kv_index is None:
        kv_offsets = check_index_tensor(
            "kv_offsets",
            kv_offsets,
            q.device,
            length=num_q + 1,
            what="(like q_offsets, as kv_index is not given)",
        )
    else:
        kv_offsets = check_index_tensor("kv_offsets", kv_offsets, q.device, what="(Bk + 1 offsets)")
        kv_index = check_index_tensor(
            "kv_index",
            kv_index,
            q.device,
            length=num_q,
            what="(one kv sequence per query sequence)",
        )
    if num_targets is not None:
        num_targets = check_index_tensor(
            "num_targets", num_targets, q.device, length=num_q, what="(one per query sequence)"
        )
    check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    check_int("max_seqlen_kv", max_seqlen_kv, minimum=0)
    check_choice("activation", activation, ACTIVATIONS)
    check_choice("normalization", normalization, NORMALIZATIONS)
    check_float("output_scale", output_scale)
    check_bool("causal", causal)
    check_int("contextual_len", contextual_len, minimum=0)
    left, right = _window(window_size)
    spec = make_spec(
        activation=activation,
        scale=_scale(scale, q.shape[2]),
        output_scale=float(output_scale),
        normalization=normalization,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        causal=causal,
        window_left=left,
        window_right=right,
        contextual_len=contextual_len,
    )
    return _dispatch(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        kv_index=kv_index,
        num_targets=num_targets,
        spec=spec,
        backend=backend,
        validate=validate,
        names=Names(),
        precision=precision,
        quantized=quantized,
    )


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen: int,
    *,
    block_size: int = 64,
    previous_block: bool = False,
    num_global: int = 0,
    causal: bool = False,
    scale: float | None = None,
    backend: Backend = "auto",
    validate: Validate = True,
    precision: Precision | FP8Config = "bf16",
    quantized: QuantizedQKV | None = None,
) -> torch.Tensor:
    """Softmax self-attention within fixed-size blocks of each sequence: O(L) work.

    Each sequence is cut into blocks of ``block_size`` tokens from its first token (the
    last block may be shorter); a query sees the keys of its own block, optionally of the
    previous block, and the sequence's first ``num_global`` tokens (summary tokens that
    the caller places at the start of each sequence; they in turn see their whole
    sequence). Work per sequence of length ``L`` is about
    ``L * (block_size * (1 + previous_block) + num_global) + num_global * L``.

    Args:
        q, k: ``(T, H, D)`` float16/bfloat16/float32/float64; v: ``(T, H, Dv)``; one
            sequence layout for all three (self-attention).
        offsets: ``(B + 1,)`` int32/int64, non-decreasing, 0 first, ``T`` last.
        max_seqlen: int >= the longest sequence.
        block_size: tokens per block, >= 1 (default 64, as Meta's BlockAttention).
        previous_block: also attend to the previous block.
        num_global: number of leading global tokens per sequence (default 0).
        causal: additionally restrict to keys at or before the query.
        scale: default ``1 / sqrt(D)``.
        backend, validate, precision, quantized: as in :func:`jagged_attention`.

    Returns:
        ``(T, H, Dv)`` in ``q.dtype``, differentiable in ``q``, ``k``, ``v``.

    Raises:
        TypeError, ValueError: as in :func:`jagged_attention`, plus
            ``block_size < 1`` or ``num_global < 0``.
        ModuleNotFoundError: as in :func:`jagged_attention`.
        TypeError, ValueError: a bad ``quantized``, as in :func:`jagged_attention`.
    """
    check_qkv(q, k, v)
    offsets = check_index_tensor("offsets", offsets, q.device, what="(B + 1 offsets)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_attention is self-attention: k.shape[0] must equal q.shape[0] = "
            f"{q.shape[0]}, got {k.shape[0]}"
        )
    check_int("max_seqlen", max_seqlen, minimum=0)
    check_int("block_size", block_size, minimum=1)
    check_bool("previous_block", previous_block)
    check_int("num_global", num_global, minimum=0)
    check_bool("causal", causal)
    spec = make_spec(
        activation="softmax",
        scale=_scale(scale, q.shape[2]),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        causal=causal,
        contextual_len=num_global,
        block_size=block_size,
        block_previous=previous_block,
    )
    names = Names(
        q_offsets="offsets",
        kv_offsets="offsets",
        max_seqlen_q="max_seqlen",
        max_seqlen_kv="max_seqlen",
    )
    return _dispatch(
        q,
        k,
        v,
        offsets,
        offsets,
        kv_index=None,
        num_targets=None,
        spec=spec,
        backend=backend,
        validate=validate,
        names=names,
        precision=precision,
        quantized=quantized,
    )
