"""The one argument list of every attention custom op, and how a spec crosses it.

Below the public functions a call is one frozen :class:`AttentionCall`: the jagged tensors
and the :class:`~hyperrec.jagged_attn.spec.AttentionSpec`. A ``torch.library`` op takes
only tensors, scalars and strings, so at the op boundary the call becomes

    (q, k, v, q_offsets, kv_offsets, kv_index, num_targets,    the tensors
     spec, scale, output_scale, max_seqlen_q, max_seqlen_kv)    the spec

where ``spec`` is the canonical string of the spec's static fields (activation,
normalisation, mask: a compile-time constant to ``torch.compile``) and the scalars stay
real ``float``/``SymInt`` arguments, so ``torch.compile(dynamic=True)`` keeps the default
scale ``1 / sqrt(head_dim)`` and the maxima symbolic (one compile for any batch).
:func:`schema` spells the list once for every op; :meth:`AttentionCall.op_args` and
:meth:`AttentionCall.from_op_args` are the only code that knows its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch

from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = ["NAMESPACE", "AttentionCall", "activation_of", "make_spec", "schema", "spec_op_args"]

#: The ``torch.library`` namespace of every op of this package.
NAMESPACE = "hyperrec_jagged_attn"

# The tensors of a call, in op order; the last two are optional.
_TENSOR_NAMES = ("q", "k", "v", "q_offsets", "kv_offsets", "kv_index", "num_targets")
_TENSORS = ", ".join(
    f"Tensor{'?' if n in ('kv_index', 'num_targets') else ''} {n}" for n in _TENSOR_NAMES
)
_SPEC = "str spec, float scale, float output_scale, SymInt max_seqlen_q, SymInt max_seqlen_kv"
_N_TENSORS = len(_TENSOR_NAMES)
_N_SPEC = 5

# The static fields in the canonical string, in order: AttentionSpec's, then MaskSpec's.
_STATIC = ("activation", "normalization")
_MASK = tuple(f.name for f in fields(MaskSpec))
_MASK_BOOLS = frozenset(f.name for f in fields(MaskSpec) if f.type in ("bool", bool))


def schema(*, before: str = "", returns: str = "Tensor") -> str:
    """The op schema: ``before`` (extra leading tensors, e.g. ``"Tensor grad_out, "``),
    the call's tensors, the spec, ``-> returns``."""
    return f"({before}{_TENSORS}, {_SPEC}) -> {returns}"


# Per-call host work matters: a call whose kernels take 50 us must not spend as long in
# Python. Encoding, decoding and building specs are memoised on their plain-value fields
# (never on symbolic values, which torch.compile may pass); the caches are small and reset
# when full.
_CACHE_LIMIT = 256
_Key = tuple[object, ...]  # plain values (and their types)
_ENCODED: dict[_Key, str] = {}
_DECODED: dict[_Key, AttentionSpec] = {}
_SPECS: dict[_Key, AttentionSpec] = {}
_PLAIN = (bool, int, float, str)
_V = TypeVar("_V")


def _remember(cache: dict[_Key, _V], key: _Key, value: _V) -> _V:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _plain(values: tuple[object, ...]) -> bool:
    # Plain Python values only, and never while Dynamo traces (a dynamic int looks like an
    # int there, and a dict lookup would specialise the graph on it); float zeros are left
    # out too (0.0 == -0.0 would share an entry, and the sign of a zero output_scale
    # reaches the output's zeros).
    if torch.compiler.is_compiling():
        return False
    for v in values:
        t = type(v)
        if t not in _PLAIN or (t is float and v == 0.0):
            return False
    return True


def _encode(spec: AttentionSpec) -> str:
    mask = spec.mask
    values = (spec.activation, spec.normalization) + tuple(getattr(mask, n) for n in _MASK)
    plain = _plain(values)  # a symbolic value (torch.compile) is not hashable
    hit = _ENCODED.get(values) if plain else None
    if hit is not None:
        return hit
    # int(): a mask field that torch.compile made symbolic is specialised here on purpose
    # (masks select kernel variants).
    text = ";".join(
        f"{n}={int(v) if isinstance(v, bool | int) else v}" for n, v in zip(_STATIC + _MASK, values)
    )
    return _remember(_ENCODED, values, text) if plain else text


def make_spec(
    *,
    activation: str,
    scale: Any,
    output_scale: Any = 1.0,
    normalization: str = "none",
    max_seqlen_q: Any,
    max_seqlen_kv: Any,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    contextual_len: int = 0,
    block_size: int = 0,
    block_previous: bool = False,
) -> AttentionSpec:
    """``AttentionSpec(..., mask=MaskSpec(...))``, memoised on plain values (the public
    functions build one per call; building and validating two frozen dataclasses costs
    more than the rest of the call's Python).

    Raises:
        TypeError, ValueError: as :class:`AttentionSpec` and :class:`MaskSpec`.
    """
    values = (activation, scale, output_scale, normalization, max_seqlen_q, max_seqlen_kv, causal,
              window_left, window_right, contextual_len, block_size, block_previous)  # fmt: skip
    plain = _plain(values)  # a symbolic value (torch.compile) is not hashable
    # type() in the key: True == 1 == 1.0 must not share an entry
    key = values + tuple(type(v) for v in values) if plain else ()
    hit = _SPECS.get(key) if plain else None
    if hit is not None:
        return hit
    spec = AttentionSpec(
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
        ),  # fmt: skip
    )
    return _remember(_SPECS, key, spec) if plain else spec


def _decode(text: str) -> tuple[dict[str, str], dict[str, Any]]:
    pairs = dict(item.split("=", 1) for item in text.split(";"))
    if tuple(pairs) != _STATIC + _MASK:
        raise ValueError(f"not an encoded attention spec: {text!r}")
    static = {n: pairs[n] for n in _STATIC}
    mask: dict[str, Any] = {n: int(pairs[n]) for n in _MASK}
    mask.update({n: bool(mask[n]) for n in _MASK_BOOLS})
    return static, mask


def spec_op_args(spec: AttentionSpec) -> tuple[Any, ...]:
    """The op arguments that carry ``spec`` (what follows the tensors)."""
    # float() on plain numbers only: a symbolic float (torch.compile) passes as it is.
    scale = float(spec.scale) if type(spec.scale) is int else spec.scale
    out_scale = float(spec.output_scale) if type(spec.output_scale) is int else spec.output_scale
    return (_encode(spec), scale, out_scale, spec.max_seqlen_q, spec.max_seqlen_kv)


def activation_of(text: str) -> str:
    """The activation named by an encoded spec (fake kernels need it for output shapes)."""
    return _decode(text)[0]["activation"]


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One attention call below the public API: the jagged tensors and the spec."""

    q: torch.Tensor
    """``(Tq, H, D)``."""
    k: torch.Tensor
    """``(Tk, H, D)``."""
    v: torch.Tensor
    """``(Tk, H, Dv)``."""
    q_offsets: torch.Tensor
    """``(Bq + 1,)`` int32/int64."""
    kv_offsets: torch.Tensor
    """``(Bk + 1,)`` int32/int64."""
    kv_index: torch.Tensor | None
    """``(Bq,)``: the kv sequence of each query sequence, or None (``Bk == Bq``)."""
    num_targets: torch.Tensor | None
    """``(Bq,)`` HSTU targets per query sequence, or None."""
    spec: AttentionSpec
    """Everything else."""

    def op_args(self) -> tuple[Any, ...]:
        """The positional arguments of an op with :func:`schema`'s list."""
        return (*self.tensors, *spec_op_args(self.spec))

    @classmethod
    def from_op_args(cls, args: Sequence[Any]) -> AttentionCall:
        """The inverse of :meth:`op_args`."""
        if len(args) != _N_TENSORS + _N_SPEC:
            raise TypeError(f"expected {_N_TENSORS + _N_SPEC} op arguments, got {len(args)}")
        spec_args = tuple(args[_N_TENSORS:])
        plain = _plain(spec_args)  # a symbolic value (torch.compile) is not hashable
        key = spec_args + tuple(type(a) for a in spec_args) if plain else ()
        spec = _DECODED.get(key) if plain else None
        if spec is None:
            text, scale, output_scale, max_q, max_kv = spec_args
            static, mask = _decode(text)
            spec = AttentionSpec(
                scale=scale,
                output_scale=output_scale,
                max_seqlen_q=max_q,
                max_seqlen_kv=max_kv,
                mask=MaskSpec(**mask),
                **static,
            )
            if plain:
                _remember(_DECODED, key, spec)
        q, k, v, q_offsets, kv_offsets, kv_index, num_targets = args[:_N_TENSORS]
        return cls(q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=kv_offsets,
                   kv_index=kv_index, num_targets=num_targets, spec=spec)  # fmt: skip

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor arguments, in op order (what autograd saves)."""
        return tuple(getattr(self, n) for n in _TENSOR_NAMES)

    def with_tensors(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionCall:
        """A copy with ``q``, ``k``, ``v`` replaced (e.g. made contiguous); ``self`` if each
        is already the call's own."""
        if q is self.q and k is self.k and v is self.v:
            return self
        return replace(self, q=q, k=k, v=v)

    @staticmethod
    def split_op_args(args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``(tensors, spec arguments)`` of an op's positional arguments."""
        return tuple(args[:_N_TENSORS]), tuple(args[_N_TENSORS:])

    @staticmethod
    def max_lengths(args: Sequence[Any]) -> tuple[int, int]:
        """``(max_seqlen_q, max_seqlen_kv)`` from the tail of an op's arguments (for FLOP
        formulas, which see shapes in place of tensors)."""
        return args[-2], args[-1]
