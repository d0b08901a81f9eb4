"""Host side of the Gluon forward: validation, the tile table, descriptors, the launch.

Nothing here reads a device value: the offsets' *values* are trusted (validate them with
the public API's ``validate=True`` path or your own checks); shapes, dtypes, strides and
the device are checked and give ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

from hyperrec.jagged_attn._gluon._probe import gluon_supported, unsupported_reason

__all__ = [
    "ACTIVATIONS",
    "DYNAMIC_ENV",
    "NORMALIZATIONS",
    "GluonConfig",
    "default_config",
    "jagged_attention_fwd_gluon",
    "shared_memory_bytes",
]

#: Activations of the Gluon forward: softmax attention, or GDPA/HSTU's SiLU.
ACTIVATIONS: tuple[str, ...] = ("softmax", "silu")
#: ``normalization=`` values (SiLU only): none, or HSTU's ``1 / max_seqlen_kv``.
NORMALIZATIONS: tuple[str, ...] = ("none", "max_seqlen")

Activation = Literal["softmax", "silu"]
Normalization = Literal["none", "max_seqlen"]

# Query rows of one work item: two consumer warpgroups of 64 rows each.
BLOCK_M = 128
_WG_ROWS = 64
# Register cap of the whole kernel: 12 warps (2 consumer warpgroups + the producer warp's
# group) x 32 threads x 168 fills the 64K-register file of one SM; the partitions then
# re-balance it with setmaxnreg (consumers 240, producer 24).
_MAXNREG = 168
# Hopper: 227 KiB of shared memory per block, minus what Triton reserves for barriers.
_SMEM_LIMIT = 232448 - 1024
_HEAD_DIMS = (64, 128)

#: ``0`` makes every Gluon kernel take its items in the static snake order whatever its
#: configuration says; ``1`` or unset: as configured (dynamic by default). Read at every
#: launch; other values are a ValueError.
DYNAMIC_ENV = "JAGGED_ATTN_GLUON_DYNAMIC"


def dynamic_allowed() -> bool:
    """False when :data:`DYNAMIC_ENV` is ``0``."""
    value = os.environ.get(DYNAMIC_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{DYNAMIC_ENV} must be '0' or '1', got {value!r}")
    return value == "1"


_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class GluonConfig:
    """Tile and pipeline parameters of the Gluon forward."""

    block_n: int = 128
    """Key rows per K/V tile (64 or 128)."""
    num_stages: int = 2
    """Depth of the shared-memory K/V ring (each stage holds one K and one V tile)."""
    pingpong: bool = True
    """Make the two consumer warpgroups take turns issuing their GEMMs, so one
    warpgroup's softmax overlaps the other's GEMMs (FlashAttention-3's inter-warpgroup
    schedule). Off: both issue as soon as their data is ready."""
    isolate_values: bool = True
    """Zero the rows of a sequence's last value tile that belong to the next sequence
    before the last ``P V`` product (TMA reads whole boxes; their weights are 0, but
    ``0 * NaN`` is NaN). Off: a non-finite value in one sequence's first rows reaches the
    previous sequence's output (FlashAttention-3's varlen forward and FlexAttention's
    document masks behave that way); for benchmarks of what the guard costs."""
    dynamic: bool = True
    """Each CTA claims its next work item from a global counter when it starts one (the
    producer warp hands the index to the consumers), so CTAs that drew cheap items take
    more of them. Off: CTA ``p`` takes items ``p``, ``2P - 1 - p``, ... of the
    cost-sorted list ("snake" order), which balances only lists sorted heaviest first."""
    overlap_pv: bool = False
    """Keep the wait for ``O += P_{j-1} V_{j-1}`` after the softmax of tile ``j`` in the
    compiled code. ptxas hoists it above that softmax (so the softmax does not overlap
    the GEMM it was written to overlap); on makes the SASS match the source's schedule.
    Off by default: measured no faster (0.95-1.04x, slower with SiLU; README, "Since
    0.2.30")."""

    def __post_init__(self) -> None:
        for name in ("block_n", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        for name in ("pingpong", "isolate_values", "dynamic", "overlap_pv"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@functools.cache
def default_config(head_dim: int) -> GluonConfig:
    """The configuration used when none is given (2 stages fill SMEM at head dim 128)."""
    return GluonConfig(block_n=128, num_stages=2 if head_dim > 64 else 3)


def shared_memory_bytes(head_dim: int, config: GluonConfig, element_size: int = 2) -> int:
    """Shared memory of one CTA: Q and O tiles of both warpgroups plus the K/V ring."""
    q_and_o = 2 * 2 * _WG_ROWS * head_dim * element_size
    ring = 2 * config.num_stages * config.block_n * head_dim * element_size
    return q_and_o + ring


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_tma_rows(name: str, t: torch.Tensor) -> None:
    """(tokens, H, D) readable as a 2-D (tokens, H * D) tensor descriptor."""
    item = t.element_size()
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(
            f"{name} must have contiguous, packed heads (stride(1) == head_dim, stride(2) == 1), "
            f"got strides {tuple(t.stride())}; pass {name}.contiguous()"
        )
    if t.data_ptr() % 16 or (t.stride(0) * item) % 16:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address with 16-byte aligned rows "
            f"(TMA), got address {t.data_ptr()} and row stride {t.stride(0)}"
        )


def _check_offsets(name: str, t: object, device: torch.device) -> torch.Tensor:
    t = _check_tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def jagged_attention_fwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_offsets: torch.Tensor | None = None,
    max_seqlen_kv: int | None = None,
    activation: Activation = "softmax",
    output_scale: float = 1.0,
    normalization: Normalization = "none",
    config: GluonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of jagged attention with the warp-specialised Hopper kernel.

    ``o_i = output_scale * sum_j w_ij v_j`` over the keys ``j`` of query ``i``'s sequence
    that the mask allows, with ``w = softmax_j(scale * q_i.k_j)`` (``activation="softmax"``)
    or ``w = silu(scale * q_i.k_j) * norm`` (``"silu"``: GDPA; HSTU with
    ``normalization="max_seqlen"``, ``norm = 1 / max_seqlen_kv``).

    Args:
        q: ``(Tq, H, D)`` bfloat16/float16 on an sm_90 GPU, ``D`` in {64, 128}, heads packed
            (``stride(1) == D``), 16-byte aligned.
        k, v: ``(Tk, H, D)``, same dtype, device and layout rules. ``Tk == Tq`` without
            ``kv_offsets``.
        offsets: ``(B + 1,)`` int32/int64 query offsets (also the key offsets unless
            ``kv_offsets`` is given); values are not checked (no host sync).
        max_seqlen: int >= the longest query sequence (HSTU's divisor without
            ``max_seqlen_kv``).
        causal: key ``j`` visible to query ``i`` iff ``j <= i + Lk - Lq`` (bottom-right).
        scale: score multiplier; default ``1 / sqrt(D)``.
        kv_offsets: ``(B + 1,)`` key/value offsets when key lengths differ from query
            lengths; ``max_seqlen_kv`` is then its maximum length.
        activation: ``"softmax"`` or ``"silu"``.
        output_scale: multiplies the output.
        normalization: ``"none"`` or ``"max_seqlen"`` (SiLU only).
        config: tile/pipeline parameters; default :func:`default_config`.

    Returns:
        ``(out, lse)``: ``out`` ``(Tq, H, D)`` in ``q.dtype``; ``lse`` ``(H, Tq)`` float32,
        the base-2 log-sum-exp of ``log2(e) * scale * q_i.k_j`` over each row's allowed
        keys (``+inf`` for a row with none, whose output is 0): the convention of the
        package's Triton backward. SiLU returns an empty ``lse``.

    Raises:
        TypeError: non-tensors, unsupported dtypes, non-int/float/bool/str arguments.
        ValueError: shapes, head dims or layouts the kernel does not take, tensors on
            different devices, a non-Hopper device or a Triton without the Gluon API this
            kernel was written for, an unknown activation/normalization, a configuration
            that does not fit in shared memory.
    """
    q, k, v = (_check_tensor(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (tokens, heads, head_dim), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    total_q, n_heads, head_dim = q.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"q.shape[2] (head_dim) must be one of {_HEAD_DIMS}, got {head_dim}")
    if k.shape[1:] != q.shape[1:] or v.shape[1:] != q.shape[1:] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must be (Tk, {n_heads}, {head_dim}) like q, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if activation == "softmax" and normalization != "none":
        raise ValueError(f"normalization must be 'none' with softmax, got {normalization!r}")
    max_seqlen = _check_int("max_seqlen", max_seqlen, 0)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_float("scale", scale)
    output_scale = _check_float("output_scale", output_scale)
    offsets = _check_offsets("offsets", offsets, q.device)
    if kv_offsets is None:
        if max_seqlen_kv is not None:
            raise ValueError("max_seqlen_kv is only meaningful together with kv_offsets")
        if k.shape[0] != total_q:
            raise ValueError(
                f"without kv_offsets, k.shape[0] must equal q.shape[0] = {total_q}, "
                f"got {k.shape[0]}"
            )
        kv_offsets, max_seqlen_kv = offsets, max_seqlen
    else:
        kv_offsets = _check_offsets("kv_offsets", kv_offsets, q.device)
        if kv_offsets.numel() != offsets.numel():
            raise ValueError(
                f"kv_offsets must have {offsets.numel()} entries like offsets, "
                f"got {kv_offsets.numel()}"
            )
        if max_seqlen_kv is None:
            raise ValueError("max_seqlen_kv is required when kv_offsets is given")
        max_seqlen_kv = _check_int("max_seqlen_kv", max_seqlen_kv, 0)
    config = default_config(head_dim) if config is None else config
    if not isinstance(config, GluonConfig):
        raise TypeError(f"config must be a GluonConfig, got {type(config).__name__}")
    smem = shared_memory_bytes(head_dim, config, q.element_size())
    if smem > _SMEM_LIMIT:
        raise ValueError(
            f"config needs {smem} bytes of shared memory at head_dim {head_dim}, more than "
            f"the {_SMEM_LIMIT} available; lower num_stages or block_n"
        )
    if not gluon_supported(q.device):
        raise ValueError(
            f"q must be on an sm_90 GPU with Triton 3.6 Gluon: {unsupported_reason(q.device)}"
        )

    return _run(
        q,
        k,
        v,
        offsets,
        kv_offsets,
        max_seqlen_kv,
        causal,
        scale,
        activation == "softmax",
        output_scale,
        normalization == "max_seqlen",
        config,
    )


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_kv: int,
    causal: bool,
    scale: float,
    softmax: bool,
    output_scale: float,
    hstu_norm: bool,
    config: GluonConfig,
    schedule: tuple[torch.Tensor, ...] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch without argument checks: the package's dispatcher calls it for calls it
    has validated (``_triton._launch.gluon_unsupported``); everything else goes through
    :func:`jagged_attention_fwd_gluon`.

    ``schedule``: ``(q_offsets32, kv_offsets32, tile_seq, tile_idx, total)``, the forward's
    query-tile schedule for 128-row tiles (``_triton._tiles.tile_schedule``), if the caller
    has it (the dispatcher's is cached per offsets object and fuses its value check);
    otherwise built here, cached the same way. ``out``/``lse``: buffers the caller has
    allocated (``(Tq, H, D)`` contiguous in q's dtype; ``(H, Tq)`` float32, or ``(0,)`` for
    SiLU), else allocated here."""
    total_q, n_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((n_heads, total_q) if softmax else (0,), dtype=torch.float32,
                          device=q.device)  # fmt: skip
    n_seq = offsets.numel() - 1
    if total_q == 0 or n_seq == 0:
        return out, lse
    if k.shape[0] == 0:  # every key sequence is empty: no query sees a key
        out.zero_()
        lse.fill_(math.inf)
        return out, lse
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_tma_rows(name, t)

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hyperrec.jagged_attn._gluon._kernel import jagged_fwd_kernel
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._schedule import work_upper_bound

    def desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
        return TensorDescriptor(t, shape=[t.shape[0], n_heads * head_dim],
                                strides=[t.stride(0), 1], block_shape=[rows, head_dim],
                                layout=_smem_layout(rows, head_dim, q.dtype))  # fmt: skip

    if schedule is None:
        schedule = _schedule(offsets, kv_offsets, causal, total_q, max_seqlen_kv)
    q32, kv32, tile_seq, tile_idx, total = schedule
    if softmax:
        qk_scale = scale * math.log2(math.e)  # the kernel's exp2 works in base 2
        coef = output_scale
        lse_arg = lse
    else:
        qk_scale = scale
        coef = output_scale / max(max_seqlen_kv, 1) if hstu_norm else output_scale
        lse_arg = torch.empty(1, dtype=torch.float32, device=q.device)  # never written
    items = work_upper_bound(total_q, n_seq, BLOCK_M) * n_heads
    grid, work, dynamic = _persistent_grid(items, q.device, config.dynamic, total)
    args = (desc(q, _WG_ROWS), desc(k, config.block_n), desc(v, config.block_n),
            desc(out, _WG_ROWS), out, lse_arg, tile_seq, tile_idx, q32, kv32, total, work,
            out.stride(0), total_q, qk_scale,
            coef)  # fmt: skip
    kw = dict(H=n_heads, HEAD_DIM=head_dim, BLOCK_N=config.block_n,
              NUM_STAGES=config.num_stages, CAUSAL=causal, ACT=0 if softmax else 1,
              SCALE_IN_EXP=softmax and scale > 0, PINGPONG=config.pingpong,
              ISOLATE_VALUES=config.isolate_values, DYNAMIC=dynamic,
              OVERLAP_PV=config.overlap_pv, TREE_MAX=ROW_MAX_TREE)  # fmt: skip
    # The launch key fixes everything but the arguments (``_direct.launch``'s contract):
    # the descriptors' dtype, boxes and layouts follow from (dtype, head dim, config).
    key = ("gluon_fwd", q.dtype, q.device, tuple(sorted(kw.items())))
    _direct.launch(jagged_fwd_kernel, grid, key, args, kw, _OPTIONS)
    return out, lse


_OPTIONS = {"num_warps": 4, "maxnreg": _MAXNREG}
#: The softmax's row maximum (and FP8 SiLU's row scale) as two rounds of register-local
#: pairwise maxima before the in-thread chain (``_kernel._row_max``): a chain of 8
#: dependent ``FMNMX`` instead of 32 per row and tile. Read at each launch (an experiment
#: switch for A/B timing, off: measured no faster; part of the launch key).
ROW_MAX_TREE = False
# Slots of each CTA's item ring (the kernel's ``ITEM_DEPTH``).
_ITEM_DEPTH = 4


def _persistent_grid(
    items: int, device: torch.device, dynamic: bool, unused: torch.Tensor
) -> tuple[tuple[int], torch.Tensor, bool]:
    """``(grid, work, dynamic)`` of a persistent Gluon kernel over at most ``items`` work
    items: at most one CTA per SM; with ``dynamic`` (unless :data:`DYNAMIC_ENV` is ``0``)
    ``work`` is a new zeroed int32 buffer, the item counter and each CTA's ring, else
    ``unused`` (never read). A new buffer per launch: a counter shared between launches
    would need resetting, and kernels on two streams would take each other's items."""
    grid = (max(1, min(items, _num_sms(device))),)
    dynamic = dynamic and dynamic_allowed()
    if not dynamic:
        return grid, unused, False
    return grid, torch.zeros(1 + _ITEM_DEPTH * grid[0], dtype=torch.int32, device=device), True


def _schedule(
    offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    causal: bool,
    total_q: int,
    max_seqlen_kv: int,
) -> tuple[torch.Tensor, ...]:
    """The package forward's query-tile schedule for 128-row tiles (one Triton launch, no
    host sync), cached per offsets object in the same cache as the Triton forward's."""
    from hyperrec.jagged_attn._triton._launch import forward_schedule

    return forward_schedule(offsets, kv_offsets, None, None, causal=causal, total_q=total_q,
                            max_seqlen_kv=max_seqlen_kv, block_m=BLOCK_M)  # fmt: skip


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: torch.dtype) -> object:
    """The shared-memory layout of a ``[rows, cols]`` box of bf16, fp16 or E4M3 elements
    (built once: a Python object Triton derives from the swizzle rules, worth caching on a
    path that runs every call)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                torch.float8_e4m3fn: gl.float8e4nv}[dtype]  # fmt: skip
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)
