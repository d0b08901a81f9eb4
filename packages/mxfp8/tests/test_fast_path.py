"""The fast (128-block, cuBLAS) path on the CPU: per-call op counts (a regression guard
for host overhead), FP32 scales written by the quantizer, the division-free scale rule,
the custom-op bypass, the cuBLAS wrapper's bias handling, and the sweep script's CLI.

cuBLAS is emulated: ``F.scaled_mm`` is replaced by a dequantize-then-matmul that checks
the operand layouts cuBLAS's 1x128 block scaling takes.
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mx_helpers import needs_interpreter, u8
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from hyperrec.mxfp8 import (
    E2M1,
    E4M3,
    E5M2,
    MXLinear,
    PrecisionPolicy,
    _cublas,
    mx_mm,
    mx_quantize,
    to_mx,
)
from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8._triton import quantize as qk
from hyperrec.mxfp8._triton._configs import quantize_candidates
from hyperrec.mxfp8._triton.common import scale_constants
from hyperrec.testing import snr_db

#: Ops that allocate or make views: no device kernel.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::t",
    "aten::transpose",
    "aten::as_strided",
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::detach",
    "aten::alias",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::expand",
    "aten::permute",
}

# Per-call budgets measured after the overhead work. Before it (same harness): quantize 8
# aten ops plus a custom-op dispatch; a cuBLAS GEMM 18 aten ops, 14 of them kernels that
# converted the scales; MXLinear forward + backward 92 aten ops, 48 of them kernels, and 6
# custom-op dispatches. Raise a budget only with a reason.
BUDGET_QUANTIZE = {"aten ops": 6, "kernels": 1}
BUDGET_GEMM = {"aten ops": 1, "kernels": 1}
BUDGET_LINEAR = {"aten ops": 31, "kernels": 7}


def _fake_scaled_mm(a, b, sa, ra, sb, rb, *args, output_dtype=torch.bfloat16, bias=None, **kw):
    """``F.scaled_mm`` with 1x128 block scaling, emulated: deq(a) @ deq(b) in FP32."""
    with record_function("kernel:scaled_mm"):
        m, k = a.shape
        n = b.shape[1]
        assert ra == rb == F.ScalingType.BlockWise1x128
        assert a.stride(1) == 1 and b.stride(0) == 1, "cuBLAS wants A row-, B column-major"
        assert sa.dtype == sb.dtype == torch.float32
        assert sa.shape == (m, k // 128) and sa.stride(0) == 1
        assert sb.shape == (n, k // 128) and sb.stride(0) == 1
        da = a.float() * sa.repeat_interleave(128, 1)
        db = b.float() * sb.t().repeat_interleave(128, 0)
        out = da @ db
        if bias is not None:
            out = out + bias.float()
        return out.to(output_dtype)


class _Kernel:
    """Wraps a Triton kernel so each launch is one profiler range (its interpreter work
    is not counted as ops)."""

    def __init__(self, fn, name: str) -> None:
        self.fn, self.name = fn, name

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            with record_function(f"kernel:{self.name}"):
                return launch(*args, **kwargs)

        return run


@pytest.fixture
def emulated_cublas(monkeypatch):
    """The fast path as on Hopper: FP32 scales from the quantizer, cuBLAS GEMMs."""
    monkeypatch.setattr(_cublas, "blockwise_available", lambda device: True)
    monkeypatch.setattr(F, "scaled_mm", _fake_scaled_mm, raising=False)
    monkeypatch.setitem(_cublas._STATE, "layout", 0)
    monkeypatch.setitem(_cublas._STATE, "bias", None)
    monkeypatch.setattr(qk, "_mx_quantize_2d_kernel", _Kernel(qk._mx_quantize_2d_kernel, "q"))


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith(("autograd::", "torch::autograd", "kernel:"))


def count_ops(fn) -> dict:
    """Ops of one ``fn()`` call: aten ops called from Python (not those nested in another
    aten op, nor the interpreter's work inside a kernel range), how many of them launch
    device work (plus the kernel ranges), and custom-op dispatches."""
    fn()  # warm (compile caches, first-call state)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    aten, kernels, custom = collections.Counter(), 0, 0
    for e in prof.events():
        hidden = under_aten = False
        p = e.cpu_parent
        while p is not None:
            hidden |= p.name.startswith("kernel:")
            under_aten |= p.name.startswith("aten::")
            p = p.cpu_parent
        if hidden:
            continue
        if e.name.startswith("kernel:"):
            kernels += 1
        elif e.name.startswith("hyperrec_mxfp8::"):
            custom += 1
        elif _is_op(e.name) and not under_aten:
            aten[e.name] += 1
            kernels += e.name not in _NO_KERNEL
    return {"aten ops": sum(aten.values()), "kernels": kernels, "custom ops": custom, "by op": aten}


def _within(got: dict, budget: dict) -> bool:
    return all(got[k] <= v for k, v in budget.items()) and got["custom ops"] == 0


@needs_interpreter
def test_fast_path_op_counts_stay_within_budget(emulated_cublas):
    torch.manual_seed(0)
    pol = PrecisionPolicy(block_size=128, backend="triton")
    lin = MXLinear(256, 256, policy=pol, dtype=torch.bfloat16)
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 256, dtype=torch.bfloat16)
    xd = x.detach()
    xr, _ = mx_quantize(xd, block_size=128, backend="triton")
    b = mx_quantize(lin.weight.detach(), block_size=128, backend="triton")[0].t()
    assert xr.scale_fp32 is not None and b.scale_fp32 is not None

    def step():
        for p in (x, lin.weight, lin.bias):
            p.grad = None
        lin(x).backward(g)

    got = {
        "quantize": count_ops(
            lambda: mx_quantize(xd, block_size=128, colwise=True, backend="triton")
        ),
        "gemm": count_ops(lambda: mx_mm(xr, b, backend="triton")),
        "linear": count_ops(step),
    }
    assert _within(got["quantize"], BUDGET_QUANTIZE), got["quantize"]
    assert _within(got["gemm"], BUDGET_GEMM), got["gemm"]
    assert _within(got["linear"], BUDGET_LINEAR), got["linear"]
    # The extra ops the wrapper used to issue must not come back.
    assert not {"aten::eq", "aten::where", "aten::__lshift__", "aten::to"} & set(
        got["linear"]["by op"]
    ), got["linear"]["by op"]


@needs_interpreter
def test_fast_path_matches_the_reference_path(emulated_cublas):
    # Same layer through the emulated cuBLAS path (FP32 scales from the quantizer) and
    # through the reference backend: only the GEMM's summation order differs.
    torch.manual_seed(0)
    lins = [
        MXLinear(256, 128, policy=PrecisionPolicy(block_size=128, backend=b), dtype=torch.bfloat16)
        for b in ("triton", "torch")
    ]
    lins[1].load_state_dict(lins[0].state_dict())
    x, g = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    outs = []
    for lin in lins:
        xx = x.clone().requires_grad_()
        y = lin(xx)
        y.backward(g)
        outs.append((y.float(), xx.grad.float(), lin.weight.grad.float(), lin.bias.grad.float()))
    for a, b in zip(*outs):
        assert snr_db(a, b) > 40  # bf16 outputs of the same products


@needs_interpreter
def test_quantizer_writes_fp32_scales_for_cublas(emulated_cublas):
    x = torch.randn(256, 384, dtype=torch.bfloat16) * 4
    x[3, 5] = float("nan")
    x[200, 300] = float("inf")
    x[128:256, 0:128] = 0
    row, col = mx_quantize(x, block_size=128, colwise=True, backend="triton")
    for q in (row, col):
        sf = q.scale_fp32
        assert sf.dtype == torch.float32 and sf.shape == q.scale.shape
        assert sf.stride() == q.scale.stride()
        want = ref.e8m0_to_fp32(q.scale)
        assert torch.equal(sf.isnan(), want.isnan())
        assert torch.equal(sf.nan_to_num(), want.nan_to_num())
        assert (q.scale == 255).any() and (q.scale == 0).any()
    t = row.t()
    assert t.scale_fp32.data_ptr() == row.scale_fp32.data_ptr()
    assert t.scale_fp32.shape == t.scale.shape and t.scale_fp32.stride() == t.scale.stride()
    # not written off the fast path (32-blocks, E5M2, the reference backend)
    assert mx_quantize(x, backend="triton")[0].scale_fp32 is None
    assert mx_quantize(x, block_size=128, elem_dtype="e5m2", backend="triton")[0].scale_fp32 is None
    assert mx_quantize(x, block_size=128, backend="torch")[0].scale_fp32 is None


def _scale_rule_edges(fmt) -> torch.Tensor:
    """FP32 bit patterns around every boundary of the division-free RCEIL/FLOOR rules."""
    add, odd = scale_constants(fmt.max_value, fmt.emax)
    t = 2**23 - 1 - add - (fmt.emax << 23)
    pats = {0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 0x7F7FFFFF, odd - 1, odd, odd + 1}
    for e in [*range(1, 12), *range(fmt.emax - 2, fmt.emax + 5), 100, 127, 200, 254]:
        for mant in (0, 1, t - 1, t, t + 1, 0x7FFFFF):
            if 1 <= e <= 254 and 0 <= mant <= 0x7FFFFF:
                pats.add((e << 23) | mant)
    return torch.tensor(sorted(pats), dtype=torch.int32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_division_free_scale_rule_matches_the_division(fmt):
    # A torch mirror of the kernel's integer rule against reference.e8m0_scale, on the
    # boundary patterns and a stride through all positive finite floats.
    add, odd = scale_constants(fmt.max_value, fmt.emax)
    sweep = torch.arange(0, 0x7F800000, 9973, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([_scale_rule_edges(fmt), sweep])
    amax = bits.view(torch.float32)
    rceil = ((bits + add) >> 23).clamp_min(0) - (bits == odd).int()
    floor = ((bits - (fmt.emax << 23)) >> 23).clamp_min(0)
    assert torch.equal(rceil.to(torch.uint8), ref.e8m0_scale(amax[:, None], fmt, "rceil"))
    assert torch.equal(floor.to(torch.uint8), ref.e8m0_scale(amax[:, None], fmt, "floor"))


@needs_interpreter
@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_kernel_scale_rule_on_boundary_amaxes(elem, mode):
    fmt = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}[elem]
    amax = _scale_rule_edges(fmt).view(torch.float32)
    x = torch.zeros(len(amax), 32)
    x[:, 0] = amax
    x[:, 1] = -amax / 3  # a second element that rounds somewhere in the middle
    got = to_mx(x, elem_dtype=elem, scale_mode=mode, backend="triton")
    want = to_mx(x, elem_dtype=elem, scale_mode=mode, backend="torch")
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(u8(got.data), u8(want.data))


def test_eager_calls_skip_the_custom_op_and_traces_still_see_it():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(64, 64)
    with Record():
        mx_quantize(x, colwise=True)
    assert any("hyperrec_mxfp8.quantize_2d" in s for s in seen), seen
    got = count_ops(lambda: mx_quantize(x, colwise=True))
    assert got["custom ops"] == 0


def test_cublas_wrapper_adds_the_bias_itself_when_cublas_refuses_it(monkeypatch):
    calls = []

    def no_bias(a, b, sa, ra, sb, rb, *args, bias=None, **kw):
        calls.append(bias is not None)
        if bias is not None:
            raise RuntimeError("bias is not supported with block-wise scaling")
        return _fake_scaled_mm(a, b, sa, ra, sb, rb, *args, **kw)

    monkeypatch.setattr(F, "scaled_mm", no_bias, raising=False)
    monkeypatch.setitem(_cublas._STATE, "layout", 0)
    monkeypatch.setitem(_cublas._STATE, "bias", None)
    a = to_mx(torch.randn(32, 256), block_size=128)
    b = to_mx(torch.randn(48, 256), block_size=128).t()
    bias = torch.randn(48)
    args = (a.data, a.scale, b.data, b.scale, bias, 1.0, torch.bfloat16)
    out = _cublas.blockwise_mm(*args)
    assert calls == [True, False] and _cublas._STATE["bias"] == 0
    want = mx_mm(a, b, out_dtype=torch.float32, bias=bias, backend="torch")
    assert snr_db(out.float(), want) > 40
    _cublas.blockwise_mm(*args)
    assert calls == [True, False, False]  # no second try


def _sweep_module():
    path = Path(__file__).resolve().parents[1] / "bench" / "sweep_quantize.py"
    spec = importlib.util.spec_from_file_location("sweep_quantize", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_script_parses_its_arguments(tmp_path):
    sweep = _sweep_module()
    args = sweep.parse_args(["--out", str(tmp_path / "s.json"), "--quick", "--skip", "host"])
    assert args.quick and args.skip == ["host"] and args.budget_s > 0
    assert sweep.parse_args([]).variants is None
    with pytest.raises(SystemExit):
        sweep.parse_args(["--variants", "nope"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            sweep.main(["--out", str(tmp_path / "s.json")])
    # the sweep records the table's tile for every variant
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    for kw in sweep.VARIANTS.values():
        got = sweep._table_config(x, dict(kw))
        assert len(got["config"]) == 3 and got["source"]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("hadamard", [0, 16, 32])
@pytest.mark.parametrize(("rowwise", "colwise"), [(True, True), (True, False), (False, True)])
def test_launch_candidates_hold_whole_blocks(block_size, hadamard, rowwise, colwise):
    if hadamard > block_size or (hadamard and not colwise):
        return
    configs = quantize_candidates(block_size, hadamard, rowwise=rowwise, colwise=colwise)
    assert configs and len(set(configs)) == len(configs)
    for bm, bk, warps in configs:
        assert bm <= 128 or not hadamard  # the stored Hadamard matrix is 128 x 128
        assert (not colwise or bm % max(block_size, hadamard) == 0) and bm >= 16
        assert (not rowwise or bk % block_size == 0) and bk >= 32
        assert warps in (1, 2, 4, 8, 16)
