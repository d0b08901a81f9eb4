"""Input validation for the public functions.

Shape, dtype and device checks cost nothing and always run. Checks on the *values* of
the offsets (order, first/last entry, the longest sequence against ``max_seqlen``, index
ranges) need the values on the host; they run in one batched device sync when
``validate=True`` and outside ``torch.compile`` tracing (a sync would break the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FLOAT_DTYPES", "Names", "check_index_tensor", "check_qkv", "check_values"]

#: Accepted dtypes of q, k and v.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Names:
    """How the caller spelled each argument, for error messages."""

    q_offsets: str = "q_offsets"
    kv_offsets: str = "kv_offsets"
    max_seqlen_q: str = "max_seqlen_q"
    max_seqlen_kv: str = "max_seqlen_kv"


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``q (Tq, H, D)``, ``k (Tk, H, D)``, ``v (Tk, H, Dv)``: one float dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        t = _tensor(name, t)
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    heads, dim = q.shape[1], q.shape[2]
    if heads < 1 or dim < 1:
        raise ValueError(f"q must have heads >= 1 and head_dim >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] != heads or v.shape[1] != heads:
        raise ValueError(
            f"q, k and v must have the same number of heads, got {heads}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if k.shape[2] != dim:
        raise ValueError(f"k head_dim must equal q head_dim {dim}, got {k.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(
            f"v.shape[0] must equal k.shape[0] (total key tokens) {k.shape[0]}, got {v.shape[0]}"
        )
    if v.shape[2] < 1:
        raise ValueError(f"v head_dim must be >= 1, got shape {tuple(v.shape)}")


def check_index_tensor(
    name: str, t: object, device: torch.device, *, length: int | None = None, what: str
) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``device``: ``length`` entries, or >= 1 if None."""
    t = _tensor(name, t)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D {what}, got shape {tuple(t.shape)}")
    if length is None and t.numel() < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries {what}, got none")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries {what}, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")
    return t


def _offsets_summary(offsets: torch.Tensor) -> list[torch.Tensor]:
    o = offsets.long()
    lengths = o[1:] - o[:-1]
    if lengths.numel() == 0:
        zero = o.new_zeros(())
        return [o[0], o[-1], zero, zero]
    return [o[0], o[-1], (lengths < 0).any().long(), lengths.max()]


def _check_offsets(name: str, values: list[int], total: int, total_name: str) -> None:
    first, last, unordered, _ = values
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if unordered:
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0)")
    if last != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {last}")


def check_values(
    q: torch.Tensor,
    k: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    names: Names,
) -> None:
    """The value checks (one device-to-host sync).

    Raises:
        ValueError: an offsets tensor does not start at 0, decreases, or does not end at
            its token count; a sequence is longer than its ``max_seqlen``; ``kv_index``
            points outside ``[0, Bk)``; ``num_targets`` is negative or exceeds the length
            of its kv sequence.
    """
    parts = _offsets_summary(q_offsets) + _offsets_summary(kv_offsets)
    k_len = (kv_offsets[1:] - kv_offsets[:-1]).long()
    num_kv = k_len.numel()
    if kv_index is not None:
        if kv_index.numel():
            parts += [kv_index.min().long(), kv_index.max().long()]
        else:
            parts += [q_offsets.new_zeros((), dtype=torch.long)] * 2
        if num_kv:
            k_len = k_len[kv_index.long().clamp(0, num_kv - 1)]
    if num_targets is not None:
        if num_targets.numel() and num_kv:
            parts += [num_targets.min().long(), (num_targets.long() > k_len).any().long()]
        else:
            parts += [q_offsets.new_zeros((), dtype=torch.long)] * 2
    values = torch.stack([p.to(q_offsets.device) for p in parts]).tolist()

    _check_offsets(names.q_offsets, values[0:4], q.shape[0], "q.shape[0] (total query tokens)")
    if names.kv_offsets != names.q_offsets:
        _check_offsets(names.kv_offsets, values[4:8], k.shape[0], "k.shape[0] (total key tokens)")
    if values[3] > max_seqlen_q:
        raise ValueError(
            f"{names.max_seqlen_q}={max_seqlen_q} is smaller than the longest query "
            f"sequence ({values[3]})"
        )
    if values[7] > max_seqlen_kv:
        raise ValueError(
            f"{names.max_seqlen_kv}={max_seqlen_kv} is smaller than the longest key "
            f"sequence ({values[7]})"
        )
    rest = values[8:]
    if kv_index is not None:
        lo, hi = rest[:2]
        rest = rest[2:]
        if kv_index.numel() and (lo < 0 or hi >= num_kv):
            raise ValueError(
                f"kv_index entries must lie in [0, {num_kv}) (the number of kv sequences), "
                f"got range [{lo}, {hi}]"
            )
    if num_targets is not None:
        lo, too_many = rest[:2]
        if lo < 0:
            raise ValueError(f"num_targets must be >= 0, got a minimum of {lo}")
        if too_many:
            raise ValueError("num_targets must not exceed the length of its kv sequence")
