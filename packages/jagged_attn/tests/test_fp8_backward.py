"""The FP8 backward (``FP8Config(backward="fp8")``) against its specification.

``reference_fp8.attention_backward`` is the specification. Its steps are first checked
without quantization against float64 autograd of the exact attention (masks, maps,
coefficients, the rotation back); then the kernels against it: the per-token operands bit
for bit, the gradients within a tenth of the specification's own FP8 error (the kernels
form P and dS in float32, the specification in float64, so a value can cross an E4M3
rounding boundary now and then; a wrong scale, group or mask is off by the whole error).
The kernels run under ``TRITON_INTERPRET=1`` on the CPU (allocations poisoned with NaN).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from kernel_check import (
    DEVICE,
    Case,
    build,
    call_of,
    kernels_available,
    offsets_tensor,
    poison_allocations,
)

import hyperrec.jagged_attn as ja
from hyperrec.jagged_attn import FP8Config, reference, reference_fp8
from hyperrec.jagged_attn.spec import AttentionSpec

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or the interpreter")
pytestmark = pytest.mark.usefixtures(poison_allocations.__name__)

BWD = FP8Config(hadamard=False, backward="fp8")
BWD_H = FP8Config(backward="fp8")  # Hadamard: the default (D = 32)
LENS = (17, 0, 1, 70, 5, 33)

CASES = {
    "softmax": (Case(LENS), BWD),
    "softmax_hadamard_causal": (Case((17, 0, 70, 33), mask=dict(causal=True)), BWD_H),
    "cross_map": (Case((9, 80), kv_lens=(70, 7), kv_index=(1, 0)), BWD_H),
    # causal with more keys than queries: every key tile's first query tile is unaligned
    "causal_cross": (Case((50, 130), kv_lens=(110, 150), mask=dict(causal=True)), BWD),
    "targets": (Case((30, 100), targets=(3, 5), mask=dict(causal=True)), BWD),
    "window": (Case((90, 40), mask=dict(window_left=20, window_right=5)), BWD_H),
    "silu_norm": (Case((30, 75, 0), spec=dict(activation="silu", normalization="length")), BWD),
    "block_mask": (Case((70, 12), mask=dict(block_size=16, causal=True)), BWD_H),
    "gelu_dv64": (Case((40, 3), head_dim_v=64, spec=dict(activation="gelu")), BWD_H),
}


def _exact_grads(q, k, v, do, qo, ko, kvi, nt, spec):
    leaves = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    out = reference.attention_forward(*leaves, qo.cpu(), ko.cpu(), spec,
                                      kv_index=None if kvi is None else kvi.cpu(),
                                      num_targets=None if nt is None else nt.cpu())  # fmt: skip
    return torch.autograd.grad(out, leaves, do.double().cpu()), out


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_specification_steps_without_quantization_are_the_exact_gradient(name):
    """With nothing quantized, the specification's steps (rotated operands, groups, masks,
    coefficients, the rotation back) give float64 autograd's gradients."""
    case, config = CASES[name]
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 1, "cpu")
    exact, out = _exact_grads(q, k, v, do, qo, ko, kvi, nt, spec)
    got = reference_fp8.attention_backward(q.float(), k.float(), v.float(), do.float(), qo, ko,
                                           spec, config, kv_index=kvi, num_targets=nt,
                                           quantize=False)  # fmt: skip
    for g, e in zip(got, exact):
        assert _rms(g.double() - e) <= 1e-5 * max(_rms(e), 1e-30)


def _kernel_grads(case, config, seed=0, scale_do=1.0, transposed_b=None):
    from hyperrec.jagged_attn._triton._fp8_launch import attention_backward_fp8

    q, k, v, do, qo, ko, kvi, nt, spec = build(case, seed)
    do = do * scale_do
    got = attention_backward_fp8(do, call_of(q, k, v, qo, ko, kvi, nt, spec), config,
                                 transposed_b=transposed_b)  # fmt: skip
    return got, (q, k, v, do, qo, ko, kvi, nt, spec)


def _spec_grads(q, k, v, do, qo, ko, kvi, nt, spec, config):
    return reference_fp8.attention_backward(q, k, v, do, qo, ko, spec, config, kv_index=kvi,
                                            num_targets=nt)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_match_the_specification(name):
    from hyperrec.jagged_attn._triton._fp8_launch import quantize_grad_operands

    case, config = CASES[name]
    got, inputs = _kernel_grads(case, config)
    q, k, v, do, qo, ko, kvi, nt, spec = inputs
    for t, want in zip(
        quantize_grad_operands(q, k, v, do, qo, ko, config),
        (reference_fp8.quantize_tokens(x, config, rotate=r)
         for x, r in ((q, True), (k, True), (v, False), (do, False))),
    ):  # fmt: skip
        assert torch.equal(t.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(t.scale, want.scale)
    want = _spec_grads(*inputs, config)
    exact, _ = _exact_grads(q, k, v, do, qo, ko, kvi, nt, spec)
    for name_, g, s, e in zip("qkv", got, want, exact):
        dev = _rms(g.double().cpu() - s.double().cpu())
        err = _rms(s.double().cpu() - e)
        assert dev <= 0.1 * err + 1e-6, f"d{name_}: deviation {dev:.2e} vs FP8 error {err:.2e}"
        a, b = g.double().cpu(), s.double().cpu()
        off = ((a - b).abs() > 2.0**-7 * b.abs() + 1e-3 * _rms(b)).double().mean().item()
        assert off <= 0.01, f"d{name_}: {off:.1%} of the gradients off the specification"


@needs_kernels
@pytest.mark.parametrize("name", ["causal_cross", "cross_map", "silu_norm", "gelu_dv64"])
def test_transposed_operands_give_the_same_gradients(name):
    """Reading dO, Q and K from their transposed copies (the default on a GPU, K-major for
    the FP8 tensor cores) or from the rows copies gives the same gradients bit for bit;
    the copies hold the rows' bytes."""
    from hyperrec.jagged_attn._triton._fp8_launch import quantize_grad_operands
    from hyperrec.jagged_attn.reference_fp8 import dequantize

    case, config = CASES[name]
    a, inputs = _kernel_grads(case, config, transposed_b=True)
    b, _ = _kernel_grads(case, config, transposed_b=False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    q, k, v, do, qo, ko, kvi, nt, spec = inputs
    ops = quantize_grad_operands(q, k, v, do, qo, ko, config, transposed=True)
    assert len(ops) == 7
    for rows, cols, offsets, n in ((ops[0], ops[4], qo, q.shape[0]), (ops[1], ops[5], ko,
                                   k.shape[0]), (ops[3], ops[6], qo, q.shape[0])):  # fmt: skip
        assert torch.equal(
            dequantize(rows, config, offsets, n), dequantize(cols, config, offsets, n)
        )


@needs_kernels
def test_gradient_scale_does_not_matter():
    """A tiny upstream gradient (a loss averaged over a huge batch) gives the same gradients
    scaled by the same power of two, bit for bit: the backward's scales reach 2**-126
    (the forward's 2**-24 floor would have flushed these to zero)."""
    case, config = CASES["softmax_hadamard_causal"]
    one, _ = _kernel_grads(case, config)
    tiny, _ = _kernel_grads(case, config, scale_do=2.0**-60)
    for a, b in zip(one, tiny):
        assert torch.equal(a.float() * 2.0**-60, b.float())
        assert b.abs().max() > 0


def test_specification_gradient_scale_does_not_matter():
    case, config = CASES["silu_norm"]
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 2, "cpu")
    one = _spec_grads(q, k, v, do, qo, ko, kvi, nt, spec, config)
    tiny = _spec_grads(q, k, v, do * 2.0**-70, qo, ko, kvi, nt, spec, config)
    for a, b in zip(one, tiny):
        assert torch.equal(a.float() * 2.0**-70, b.float()) and b.abs().max() > 0


@needs_kernels
def test_nan_gradient_stays_in_its_sequence():
    """A NaN in one query's upstream gradient makes the gradients of its own sequence NaN
    (as the bf16 backward does) and nothing else; the specification agrees."""
    case, config = Case((20, 45, 7)), BWD
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 3)
    do[30, 1, 5] = float("nan")
    from hyperrec.jagged_attn._triton._fp8_launch import attention_backward_fp8

    got = attention_backward_fp8(do, call_of(q, k, v, qo, ko, kvi, nt, spec), config)
    want = _spec_grads(q, k, v, do, qo, ko, kvi, nt, spec, config)
    for g, w in zip(got, want):
        nan = torch.isnan(g.cpu())
        assert torch.equal(nan, torch.isnan(w.cpu()))
        assert not nan[:20].any() and not nan[65:].any() and nan[20:65].any()


def test_error_against_exact_and_bf16():
    """What users choose between (Gaussian inputs, one long and several short sequences,
    the torch emulation on the CPU): the FP8 backward's gradients stay within 10% RMS of
    the exact ones (cosine > 0.99), while the default bf16 backward after the FP8 forward
    stays within 3%. ``bench/fp8_grad_error.py`` measures the same on the benchmark's
    length distributions."""
    g = torch.Generator().manual_seed(0)
    lens = (300, 17, 64, 1, 90)
    offsets = offsets_tensor(lens, "cpu")
    q, k, v, do = (torch.randn(sum(lens), 2, 64, generator=g).bfloat16() for _ in range(4))
    spec = AttentionSpec(scale=64**-0.5, max_seqlen_q=300, max_seqlen_kv=300)
    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    for config, bound in ((FP8Config(backward="fp8"), 0.10), (FP8Config(), 0.03)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ja.jagged_attention(*leaves, offsets, 300, backend="torch", precision=config)
        for got, e in zip(torch.autograd.grad(out, leaves, do), exact):
            m = reference_fp8.error_metrics(got.double(), e)
            assert _rms(got.double() - e) <= bound * _rms(e), (config.backward, m)
            assert m["cosine"] > 0.99


def _outlier_inputs(lens=(120, 9, 60), heads=1, dim=64, seed=0):
    """Q and K with two head-dim channels 20x larger (then / 3), as in trained models:
    peaked attention over keys of large norm, where a softmax gradient whose statistics
    disagree with its P goes wrong."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v, do = (torch.randn(total, heads, dim, generator=g) for _ in range(4))
    q[..., :2] *= 20
    k[..., :2] *= 20
    q, k = q / 3, k / 3
    offsets = offsets_tensor(lens, DEVICE)
    spec = AttentionSpec(scale=dim**-0.5, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    return [t.to(DEVICE, torch.bfloat16) for t in (q, k, v, do)], offsets, spec


@needs_kernels
@pytest.mark.parametrize("by_forward", [False, True], ids=["stats_pass", "bf16_forward"])
def test_default_fp8_forward_gradients_on_outlier_channels(by_forward, monkeypatch):
    """``precision="fp8"`` with the default bf16 backward: the backward recomputes the
    softmax statistics from the unquantized inputs, so its gradients are the bf16
    backward's (SNR > 30 dB against float64). Reading the FP8 forward's log-sum-exp and
    output (what it did before) gave dQ 9 dB, dK 16 dB, dV 16 dB here. Both ways of
    recomputing (``_launch.STATS_BY_FORWARD``: the dQ kernel's stats pass, or a bf16
    forward, what runs where the Gluon backward serves the call); with the forward, the
    gradients are bit for bit those of the bf16 call's backward."""
    from hyperrec.jagged_attn._triton import _launch

    monkeypatch.setattr(_launch, "STATS_BY_FORWARD", by_forward)
    (q, k, v, do), offsets, spec = _outlier_inputs()
    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ja.jagged_attention(*leaves, offsets, 120, backend="triton", precision="fp8")
    got = torch.autograd.grad(out, leaves, do)
    for name, g, e in zip("qkv", got, exact):
        snr = reference_fp8.error_metrics(g.double().cpu(), e)["snr_db"]
        assert snr > 30, f"d{name}: {snr:.1f} dB"
    if by_forward:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ja.jagged_attention(*leaves, offsets, 120, backend="triton")
        for g, b in zip(got, torch.autograd.grad(out, leaves, do)):
            torch.testing.assert_close(g, b, rtol=0, atol=0)


@needs_kernels
def test_fp8_backward_on_outlier_channels():
    """The FP8 backward on the same inputs: the kernels follow the specification, whose
    own statistics keep dQ at >= 15 dB (with the FP8 forward's delta it was 12 dB), dK and
    dV >= 20 dB; without the Hadamard rotation the outliers cost far more."""
    (q, k, v, do), offsets, spec = _outlier_inputs()
    from hyperrec.jagged_attn._triton._fp8_launch import attention_backward_fp8

    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    call = call_of(q, k, v, offsets, offsets, None, None, spec)
    got = attention_backward_fp8(do, call, BWD_H)
    want = _spec_grads(q, k, v, do, offsets, offsets, None, None, spec, BWD_H)
    floors = {"q": 15.0, "k": 20.0, "v": 20.0}
    for name, g, w, e in zip("qkv", got, want, exact):
        g, w = g.double().cpu(), w.double().cpu()
        assert _rms(g - w) <= 0.1 * _rms(w - e)
        snr = reference_fp8.error_metrics(w, e)["snr_db"]
        assert snr >= floors[name], f"d{name}: {snr:.1f} dB"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_public_option(backend):
    """``precision=FP8Config(backward="fp8")`` through ``gdpa`` and ``jagged_attention``:
    the gradients are the specification's (torch backend: exactly the emulation's op),
    also under non-reentrant checkpointing (each saved tensor unpacked once)."""
    lens = (9, 0, 40)
    offsets = offsets_tensor(lens, DEVICE)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(49, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
                   for _ in range(4))  # fmt: skip

    def fn(q, k, v):
        return ja.jagged_attention(q, k, v, offsets, 40, causal=True, backend=backend,
                                   precision=BWD_H)  # fmt: skip

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    got = torch.autograd.grad(out, leaves, do)
    spec = AttentionSpec(scale=32**-0.5, max_seqlen_q=40, max_seqlen_kv=40,
                         mask=ja.MaskSpec(causal=True))  # fmt: skip
    want = _spec_grads(q, k, v, do, offsets, offsets, None, None, spec, BWD_H)
    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    emulated = reference_fp8.attention_backward(q, k, v, do, offsets, offsets, spec, BWD_H,
                                                dtype=torch.float32)  # fmt: skip
    for a, w, e, em in zip(got, want, exact, emulated):
        if backend == "torch":  # the op computes the specification in float32
            torch.testing.assert_close(a, em, rtol=0, atol=0)
        assert _rms(a.double().cpu() - w.double().cpu()) <= 0.1 * _rms(w.double().cpu() - e)
    ckpt = torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False)
    for a, b in zip(torch.autograd.grad(ckpt, leaves, do), got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ja.gdpa(*leaves, offsets, offsets, 40, 40, activation="silu", backend=backend,
                  precision=BWD)  # fmt: skip
    got = torch.autograd.grad(out, leaves, do)
    spec = AttentionSpec(scale=32**-0.5, max_seqlen_q=40, max_seqlen_kv=40, activation="silu")
    want = _spec_grads(q, k, v, do, offsets, offsets, None, None, spec, BWD)
    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    for a, w, e in zip(got, want, exact):
        assert _rms(a.double().cpu() - w.double().cpu()) <= 0.1 * _rms(w.double().cpu() - e)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_backward_does_not_depend_on_the_forward_format(backend):
    """The FP8 backward reads neither the forward's output nor its statistics: with an
    ``"mxfp8"`` forward its gradients are bit for bit those after an ``"fp8"`` forward."""
    pytest.importorskip("hyperrec.mxfp8")
    offsets = offsets_tensor((33, 0, 20), DEVICE)
    g = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(53, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    grads = []
    for fmt in ("fp8", "mxfp8"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ja.jagged_attention(*leaves, offsets, 33, causal=True, backend=backend,
                                  precision=FP8Config(format=fmt, backward="fp8"))  # fmt: skip
        grads.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_flop_counter_counts_the_fp8_backward(backend):
    """``FlopCounterMode`` sees the FP8 backward: fwd + bwd = 3.5x the forward's count (the
    statistics pass is recomputation and not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    offsets = offsets_tensor((20, 12), DEVICE)
    q, k, v = (torch.randn(32, 2, 32).to(DEVICE, torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    with FlopCounterMode(display=False) as fwd_only:
        ja.jagged_attention(q, k, v, offsets, 20, backend=backend, precision=BWD)
    with FlopCounterMode(display=False) as both:
        out = ja.jagged_attention(q, k, v, offsets, 20, backend=backend, precision=BWD)
        out.sum().backward()
    assert fwd_only.get_total_flops() > 0
    assert both.get_total_flops() == pytest.approx(3.5 * fwd_only.get_total_flops())


TRITON_OP = pytest.param("attention_fp8_triton_bwd", marks=needs_kernels)


@pytest.mark.parametrize("op_name", ["attention_fp8_torch_bwd", TRITON_OP])
def test_opcheck(op_name):
    from hyperrec.jagged_attn._fp8 import ops
    from hyperrec.jagged_attn._opschema import AttentionCall

    lens = (9, 4)
    offsets = offsets_tensor(lens, DEVICE)
    q, k, v, do = (torch.randn(13, 2, 32).to(DEVICE, torch.bfloat16) for _ in range(4))
    spec = AttentionSpec(scale=0.2, max_seqlen_q=9, max_seqlen_kv=9)
    call = AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip
    if op_name == "attention_fp8_triton_bwd":
        extra = (do, *ops.attention_fp8_triton_fwd(BWD.encode(), *call.op_args()))
    else:
        extra = (do,)
    torch.library.opcheck(getattr(ops, op_name), (BWD.encode(), *extra, *call.op_args()),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_compile_fullgraph_backward():
    lens = (9, 0, 20)
    offsets = offsets_tensor(lens, "cpu")
    q, k, v = (torch.randn(29, 2, 32).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return ja.jagged_attention(q, k, v, offsets, 20, backend="torch", precision=BWD_H,
                                   validate=False)  # fmt: skip

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    do = torch.randn(29, 2, 32)
    a = torch.autograd.grad(compiled(q, k, v), (q, k, v), do)
    b = torch.autograd.grad(f(q, k, v), (q, k, v), do)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softmax_hadamard_causal", "silu_norm", "cross_map"])
def test_gpu_kernels_against_the_specification(name):
    """On a GPU the products run on FP8 tensor cores (coarser accumulation than float32,
    see test_fp8_attention.MMA_RMS): as accurate as the specification, within 1%."""
    case, config = CASES[name]
    case = Case(tuple(4 * n for n in case.q_lens),
                kv_lens=None if case.kv_lens is None else tuple(4 * n for n in case.kv_lens),
                kv_index=case.kv_index, targets=case.targets, heads=4, head_dim=128,
                spec=case.spec, mask=case.mask)  # fmt: skip
    got, inputs = _kernel_grads(case, config)
    q, k, v, do, qo, ko, kvi, nt, spec = inputs
    want = _spec_grads(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in inputs),
                       config)  # fmt: skip
    exact, _ = _exact_grads(q, k, v, do, qo, ko, kvi, nt, spec)
    for g, s, e in zip(got, want, exact):
        g, s = g.double().cpu(), s.double().cpu()
        err_spec, err = _rms(s - e), _rms(g - e)
        assert _rms(g - s) <= 0.15 * err_spec
        assert abs(err / err_spec - 1) <= 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_default_backward_takes_the_gluon_kernels(causal):
    """Sequences past the Gluon threshold: the FP8 forward's default bf16 backward gets its
    statistics from a bf16 forward and runs the Gluon backward kernels, so its gradients are
    bit for bit the bf16 call's (and accurate on outlier channels)."""
    from hyperrec.jagged_attn._gluon import gluon_supported
    from hyperrec.jagged_attn._triton import _launch

    if not torch.cuda.is_available() or not gluon_supported("cuda"):
        pytest.skip("needs a GPU the Gluon kernels support")
    lens = (300, 0, 517, 64)
    (q, k, v, do), offsets, spec = _outlier_inputs(lens, heads=2, dim=128, seed=3)
    spec = AttentionSpec(scale=spec.scale, max_seqlen_q=517, max_seqlen_kv=517,
                         mask=ja.MaskSpec(causal=causal))  # fmt: skip
    call = call_of(q, k, v, offsets, offsets, None, None, spec)
    assert _launch.gluon_eligible(call) and _launch.gluon_bwd_requested(spec)
    exact, _ = _exact_grads(q, k, v, do, offsets, offsets, None, None, spec)
    grads = []
    for precision in ("fp8", "bf16"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ja.jagged_attention(*leaves, offsets, 517, causal=causal, precision=precision)
        grads.append(torch.autograd.grad(out, leaves, do))
    for name, g, b, e in zip("qkv", *grads, exact):
        torch.testing.assert_close(g, b, rtol=0, atol=0)
        snr = reference_fp8.error_metrics(g.double().cpu(), e)["snr_db"]
        assert snr > 30, f"d{name}: {snr:.1f} dB"
