"""Kernel configurations: a shipped tuned table looked up by bucketed keys.

A configuration is chosen from a *bucketed* key, never from the lengths themselves, so a new
batch with a new set of lengths never triggers compilation or tuning:

    (kernel, architecture, padded head dim, softmax or activation, causal, max-length bucket)

(the shipped table uses the same tiles for every mask, and for every activation except
the dK/dV tile of pointwise ones, see :data:`TUNED` and :data:`TUNED_POINTWISE`).
``kernel`` is ``"fwd"``, ``"dkdv"`` or ``"dq"``; the architecture is ``"sm90"`` for Hopper
(H100 and H200 share the SM, so one table serves both) and ``"default"`` elsewhere; the
length bucket is ``"short"`` (max_seqlen <= 256) or ``"long"``. The table was produced
offline on an H200 with ``bench/tune_configs.py`` (which times :data:`CANDIDATES`); nothing
is tuned at run time, so the first call of a shape costs one compilation per kernel and no
benchmarking. Other GPUs get :func:`_heuristic`'s safe defaults (re-run the tuning script
there to extend the table).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "CANDIDATES",
    "TMA_ALL",
    "TMA_K_MASKED",
    "TMA_KV",
    "TMA_O",
    "TMA_Q",
    "PACKED",
    "PACK_ROWS_MAX_LEN",
    "TUNED",
    "TUNED_POINTWISE",
    "WORK_ORDERS",
    "KernelConfig",
    "config_key",
    "packed_config",
    "select_config",
]


#: ``KernelConfig.tma`` bits: the parts of the forward read or written through descriptors.
TMA_Q = 1
TMA_KV = 2
TMA_K_MASKED = 4
TMA_O = 8
TMA_ALL = TMA_Q | TMA_KV | TMA_K_MASKED | TMA_O

#: ``KernelConfig.work_order`` values.
WORK_ORDERS = ("cost", "sequence")


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Tile shape and launch parameters of one kernel.

    For ``fwd`` and ``dq`` a work item is a ``block_m`` tile of queries streaming ``block_n``
    keys at a time; for ``dkdv`` it is a ``block_n`` tile of keys streaming ``block_m``
    queries at a time.
    """

    block_m: int
    """Query rows per tile (a power of two, >= 16)."""
    block_n: int
    """Key rows per tile (a power of two, >= 16)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 2
    """Software-pipelining depth of the streamed loop (shared-memory buffers)."""
    dq_atomic: bool = False
    """``dkdv`` only: also accumulate dQ there with atomic fp32 adds (no dQ kernel)."""
    bwd_tma: bool = False
    """``dkdv`` and ``dq``: read the streamed tiles that lie wholly inside their sequence
    and need no mask through tensor descriptors built in the kernel (``dkdv``: query and dO
    tiles; ``dq``: key and value tiles); with ``dq_atomic`` also add those tiles' dQ shares
    with one bulk reduce-add per tile (TMA; on the GPU only, the interpreter keeps
    per-element atomics). Needs power-of-two head dims, packed 16-byte aligned rows and
    ``hopper_features()["tma"]``; dropped for a call where that does not hold."""

    # Forward-only variants (``fwd`` configurations; the other kernels ignore them). Off by
    # default; the shipped sm90 forward entries set ``tma``. Each one that cannot apply
    # to a call (see ``_launch.attention_forward``) is dropped silently for that call, so a
    # configuration that sets one is valid everywhere.
    prefetch: bool = False
    """Read each work item's tile metadata (sequence starts and lengths, first row, targets)
    from a precomputed 32-byte row, and issue the next item's read before computing the
    current one: no dependent load chain between two items of the persistent loop."""
    softmax_fma: bool = False
    """Softmax: take the row max of the unscaled scores and form ``exp2`` arguments as one
    fused ``s * qk_scale - m`` (drops one multiply per score). Needs ``scale > 0``."""
    lazy_rescale: bool = False
    """Softmax: rescale the accumulator only when some row's running max grew by more than
    ``2**8`` since the last rescale (a tile-wide branch); otherwise keep the stale max, so
    the weights of that tile are at most ``256``: exact in fp32, no loss in bf16."""
    tma: int = 0
    """Which tiles go through tensor descriptors (Hopper's bulk copy engine) instead of
    pointer loads: a bitmask of :data:`TMA_Q` (the query tile), :data:`TMA_KV` (K and V in
    mask-free tiles), :data:`TMA_K_MASKED` (K in masked tiles; V there stays a masked load)
    and :data:`TMA_O` (the output of tiles inside the sequence); ``True`` means all
    (:data:`TMA_ALL`). Needs power-of-two head dims, heads packed in 16-byte aligned rows and
    ``hopper_features()["tma"]`` (also runs under the interpreter)."""
    tma_in_kernel: bool = False
    """With ``tma``: build the descriptors in the kernel, once per program, instead of on the
    host at every call (host-built descriptors cost tens of microseconds of launch time;
    in-kernel ones need a Triton allocator for their scratch memory: the launcher installs a
    PyTorch one when none is set)."""
    warp_specialize: bool = False
    """Ask Triton to warp-specialise the key loops (``tl.range(warp_specialize=True)``);
    needs ``hopper_features()["warp_specialize"]``. A build that fails falls back to the
    same configuration without it (remembered per compiled variant)."""
    work_order: str = "cost"
    """Order of the forward's work list: ``"cost"`` (every query tile by its own cost,
    heaviest first) or ``"sequence"`` (sequences by total cost, heaviest first, each
    sequence's tiles together, heaviest first, so that programs running at the same time
    share the sequence's K/V in L2)."""
    dynamic_schedule: bool = False
    """Forward: programs take the next work item from an atomic counter instead of a fixed
    stride (greedy list scheduling: robust to uneven items and to programs that are not
    resident at once; one atomic per item). Not combined with ``prefetch``."""
    pack_rows: bool = False
    """Forward, for batches of many short sequences: a work item is ``block_m`` consecutive
    token rows of the whole batch (several sequences at once, pairs of different sequences
    masked) instead of ``block_m`` rows of one sequence. Applies to self-attention whose
    mask is at most causal (no map, targets, window, contextual or block rules); other
    calls ignore it. The other forward variants do not apply to it."""

    def __post_init__(self) -> None:
        if isinstance(self.tma, bool):  # frozen: normalise through object.__setattr__
            object.__setattr__(self, "tma", TMA_ALL if self.tma else 0)
        if not 0 <= self.tma <= TMA_ALL:
            raise ValueError(f"tma must be a bitmask of TMA_* flags, got {self.tma}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.work_order not in WORK_ORDERS:
            raise ValueError(f"work_order must be one of {WORK_ORDERS}, got {self.work_order!r}")


def _c(bm: int, bn: int, w: int, s: int, atomic: bool = False) -> KernelConfig:
    return KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, dq_atomic=atomic)


def _bwd(cfg: KernelConfig) -> KernelConfig:
    # Backward tiles with descriptor reads of the streamed whole tiles (``bwd_tma``).
    return replace(cfg, bwd_tma=True)


def _tma(cfg: KernelConfig) -> KernelConfig:
    # Q, K/V of mask-free tiles and O through in-kernel descriptors (masked K stays a
    # pointer load: TMA_K_MASKED measured no better).
    return replace(cfg, tma=TMA_Q | TMA_KV | TMA_O, tma_in_kernel=True)


Key = tuple[str, str, int, bool, bool, str]


def config_key(
    kernel: str, arch: str, head_dim: int, softmax: bool, causal: bool, max_seqlen: int
) -> Key:
    """The bucketed key a configuration is chosen by (see the module docstring)."""
    if kernel not in ("fwd", "dkdv", "dq"):
        raise ValueError(f"kernel must be 'fwd', 'dkdv' or 'dq', got {kernel!r}")
    d = max(32, 1 << (max(head_dim, 1) - 1).bit_length())
    bucket = "short" if max_seqlen <= 256 else "long"
    return (kernel, arch, d, bool(softmax), bool(causal), bucket)


#: Tuned on an H200 (torch 2.11, triton 3.6) by ``bench/tune_configs.py`` on softmax,
#: non-causal, bf16 batches with uniform lengths (short: B=1024, max 256; long: B=64, max
#: 2048; H=8); results in ``bench/results/tune_h200.json``. The forward entries then gained
#: tensor-descriptor (TMA) loads of Q and of K/V in mask-free tiles and TMA stores of O,
#: with descriptors built in the kernel, and the D=128 long tile a fourth stage, from
#: ``bench/sweep_forward.py`` (``bench/results/sweep_forward_h200.json``; against the same
#: tiles without descriptors, ``sweep_tma_default_h200.json``: +9-21% forward). Keyed by
#: (kernel, arch, padded head dim, bucket): the same tiles serve every activation and mask
#: (they change the element-wise work, not the data movement). H100 uses the same entries
#: (same SM). Keys missing here fall back to :func:`_heuristic`. A TMA flag that cannot
#: apply to a call (no descriptors in this Triton, head dims not powers of two, misaligned
#: rows) is dropped for that call by the launcher. The long-bucket backward entries then
#: gained descriptor reads of their streamed whole tiles (``bwd_tma``: +1-7% on softmax
#: calls; the short bucket lost 3% with them and keeps pointer loads), and pointwise
#: activations (HSTU's SiLU) their own dK/dV tile (:data:`TUNED_POINTWISE`), from
#: ``bench/tune_backward.py`` and ``bench/confirm_backward.py``
#: (``bench/results/*backward*_h200_2026-12-02.json``).
TUNED: dict[tuple[str, str, int, str], KernelConfig] = {
    ("fwd", "sm90", 64, "short"): _tma(_c(128, 32, 4, 3)),
    ("dkdv", "sm90", 64, "short"): _c(32, 64, 4, 3),
    ("dq", "sm90", 64, "short"): _c(64, 32, 4, 3),
    ("fwd", "sm90", 128, "short"): _tma(_c(128, 32, 4, 3)),
    ("dkdv", "sm90", 128, "short"): _c(32, 64, 4, 3),
    ("dq", "sm90", 128, "short"): _c(64, 32, 4, 3),
    ("fwd", "sm90", 64, "long"): _tma(_c(128, 64, 4, 3)),
    ("dkdv", "sm90", 64, "long"): _bwd(_c(64, 64, 4, 2)),
    ("dq", "sm90", 64, "long"): _bwd(_c(64, 32, 4, 3)),
    ("fwd", "sm90", 128, "long"): _tma(_c(128, 64, 8, 4)),
    ("dkdv", "sm90", 128, "long"): _bwd(_c(64, 64, 4, 2)),
    ("dq", "sm90", 128, "long"): _bwd(_c(128, 64, 8, 3)),
}

#: Entries that replace :data:`TUNED`'s for activations other than softmax: the dK/dV
#: tile of HSTU-style attention (SiLU, causal), where 32x64 tiles with 4 warps and 3
#: stages ran 1.05-1.12x the softmax tile (``confirm_backward_h200_2026-12-02.json``;
#: on softmax calls the same tile lost up to 15%).
TUNED_POINTWISE: dict[tuple[str, str, int, str], KernelConfig] = {
    ("dkdv", "sm90", 64, "long"): _bwd(_c(32, 64, 4, 3)),
    ("dkdv", "sm90", 128, "long"): _bwd(_c(32, 64, 4, 3)),
}

#: Longest sequence for which the forward packs rows by default (see :data:`PACKED`).
PACK_ROWS_MAX_LEN = 64

#: The default forward of self-attention calls (no mask or causal, no kv map, no targets)
#: whose sequences are all at most :data:`PACK_ROWS_MAX_LEN` long, per (arch, padded head
#: dim): the packed-rows kernel (``pack_rows``), whose 64-row spans hold several
#: sequences. On the H200 (``bench/results/attention_quick_h200_2026-12-03_direct_launch.json``,
#: tiny-u-B2048-L64-H4-D128, 4 fresh instances) it ran the forward at 50 TFLOP/s on the
#: GPU against the one-tile-per-sequence kernel's 29 and padded SDPA's 32; as the default
#: 49.5 (``attention_quick_h200_2026-12-03_packed_default.json``). Calls that do not
#: qualify keep :data:`TUNED`'s entry.
PACKED: dict[tuple[str, int], KernelConfig] = {
    ("sm90", 64): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                               pack_rows=True),
    ("sm90", 128): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                pack_rows=True),
}  # fmt: skip


def packed_config(arch: str, head_dim: int, max_seqlen: int) -> KernelConfig | None:
    """The default packed-rows forward for this call's key (:data:`PACKED`), or None."""
    if max_seqlen > PACK_ROWS_MAX_LEN:
        return None
    return PACKED.get((arch, max(32, 1 << (max(head_dim, 1) - 1).bit_length())))


#: What ``bench/tune_configs.py`` searches, per kernel (dK/dV also with ``dq_atomic``).
CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "fwd": (
        _c(128, 64, 8, 3),
        _c(128, 64, 8, 2),
        _c(128, 128, 8, 2),
        _c(128, 64, 4, 3),
        _c(64, 64, 4, 3),
        _c(128, 32, 4, 3),
    ),
    # dK/dV: block_m = query rows streamed, block_n = key rows owned by a program
    "dkdv": (
        _c(64, 128, 8, 2),
        _c(32, 128, 8, 2),
        _c(64, 64, 8, 2),
        _c(64, 64, 4, 2),
        _c(32, 64, 4, 3),
    ),
    "dq": (
        _c(128, 64, 8, 2),
        _c(64, 64, 4, 2),
        _c(128, 32, 8, 2),
        _c(64, 32, 4, 3),
        _c(128, 64, 8, 3),
    ),
}


def _heuristic(kernel: str, arch: str, head_dim: int) -> KernelConfig:
    """A safe default: fits the shared memory of every GPU since sm80 for each head dim."""
    if arch == "interpreter":
        return _c(32, 32, 4, 1)
    big = head_dim > 128
    if kernel == "fwd":
        return _c(64, 32, 4, 2) if big else _c(128, 64, 8 if head_dim > 64 else 4, 3)
    if kernel == "dkdv":
        return _c(32, 64, 8, 1) if big else _c(64, 128, 8, 2)
    return _c(64, 32, 8, 1) if big else _c(128, 64, 8, 2)


def select_config(key: Key) -> KernelConfig:
    """The shipped configuration for ``key`` (tuned table, else the heuristic)."""
    kernel, arch, d, softmax, _, bucket = key
    hit = None if softmax else TUNED_POINTWISE.get((kernel, arch, d, bucket))
    if hit is None:
        hit = TUNED.get((kernel, arch, d, bucket))
    return hit if hit is not None else _heuristic(kernel, arch, d)
