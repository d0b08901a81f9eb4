"""The storage tracker's accounting and the packed formats."""

from __future__ import annotations

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


@pytest.mark.parametrize("fmt", SAVE_FORMATS)
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
