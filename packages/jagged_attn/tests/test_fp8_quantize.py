"""Q/K/V quantization for ``precision="fp8" | "mxfp8"``: the kernel against its reference,
bit for bit, and the reference against independent definitions.

The kernel runs under ``TRITON_INTERPRET=1`` on the CPU (CUDA when present). Cases: jagged
lengths with empty and one-token sequences, blocks that end inside a sequence, every
block size class, both scale rules, the Hadamard rotation, strided views of one projection
buffer, NaN/Inf/zero/tiny blocks, and MX scales at the edges of E8M0.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_check import DEVICE, kernels_available, offsets_tensor

from hyperrec.jagged_attn import FP8Config, quantize_qkv, reference_fp8
from hyperrec.jagged_attn.fp8 import key_shift
from hyperrec.jagged_attn.reference_fp8 import NAN_BYTE, fwht, hadamard_signs

mx = pytest.importorskip("hyperrec.mxfp8")

LENS = (37, 0, 1, 70, 5)


def _inputs(lens, heads=2, dim=32, dim_v=48, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k = (torch.randn(total, heads, dim, generator=g) for _ in range(2))
    v = torch.randn(total, heads, dim_v, generator=g)
    # a spread of magnitudes across heads and tokens, so block scales differ
    q = q * torch.exp2(torch.randint(-6, 7, (total, 1, 1), generator=g).float())
    if heads > 1:
        k[:, 1] *= 1e-3
    return (t.to(dtype).to(DEVICE) for t in (q, k, v)), offsets_tensor(lens, DEVICE)


def _bytes(t):
    """Bits to compare (NaN == NaN): uint8 codes, or float32 scales as int32."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.uint8)


def _assert_same(got, want, offsets, total):
    """Bitwise equality of two QuantizedQKV (V: only the columns that hold tokens)."""
    for name in "qk":
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(_bytes(a.data).cpu(), _bytes(b.data).cpu()), f"{name} data"
        assert torch.equal(_bytes(a.scale).cpu(), _bytes(b.scale).cpu()), f"{name} scale"
    assert torch.equal(got.v.pad_offsets.cpu(), want.v.pad_offsets.cpu())
    seq, pos = reference_fp8._positions(offsets.cpu(), total)
    col = want.v.pad_offsets.long().cpu()[seq] + pos
    va, vb = _bytes(got.v.data).cpu(), _bytes(want.v.data).cpu()
    assert torch.equal(va[:, :, col], vb[:, :, col]), "v data"
    if got.config.mx:
        blocks = torch.unique(col // 32)
        assert torch.equal(got.v.scale.cpu()[:, :, blocks], want.v.scale.cpu()[:, :, blocks])
    else:
        assert torch.equal(_bytes(got.v.scale).cpu(), _bytes(want.v.scale).cpu()), "v scale"


needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or the interpreter")

CONFIGS = [
    FP8Config(),  # Hadamard on (power-of-two head dim)
    FP8Config(block_q=1, block_kv=32, p_block=32, hadamard=False),
    FP8Config(block_q=16, block_kv=64, p_block=32, scale="fp32", hadamard=False),
    FP8Config(block_q=32, block_kv=32, p_block=32, hadamard=True, hadamard_seed=3),
    FP8Config(format="mxfp8", hadamard=False),
    FP8Config(format="mxfp8"),
]


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.encode().replace(";", ","))
def test_kernel_bit_exact(config):
    (q, k, v), offsets = _inputs(LENS)
    got = quantize_qkv(q, k, v, offsets, precision=config, backend="triton")
    want = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config)
    _assert_same(got, want, offsets, q.shape[0])


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_kernel_bit_exact_with_key_shift(fmt):
    """``smooth_k``'s per-sequence shift is subtracted from each sequence's keys before the
    rotation, bit for bit as the reference does; keys sharing a large common component
    quantize about as well as keys without it (their scales follow the variation)."""
    (q, k, v), offsets = _inputs(LENS)
    config = FP8Config(format=fmt) if fmt == "mxfp8" else FP8Config(block_kv=32, p_block=32)
    bias = 30.0 * torch.randn(k.shape[1:], generator=torch.Generator().manual_seed(4))
    k = (k.float() + bias.to(k.device)).to(k.dtype)
    shift = key_shift(k, offsets)
    assert shift.dtype == torch.bfloat16 and shift.shape == (len(LENS), *k.shape[1:])
    got = quantize_qkv(q, k, v, offsets, precision=config, backend="triton", key_shift=shift)
    want = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config, key_shift=shift)
    _assert_same(got, want, offsets, q.shape[0])
    plain = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config)
    kd = reference_fp8.dequantize(want.k, config, offsets, k.shape[0]).cpu()
    kp = reference_fp8.dequantize(plain.k, config, offsets, k.shape[0]).cpu()
    shifted = reference_fp8._rotate(k, config, shift, offsets).cpu()
    exact = reference_fp8._rotate(k, config).cpu()
    assert (kd - shifted).norm() < 0.2 * (kp - exact).norm()


@needs_kernels
@pytest.mark.parametrize(
    "config", CONFIGS[-2:] + CONFIGS[1:2], ids=["mx", "mx_rotated", "fp8_rows"]
)
def test_kernel_bit_exact_on_bf16_subnormals(config):
    """Blocks of bf16 subnormals (scales at the bottom of E8M0, values the fp8 floor
    zeroes): the same bytes and key means as the reference. The interpreter's own bf16
    conversion gets subnormals wrong, which made every byte of such an MX block differ."""
    lens = (5, 0, 40)
    (q, k, v), offsets = _inputs(lens, dim_v=32, seed=3)
    g = torch.Generator().manual_seed(5)
    tiny = (torch.randn(q.shape, generator=g) * 1e-39).to(torch.bfloat16).to(q.device)
    assert ((tiny != 0) & (tiny.float().abs() < torch.finfo(torch.float32).tiny)).any()
    q, v = tiny, tiny.flip(0)
    k = torch.cat([k[:5], tiny[5:]])  # one sequence normal, one subnormal
    got = quantize_qkv(q, k, v, offsets, precision=config, backend="triton")
    want = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config)
    _assert_same(got, want, offsets, q.shape[0])
    shift = key_shift(k, offsets)
    total = k.float().cpu().double()
    for b, (s, e) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:], strict=False)):
        want_mean = total[s:e].mean(0) if e > s else torch.zeros_like(total[0])
        assert torch.equal(shift[b].cpu(), want_mean.to(torch.bfloat16)), b


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_key_shift_per_sequence_finite_mean(backend, monkeypatch):
    """The shift: per sequence and head, the mean of its keys over the finite values; zeros
    for an empty sequence; a NaN key moves no other sequence's shift. The kernel and the
    PyTorch path both sum in float64 (exact for bf16): bit-identical."""
    from hyperrec.jagged_attn._fp8 import quantize as q_mod

    if backend == "torch":
        monkeypatch.setattr(q_mod, "fp8_kernels_supported", lambda device: False)
    g = torch.Generator().manual_seed(0)
    lens = (70, 0, 3)
    k = torch.randint(-64, 64, (73, 2, 8), generator=g).float() / 8
    k[71, 1, 3] = float("nan")
    k[1, 0, 0] = float("inf")
    offsets = offsets_tensor(lens, DEVICE)
    got = key_shift(k.bfloat16().to(DEVICE), offsets).float().cpu()
    assert got.shape == (3, 2, 8)
    want0 = k[:70].double().mean(0)
    want0[0, 0] = k[[0, *range(2, 70)], 0, 0].double().mean()
    assert torch.equal(got[0], want0.bfloat16().float())
    assert torch.equal(got[1], torch.zeros(2, 8))
    want2 = k[70:73].double().mean(0)
    want2[1, 3] = k[[70, 72], 1, 3].double().mean()
    assert torch.equal(got[2], want2.bfloat16().float())
    assert torch.isfinite(got).all()
    # a long sequence (several row blocks and column blocks in the kernel)
    long = torch.randn(600, 2, 40, generator=g).bfloat16()
    got = key_shift(long.to(DEVICE), offsets_tensor((600,), DEVICE)).float().cpu()
    assert torch.equal(got[0], long.double().mean(0).bfloat16().float())


def test_key_shift_bad_inputs():
    """Clear errors naming the argument, before any kernel runs."""
    k = torch.zeros(5, 2, 8, dtype=torch.bfloat16)
    good = torch.tensor([0, 2, 5])
    with pytest.raises(TypeError, match="k must be"):
        key_shift(k.float().numpy(), good)
    with pytest.raises(TypeError, match="k must be"):
        key_shift(k.long(), good)
    with pytest.raises(ValueError, match="k must be 3-D"):
        key_shift(k[0], good)
    with pytest.raises(TypeError, match="kv_offsets"):
        key_shift(k, good.float())
    with pytest.raises(ValueError, match="kv_offsets must be 1-D"):
        key_shift(k, good[None])
    with pytest.raises(ValueError, match="kv_offsets must have B \\+ 1 >= 1 entries"):
        key_shift(k, good[:0])
    with pytest.raises(ValueError, match=r"kv_offsets\[0\] must be 0"):
        key_shift(k, torch.tensor([1, 2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        key_shift(k, torch.tensor([0, 4, 3, 5]))
    with pytest.raises(ValueError, match=r"kv_offsets\[-1\] must equal k.shape\[0\] = 5"):
        key_shift(k, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="kv_offsets must be on meta like k"):
        key_shift(k.to("meta"), good)


@needs_kernels
def test_kernel_bit_exact_cross_attention_and_strided_views():
    """Q from one length distribution, K/V from another; K and V are column slices of one
    projection buffer (last dim contiguous, row stride 3x), read in place."""
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens = (3, 0, 20), (40, 7, 0)
    q = torch.randn(sum(q_lens), 2, 32, generator=g).to(DEVICE, torch.float16)
    proj = torch.randn(sum(kv_lens), 3 * 2 * 32, generator=g).to(DEVICE, torch.float16)
    _, k, v = (t.view(-1, 2, 32) for t in proj.split(64, dim=-1))
    assert not k.is_contiguous()
    qo, ko = offsets_tensor(q_lens, DEVICE), offsets_tensor(kv_lens, DEVICE)
    for config in (FP8Config(block_q=2, block_kv=32, p_block=32), FP8Config(format="mxfp8")):
        assert config.rotates(32)
        got = quantize_qkv(q, k, v, qo, ko, precision=config, backend="triton")
        want = reference_fp8.quantize_qkv(q, k, v, qo, ko, config)
        for name in "qk":
            a, b = getattr(got, name), getattr(want, name)
            assert torch.equal(_bytes(a.data).cpu(), _bytes(b.data).cpu())
            assert torch.equal(_bytes(a.scale).cpu(), _bytes(b.scale).cpu())
        seq, pos = reference_fp8._positions(ko.cpu(), k.shape[0])
        col = want.v.pad_offsets.long().cpu()[seq] + pos
        va, vb = _bytes(got.v.data).cpu(), _bytes(want.v.data).cpu()
        assert torch.equal(va[:, :, col], vb[:, :, col])


@needs_kernels
def test_nonfinite_zero_and_tiny_blocks_stay_in_their_block():
    """A NaN/Inf marks only its own block (scale NaN, every element the NaN byte), never
    another sequence's; all-zero blocks get scale 1; tiny blocks are scaled as 2**-24."""
    (q, k, v), offsets = _inputs((40, 33, 3), heads=1, dim=32, dim_v=32)
    q[5, 0, 3] = float("nan")  # sequence 0, first 32-token block
    k[41, 0, 0] = float("inf")  # sequence 1
    v[:33] = 0.0  # sequence 0's first V block: zeros
    k[:40] *= 1e-12  # sequence 0: below 2**-24 (bf16 keeps it)
    config = FP8Config(block_q=32, block_kv=32, p_block=32, hadamard=False)
    got = quantize_qkv(q, k, v, offsets, precision=config, backend="triton")
    want = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config)
    _assert_same(got, want, offsets, q.shape[0])
    qb = _bytes(want.q.data).cpu()
    assert (qb[:32] == NAN_BYTE).all() and torch.isnan(want.q.scale[:32]).all()
    assert (qb[32:] != NAN_BYTE).all() and torch.isfinite(want.q.scale[32:]).all()
    assert torch.isnan(want.k.scale[40:72]).all()  # its 32-token block only
    assert torch.isfinite(want.k.scale[:40]).all() and torch.isfinite(want.k.scale[72:]).all()
    assert (want.v.scale[:32] == 1).all()
    assert (want.k.scale[:32] == 2.0 ** math.ceil(math.log2(2.0**-24 / 448))).all()


def test_pow2_rule_equals_the_division_rule():
    """The bit formula for ``ceil(log2(fl(amax / 448)))`` equals the division for normal,
    edge-mantissa and huge amax."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(103 << 23, 254 << 23, (200_000,), generator=g, dtype=torch.int64)
    edges = [(e << 23) | m for e in (103, 127, 135, 200, 253) for m in
             (0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF)]  # fmt: skip
    bits = torch.cat([bits, torch.tensor(edges)]).to(torch.int32)
    scale, inv = reference_fp8.fp8_block_scales(bits, "pow2")
    d = bits.view(torch.float32) / torch.full((bits.numel(),), 448.0)  # one IEEE division
    db = d.view(torch.int32)
    e = ((db >> 23) & 0xFF) - 127 + ((db & 0x7FFFFF) != 0).int()
    assert torch.equal(scale, torch.exp2(e.float())) and torch.equal(inv, torch.exp2(-e.float()))
    a = bits.view(torch.float32)
    assert (a / scale <= 448).all() and (a / scale > 224).all()


def test_fp32_rule_and_special_blocks():
    bits = torch.tensor([0, 1, 0x7F800000, 0x7FC00000, 0x3F800000], dtype=torch.int32)
    scale, inv = reference_fp8.fp8_block_scales(bits, "fp32")
    assert scale[0] == 1 and inv[0] == 1  # all-zero block
    f448 = torch.tensor(448.0)
    assert scale[1] == torch.tensor(2.0**-24) / f448  # tiny
    assert torch.isnan(scale[2:4]).all() and torch.isnan(inv[2:4]).all()
    assert scale[4] == torch.tensor(1.0) / f448 and inv[4] == 448


@needs_kernels
def test_mx_scale_bytes_at_the_edges():
    """E8M0 bytes of the kernel for block maxima around the subnormal quotients (the one
    amax whose quotient rounds down to 2**-127), zero, huge and 448 * 2**k, against
    hyperrec.mxfp8's reference."""
    odd = (8 << 23) | 0x600001
    specials = [0, 1, odd - 1, odd, odd + 1, (8 << 23) | 0x600000, 0x00800000, 0x3F800000,
                0x43E00000, 0x7F7FFFFF, (9 << 23) | 0x600000, (7 << 23) | 0x7FFFFF]  # fmt: skip
    rows = []
    for s in specials:
        row = torch.zeros(32, dtype=torch.int32)
        row[7] = s
        rows.append(row.view(torch.float32))
    x = torch.stack(rows)[:, None, :].to(DEVICE)  # (T, 1, 32) float32, one MX block a row
    offsets = offsets_tensor((x.shape[0],), DEVICE)
    config = FP8Config(format="mxfp8", hadamard=False)
    got = quantize_qkv(x, x, x, offsets, precision=config, backend="triton")
    codes, scale = mx.reference.quantize_blocks(x.cpu().reshape(-1, 32), mx.E4M3, 32, "rceil")
    assert torch.equal(got.q.scale.cpu().reshape(-1), scale.reshape(-1))
    assert torch.equal(_bytes(got.q.data).cpu().reshape(-1, 32), codes)


def test_mx_rows_match_hyperrec_mxfp8_to_mx():
    """The reference's MX rows are hyperrec.mxfp8's public ``to_mx`` (OCP E4M3, RCEIL)."""
    (q, _, _), offsets = _inputs(LENS, dim=64)
    ours = reference_fp8.quantize_rows(q, offsets, FP8Config(format="mxfp8", hadamard=False),
                                       role="q")  # fmt: skip
    theirs = mx.to_mx(q.float().reshape(-1, 64), block_size=32, scale_mode="rceil",
                      backend="torch")  # fmt: skip
    assert torch.equal(ours.data.view(torch.uint8).reshape(-1, 64).cpu(),
                       theirs.data.view(torch.uint8).cpu())  # fmt: skip
    assert torch.equal(ours.scale.reshape(-1, 2).cpu(), theirs.scale.cpu())


@pytest.mark.parametrize("n", [16, 32, 128])
def test_fwht_is_sylvester_hadamard(n):
    x = torch.randn(5, n, dtype=torch.float64).float()
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    torch.testing.assert_close(fwht(x).double(), x.double() @ h, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fwht(fwht(x)) / n, x, rtol=1e-6, atol=1e-6)
    s = hadamard_signs(n, 7)
    assert set(s.tolist()) <= {-1.0, 1.0} and torch.equal(s, hadamard_signs(n, 7))


def test_rotation_keeps_scores():
    """Rotated Q and K (before quantization) have ``Q' K'^T = D Q K^T``."""
    x, y = torch.randn(9, 64), torch.randn(11, 64)
    s = hadamard_signs(64, 0)
    torch.testing.assert_close(fwht(x * s) @ fwht(y * s).T, 64 * x @ y.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.format + str(c.hadamard))
def test_dequantize_round_trip(config):
    """E4M3 keeps 3 mantissa bits: every element within 2**-4 relative (or the subnormal
    step) of its (rotated) input."""
    (q, k, v), offsets = _inputs(LENS)
    qkv = reference_fp8.quantize_qkv(q, k, v, offsets, offsets, config)
    total = q.shape[0]
    for name, x in (("q", q), ("k", k), ("v", v)):
        x = x.float().cpu()
        if config.rotates(x.shape[-1]) and name != "v":
            x = fwht(x * hadamard_signs(x.shape[-1], config.hadamard_seed))
        t = getattr(qkv, name)
        back = reference_fp8.dequantize(t, config, offsets.cpu(), total)
        tol = x.abs() * 2.0**-4 + x.abs().amax() * 2.0**-15
        assert ((back - x).abs() <= tol).all(), name
