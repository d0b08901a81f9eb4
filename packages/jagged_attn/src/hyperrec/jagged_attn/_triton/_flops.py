"""Useful-FLOP counts of jagged attention (what a benchmark divides by time).

Only the work of allowed (query, key) pairs counts: two GEMMs of ``2 * D`` FLOPs per pair in
the forward (``S = Q K^T`` and ``O = P V``), i.e. ``4 * sum(Lq * Lk) * H * D`` without a
mask. The backward is counted as 2.5x the forward (five GEMMs instead of two), the usual
convention of FlashAttention benchmarks; recomputation is not counted as useful.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["flops", "flops_upper_bound"]


def _allowed_pairs(lq: int, lk: int, causal: bool, bottom_right: bool) -> int:
    if not causal:
        return lq * lk
    diag = lk - lq if bottom_right else 0
    total = 0
    # row i sees keys 0 .. min(i + diag, lk - 1)
    for i in range(lq):
        total += max(0, min(i + diag + 1, lk))
    return total


def flops(
    q_lengths: Sequence[int],
    kv_lengths: Sequence[int],
    n_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    seq_map: Sequence[int] | None = None,
    pass_: str = "fwd",
) -> float:
    """Useful FLOPs of one call, from host-side lengths.

    Args:
        q_lengths: query length of each sequence.
        kv_lengths: key length of each kv sequence (indexed through ``seq_map`` if given).
        n_heads, head_dim, head_dim_v: shapes (``head_dim_v`` defaults to ``head_dim``).
        causal, bottom_right: the causal mask and its alignment (only allowed pairs count).
        seq_map: query sequence -> kv sequence (identity if None).
        pass_: ``"fwd"``, ``"bwd"`` (2.5x fwd) or ``"fwd_bwd"`` (3.5x fwd).
    """
    if pass_ not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"pass_ must be 'fwd', 'bwd' or 'fwd_bwd', got {pass_!r}")
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = 0
    for b, lq in enumerate(q_lengths):
        lk = kv_lengths[b if seq_map is None else seq_map[b]]
        if causal and not bottom_right and lq == lk:
            pairs += lq * (lq + 1) // 2
        else:
            pairs += _allowed_pairs(int(lq), int(lk), causal, bottom_right)
    fwd = 2.0 * pairs * n_heads * (head_dim + dv)
    return {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_] * fwd


def flops_upper_bound(
    total_q: int,
    total_kv: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    n_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    pass_: str = "fwd",
) -> float:
    """An upper bound from shapes alone (``sum Lq*Lk <= min(Tq*max_kv, Tk*max_q)`` for a
    one-to-one map), for FLOP counters that see only shapes (``torch.utils.flop_counter``).
    """
    if pass_ not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"pass_ must be 'fwd', 'bwd' or 'fwd_bwd', got {pass_!r}")
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = min(total_q * max_seqlen_kv, total_kv * max_seqlen_q)
    fwd = 2.0 * pairs * n_heads * (head_dim + dv)
    return {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_] * fwd
