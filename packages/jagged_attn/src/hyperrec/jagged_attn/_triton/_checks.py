"""The default (``validate=True``) value checks of a CUDA call in one kernel launch.

``_validate.run_value_checks`` reduces every condition on the offsets, the maxima,
``kv_index`` and ``num_targets`` to one flag on the device and hands it to
``torch._assert_async`` (no host sync). Computed with PyTorch ops that is a dozen tiny
kernels and as many host dispatches per new offsets object, which on a slow host cost
more than a short attention call itself; here it is one single-program kernel that scans
the index tensors and writes the flag. The conditions are exactly those of the host
checks (``validate="full"``), which name the failing argument.

When the call also builds a forward tile schedule (the first call with a new offsets
object, the common case), the same scan runs inside the schedule kernel instead
(``_tiles.py``, ``values_bad``) and this launch is not made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperrec.jagged_attn._triton._direct import launch

__all__ = ["CHECK_BLOCK", "check_constexprs", "values_bad", "values_ok"]

# Indices per step of the scan (one program; 100,000 sequences take 25 steps).
_BLOCK = 4096
#: The check's scan width, for kernels that call :func:`values_bad`.
CHECK_BLOCK = _BLOCK


@triton.jit
def _scan_offsets(OFF, n, total, max_len, BLOCK: tl.constexpr):
    """1 where ``OFF`` (n + 1 entries) violates: first == 0, last == total,
    0 <= length <= max_len; else 0 (an int32 scalar)."""
    bad = ((tl.load(OFF) != 0) | (tl.load(OFF + n) != total)).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        i = start + offs
        m = i < n
        length = tl.load(OFF + i + 1, mask=m, other=0) - tl.load(OFF + i, mask=m, other=0)
        wrong = m & ((length < 0) | (length > max_len))
        bad = bad | tl.max(wrong.to(tl.int32), 0)
    return bad


@triton.jit
def values_bad(
    QO, KO, KI, NT, n_q, n_kv, total_q, total_k, max_q, max_kv,
    SAME: tl.constexpr, HAS_MAP: tl.constexpr, HAS_TARGETS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """1 (an int32 scalar) where any value condition of ``_validate._device_condition``
    fails, else 0. Also called by the tile-schedule kernel (``_tiles.py``), which fuses the
    default check into the schedule build of a new offsets object."""
    bad = _scan_offsets(QO, n_q, total_q, max_q, BLOCK)
    if not SAME:
        bad = bad | _scan_offsets(KO, n_kv, total_k, max_kv, BLOCK)
    if HAS_MAP or HAS_TARGETS:
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_q, BLOCK):
            i = start + offs
            m = i < n_q
            kb = i
            if HAS_MAP:
                kb = tl.load(KI + i, mask=m, other=0)
                wrong = m & ((kb < 0) | (kb >= n_kv))
                bad = bad | tl.max(wrong.to(tl.int32), 0)
            if HAS_TARGETS:
                # the kv sequence of each query sequence (clamped, as the host check does)
                kb = tl.minimum(tl.maximum(kb, 0), n_kv - 1)
                mk = m & ((i * 0 + n_kv) > 0)  # (a vector: the interpreter needs one)
                k_len = tl.load(KO + kb + 1, mask=mk, other=0) - tl.load(KO + kb, mask=mk, other=0)
                nt = tl.load(NT + i, mask=mk, other=0)
                wrong = mk & ((nt < 0) | (nt > k_len))
                bad = bad | tl.max(wrong.to(tl.int32), 0)
    return bad


@triton.jit(do_not_specialize=["n_q", "n_kv", "total_q", "total_k", "max_q", "max_kv"])
def _values_ok_kernel(
    QO, KO, KI, NT, OK, n_q, n_kv, total_q, total_k, max_q, max_kv,
    SAME: tl.constexpr, HAS_MAP: tl.constexpr, HAS_TARGETS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bad = values_bad(QO, KO, KI, NT, n_q, n_kv, total_q, total_k, max_q, max_kv,
                     SAME, HAS_MAP, HAS_TARGETS, BLOCK)  # fmt: skip
    tl.store(OK, (bad == 0).to(tl.int32))


def check_constexprs(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> dict[str, bool]:
    """``SAME``, ``HAS_MAP`` and ``HAS_TARGETS`` of :func:`values_bad` for these inputs."""
    same = kv_offsets is q_offsets and total_k == total_q and max_seqlen_kv >= max_seqlen_q
    return dict(SAME=same, HAS_MAP=kv_index is not None,
                HAS_TARGETS=num_targets is not None and q_offsets.numel() > 1)  # fmt: skip


def values_ok(
    total_q: int,
    total_k: int,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> torch.Tensor:
    """A 0-dim int32 tensor on the offsets' device: 1 if every value check passes, else 0
    (the conditions of ``_validate._device_condition``), from one kernel launch and
    without reading a value on the host."""
    n_q, n_kv = q_offsets.numel() - 1, kv_offsets.numel() - 1
    ok = torch.empty((), dtype=torch.int32, device=q_offsets.device)
    flags = check_constexprs(q_offsets, kv_offsets, total_q, total_k, max_seqlen_q,
                             max_seqlen_kv, kv_index, num_targets)  # fmt: skip
    ki = q_offsets if kv_index is None else kv_index
    nt = q_offsets if num_targets is None else num_targets
    args = (q_offsets, kv_offsets, ki, nt, ok, n_q, n_kv, total_q, total_k, max_seqlen_q,
            max_seqlen_kv)  # fmt: skip
    kw = dict(**flags, BLOCK=_BLOCK)
    key = ("checks", q_offsets.device, q_offsets.dtype, kv_offsets.dtype, ki.dtype, nt.dtype,
           *kw.values())  # fmt: skip
    launch(_values_ok_kernel, (1,), key, args, kw, {"num_warps": 8})
    return ok
