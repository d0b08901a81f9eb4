"""The mask algebra: which key each query may attend to.

All rules are stated on the *key timeline* of one (query sequence, kv sequence) pair of
lengths ``Lq`` and ``Lk``. Query ``i`` sits at position ``p = i + (Lk - Lq)`` on that
timeline (bottom-right alignment, as in flash-attn >= 2.1: the last query lines up with
the last key; for self-attention ``p = i``). With ``n`` targets, ``t0 = Lk - n`` is the
first target position and target queries act as if they sat at ``t0``:
``e = min(p, t0)``. Then::

    base(i, j) = causal:   j <= e
               & window:   e - left <= j <= e + right        (-1 = unbounded side)
               & block:    j // bs == e // bs  (or e // bs - 1 with previous_block)
    ctx(i, j)  = j < c  or  0 <= p < c                       (c = contextual_len)

    allowed(i, j) = 0 <= i < Lq and 0 <= j < Lk and (
        (j < t0  and (base(i, j) or ctx(i, j)))              # history keys
        or (j >= t0 and j == p)                              # a target key: only itself
    )

A disabled rule is true. Contextual (global) tokens override causal, window and block:
every query sees the first ``c`` keys and the first ``c`` queries see every history key.
Target keys are visible to their own query only, so targets see the history and
themselves but not each other, and history never sees targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperrec.jagged_attn._validate import check_bool, check_int

__all__ = ["MaskSpec", "allowed", "mask_matrix"]


@dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """Which (query, key) pairs of one sequence pair may interact; see the module doc.

    Raises:
        TypeError: a field of the wrong type (``causal``/``block_previous`` not bools, the
            others not ints).
        ValueError: a window below -1, a negative ``contextual_len`` or ``block_size``, or
            ``block_previous=True`` without a ``block_size``.
    """

    causal: bool = False
    """Query at key-timeline position ``e`` sees keys ``j <= e`` only."""

    window_left: int = -1
    """Keys at most this many positions before ``e`` are visible; -1 = unbounded."""

    window_right: int = -1
    """Keys at most this many positions after ``e`` are visible; -1 = unbounded."""

    contextual_len: int = 0
    """The first ``contextual_len`` positions are global: seen by and seeing everything
    (target keys excepted). HSTU's ``contextual_seq_len``; block attention's summary
    tokens."""

    block_size: int = 0
    """If > 0, positions are cut into blocks of this size from the start of each
    sequence and queries see keys of their own block only."""

    block_previous: bool = False
    """With ``block_size > 0``, queries also see the previous block."""

    def __post_init__(self) -> None:
        check_bool("causal", self.causal)
        check_int("window_left", self.window_left, minimum=-1)
        check_int("window_right", self.window_right, minimum=-1)
        check_int("contextual_len", self.contextual_len, minimum=0)
        check_int("block_size", self.block_size, minimum=0)
        check_bool("block_previous", self.block_previous)
        if self.block_previous and self.block_size == 0:
            raise ValueError("block_previous=True needs block_size > 0")


_CAP = 1 << 62


def allowed(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_len: torch.Tensor,
    k_len: torch.Tensor,
    num_targets: torch.Tensor | None,
    spec: MaskSpec,
) -> torch.Tensor:
    """Evaluate the mask for broadcastable integer tensors of positions and lengths.

    Args:
        q_pos: query index ``i`` within its sequence (any integer dtype).
        k_pos: key index ``j`` within its sequence.
        q_len, k_len: ``Lq`` and ``Lk`` of the pair each element belongs to.
        num_targets: ``n`` per pair, or None for no targets.
        spec: the mask rules.

    Returns:
        A bool tensor of the broadcast shape: True where query ``i`` may attend to key
        ``j``. Out-of-range positions (padding) are False.
    """
    p = q_pos + (k_len - q_len)
    t0 = k_len if num_targets is None else k_len - num_targets
    e = torch.minimum(p, t0)
    in_range = (q_pos >= 0) & (q_pos < q_len) & (k_pos >= 0) & (k_pos < k_len)

    # MaskSpec takes any int: a window, block or prefix wider than 2**62 positions means
    # the same as 2**62 (longer than any sequence), and the cap keeps ``e + right`` inside
    # int64 (2**63 - 1 used to wrap around and hide every key).
    wl, wr, bs, c = (min(x, _CAP) for x in (spec.window_left, spec.window_right,
                                            spec.block_size, spec.contextual_len))  # fmt: skip
    base = torch.ones_like(in_range)
    if spec.causal:
        base = base & (k_pos <= e)
    if wl >= 0:
        base = base & (k_pos >= e - wl)
    if wr >= 0:
        base = base & (k_pos <= e + wr)
    if bs > 0:
        q_block = torch.div(e, bs, rounding_mode="floor")
        k_block = torch.div(k_pos, bs, rounding_mode="floor")
        same = k_block == q_block
        if spec.block_previous:
            same = same | (k_block == q_block - 1)
        base = base & same
    if c > 0:
        base = base | (k_pos < c) | ((p >= 0) & (p < c))

    history = k_pos < t0
    return in_range & ((history & base) | (~history & (k_pos == p)))


def mask_matrix(q_len: int, k_len: int, spec: MaskSpec, *, num_targets: int = 0) -> torch.Tensor:
    """The ``(q_len, k_len)`` bool mask of one sequence pair (for inspection and docs).

    Raises:
        TypeError: a length or ``num_targets`` that is not an int, or ``spec`` that is not
            a :class:`MaskSpec`.
        ValueError: a negative length, or ``num_targets`` outside ``[0, k_len]``.
    """
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"spec must be a MaskSpec, got {type(spec).__name__}")
    check_int("q_len", q_len, minimum=0)
    check_int("k_len", k_len, minimum=0)
    check_int("num_targets", num_targets, minimum=0)
    if num_targets > k_len:
        raise ValueError(f"num_targets={num_targets} exceeds k_len={k_len}")
    return allowed(
        torch.arange(q_len).view(-1, 1),
        torch.arange(k_len).view(1, -1),
        torch.tensor(q_len),
        torch.tensor(k_len),
        torch.tensor(num_targets),
        spec,
    )
