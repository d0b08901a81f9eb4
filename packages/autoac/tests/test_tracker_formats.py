"""The storage tracker's accounting and the packed formats."""

from __future__ import annotations

import math

import pytest
import torch

from hyperrec.autoac import MemoryTracker
from hyperrec.autoac.formats import (
    SAVE_FORMATS,
    can_pack,
    pack_storage,
    packed_nbytes,
    unpack_view,
)
from hyperrec.mxfp8 import reference as mxref
from hyperrec.mxfp8 import to_mx
from hyperrec.testing import snr_db


def test_tracker_counts_exact_bytes():
    x = torch.randn(1000)  # resident: created before the step
    tr = MemoryTracker(record_ops=True)
    with tr:
        a = x * 2  # 4000 bytes
        b = a[10:]  # a view: no bytes
        c = b.to(torch.float64)  # a copy through an op that may alias: 7920 bytes
        d = c.reshape(10, 99)  # a view of a contiguous tensor: no bytes
        del a  # b still holds the storage
        e = d.sum()
        del b, c, d
    tr.finish()
    assert tr.resident_bytes == 4000
    assert tr.peak_bytes() == 4000 + 4000 + 7920 + 8
    live = tr.live_bytes()
    assert live[-1] == 4000 + 8  # only the sum is alive at the end
    assert [tr.storages[s].nbytes for o in tr.ops for s in o.new] == [4000, 7920, 8]
    assert e.item() != 0


def test_tracker_sees_backward_and_marks_inplace_writes():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    tr = MemoryTracker(record_ops=True)
    with tr:
        y = x @ w
        y.relu_()
        loss = y.sum()
        tr.phase = "bwd"
        loss.backward()
    tr.finish()
    phases = {o.phase for o in tr.ops}
    assert phases == {"fwd", "bwd"}
    relu = next(o for o in tr.ops if "relu_" in str(o.func))
    assert relu.writes and not relu.new
    mm = next(o for o in tr.ops if str(o.func) == "aten.mm.default")
    assert mm.flops == 2 * 32 * 64 * 64
    # w.grad (64*64*4 bytes) is allocated in the backward and alive at the end.
    assert tr.live_bytes()[-1] >= 64 * 64 * 4


def test_tracker_random_and_collective_flags():
    from hyperrec.autoac.tracker import is_collective, is_random

    assert is_random(torch.ops.aten.bernoulli.default)
    assert not is_random(torch.ops.aten.mm.default)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 1, 4, 8)
    assert not is_random(sdpa, (q, q, q, 0.0))
    assert is_random(sdpa, (q, q, q, 0.1))
    assert is_collective(torch.ops._c10d_functional.all_reduce.default)
    assert not is_collective(torch.ops.aten.add.Tensor)


@pytest.mark.parametrize("fmt", [f for f in SAVE_FORMATS if f != "mxint8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip_matches_mxfp8_reference(fmt, dtype):
    x = torch.randn(48, 384).to(dtype)
    p = pack_storage(x, fmt)
    assert p.nbytes == packed_nbytes(x.numel(), fmt)
    got = unpack_view(p, x.shape, x.stride(), x.storage_offset())
    elem, block = {
        "mxfp8": (torch.float8_e4m3fn, 32),
        "fp8_e4m3": (torch.float8_e4m3fn, 128),
        "fp8_e5m2": (torch.float8_e5m2, 128),
        "mx4": ("e2m1", 32),
    }[fmt]
    # Blocks of consecutive elements of the storage: the reference on the flat run.
    q = to_mx(x.reshape(1, -1), elem_dtype=elem, block_size=block, backend="torch")
    want = mxref.dequantize(q.data, q.scale, q.fmt, block, 1, x.numel(), dtype).reshape(x.shape)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    floor = {"mxfp8": 30, "fp8_e4m3": 30, "fp8_e5m2": 24, "mx4": 15}[fmt]
    assert snr_db(got.float(), x.float()) > floor


def test_views_rebuilt_from_one_packed_storage():
    base = torch.randn(64, 96)
    qkv = base.view(64, 3, 32)
    k = qkv[:, 1].t()  # a strided, offset view
    p = pack_storage(k, "mxfp8")
    flat = p.dequantize()
    assert flat.numel() == base.numel()
    kk = unpack_view(flat, k.shape, k.stride(), k.storage_offset())
    full = unpack_view(flat, base.shape, base.stride(), 0)
    assert torch.equal(kk, full.view(64, 3, 32)[:, 1].t())
    assert snr_db(kk, k) > 30


def test_pack_rejects_what_it_cannot_hold():
    assert not can_pack(torch.int64, 64, "mxfp8")
    assert not can_pack(torch.float32, 48, "mx4")  # not a whole number of 32-blocks
    assert can_pack(torch.float32, 96, "mxfp8")
    assert not can_pack(torch.float32, 96, "fp8_e4m3")  # 128-blocks
    with pytest.raises(ValueError, match="mx4"):
        pack_storage(torch.randn(48), "mx4")
    with pytest.raises(ValueError, match="fmt"):
        pack_storage(torch.randn(64), "fp16")
    with pytest.raises(ValueError, match="fmt"):
        packed_nbytes(10, "int8")
    assert packed_nbytes(64, "mx4") == 32 + 2
    assert packed_nbytes(100, "fp8_e4m3") == 100 + 1


def test_nan_blocks_stay_nan():
    x = torch.randn(128)
    x[5] = float("nan")
    got = pack_storage(x, "mxfp8").dequantize()
    assert torch.isnan(got[:32]).all()
    assert torch.isfinite(got[32:]).all()


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_fp8_dequantize_is_bit_identical_to_mxfp8(fmt, dtype):
    """autoac's two-pass FP8 unpacking equals ``MXTensor.dequantize`` bit for bit, over
    60 decades of magnitude, zero, subnormal, NaN and Inf blocks."""
    x = torch.randn(16, 1024) * torch.logspace(-30, 30, 1024)
    x[3, 5], x[7, 100] = float("nan"), float("inf")
    x[9, :32], x[10, 32:64] = 0.0, 1e-40
    x = x.to(dtype)
    p = pack_storage(x, fmt)
    got, want = p.dequantize(), p.mx.dequantize(dtype).reshape(-1)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


# --------------------------------------------------------------------------- MXINT8
def _mxint8_scalar(values: list[float]) -> list[float]:
    """OCP MXINT8 of one 32-element block, written from the spec with Python floats
    (independent of the tensor implementation): shared exponent floor(log2 amax), at
    least -120; elements round-half-even(x / 2**e * 64), clamped to +-127, times
    2**e / 64; NaN/Inf anywhere: the block is NaN."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return [math.nan] * len(values)
    amax = max(abs(v) for v in values)
    e = math.frexp(amax)[1] - 1 if amax > 0 else -120
    e = max(e, -120)
    out = []
    for v in values:
        q = round(math.ldexp(v, 6 - e))  # Python's round: half to even
        out.append(math.ldexp(max(-127, min(127, q)), e - 6))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxint8_matches_a_scalar_reference_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(11)
    # 40 decades of block magnitudes, ties (k + 1/2 steps), zero/tiny/non-finite blocks
    x = torch.randn(8, 1024, generator=g) * torch.logspace(-20, 20, 32).repeat_interleave(32)
    # amax 31: e = 4, step 0.25; 16 + (k + 1/2) / 4 are exact ties (half to even)
    x[0, :31] = 16 + (torch.arange(31) + 0.5) * 0.25
    x[0, 31] = 31.0
    x[1, :32] = 0.0
    x[1, 32:64] = 1e-39  # below 2**-120 (fp32 subnormal)
    x[2, 5], x[3, 40], x[4, 70] = float("nan"), float("inf"), float("-inf")
    x[5, :32] = 1.9999  # rounds to 128 before the clamp
    x = x.to(dtype)
    got = pack_storage(x, "mxint8").dequantize().view_as(x)
    flat = x.double().reshape(-1).tolist()
    want = [v for i in range(0, len(flat), 32) for v in _mxint8_scalar(flat[i : i + 32])]
    want_t = torch.tensor(want, dtype=torch.float64).view_as(x)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want_t.isnan())
    assert torch.equal(got.double().nan_to_num(7.0), want_t.to(dtype).double().nan_to_num(7.0))


def test_mxint8_error_is_well_below_mxfp8_at_the_same_size():
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(3)).bfloat16()
    err = {}
    for fmt in ("mxfp8", "mxint8"):
        p = pack_storage(x, fmt)
        assert p.nbytes == packed_nbytes(x.numel(), fmt)
        got = p.dequantize().view_as(x)
        err[fmt] = float((got.double() - x.double()).norm() / x.double().norm())
    assert packed_nbytes(x.numel(), "mxint8") == packed_nbytes(x.numel(), "mxfp8")
    # Gaussian blocks: ~0.8% against ~2.6% relative L2
    assert err["mxint8"] < 0.4 * err["mxfp8"], err
    assert err["mxint8"] < 0.01, err


def test_mxint8_rows_of_a_large_tensor_are_all_written():
    """A tensor over one chunk (2**23 elements) is packed in row chunks: every row must
    equal the same rows packed on their own (rows are independent blocks)."""
    from hyperrec.autoac.formats import quantize_mxint8

    big = torch.randn((1 << 23) // 64 + 7, 64)
    got = quantize_mxint8(big)
    ref = [quantize_mxint8(c) for c in big.split(4096)]
    assert torch.equal(got.data, torch.cat([r.data for r in ref]))
    assert torch.equal(got.scale, torch.cat([r.scale for r in ref]))


def test_mxint8_rejects_bad_shapes():
    from hyperrec.autoac.formats import quantize_mxint8

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxint8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="2-D bfloat16/float16/float32"):
        quantize_mxint8(torch.ones(4, 32, dtype=torch.int32))
    assert not can_pack(torch.float32, 48, "mxint8")
    assert can_pack(torch.bfloat16, 96, "mxint8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxint8_triton_kernels_equal_the_torch_path(dtype):
    """The one-pass Triton pack/unpack (CUDA's default; the interpreter on the CPU) write
    the same bytes and values as the PyTorch path, over 60 decades, ties, zero, tiny,
    NaN/Inf blocks and a ragged last program (blocks not a multiple of 64)."""
    import os

    from hyperrec.autoac.formats import dequantize_mxint8, quantize_mxint8

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on the CPU only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96 * 32, generator=g) * torch.logspace(-30, 30, 96).repeat_interleave(32)
    x[0, :31] = 16 + (torch.arange(31) + 0.5) * 0.25
    x[1, :32], x[1, 32:64] = 0.0, 1e-39
    x[2, 5], x[3, 40], x[4, 70] = float("nan"), float("inf"), float("-inf")
    x[5, :32] = 1.9999
    x = x.to(dtype)
    a = quantize_mxint8(x, backend="torch")
    b = quantize_mxint8(x, backend="triton")
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    for out_dtype in (dtype, torch.float32):
        u = dequantize_mxint8(a, out_dtype, backend="torch")
        v = dequantize_mxint8(a, out_dtype, backend="triton")
        assert u.dtype == v.dtype == out_dtype
        assert torch.equal(u.isnan(), v.isnan())
        assert torch.equal(u.nan_to_num(7.0), v.nan_to_num(7.0))
    with pytest.raises(ValueError, match="backend"):
        quantize_mxint8(x, backend="cuda")
