"""jagged_attention: forward and backward against the float64 oracle, SDPA and gradcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from jagged_oracle import Call, Mask, grads, make_problem, oracle_attention

from hyperrec.jagged_attn import jagged_attention
from hyperrec.testing import assert_close_to_reference


def _check_against_oracle(p, *, asym: bool, causal=False, window=(-1, -1), scale=None, atol=1e-10):
    q, k, v = p.leaves()
    kwargs = {"causal": causal, "window_size": window, "scale": scale}
    if asym:
        kwargs |= {"kv_offsets": p.kv_offsets_t, "max_seqlen_kv": p.max_kv}
    out = jagged_attention(q, k, v, p.q_offsets_t, p.max_q, **kwargs)
    call = Call(scale=scale, mask=Mask(causal=causal, left=window[0], right=window[1]))
    ref = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], v.shape[2])
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)
    g = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g.double())):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol * 10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [
        ([5, 1, 7], None),
        ([0, 3, 0, 4], None),  # zero-length sequences
        ([1], None),
        ([3, 5], [5, 3]),  # asymmetric, both directions
        ([2, 0, 4], [6, 3, 0]),  # queries with an empty key sequence
        ([0, 0], [0, 0]),  # no tokens at all
    ],
)
def test_matches_oracle(q_lens, kv_lens, causal):
    p = make_problem(q_lens, kv_lens, heads=2, dim=5, dim_v=3, seed=len(q_lens))
    _check_against_oracle(p, asym=kv_lens is not None, causal=causal)


def test_empty_batch():
    p = make_problem([], heads=3, dim=4)
    q, k, v = p.leaves()
    out = jagged_attention(q, k, v, torch.tensor([0]), 0)
    assert out.shape == (0, 3, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_causal_first_queries_without_keys_are_zero():
    # Lq = 5 > Lk = 2: bottom-right alignment leaves queries 0..2 with no visible key.
    p = make_problem([5], [2], seed=3)
    q, k, v = p.leaves()
    out = jagged_attention(
        q, k, v, p.q_offsets_t, 5, kv_offsets=p.kv_offsets_t, max_seqlen_kv=2, causal=True
    )
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert out[3:].abs().min() > 0
    out.sum().backward()
    assert torch.equal(q.grad[:3], torch.zeros_like(q.grad[:3]))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("window", [(2, 0), (1, 1), (0, 3), (-1, 2)])
def test_window_matches_oracle(window):
    p = make_problem([6, 2, 9], seed=7)
    _check_against_oracle(p, asym=False, window=window)
    _check_against_oracle(p, asym=False, window=window, causal=True)


def test_scale_is_applied_to_scores():
    p = make_problem([4, 6], seed=5)
    _check_against_oracle(p, asym=False, scale=0.37)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_per_sequence(causal):
    p = make_problem([4, 7, 1, 5], heads=3, dim=8, seed=11)
    out = jagged_attention(p.q, p.k, p.v, p.q_offsets_t, 7, causal=causal)
    for a, b in zip(p.q_offsets, p.q_offsets[1:]):
        sl = slice(a, b)
        want = F.scaled_dot_product_attention(
            p.q[sl].transpose(0, 1),
            p.k[sl].transpose(0, 1),
            p.v[sl].transpose(0, 1),
            is_causal=causal,
        ).transpose(0, 1)
        torch.testing.assert_close(out[sl], want, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    p = make_problem([3, 0, 2], [2, 1, 3], heads=1, dim=3, dim_v=2, seed=2)
    offs, kv_offs = p.q_offsets_t, p.kv_offsets_t

    def fn(q, k, v):
        return jagged_attention(q, k, v, offs, 3, kv_offsets=kv_offs, max_seqlen_kv=3, causal=True)

    assert torch.autograd.gradcheck(fn, p.leaves())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_follows_the_accuracy_rule(dtype):
    p = make_problem([37, 5, 0, 64], heads=2, dim=32, dim_v=16, dtype=dtype, seed=13)
    q, k, v = p.leaves()
    out = jagged_attention(q, k, v, p.q_offsets_t, 64, causal=True)
    call = Call(mask=Mask(causal=True))
    exact = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call)
    same_dtype = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call, dtype=dtype)
    assert out.dtype == dtype
    assert_close_to_reference(out, same_dtype, exact, name="out")
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    got = grads(out, (q, k, v), g)
    want = grads(exact, (q, k, v), g.double())
    ref = grads(same_dtype, (q, k, v), g)
    for name, a, r, e in zip("qkv", got, ref, want):
        assert a.dtype == dtype
        assert_close_to_reference(a, r, e, name=f"d{name}")


def test_nan_stays_inside_its_sequence():
    p = make_problem([4, 5, 3], seed=17)
    q, k, v = p.leaves()
    with torch.no_grad():
        k[4 + 2, 1, 0] = float("nan")  # sequence 1
        v[4 + 1, 0, 2] = float("nan")
    out = jagged_attention(q, k, v, p.q_offsets_t, 5)
    assert torch.isfinite(out[:4]).all() and torch.isfinite(out[9:]).all()
    assert torch.isnan(out[4:9]).any()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):  # rows of sequences 0 and 2 stay finite
        assert torch.isfinite(t.grad[:4]).all() and torch.isfinite(t.grad[9:]).all()


def test_non_contiguous_inputs():
    p = make_problem([3, 6], heads=2, dim=4, seed=19)
    qkv = torch.cat([p.q, p.k, p.v], dim=-1).requires_grad_()  # (T, H, 12): sliced views
    q, k, v = qkv[..., :4], qkv[..., 4:8], qkv[..., 8:]
    assert not q.is_contiguous()
    out = jagged_attention(q, k, v, p.q_offsets_t, 6, causal=True)
    ref = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, Call(mask=Mask(causal=True)))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    (g_out,) = torch.autograd.grad(out.sum(), qkv)
    (g_ref,) = torch.autograd.grad(ref.sum(), qkv)
    torch.testing.assert_close(g_out, g_ref, rtol=0, atol=1e-11)


def test_int32_and_int64_offsets_agree():
    p = make_problem([3, 4], seed=23)
    a = jagged_attention(p.q, p.k, p.v, p.q_offsets_t.int(), 4)
    b = jagged_attention(p.q, p.k, p.v, p.q_offsets_t.long(), 4)
    assert torch.equal(a, b)


def test_validate_false_skips_value_checks_and_backend_torch_is_the_reference():
    p = make_problem([3, 4], seed=29)
    a = jagged_attention(p.q, p.k, p.v, p.q_offsets_t, 4, validate=False, backend="torch")
    b = jagged_attention(p.q, p.k, p.v, p.q_offsets_t, 4)
    assert torch.equal(a, b)


@settings(deadline=None, max_examples=80)
@given(
    q_lens=st.lists(st.integers(0, 7), min_size=0, max_size=4),
    data=st.data(),
    heads=st.integers(1, 3),
    dim=st.integers(1, 6),
    causal=st.booleans(),
    left=st.integers(-1, 3),
    right=st.integers(-1, 3),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_sweep(q_lens, data, heads, dim, causal, left, right, seed):
    asym = data.draw(st.booleans())
    kv_lens = data.draw(st.lists(st.integers(0, 7), min_size=len(q_lens), max_size=len(q_lens)))
    p = make_problem(q_lens, kv_lens if asym else None, heads=heads, dim=dim, seed=seed)
    _check_against_oracle(p, asym=asym, causal=causal, window=(left, right))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_ignores_ambient_autocast(dtype):
    """Under torch.autocast the reference must still compute in float32 (not mix dtypes)."""
    torch.manual_seed(0)
    offsets = torch.tensor([0, 5, 5, 12])
    q, k, v = (torch.randn(12, 2, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    plain = jagged_attention(q, k, v, offsets, 7, causal=True, backend="torch")
    (gq,) = torch.autograd.grad(plain.float().sum(), q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = jagged_attention(q, k, v, offsets, 7, causal=True, backend="torch")
        (gq_inside,) = torch.autograd.grad(inside.float().sum(), q)
    assert inside.dtype == dtype
    torch.testing.assert_close(inside, plain, rtol=0, atol=0)
    torch.testing.assert_close(gq_inside, gq, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_under_non_reentrant_checkpoint(backend):
    # Non-reentrant checkpointing lets each saved tensor be unpacked once: a backward that
    # reads ctx.saved_tensors twice fails there (it did in the reference backend).
    p = make_problem([3, 0, 5], None, heads=2, dim=16, seed=5)
    dtype = torch.float32 if backend == "torch" else torch.bfloat16
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in p.leaves())
    offs = p.q_offsets_t

    def fn(q, k, v):
        return jagged_attention(q, k, v, offs, 5, causal=True, backend=backend)

    g = torch.randn(q.shape[0], q.shape[1], v.shape[2], dtype=dtype)
    plain = grads(fn(q, k, v), (q, k, v), g)
    ckpt = torch.utils.checkpoint.checkpoint(fn, q, k, v, use_reentrant=False)
    for got, want in zip(grads(ckpt, (q, k, v), g), plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
