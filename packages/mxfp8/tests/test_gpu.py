"""GPU tests: the compiled kernels (hardware FP8 casts, FP8 tensor cores) against the
reference. Deselected on CPU CI (``-m "not gpu"``)."""

from __future__ import annotations

import mx_cases as C
import pytest
import torch

from hyperrec.mxfp8 import MXLinear, PrecisionPolicy, mx_mm, mx_quantize, to_mx
from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8._triton.quantize import launch_quantize_2d
from hyperrec.mxfp8.formats import get_format
from hyperrec.testing import snr_db

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def _heavy_tailed(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(m, k) * torch.exp(2 * torch.randn(m, k))
    return x.to(dtype)


@pytest.mark.parametrize(
    ("dtype", "elem", "hw"),
    [
        (torch.bfloat16, "e4m3", True),
        (torch.bfloat16, "e4m3", False),
        (torch.bfloat16, "e5m2", True),
        (torch.bfloat16, "e2m1", True),
        (torch.float32, "e4m3", True),
        (torch.float32, "e5m2", False),
        (torch.float16, "e4m3", True),
    ],
)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_quantize_bit_exact_on_gpu(dtype, elem, mode, hw):
    x = _heavy_tailed(1000, 1056, dtype)
    x[3, 7] = float("nan")
    x[40, 100] = float("-inf")
    x[64:96, 256:288] = 0
    fmt = get_format(elem)
    got = launch_quantize_2d(
        x.cuda(),
        fmt=fmt,
        block_size=32,
        rceil=mode == "rceil",
        rowwise=True,
        colwise=True,
        act="none",
        hadamard=None,
        seed=None,
        hw_cast=hw,
    )
    want = ref.quantize_2d(x, fmt=fmt, block_size=32, scale_mode=mode, rowwise=True, colwise=True)
    for g, w in zip(got, want):
        assert torch.equal(_bytes(g), _bytes(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_conformance_cases_on_gpu(dtype, mode):
    cases = C.e4m3_cases(dtype)
    x, scales, data = C.stack(cases, dtype, mode)
    q = to_mx(x.cuda(), scale_mode=mode)
    assert torch.equal(q.scale.cpu()[:, 0], scales)
    assert torch.equal(_bytes(q.data), data)


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize(
    "opts",
    [
        {"activation": "relu"},
        {"activation": "relu2", "stochastic_rounding": True, "seed": 3},
        {"stochastic_rounding": True, "seed": 11},
    ],
)
def test_fused_options_bit_exact_on_gpu(block_size, opts):
    x = torch.randn(512, 384, dtype=torch.bfloat16)
    got = mx_quantize(x.cuda(), block_size=block_size, rowwise=True, colwise=True, **opts)
    want = mx_quantize(x, block_size=block_size, rowwise=True, colwise=True, **opts)
    for g, w in zip(got, want):
        assert torch.equal(_bytes(g.data), _bytes(w.data))
        assert torch.equal(g.scale.cpu(), w.scale)


@pytest.mark.parametrize("n", [16, 32])
def test_hadamard_on_tensor_cores(n):
    # Inputs on a 2**-6 grid sum exactly in FP32, so the BF16 tensor-core transform must
    # match the reference bit for bit; random inputs may differ by summation order only.
    exact = (torch.randint(-64, 64, (256, 512)) * 2.0**-6).bfloat16()
    got = mx_quantize(exact.cuda(), colwise=True, hadamard=n)[1]
    want = mx_quantize(exact, colwise=True, hadamard=n)[1]
    assert torch.equal(_bytes(got.data), _bytes(want.data))
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    got = mx_quantize(x.cuda(), colwise=True, hadamard=n)[1]
    want = mx_quantize(x, colwise=True, hadamard=n)[1]
    same = (_bytes(got.data) == _bytes(want.data)).float().mean().item()
    assert same > 0.999
    assert snr_db(got.dequantize(torch.float32).cpu(), want.dequantize(torch.float32)) > 40


# Exact MX (32-wide scales): >= 80 dB against dequantize-then-FP32-matmul. The 128-wide
# path lets the tensor core sum 128 FP8 products before each FP32 promotion; its floor
# is lower (measured ~78 dB at K=1024).
@pytest.mark.parametrize(
    ("block_size", "kernel", "floor_db"),
    [(32, "fixup", 80.0), (32, "upcast", 80.0), (128, "fixup", 70.0)],
)
@pytest.mark.parametrize("shape", [(512, 768, 1024), (300, 200, 4160), (128, 256, 96)])
def test_gemm_vs_dequantized_fp32(block_size, kernel, floor_db, shape):
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda")
    a, b = to_mx(x, block_size=block_size), to_mx(w, block_size=block_size).t()
    out = mx_mm(a, b, out_dtype=torch.float32, bias=bias, alpha=0.5, kernel=kernel)
    want = mx_mm(a, b, out_dtype=torch.float32, bias=bias, alpha=0.5, backend="torch")
    assert snr_db(out, want) >= floor_db


def test_cublas_blockwise_path_matches_reference():
    from hyperrec.mxfp8._cublas import blockwise_available

    if not blockwise_available(torch.device("cuda")):
        pytest.skip("torch has no cuBLAS 1x128 block scaling here")
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
    a, b = to_mx(x, block_size=128), to_mx(w, block_size=128).t()
    want = mx_mm(a, b, out_dtype=torch.float32, backend="torch")
    got = mx_mm(a, b, kernel="cublas")
    assert got.dtype == torch.bfloat16
    assert snr_db(got.float(), want) >= 45.0  # bf16 output rounding bounds this
    assert blockwise_available(torch.device("cuda")), "cuBLAS refused our layouts"


def test_gemm_mixed_formats_and_dot_scaled():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    a = to_mx(x, elem_dtype=torch.float8_e5m2)
    b = to_mx(w).t()
    want = mx_mm(a, b, out_dtype=torch.float32, backend="torch")
    assert snr_db(mx_mm(a, b, out_dtype=torch.float32, kernel="fixup"), want) >= 80.0
    a = to_mx(x)
    want = mx_mm(a, b, out_dtype=torch.float32, backend="torch")
    got = mx_mm(a, b, out_dtype=torch.float32, kernel="dot_scaled")
    assert snr_db(got, want) >= 80.0


@pytest.mark.parametrize("block_size", [32, 128])
def test_mxlinear_on_gpu_matches_cpu_reference_path(block_size):
    torch.manual_seed(0)
    pol = PrecisionPolicy(block_size=block_size, hadamard=16, stochastic_rounding=False)
    lin = MXLinear(512, 256, policy=pol, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(320, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    ref_lin = MXLinear(512, 256, policy=pol, dtype=torch.bfloat16)
    ref_lin.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    xc = x.detach().cpu().requires_grad_()
    yc = ref_lin(xc)
    yc.backward(g.cpu())
    assert snr_db(y.float().cpu(), yc.float()) > 40
    assert snr_db(x.grad.float().cpu(), xc.grad.float()) > 40
    assert snr_db(lin.weight.grad.float().cpu(), ref_lin.weight.grad.float()) > 35
    full = torch.nn.Linear(512, 256, dtype=torch.float32)
    full.load_state_dict({k: v.float().cpu() for k, v in lin.state_dict().items()})
    xf = x.detach().float().cpu().requires_grad_()
    yf = full(xf)
    yf.backward(g.float().cpu())
    assert snr_db(y.float().cpu(), yf) > 25
    assert snr_db(x.grad.float().cpu(), xf.grad) > 23
    assert snr_db(lin.weight.grad.float().cpu(), full.weight.grad) > 22


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_one_pass_dequantize_on_the_gpu(elem, out):
    """The Triton dequantizer (FP8, and MX4 since 0.4.3) on the GPU equals the reference
    on the CPU bit for bit (products stay in float32's normal range here)."""
    x = _heavy_tailed(96, 640, torch.float32).clamp(-1e30, 1e30)
    q = to_mx(x.cuda(), elem_dtype=elem, block_size=32)
    got = q.dequantize(out, backend="triton").cpu()
    cpu = type(q)(**{**q.__dict__, "data": q.data.cpu(), "scale": q.scale.cpu(),
                     "scale_fp32": None})  # fmt: skip
    want = cpu.dequantize(out, backend="torch")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(got)
    assert torch.equal(got[fin], want[fin])


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_one_pass_dequantize_every_fp8_code_on_the_gpu(elem):
    """Every FP8 byte (NaN and Inf codes included) under a finite scale decodes as the
    reference decodes it on the CPU."""
    from hyperrec.mxfp8 import MXTensor

    fmt = get_format(elem)
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    scale = torch.full((2, 4), 120, dtype=torch.uint8)
    data = codes.view(fmt.storage_dtype)
    q = MXTensor(data=data.cuda(), scale=scale.cuda(), fmt=fmt, block_size=32, axis=1,
                 shape=torch.Size((2, 128)), orig_dtype=torch.float32)  # fmt: skip
    got = q.dequantize(torch.float32, backend="triton").cpu()
    want = ref.dequantize(data, scale, fmt, 32, axis=-1, length=128)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(got)
    assert torch.equal(got[fin], want[fin])
