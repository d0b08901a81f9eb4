"""The experimental Gluon backward kernels (``JAGGED_ATTN_GLUON_BWD=1``).

On the CPU: the variable's values, and that the backward routes dK/dV and dQ to the Gluon
launchers only when asked and eligible, and dQ to the Triton kernel when the dQ switch
says so (the launchers are replaced by stubs there: Gluon has no interpreter). On an
sm_90 GPU (``gpu``): gradients through the public API against a float64 autograd
reference, with the rule ``max|g - ref| <= 2 * max|g_triton - ref| + 1e-3``
(``g_triton``: the default Triton backward on the same inputs), over causal and not,
softmax and SiLU, head dims 64 and 128, query lengths shorter than, equal to and longer
than key lengths, empty sequences and partial tiles; and the isolation of non-finite
values in a neighbouring sequence.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from hyperrec.jagged_attn import AttentionSpec, gdpa
from hyperrec.jagged_attn._triton import _launch
from hyperrec.jagged_attn._triton._launch import GLUON_BWD_ENV

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _spec(max_len):
    return AttentionSpec(scale=0.125, max_seqlen_q=max_len, max_seqlen_kv=max_len)


def test_a_bad_variable_value_is_an_error(monkeypatch):
    monkeypatch.setenv(GLUON_BWD_ENV, "yes")
    with pytest.raises(ValueError, match="JAGGED_ATTN_GLUON_BWD must be 0, 1 or auto"):
        _launch.gluon_bwd_requested(_spec(512))


@pytest.mark.parametrize("env", [None, "auto", "0", "1"])
@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("max_len", [16, 256, 257, 4096])
def test_the_variable_and_the_default(env, default, max_len, monkeypatch):
    # "1": every eligible call; "0": none; unset/"auto": GLUON_BWD_DEFAULT for calls longer
    # than GLUON_MIN_SEQLEN (256)
    monkeypatch.setattr(_launch, "GLUON_BWD_DEFAULT", default)
    if env is None:
        monkeypatch.delenv(GLUON_BWD_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUON_BWD_ENV, env)
    want = env == "1" or (env in (None, "auto") and default and max_len > 256)
    assert _launch.gluon_bwd_requested(_spec(max_len)) is want


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("gluon_dq", [False, True])
@pytest.mark.parametrize("eligible", [False, True])
@pytest.mark.parametrize("env", ["0", "1"])
def test_backward_routes_to_the_gluon_kernels(env, eligible, gluon_dq, monkeypatch):
    lens = [5, 0, 9]
    t = sum(lens)
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(t, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4))

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = gdpa(*leaves, off, off, 9, 9, activation="softmax", causal=True, backend="triton")
        return torch.autograd.grad(out, leaves, do)

    monkeypatch.delenv(GLUON_BWD_ENV, raising=False)
    dq0, dk0, dv0 = grads()
    calls = []

    dq_calls = []

    def stub(call, grad_out, lse, delta, dk, dv, qk_scale, scale, coef):
        calls.append((lse.shape, delta.shape, qk_scale, scale, coef))
        dk.fill_(7.0)
        dv.fill_(-7.0)

    def dq_stub(call, grad_out, lse, delta, dq, qk_scale, scale, coef):
        # the real one returns False without launching when the switch says "triton"
        dq_calls.append(qk_scale)
        if gluon_dq:
            dq.fill_(3.0)
        return gluon_dq

    monkeypatch.setattr(_launch, "gluon_unsupported", lambda call: None if eligible else "no")
    monkeypatch.setattr(_launch, "_BWD_PLANS", {})  # eligibility is part of the plan
    monkeypatch.setattr(_launch, "_gluon_dkdv", stub)
    monkeypatch.setattr(_launch, "_gluon_dq", dq_stub)
    monkeypatch.setenv(GLUON_BWD_ENV, env)
    dq, dk, dv = grads()
    taken = env == "1" and eligible
    assert len(calls) == len(dq_calls) == int(taken)
    if taken and gluon_dq:
        assert (dq == 3.0).all()
    else:
        assert torch.equal(dq, dq0)  # the Triton dQ kernel
    if taken:
        lse_shape, delta_shape, qk_scale, scale, coef = calls[0]
        assert lse_shape == delta_shape == (2, t)
        assert math.isclose(qk_scale, scale * math.log2(math.e)) and coef == 1.0
        assert (dk == 7.0).all() and (dv == -7.0).all()
    else:
        assert torch.equal(dk, dk0) and torch.equal(dv, dv0)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("dim", [64, 128])
def test_fused_dq_routes_through_a_zeroed_fp32_buffer(act, dim, monkeypatch):
    # DQ_KERNEL="fused": the dK/dV launcher gets a zeroed fp32 buffer of q's shape, dQ is
    # that buffer times the scale in q's dtype, and no dQ kernel runs; SiLU at head dim 128
    # (no 64-row tiles there) keeps the separate dQ kernel
    from hyperrec.jagged_attn._gluon import _bwd_launch

    lens = [5, 0, 9]
    t = sum(lens)
    off = torch.tensor([0, 5, 5, 14])
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(t, 2, dim, generator=g).to(torch.bfloat16) for _ in range(4))
    seen, dq_calls = [], []

    def stub(call, grad_out, lse, delta, dk, dv, qk_scale, scale, coef, dq_accum=None):
        if dq_accum is not None:
            seen.append((dq_accum.dtype, dq_accum.shape, bool((dq_accum == 0).all()), scale))
            dq_accum.fill_(2.0)
        dk.zero_()
        dv.zero_()

    def dq_stub(call, grad_out, lse, delta, dq, qk_scale, scale, coef):
        dq_calls.append(1)
        dq.fill_(-1.0)
        return True

    monkeypatch.setattr(_bwd_launch, "DQ_KERNEL", "fused")
    monkeypatch.setattr(_launch, "gluon_unsupported", lambda call: None)
    monkeypatch.setattr(_launch, "_BWD_PLANS", {})
    monkeypatch.setattr(_launch, "_gluon_dkdv", stub)
    monkeypatch.setattr(_launch, "_gluon_dq", dq_stub)
    monkeypatch.setenv(GLUON_BWD_ENV, "1")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = gdpa(*leaves, off, off, 9, 9, activation=act, causal=True, backend="triton")
    dq = torch.autograd.grad(out, leaves, do)[0]
    fused = act == "softmax" or dim <= 64
    assert _bwd_launch.fused_dq_supported(dim, act == "softmax") is fused
    if fused:
        assert len(seen) == 1 and not dq_calls
        dtype, shape, zeroed, scale = seen[0]
        assert dtype == torch.float32 and shape == q.shape and zeroed
        assert dq.dtype == q.dtype
        assert torch.equal(dq, torch.full_like(dq, 2.0 * scale))
    else:
        assert not seen and dq_calls == [1] and (dq == -1.0).all()


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("value", ["fuzed", "Gluon", ""])
def test_a_misspelt_dq_switch_is_an_error(value, monkeypatch):
    from hyperrec.jagged_attn._gluon import _bwd_launch

    off = torch.tensor([0, 5, 14])
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(14, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    monkeypatch.setattr(_launch, "gluon_unsupported", lambda call: None)
    monkeypatch.setattr(_launch, "_BWD_PLANS", {})
    monkeypatch.setattr(_launch, "_gluon_dkdv", lambda *a, **kw: None)
    monkeypatch.setenv(GLUON_BWD_ENV, "1")
    monkeypatch.setattr(_bwd_launch, "DQ_KERNEL", value)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = gdpa(*leaves, off, off, 9, 9, activation="softmax", causal=True, backend="triton")
    with pytest.raises(ValueError, match="DQ_KERNEL must be"):
        torch.autograd.grad(out, leaves, do)


# ----------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------


def _gluon_gpu() -> bool:
    if not torch.cuda.is_available() or INTERPRET:
        return False
    from hyperrec.jagged_attn._gluon import gluon_supported

    return gluon_supported("cuda")


needs_gluon = pytest.mark.skipif(not _gluon_gpu(), reason="needs sm_90 and Gluon's Triton")


def _offsets(lens, device="cuda"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)


def _reference(q, k, v, qo, ko, causal, scale, act, coef):
    """float64 output of the same attention, differentiable (a loop over sequences)."""
    outs = []
    for b in range(qo.numel() - 1):
        q0, q1, k0, k1 = int(qo[b]), int(qo[b + 1]), int(ko[b]), int(ko[b + 1])
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if lk == 0:
            outs.append(q[q0:q1].new_zeros(lq, q.shape[1], v.shape[2]))
            continue
        qb, kb, vb = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        s = (qb @ kb.transpose(1, 2)) * scale
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        ok = (j <= i + lk - lq) if causal else torch.ones(lq, lk, dtype=torch.bool,
                                                          device=q.device)  # fmt: skip
        if act == "softmax":
            w = torch.softmax(s.masked_fill(~ok, -math.inf), -1).nan_to_num(0.0)
        else:
            w = F.silu(s) * ok * coef
        outs.append((w @ vb).transpose(0, 1))
    return torch.cat(outs)


def _grads(q, k, v, do, qo, ko, mq, mk, causal, act, env, monkeypatch):
    """Gradients through the public API with ``JAGGED_ATTN_GLUON_BWD=env``; checks that
    the Gluon launchers ran exactly when asked (the Gluon and Triton kernels can give
    bit-identical gradients: the same tensor-core products in the same order)."""
    from hyperrec.jagged_attn._gluon import _bwd_launch

    launches = []
    real = {name: getattr(_bwd_launch, name) for name in ("run_dkdv", "run_dq")}

    def spy(name):
        def run(*a, **kw):
            launches.append(name)
            return real[name](*a, **kw)

        return run

    monkeypatch.setenv(GLUON_BWD_ENV, env)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    norm = "max_seqlen" if act == "silu" else "none"
    try:
        for name in real:
            setattr(_bwd_launch, name, spy(name))
        out = gdpa(*leaves, qo, ko, mq, mk, activation=act, causal=causal, normalization=norm)
        grads = torch.autograd.grad(out, leaves, do)
    finally:
        for name, fn in real.items():
            setattr(_bwd_launch, name, fn)
    fused = _bwd_launch.DQ_KERNEL == "fused" and _bwd_launch.fused_dq_supported(
        q.shape[2], act == "softmax"
    )
    want = ["run_dkdv"] + ([] if fused or _bwd_launch.DQ_KERNEL == "triton" else ["run_dq"])
    assert launches == (want if env == "1" else [])
    return grads


CASES = {
    # name: (query lengths, key lengths)
    "equal": ([300, 0, 1, 129, 64, 513, 128, 77], None),
    "lq<lk": ([17, 64, 200, 1, 0], [300, 64, 333, 5, 9]),
    "lq>lk": ([300, 64, 333, 5, 9], [17, 64, 200, 1, 0]),
    "long": ([2048, 1000], None),
}


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("dq_kernel", ["gluon", "fused"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_gradients_against_float64(case, act, causal, dim, dq_kernel, monkeypatch):
    from hyperrec.jagged_attn._gluon import _bwd_launch

    monkeypatch.setattr(_bwd_launch, "DQ_KERNEL", dq_kernel)
    lens, kv_lens = CASES[case]
    kv_lens = lens if kv_lens is None else kv_lens
    qo, ko = _offsets(lens), _offsets(kv_lens)
    mq, mk = max(lens), max(kv_lens)
    seed = zlib.crc32(f"{case}/{act}/{causal}/{dim}".encode())
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens), sum(kv_lens)
    q, do = (torch.randn(tq, 4, dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(tk, 4, dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    scale = dim**-0.5
    coef = 1.0 / max(mk, 1)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(
        _reference(*leaves, qo, ko, causal, scale, act, coef), leaves, do.double()
    )
    base = _grads(q, k, v, do, qo, ko, mq, mk, causal, act, "0", monkeypatch)
    glu = _grads(q, k, v, do, qo, ko, mq, mk, causal, act, "1", monkeypatch)
    for name, r, b, x in zip("qkv", ref, base, glu):
        assert torch.isfinite(x).all(), f"d{name} not finite"
        err = (x.double() - r).abs().max().item()
        tol = 2 * (b.double() - r).abs().max().item() + 1e-3
        assert err <= tol, f"d{name}: {err:.3e} > {tol:.3e}"


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_dkdv_with_the_triton_dq(causal, monkeypatch):
    from hyperrec.jagged_attn._gluon import _bwd_launch

    monkeypatch.setattr(_bwd_launch, "DQ_KERNEL", "triton")
    lens = [300, 0, 1, 129, 64, 513]
    qo = _offsets(lens)
    g = torch.Generator(device="cuda").manual_seed(11)
    t = sum(lens)
    q, k, v, do = (torch.randn(t, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(4))
    base = _grads(q, k, v, do, qo, qo, 513, 513, causal, "softmax", "0", monkeypatch)
    glu = _grads(q, k, v, do, qo, qo, 513, 513, causal, "softmax", "1", monkeypatch)
    assert torch.equal(base[0], glu[0])  # the same dQ kernel
    for b, x in zip(base[1:], glu[1:]):
        torch.testing.assert_close(x.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("dq_kernel", ["gluon", "fused"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("where", ["q", "do", "k", "v"])
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("poisoned_len", [64, 50])
def test_gpu_non_finite_values_stay_in_their_sequence(where, act, dim, dq_kernel, poisoned_len,
                                                      monkeypatch):  # fmt: skip
    from hyperrec.jagged_attn._gluon import _bwd_launch

    monkeypatch.setattr(_bwd_launch, "DQ_KERNEL", dq_kernel)
    # sequence 1 (poisoned) follows sequence 0, whose last query and key tiles are partial;
    # at length 50 its own last tiles are partial too and reach into sequence 2 (the fused
    # dQ's reduce-add covers whole 64-row tiles)
    lens = [100, poisoned_len, 37]
    end = 100 + poisoned_len
    qo = _offsets(lens)
    g = torch.Generator(device="cuda").manual_seed(3)
    t = sum(lens)
    q, k, v, do = (torch.randn(t, 2, dim, device="cuda", generator=g).bfloat16() for _ in range(4))
    poisoned = dict(q=q, do=do, k=k, v=v)[where]
    poisoned[100:end] = float("nan")
    dq, dk, dv = _grads(q, k, v, do, qo, qo, 100, 100, True, act, "1", monkeypatch)
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x[:100]).all(), f"{name} of sequence 0"
        assert torch.isfinite(x[end:]).all(), f"{name} of sequence 2"


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_every_dtype_and_activation_routes_to_gluon(dtype, activation, monkeypatch):
    """fp16 activation calls kept the Triton backward in 0.2.22 while the Gluon kernels
    rounded dS to fp16 before the output multiplier; they fold it in first since 0.2.23
    (checked on the GPU by ``test_gpu_fp16_activation_with_a_loss_scaled_gradient``)."""
    lens = [5, 9]
    off = torch.tensor([0, 5, 14])
    q, k, v, do = (torch.randn(14, 2, 64, generator=torch.Generator().manual_seed(i)).to(dtype)
                   for i in range(4))  # fmt: skip
    calls = []
    monkeypatch.setattr(_launch, "gluon_unsupported", lambda call: None)
    monkeypatch.setattr(_launch, "_BWD_PLANS", {})
    monkeypatch.setattr(_launch, "_gluon_dkdv", lambda *a: calls.append(a))
    monkeypatch.setattr(_launch, "_gluon_dq", lambda *a: False)
    monkeypatch.setenv(GLUON_BWD_ENV, "1")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = gdpa(*leaves, off, off, max(lens), max(lens), activation=activation, causal=True,
               backend="triton")  # fmt: skip
    torch.autograd.grad(out, leaves, do)
    assert len(calls) == 1


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp16_activation_with_a_loss_scaled_gradient(causal, monkeypatch):
    """HSTU's ``1 / max_seqlen`` multiplier must scale dS before it is rounded to fp16: a
    loss-scaled dO (x4096) made dS overflow while the true gradients are far in range."""
    lens = [7, 300, 129]
    qo = _offsets(lens)
    mk = 1024  # normalization by a larger max_seqlen, as a model's configured maximum
    g = torch.Generator(device="cuda").manual_seed(5)
    t = sum(lens)
    q, k, v = (torch.randn(t, 2, 128, device="cuda", generator=g).half() for _ in range(3))
    do = torch.randn(t, 2, 128, device="cuda", generator=g, dtype=torch.float64) * 4096
    do = do.half()
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = _reference(*leaves, qo, qo, causal, 128**-0.5, "silu", 1.0 / mk)
    ref = torch.autograd.grad(out, leaves, do.double())
    from hyperrec.jagged_attn._gluon import _bwd_launch

    launches = []
    real = _bwd_launch.run_dkdv
    monkeypatch.setattr(
        _bwd_launch, "run_dkdv", lambda *a, **kw: (launches.append(1), real(*a, **kw))[1]
    )
    monkeypatch.setenv(GLUON_BWD_ENV, "1")
    x = [t_.clone().requires_grad_() for t_ in (q, k, v)]
    o = gdpa(*x, qo, qo, max(lens), mk, activation="silu", causal=causal,
             normalization="max_seqlen")  # fmt: skip
    got = torch.autograd.grad(o, x, do)
    assert launches == [1]
    for name, a, e in zip("qkv", got, ref):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        err = (a.double() - e).abs().max() / e.abs().max()
        assert err < 3e-3, (name, float(err))
