"""The public quantization API: shapes, axes, dequantize, validation, torch.library."""

from __future__ import annotations

import pytest
import torch
from mx_helpers import INTERPRET, u8

from hyperrec.mxfp8 import E2M1, MXTensor, mx_quantize, to_mx
from hyperrec.mxfp8 import reference as ref
from hyperrec.testing import snr_db

BACKENDS = ["torch", "triton"] if INTERPRET else ["torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("shape", "axis"), [((4, 6, 64), -1), ((4, 64, 6), 1), ((64, 40), 0)])
def test_to_mx_shapes_axes_and_roundtrip(backend, shape, axis):
    x = torch.randn(*shape, dtype=torch.bfloat16)
    q = to_mx(x, axis=axis, backend=backend)
    ax = axis % x.dim()
    assert isinstance(q, MXTensor) and q.axis == ax and q.shape == x.shape
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    want_scale = list(shape)
    want_scale[ax] = -(-shape[ax] // 32)
    assert list(q.scale.shape) == want_scale and q.scale.dtype == torch.uint8
    deq = q.dequantize()
    assert deq.dtype == torch.bfloat16 and deq.shape == x.shape
    assert snr_db(deq.float(), x.float()) > 25  # E4M3 round trip: ~30 dB on Gaussians
    # the same quantization through the reference
    data, scale = ref.to_mx(x, q.fmt, 32, "rceil", axis)
    assert torch.equal(u8(q.data), u8(data)) and torch.equal(q.scale, scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mx4_packs_along_the_axis(backend):
    x = torch.randn(8, 64)
    q = to_mx(x, elem_dtype="e2m1", backend=backend)
    assert q.fmt is E2M1 and q.data.dtype == torch.uint8 and q.data.shape == (8, 32)
    assert snr_db(q.dequantize(), x) > 8  # two mantissa bits... one, really
    qc = to_mx(x.t().contiguous(), elem_dtype="e2m1", axis=0, backend=backend)
    assert qc.data.shape == (32, 8)
    torch.testing.assert_close(qc.dequantize().t(), q.dequantize())


def test_transpose_swaps_axis_and_shape():
    x = torch.randn(64, 96)
    q = to_mx(x)
    t = q.t()
    assert t.shape == (96, 64) and t.axis == 0
    torch.testing.assert_close(t.dequantize(), q.dequantize().t())
    with pytest.raises(ValueError, match="2-D"):
        to_mx(torch.randn(2, 3, 32)).t()


def test_zero_sized_and_ragged_inputs():
    q = to_mx(torch.randn(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 2)
    x = torch.randn(3, 33)
    q = to_mx(x)
    assert q.scale.shape == (3, 2) and q.dequantize().shape == (3, 33)
    assert snr_db(q.dequantize(), x) > 25


def test_dequantize_nan_block_is_nan():
    x = torch.ones(2, 32)
    x[1, 5] = float("nan")
    deq = to_mx(x).dequantize(torch.float32)
    assert torch.isnan(deq[1]).all() and (deq[0] == 1).all()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": [1.0]}, TypeError, "x must be a torch.Tensor"),
        ({"x": torch.ones(4, 32, dtype=torch.int32)}, TypeError, "x must be a float32"),
        ({"elem_dtype": torch.int8}, ValueError, "elem_dtype"),
        ({"block_size": 24}, ValueError, "block_size"),
        ({"block_size": 32.0}, TypeError, "block_size"),
        ({"scale_mode": "even"}, ValueError, "scale_mode"),
        ({"axis": 2}, ValueError, "axis"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"seed": 3}, ValueError, "seed"),
        ({"stochastic_rounding": True, "seed": -1}, ValueError, "seed"),
        ({"stochastic_rounding": 1}, TypeError, "stochastic_rounding"),
        ({"x": torch.ones(4, 33), "elem_dtype": "e2m1"}, ValueError, "even"),
    ],
)
def test_to_mx_rejects_bad_arguments(kwargs, exc, match):
    args = {"x": torch.ones(4, 32), **kwargs}
    x = args.pop("x")
    with pytest.raises(exc, match=match):
        to_mx(x, **args)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        to_mx(torch.ones(4, 32), backend="triton")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": torch.ones(2, 4, 32)}, ValueError, "2-D"),
        ({"rowwise": False}, ValueError, "at least one"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"hadamard": 8, "colwise": True}, ValueError, "hadamard"),
        ({"hadamard": 16}, ValueError, "colwise"),
        ({"hadamard": 32, "colwise": True, "block_size": 16}, ValueError, "divide"),
        ({"x": torch.ones(3, 32), "colwise": True, "elem_dtype": "e2m1"}, ValueError, "even"),
    ],
)
def test_mx_quantize_rejects_bad_arguments(kwargs, exc, match):
    args = {"x": torch.ones(4, 32), **kwargs}
    x = args.pop("x")
    with pytest.raises(exc, match=match):
        mx_quantize(x, **args)


def test_custom_ops_pass_opcheck():
    from hyperrec.mxfp8._ops import mm_op, quantize_2d_op

    # torch's schema checker cannot compare FP8 tensors (no CPU mul for them), so ops with
    # FP8 outputs skip that one check; the MX4 variant (uint8 outputs) runs all of them.
    no_schema = ("test_faketensor", "test_aot_dispatch_dynamic")
    x = torch.randn(64, 64)
    seed = torch.tensor([3], dtype=torch.int64)
    torch.library.opcheck(
        quantize_2d_op,
        (x, seed, "e4m3", 32, "rceil", True, True, "relu", 16, 0, "torch"),
        test_utils=no_schema,
    )
    torch.library.opcheck(
        quantize_2d_op, (x, None, "e2m1", 32, "floor", True, True, "none", 0, 0, "torch")
    )
    a = to_mx(x)
    b = to_mx(torch.randn(48, 64)).t()
    torch.library.opcheck(
        mm_op,
        (a.data, a.scale, b.data, b.scale, None, 32, 1.0, torch.bfloat16, "torch"),
        test_utils=no_schema,
    )


def test_compiles_fullgraph():
    def f(x):
        row, col = mx_quantize(x, colwise=True)
        return row.dequantize(torch.float32) + col.dequantize(torch.float32)

    x = torch.randn(64, 64)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 32), (0,)])
def test_mx4_empty_round_trip(shape):
    """An empty MX4 tensor dequantizes to its shape (the nibble unpacking could not infer
    a length for zero rows before 0.4.3)."""
    x = torch.randn(shape)
    q = to_mx(x, elem_dtype="e2m1", block_size=32)
    out = q.dequantize(backend="torch")
    assert out.shape == x.shape and out.dtype == x.dtype
