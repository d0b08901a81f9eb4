"""Tile schedules in one kernel launch (the default path of a new offsets object).

A new batch brings a new offsets object, and its first attention call builds the tile
schedules of the kernels (``_schedule.py`` explains what a schedule is). Built with
PyTorch ops (``_schedule.q_tile_schedule``) that is some thirty tiny kernels and as many
host dispatches, which on a slow host cost more than a short attention call; here it is
one single-program kernel:

1. the int32 copies of the offsets the kernels read (when they are int64);
2. a histogram of the tiles' costs in :data:`_BINS` buckets, heaviest first
   (longest-processing-time order, as the PyTorch builder; ties and tiles whose costs
   share a bucket come in arbitrary order, which changes which program computes a tile,
   never what it computes; without a causal mask a sequence's tiles all cost the same
   and take consecutive positions, in tile order, as in the PyTorch builder: programs
   running side by side share its keys and values in L2; by default a causal call's
   tiles form such runs too, heaviest tile first, see :func:`causal_runs`);
3. the buckets' start positions (a prefix sum), then every tile placed by an atomic
   increment of its bucket's cursor.

Entries past the real tiles (the table is sized by an upper bound from shapes) hold a
valid tile of the last sequence that the kernels never run. Query-tile schedules (the
forward and dQ kernels, with or without a query -> kv map) and key-tile schedules of
self-attention maps (dK/dV without ``kv_index``) are built here; the opt-in variants
(``work_order="sequence"``, ``prefetch``) and the dK/dV schedule with a map keep the
PyTorch builders.

With ``check=`` the kernel first runs the default value check of the call
(``_checks.values_bad``: one launch fewer per new offsets object) and writes its flag;
invalid values build an empty schedule, so nothing is written out of bounds before the
caller's ``torch._assert_async`` fires.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from hyperrec.jagged_attn._triton._checks import CHECK_BLOCK, check_constexprs, values_bad
from hyperrec.jagged_attn._triton._direct import launch

__all__ = ["CAUSAL_RUNS_ENV", "causal_runs", "tile_schedule"]

#: Switch read at every schedule build: ``0`` places a causal call's tiles one by one by
#: cost; ``1``: as runs per sequence (see :func:`causal_runs`); unset: runs unless
#: ``JAGGED_ATTN_GLUON_DYNAMIC=0`` (the Gluon kernels' fixed order balances runs badly);
#: anything else is a ValueError.
CAUSAL_RUNS_ENV = "JAGGED_ATTN_CAUSAL_RUNS"
# The Gluon kernels' switch (``_gluon._launch.DYNAMIC_ENV``; named here, not imported: the
# Triton schedules do not import the Gluon modules).
_GLUON_DYNAMIC_ENV = "JAGGED_ATTN_GLUON_DYNAMIC"


def causal_runs() -> bool:
    """Whether causal schedules place each sequence's tiles as one run (heaviest tile
    first, sequences by their heaviest tile) instead of every tile by its own cost. Runs
    share keys and values in L2 between programs running side by side. Placed by their
    own cost, tiles balance a persistent grid whose programs take items in a fixed order
    better; since 0.2.18 the Gluon kernels claim items as they go (``GluonConfig.dynamic``)
    and runs are the default (``bench/results/probe_dynamic_h200_2026-12-04.json``); with
    those claims off (``JAGGED_ATTN_GLUON_DYNAMIC=0``) the default is the per-tile order
    again (runs with the fixed order: 0.69-0.92x on causal calls, same file and
    ``probe_gluon_fp8_h200_2026-12-04_static.json``).
    Without a causal mask the tiles of a sequence cost the same and always form a run."""
    default = "0" if os.environ.get(_GLUON_DYNAMIC_ENV) == "0" else "1"
    value = os.environ.get(CAUSAL_RUNS_ENV, default)
    if value not in ("0", "1"):
        raise ValueError(f"{CAUSAL_RUNS_ENV} must be '0' or '1', got {value!r}")
    return value == "1"


# Cost buckets of the counting sort, and sequences per step of the kernel's loops.
_BINS = 4096
_SEQS = 1024
_OPTIONS = {"num_warps": 8}
# The checking variant's options on a GPU: debug mode keeps ``tl.device_assert``; Triton's
# integer-overflow asserts, which debug mode would add to every int32 add, stay off.
_ASSERT_OPTIONS: dict[str, object] = {}


def _assert_options() -> dict[str, object] | None:
    """The launch options that compile the in-kernel assert, or None where it cannot be
    used (the interpreter; a Triton without these options)."""
    from hyperrec.jagged_attn._triton import interpreting

    if interpreting():
        return None
    if not _ASSERT_OPTIONS:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions

            fields = CUDAOptions.__dataclass_fields__
        except Exception:  # another backend or layout
            return None
        if "debug" not in fields or "sanitize_overflow" not in fields:
            return None
        _ASSERT_OPTIONS.update(num_warps=8, debug=True, sanitize_overflow=False)
    return _ASSERT_OPTIONS


@triton.jit
def _tile_geometry(QO, KO, KI, s, m, HAS_MAP: tl.constexpr):
    """(query length, key length) of query sequence ``s`` (lanes ``m``), int32."""
    lq = (tl.load(QO + s + 1, mask=m, other=0) - tl.load(QO + s, mask=m, other=0)).to(tl.int32)
    kb = s
    if HAS_MAP:
        kb = tl.load(KI + s, mask=m, other=0)
    lk = (tl.load(KO + kb + 1, mask=m, other=0) - tl.load(KO + kb, mask=m, other=0)).to(tl.int32)
    return lq, lk


@triton.jit
def _tile_bucket(t, lq, lk, gran, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                 KV_TILES: tl.constexpr, BINS: tl.constexpr):  # fmt: skip
    """Cost bucket of tile ``t``: the keys a query tile visits (or the queries a key tile
    visits), counting the causal triangle, plus a fixed per-tile overhead; the cost model
    of ``_schedule.py``."""
    if KV_TILES:
        work = lq
        if CAUSAL:  # queries at or below the tile's first key
            first_row = tl.maximum(t * BLOCK - (lk - lq), 0)
            work = tl.maximum(lq - first_row, 0)
    else:
        work = lk
        if CAUSAL:  # keys up to the tile's last row on the bottom-right diagonal
            last = tl.minimum((t + 1) * BLOCK, lq) + lk - lq
            work = tl.maximum(tl.minimum(lk, last), 0)
    return tl.minimum((work + BLOCK) // gran, BINS - 1)


@triton.jit
def _run_bucket(tiles, lq, lk, gran, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                KV_TILES: tl.constexpr, BINS: tl.constexpr):  # fmt: skip
    """Bucket of a sequence whose tiles form one run: its heaviest tile's (the first key
    tile, or the last query tile under a causal mask; every tile alike without one)."""
    t = 0
    if CAUSAL and not KV_TILES:
        t = tl.maximum(tiles - 1, 0)
    return _tile_bucket(t, lq, lk, gran, BLOCK, CAUSAL, KV_TILES, BINS)


@triton.jit(do_not_specialize=["n_seq", "n_q_off", "n_kv_off", "upper", "gran", "c_total_q",
                               "c_total_k", "c_max_q", "c_max_kv"])  # fmt: skip
def _tile_schedule_kernel(
    QO, KO, KI, QO32, KO32, TILE_SEQ, TILE_IDX, TOTAL, CURSOR,
    n_seq, n_q_off, n_kv_off, upper, gran,
    KIC, NTC, OK, c_total_q, c_total_k, c_max_q, c_max_kv,
    BLOCK: tl.constexpr, CAUSAL: tl.constexpr, KV_TILES: tl.constexpr, HAS_MAP: tl.constexpr,
    RUNS: tl.constexpr,
    WRITE_Q32: tl.constexpr, WRITE_KV32: tl.constexpr, BINS: tl.constexpr, SEQS: tl.constexpr,
    CHECK: tl.constexpr, C_SAME: tl.constexpr, C_HAS_MAP: tl.constexpr,
    C_HAS_TARGETS: tl.constexpr, C_BLOCK: tl.constexpr, C_ASSERT: tl.constexpr,
):  # fmt: skip
    if CHECK:  # the call's value check (``_checks.py``); invalid values: an empty schedule
        bad = values_bad(QO, KO, KIC, NTC, n_q_off - 1, n_kv_off - 1, c_total_q, c_total_k,
                         c_max_q, c_max_kv, C_SAME, C_HAS_MAP, C_HAS_TARGETS, C_BLOCK)  # fmt: skip
        if not C_ASSERT:  # the caller asserts the flag
            tl.store(OK, (bad == 0).to(tl.int32))
        else:  # compiled with debug=True (see ``tile_schedule``); no flag to write
            tl.device_assert(bad == 0, "hyperrec.jagged_attn: invalid offsets, max_seqlen, "
                             "kv_index or num_targets values (call with validate='full' for "
                             "the error that names the argument)")  # fmt: skip
        n_seq = tl.where(bad == 0, n_seq, 0)
    lanes = tl.arange(0, SEQS)
    bins = tl.arange(0, BINS)
    tl.store(CURSOR + bins, tl.zeros([BINS], dtype=tl.int32))
    if WRITE_Q32:
        for start in range(0, n_q_off, SEQS):
            i = start + lanes
            tl.store(QO32 + i, tl.load(QO + i, mask=i < n_q_off).to(tl.int32), mask=i < n_q_off)
    if WRITE_KV32:
        for start in range(0, n_kv_off, SEQS):
            i = start + lanes
            tl.store(KO32 + i, tl.load(KO + i, mask=i < n_kv_off).to(tl.int32),
                     mask=i < n_kv_off)  # fmt: skip
    tl.debug_barrier()
    # 1. histogram of the tiles' cost buckets
    total = tl.zeros([], dtype=tl.int32)
    for start in range(0, n_seq, SEQS):
        s = start + lanes
        m = s < n_seq
        lq, lk = _tile_geometry(QO, KO, KI, s, m, HAS_MAP)
        length = lk if KV_TILES else lq
        tiles = tl.where(m, (length + BLOCK - 1) // BLOCK, 0)
        total += tl.sum(tiles, 0)
        if RUNS:  # one bucket per sequence, one atomic
            b = _run_bucket(tiles, lq, lk, gran, BLOCK, CAUSAL, KV_TILES, BINS)
            tl.atomic_add(CURSOR + b, tiles, mask=tiles > 0)
        else:
            for t in range(0, tl.max(tiles, 0)):
                b = _tile_bucket(t, lq, lk, gran, BLOCK, CAUSAL, KV_TILES, BINS)
                tl.atomic_add(CURSOR + b, 1, mask=t < tiles)
    tl.debug_barrier()
    # 2. each bucket's first position, heaviest bucket first
    counts = tl.atomic_add(CURSOR + bins, bins * 0)  # read where the atomics landed (L2)
    first = total - tl.cumsum(counts, 0)
    tl.debug_barrier()
    tl.store(CURSOR + bins, first)
    tl.debug_barrier()
    # 3. every tile to its place
    for start in range(0, n_seq, SEQS):
        s = start + lanes
        m = s < n_seq
        lq, lk = _tile_geometry(QO, KO, KI, s, m, HAS_MAP)
        length = lk if KV_TILES else lq
        tiles = tl.where(m, (length + BLOCK - 1) // BLOCK, 0)
        if RUNS:
            # A sequence's tiles take one run of consecutive positions, heaviest first: the
            # programs that run side by side then share its keys and values in L2. Placed
            # one tile at a time, the tiles of all sequences interleaved (t = 0 of every
            # sequence, then t = 1, ...), and on batches of equal lengths no two programs
            # running together read the same keys: the H200's forward fell to ~480 TFLOP/s,
            # the HBM bound of 128 FLOP per byte read.
            b = _run_bucket(tiles, lq, lk, gran, BLOCK, CAUSAL, KV_TILES, BINS)
            start = tl.atomic_add(CURSOR + b, tiles, mask=tiles > 0)
            for j in range(0, tl.max(tiles, 0)):
                valid = j < tiles
                t = j + lanes * 0
                if CAUSAL and not KV_TILES:  # query tiles: the last one is the heaviest
                    t = tiles - 1 - j
                tl.store(TILE_SEQ + start + j, s, mask=valid)
                tl.store(TILE_IDX + start + j, t, mask=valid)
        else:
            for t in range(0, tl.max(tiles, 0)):
                b = _tile_bucket(t, lq, lk, gran, BLOCK, CAUSAL, KV_TILES, BINS)
                valid = t < tiles
                pos = tl.atomic_add(CURSOR + b, 1, mask=valid)
                tl.store(TILE_SEQ + pos, s, mask=valid)
                tl.store(TILE_IDX + pos, t + lanes * 0, mask=valid)
    # entries past the real tiles: a valid tile (never run)
    last = tl.maximum(n_seq - 1, 0)
    for start in range(total, upper, SEQS):
        i = start + lanes
        tl.store(TILE_SEQ + i, last + lanes * 0, mask=i < upper)
        tl.store(TILE_IDX + i, lanes * 0, mask=i < upper)
    tl.store(TOTAL, total)


def _as_int32_buffer(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if t.dtype == torch.int32:
        return t, False
    return torch.empty(t.shape, dtype=torch.int32, device=t.device), True


def tile_schedule(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    block: int,
    causal: bool,
    upper: int,
    max_len: int,
    *,
    kv_tiles: bool,
    check: tuple[Any, ...] | None = None,
) -> tuple[Any, ...]:
    """``(q_offsets32, kv_offsets32, tile_seq, tile_idx, total)`` from one launch, and
    with ``check`` a sixth entry: the value check's flag (0-dim int32, 1 = valid), or
    None where the kernel asserted it itself (on a GPU).

    Query tiles of ``block`` rows (``kv_tiles=False``: the forward and dQ kernels; a
    ``kv_index`` maps query sequences to kv sequences) or key tiles (``kv_tiles=True``:
    the dK/dV kernel of self-attention maps, ``kv_index`` None). ``upper`` is the table's
    size (:func:`._schedule.work_upper_bound`), ``max_len`` the longest length the costs
    can reach (``max_seqlen_kv`` for query tiles, ``max_seqlen_q`` for key tiles; a bound
    that is too small only coarsens the order). The int32 offsets are the inputs if they
    are int32 already, else copies written by the same launch.

    ``check`` is the argument tuple of ``_checks.values_ok`` (``total_q, total_k,
    q_offsets, kv_offsets, max_seqlen_q, max_seqlen_kv, kv_index, num_targets``, the
    offsets being these ``q_offsets``/``kv_offsets``): the kernel runs that check first,
    and on invalid values builds an empty schedule (``total`` 0) instead. On a GPU it also
    asserts the flag itself (``tl.device_assert``, compiled in debug mode; one
    ``torch._assert_async`` launch fewer), and the flag returned is None; under the
    interpreter the caller asserts the flag.
    """
    assert not (kv_tiles and kv_index is not None), "key tiles with a kv_index: use _schedule"
    device = q_offsets.device
    q32, write_q = _as_int32_buffer(q_offsets)
    if kv_offsets is q_offsets:
        kv32, write_kv = q32, False
    else:
        kv32, write_kv = _as_int32_buffer(kv_offsets)
    tile_seq = torch.empty(upper, dtype=torch.int32, device=device)
    tile_idx = torch.empty(upper, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(_BINS, dtype=torch.int32, device=device)
    gran = max(1, -(-(max_len + block + 1) // _BINS))
    n_seq = q_offsets.numel() - 1
    in_kernel = check is not None and _assert_options() is not None
    if check is None:
        ok = total  # not written
        c_args: tuple[Any, ...] = (q_offsets, q_offsets, 0, 0, 0, 0)
        flags = dict(C_SAME=True, C_HAS_MAP=False, C_HAS_TARGETS=False)
    else:
        c_total_q, c_total_k, c_qo, c_ko, c_max_q, c_max_kv, c_map, c_targets = check
        assert c_qo is q_offsets and c_ko is kv_offsets, "check: another call's offsets"
        # asserted in the kernel, the flag is never written: no allocation for it (a
        # new offsets object's call is host-bound on short sequences)
        ok = total if in_kernel else torch.empty((), dtype=torch.int32, device=device)
        c_args = (q_offsets if c_map is None else c_map,
                  q_offsets if c_targets is None else c_targets,
                  c_total_q, c_total_k, c_max_q, c_max_kv)  # fmt: skip
        flags = {"C_" + name: value for name, value in check_constexprs(
            q_offsets, kv_offsets, c_total_q, c_total_k, c_max_q, c_max_kv, c_map, c_targets
        ).items()}  # fmt: skip
    c_map, c_targets = c_args[0], c_args[1]
    args = (q_offsets, kv_offsets, q_offsets if kv_index is None else kv_index, q32, kv32,
            tile_seq, tile_idx, total, cursor, n_seq, q_offsets.numel(), kv_offsets.numel(),
            upper, gran, c_map, c_targets, ok, *c_args[2:])  # fmt: skip
    kw = dict(BLOCK=block, CAUSAL=causal, KV_TILES=kv_tiles, HAS_MAP=kv_index is not None,
              RUNS=not causal or causal_runs(),
              WRITE_Q32=write_q, WRITE_KV32=write_kv, BINS=_BINS, SEQS=_SEQS,
              CHECK=check is not None, **flags, C_BLOCK=CHECK_BLOCK,
              C_ASSERT=in_kernel)  # fmt: skip
    # the key fixes the compiled variant: constexprs and the index tensors' dtypes
    key = ("tiles", device, q_offsets.dtype, kv_offsets.dtype, c_map.dtype, c_targets.dtype,
           *kw.values())  # fmt: skip
    launch(_tile_schedule_kernel, (1,), key, args, kw, _ASSERT_OPTIONS if in_kernel else _OPTIONS)
    if check is None:
        return q32, kv32, tile_seq, tile_idx, total
    return q32, kv32, tile_seq, tile_idx, total, None if in_kernel else ok
