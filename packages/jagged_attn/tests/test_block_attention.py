"""block_attention against the oracle and against jagged attention over the blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jagged_oracle import Call, Mask, grads, make_problem, offsets_of, oracle_attention

from hyperrec.jagged_attn import (
    AttentionSpec,
    MaskSpec,
    block_attention,
    jagged_attention,
    reference,
)
from hyperrec.testing import assert_close_to_reference


def _compare(p, *, block_size, previous_block=False, num_global=0, causal=False, atol=1e-10):
    q, k, v = p.leaves()
    out = block_attention(
        q,
        k,
        v,
        p.q_offsets_t,
        p.max_q,
        block_size=block_size,
        previous_block=previous_block,
        num_global=num_global,
        causal=causal,
    )
    mask = Mask(causal=causal, contextual=num_global, block=block_size, previous=previous_block)
    ref = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, Call(mask=mask))
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    g = torch.randn_like(out)
    for name, got, want in zip("qkv", grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=0, atol=atol * 10, msg=f"d{name}")


@pytest.mark.parametrize("previous_block", [False, True])
@pytest.mark.parametrize("num_global", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_oracle(previous_block, num_global, causal):
    p = make_problem([9, 0, 1, 4, 12], heads=2, dim=4, dim_v=3, seed=1)
    _compare(p, block_size=4, previous_block=previous_block, num_global=num_global, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_longer_sequences_match_oracle(causal):
    # Several blocks per sequence, a partial last block, global rows spanning two blocks.
    p = make_problem([37, 64, 5], heads=2, dim=4, seed=6)
    _compare(p, block_size=8, previous_block=True, num_global=10, causal=causal)


def test_reference_work_is_linear_in_length():
    # The reference's tiles cover O(L) (query, key) pairs under a block mask.
    length, bs, glob = 4096, 64, 4
    spec = AttentionSpec(
        scale=1.0,
        max_seqlen_q=length,
        max_seqlen_kv=length,
        mask=MaskSpec(block_size=bs, block_previous=True, contextual_len=glob),
    )
    offsets = torch.tensor([0, length])
    pairs = reference._pairs(offsets, offsets, None, None)
    area = sum(t[2] * t[5] for t in reference._tiles(pairs, spec))
    assert area <= length * (2 * bs + glob) + glob * length
    covered = sum(t[2] for t in reference._tiles(pairs, spec))
    assert covered == length  # every query row in exactly one tile


def test_equals_jagged_attention_over_the_blocks():
    # Cutting each sequence into blocks and running plain jagged attention on the blocks
    # as sequences is the definition of the basic variant.
    lengths, bs = [10, 3, 0, 8], 4
    p = make_problem(lengths, heads=2, dim=8, seed=2)
    q, k, v = p.leaves()
    out = block_attention(q, k, v, p.q_offsets_t, 10, block_size=bs)
    blocks = [min(bs, n - s) for n in lengths for s in range(0, n, bs)]
    ref = jagged_attention(q, k, v, torch.tensor(offsets_of(blocks)), bs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_one_block_covering_everything_is_full_attention():
    p = make_problem([5, 7], seed=3)
    a = block_attention(p.q, p.k, p.v, p.q_offsets_t, 7, block_size=7, causal=True)
    b = jagged_attention(p.q, p.k, p.v, p.q_offsets_t, 7, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck():
    p = make_problem([5, 2], heads=1, dim=2, dim_v=2, seed=4)

    def fn(q, k, v):
        return block_attention(
            q, k, v, p.q_offsets_t, 5, block_size=2, previous_block=True, num_global=1
        )

    assert torch.autograd.gradcheck(fn, p.leaves())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_follows_the_accuracy_rule(dtype):
    p = make_problem([70, 3, 0, 64], heads=2, dim=32, dtype=dtype, seed=5)
    q, k, v = p.leaves()
    out = block_attention(q, k, v, p.q_offsets_t, 70, block_size=16, previous_block=True)
    call = Call(mask=Mask(block=16, previous=True))
    exact = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call)
    same = oracle_attention(q, k, v, p.q_offsets, p.kv_offsets, call, dtype=dtype)
    assert_close_to_reference(out, same, exact, name="out")
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    for name, a, r, e in zip(
        "qkv", grads(out, (q, k, v), g), grads(same, (q, k, v), g), grads(exact, (q, k, v), g)
    ):
        assert_close_to_reference(a, r, e, name=f"d{name}")


@settings(deadline=None, max_examples=100)
@given(
    lengths=st.lists(st.integers(0, 13), min_size=0, max_size=4),
    block_size=st.integers(1, 5),
    previous_block=st.booleans(),
    num_global=st.integers(0, 3),
    causal=st.booleans(),
    heads=st.integers(1, 2),
    dim=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_sweep(
    lengths, block_size, previous_block, num_global, causal, heads, dim, seed
):
    p = make_problem(lengths, heads=heads, dim=dim, seed=seed)
    _compare(
        p,
        block_size=block_size,
        previous_block=previous_block,
        num_global=num_global,
        causal=causal,
    )
