"""Launchers of the FP8 / MXFP8 forward (quantize Q/K/V, pick a configuration, launch) and
of the FP8 backward (``FP8Config(backward="fp8")``).

Like :mod:`hyperrec.jagged_attn._triton._launch` (whose argument checks, mask flags and
schedules these reuse), each function takes validated input and only asserts its own
preconditions. Nothing here reads a length on the host.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import triton

from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton import _fp8_bwd_kernels, _fp8_kernels, interpreting
from hyperrec.jagged_attn._triton._configs import KernelConfig
from hyperrec.jagged_attn._triton._launch import (
    _arch,
    _check_inputs,
    _common,
    _ensure_allocator,
    _fwd_schedule,
    _Key,
    _kv_schedule,
    _launch_persistent,
    _long,
    _Mask,
    _pick,
    _qk_scale,
    _switch,
    _tma_ready,
    gluon_unsupported,
    occupancy_estimate,
)
from hyperrec.jagged_attn._triton._probe import hopper_features
from hyperrec.jagged_attn._triton._schedule import (
    _cached,
    as_int32,
    q_tile_schedule,
    work_upper_bound,
)
from hyperrec.jagged_attn.fp8 import (
    GRAD_GROUP,
    FP8Config,
    QuantizedJagged,
    QuantizedQKV,
    hadamard_scale,
)
from hyperrec.jagged_attn.reference_fp8 import (
    cols_width,
    fwht,
    hadamard_signs,
    pad_offsets,
    smoothing_shift,
)

__all__ = [
    "FP8_BWD_ROTATE_IN_KERNEL",
    "FP8_BWD_TRANSPOSED_B",
    "FP8_TMA",
    "FP8_TUNED",
    "GLUON_FP8_DEFAULT",
    "GLUON_FP8_ENV",
    "QUANT_NUM_WARPS",
    "attention_backward_fp8",
    "attention_forward_fp8",
    "gluon_fp8_unsupported",
    "key_mean",
    "quantize_grad_operands",
    "qkv_buffers",
    "quantize_qkv",
    "rceil_e4m3",
    "select_fp8_config",
]


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _rceil_constants(max_value: float) -> tuple[int, int]:
    """``(ADD, ODD)`` of the division-free RCEIL byte (``_fp8_kernels._e8m0_byte``) for an
    element format whose largest value is ``max_value = c * 2**emax`` (``1 <= c < 2``).

    ``amax = m * 2**E`` divided by ``max_value`` rounds above ``2**(E - emax)`` exactly when
    ``m > c``: with ``T`` the mantissa bits of ``c``, adding ``2**23 - 1 - T`` to amax's
    bits carries into the exponent field precisely then, and subtracting ``emax << 23``
    yields the biased scale exponent. ``ODD`` is the one amax above ``max_value * 2**-127``
    whose quotient rounds *down* to ``2**-127`` in the float32 subnormal range (the next
    float32 after ``max_value * 2**-127``), whose byte is 0, not 1.
    """
    mant, emax = math.frexp(max_value)  # max_value = mant * 2**emax, 0.5 <= mant < 1
    emax -= 1
    t = int((mant * 2 - 1) * 2**23)
    return (1 << 23) - 1 - t - (emax << 23), (emax << 23) | (t + 1)


def _device_signs(n: int, seed: int, device: torch.device) -> torch.Tensor:
    key = ("signs", n, seed, str(device))
    hit = _SIGNS.get(key)
    if hit is None:
        hit = _SIGNS[key] = hadamard_signs(n, seed).to(device)
    return hit


_SIGNS: dict[tuple[str, int, int, str], torch.Tensor] = {}


def _padded(offsets: torch.Tensor, pad: int) -> torch.Tensor:
    return _cached((offsets,), ("vpad", pad), lambda: pad_offsets(offsets, pad))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def qkv_buffers(
    total_q: int,
    total_kv: int,
    n_kv: int,
    heads: int,
    dim: int,
    dim_v: int,
    kv_offsets: torch.Tensor,
    config: FP8Config,
    device: torch.device,
    v_mma_order: bool = False,
) -> QuantizedQKV:
    """Empty Q/K/V buffers in the layout of :class:`QuantizedQKV` for ``config`` (V's
    padded column offsets computed from the int32 ``kv_offsets``, cached per object)."""
    width = cols_width(total_kv, n_kv, config.v_pad)
    qd = torch.empty((total_q, heads, dim), dtype=torch.uint8, device=device)
    kd = torch.empty((total_kv, heads, dim), dtype=torch.uint8, device=device)
    vd = torch.empty((heads, dim_v, width), dtype=torch.uint8, device=device)
    if config.mx:
        qs = torch.empty((total_q, heads, dim // 32), dtype=torch.uint8, device=device)
        ks = torch.empty((total_kv, heads, dim // 32), dtype=torch.uint8, device=device)
        vs = torch.empty((heads, dim_v, width // 32), dtype=torch.uint8, device=device)
    else:
        qs = torch.empty((total_q, heads), dtype=torch.float32, device=device)
        ks = torch.empty((total_kv, heads), dtype=torch.float32, device=device)
        vs = torch.empty((total_kv, heads), dtype=torch.float32, device=device)
    e4m3 = torch.float8_e4m3fn
    return QuantizedQKV(
        q=QuantizedJagged(data=qd.view(e4m3), scale=qs, layout="rows"),
        k=QuantizedJagged(data=kd.view(e4m3), scale=ks, layout="rows"),
        v=QuantizedJagged(
            data=vd.view(e4m3),
            scale=vs,
            layout="cols",
            pad_offsets=_padded(kv_offsets, config.v_pad),
            mma_order=v_mma_order,
        ),  # fmt: skip
        config=config,
    )


def rceil_e4m3(config: FP8Config) -> tuple[int, int]:
    """The kernels' ``(ADD, ODD)`` constants: MX's E8M0 rule for E4M3, zeros for "fp8"."""
    if not config.mx:
        return 0, 0
    from hyperrec.jagged_attn.fp8 import mxfp8_module

    return _rceil_constants(mxfp8_module().E4M3.max_value)


#: Warps of the Q/K/V quantization launch; ``None``: 4 for tiles of up to 16,384 elements,
#: else 8. At 128 tokens x D = 128, 4 warps took 0.50-0.52 ms for 65,536 tokens x 8 heads
#: on an H200 against 0.66-0.78 ms with the 8 used before (2, 16: 0.65-0.80;
#: ``bench/results/fp8_quant_probe_h200_2026-12-02.json``, ``bench/fp8_bwd_probe.py
#: --part quant``); larger tiles (D = 256) keep 8, untimed.
QUANT_NUM_WARPS: int | None = None


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    config: FP8Config,
    *,
    key_shift: torch.Tensor | None = None,
    v_mma_order: bool = False,
) -> QuantizedQKV:
    """Q, K, V in the FP8 layout of :class:`~hyperrec.jagged_attn.fp8.QuantizedJagged`, one
    kernel launch; bit-exact against :func:`hyperrec.jagged_attn.reference_fp8.quantize_qkv`
    (columns between V's sequences are left unwritten). ``key_shift`` ``(Bk, H, D)``: row
    ``b`` is subtracted from kv sequence ``b``'s keys first. ``v_mma_order`` (``"fp8"``
    only): V's tokens in the Gluon FP8 forward's order (``QuantizedJagged.mma_order``)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    total_q, heads, dim = q.shape
    total_kv, dim_v = k.shape[0], v.shape[2]
    device = q.device
    mx = config.mx
    assert not (mx and v_mma_order), "v_mma_order is for format 'fp8' only"
    n_kv = kv_offsets.numel() - 1
    qo, ko = as_int32(q_offsets), as_int32(kv_offsets)
    out = qkv_buffers(total_q, total_kv, n_kv, heads, dim, dim_v, ko, config, device, v_mma_order)
    qd, kd, vd = (t.data.view(torch.uint8) for t in (out.q, out.k, out.v))
    qs, ks, vs = out.q.scale, out.k.scale, out.v.scale
    poff = out.v.pad_offsets
    add, odd = rceil_e4m3(config)
    if mx:
        tile_q = group_q = tile_kv = group_kv = 32
    else:
        group_q, tile_q = config.q_block, max(config.q_block, 32)
        group_kv = tile_kv = config.kv_block
    if heads == 0 or (total_q == 0 and total_kv == 0):
        return out
    q_seq, q_idx, q_tot = q_tile_schedule(qo, qo, None, tile_q, False, total_q)
    kv_seq, kv_idx, kv_tot = q_tile_schedule(ko, ko, None, tile_kv, False, total_kv)
    tiles = max(work_upper_bound(total_q, qo.numel() - 1, tile_q),
                work_upper_bound(total_kv, n_kv, tile_kv))  # fmt: skip
    rotate = config.rotates(dim)
    signs = _device_signs(dim, config.hadamard_seed, device) if rotate else qs
    # scale strides: rows (T, H[, D/32]) -> (row, head); V MX (H, Dv, Tp/32) -> (d, head)
    vs_strides = (vs.stride(1), vs.stride(0)) if mx else (vs.stride(0), vs.stride(1))
    shift = qs if key_shift is None else key_shift.contiguous()
    _fp8_kernels._quant_qkv_kernel[(tiles, heads, 3)](
        q, k, v, qd, kd, vd, qs, ks, vs, signs, shift, qo, ko, poff,
        q_seq, q_idx, q_tot, kv_seq, kv_idx, kv_tot,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        qd.stride(0), qd.stride(1), kd.stride(0), kd.stride(1), vd.stride(1), vd.stride(0),
        qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), *vs_strides,
        D=dim, BD=_pow2(dim), DV=dim_v, BDV=_pow2(dim_v),
        TILE_Q=tile_q, GROUP_Q=group_q, TILE_KV=tile_kv, GROUP_KV=group_kv,
        MODE_QK=1 if mx else 0, MODE_V=2 if mx else 0, POW2=config.scale_rule == "pow2",
        HADAMARD=rotate, LOG2D=max(dim.bit_length() - 1, 0), ADD=add, ODD=odd,
        HAS_SHIFT=key_shift is not None, V_MMA_ORDER=v_mma_order,
        num_warps=QUANT_NUM_WARPS or (4 if tile_q * dim <= 16384 else 8),
    )  # fmt: skip
    return out


def key_mean(k: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """:func:`hyperrec.jagged_attn.fp8.key_shift` in one launch (``(B, H, D / 32)``
    programs)."""
    k = _last_dim_contiguous(k)
    heads, dim = k.shape[1], k.shape[2]
    ko = as_int32(kv_offsets)
    n_seq = ko.numel() - 1
    out = torch.empty((n_seq, heads, dim), dtype=torch.float64, device=k.device)
    if n_seq > 0 and heads > 0:
        _fp8_kernels._key_mean_kernel[(n_seq, heads, triton.cdiv(dim, 32))](
            k, out, ko, k.stride(0), k.stride(1), D=dim, COLS=32, ROWS=64, num_warps=4,
        )  # fmt: skip
    return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------

#: FP8 forward tiles by (arch, padded head dim, format, length bucket): ``block_m``,
#: ``num_warps``, ``num_stages`` (``block_n`` is the config's P tile). Timed on an H200 at
#: D = 128 only (``bench/bench_fp8.py --sweep``, 2026-12-01: 64 rows / 4 warps / 3 stages
#: with descriptors was the fastest of the tiles tried at lengths 2,048-8,192; the short
#: bucket copies it untimed); the other head dims keep tiles chosen by analogy.
FP8_TUNED: dict[tuple[str, int, str, str], tuple[int, int, int]] = {
    ("sm90", 64, "fp8", "short"): (128, 4, 3),
    ("sm90", 64, "fp8", "long"): (128, 4, 3),
    ("sm90", 128, "fp8", "short"): (64, 4, 3),
    ("sm90", 128, "fp8", "long"): (64, 4, 3),
    ("sm90", 256, "fp8", "short"): (64, 8, 2),
    ("sm90", 256, "fp8", "long"): (64, 8, 2),
    ("sm90", 128, "mxfp8", "short"): (64, 4, 3),
    ("sm90", 128, "mxfp8", "long"): (128, 8, 3),
}

#: (arch, padded head dim) whose ``"fp8"`` forward reads K/V through tensor descriptors by
#: default (H200, D = 128: 1.9-2.6x the pointer loads' kernel time; D = 64 ran the GPU
#: tests with them; other head dims and MX tiles keep pointer loads until run on a GPU).
FP8_TMA = frozenset({("sm90", 64), ("sm90", 128)})


def select_fp8_config(arch: str, head_dim: int, config: FP8Config, max_seqlen: int) -> KernelConfig:
    """The forward tile configuration: the table, else a safe default (the interpreter
    gets small tiles)."""
    n = config.tile_n
    if arch == "interpreter":
        return KernelConfig(block_m=16, block_n=n, num_warps=4, num_stages=1)
    d = max(32, _pow2(head_dim))
    bucket = "short" if max_seqlen <= 256 else "long"
    bm, warps, stages = FP8_TUNED.get((arch, d, config.format, bucket), (64, 4, 2))
    tma = (arch, d) in FP8_TMA and not config.mx
    return KernelConfig(block_m=bm, block_n=n, num_warps=warps, num_stages=stages, tma=tma)


#: Environment variable that chooses the Gluon FP8 forward (``_gluon/_fp8_kernel.py``) for
#: the ``"fp8"`` calls it serves (:func:`gluon_fp8_unsupported`): ``1`` every such call,
#: ``0`` never; unset (or ``auto``): when :data:`GLUON_FP8_DEFAULT` is on, for such calls
#: whose longest sequence exceeds ``_launch.GLUON_MIN_SEQLEN`` tokens.
GLUON_FP8_ENV = "JAGGED_ATTN_GLUON_FP8"
#: Whether the Gluon FP8 forward runs by default. On an H200 (kernel alone, three fresh
#: instances, 2026-12-04, ``bench/results/probe_gluon_fp8_h200_2026-12-04_packed_p.json``)
#: it ran at 1.54x the Triton FP8 kernel on causal 16 x 4,096 and 1.07-1.12x on non-causal
#: 32 x 2,048 and 8 x 8,192 softmax (before 0.2.19 packed P in place: 0.96x non-causal,
#: hence causal calls only until then); non-causal SiLU with HSTU's normalization
#: 1.14-1.23x, public call 1.10-1.14x (``probe_fp8_silu_h200_2026-12-04.json``; the
#: default for it since 0.2.21).
GLUON_FP8_DEFAULT = True


def gluon_fp8_unsupported(
    call: AttentionCall, config: FP8Config, qkv: QuantizedQKV | None, qk_scale: float,
    fast_math: bool = True, *, check_device: bool = True,
) -> str | None:  # fmt: skip
    """Why the Gluon FP8 forward cannot serve ``call``, or None: the Gluon bf16 forward's
    calls (:func:`~hyperrec.jagged_attn._triton._launch.gluon_unsupported`, whatever the
    layout of the unquantized inputs), ``"fp8"`` with 128-key P tiles and a positive
    scale, packed quantized operands, and fast math for SiLU (the kernel's tanh is the
    approximate instruction)."""
    why = gluon_unsupported(call, check_device=check_device, check_layout=False)
    if why is None and call.spec.activation != "softmax" and not fast_math:
        why = "fast_math=False with SiLU"
    if why is None:
        from hyperrec.jagged_attn._gluon._fp8_launch import fp8_unsupported

        why = fp8_unsupported(config, qkv, qk_scale)
    return why


def _use_gluon_fp8(
    call: AttentionCall,
    config: FP8Config,
    qkv: QuantizedQKV | None,
    qk_scale: float,
    fast_math: bool,
) -> bool:
    asked = _switch(GLUON_FP8_ENV)
    if asked is None:  # the default policy first: it is free, eligibility is not
        asked = GLUON_FP8_DEFAULT and _long(call.spec)
    return asked and gluon_fp8_unsupported(call, config, qkv, qk_scale, fast_math) is None


_SMS: dict[int, int] = {}
_OCCUPANCY: dict[tuple[object, ...], int] = {}


def _num_sms(device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return 2  # the interpreter runs programs one by one: a small grid tests striding
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def attention_forward_fp8(
    call: AttentionCall,
    config: FP8Config,
    *,
    qkv: QuantizedQKV | None = None,
    fast_math: bool = True,
    kernel_config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 forward of the attention of ``call``: ``(out, lse)`` as
    :func:`hyperrec.jagged_attn._triton._launch.attention_forward` returns them (``lse``
    from the FP8 scores, so the bf16 backward can use it).

    ``qkv`` passes operands quantized beforehand (by :func:`quantize_qkv` with ``config``
    and, for softmax, the key shift of
    :func:`~hyperrec.jagged_attn.reference_fp8.smoothing_shift`);
    ``kernel_config`` pins ``block_m``, warps and stages (``block_n`` must equal the P tile).
    """
    _check_inputs(call)
    q, spec = call.q, call.spec
    total_q, heads, dim = q.shape
    dim_v = call.v.shape[2]
    n_seq = call.q_offsets.numel() - 1
    softmax = spec.activation == "softmax"
    out = torch.empty((total_q, heads, dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q) if softmax else (0,), dtype=torch.float32, device=q.device)
    if total_q == 0 or n_seq == 0:
        return out, lse
    coef, ce = _common(call, fast_math)
    qk_scale = spec.scale / hadamard_scale(config, dim)
    if softmax:
        qk_scale *= math.log2(math.e)
    gluon = kernel_config is None and _use_gluon_fp8(call, config, qkv, qk_scale, fast_math)
    if qkv is None:
        shift = smoothing_shift(call.k, call.kv_offsets, spec, config)
        qkv = quantize_qkv(q, call.k, call.v, call.q_offsets, call.kv_offsets, config,
                           key_shift=shift, v_mma_order=gluon)  # fmt: skip
    elif qkv.v.mma_order and not gluon:
        raise ValueError("qkv.v is in mma_order, which only the Gluon FP8 forward reads")
    if gluon:
        from hyperrec.jagged_attn._gluon import _fp8_launch as gluon_fp8
        from hyperrec.jagged_attn._gluon._launch import _schedule

        schedule = _schedule(call.q_offsets, call.kv_offsets, spec.mask.causal, total_q,
                             spec.max_seqlen_kv)  # fmt: skip
        return gluon_fp8.run(qkv, causal=spec.mask.causal, qk_scale=qk_scale, coef=coef,
                             softmax=softmax, schedule=schedule, out=out, lse=lse)  # fmt: skip
    cfg = kernel_config or select_fp8_config(
        _arch(q.device), dim, config, max(spec.max_seqlen_q, spec.max_seqlen_kv)
    )
    assert cfg.block_n == config.tile_n, "block_n must equal the P tile of the config"
    q_offsets, kv_offsets = as_int32(call.q_offsets), as_int32(call.kv_offsets)
    kv_index, num_targets = as_int32(call.kv_index), as_int32(call.num_targets)
    tile_seq, tile_idx, total = q_tile_schedule(
        q_offsets, kv_offsets, kv_index, cfg.block_m, spec.mask.causal, total_q
    )
    q8, k8, v8 = qkv.q, qkv.k, qkv.v
    if config.mx:
        qs_strides = (q8.scale.stride(0), q8.scale.stride(1))
        ks_strides = (k8.scale.stride(0), k8.scale.stride(1))
        vs_strides = (v8.scale.stride(0), v8.scale.stride(1))  # (head, head dim)
    else:
        qs_strides = (q8.scale.stride(0), q8.scale.stride(1))
        ks_strides = (k8.scale.stride(0), k8.scale.stride(1))
        vs_strides = (0, 0)  # V scales share K's (T, H) layout and strides
    unused = total
    args = (
        q8.data, k8.data, v8.data, q8.scale, k8.scale, v8.scale, out, lse if softmax else out,
        q8.data.stride(0), q8.data.stride(1), k8.data.stride(0), k8.data.stride(1),
        v8.data.stride(0), v8.data.stride(1), *qs_strides, *ks_strides, *vs_strides,
        out.stride(0), out.stride(1), lse.stride(0) if softmax else 0,
        q_offsets, kv_offsets, v8.pad_offsets, unused if kv_index is None else kv_index,
        unused if num_targets is None else num_targets, tile_seq, tile_idx, total,
        qk_scale, coef, *_Mask(call).ints(), k8.data.shape[0], v8.data.shape[2],
    )  # fmt: skip
    # FP8 tensor-core products reduce over >= 32 elements: head dims pad up to 32.
    kw = dict(
        H=heads, HEAD_DIM=dim, HEAD_DIM_V=dim_v, BLOCK_D=max(32, _pow2(dim)),
        BLOCK_DV=max(32, _pow2(dim_v)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MX=config.mx, FMA=softmax and qk_scale > 0,
        **ce,
    )  # fmt: skip
    tma = _use_tma(cfg, config, k8.data, v8.data, kw["BLOCK_D"], kw["BLOCK_DV"], dim, dim_v)
    if tma:
        _ensure_allocator()
        kw["TMA"] = True
    work = work_upper_bound(total_q, n_seq, cfg.block_m) * heads
    key = (q.dtype, cfg, tuple(sorted(kw.items())))
    grid = (max(1, min(work, _num_sms(q.device) * _OCCUPANCY.get(key, 1))),)
    compiled = _fp8_kernels._fp8_fwd_kernel[grid](
        *args, **kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
    if key not in _OCCUPANCY and not interpreting() and q.device.type == "cuda":
        _OCCUPANCY[key] = _occupancy(compiled, cfg.num_warps, q.device)
    return out, lse


def _use_tma(
    cfg: KernelConfig,
    config: FP8Config,
    k8: torch.Tensor,
    vt8: torch.Tensor,
    block_d: int,
    block_dv: int,
    dim: int,
    dim_v: int,
) -> bool:
    """Whether the K/V tiles can go through tensor descriptors: asked for by ``cfg.tma``,
    ``"fp8"`` (MX tiles also need their scale tiles), unpadded power-of-two head dims,
    descriptors on this GPU (or the interpreter), and operands that :func:`_tma_ready`
    accepts; V is read as the 2-D ``(H * Dv, Tp)`` view, so its heads must be packed too."""
    if not cfg.tma or config.mx or dim != block_d or dim_v != block_dv:
        return False
    gpu_ok = k8.device.type == "cuda" and hopper_features(k8.device.index)["tma"]
    if not (interpreting() or gpu_ok):
        return False
    return _tma_ready(k8, vt8) and vt8.stride(0) == vt8.shape[1] * vt8.stride(1)


def _occupancy(compiled: Any, num_warps: int, device: torch.device) -> int:
    try:
        n_regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
    except (AttributeError, TypeError, ValueError):
        return 1
    p = torch.cuda.get_device_properties(device)
    props = dict(
        regs=int(getattr(p, "regs_per_multiprocessor", 65536)),
        smem=int(getattr(p, "shared_memory_per_multiprocessor", 228 * 1024)),
        threads=int(getattr(p, "max_threads_per_multi_processor", 2048)),
    )
    return occupancy_estimate(n_regs, shared, num_warps, props)


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------

#: Token rows per program of the backward's operand quantization.
_GRAD_QUANT_ROWS = 32


def quantize_grad_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    config: FP8Config,
    *,
    key_shift: torch.Tensor | None = None,
    transposed: bool = False,
) -> tuple[QuantizedJagged, ...]:
    """Q, K (rotated when ``config`` rotates; ``key_shift`` subtracted first), V and dO as
    E4M3 with one scale per token and head (``"rows"`` layout, scales ``(T, H)`` float32),
    one launch; bit-exact against
    :func:`hyperrec.jagged_attn.reference_fp8.quantize_tokens`. ``transposed`` also returns
    Q, K and dO in the ``"cols"`` layout (``(H, D, Tp)``, sequences at 16-aligned columns;
    same bytes; their ``scale`` is the rows copy's)."""
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    total_q, heads, dim = q.shape
    total_kv, dim_v = k.shape[0], v.shape[2]
    device = q.device
    data = [torch.empty(t.shape, dtype=torch.uint8, device=device) for t in (q, k, v, grad_out)]
    scales = [torch.empty(t.shape[:2], dtype=torch.float32, device=device)
              for t in (q, k, v, grad_out)]  # fmt: skip
    out = [QuantizedJagged(data=d.view(torch.float8_e4m3fn), scale=s, layout="rows")
           for d, s in zip(data, scales)]  # fmt: skip
    qo, ko = as_int32(q_offsets), as_int32(kv_offsets)
    pad = 16
    q_poff, kv_poff = _padded(qo, pad), _padded(ko, pad)
    q_width = cols_width(total_q, qo.numel() - 1, pad)
    kv_width = cols_width(total_kv, ko.numel() - 1, pad)
    cols = [torch.empty((heads, d, w), dtype=torch.uint8, device=device)
            for d, w in ((dim, q_width), (dim, kv_width), (dim_v, q_width))] if transposed else (
        [data[0]] * 3)  # fmt: skip
    if transposed:
        for c, (src, poff) in zip(cols, ((out[0], q_poff), (out[1], kv_poff), (out[3], q_poff))):
            out.append(QuantizedJagged(data=c.view(torch.float8_e4m3fn), scale=src.scale,
                                       layout="cols", pad_offsets=poff))  # fmt: skip
    if heads == 0 or (total_q == 0 and total_kv == 0):
        return tuple(out)
    rows = _GRAD_QUANT_ROWS
    q_seq, q_idx, q_tot = q_tile_schedule(qo, qo, None, rows, False, total_q)
    kv_seq, kv_idx, kv_tot = q_tile_schedule(ko, ko, None, rows, False, total_kv)
    tiles = max(work_upper_bound(total_q, qo.numel() - 1, rows),
                work_upper_bound(total_kv, ko.numel() - 1, rows))  # fmt: skip
    rotate = config.rotates(dim)
    signs = _device_signs(dim, config.hadamard_seed, device) if rotate else scales[0]
    strides = [x for t in (q, k, v, grad_out) for x in (t.stride(0), t.stride(1))]
    dstrides = [x for t in data for x in (t.stride(0), t.stride(1))]
    shift = scales[0] if key_shift is None else key_shift.contiguous()
    # the transposed copies' scales equal the rows copies': write them to a scratch buffer
    scratch = (torch.empty((max(total_q, total_kv), heads), dtype=torch.float32, device=device)
               if transposed else scales[0])  # fmt: skip
    cstrides = [x for c in cols for x in (c.stride(1), c.stride(0))] if transposed else [0] * 6
    _fp8_bwd_kernels._quant_grad_kernel[(tiles, heads, 7 if transposed else 4)](
        q, k, v, grad_out, *data, *scales, signs, shift, qo, ko, q_seq, q_idx, q_tot, kv_seq,
        kv_idx, kv_tot, *strides, *dstrides, scales[0].stride(0), scales[0].stride(1),
        *cols, scratch, q_poff, kv_poff, *cstrides,
        D=dim, BD=_pow2(dim), DV=dim_v, BDV=_pow2(dim_v), TILE=rows, HADAMARD=rotate,
        LOG2D=max(dim.bit_length() - 1, 0), HAS_SHIFT=key_shift is not None, num_warps=4,
    )  # fmt: skip
    return tuple(out)


#: Whether the FP8 backward reads the operands of its token-reducing products (dO and Q
#: for dV and dK, K for dQ) from transposed (K-major) copies. Off: on an H200 (2026-12-02,
#: 32 x 2,048 tokens, H = 8, D = 128; ``bench/results/fp8_bwd_probe_h200_2026-12-02.json``)
#: the transposed path's dK/dV kernel spilled 408 registers against 118 and took 28.3 ms
#: against 9.8 ms, and its quantization launch (seven roles instead of four) 0.94 ms
#: against 0.46 ms. Both paths are tested and give bit-identical gradients.
FP8_BWD_TRANSPOSED_B = False

#: Whether the FP8 backward undoes the Hadamard rotation of dQ and dK in its kernels'
#: epilogues (else one ``fwht`` pass over each afterwards, as for head dims below 32).
#: A switch for measuring the epilogue's register cost.
FP8_BWD_ROTATE_IN_KERNEL = True


def attention_backward_fp8(
    grad_out: torch.Tensor,
    call: AttentionCall,
    config: FP8Config,
    *,
    fast_math: bool = True,
    transposed_b: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 backward: ``(dq, dk, dv)`` in the input dtype; the numerics of
    :func:`hyperrec.jagged_attn.reference_fp8.attention_backward`. It reads neither the
    forward's output nor its log-sum-exp: the dQ kernel runs first and recomputes both
    softmax statistics from this backward's own scores. The streamed tile of each kernel
    (keys for dQ, queries for dK/dV) is the quantization group,
    :data:`~hyperrec.jagged_attn.fp8.GRAD_GROUP`; the other tile dims, warps and stages
    are the bf16 backward's shipped ones. ``transposed_b`` (default
    :data:`FP8_BWD_TRANSPOSED_B`): read the token-reducing products' B operands from
    transposed copies (same values, same results)."""
    _check_inputs(call)
    q, k, v, spec = call.q, call.k, call.v, call.spec
    trans = FP8_BWD_TRANSPOSED_B if transposed_b is None else bool(transposed_b)
    total_q, heads, dim = q.shape
    total_kv, dim_v = k.shape[0], v.shape[2]
    n_seq, n_kv_seq = call.q_offsets.numel() - 1, call.kv_offsets.numel() - 1
    softmax = spec.activation == "softmax"
    assert grad_out.shape == (total_q, heads, dim_v), "grad_out shape"
    grad_out = _last_dim_contiguous(grad_out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or total_kv == 0 or n_seq == 0 or n_kv_seq == 0 or heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    q8, k8, v8, do8, *tr = quantize_grad_operands(
        q, k, v, grad_out, call.q_offsets, call.kv_offsets, config,
        key_shift=smoothing_shift(k, call.kv_offsets, spec, config), transposed=trans,
    )  # fmt: skip
    # (without the transposed copies any tensor will do: the kernels never read them)
    qt, kt, dot = tr if trans else (q8, k8, do8)
    q_poff = qt.pad_offsets if trans else q8.scale
    kv_poff = kt.pad_offsets if trans else q8.scale
    tstr = (lambda t: (t.data.stride(1), t.data.stride(0))) if trans else (lambda t: (0, 0))
    coef, ce = _common(call, fast_math)
    bd, bdv = max(32, _pow2(dim)), max(32, _pow2(dim_v))
    rotate = config.rotates(dim)
    in_kernel_rotation = rotate and bd == dim and FP8_BWD_ROTATE_IN_KERNEL
    signs = _device_signs(dim, config.hadamard_seed, q.device) if rotate else q8.scale
    scale = spec.scale / hadamard_scale(config, dim)
    qk_scale = _qk_scale(spec.activation, scale)
    # Written by the dQ kernel (softmax); rows no query tile covers keep +inf / 0, which
    # give P = 0 and dS = 0 in the dK/dV kernel.
    shape = (heads, total_q) if softmax else (0,)
    lse = torch.full(shape, float("inf"), dtype=torch.float32, device=q.device)
    delta = torch.zeros_like(lse)
    stride_lh = lse.stride(0) if softmax else 0
    mask_ints = _Mask(call).ints()
    num_targets = as_int32(call.num_targets)
    common = dict(H=heads, HEAD_DIM=dim, HEAD_DIM_V=dim_v, BLOCK_D=bd, BLOCK_DV=bdv,
                  HADAMARD=in_kernel_rotation, LOG2D=max(dim.bit_length() - 1, 0),
                  TRANS_B=trans, **ce)  # fmt: skip
    operands = (q8.data, k8.data, v8.data, do8.data, q8.scale, k8.scale, v8.scale, do8.scale)
    strides = (
        q8.data.stride(0), q8.data.stride(1), k8.data.stride(0), k8.data.stride(1),
        v8.data.stride(0), v8.data.stride(1), do8.data.stride(0), do8.data.stride(1),
        q8.scale.stride(0), q8.scale.stride(1),
    )  # fmt: skip

    cfg = replace(_pick("dq", call, None), block_n=GRAD_GROUP)
    q_offsets, kv_offsets, tile_seq, tile_idx, total = _fwd_schedule(call, cfg.block_m, "cost")
    kv_index = as_int32(call.kv_index)
    args: tuple[object, ...] = (
        *operands, lse, delta, dq, signs, kt.data, kv_poff, *tstr(kt), *strides, dq.stride(0),
        dq.stride(1),
        stride_lh, q_offsets, kv_offsets, total if kv_index is None else kv_index,
        total if num_targets is None else num_targets, tile_seq, tile_idx, total,
        qk_scale, scale, coef, *mask_ints,
    )  # fmt: skip
    kw = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    work = work_upper_bound(total_q, n_seq, cfg.block_m) * heads
    key = _Key(("fp8_dq", q.dtype, cfg, tuple(sorted(kw.items()))))
    _launch_persistent(_fp8_bwd_kernels._fp8_bwd_dq_kernel, work, q.device, cfg, key, args, kw)

    cfg = replace(_pick("dkdv", call, None), block_m=GRAD_GROUP, dq_atomic=False)
    q_offsets, kv_offsets, tile_seq, tile_idx, total, inv_ptr, inv_idx = _kv_schedule(call, cfg)
    args = (
        *operands, lse, delta, dk, dv, signs, qt.data, dot.data, q_poff, *tstr(qt), *tstr(dot),
        *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), stride_lh,
        q_offsets, kv_offsets, inv_ptr, inv_idx, total if num_targets is None else num_targets,
        tile_seq, tile_idx, total, qk_scale, scale, coef, *mask_ints,
    )  # fmt: skip
    kw = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    work = work_upper_bound(total_kv, n_kv_seq, cfg.block_n) * heads
    key = _Key(("fp8_dkdv", q.dtype, cfg, tuple(sorted(kw.items()))))
    _launch_persistent(_fp8_bwd_kernels._fp8_bwd_dkdv_kernel, work, q.device, cfg, key, args,
                       kw)  # fmt: skip
    if rotate and not in_kernel_rotation:
        # head dims below the 32-wide FP8 tile: rotate back here
        sgn = signs.float()
        dq = (fwht(dq) * sgn).to(q.dtype)
        dk = (fwht(dk) * sgn).to(k.dtype)
    return dq, dk, dv
