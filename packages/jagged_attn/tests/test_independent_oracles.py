"""The reference and the Triton kernels against two oracles written from other projects'
published semantics (see ``flash_attn_oracle.py`` and ``hstu_oracle.py``): flash-attn's
padded ``attention_ref`` (causal and sliding windows with bottom-right alignment) and
generative-recommenders' pure-PyTorch HSTU attention (SiLU / N, targets, contextual
tokens, ``max_attn_len``; the cached "delta" variant, whose queries are shorter than its
keys). Jagged batches are padded for the oracles and unpadded again in the tests.

* The reference (``backend="torch"``, float64) must equal each oracle to float64 rounding,
  output and gradients.
* The kernels (``backend="triton"``, bf16; the interpreter on the CPU) must meet the
  accuracy rule of DESIGN.md against the oracle in float64, with the oracle computed in
  bf16 as the same-dtype baseline.

The oracles' conventions differ from hyperrec's in two documented places (HSTU windows its
contextual keys, and its non-causal mask lets history see targets), so those combinations
are not compared here; ``test_masks.py`` pins the difference.
"""

from __future__ import annotations

import math

import pytest
import torch
from flash_attn_oracle import varlen_attention_ref
from hstu_oracle import cached_hstu_mha_ref, hstu_mha_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from jagged_oracle import offsets_of, rand

from hyperrec.jagged_attn import gdpa, jagged_attention
from hyperrec.jagged_attn._triton import supports
from hyperrec.testing import assert_close_to_reference, poison_like

TRITON = supports("cpu") or supports("cuda")
DEVICE = "cpu" if supports("cpu") or not torch.cuda.is_available() else "cuda"
needs_kernels = pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

# (query lengths, key lengths): every relation, empty sequences, lengths across tiles.
BATCHES = {
    "lq<lk": ([5, 0, 19, 1, 0], [37, 3, 40, 17, 0]),
    "lq=lk": ([26, 0, 5, 37, 1], [26, 0, 5, 37, 1]),
    "lq>lk": ([37, 3, 40, 17, 9], [5, 0, 19, 1, 0]),
}
# (causal, window_size): flash-attn's mask family.
FA_MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "sliding": (True, (6, -1)),
    "left": (False, (6, -1)),
    "right": (False, (-1, 5)),
    "both": (False, (4, 7)),
}


@pytest.fixture
def poisoned(monkeypatch):
    """Allocations start as NaN, so an output element the kernels never write shows up."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_like(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_like(empty_like(*a, **k)))


def _leaves(*tensors: torch.Tensor, dtype: torch.dtype, device: str = "cpu"):
    return [t.to(device=device, dtype=dtype).detach().requires_grad_() for t in tensors]


def _grads(out: torch.Tensor, leaves, grad_out: torch.Tensor):
    return torch.autograd.grad(
        out, leaves, grad_out.to(out), allow_unused=True, materialize_grads=True
    )


def _inputs(q_lens, kv_lens, *, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = rand(sum(q_lens), heads, dim, gen=g)
    k = rand(sum(kv_lens), heads, dim, gen=g)
    v = rand(sum(kv_lens), heads, dim, gen=g)
    do = rand(sum(q_lens), heads, dim, gen=g)
    # The kernels see bf16 values: give every path the same (bf16-representable) inputs.
    return tuple(t.to(torch.bfloat16).double() for t in (q, k, v, do))


def _against(oracle, ours, inputs, grad_out, *, low: torch.dtype | None):
    """``oracle(dtype, leaves)`` and ``ours(leaves)``: compare outputs and gradients.

    ``low=None``: ours runs in float64 and must match to float64 rounding. Otherwise ours
    runs in ``low`` and must meet the accuracy rule against the float64 oracle, with the
    oracle in ``low`` as the baseline.
    """
    exact_leaves = _leaves(*inputs, dtype=torch.float64)
    exact = oracle(torch.float64, exact_leaves)
    exact_grads = _grads(exact, exact_leaves, grad_out)
    if low is None:
        our_leaves = _leaves(*inputs, dtype=torch.float64)
        got = ours(our_leaves)
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-10)
        for name, a, b in zip(("dq", "dk", "dv"), _grads(got, our_leaves, grad_out), exact_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=name)
        return
    base_leaves = _leaves(*inputs, dtype=low)
    base = oracle(low, base_leaves)
    base_grads = _grads(base, base_leaves, grad_out)
    our_leaves = _leaves(*inputs, dtype=low, device=DEVICE)
    got = ours(our_leaves)
    assert_close_to_reference(got, base, exact, atol=1e-3, name="out")
    got_grads = _grads(got, our_leaves, grad_out.to(DEVICE))
    for name, a, b, e in zip(("dq", "dk", "dv"), got_grads, base_grads, exact_grads):
        assert_close_to_reference(a, b, e, atol=1e-3, name=name)


# ----------------------------------------------------------------------------------------
# flash-attn's attention_ref
# ----------------------------------------------------------------------------------------


def _fa_case(q_lens, kv_lens, causal, window, *, backend, low, seed=0):
    q, k, v, do = _inputs(q_lens, kv_lens, seed=seed)
    qo, ko = offsets_of(q_lens), offsets_of(kv_lens)

    def oracle(dtype, leaves):
        return varlen_attention_ref(
            *leaves, qo, ko, causal=causal, window_size=window, upcast=dtype == torch.float64
        )

    def ours(leaves):
        dev = leaves[0].device
        return jagged_attention(
            *leaves,
            torch.tensor(qo, device=dev),
            max(q_lens, default=0),
            kv_offsets=torch.tensor(ko, device=dev, dtype=torch.int32),
            max_seqlen_kv=max(kv_lens, default=0),
            causal=causal,
            window_size=window,
            backend=backend,
        )

    _against(oracle, ours, (q, k, v), do, low=low)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mask", list(FA_MASKS))
def test_reference_equals_flash_attn_ref(mask, batch):
    _fa_case(*BATCHES[batch], *FA_MASKS[mask], backend="torch", low=None)


@needs_kernels
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mask", ["causal", "sliding", "right", "both"])
def test_kernels_against_flash_attn_ref(mask, batch):
    _fa_case(*BATCHES[batch], *FA_MASKS[mask], backend="triton", low=torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mask", ["causal", "sliding", "both"])
def test_fp8_forward_gradients_against_flash_attn_ref(mask, batch):
    """``precision="fp8"`` (FP8 forward, default bf16 backward) on inputs with outlier
    channels: the gradients must meet the bf16 accuracy rule against the oracle (the
    backward recomputes its softmax statistics; before 0.2.4 it read the FP8 forward's
    and dQ fell to 9 dB on such inputs), the output an FP8 bound (>= 20 dB)."""
    q_lens, kv_lens = BATCHES[batch]
    causal, window = FA_MASKS[mask]
    q, k, v, do = _inputs(q_lens, kv_lens, seed=3)
    # two head-dim channels 20x larger in Q and K, as in trained models
    q, k = q.clone(), k.clone()
    q[..., :2] *= 20
    k[..., :2] *= 20
    # (scaled before rounding: every path must see the same bf16-representable values)
    q, k = ((t / 3).to(torch.bfloat16).double() for t in (q, k))
    qo, ko = offsets_of(q_lens), offsets_of(kv_lens)
    exact_leaves = _leaves(q, k, v, dtype=torch.float64)
    exact = varlen_attention_ref(*exact_leaves, qo, ko, causal=causal, window_size=window,
                                 upcast=True)  # fmt: skip
    exact_grads = _grads(exact, exact_leaves, do)
    base_leaves = _leaves(q, k, v, dtype=torch.bfloat16)
    base = varlen_attention_ref(*base_leaves, qo, ko, causal=causal, window_size=window,
                                upcast=False)  # fmt: skip
    base_grads = _grads(base, base_leaves, do)
    leaves = _leaves(q, k, v, dtype=torch.bfloat16, device=DEVICE)
    got = jagged_attention(
        *leaves, torch.tensor(qo, device=DEVICE), max(q_lens),
        kv_offsets=torch.tensor(ko, device=DEVICE), max_seqlen_kv=max(kv_lens), causal=causal,
        window_size=window, backend="triton", precision="fp8",
    )  # fmt: skip
    err = (got.double().cpu() - exact).norm() / exact.norm().clamp_min(1e-30)
    assert err <= 0.1, f"FP8 output relative error {err:.3f} (> -20 dB)"
    for name, a, b, e in zip(("dq", "dk", "dv"), _grads(got, leaves, do.to(DEVICE)),
                             base_grads, exact_grads):  # fmt: skip
        assert_close_to_reference(a, b, e, atol=1e-3, name=name)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    q_lens=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    causal=st.booleans(),
    left=st.sampled_from([-1, 0, 1, 4]),
    right=st.sampled_from([-1, 0, 1, 4]),
)
def test_reference_equals_flash_attn_ref_hypothesis(data, q_lens, causal, left, right):
    kv_lens = data.draw(st.lists(st.integers(0, 12), min_size=len(q_lens), max_size=len(q_lens)))
    _fa_case(q_lens, kv_lens, causal, (left, right), backend="torch", low=None, seed=len(q_lens))


# ----------------------------------------------------------------------------------------
# generative-recommenders' HSTU (self-attention and the cached "delta" queries)
# ----------------------------------------------------------------------------------------

ALPHA = 0.4
# (num_targets, max_attn_len, contextual_seq_len); contextual + max_attn_len differ by
# design (HSTU windows contextual keys), so they are not combined.
HSTU_MASKS = {
    "causal": (None, 0, 0),
    "targets": ([2, 0, 3, 1, 0], 0, 0),
    "contextual": (None, 0, 3),
    "targets_contextual": ([2, 0, 3, 1, 0], 0, 2),
    "targets_window": ([2, 0, 3, 1, 0], 5, 0),
}


def _hstu_gdpa(leaves, qo, ko, max_q, n, targets, window, ctx, backend):
    dev = leaves[0].device
    return gdpa(
        *leaves,
        torch.tensor(qo, device=dev),
        torch.tensor(ko, device=dev),
        max_q,
        n,
        activation="silu",
        scale=ALPHA,
        normalization="max_seqlen",
        causal=True,
        window_size=(window if window > 0 else -1, -1),
        num_targets=None if targets is None else torch.tensor(targets, device=dev),
        contextual_len=ctx,
        backend=backend,
    )


def _hstu_case(lens, targets, window, ctx, *, backend, low, n=None):
    n = max(lens) + 3 if n is None else n  # HSTU's N is the batch cap, not the longest
    q, k, v, do = _inputs(lens, lens, seed=1)
    offs = offsets_of(lens)

    def oracle(dtype, leaves):
        return hstu_mha_ref(
            n, ALPHA, *leaves, offs, num_targets=targets, max_attn_len=window,
            contextual_seq_len=ctx, dtype=dtype,
        )  # fmt: skip

    def ours(leaves):
        return _hstu_gdpa(leaves, offs, offs, n, n, targets, window, ctx, backend)

    _against(oracle, ours, (q, k, v), do, low=low)


def _cached_case(lens, delta, targets, window, ctx, *, backend, low):
    n = max(lens) + 2
    batch = len(lens)
    q, k, v, do = _inputs([delta] * batch, lens, seed=2)
    qo, ko = offsets_of([delta] * batch), offsets_of(lens)

    def oracle(dtype, leaves):
        return cached_hstu_mha_ref(
            n, ALPHA, *leaves, ko, num_targets=targets, max_attn_len=window,
            contextual_seq_len=ctx, dtype=dtype,
        )  # fmt: skip

    def ours(leaves):
        return _hstu_gdpa(leaves, qo, ko, delta, n, targets, window, ctx, backend)

    _against(oracle, ours, (q, k, v), do, low=low)


HSTU_LENS = [26, 3, 37, 9, 20]  # >= 3 each: every delta of 3 fits


@pytest.mark.parametrize("mask", list(HSTU_MASKS))
def test_reference_equals_hstu(mask):
    _hstu_case(HSTU_LENS, *HSTU_MASKS[mask], backend="torch", low=None)


@pytest.mark.parametrize("mask", list(HSTU_MASKS))
@pytest.mark.parametrize("delta", [1, 3])
def test_reference_equals_cached_hstu(mask, delta):
    _cached_case(HSTU_LENS, delta, *HSTU_MASKS[mask], backend="torch", low=None)


@needs_kernels
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("mask", ["targets_contextual", "targets_window"])
def test_kernels_against_hstu(mask):
    _hstu_case(HSTU_LENS, *HSTU_MASKS[mask], backend="triton", low=torch.bfloat16)


@needs_kernels
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("mask", ["targets", "targets_window", "contextual"])
def test_kernels_against_cached_hstu(mask):
    # Delta queries with targets: the case whose dK/dV the kernels used to drop.
    _cached_case(HSTU_LENS, 3, *HSTU_MASKS[mask], backend="triton", low=torch.bfloat16)


def test_oracles_are_not_trivially_equal():
    # The oracles must see the masks: dropping the window or the targets changes them.
    lens = [9, 6]
    q, k, v, _ = _inputs(lens, lens)
    offs = offsets_of(lens)
    a = varlen_attention_ref(q, k, v, offs, offs, causal=True, window_size=(2, -1))
    b = varlen_attention_ref(q, k, v, offs, offs, causal=True)
    assert not torch.allclose(a, b)
    c = hstu_mha_ref(10, ALPHA, q, k, v, offs, num_targets=[2, 1])
    d = hstu_mha_ref(10, ALPHA, q, k, v, offs)
    assert not torch.allclose(c, d)
    assert math.isfinite(float(a.abs().sum() + c.abs().sum()))
