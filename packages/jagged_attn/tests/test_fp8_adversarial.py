"""Adversarial sweep of ``precision="fp8" | "mxfp8"`` against an independent numpy oracle.

The oracle below is written from the documentation only (README "FP8 / MXFP8 attention",
the module docs of ``fp8`` and ``reference_fp8``), in numpy:

* E4M3 from its own table of the 254 finite codes (round to nearest, ties to the even
  code, saturation at +-448, signed zeros, NaN byte 0x7F);
* ``"fp8"`` block scales ``2**ceil(log2(fl32(amax / 448)))`` (``"pow2"``) or
  ``fl32(amax / 448)`` applied as ``x * fl32(448 / amax)`` (``"fp32"``), blocks of
  ``block_q`` / ``block_kv`` tokens of one sequence and head, ``amax`` floored at
  ``2**-24``, zero blocks scale 1, non-finite blocks scale NaN and all bytes 0x7F;
* MX (OCP, RCEIL): an E8M0 byte ``clamp(ceil(log2(fl32(amax / 448))), -127, 127) + 127``
  per 32 elements (head dim for Q/K, each sequence's tokens for V), 255 for non-finite;
* the rotation ``x * signs`` times Sylvester's Hadamard matrix, as the float32 butterflies
  the docs specify; key smoothing by each kv sequence's mean key (finite values, float64
  sum, bf16);
* attention in float64 from the dequantized operands, P quantized per (row, tile of
  ``p_block`` keys from the sequence's first key) with the power-of-two scale that puts
  the tile's largest weight in (220, 440] (softmax: relative to the running max).

Operands are compared bit for bit (the docs promise bit-exactness for Q/K/V, both
backends); outputs of the torch backend (float64 inputs, so it computes in float64) to
1e-9, outputs of the Triton kernel (interpreter, float32 accumulation) with the tolerance
of ``test_fp8_attention.py`` (an occasional P value on the other side of an E4M3 rounding
boundary). Then hostile inputs: empty batches, NaN/Inf (never a finite wrong output, never
outside their sequence), power-of-two rescaling to the edges of the formats (bit-exact
invariance), head dims below the kernels' tile, bad configs and arguments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kernel_check import kernels_available, offsets_tensor

import hyperrec.jagged_attn as ja
from hyperrec.jagged_attn import FP8Config, quantize_qkv, reference_fp8
from hyperrec.jagged_attn.fp8 import key_shift
from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.reference_fp8 import hadamard_signs

pytest.importorskip("hyperrec.mxfp8")
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs the interpreter")
BACKENDS = ["torch", pytest.param("triton", marks=needs_kernels)]

# ----------------------------------------------------------------------------------------
# The independent oracle
# ----------------------------------------------------------------------------------------


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite E4M3 values (ascending) and their codes."""
    vals, codes = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            codes.append(e << 3 | m)
    return np.array(vals), np.array(codes)


E4M3_VALS, E4M3_CODES = _e4m3_table()
assert E4M3_VALS[-1] == 448.0 and np.all(np.diff(E4M3_VALS) > 0)


def e4m3(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8, values float64) of ``y`` rounded to E4M3: nearest, ties to the even
    code, saturating at 448, sign kept (also of zero); NaN -> 0x7F."""
    y = np.asarray(y, dtype=np.float64)
    a = np.minimum(np.abs(np.nan_to_num(y)), 448.0)
    hi = np.clip(np.searchsorted(E4M3_VALS, a), 1, len(E4M3_VALS) - 1)
    lo = hi - 1
    dlo, dhi = a - E4M3_VALS[lo], E4M3_VALS[hi] - a
    take_hi = (dhi < dlo) | ((dhi == dlo) & (E4M3_CODES[hi] % 2 == 0))
    idx = np.where(take_hi, hi, lo)
    neg = np.signbit(y)
    codes = (E4M3_CODES[idx] | np.where(neg, 0x80, 0)).astype(np.uint8)
    vals = np.where(neg, -E4M3_VALS[idx], E4M3_VALS[idx])
    nan = np.isnan(y)
    return np.where(nan, 0x7F, codes).astype(np.uint8), np.where(nan, np.nan, vals)


def pow2_ceil_log2(d: np.ndarray) -> np.ndarray:
    """ceil(log2(d)) for float64 ``d >= 0`` (exact, from frexp); -inf for 0."""
    m, e = np.frexp(d)
    out = np.where(m == 0.5, e - 1, e).astype(np.float64)
    return np.where(d == 0, -np.inf, out)


def fp8_block(x: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """One ``"fp8"`` block (float32 values, any shape): (codes, scale float32)."""
    if not np.isfinite(x).all():
        return np.full(x.shape, 0x7F, np.uint8), np.float32(np.nan)
    amax = np.float32(np.abs(x).max()) if x.size else np.float32(0)
    if amax == 0:
        return e4m3(x)[0], np.float32(1)
    a = max(amax, np.float32(2.0**-24))
    if rule == "pow2":
        e = pow2_ceil_log2(np.float64(np.float32(a) / np.float32(448)))
        scale, inv = np.float32(2.0**e), np.float32(2.0**-e)
    else:
        scale, inv = np.float32(a) / np.float32(448), np.float32(448) / np.float32(a)
    return e4m3(x.astype(np.float32) * inv)[0], scale


def mx_block(x: np.ndarray) -> tuple[np.ndarray, int]:
    """One MX block of 32 float32 values: (codes, E8M0 byte)."""
    if not np.isfinite(x).all():
        return np.full(x.shape, 0x7F, np.uint8), 255
    d = np.float64(np.float32(np.abs(x).max()) / np.float32(448))
    e = int(np.clip(pow2_ceil_log2(d), -127, 127))
    return e4m3(x.astype(np.float32) * np.float32(2.0**-e))[0], e + 127


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 -> nearest bfloat16 (ties to even), as float64 (finite inputs)."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m 2**e, 0.5 <= |m| < 1: bf16 keeps 8 significant bits
    return np.ldexp(np.round(m * 256) / 256, e)  # np.round: half to even


def np_key_shift(k: np.ndarray, offsets: list[int]) -> np.ndarray:
    """Per kv sequence and head, the mean of the finite keys, rounded to bf16."""
    out = np.zeros((len(offsets) - 1, *k.shape[1:]))
    for b in range(len(offsets) - 1):
        x = k[offsets[b] : offsets[b + 1]].astype(np.float64)
        fin = np.isfinite(x)
        n = np.maximum(fin.sum(0), 1)
        out[b] = bf16_round(np.where(fin, x, 0).sum(0) / n)
    return out


def np_fwht32(x: np.ndarray) -> np.ndarray:
    """``x @ H`` (Sylvester) as float32 butterflies (pairs (i, i + h), h = 1, 2, ...)."""
    x = x.astype(np.float32).copy()
    n, h = x.shape[-1], 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*x.shape[:-1], n)
        h *= 2
    return x


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def np_prepare(x: np.ndarray, offsets, config: FP8Config, shift=None) -> np.ndarray:
    """float32 operand after the per-sequence shift and the rotation (Q, K)."""
    x = x.astype(np.float32)
    if shift is not None:
        seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        x = x - shift[seq].astype(np.float32)
    if config.rotates(x.shape[-1]):
        x = np_fwht32(x * hadamard_signs(x.shape[-1], config.hadamard_seed).numpy())
    return x


def np_quantize(x: np.ndarray, offsets, config: FP8Config, role: str):
    """Per token: (codes (T, H, D) uint8, scale (T, H) float32 or (T, H, D) E8M0 bytes)."""
    t, h, d = x.shape
    codes = np.zeros(x.shape, np.uint8)
    if config.mx:
        scale = np.zeros(x.shape, np.int64)
        for b in range(len(offsets) - 1):
            s, e = offsets[b], offsets[b + 1]
            for hh in range(h):
                if role == "v":  # blocks of 32 tokens, per head-dim column
                    for j in range(s, e, 32):
                        for c in range(d):
                            blk = x[j : min(j + 32, e), hh, c]
                            codes[j : j + len(blk), hh, c], scale[j : j + len(blk), hh, c] = (
                                mx_block(blk)
                            )
                else:  # blocks of 32 along the head dim
                    for j in range(s, e):
                        for c in range(0, d, 32):
                            codes[j, hh, c : c + 32], scale[j, hh, c : c + 32] = mx_block(
                                x[j, hh, c : c + 32]
                            )
        return codes, scale
    block = config.q_block if role == "q" else config.kv_block
    scale = np.zeros((t, h), np.float32)
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        for j in range(s, e, block):
            r = slice(j, min(j + block, e))
            for hh in range(h):
                codes[r, hh], scale[r, hh] = fp8_block(x[r, hh], config.scale_rule)
    return codes, scale


def np_dequantize(codes, scale, config: FP8Config) -> np.ndarray:
    vals = e4m3_decode(codes)
    if config.mx:
        s = np.where(scale == 255, np.nan, 2.0 ** (scale.astype(np.float64) - 127))
        return vals * s
    return vals * scale.astype(np.float64)[..., None]


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    table = np.full(256, np.nan)
    table[E4M3_CODES] = E4M3_VALS
    table[E4M3_CODES | 0x80] = -E4M3_VALS
    return table[codes]


def lib_per_token(qkv, offsets, total_kv: int):
    """The library's QuantizedQKV as per-token arrays like :func:`np_quantize`'s."""
    out = {}
    for name in "qk":
        t = getattr(qkv, name)
        scale = t.scale.cpu()
        if qkv.config.mx:
            scale = scale.long().repeat_interleave(32, -1).numpy()
        else:
            scale = scale.numpy()
        out[name] = (t.data.view(torch.uint8).cpu().numpy(), scale)
    v = qkv.v
    seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    pos = np.arange(total_kv) - np.asarray(offsets)[seq]
    col = v.pad_offsets.long().cpu().numpy()[seq] + pos
    data = v.data.view(torch.uint8).cpu().numpy()[:, :, col].transpose(2, 0, 1)
    if qkv.config.mx:
        scale = v.scale.long().cpu().numpy()[:, :, col // 32].transpose(2, 0, 1)
    else:
        scale = v.scale.cpu().numpy()
    out["v"] = (data, scale)
    return out


def assert_bits_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    if got.dtype.kind == "f":
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), f"{what}: NaN pattern"
        g, w = got[~nan], want[~nan]
        assert np.array_equal(g.view(np.int32), w.astype(np.float32).view(np.int32)), what
    else:
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{what}: {len(bad)} differ, first at {bad[:3].tolist()}"


def np_activation(name: str, s: np.ndarray) -> np.ndarray:
    if name == "silu":
        return s / (1 + np.exp(-s))
    if name == "relu":
        return np.maximum(s, 0)
    raise AssertionError(name)


def np_attention(qd, kd, vd, qo, ko, *, scale, mask, activation="softmax", kv_index=None,
                 targets=None, n=32, quantize_p=True, coef=1.0):  # fmt: skip
    """Float64 attention of dequantized (rotated) operands with P quantized per tile."""
    tq, h, _ = qd.shape
    out = np.zeros((tq, h, vd.shape[2]))
    log2_440 = math.log2(440.0)
    for b in range(len(qo) - 1):
        kb = b if kv_index is None else kv_index[b]
        qs, qe, ks, ke = qo[b], qo[b + 1], ko[kb], ko[kb + 1]
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        ok = ja.mask_matrix(lq, lk, mask, num_targets=0 if targets is None else targets[b])
        ok = ok.numpy()
        for hh in range(h):
            s = scale * qd[qs:qe, hh] @ kd[ks:ke, hh].T
            v = vd[ks:ke, hh]
            acc = np.zeros((lq, v.shape[1]))
            if activation == "softmax":
                t = np.where(ok, s * math.log2(math.e), -np.inf)
                m = np.full(lq, -np.inf)
                for j0 in range(0, lk, n):
                    tt = t[:, j0 : j0 + n]
                    big = tt.max(1)
                    m_new = np.maximum(m, big)
                    has = big > -np.inf
                    kk = np.where(has, np.minimum(np.floor(log2_440 + m_new - big), 32), 0)
                    safe_m = np.where(np.isfinite(m_new), m_new, 0)
                    p = np.exp2(tt - (safe_m - kk)[:, None])
                    p8 = e4m3(p)[1] if quantize_p else p
                    # the accumulator in units of the running max
                    acc = acc * np.where(np.isfinite(m), np.exp2(m - safe_m), 0)[:, None]
                    acc += (p8 * np.exp2(-kk)[:, None]) @ v[j0 : j0 + n]
                    m = m_new
                denom = np.exp2(t - np.where(np.isfinite(m), m, 0)[:, None]).sum(1)
                o = np.where(denom[:, None] > 0, acc / np.where(denom > 0, denom, 1)[:, None], 0)
            else:
                a = np.where(ok, np_activation(activation, s), 0.0)
                for j0 in range(0, lk, n):
                    aa = a[:, j0 : j0 + n]
                    amax = np.abs(aa).max(1)
                    with np.errstate(divide="ignore"):
                        kk = np.clip(np.floor(log2_440 - np.log2(amax)), -32, 32)
                    kk = np.where(amax > 0, kk, 0)
                    p = aa * np.exp2(kk)[:, None]
                    p8 = e4m3(p)[1] if quantize_p else p
                    acc += (p8 * np.exp2(-kk)[:, None]) @ v[j0 : j0 + n]
                o = acc * coef
            out[qs:qe, hh] = o
    return out


def oracle(q, k, v, qo, ko, config: FP8Config, *, softmax=True, **kw):
    """The oracle's output and the exact (unquantized) float64 attention."""
    qn, kn, vn = (t.double().cpu().numpy() for t in (q, k, v))
    d = q.shape[2]
    shift = np_key_shift(kn, ko) if softmax and config.smooth_k else None
    qp, kp = np_prepare(qn, qo, config), np_prepare(kn, ko, config, shift)
    qd = np_dequantize(*np_quantize(qp, qo, config, "q"), config)
    kd = np_dequantize(*np_quantize(kp, ko, config, "k"), config)
    vd = np_dequantize(*np_quantize(vn.astype(np.float32), ko, config, "v"), config)
    had = d if config.rotates(d) else 1
    scale = kw.pop("scale", 1 / math.sqrt(d))
    out = np_attention(qd, kd, vd, qo, ko, scale=scale / had, n=config.tile_n, **kw)
    exact = np_attention(qn, kn, vn, qo, ko, scale=scale, n=config.tile_n, quantize_p=False,
                         **kw)  # fmt: skip
    return out, exact


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------

LENS = (37, 0, 1, 70, 5)
HEADS = 2
FP8_SMALL = FP8Config(block_q=16, block_kv=32, p_block=32, hadamard=False)
CONFIGS = {
    "fp8_pow2": FP8_SMALL,
    "fp8_fp32_blockq1": FP8Config(
        block_q=1, block_kv=64, p_block=32, scale="fp32", hadamard=False
    ),  # fmt: skip
    "fp8_hadamard": FP8Config(block_q=8, block_kv=32, p_block=32, hadamard_seed=5),
    "mx": FP8Config(format="mxfp8", hadamard=False),
    "mx_hadamard": FP8Config(format="mxfp8", hadamard=True),
}


def hostile(lens, dim=32, dim_v=24, seed=0, dtype=torch.bfloat16):
    """bf16-exact values: integers below 256 times a per-token power of two spanning
    2**-40..2**90 (so the float32 rotation is exact), all-zero tokens, a token below the
    2**-24 floor, one sequence with a large common key component."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)

    def rnd(d, lo, hi):
        x = torch.randint(-255, 256, (total, HEADS, d), generator=g).double()
        e = torch.randint(lo, hi, (total, HEADS, 1), generator=g).double()
        return x * torch.exp2(e)

    q, k, v = rnd(dim, -12, 4), rnd(dim, -12, 4), rnd(dim_v, -8, 8)
    if total > 44:
        q[3], k[5], v[7] = 0.0, 0.0, 0.0  # zero tokens
        q[40, 0] *= 2.0**-40  # below the fp8 floor
        k[41, 1] *= 2.0**-30
        q[42, 1] *= 2.0**80  # huge, still finite after the rotation
        v[43, 0] *= 2.0**90
        k[38:108, 0, :4] += 2.0**12  # a common component (smoothing)
    return (t.to(dtype) for t in (q, k, v))


# ----------------------------------------------------------------------------------------
# Operands: bit for bit
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_operands_bit_exact_against_the_oracle(name, backend):
    config = CONFIGS[name]
    q, k, v = hostile(LENS, dim=64 if config.mx else 32)
    q[45, 1, 3] = float("nan")
    k[60, 0, 1] = float("inf")
    v[2, 1, 0] = float("-inf")
    offsets = offsets_tensor(LENS, "cpu")
    off = list(np.cumsum((0, *LENS)))
    shift = key_shift(k, offsets)
    want_shift = np_key_shift(k.double().numpy(), off)
    assert_bits_equal(shift.float().numpy(), want_shift.astype(np.float32), "key_shift")
    got = quantize_qkv(q, k, v, offsets, precision=config, backend=backend, key_shift=shift)
    lib = lib_per_token(got, off, k.shape[0])
    for role, x, sh in (("q", q, None), ("k", k, want_shift), ("v", v, None)):
        x = x.double().numpy()
        xp = np_prepare(x, off, config, sh) if role != "v" else x.astype(np.float32)
        codes, scale = np_quantize(xp, off, config, role)
        assert_bits_equal(lib[role][0], codes, f"{role} codes")
        assert_bits_equal(lib[role][1], scale, f"{role} scales")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hadamard_below_the_kernel_tile_reads_only_its_signs(backend, monkeypatch):
    """Head dims below 16 are padded to 16 in the quantization kernel; the sign vector has
    only D entries. Whatever follows it in memory (here NaN) must not reach the result:
    the kernel read past it and turned every rotated block into NaN."""
    from hyperrec.jagged_attn._triton import _fp8_launch

    real = _fp8_launch.hadamard_signs

    def signs_followed_by_nan(n, seed):
        buf = torch.full((n + 64,), float("nan"))
        buf[:n] = real(n, seed)
        return buf[:n]

    monkeypatch.setattr(_fp8_launch, "hadamard_signs", signs_followed_by_nan)
    monkeypatch.setattr(_fp8_launch, "_SIGNS", {})
    lens = (3, 0, 9)
    off = list(np.cumsum((0, *lens)))
    offsets = offsets_tensor(lens, "cpu")
    for dim in (2, 8):
        config = FP8Config(block_q=1, block_kv=32, p_block=32, hadamard=True)
        q, k, v = hostile(lens, dim=dim, dim_v=8, seed=dim)
        got = lib_per_token(quantize_qkv(q, k, v, offsets, precision=config, backend=backend),
                            off, k.shape[0])  # fmt: skip
        for role, x in (("q", q), ("k", k)):
            codes, scale = np_quantize(np_prepare(x.double().numpy(), off, config), off,
                                       config, role)  # fmt: skip
            assert_bits_equal(got[role][1], scale, f"D={dim} {role} scales")
            assert_bits_equal(got[role][0], codes, f"D={dim} {role} codes")


def test_oracle_rotation_is_sylvester_and_keeps_scores():
    """The oracle's own rotation: ``H H^T = D I``, so rotated scores are D times the
    original ones (the kernel divides by D)."""
    g = np.random.default_rng(0)
    x, y = g.integers(-64, 64, (5, 32)), g.integers(-64, 64, (7, 32))
    s = hadamard_signs(32, 3).numpy()
    assert np.array_equal(np_fwht32(x * s), (x * s) @ sylvester(32))
    assert np.array_equal(np_fwht32(x * s) @ np_fwht32(y * s).T, 32 * x @ y.T)


# ----------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------


def _check_against_oracle(out, want, exact, tight: bool):
    o = out.double().cpu().numpy()
    assert np.array_equal(np.isnan(o), np.isnan(want)), "NaN pattern"
    fin = np.isfinite(want)
    o, w, e = o[fin], want[fin], exact[fin]
    if tight:  # float64 both: only the order of the float64 operations differs
        assert np.abs(o - w).max() <= 1e-9 * (np.abs(w).max() + 1e-300)
        return
    # The kernel: bf16 output (rounding <= 2**-9 relative) from float32 accumulation (an
    # occasional P value on the other side of an E4M3 boundary). Beyond 2**-8 relative,
    # what is left must be a tenth of the FP8 error itself (a wrong scale, tile or mask
    # is off by the whole error or more).
    excess = np.maximum(np.abs(o - w) - 2.0**-8 * np.abs(w), 0)
    quant = np.sqrt(np.mean((w - e) ** 2))
    assert np.sqrt(np.mean(excess**2)) <= 0.1 * quant + 1e-6, (excess.max(), quant)
    off = np.mean(np.abs(o - w) > 2.0**-7 * np.abs(w) + 1e-5)
    assert off <= 0.01, off


CASES = {
    # name: (lens q, lens kv, gdpa kwargs, oracle kwargs)
    "softmax_causal_window": (
        (37, 0, 1, 70, 5), None,
        dict(activation="softmax", causal=True, window_size=(40, 0)),
        dict(mask=MaskSpec(causal=True, window_left=40, window_right=0)),
    ),
    "softmax_kv_index_cross": (
        (5, 33, 0, 9), (40, 0, 70),
        dict(activation="softmax", kv_index=[2, 0, 1, 0], scale=0.3),
        dict(mask=MaskSpec(), kv_index=[2, 0, 1, 0], scale=0.3),
    ),
    "silu_targets_context": (
        (37, 1, 70), None,
        dict(activation="silu", causal=True, num_targets=[4, 0, 9], contextual_len=2,
             normalization="length"),
        dict(mask=MaskSpec(causal=True, contextual_len=2), targets=[4, 0, 9],
             activation="silu"),
    ),
}  # fmt: skip


def _run_case(case, config, backend, dtype):
    lq, lk, kw, okw = case
    lk = lq if lk is None else lk
    total_k = sum(lk)
    q, _, _ = hostile(lq, dim=64 if config.mx else 32, dtype=dtype)
    _, k, v = hostile(lk, dim=64 if config.mx else 32, seed=1, dtype=dtype)
    assert k.shape[0] == total_k
    if kw["activation"] != "softmax":
        # (activations above 440 * 2**32 saturate P: the documented P-scale clamp)
        q, k = q.clamp(-64.0, 64.0), k.clamp(-64.0, 64.0)
    qo, ko = offsets_tensor(lq, "cpu"), offsets_tensor(lk, "cpu")
    kw = dict(kw)
    for name in ("kv_index", "num_targets"):
        if name in kw:
            kw[name] = torch.tensor(kw[name])
    out = ja.gdpa(q, k, v, qo, ko, max(lq), max(lk), precision=config, backend=backend, **kw)
    okw = dict(okw)
    if kw.get("normalization") == "length":
        okw["coef"] = None
    return q, k, v, list(np.cumsum((0, *lq))), list(np.cumsum((0, *lk))), out, okw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["fp8_pow2", "fp8_hadamard", "mx"])
def test_output_against_the_oracle(name, case, backend):
    """Softmax with windows, kv_index and cross lengths; SiLU with targets and contextual
    tokens; every format; the torch backend (float64 inputs: computed in float64, 1e-9) and
    the kernel (interpreter, bf16 in / out)."""
    config = CONFIGS[name]
    if backend == "torch":
        dtype = torch.float64  # bf16-exact values: the same operands
    else:
        dtype = torch.bfloat16
    q, k, v, qo, ko, out, okw = _run_case(CASES[case], config, backend, dtype)
    softmax = okw.get("activation", "softmax") == "softmax"
    if okw.get("coef", 1.0) is None:  # normalization="length": 1 / Lk, per pair
        okw.pop("coef")
        want, exact = _per_pair_length_norm(q, k, v, qo, ko, config, okw)
    else:
        want, exact = oracle(q, k, v, qo, ko, config, softmax=softmax, **okw)
    _check_against_oracle(out, want, exact, tight=backend == "torch")


def _per_pair_length_norm(q, k, v, qo, ko, config, okw):
    want, exact = oracle(q, k, v, qo, ko, config, softmax=False, **okw)
    kvi = okw.get("kv_index")
    for b in range(len(qo) - 1):
        kb = b if kvi is None else kvi[b]
        lk = max(ko[kb + 1] - ko[kb], 1)
        want[qo[b] : qo[b + 1]] /= lk
        exact[qo[b] : qo[b + 1]] /= lk
    return want, exact


@pytest.mark.parametrize("name", ["fp8_hadamard", "mx_hadamard"])
def test_rotation_and_smoothing_are_exact_without_quantization(name):
    """Exact arithmetic: rotating Q and K by the same orthogonal matrix, and subtracting
    each kv sequence's mean key, leave the softmax output unchanged (the spec with no
    operand quantized equals the exact attention to float64 rounding)."""
    config = CONFIGS[name]
    g = torch.Generator().manual_seed(3)
    # small integers: the float32 shift and rotation are exact, so float64 rounding is all
    q, k, v = (torch.randint(-8, 9, (113, HEADS, 64), generator=g).double() for _ in range(3))
    k[:, 1] += 300.0  # a common component for the smoothing to remove
    args = (q.double(), k.double(), v.double(), offsets_tensor(LENS, "cpu"))
    spec = ja.AttentionSpec(scale=0.125, mask=MaskSpec(causal=True), max_seqlen_q=70,
                            max_seqlen_kv=70)  # fmt: skip
    got = reference_fp8.attention_forward(*args, args[3], spec, config, operands="")
    from hyperrec.jagged_attn import reference

    want = reference.attention_forward(*args, args[3], spec)
    assert reference_fp8.smoothing_shift(k, args[3], spec, config) is not None
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------
# Hostile values
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["fp8_pow2", "fp8_fp32_blockq1", "mx"])
def test_power_of_two_rescaling_is_bit_exact(name, backend):
    """Q * 2**a, K * 2**-a, V * 2**c: the block scales absorb the factors (the codes stay
    the same), so the output is 2**c times the original, bit for bit, up to the edges of
    the formats (K at 2**-66 for MX; fp8 above its 2**-24 floor). (V stays at 2**60: the
    MX kernel's accumulator, in units of the P scale 2**k with k up to 32, overflows
    float32 for outputs above about 2**82, a known limit of the kernel.)"""
    config = CONFIGS[name]
    dim = 64 if config.mx else 32
    lens = (37, 0, 40)
    offsets = offsets_tensor(lens, "cpu")
    q, k, v = hostile(lens, dim=dim)
    q, k, v = (t.clamp(-100.0, 100.0) for t in (q, k, v))  # (hostile() scales some tokens)
    q[5], k[9] = 0.0, 0.0
    a = 60 if config.mx else 20
    kw = dict(causal=True, precision=config, backend=backend)
    base = ja.jagged_attention(q, k, v, offsets, 40, **kw)
    scaled = ja.jagged_attention(q * 2.0**a, k * 2.0**-a, v * 2.0**60, offsets, 40, **kw)
    assert torch.isfinite(base).all()
    assert torch.equal(scaled, base * 2.0**60)


def test_fp8_floor_of_tiny_blocks_is_the_documented_one():
    """``"fp8"`` scales a block whose max is below 2**-24 as if it were 2**-24 (documented
    in ``reference_fp8``): values below 2**-42 flush to zero. Pinned so a change is seen."""
    x = torch.zeros(1, 1, 32, dtype=torch.float32)
    x[0, 0, 0], x[0, 0, 1] = 2.0**-30, 2.0**-43
    offsets = torch.tensor([0, 1])
    got = quantize_qkv(x, x, x, offsets, precision=FP8_SMALL, backend="torch")
    assert got.q.scale.item() == 2.0**-32
    assert got.q.data[0, 0, 0].float().item() == 4.0 and got.q.data[0, 0, 1].float() == 0


NONFINITE = [("q", float("nan")), ("k", float("inf")), ("v", float("-inf")), ("k", float("nan"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["fp8_hadamard", "mx"])
@pytest.mark.parametrize(("where", "value"), NONFINITE)
def test_nonfinite_input_never_gives_a_finite_wrong_output(where, value, name, backend):
    """A NaN/Inf input reaches only its own sequence (other sequences bit-identical to the
    clean run), and every output row that can see the poisoned block is NaN, not finite
    (with key smoothing on: the mean skips it)."""
    config = CONFIGS[name]
    dim = 64 if config.mx else 32
    lens = (20, 45, 7)
    offsets = offsets_tensor(lens, "cpu")
    q, k, v = (t.clamp(-50.0, 50.0) for t in hostile(lens, dim=dim))
    kw = dict(causal=True, precision=config, backend=backend)
    clean = ja.jagged_attention(q, k, v, offsets, 45, **kw)
    tok = 20 + 30  # sequence 1, position 30
    dict(q=q, k=k, v=v)[where][tok, 1, 3] = value
    out = ja.jagged_attention(q, k, v, offsets, 45, **kw)
    assert torch.equal(out[:20], clean[:20]) and torch.equal(out[65:], clean[65:])
    assert torch.equal(out[:, 0], clean[:, 0])  # other heads
    seq = out[20:65, 1].float()
    if where == "q":  # the query's block (MX: its row)
        block = 1 if config.mx else config.q_block
        rows = range(30 // block * block, min(30 // block * block + block, 45))
    else:  # rows that see a key of the poisoned block (causal)
        block = 1 if (config.mx and where == "k") else config.kv_block
        rows = range(30 // block * block, 45)
    for r in rows:
        assert torch.isnan(seq[r]).any(), f"row {r} finite: {seq[r, :4]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("lens", [(), (0, 0)], ids=["no_sequences", "empty_sequences"])
def test_empty_batches(lens, precision, backend):
    """No tokens at all: an empty output, and a backward, with either format on either
    backend (``"mxfp8"`` on the torch backend, what ``"auto"`` runs on a CPU, failed on
    the shape of its empty scale tensor)."""
    offsets = offsets_tensor(lens, "cpu")
    q, k, v = (torch.zeros(0, HEADS, 32, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    for fn in (
        lambda: ja.jagged_attention(q, k, v, offsets, 0, precision=precision, backend=backend),
        lambda: ja.gdpa(q, k, v, offsets, offsets, 0, 0, precision=precision, backend=backend),
        lambda: ja.block_attention(q, k, v, offsets, 0, precision=precision, backend=backend),
    ):
        out = fn()
        assert out.shape == (0, HEADS, 32)
        out.sum().backward()
    qkv = quantize_qkv(q.detach(), k.detach(), v.detach(), offsets, precision=precision,
                       backend=backend)  # fmt: skip
    assert qkv.q.data.shape == (0, HEADS, 32)
    assert qkv.q.scale.shape == ((0, HEADS, 1) if precision == "mxfp8" else (0, HEADS))


# ----------------------------------------------------------------------------------------
# Bad configs and arguments
# ----------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(block_q=0), ValueError, "block_q"),
    (dict(block_kv=-32), ValueError, "block_kv"),
    (dict(p_block=48), ValueError, "p_block"),
    (dict(block_q=3), ValueError, "block_q"),
    (dict(block_kv=32), ValueError, "block_kv must be a multiple of p_block"),
    (dict(block_q=16.0), TypeError, "block_q"),
    (dict(format="FP8"), ValueError, "format"),
    (dict(format=None), TypeError, "format"),
    (dict(scale="e8m0"), ValueError, "scale"),
    (dict(format="mxfp8", p_block=32), ValueError, "p_block"),
    (dict(backward="fp16"), ValueError, "backward"),
    (dict(hadamard=1), TypeError, "hadamard"),
    (dict(smooth_k="yes"), TypeError, "smooth_k"),
    (dict(hadamard_seed=-1), ValueError, "hadamard_seed"),
    (dict(hadamard_seed=2**64), ValueError, "hadamard_seed"),  # passed; failed at the call
]


@pytest.mark.parametrize(("kw", "exc", "match"), BAD_CONFIGS, ids=lambda x: str(x)[:30])
def test_bad_config_names_the_field(kw, exc, match):
    with pytest.raises(exc, match=match):
        FP8Config(**kw)


def test_largest_seed_runs():
    q = torch.randn(6, HEADS, 32)
    config = FP8Config(hadamard_seed=2**64 - 1)
    out = ja.jagged_attention(q, q, q, torch.tensor([0, 6]), 6, precision=config,
                              backend="torch")  # fmt: skip
    assert torch.isfinite(out).all()


def test_bad_arguments_name_the_argument():
    q = torch.randn(6, HEADS, 32)
    off = torch.tensor([0, 2, 6])
    for bad in ("FP8", "fp8 ", "", "int8"):
        with pytest.raises(ValueError, match="precision"):
            ja.jagged_attention(q, q, q, off, 4, precision=bad, backend="torch")
    with pytest.raises(TypeError, match="precision"):
        ja.gdpa(q, q, q, off, off, 4, 4, precision=FP8Config, backend="torch")
    for kw in (dict(hadamard=True), dict(format="mxfp8")):  # D = 48: neither fits
        x = torch.randn(6, HEADS, 48)
        with pytest.raises(ValueError, match="head_dim"):
            ja.block_attention(x, x, q, off, 4, precision=FP8Config(**kw), backend="torch")
    # quantize_qkv: offsets that are not index tensors raised AttributeError
    with pytest.raises(TypeError, match="q_offsets"):
        quantize_qkv(q, q, q, [0, 2, 6])
    with pytest.raises(TypeError, match="kv_offsets"):
        quantize_qkv(q, q, q, off, off.float())
    with pytest.raises(ValueError, match="precision"):
        quantize_qkv(q, q, q, off, precision="bf16")


@needs_kernels
def test_subnormal_key_shift_quantizes_bit_exact():
    """Keys whose per-sequence mean (the smoothing shift) is a bf16 subnormal: the
    kernels' quantizers read the shift through the interpreter's bf16 -> fp32
    conversion, which gets subnormals wrong (1.1e-39 read as 5.9e-39), so K's bytes and
    scales differed from ``reference_fp8`` in the forward and backward quantizers."""
    from hyperrec.jagged_attn._triton._fp8_launch import quantize_grad_operands
    from hyperrec.jagged_attn._triton._fp8_launch import quantize_qkv as kernel_quantize_qkv
    from hyperrec.jagged_attn.fp8 import key_shift

    g = torch.Generator().manual_seed(9)
    o = offsets_tensor([5, 0, 70, 1], "cpu")
    T, H, D = int(o[-1]), 1, 32
    k = (torch.randn(T, H, D, generator=g) * 2.0**-125).bfloat16()
    q = torch.randn(T, H, D, generator=g).bfloat16()
    sh = key_shift(k, o)
    sub = sh.float().abs()
    assert ((sub > 0) & (sub < torch.finfo(torch.bfloat16).tiny)).any()  # subnormal shifts
    cfg = FP8Config(hadamard=False)
    res = quantize_grad_operands(q, k, q, q, o, o, cfg, key_shift=sh)
    ref = reference_fp8.quantize_tokens(k, cfg, rotate=False, shift=sh, offsets=o)
    assert torch.equal(res[1].data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(res[1].scale, ref.scale)
    cfg = FP8Config(hadamard=False, block_kv=32, p_block=32)
    r1 = kernel_quantize_qkv(q, k, q, o, o, cfg, key_shift=sh)
    r2 = reference_fp8.quantize_qkv(q, k, q, o, o, cfg, key_shift=sh)
    assert torch.equal(r1.k.data.view(torch.uint8), r2.k.data.view(torch.uint8))
    assert torch.equal(r1.k.scale, r2.k.scale)
