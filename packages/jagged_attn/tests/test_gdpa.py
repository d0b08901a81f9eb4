"""gdpa: every activation, normalisation, scale placement, map and mask against the
float64 oracle, plus independent formulations (HSTU, duplicated histories, PMA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jagged_oracle import Call, Mask, grads, make_problem, offsets_of, oracle_attention

from hyperrec.jagged_attn import ACTIVATIONS, NORMALIZATIONS, gdpa, jagged_attention
from hyperrec.testing import assert_close_to_reference


def _compare(p, call: Call, *, kv_index=None, num_targets=None, atol=1e-10, **kwargs):
    q, k, v = p.leaves()
    out = gdpa(
        q,
        k,
        v,
        p.q_offsets_t,
        p.kv_offsets_t,
        p.max_q,
        p.max_kv,
        activation=call.activation,
        scale=call.scale,
        output_scale=call.output_scale,
        normalization=call.normalization,
        causal=call.mask.causal,
        window_size=(call.mask.left, call.mask.right),
        contextual_len=call.mask.contextual,
        kv_index=None if kv_index is None else torch.tensor(kv_index, dtype=torch.int32),
        num_targets=None if num_targets is None else torch.tensor(num_targets, dtype=torch.long),
        **kwargs,
    )
    ref = oracle_attention(
        q, k, v, p.q_offsets, p.kv_offsets, call, kv_index=kv_index, num_targets=num_targets
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    g = torch.randn_like(out)
    for name, got, want in zip("qkv", grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=0, atol=atol * 10, msg=f"d{name}")
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_every_activation_and_normalization(activation, normalization):
    p = make_problem([4, 0, 6], [5, 2, 6], heads=2, dim=3, dim_v=2, seed=3)
    call = Call(
        activation=activation,
        scale=0.8,
        output_scale=1.7,
        normalization=normalization,
        max_seqlen_kv=p.max_kv,
        mask=Mask(causal=True),
    )
    _compare(p, call)


def test_default_scale_and_silu():
    p = make_problem([3, 5], heads=2, dim=9, seed=1)
    q, k, v = p.q, p.k, p.v
    out = gdpa(q, k, v, p.q_offsets_t, p.kv_offsets_t, 5, 5)
    ref = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, Call(activation="silu"))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_scale_placement_is_distinct():
    # identity activation: scale and output_scale both multiply linearly; silu is not
    # homogeneous, so moving the factor from before to after the activation changes it.
    p = make_problem([5], seed=2)
    args = (p.q, p.k, p.v, p.q_offsets_t, p.kv_offsets_t, 5, 5)
    before = gdpa(*args, activation="silu", scale=2.0, output_scale=1.0)
    after = gdpa(*args, activation="silu", scale=1.0, output_scale=2.0)
    assert not torch.allclose(before, after)
    lin_before = gdpa(*args, activation="identity", scale=2.0, output_scale=1.0)
    lin_after = gdpa(*args, activation="identity", scale=1.0, output_scale=2.0)
    torch.testing.assert_close(lin_before, lin_after, rtol=1e-12, atol=1e-12)


def test_softmax_gdpa_equals_jagged_attention():
    p = make_problem([4, 7, 0, 2], [3, 7, 2, 0], seed=4)
    a = gdpa(p.q, p.k, p.v, p.q_offsets_t, p.kv_offsets_t, 7, 7, activation="softmax", causal=True)
    b = jagged_attention(
        p.q, p.k, p.v, p.q_offsets_t, 7, kv_offsets=p.kv_offsets_t, max_seqlen_kv=7, causal=True
    )
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _hstu(q, k, v, lengths, n_pad, alpha, num_targets, contextual):
    """HSTU's padded formulation: silu(alpha q k^T) / N times the HSTU mask, N = n_pad."""
    out = []
    start = 0
    for b, length in enumerate(lengths):
        sl = slice(start, start + length)
        start += length
        s = torch.einsum("ihd,jhd->hij", q[sl], k[sl]) * alpha
        ids = torch.arange(length)
        max_id = length - num_targets[b]
        if contextual:
            ids = (ids - contextual + 1).clamp(min=0)
            max_id = max_id - contextual + 1
        ids = torch.minimum(ids, torch.tensor(max_id))
        dist = ids.view(-1, 1) - ids.view(1, -1)
        valid = torch.eye(length, dtype=torch.bool) | (dist > 0)
        if contextual:
            valid |= (ids.view(-1, 1) == 0) & (ids.view(1, -1) < max_id)
        w = torch.nn.functional.silu(s) / n_pad * valid
        out.append(torch.einsum("hij,jhd->ihd", w, v[sl]))
    return torch.cat(out)


def test_hstu_convention():
    lengths, targets, contextual = [6, 9, 3], [2, 3, 0], 2
    p = make_problem(lengths, heads=2, dim=8, seed=5)
    q, k, v = p.leaves()
    out = gdpa(
        q,
        k,
        v,
        p.q_offsets_t,
        p.q_offsets_t,
        12,
        12,
        activation="silu",
        scale=0.3,
        normalization="max_seqlen",
        causal=True,
        num_targets=torch.tensor(targets),
        contextual_len=contextual,
    )
    ref = _hstu(q, k, v, lengths, 12, 0.3, targets, contextual)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_kv_index_equals_duplicated_histories():
    # Candidates: 4 query sequences over 2 user histories; the same answer as giving each
    # query sequence its own copy of the history, and gradients of shared keys add up.
    histories, cand_lens, kv_index = [5, 3], [2, 1, 3, 2], [0, 0, 1, 0]
    p = make_problem(cand_lens, histories, heads=2, dim=4, seed=6)
    q, k, v = p.leaves()
    out = gdpa(q, k, v, p.q_offsets_t, p.kv_offsets_t, 3, 5, kv_index=torch.tensor(kv_index))
    ks = [k[a:b] for a, b in zip(p.kv_offsets, p.kv_offsets[1:])]
    vs = [v[a:b] for a, b in zip(p.kv_offsets, p.kv_offsets[1:])]
    k_dup = torch.cat([ks[m] for m in kv_index])
    v_dup = torch.cat([vs[m] for m in kv_index])
    dup_offsets = torch.tensor(offsets_of([histories[m] for m in kv_index]))
    ref = gdpa(q, k_dup, v_dup, p.q_offsets_t, dup_offsets, 3, 5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_pma_pooling_with_learned_queries():
    # 3 learned queries attend to every sequence; they get gradients from all of them.
    num_q, kv_lens = 3, [4, 0, 7]
    p = make_problem([num_q] * len(kv_lens), kv_lens, heads=2, dim=4, seed=7)
    learned = torch.randn(num_q, 2, 4, dtype=torch.float64, requires_grad=True)
    q = learned.unsqueeze(0).expand(len(kv_lens), -1, -1, -1).reshape(-1, 2, 4)
    q_offsets = torch.arange(len(kv_lens) + 1) * num_q
    out = gdpa(q, p.k, p.v, q_offsets, p.kv_offsets_t, num_q, 7, activation="softmax")
    ref = oracle_attention(q, p.k, p.v, q_offsets.tolist(), p.kv_offsets, Call())
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.equal(out[num_q : 2 * num_q], torch.zeros_like(out[:num_q]))  # empty seq
    (g_out,) = torch.autograd.grad(out.sum(), learned)
    (g_ref,) = torch.autograd.grad(ref.sum(), learned)
    torch.testing.assert_close(g_out, g_ref, rtol=0, atol=1e-11)


def test_gelu_poly_attention_is_close_to_gelu_attention():
    p = make_problem([16, 9], heads=2, dim=16, seed=8)
    args = (p.q, p.k, p.v, p.q_offsets_t, p.kv_offsets_t, 16, 16)
    exact = gdpa(*args, activation="gelu", scale=1.0)
    poly = gdpa(*args, activation="gelu_poly", scale=1.0)
    # |o_i - o_i'| <= sum_j |act err| |v_j| <= 1e-4 * sum_j |v_j|.
    bound = 1e-4 * p.v.abs().sum(dim=0).max()
    assert (exact - poly).abs().max() <= bound
    assert not torch.equal(exact, poly)


def test_gradcheck_with_map_targets_and_contextual():
    p = make_problem([3, 2, 0], [4, 3], heads=1, dim=2, dim_v=2, seed=9)
    kv_index, targets = torch.tensor([0, 1, 1]), torch.tensor([1, 2, 0])

    def fn(q, k, v):
        return gdpa(
            q,
            k,
            v,
            p.q_offsets_t,
            p.kv_offsets_t,
            3,
            4,
            activation="gelu_tanh",
            normalization="length",
            kv_index=kv_index,
            num_targets=targets,
            contextual_len=1,
            causal=True,
        )

    assert torch.autograd.gradcheck(fn, p.leaves())


@pytest.mark.parametrize("activation", ["silu", "gelu_poly", "softmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_follows_the_accuracy_rule(activation, dtype):
    p = make_problem([33, 0, 48], [40, 7, 48], heads=2, dim=32, dim_v=32, dtype=dtype, seed=10)
    q, k, v = p.leaves()
    call = Call(
        activation=activation, normalization="length", max_seqlen_kv=48, mask=Mask(causal=True)
    )
    out = gdpa(
        q,
        k,
        v,
        p.q_offsets_t,
        p.kv_offsets_t,
        48,
        48,
        activation=activation,
        normalization="length",
        causal=True,
    )
    exact = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call)
    same = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call, dtype=dtype)
    assert_close_to_reference(out, same, exact, name="out")
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    for name, a, r, e in zip(
        "qkv", grads(out, (q, k, v), g), grads(same, (q, k, v), g), grads(exact, (q, k, v), g)
    ):
        assert_close_to_reference(a, r, e, name=f"d{name}")


@settings(deadline=None, max_examples=150)
@given(
    num_kv=st.integers(0, 3),
    data=st.data(),
    heads=st.integers(1, 2),
    dim=st.integers(1, 5),
    dim_v=st.integers(1, 4),
    activation=st.sampled_from(ACTIVATIONS),
    normalization=st.sampled_from(NORMALIZATIONS),
    causal=st.booleans(),
    left=st.integers(-1, 3),
    right=st.integers(-1, 3),
    contextual=st.integers(0, 2),
    scale=st.floats(0.1, 2.0),
    output_scale=st.floats(-2.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_sweep(
    num_kv,
    data,
    heads,
    dim,
    dim_v,
    activation,
    normalization,
    causal,
    left,
    right,
    contextual,
    scale,
    output_scale,
    seed,
):
    kv_lens = data.draw(st.lists(st.integers(0, 7), min_size=num_kv, max_size=num_kv))
    use_map = num_kv > 0 and data.draw(st.booleans(), label="use_map")
    if use_map:
        kv_index = data.draw(st.lists(st.integers(0, num_kv - 1), min_size=0, max_size=4))
    else:
        kv_index = None
    num_q = len(kv_index) if use_map else num_kv
    q_lens = data.draw(st.lists(st.integers(0, 7), min_size=num_q, max_size=num_q))
    seq_kv = [kv_lens[m] for m in kv_index] if use_map else kv_lens
    targets = None
    if data.draw(st.booleans(), label="targets"):
        targets = [data.draw(st.integers(0, n)) for n in seq_kv]
    p = make_problem(q_lens, kv_lens, heads=heads, dim=dim, dim_v=dim_v, seed=seed)
    call = Call(
        activation=activation,
        scale=scale,
        output_scale=output_scale,
        normalization=normalization,
        max_seqlen_kv=p.max_kv,
        mask=Mask(causal=causal, left=left, right=right, contextual=contextual),
    )
    _compare(p, call, kv_index=kv_index, num_targets=targets)


@pytest.mark.parametrize("activation", ["silu", "gelu_poly"])
def test_fp16_backward_with_a_loss_scaled_gradient(activation):
    """An activation's dS was rounded to fp16 before the output multiplier (HSTU's
    ``1 / max_seqlen``) scaled it: a loss-scaled dO (x4096) overflowed dQ and dK to inf
    while the true gradients are ~1,800x below fp16's maximum (an audit found it). The
    float64 answer is the reference (a same-dtype one overflows itself here)."""
    p = make_problem([7, 17], [7, 17], heads=1, dim=64, dim_v=64, dtype=torch.float16, seed=3)
    q, k, v = p.leaves()
    call = Call(activation=activation, normalization="max_seqlen", max_seqlen_kv=1024,
                mask=Mask(causal=True))  # fmt: skip
    out = gdpa(q, k, v, p.q_offsets_t, p.kv_offsets_t, 17, 1024, activation=activation,
               normalization="max_seqlen", causal=True, backend="triton")  # fmt: skip
    exact = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call)
    g = (torch.randn(out.shape, dtype=torch.float64) * 4096).to(torch.float16)
    for name, a, e in zip("qkv", grads(out, (q, k, v), g), grads(exact, (q, k, v), g)):
        assert torch.isfinite(a).all(), name
        err = (a.double() - e).abs().max() / e.abs().max()
        assert err < 2e-3, (name, float(err))  # fp16 rounding: ~5e-4 measured
