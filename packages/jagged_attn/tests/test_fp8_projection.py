"""The projection with Q/K/V quantization in its epilogue (``linear_quantize_qkv``) and the
attention's ``quantized=`` argument.

The contract under test: the quantized operands equal ``quantize_qkv`` of the projection's
own output ``y`` bit for bit (kernel and PyTorch path alike); ``y`` equals
``act(x W^T + b)`` up to accumulation order; gradients are those of that expression; an
attention given the operands computes what it computes when it quantizes ``q``/``k``/``v``
itself, bit for bit. The kernel runs under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_check import DEVICE, kernels_available, offsets_tensor
from test_fp8_quantize import _assert_same

from hyperrec.jagged_attn import (
    FP8Config,
    block_attention,
    gdpa,
    jagged_attention,
    linear_quantize_qkv,
    quantize_qkv,
    reference_fp8,
)
from hyperrec.jagged_attn.fp8 import QuantizedQKV
from hyperrec.jagged_attn.reference_fp8 import projection_chunks

pytest.importorskip("hyperrec.mxfp8")
# SiLU's sigmoid overflows exp() for very negative inputs in the interpreter (to the right
# limit, 0): numpy warns.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or the interpreter")

LENS = (37, 0, 1, 70, 5)
CONFIGS = [
    FP8Config(),  # 128-token blocks, Hadamard on
    FP8Config(block_q=16, block_kv=64, p_block=32, scale="fp32", hadamard=False),
    FP8Config(block_q=1, block_kv=32, p_block=32, hadamard=True, hadamard_seed=5),
    FP8Config(format="mxfp8"),
]


def _case(lens, heads=2, dim=32, k_dim=48, chunks="qkv", dtype=torch.bfloat16, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    total, n = sum(lens), len(chunks) * heads * dim
    x = torch.randn(total, k_dim, generator=g)
    # rows of very different magnitude, so block scales differ within a sequence
    x = x * torch.exp2(torch.randint(-5, 6, (total, 1), generator=g).float())
    w = torch.randn(n, k_dim, generator=g) / k_dim**0.5
    b = torch.randn(n, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(x), cast(w), cast(b), offsets_tensor(lens, DEVICE)


def _quantize_y(y, offsets, heads, chunks, config, v_mma_order=False):
    """What quantize_qkv gives for the chunks of ``y`` (the contract)."""
    p = projection_chunks(y.detach(), heads, chunks)
    if v_mma_order:
        from hyperrec.jagged_attn._triton._fp8_launch import quantize_qkv as kernel

        return kernel(p["q"], p["k"], p["v"], offsets, offsets, config, v_mma_order=True)
    return reference_fp8.quantize_qkv(p["q"], p["k"], p["v"], offsets, offsets, config)


def _assert_same_mma(got, want, offsets, total):
    """As ``_assert_same`` for V in ``mma_order`` (tokens at ``mma_column`` positions)."""
    from hyperrec.jagged_attn.fp8 import mma_column

    _assert_same(got, want, offsets, 0)  # Q, K, V's offsets (no V column compared)
    seq, pos = reference_fp8._positions(offsets.cpu(), total)
    col = want.v.pad_offsets.long().cpu()[seq] + mma_column(pos)
    a, b = (t.data.cpu().view(torch.uint8)[:, :, col] for t in (got.v, want.v))
    assert torch.equal(a, b), "v data"
    assert torch.equal(got.v.scale.cpu(), want.v.scale.cpu()), "v scale"


def _ulps_bf16(a, b):
    """Largest distance between two bf16 tensors in units in the last place of ``b``."""
    a, b = a.float(), b.float()
    if b.numel() == 0:
        return 0.0
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2.0**-126))) - 7)
    return ((a - b).abs() / ulp).max().item()


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.encode().replace(";", ","))
@pytest.mark.parametrize(("chunks", "activation"), [("qkv", "none"), ("uvqk", "silu")])
def test_kernel_quantizes_its_own_output_bit_exact(config, chunks, activation):
    x, w, b, off = _case(LENS, chunks=chunks)
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, chunks=chunks, activation=activation,
                                 precision=config, backend="triton")  # fmt: skip
    _assert_same(qkv, _quantize_y(y, off, 2, chunks, config), off, x.shape[0])
    y_ref, _ = reference_fp8.linear_quantize_qkv(x, w, b, off, config, heads=2, chunks=chunks,
                                                 activation=activation)  # fmt: skip
    # the kernel's GEMM sums in another order: at most one rounding step apart
    assert _ulps_bf16(y, y_ref) <= 1.0
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_other_dtypes(dtype):
    x, w, b, off = _case(LENS, dtype=dtype, chunks="kvq")
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, chunks="kvq", precision="fp8",
                                 backend="triton")  # fmt: skip
    _assert_same(qkv, _quantize_y(y, off, 2, "kvq", FP8Config()), off, x.shape[0])
    want = (x.double() @ w.double().T + b.double()).to(dtype)
    torch.testing.assert_close(y, want, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-4)


@needs_kernels
def test_v_mma_order_matches_the_quantizer():
    x, w, b, off = _case(LENS)
    config = FP8Config(hadamard=False)
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision=config, backend="triton",
                                 v_mma_order=True)  # fmt: skip
    assert qkv.v.mma_order
    _assert_same_mma(qkv, _quantize_y(y, off, 2, "qkv", config, v_mma_order=True), off,
                     x.shape[0])  # fmt: skip
    y_t, qkv_t = linear_quantize_qkv(x, w, b, off, heads=2, precision=config, backend="torch",
                                     v_mma_order=True)  # fmt: skip
    assert qkv_t.v.mma_order
    _assert_same_mma(qkv_t, _quantize_y(y_t, off, 2, "qkv", config, v_mma_order=True), off,
                     x.shape[0])  # fmt: skip


@pytest.mark.parametrize("config", [FP8Config(), FP8Config(format="mxfp8")], ids=["fp8", "mx"])
def test_torch_backend_keeps_the_contract(config):
    x, w, b, off = (t.cpu() if t is not None else None for t in _case(LENS))
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, chunks="qkv", precision=config,
                                 backend="torch")  # fmt: skip
    assert torch.equal(y, F.linear(x, w, b))
    _assert_same(qkv, _quantize_y(y, off, 2, "qkv", config), off, x.shape[0])


@needs_kernels
def test_non_finite_rows_stay_in_their_sequence():
    x, w, b, off = _case(LENS)
    x[40, 3] = float("nan")  # sequence 3 (rows 38..107)
    x[0, 0] = float("inf")  # sequence 0
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision="fp8", backend="triton")
    _assert_same(qkv, _quantize_y(y, off, 2, "qkv", FP8Config()), off, x.shape[0])
    q_scale = qkv.q.scale.cpu()
    assert q_scale[0].isnan().all() and q_scale[38:].isnan().any()
    # sequence 4 (5 rows at the end) and the 1-row sequence 2 are untouched
    assert q_scale[-5:].isfinite().all() and q_scale[37].isfinite().all()


@needs_kernels
def test_strided_inputs_are_read_as_their_values():
    """Strided views of x, weight, bias and offsets give what their contiguous copies give
    (the kernel indexes bias, offsets and weight as dense arrays)."""
    x, w, b, off = _case(LENS)
    xs = torch.stack([x, x], -1)[..., 0]  # row stride 2 * K, last dim strided
    ws = torch.stack([w, w], 0)[0].t().contiguous().t()  # column-major
    bs = torch.stack([b, b], -1)[:, 1]
    offs = torch.stack([off, off], -1)[:, 0]
    assert not (xs.is_contiguous() or ws.is_contiguous() or bs.is_contiguous()
                or offs.is_contiguous())  # fmt: skip
    got = linear_quantize_qkv(xs, ws, bs, offs, heads=2, backend="triton")
    want = linear_quantize_qkv(x, w, b, off, heads=2, backend="triton")
    assert torch.equal(got[0], want[0])
    _assert_same(got[1], want[1], off, x.shape[0])


@needs_kernels
@pytest.mark.parametrize("lens", [(), (0, 0), (3,)], ids=["no-seq", "empty-seqs", "one"])
def test_empty_and_tiny(lens):
    x, w, b, off = _case(lens, bias=False)
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision="fp8", backend="triton")
    assert y.shape == (sum(lens), w.shape[0])
    _assert_same(qkv, _quantize_y(y, off, 2, "qkv", FP8Config()), off, x.shape[0])


@needs_kernels
def test_zero_input_features_give_the_bias():
    _, _, b, off = _case(LENS)
    x = torch.zeros(sum(LENS), 0, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(b.shape[0], 0, dtype=torch.bfloat16, device=DEVICE)
    y, _ = linear_quantize_qkv(x, w, b, off, heads=2, activation="silu", backend="triton")
    assert torch.equal(y, F.silu(b.float()).to(b.dtype).expand(sum(LENS), -1))


@needs_kernels
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_gradients_against_float64(activation):
    x, w, b, off = _case(LENS, chunks="uvqk")
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape[0], w.shape[0], generator=g).to(x.dtype).to(DEVICE)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        y = fn(*leaves)
        return torch.autograd.grad(y, leaves, dy.to(dtype))

    def fused(xx, ww, bb):
        return linear_quantize_qkv(xx, ww, bb, off, heads=2, chunks="uvqk",
                                   activation=activation, backend="triton")[0]  # fmt: skip

    def plain(xx, ww, bb):
        z = F.linear(xx, ww, bb)
        return F.silu(z) if activation == "silu" else z

    got, base, exact = grads(fused, x.dtype), grads(plain, x.dtype), grads(plain, torch.float64)
    for name, a, p, e in zip("xwb", got, base, exact, strict=True):
        err = (a.double() - e).norm() / e.norm()
        err_base = (p.double() - e).norm() / e.norm()
        assert err <= 2 * err_base + 1e-3, (name, err.item(), err_base.item())


@needs_kernels
@pytest.mark.parametrize("config", [FP8Config(), FP8Config(format="mxfp8")], ids=["fp8", "mx"])
def test_attention_reads_the_operands_bit_exact(config):
    x, w, b, off = _case(LENS, chunks="uvqk")
    x.requires_grad_()
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, chunks="uvqk", activation="silu",
                                 precision=config, backend="triton")  # fmt: skip
    p = projection_chunks(y, 2, "uvqk")
    args = (p["q"], p["k"], p["v"], off, off, 70, 70)
    kw = dict(activation="silu", causal=True, precision=config, backend="triton")
    given_ = gdpa(*args, quantized=qkv, **kw)
    own = gdpa(*args, **kw)
    assert torch.equal(given_, own)
    dout = torch.randn_like(own)
    g1 = torch.autograd.grad(given_, x, dout, retain_graph=True)[0]
    g2 = torch.autograd.grad(own, x, dout)[0]
    assert torch.equal(g1, g2)
    # the emulation re-quantizes q/k/v: the same operands, so it agrees with the kernel to
    # accumulation order
    emulated = gdpa(*args, quantized=qkv, **{**kw, "backend": "torch"})
    torch.testing.assert_close(emulated, own, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_softmax_attention_with_smoothing_off():
    config = FP8Config(smooth_k=False)
    x, w, b, off = _case(LENS)
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision=config, backend="triton")
    p = projection_chunks(y, 2, "qkv")
    for fn in (
        lambda **kw: jagged_attention(p["q"], p["k"], p["v"], off, 70, causal=True, **kw),
        lambda **kw: block_attention(p["q"], p["k"], p["v"], off, 70, block_size=32, **kw),
    ):
        got = fn(precision=config, backend="triton", quantized=qkv)
        assert torch.equal(got, fn(precision=config, backend="triton"))


def _bad(**kw):
    x, w, b, off = (t.cpu() if t is not None else None for t in _case((3, 4)))
    args = dict(x=x, weight=w, bias=b, offsets=off, heads=2)
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(chunks="qk"), ValueError, "chunks"),
        (dict(chunks="qkvq"), ValueError, "chunks"),
        (dict(chunks=3), TypeError, "chunks"),
        (dict(heads=5), ValueError, "len\\(chunks\\) \\* heads"),
        (dict(heads=0), ValueError, "heads"),
        (dict(activation="gelu"), ValueError, "activation"),
        (dict(precision="bf16"), ValueError, "precision"),
        (dict(precision=FP8Config(format="mxfp8"), v_mma_order=True), ValueError, "v_mma_order"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(bias=torch.zeros(5, dtype=torch.bfloat16)), ValueError, "bias"),
        (dict(bias=torch.zeros(192)), TypeError, "bias"),
        (dict(weight=torch.zeros(192, 47, dtype=torch.bfloat16)), ValueError, "weight"),
        (dict(weight=torch.zeros(192, 48)), TypeError, "weight"),
        (dict(x=torch.zeros(7, 48, dtype=torch.float64)), TypeError, "x"),
        (dict(x=torch.zeros(7, 2, 24, dtype=torch.bfloat16)), ValueError, "2-D"),
        (dict(offsets=torch.tensor([0.0, 7.0])), TypeError, "offsets"),
        (dict(x="x"), TypeError, "x"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        linear_quantize_qkv(**_bad(**change))


def test_bad_quantized_argument():
    x, w, b, off = (t.cpu() for t in _case((3, 4)))
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision="fp8", backend="torch")
    p = projection_chunks(y, 2, "qkv")
    args = (p["q"], p["k"], p["v"], off, off, 4, 4)
    with pytest.raises(TypeError, match="QuantizedQKV"):
        gdpa(*args, precision="fp8", quantized=(qkv.q, qkv.k, qkv.v))
    with pytest.raises(ValueError, match="precision"):
        gdpa(*args, quantized=qkv)  # bf16
    with pytest.raises(ValueError, match="made with precision"):
        gdpa(*args, precision=FP8Config(hadamard=False), quantized=qkv)
    with pytest.raises(ValueError, match="smooth_k"):
        jagged_attention(p["q"], p["k"], p["v"], off, 4, precision="fp8", quantized=qkv)
    other = quantize_qkv(p["q"][:5], p["k"][:5], p["v"][:5], torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="quantized.q.data must have shape"):
        gdpa(*args, precision="fp8", quantized=other)
    assert isinstance(qkv, QuantizedQKV)


@needs_kernels
@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(0, 80), min_size=1, max_size=4),
    heads=st.integers(1, 3),
    dim=st.sampled_from([16, 32, 64]),
    k_dim=st.integers(1, 70),
    config=st.sampled_from(CONFIGS),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_sweep(lens, heads, dim, k_dim, config, seed):
    assume(not (config.mx and dim % 32))  # MX blocks of 32 along the head dim
    x, w, b, off = _case(tuple(lens), heads=heads, dim=dim, k_dim=k_dim, chunks="vqk", seed=seed)
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=heads, chunks="vqk", precision=config,
                                 backend="triton")  # fmt: skip
    _assert_same(qkv, _quantize_y(y, off, heads, "vqk", config), off, x.shape[0])
    y_ref, _ = reference_fp8.linear_quantize_qkv(x, w, b, off, config, heads=heads, chunks="vqk",
                                                 activation="none")  # fmt: skip
    assert _ulps_bf16(y, y_ref) <= 1.0


def test_benchmark_script_smoke(tmp_path, monkeypatch):
    """``bench/bench_fp8_projection.py --smoke`` runs end to end (so it does not rot
    between GPU sessions) and records every implementation."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_projection

    out = tmp_path / "smoke.json"
    assert bench_fp8_projection.main(["--out", str(out), "--smoke"]) == 0
    result = json.loads(out.read_text())
    impls = {row["impl"] for row in result["summary"]}
    assert impls == {"proj_bf16", "proj_then_quant", "proj_fused", "proj_fused_16_warps",
                     "layer_bf16", "layer_fp8_unfused", "layer_fp8_fused"}  # fmt: skip
    assert all(row["ms_median"] > 0 for row in result["summary"])


def test_benchmark_sweep_smoke_restores_the_launch_settings(tmp_path, monkeypatch):
    """``--sweep`` times the fused kernel per (warps, stages, BK) and puts the module's
    launch settings back afterwards."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_projection

    from hyperrec.jagged_attn._triton import _fp8_proj

    before = (_fp8_proj.PROJ_NUM_WARPS, _fp8_proj.PROJ_NUM_STAGES, _fp8_proj.PROJ_BLOCK_K)
    monkeypatch.setattr(bench_fp8_projection, "SWEEP", [(4, 2, 32), (8, 3, 64)])
    out = tmp_path / "sweep.json"
    assert bench_fp8_projection.main(["--out", str(out), "--smoke", "--sweep"]) == 0
    result = json.loads(out.read_text())
    got = [(r["num_warps"], r["num_stages"], r["block_k"]) for r in result["sweep"]]
    assert got == [(4, 2, 32), (8, 3, 64)]
    assert all(r["error"] is None and r["ms"] > 0 for r in result["sweep"])
    assert before == (_fp8_proj.PROJ_NUM_WARPS, _fp8_proj.PROJ_NUM_STAGES, _fp8_proj.PROJ_BLOCK_K)


@needs_kernels
def test_quantized_op_passes_opcheck():
    """The ``quantized=`` custom op: fake tensor and autograd registration (opcheck's
    ``test_schema`` multiplies inputs, which float8 tensors do not support on the CPU)."""
    from hyperrec.jagged_attn._fp8.ops import attention_fp8_triton_fwd_quantized
    from hyperrec.jagged_attn._opschema import AttentionCall, make_spec

    x, w, b, off = _case((5, 0, 9))
    y, qkv = linear_quantize_qkv(x, w, b, off, heads=2, precision="fp8", backend="triton")
    p = {k: t.detach().clone().requires_grad_() for k, t in projection_chunks(y, 2, "qkv").items()}
    spec = make_spec(activation="silu", scale=0.2, max_seqlen_q=9, max_seqlen_kv=9)
    call = AttentionCall(q=p["q"], k=p["k"], v=p["v"], q_offsets=off, kv_offsets=off,
                         kv_index=None, num_targets=None, spec=spec)  # fmt: skip
    quantized = (qkv.q.data, qkv.q.scale, qkv.k.data, qkv.k.scale, qkv.v.data, qkv.v.scale,
                 qkv.v.pad_offsets, qkv.v.mma_order)  # fmt: skip
    torch.library.opcheck(attention_fp8_triton_fwd_quantized,
                          (FP8Config().encode(), *quantized, *call.op_args()),
                          test_utils=("test_faketensor", "test_autograd_registration"))  # fmt: skip


@needs_kernels
def test_checkpointed_layer_recomputes_the_same():
    """Projection + attention under ``torch.utils.checkpoint`` (what activation
    checkpointing of a layer does): the recomputed forward gives the same gradients."""
    from torch.utils.checkpoint import checkpoint

    x, w, b, off = _case(LENS, chunks="uvqk")

    def layer(xx, ww, bb):
        y, qkv = linear_quantize_qkv(xx, ww, bb, off, heads=2, chunks="uvqk", activation="silu",
                                     backend="triton")  # fmt: skip
        p = projection_chunks(y, 2, "uvqk")
        a = gdpa(p["q"], p["k"], p["v"], off, off, 70, 70, causal=True, precision="fp8",
                 quantized=qkv, backend="triton")  # fmt: skip
        return a * p["u"]

    grads = []
    for wrap in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = checkpoint(layer, *leaves, use_reentrant=False) if wrap else layer(*leaves)
        g = torch.Generator().manual_seed(2)
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
        grads.append([t.grad for t in leaves])
    for a, c in zip(*grads, strict=True):
        assert torch.equal(a, c)
