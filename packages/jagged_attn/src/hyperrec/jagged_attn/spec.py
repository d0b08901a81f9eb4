"""``AttentionSpec``: everything that defines one attention call apart from the tensors.

For query sequence ``b`` with kv sequence ``m = kv_index[b]`` (``m = b`` without a map),
query ``i`` and key ``j`` of that pair::

    s_ij = scale * <q_i, k_j>                                  (float32 or float64)
    w_ij = softmax_j(s_ij over allowed j)    if activation == "softmax"
         = act(s_ij) if allowed(i, j) else 0  otherwise
    o_i  = output_scale * norm_b * sum_j w_ij v_j

with ``norm_b`` = 1 (``"none"``), ``1 / max_seqlen_kv`` (``"max_seqlen"``, HSTU's 1/N) or
``1 / Lk_m`` (``"length"``). A query with no allowed key gets ``o_i = 0``, softmax
included (never NaN). ``allowed`` is :func:`hyperrec.jagged_attn.masks.allowed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperrec.jagged_attn._validate import check_choice, check_float, check_int
from hyperrec.jagged_attn.activations import ACTIVATIONS
from hyperrec.jagged_attn.masks import MaskSpec

__all__ = ["NORMALIZATIONS", "AttentionSpec"]

#: Names accepted by ``normalization=``.
NORMALIZATIONS: tuple[str, ...] = ("none", "max_seqlen", "length")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """The non-tensor arguments of one attention call; see the module doc for the math.

    Raises:
        TypeError: a field of the wrong type (``mask`` not a :class:`MaskSpec`, a scale not
            a real number, a maximum not an int, a choice not a str).
        ValueError: a non-finite scale, a negative maximum, or an unknown ``activation`` /
            ``normalization``.
    """

    scale: float
    """Multiplies the scores ``<q_i, k_j>`` before the activation (HSTU's ``alpha``; the
    public functions default it to ``1 / sqrt(head_dim)``)."""

    max_seqlen_q: int
    """Upper bound on every query sequence's length."""

    max_seqlen_kv: int
    """Upper bound on every kv sequence's length; the divisor of ``"max_seqlen"``."""

    activation: str = "softmax"
    """One of :data:`~hyperrec.jagged_attn.activations.ACTIVATIONS`."""

    output_scale: float = 1.0
    """Multiplies the output (equivalently the weights after the activation): the
    ``qk_scale`` of Meta's GDPA kernels."""

    normalization: str = "none"
    """One of :data:`NORMALIZATIONS`: ``"none"``, ``"max_seqlen"`` (divide by
    ``max_seqlen_kv``) or ``"length"`` (divide by the kv sequence's length)."""

    mask: MaskSpec = field(default_factory=MaskSpec)
    """Which pairs may interact."""

    def __post_init__(self) -> None:
        check_float("scale", self.scale)
        check_float("output_scale", self.output_scale)
        check_int("max_seqlen_q", self.max_seqlen_q, minimum=0)
        check_int("max_seqlen_kv", self.max_seqlen_kv, minimum=0)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        if not isinstance(self.mask, MaskSpec):
            raise TypeError(f"mask must be a MaskSpec, got {type(self.mask).__name__}")
