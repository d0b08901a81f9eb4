"""Launchers: allocate outputs, build schedules, pick configurations, launch the kernels.

Each takes one :class:`~hyperrec.jagged_attn._opschema.AttentionCall` (the tensors and the
spec), as the reference backend's launcher does. The public layer validates user input;
these functions only assert their own
preconditions (layout, dtypes, devices) so that a wrong internal call fails with a clear
message instead of a wrong answer or an illegal memory access.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

from hyperrec.jagged_attn._gluon._bwd_launch import BLOCK_N as GLUON_BWD_BLOCK_N
from hyperrec.jagged_attn._gluon._launch import BLOCK_M as GLUON_BLOCK_M
from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton import _configs, _direct, _kernels, interpreting
from hyperrec.jagged_attn._triton._configs import KernelConfig
from hyperrec.jagged_attn._triton._probe import hopper_features
from hyperrec.jagged_attn._triton._schedule import (
    as_int32,
    cached_schedule,
    kv_tile_schedule,
    q_tile_meta,
    q_tile_schedule,
    remember_int32,
    row_sequence,
    work_upper_bound,
)
from hyperrec.jagged_attn._triton._tiles import tile_schedule
from hyperrec.jagged_attn._validate import DeviceCheck, take_pending_check
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = ["attention_backward", "attention_forward"]

ACTIVATION_CODES = {
    "softmax": _kernels.ACT_SOFTMAX,
    "silu": _kernels.ACT_SILU,
    "gelu": _kernels.ACT_GELU,
    "gelu_tanh": _kernels.ACT_GELU_TANH,
    "gelu_poly": _kernels.ACT_GELU_POLY,
    "relu": _kernels.ACT_RELU,
    "sigmoid": _kernels.ACT_SIGMOID,
    "identity": _kernels.ACT_IDENTITY,
}
NORMALIZATIONS = ("none", "max_seqlen", "length")
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Mask:
    """The spec's mask as the kernels take it (constexpr flags + runtime ints)."""

    call: AttentionCall

    @property
    def generic(self) -> bool:
        """Anything beyond plain causal: every visited tile evaluates the full mask."""
        m = self.call.spec.mask
        return (
            self.call.num_targets is not None
            or m.window_left >= 0
            or m.window_right >= 0
            or m.contextual_len > 0
            or m.block_size > 0
        )

    def constexprs(self) -> dict[str, bool]:
        m = self.call.spec.mask
        return dict(
            CAUSAL=m.causal,
            GENERIC=self.generic,
            HAS_TARGETS=self.call.num_targets is not None,
            HAS_WL=m.window_left >= 0,
            HAS_WR=m.window_right >= 0,
            HAS_CONTEXT=m.contextual_len > 0,
            HAS_BLOCK=m.block_size > 0,
            BLOCK_PREV=m.block_previous and m.block_size > 0,
        )

    def ints(self) -> tuple[int, int, int, int]:
        """``(window_left, window_right, contextual_len, block_size)`` for the kernels, each
        capped at ``cap = Tq + Tk + 1`` tokens. A window, block or prefix that wide already
        covers every position of every pair (``|e| <= Lq <= Tq``, ``j < Lk <= Tk``), so the
        cap changes no mask; it keeps the kernels' 32-bit position arithmetic (``e + right``,
        ``(j // size + 2) * size``) from overflowing on values such as ``2**31 - 1`` that the
        public functions accept, which used to drop keys silently (dK/dV first)."""
        m = self.call.spec.mask
        cap = self.call.q.shape[0] + self.call.k.shape[0] + 1
        return (
            min(max(m.window_left, 0), cap),
            min(max(m.window_right, 0), cap),
            min(m.contextual_len, cap),
            min(max(m.block_size, 1), cap),
        )


# Per-device facts, read once (a property query per launch costs host time).
_ARCH: dict[int, str] = {}
_SM_PROPS: dict[int, dict[str, int]] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _arch(device: torch.device) -> str:
    if interpreting():
        return "interpreter"
    if device.type != "cuda":
        return "default"
    index = _index(device)
    if index not in _ARCH:
        _ARCH[index] = "sm90" if torch.cuda.get_device_capability(index)[0] == 9 else "default"
    return _ARCH[index]


def _sm_props(device: torch.device) -> dict[str, int]:
    """SM count and per-SM limits (feature-detected; Hopper's values where torch lacks them)."""
    index = _index(device)
    if index not in _SM_PROPS:
        p = torch.cuda.get_device_properties(index)
        _SM_PROPS[index] = dict(
            sms=p.multi_processor_count,
            regs=int(getattr(p, "regs_per_multiprocessor", 65536)),
            smem=int(getattr(p, "shared_memory_per_multiprocessor", 228 * 1024)),
            threads=int(getattr(p, "max_threads_per_multi_processor", 2048)),
        )
    return _SM_PROPS[index]


def _num_sms(device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return 2  # the interpreter runs programs one by one: a small grid tests striding
    return _sm_props(device)["sms"]


class _Key(tuple[object, ...]):
    """A launch key: a tuple whose hash is computed once (keys hold ~30 entries and are
    looked up at every launch)."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


# Programs of a persistent kernel that fit on one SM at once, per compiled variant. Filled
# from the compiled kernel's registers and shared memory after its first launch (which uses
# a safe one-per-SM grid).
_OCCUPANCY: dict[tuple[object, ...], int] = {}

# The CUDA runtime reserves 1 KiB of shared memory per resident block (sm80 and later).
_SMEM_RESERVED_PER_BLOCK = 1024


def occupancy_estimate(
    n_regs: int, shared: int, num_warps: int, props: dict[str, int] | None = None
) -> int:
    """Blocks of a kernel resident on one SM at once, by registers, shared memory and
    threads, rounded the way the hardware allocates (never above 8, never below 1).

    A persistent kernel must not launch more programs than are resident: each program has a
    fixed share of the work, so programs that wait for a free SM run as a second wave and
    can double the kernel time. Registers are allocated per warp in units of 256, and every
    block also takes :data:`_SMEM_RESERVED_PER_BLOCK` of shared memory.
    """
    props = props or dict(regs=65536, smem=228 * 1024, threads=2048)
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = props["regs"] // (regs_per_warp * num_warps)
    by_smem = props["smem"] // (shared + _SMEM_RESERVED_PER_BLOCK) if shared > 0 else 32
    by_threads = props["threads"] // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 8))


def _occupancy(compiled: Any, num_warps: int, device: torch.device) -> int:
    try:
        n_regs = int(compiled.n_regs)
        shared = int(compiled.metadata.shared)
    except (AttributeError, TypeError, ValueError):
        return 1
    return occupancy_estimate(n_regs, shared, num_warps, _sm_props(device))


def _launch_persistent(kernel, work_upper_bound: int, device, cfg: KernelConfig, key, args, kw):
    """Launch ``kernel`` on min(upper bound of work items, programs resident at once)."""
    occ = _OCCUPANCY.get(key, 1)
    grid0 = max(1, min(work_upper_bound, _num_sms(device) * occ))
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    compiled = _direct.launch(kernel, (grid0,), key, args, kw, options)
    if compiled is not None and key not in _OCCUPANCY and not interpreting():
        _OCCUPANCY[key] = _occupancy(compiled, cfg.num_warps, device)
        _COMPILED[key] = compiled


# The compiled kernel of each key (for benchmarks: registers, spills, shared memory, IR).
_COMPILED: dict[tuple[object, ...], Any] = {}


# Forward variants whose build failed once (warp specialisation): their key -> the error.
# Such a key is launched without the variant from then on.
_FAILED_BUILDS: dict[tuple[object, ...], str] = {}


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether (tokens, H, D) tensors can be read as 2-D (tokens, H * D) tensor descriptors:
    heads packed, 16-byte aligned base and row stride."""
    for t in tensors:
        item = t.element_size()
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.shape[0] == 0:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * item) % 16 or (t.shape[2] * item) % 16:
            return False
    return True


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int, used: bool):
    """A host-built 2-D (tokens, H * D) descriptor of ``t``, or ``t`` itself if not ``used``
    (the kernel never reads it then; building one costs launch time)."""
    if not used:
        return t
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, h, d = t.shape
    return TensorDescriptor(t, shape=[n, h * d], strides=[t.stride(0), 1],
                            block_shape=[block_rows, block_cols])  # fmt: skip


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    del alignment, stream  # PyTorch allocations are 256-byte aligned, on the current stream
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """In-kernel descriptors need scratch memory from Triton's allocator: install one that
    allocates through PyTorch, unless the caller set their own."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    get = getattr(current, "get", None)  # a ContextVar in newer Tritons
    if get is not None:
        current = get()
    if current is None or isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _forward_variants(
    cfg: KernelConfig,
    activation: str,
    scale: float,
    tensors: tuple[torch.Tensor, ...],
    head_dims: tuple[int, int],
) -> dict[str, bool | int]:
    """The forward variants of ``cfg`` that apply to this call (the kernel's constexprs):
    ``tma`` needs descriptors on this GPU (or the interpreter) and tensors they can read,
    ``warp_specialize`` the Triton feature, ``softmax_fma`` a positive scale."""
    softmax = activation == "softmax"
    device = tensors[0].device
    gpu = device.type == "cuda" and not interpreting()
    features = hopper_features(device.index) if gpu else {}
    tma = cfg.tma if cfg.tma and _descriptors_usable(tensors, head_dims) else 0
    # The interpreter ignores warp specialisation, so there the flag only tests the plumbing.
    ws = cfg.warp_specialize and (interpreting() or features.get("warp_specialize", False))
    return dict(
        PREFETCH=cfg.prefetch,
        DYNAMIC=cfg.dynamic_schedule and not cfg.prefetch,
        TMA=tma,
        TMA_IN_KERNEL=bool(tma) and cfg.tma_in_kernel,
        WARP_SPEC=ws,
        FMA=cfg.softmax_fma and softmax and scale > 0,
        LAZY=cfg.lazy_rescale and softmax,
    )


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _check_inputs(call: AttentionCall) -> None:
    q, k, v = call.q, call.k, call.v
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be (tokens, H, D)"
    assert q.dtype in _DTYPES, f"triton kernels take bf16/fp16, got {q.dtype}"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share one dtype"
    assert q.shape[1] == k.shape[1] == v.shape[1], "q, k, v must have the same number of heads"
    assert q.shape[2] == k.shape[2], "q and k must have the same head dim"
    assert k.shape[0] == v.shape[0], "k and v must have the same number of tokens"
    assert 16 <= q.shape[2] <= 256 and v.shape[2] <= 256, "head dims must be in [16, 256]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.stride(2) == 1, f"{name} must be contiguous in its last dim"
    indices = (("q_offsets", call.q_offsets), ("kv_offsets", call.kv_offsets),
               ("kv_index", call.kv_index), ("num_targets", call.num_targets))  # fmt: skip
    for name, index in indices:
        if index is not None:
            assert index.device == q.device, f"{name} must be on {q.device}, got {index.device}"
            assert index.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64"
    assert q.device == k.device == v.device, "q, k, v must be on one device"


def _common(call: AttentionCall, fast_math: bool) -> tuple[float, dict[str, Any]]:
    """(coef, constexprs shared by all kernels). ``coef = output_scale * normalisation``
    except the per-sequence ``1 / Lk`` of ``"length"``, which the kernels apply."""
    spec = call.spec
    assert spec.activation in ACTIVATION_CODES, f"unknown activation {spec.activation!r}"
    assert spec.normalization in NORMALIZATIONS, f"unknown normalization {spec.normalization!r}"
    coef = float(spec.output_scale)
    if spec.normalization == "max_seqlen":
        coef /= max(spec.max_seqlen_kv, 1)
    ce = dict(
        ACT=ACTIVATION_CODES[spec.activation],
        NORM=_kernels.NORM_KV_LEN if spec.normalization == "length" else 0,
        HAS_MAP=call.kv_index is not None,
        FAST=bool(fast_math) and not interpreting() and call.q.device.type == "cuda",
        **_Mask(call).constexprs(),
    )
    return coef, ce


def _qk_scale(activation: str, scale: float) -> float:
    # Softmax works in base 2 (exp2 is the native instruction): fold log2(e) into the scale.
    return scale * math.log2(math.e) if activation == "softmax" else scale


def _pick(kernel: str, call: AttentionCall, config: KernelConfig | None) -> KernelConfig:
    """``config``, else the shipped one for this call's bucketed key."""
    if config is not None:
        return config
    spec = call.spec
    key = _configs.config_key(
        kernel, _arch(call.q.device), call.q.shape[2], spec.activation == "softmax",
        spec.mask.causal, max(spec.max_seqlen_q, spec.max_seqlen_kv),
    )  # fmt: skip
    return _configs.select_config(key)


@dataclass(frozen=True)
class _ForwardPlan:
    """Everything the forward decides from a call's signature (see :func:`_signature`),
    computed once per signature: the configuration, the kernel's constexprs and the
    launch key. A call then only allocates, looks up its schedule and launches."""

    cfg: KernelConfig
    kw: dict[str, Any]
    key: _Key
    ce: dict[str, Any]
    host_descs: bool
    packed: KernelConfig | None
    """The packed-rows forward to run when the call qualifies (``_packable``): a pinned
    ``pack_rows`` configuration, else :func:`._configs.packed_config`'s default."""
    gluon: bool
    """The Gluon forward can serve this call (see :func:`gluon_unsupported`)."""


_FWD_PLANS: dict[tuple[object, ...], _ForwardPlan] = {}
_BWD_PLANS: dict[tuple[object, ...], _BackwardPlan] = {}
_PLAN_LIMIT = 256


def _signature(call: AttentionCall, *extra: Any) -> tuple[object, ...]:
    """What the launchers' decisions depend on, as a cheap hashable key: dtypes, devices,
    heads and head dims, strides, which optional tensors are given, the spec's static
    fields, the length bucket, whether the inputs are empty and 16-byte aligned (tensor
    descriptors), plus ``extra`` (options, pinned configurations). Never lengths or token
    counts: a new batch reuses the plan."""
    q, k, v, spec = call.q, call.k, call.v, call.spec
    ki, nt = call.kv_index, call.num_targets
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
    return (
        q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(), v.stride(),
        call.q_offsets.dtype, call.q_offsets.device, call.kv_offsets.dtype,
        call.kv_offsets.device, None if ki is None else (ki.dtype, ki.device),
        None if nt is None else (nt.dtype, nt.device), spec.activation, spec.normalization,
        spec.mask, spec.scale > 0, max(spec.max_seqlen_q, spec.max_seqlen_kv) <= 256,
        max(spec.max_seqlen_q, spec.max_seqlen_kv) <= _configs.PACK_ROWS_MAX_LEN,
        q.shape[0] == 0, k.shape[0] == 0, aligned, *extra,
    )  # fmt: skip


_V = TypeVar("_V")


def _remember(cache: dict[tuple[object, ...], _V], key: tuple[object, ...], value: _V) -> _V:
    if len(cache) >= _PLAN_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _forward_plan(
    call: AttentionCall, out: torch.Tensor, fast_math: bool, config: KernelConfig | None
) -> _ForwardPlan:
    _check_inputs(call)
    q, k, v, spec = call.q, call.k, call.v, call.spec
    head_dim, head_dim_v = q.shape[2], v.shape[2]
    _, ce = _common(call, fast_math)
    cfg = _pick("fwd", call, config)
    variants = _forward_variants(cfg, spec.activation, spec.scale, (q, k, v, out),
                                 (head_dim, head_dim_v))  # fmt: skip
    kw = dict(
        H=q.shape[1], HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=_pow2(head_dim),
        BLOCK_DV=_pow2(head_dim_v), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **ce, **variants,
    )  # fmt: skip
    key = _Key(("fwd", q.dtype, cfg, tuple(sorted(kw.items()))))
    if key in _FAILED_BUILDS:
        kw["WARP_SPEC"] = False
        key = _Key(("fwd", q.dtype, cfg, tuple(sorted(kw.items()))))
    host_descs = bool(variants["TMA"]) and not variants["TMA_IN_KERNEL"]
    gluon = config is None and gluon_eligible(call)
    if config is not None:
        packed = config if config.pack_rows else None
    else:
        packed = _configs.packed_config(_arch(q.device), head_dim,
                                        max(spec.max_seqlen_q, spec.max_seqlen_kv))  # fmt: skip
    return _ForwardPlan(cfg=cfg, kw=kw, key=key, ce=ce, host_descs=host_descs, packed=packed,
                        gluon=gluon)  # fmt: skip


#: Environment variable that chooses the Gluon forward (``_gluon/``) for the calls it
#: supports: ``1`` for every such call, ``0`` never; unset (or ``auto``): when
#: :data:`GLUON_DEFAULT` is on, for such calls whose longest sequence exceeds
#: :data:`GLUON_MIN_SEQLEN` tokens. The backward (Triton or Gluon kernels, see
#: :data:`GLUON_BWD_ENV`) takes its LSE as is.
GLUON_ENV = "JAGGED_ATTN_GLUON"
#: Whether the Gluon forward runs by default (on since its GPU validation through the
#: public dispatch: 1.22-1.38x the Triton forward on batches with sequences of hundreds of
#: tokens and more, 0.85-0.96x on sequences of at most 128 tokens;
#: ``bench/results/bench_gluon_public_h200_2026-12-03.json``).
GLUON_DEFAULT = True
#: The default takes the Gluon forward only for calls whose ``max(max_seqlen_q,
#: max_seqlen_kv)`` exceeds this (the Triton forward wins below 128 tokens; between 128
#: and 256 nothing was measured, the short-sequence configurations stay).
GLUON_MIN_SEQLEN = 256
#: Environment variable that chooses the Gluon backward kernels (``_gluon/_bwd_kernel.py``:
#: dK/dV, then dQ) for the backward calls the Gluon forward supports
#: (:func:`gluon_unsupported`): ``1`` for every such call, ``0`` never; unset (or
#: ``auto``): when :data:`GLUON_BWD_DEFAULT` is on, for such calls whose longest sequence
#: exceeds :data:`GLUON_MIN_SEQLEN` tokens (the forward's rule).
GLUON_BWD_ENV = "JAGGED_ATTN_GLUON_BWD"
#: Whether the Gluon backward runs by default (on since its GPU validation: 1.03-1.40x the
#: Triton backward on GPU time, H = 8, D = 128, sequences of up to 1,024-8,192 tokens,
#: softmax, causal softmax and HSTU; ``bench/results/bench_gluon_bwd_h200_2026-12-03*.json``).
GLUON_BWD_DEFAULT = True
#: ``JAGGED_ATTN_BWD_TMA=0`` switches off the backward's descriptor reads
#: (``KernelConfig.bwd_tma``) for plans built after it is set: an escape hatch and an A/B
#: switch for benchmarks.
BWD_TMA_ENV = "JAGGED_ATTN_BWD_TMA"


def _switch(name: str) -> bool | None:
    """The value of an on/off environment variable: True (``"1"``), False (``"0"``) or None
    (unset or ``"auto"``: the default policy); other values are a ``ValueError``."""
    value = os.environ.get(name, "")
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0, 1 or auto (or unset), got {value!r}")
    return value == "1"


def _long(spec: AttentionSpec) -> bool:
    # read at every call (not in a cached plan): a changed threshold applies at once
    return max(spec.max_seqlen_q, spec.max_seqlen_kv) > GLUON_MIN_SEQLEN


def gluon_requested() -> bool | None:
    """What :data:`GLUON_ENV` asks for: True (``"1"``), False (``"0"``) or None (unset or
    ``"auto"``: the default policy)."""
    return _switch(GLUON_ENV)


def gluon_bwd_requested(spec: AttentionSpec) -> bool:
    """Whether :data:`GLUON_BWD_ENV` asks for the Gluon backward kernels for a call with
    ``spec`` (unset or ``auto``: :data:`GLUON_BWD_DEFAULT` for calls whose longest sequence
    exceeds :data:`GLUON_MIN_SEQLEN`); read at every call."""
    asked = _switch(GLUON_BWD_ENV)
    return GLUON_BWD_DEFAULT and _long(spec) if asked is None else asked


def _use_gluon(plan: _ForwardPlan, spec: AttentionSpec, packed: bool) -> bool:
    if not plan.gluon:
        return False
    asked = gluon_requested()
    if asked is not None:
        return asked
    return GLUON_DEFAULT and _long(spec) and not packed


def gluon_eligible(call: AttentionCall) -> bool:
    """Whether the Gluon forward computes exactly this call (see :func:`gluon_unsupported`)."""
    return gluon_unsupported(call) is None


def gluon_unsupported(
    call: AttentionCall, *, check_device: bool = True, check_layout: bool = True
) -> str | None:
    """Why the experimental Gluon forward cannot serve ``call``, or None if it can.

    It computes softmax, or SiLU with no normalisation or HSTU's ``1 / max_seqlen``; no
    mask but causal (no window, targets, contextual tokens or blocks), no query -> kv map;
    bf16/fp16; one head dim of 64 or 128 for q, k and v; non-empty q and k with packed
    heads and 16-byte aligned rows (TMA); on an sm_90 GPU with the Triton its API was
    written for (``_gluon.gluon_supported``; skipped with ``check_device=False``). The FP8
    forward reads quantized copies, not ``q``/``k``/``v``: it passes ``check_layout=False``.
    """
    q, k, v, spec = call.q, call.k, call.v, call.spec
    softmax = spec.activation == "softmax"
    if not softmax and spec.activation != "silu":
        return f"activation {spec.activation!r} (softmax or silu only)"
    if spec.normalization not in (("none",) if softmax else ("none", "max_seqlen")):
        return f"normalization {spec.normalization!r} with {spec.activation}"
    if _Mask(call).generic:
        return "a mask beyond causal (window, targets, contextual tokens or blocks)"
    if call.kv_index is not None:
        return "a query -> kv map (kv_index)"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}"
    if q.shape[2] not in (64, 128) or k.shape[1:] != q.shape[1:] or v.shape[1:] != q.shape[1:]:
        return f"head dims {q.shape[2]}/{v.shape[2]} (one of 64 or 128 for q, k and v)"
    if q.shape[0] == 0 or k.shape[0] == 0 or (check_layout and not _tma_ready(q, k, v)):
        return "empty inputs, or heads not packed / rows not 16-byte aligned (TMA)"
    if check_device:
        if q.device.type != "cuda" or interpreting():
            return f"device {q.device}"
        from hyperrec.jagged_attn._gluon import gluon_supported, unsupported_reason

        if not gluon_supported(q.device):
            return unsupported_reason(q.device)
    return None


def _gluon_forward(
    call: AttentionCall,
    schedule: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The call passed the public checks and gluon_unsupported (softmax or SiLU, none or
    # HSTU's normalisation): launch without the Gluon entry point's own argument checks
    # (host time on every call).
    from hyperrec.jagged_attn._gluon._launch import _run, default_config

    spec = call.spec
    return _run(
        call.q, call.k, call.v, call.q_offsets, call.kv_offsets, spec.max_seqlen_kv,
        spec.mask.causal, spec.scale, spec.activation == "softmax", spec.output_scale,
        spec.normalization == "max_seqlen", default_config(call.q.shape[2]), schedule, out,
        lse,
    )  # fmt: skip


def attention_forward(
    call: AttentionCall,
    *,
    fast_math: bool = True,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the attention of :mod:`hyperrec.jagged_attn.spec`; returns ``(out, lse)``.

    ``out`` is ``(Tq, H, Dv)`` in the input dtype. ``lse`` (softmax only; an empty tensor
    otherwise) is ``(H, Tq)`` fp32: the base-2 log-sum-exp of ``log2(e) * s`` over each
    row's allowed keys, +inf for a row with none; the backward needs it.

    The spec's ``max_seqlen_q``/``max_seqlen_kv`` pick the configuration bucket (and
    ``max_seqlen_kv`` is HSTU's divisor); they never size the grid, and nothing is read
    from the device.
    ``fast_math`` evaluates tanh (silu, sigmoid, gelu_tanh) with the approximate hardware
    instruction (relative error ~2^-11, below the bf16 rounding of the weights).
    ``config`` pins a tile configuration (tests, tuning); default: the shipped table.
    """
    q, k, v, spec = call.q, call.k, call.v, call.spec
    total_q, n_heads = q.shape[0], q.shape[1]
    n_seq = call.q_offsets.shape[0] - 1
    softmax = spec.activation == "softmax"
    out = torch.empty((total_q, n_heads, v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((n_heads, total_q) if softmax else (0,), dtype=torch.float32,
                      device=q.device)  # fmt: skip
    signature = _signature(call, fast_math, config)
    plan = _FWD_PLANS.get(signature)
    if plan is None:
        plan = _remember(_FWD_PLANS, signature, _forward_plan(call, out, fast_math, config))
    assert k.shape[0] == v.shape[0], "k and v must have the same number of tokens"
    # The public layer's deferred value check (``_validate.DeviceCheck``): fused into the
    # schedule build below when this call builds one, else run before any kernel.
    check = take_pending_check()
    cfg, kw = plan.cfg, plan.kw
    packed = plan.packed is not None and _packable(call)
    empty = total_q == 0 or n_seq == 0
    if check is not None and (empty or packed):
        check.run()
        check = None
    if empty:
        return out, lse
    if _use_gluon(plan, spec, packed):
        # the Gluon kernel walks the same query-tile schedule, built with the value check
        # fused as for the Triton forward
        checks = [check] if check is not None else []
        schedule = _fwd_schedule(call, GLUON_BLOCK_M, "cost", checks=checks)
        if checks:
            checks[0].run()
        return _gluon_forward(call, schedule, out, lse)
    coef = _coef(spec)
    if packed:
        _forward_packed(call, plan.packed, coef, plan.ce, out, lse)
        return out, lse
    if kw["PREFETCH"]:
        if check is not None:
            check.run()
        q_offsets, kv_offsets, tile_meta, total = _fwd_schedule(
            call, cfg.block_m, cfg.work_order, prefetch=True
        )
        tile_seq = tile_idx = total  # not read
    else:
        checks = [check] if check is not None else []
        q_offsets, kv_offsets, tile_seq, tile_idx, total = _fwd_schedule(
            call, cfg.block_m, cfg.work_order, checks=checks
        )
        if checks:  # the schedule was cached (or not built by the fused kernel)
            checks[0].run()
        tile_meta = total  # not read
    kv_index, num_targets = as_int32(call.kv_index), as_int32(call.num_targets)
    # the dynamic schedule's shared item counter, zeroed for this launch
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if kw["DYNAMIC"] else total
    unused = total  # a valid pointer for arguments a variant never reads
    if plan.host_descs:
        tma, bd, bdv = kw["TMA"], kw["BLOCK_D"], kw["BLOCK_DV"]
        descs = (
            _descriptor(q, cfg.block_m, bd, bool(tma & _configs.TMA_Q)),
            _descriptor(k, cfg.block_n, bd, bool(tma & (_configs.TMA_KV | _configs.TMA_K_MASKED))),
            _descriptor(v, cfg.block_n, bdv, bool(tma & _configs.TMA_KV)),
            _descriptor(out, cfg.block_m, bdv, bool(tma & _configs.TMA_O)),
        )
    else:
        descs = (q, k, v, out)  # not read, or replaced by descriptors built in the kernel
        if kw["TMA"] and not interpreting():
            _ensure_allocator()
    args = (
        q, k, v, out, lse if softmax else out, *descs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), total_q, total_q, k.shape[0],
        q_offsets, kv_offsets, unused if kv_index is None else kv_index,
        unused if num_targets is None else num_targets, tile_seq, tile_idx, total, tile_meta,
        counter, _qk_scale(spec.activation, spec.scale), coef, *_Mask(call).ints(),
    )  # fmt: skip
    work = work_upper_bound(total_q, n_seq, cfg.block_m) * n_heads
    try:
        _launch_persistent(_kernels._fwd_kernel, work, q.device, cfg, plan.key, args, kw)
    except Exception as e:  # any compiler error
        if not kw["WARP_SPEC"] or plan.key in _OCCUPANCY:
            raise
        # Triton's warp specialisation rejects some loops on some versions and GPUs: build
        # the same kernel without it (once; later calls go straight there).
        _FAILED_BUILDS[plan.key] = f"{type(e).__name__}: {e}"[:500]
        _FWD_PLANS.clear()
        return attention_forward(call, fast_math=fast_math, config=cfg)
    return out, lse


def _coef(spec) -> float:
    """``output_scale`` times the ``"max_seqlen"`` normalisation (the per-sequence
    ``1 / Lk`` of ``"length"`` is applied in the kernels)."""
    coef = float(spec.output_scale)
    if spec.normalization == "max_seqlen":
        coef /= max(spec.max_seqlen_kv, 1)
    return coef


def _fwd_schedule(
    call: AttentionCall,
    block_m: int,
    order: str,
    prefetch: bool = False,
    checks: list[DeviceCheck] | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`forward_schedule` for ``call``'s offsets, maps and spec."""
    return forward_schedule(
        call.q_offsets, call.kv_offsets, call.kv_index, call.num_targets,
        causal=call.spec.mask.causal, total_q=call.q.shape[0],
        max_seqlen_kv=call.spec.max_seqlen_kv, block_m=block_m, order=order,
        prefetch=prefetch, checks=checks,
    )  # fmt: skip


def forward_schedule(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    *,
    causal: bool,
    total_q: int,
    max_seqlen_kv: int,
    block_m: int,
    order: str = "cost",
    prefetch: bool = False,
    checks: list[DeviceCheck] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(int32 q offsets, int32 kv offsets, the query-tile schedule of the forward or the dQ
    kernel...): one cache lookup per call (see :mod:`._schedule`). The Triton forward and
    the Gluon forward (``_gluon._launch``) share it, so both find one schedule per offsets
    object.

    ``checks``: at most one pending value check of this call. When the default schedule is
    built here (a new offsets object) the schedule kernel computes the check's flag, the
    check is asserted and removed from the list; otherwise it stays for the caller."""
    tensors = (q_offsets, kv_offsets, kv_index, num_targets)

    def build() -> tuple[torch.Tensor, ...]:
        if not prefetch and order == "cost":  # the default: one kernel launch
            upper = work_upper_bound(total_q, q_offsets.shape[0] - 1, block_m)
            check = checks.pop() if checks else None
            q32, kv32, *table = tile_schedule(
                q_offsets, kv_offsets, as_int32(kv_index), block_m, causal, upper, max_seqlen_kv,
                kv_tiles=False, check=None if check is None else check.args,
            )  # fmt: skip
            if check is not None:
                flag = table.pop()
                if flag is not None:  # else the schedule kernel asserted it itself
                    check.assert_flag(flag)
                else:
                    check.asserted_in_kernel()
            remember_int32(q_offsets, q32)
            remember_int32(kv_offsets, kv32)
            return (q32, kv32, *table)
        qo32, kvo32 = as_int32(q_offsets), as_int32(kv_offsets)
        ki32, nt32 = as_int32(kv_index), as_int32(num_targets)
        schedule: tuple[torch.Tensor, ...]
        if prefetch:
            schedule = q_tile_meta(qo32, kvo32, ki32, nt32, block_m, causal, total_q, order)
        else:
            schedule = q_tile_schedule(qo32, kvo32, ki32, block_m, causal, total_q, order)
        return (qo32, kvo32, *schedule)

    return cached_schedule(tensors, ("fwd", block_m, causal, total_q, order, prefetch), build)


def _packable(call: AttentionCall) -> bool:
    """Self-attention (one offsets tensor for queries and keys) with at most a causal mask:
    what the packed-rows forward computes."""
    qo, ko = call.q_offsets, call.kv_offsets
    same = qo is ko or (qo.data_ptr() == ko.data_ptr() and qo.shape == ko.shape
                        and qo.stride() == ko.stride() and qo.dtype == ko.dtype)  # fmt: skip
    return (same and call.kv_index is None and call.num_targets is None
            and call.q.shape[0] == call.k.shape[0] and not _Mask(call).generic)  # fmt: skip


def _forward_packed(call, cfg, coef, ce, out, lse) -> None:
    """The forward of ``KernelConfig.pack_rows`` (see ``_kernels._fwd_packed_kernel``)."""
    q, k, v, spec = call.q, call.k, call.v, call.spec
    total_q, n_heads, head_dim = q.shape
    head_dim_v = v.shape[2]
    offsets = as_int32(call.q_offsets)
    rows = row_sequence(offsets, total_q)
    softmax = spec.activation == "softmax"
    args = (
        q, k, v, out, lse if softmax else out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), total_q, total_q, offsets, rows,
        _qk_scale(spec.activation, spec.scale), coef,
    )  # fmt: skip
    kw = dict(
        CAUSAL=spec.mask.causal, H=n_heads, ACT=ce["ACT"], NORM=ce["NORM"], HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v, BLOCK_D=_pow2(head_dim), BLOCK_DV=_pow2(head_dim_v),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FAST=ce["FAST"],
    )  # fmt: skip
    work = triton.cdiv(total_q, cfg.block_m) * n_heads
    key = ("fwd_packed", q.dtype, cfg, tuple(sorted(kw.items())))
    _launch_persistent(_kernels._fwd_packed_kernel, work, q.device, cfg, key, args, kw)


def forward_build_failures() -> dict[tuple[object, ...], str]:
    """Forward builds that failed with warp specialisation (and ran without it)."""
    return dict(_FAILED_BUILDS)


def attention_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    call: AttentionCall,
    *,
    fast_math: bool = True,
    deterministic: bool = False,
    config_dkdv: KernelConfig | None = None,
    config_dq: KernelConfig | None = None,
    recompute_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`attention_forward`: ``(dq, dk, dv)`` in the input dtype.

    ``recompute_stats`` (softmax): do not read ``out`` and ``lse``; recompute them from
    these inputs (:data:`STATS_BY_FORWARD`): by running :func:`attention_forward` first
    (where the Gluon backward serves the call), or in the dQ kernel, which first
    recomputes each row's log-sum-exp and ``delta = rowsum(P * dP)`` from the backward's
    own scores (one more pass over the keys: two more GEMMs per tile pair) with the dK/dV
    kernel after it. Needed when ``out`` and ``lse`` come from another computation
    than these inputs' scores (the FP8 forward): the softmax gradient is only right when
    its ``P``, ``lse`` and ``delta`` agree; with the FP8 forward's on inputs with outlier
    channels, dQ's SNR fell to 9 dB.

    ``out`` and ``lse`` are the forward's outputs (``lse`` is only read for softmax).
    dK and dV are accumulated in fp32 registers by one program per key tile and written
    once. dQ is accumulated in fp32 too, in one of two ways chosen by the dK/dV
    configuration (``KernelConfig.dq_atomic``): in registers by a second kernel over query
    tiles (deterministic), or by atomic fp32 adds from the dK/dV kernel into a zeroed buffer
    (fewer GEMMs; the summation order, hence the last bits, may vary from run to run).
    ``deterministic=True`` forces the first. With a ``kv_index`` that maps several query
    sequences to one kv sequence, their dK/dV contributions are summed inside one program;
    keys that no query reads get zero gradients.
    """
    q, k, v, spec = call.q, call.k, call.v, call.spec
    scale = spec.scale
    total_q, n_heads = q.shape[0], q.shape[1]
    n_seq = call.q_offsets.shape[0] - 1
    n_kv_seq = call.kv_offsets.shape[0] - 1
    softmax = spec.activation == "softmax"
    signature = _signature(call, fast_math, deterministic, config_dkdv, config_dq)
    plan = _BWD_PLANS.get(signature)
    if plan is None:
        plan = _remember(_BWD_PLANS, signature, _backward_plan(
            call, fast_math, deterministic, config_dkdv, config_dq))  # fmt: skip
    assert k.shape[0] == v.shape[0], "k and v must have the same number of tokens"
    assert grad_out.shape == out.shape == (total_q, n_heads, v.shape[2]), "grad_out/out shape"
    assert grad_out.dtype == q.dtype, "grad_out must have the input dtype"
    if softmax:
        assert lse.shape == (n_heads, total_q) and lse.dtype == torch.float32, "lse shape"
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if total_q == 0 or n_seq == 0 or n_kv_seq == 0:
        # Before the stride check: an empty grad_out (B = 0, or only empty query sequences)
        # may have any strides (autograd expands the gradient of a sum with stride 0), and
        # nothing is read from it here.
        return dq.zero_(), dk.zero_(), dv.zero_()
    assert grad_out.stride(2) == 1 and out.stride(2) == 1, "grad_out/out: last dim contiguous"
    if plan.descriptors:
        if not _tma_ready(grad_out):
            # (autograd's gradients are fresh packed tensors; a view gets one copy)
            grad_out = grad_out.clone(memory_format=torch.contiguous_format)
        if not interpreting():
            _ensure_allocator()
    coef = _coef(spec)
    mask_ints = _Mask(call).ints()
    qk_scale = _qk_scale(spec.activation, scale)
    if softmax and recompute_stats and _stats_by_forward(plan, spec):
        # The forward on these inputs gives the backward a consistent lse and out (two
        # GEMMs per tile pair, like the dQ kernel's ``STATS`` pass, but at the Gluon
        # forward's rate); then the Gluon dK/dV and dQ kernels, which have no stats pass.
        out, lse = attention_forward(call, fast_math=fast_math)
        recompute_stats = False
    if softmax and recompute_stats:
        # The dQ kernel (``STATS``) writes the log-sum-exp and delta it recomputed, then
        # dK/dV (never with atomic dQ) reads them. Rows no query tile covers keep +inf / 0:
        # P = 0 and dS = 0 there.
        stats = torch.full((n_heads, total_q), float("inf"), dtype=torch.float32,
                           device=q.device)  # fmt: skip
        delta = torch.zeros_like(stats)
        rest = (stats.stride(0), qk_scale, scale, coef, mask_ints)
        _launch_dq(call, plan, grad_out, stats, delta, dq, plan.dq_stats_kw,
                   plan.dq_stats_key, *rest)  # fmt: skip
        _launch_dkdv(call, plan, grad_out, stats, delta, dk, dv, dq, plan.dkdv_stats_kw,
                     plan.dkdv_stats_key, *rest)  # fmt: skip
        return dq, dk, dv
    if softmax:
        delta = torch.empty_like(lse)
        _direct.launch(
            _kernels._bwd_delta_kernel, (triton.cdiv(total_q, _DELTA_ROWS), n_heads),
            ("delta", signature),
            (out, grad_out, delta, out.stride(0), out.stride(1), grad_out.stride(0),
             grad_out.stride(1), delta.stride(0), total_q), plan.delta_kw, {},
        )  # fmt: skip
        lse_arg, delta_arg, stride_lh = lse, delta, lse.stride(0)
    else:
        lse_arg = delta_arg = grad_out  # never read
        stride_lh = 0
    rest = (stride_lh, qk_scale, scale, coef, mask_ints)

    if plan.gluon and gluon_bwd_requested(spec):
        if not _tma_ready(grad_out):
            grad_out = grad_out.clone(memory_format=torch.contiguous_format)
        if _gluon_fused_dq(call) and not deterministic:
            # dQ's shares added by the dK/dV kernel into a zeroed fp32 buffer (in an order
            # that varies between runs: not with ``deterministic``)
            dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            _gluon_dkdv(call, grad_out, lse_arg, delta_arg, dk, dv, qk_scale, scale, coef,
                        dq_accum=dqa)  # fmt: skip
            return dq.copy_(dqa.mul_(scale)), dk, dv
        _gluon_dkdv(call, grad_out, lse_arg, delta_arg, dk, dv, qk_scale, scale, coef)
        if not _gluon_dq(call, grad_out, lse_arg, delta_arg, dq, qk_scale, scale, coef):
            _launch_dq(call, plan, grad_out, lse_arg, delta_arg, dq, plan.dq_kw, plan.dq_key,
                       *rest)  # fmt: skip
        return dq, dk, dv

    # dK, dV: one work item per key tile. With ``dq_atomic`` the same programs also add each
    # tile's share of dQ into a zeroed fp32 buffer, and the dQ kernel is skipped.
    dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if plan.dq_atomic else dq
    _launch_dkdv(call, plan, grad_out, lse_arg, delta_arg, dk, dv, dqa, plan.dkdv_kw,
                 plan.dkdv_key, *rest)  # fmt: skip
    if plan.dq_atomic:
        return dqa.mul_(scale).to(q.dtype), dk, dv
    _launch_dq(call, plan, grad_out, lse_arg, delta_arg, dq, plan.dq_kw, plan.dq_key, *rest)
    return dq, dk, dv


#: How ``attention_backward(..., recompute_stats=True)`` gets the softmax statistics:
#: ``True``: a forward on the same inputs (its ``out`` and ``lse``), then the ordinary
#: backward; ``False``: the Triton dQ kernel's ``STATS`` pass, then the Triton dK/dV
#: kernel; ``None`` (default): the forward wherever the Gluon backward serves the call.
#: One H200, the FP8 forward's training step (2026-12-04, 8 cases,
#: ``bench/results/fp8_h200_2026-12-04_gluon_bwd_part{1,2}.json``): 0.66-0.84x the bf16
#: step this way, 0.49-0.69x through the stats pass in the same run. Read at every call;
#: a switch for tests and benchmarks.
STATS_BY_FORWARD: bool | None = None


def _stats_by_forward(plan: _BackwardPlan, spec: AttentionSpec) -> bool:
    if STATS_BY_FORWARD is not None:
        return STATS_BY_FORWARD
    return plan.gluon and gluon_bwd_requested(spec)


# what ``_kv_schedule`` reads of a configuration: the Gluon dK/dV kernel's key-tile rows
_GLUON_KEY_TILES = KernelConfig(block_m=64, block_n=GLUON_BWD_BLOCK_N, num_warps=4,
                                num_stages=1)  # fmt: skip


def _gluon_dkdv(call, grad_out, lse, delta, dk, dv, qk_scale, scale, coef,
                dq_accum=None) -> None:  # fmt: skip
    """dK and dV by the Gluon kernel (a call :func:`gluon_unsupported` accepts); with
    ``dq_accum``, dQ's unscaled shares added into it too (:func:`_gluon_fused_dq`)."""
    from hyperrec.jagged_attn._gluon._bwd_launch import run_dkdv

    softmax = call.spec.activation == "softmax"
    run_dkdv(
        call.q, call.k, call.v, grad_out, lse, delta, dk, dv,
        _kv_schedule(call, _GLUON_KEY_TILES), causal=call.spec.mask.causal, softmax=softmax,
        qk_scale=qk_scale, coef=coef, dk_scale=scale, dq_accum=dq_accum,
    )  # fmt: skip


def _gluon_fused_dq(call) -> bool:
    """Whether the Gluon dK/dV kernel computes dQ too (``_gluon._bwd_launch.DQ_KERNEL ==
    "fused"`` and a call it supports)."""
    from hyperrec.jagged_attn._gluon import _bwd_launch

    return _dq_kernel() == "fused" and _bwd_launch.fused_dq_supported(
        call.q.shape[2], call.spec.activation == "softmax"
    )


def _dq_kernel() -> str:
    """``_gluon._bwd_launch.DQ_KERNEL``, checked (a misspelt value would otherwise pick a
    kernel silently)."""
    from hyperrec.jagged_attn._gluon import _bwd_launch

    value = _bwd_launch.DQ_KERNEL
    if value not in ("gluon", "triton", "fused"):
        raise ValueError(
            f"_bwd_launch.DQ_KERNEL must be 'gluon', 'triton' or 'fused', got {value!r}"
        )
    return value


def _gluon_dq(call, grad_out, lse, delta, dq, qk_scale, scale, coef) -> bool:
    """dQ by the Gluon kernel, unless ``_gluon._bwd_launch.DQ_KERNEL`` says ``"triton"``
    (then nothing is launched and False returned). With ``"fused"``, the calls the fused
    kernel does not support come here."""
    from hyperrec.jagged_attn._gluon import _bwd_launch

    if _dq_kernel() == "triton":
        return False
    softmax = call.spec.activation == "softmax"
    _bwd_launch.run_dq(
        call.q, call.k, call.v, grad_out, lse, delta, dq,
        _fwd_schedule(call, GLUON_BLOCK_M, "cost"), causal=call.spec.mask.causal,
        softmax=softmax, qk_scale=qk_scale, coef=coef,
        dq_scale=scale,
    )  # fmt: skip
    return True


def _launch_dkdv(call, plan, grad_out, lse, delta, dk, dv, dqa, kw, key, stride_lh, qk_scale,
                 scale, coef, mask_ints) -> None:  # fmt: skip
    """The dK/dV kernel (one work item per key tile) of :func:`attention_backward`."""
    q, k, v = call.q, call.k, call.v
    cfg = plan.dkdv_cfg
    q_offsets, kv_offsets, tile_seq, tile_idx, total, inv_ptr, inv_idx = _kv_schedule(call, cfg)
    num_targets = as_int32(call.num_targets)
    args = (
        q, k, v, grad_out, lse, delta, dk, dv, dqa,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), dqa.stride(0), dqa.stride(1), stride_lh,
        q_offsets, kv_offsets, inv_ptr, inv_idx, total if num_targets is None else num_targets,
        tile_seq, tile_idx, total, qk_scale, scale, coef, *mask_ints, q.shape[0],
    )  # fmt: skip
    work = work_upper_bound(k.shape[0], call.kv_offsets.shape[0] - 1, cfg.block_n) * q.shape[1]
    _launch_persistent(_kernels._bwd_dkdv_kernel, work, q.device, cfg, key, args, kw)


def _launch_dq(call, plan, grad_out, lse, delta, dq, kw, key, stride_lh, qk_scale, scale, coef,
               mask_ints) -> None:  # fmt: skip
    """The dQ kernel (the forward's schedule: one work item per query tile)."""
    q, k, v = call.q, call.k, call.v
    cfg = plan.dq_cfg
    q_offsets, kv_offsets, tile_seq, tile_idx, total = _fwd_schedule(call, cfg.block_m, "cost")
    kv_index, num_targets = as_int32(call.kv_index), as_int32(call.num_targets)
    args = (
        q, k, v, grad_out, lse, delta, dq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), stride_lh,
        q_offsets, kv_offsets, total if kv_index is None else kv_index,
        total if num_targets is None else num_targets, tile_seq, tile_idx, total,
        qk_scale, scale, coef, *mask_ints, k.shape[0],
    )  # fmt: skip
    work = work_upper_bound(q.shape[0], call.q_offsets.shape[0] - 1, cfg.block_m) * q.shape[1]
    _launch_persistent(_kernels._bwd_dq_kernel, work, q.device, cfg, key, args, kw)


# Token rows per program of the softmax backward's row-sum kernel.
_DELTA_ROWS = 64


@dataclass(frozen=True)
class _BackwardPlan:
    """The backward's decisions for one call signature (see :class:`_ForwardPlan`)."""

    delta_kw: dict[str, Any]
    dkdv_cfg: KernelConfig
    dkdv_kw: dict[str, Any]
    dkdv_key: _Key
    dq_atomic: bool
    dq_cfg: KernelConfig
    dq_kw: dict[str, Any]
    dq_key: _Key
    # ``recompute_stats``: the dQ kernel with ``STATS`` first, then dK/dV without atomics
    dq_stats_kw: dict[str, Any]
    dq_stats_key: _Key
    dkdv_stats_kw: dict[str, Any]
    dkdv_stats_key: _Key
    # some kernel reads through in-kernel tensor descriptors (``KernelConfig.bwd_tma``)
    descriptors: bool
    # the Gluon backward kernels can compute this call (``gluon_unsupported``)
    gluon: bool


def _backward_plan(call, fast_math, deterministic, config_dkdv, config_dq) -> _BackwardPlan:
    _check_inputs(call)
    q, v = call.q, call.v
    head_dim, head_dim_v, n_heads = q.shape[2], v.shape[2], q.shape[1]
    bd, bdv = _pow2(head_dim), _pow2(head_dim_v)
    _, ce = _common(call, fast_math)
    dkdv = _pick("dkdv", call, config_dkdv)
    dq_atomic = dkdv.dq_atomic and not deterministic
    descriptors = _backward_descriptors_ok(call)
    dkdv_tma = dkdv.bwd_tma and descriptors
    dkdv_kw = dict(
        H=n_heads, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=bd, BLOCK_DV=bdv,
        BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n, DQ_ATOMIC=dq_atomic, **ce,
    )  # fmt: skip
    if dkdv_tma:
        # The interpreter has no bulk reduce (nor do Tritons whose descriptors lack
        # ``atomic_add``): there the atomic dQ stays per element.
        bulk = hasattr(getattr(tl, "tensor_descriptor", None), "atomic_add")
        dkdv_kw.update(TMA=True, TMA_REDUCE=dq_atomic and bulk and not interpreting())
    dq = _pick("dq", call, config_dq)
    dq_kw = dict(
        H=n_heads, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=bd, BLOCK_DV=bdv,
        BLOCK_M=dq.block_m, BLOCK_N=dq.block_n, **ce,
    )  # fmt: skip
    if dq.bwd_tma and descriptors:
        dq_kw.update(TMA=True)
    dq_key = _Key(("dq", q.dtype, dq, tuple(sorted(dq_kw.items()))))
    dkdv_key = _Key(("dkdv", q.dtype, dkdv, tuple(sorted(dkdv_kw.items()))))
    return _BackwardPlan(
        delta_kw=dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=bdv, BLOCK_T=_DELTA_ROWS),
        dkdv_cfg=dkdv, dkdv_kw=dkdv_kw, dkdv_key=dkdv_key,
        dq_atomic=dq_atomic, dq_cfg=dq, dq_kw=dq_kw, dq_key=dq_key,
        dq_stats_kw=dict(dq_kw, STATS=True), dq_stats_key=_Key((*dq_key, "stats")),
        dkdv_stats_kw=dict(dkdv_kw, DQ_ATOMIC=False, TMA_REDUCE=False),
        dkdv_stats_key=_Key((*dkdv_key, "stats")),
        descriptors=dkdv_tma or bool(dq_kw.get("TMA")), gluon=gluon_eligible(call),
    )  # fmt: skip


def _descriptors_usable(tensors: tuple[torch.Tensor, ...], head_dims: tuple[int, int]) -> bool:
    """Whether kernels may read ``tensors`` through tensor descriptors: Hopper's TMA (or
    the interpreter), power-of-two head dims, packed and 16-byte aligned rows."""
    device = tensors[0].device
    if interpreting():
        ok = True
    elif device.type == "cuda":
        ok = bool(hopper_features(device.index).get("tma", False))
    else:
        ok = False
    return ok and all(d == _pow2(d) for d in head_dims) and _tma_ready(*tensors)


def _backward_descriptors_ok(call: AttentionCall) -> bool:
    """:func:`_descriptors_usable` for the backward's q, k, v, unless switched off by
    :data:`BWD_TMA_ENV` (``"0"``)."""
    if os.environ.get(BWD_TMA_ENV, "1") == "0":
        return False
    return _descriptors_usable((call.q, call.k, call.v), (call.q.shape[2], call.v.shape[2]))


def _kv_schedule(call: AttentionCall, cfg: KernelConfig) -> tuple[torch.Tensor, ...]:
    """(int32 q offsets, int32 kv offsets, the dK/dV kernel's key-tile schedule...): one
    cache lookup per call."""
    causal, total_kv = call.spec.mask.causal, call.k.shape[0]
    tensors = (call.q_offsets, call.kv_offsets, call.kv_index)

    def build():
        if call.kv_index is None:  # one kernel launch
            upper = work_upper_bound(total_kv, call.kv_offsets.shape[0] - 1, cfg.block_n)
            q32, kv32, tile_seq, tile_idx, total = tile_schedule(
                call.q_offsets, call.kv_offsets, None, cfg.block_n, causal, upper,
                call.spec.max_seqlen_q, kv_tiles=True,
            )  # fmt: skip
            remember_int32(call.q_offsets, q32)
            remember_int32(call.kv_offsets, kv32)
            # (no map: the kernel never reads the inverse map; any valid pointer will do)
            return q32, kv32, tile_seq, tile_idx, total, total, total
        q_offsets, kv_offsets = as_int32(call.q_offsets), as_int32(call.kv_offsets)
        kv_index = as_int32(call.kv_index)
        return (q_offsets, kv_offsets,
                *kv_tile_schedule(q_offsets, kv_offsets, kv_index, cfg.block_n, causal,
                                  total_kv))  # fmt: skip

    return cached_schedule(tensors, ("kv", cfg.block_n, causal, total_kv), build)
