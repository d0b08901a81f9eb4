"""Every mask x every query/key length relation x jagged batches, through the kernels.

The kernels pick which tiles to visit from the mask (``_kv_range`` for a query tile,
``_q_range`` for a key tile in the dK/dV pass); a range that is too narrow silently drops
contributions. The matrix here runs each mask the public API can express with key lengths
shorter than, equal to and longer than the query lengths (bottom-right alignment puts the
queries at different key positions in each case), in batches whose lengths differ per
sequence and include empty sequences, forward and backward (out, dq, dk, dv), against the
float64 reference under the accuracy rule of DESIGN.md; a hypothesis sweep draws lengths,
masks and tiles at random. Both dQ paths (the dQ kernel and the atomic adds of the dK/dV
kernel) are covered, alternating over the matrix.

Under ``TRITON_INTERPRET=1`` at small shapes (one head of dim 16, lengths <= 40) this takes
about a second per case.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_check import (
    DKDV,
    DQ,
    SMALL,
    Case,
    assert_close_to_reference,
    baseline,
    build,
    call_of,
    check,
    kernels_available,
    poison_allocations,
    run_forward,
)

from hyperrec.jagged_attn import reference
from hyperrec.jagged_attn._triton import KernelConfig, attention_backward

pytest.importorskip("triton")
if not kernels_available():
    pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

pytestmark = pytest.mark.usefixtures(poison_allocations.__name__)

# (query lengths, key lengths) per relation; each batch mixes lengths shorter than, equal to
# and longer than one 16/32-row tile, has empty sequences (an empty query sequence, an empty
# key sequence, both), and differs from sequence to sequence by more than a tile, so that a
# range error of a whole tile shows up.
REGIMES = {
    "lq<lk": ((5, 0, 19, 1, 0, 12), (37, 3, 40, 17, 0, 13)),
    "lq=lk": ((26, 0, 5, 37, 1, 16), (26, 0, 5, 37, 1, 16)),
    "lq>lk": ((37, 3, 40, 17, 9, 13), (5, 0, 19, 1, 0, 12)),
}
TARGETS = (3, 1, 4, 2, 0, 5)  # clipped to each key length

# Mask -> (MaskSpec fields, with HSTU targets). Everything jagged_attention and gdpa accept:
# causal, left/right windows (gdpa's and flash-attn's window_size), HSTU targets and
# contextual tokens (gdpa), and their combinations.
MASKS = {
    "none": (dict(), False),
    "causal": (dict(causal=True), False),
    "window_left": (dict(window_left=6), False),
    "sliding_window": (dict(causal=True, window_left=6), False),
    "window_right": (dict(window_right=5), False),
    "window_both": (dict(window_left=4, window_right=7), False),
    "causal_right0": (dict(causal=True, window_left=9, window_right=0), False),
    "targets": (dict(), True),
    "hstu_targets": (dict(causal=True), True),
    "hstu_contextual": (dict(causal=True, contextual_len=3), False),
    "hstu_all": (dict(causal=True, contextual_len=2, window_left=8), True),
    "window_targets": (dict(window_left=5, window_right=2), True),
    "contextual_window": (dict(contextual_len=2, window_left=4, window_right=3), False),
}
# block_attention is self-attention only: block masks run with equal lengths.
BLOCK_MASKS = {
    "block": dict(block_size=8),
    "block_prev_global_causal": dict(
        block_size=8, block_previous=True, contextual_len=2, causal=True
    ),
}

DKDV_ATOMIC = replace(DKDV, dq_atomic=True)


def _case(regime: str, mask: dict, targets: bool, activation: str) -> Case:
    q_lens, kv_lens = REGIMES[regime]
    spec = dict(activation=activation)
    if activation != "softmax":
        spec["normalization"] = "max_seqlen"  # HSTU's 1/N
    return Case(
        q_lens,
        kv_lens=None if regime == "lq=lk" else kv_lens,
        targets=tuple(min(t, n) for t, n in zip(TARGETS, kv_lens)) if targets else None,
        heads=1,
        head_dim=16,
        spec=spec,
        mask=mask,
    )


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_x_lengths(name, regime):
    mask, targets = MASKS[name]
    # Softmax where flash-attn has the mask, SiLU (HSTU) where targets/contextual tokens
    # come from; both dQ paths alternate over the matrix.
    index = list(MASKS).index(name) + list(REGIMES).index(regime)
    activation = "silu" if targets or mask.get("contextual_len") else "softmax"
    dkdv = DKDV_ATOMIC if index % 2 else DKDV
    check(_case(regime, mask, targets, activation), configs=(SMALL, dkdv, DQ))


@pytest.mark.parametrize("name", list(MASKS) + list(BLOCK_MASKS))
def test_backward_recomputing_softmax_statistics(name):
    """``attention_backward(..., recompute_stats=True)`` (what runs after the FP8 forward)
    over every mask, the length relation rotating: the dQ kernel's first pass recomputes
    the log-sum-exp and ``delta`` for every row the dK/dV kernel reads. ``out`` and ``lse``
    are passed as NaN: a row left unwritten, or a read of them, shows up as NaN. Against
    the exact float64 gradients (``delta`` is computed from P and dP in float32 here, so
    there is no stored-output rounding term)."""
    regimes = list(REGIMES)
    block = name in BLOCK_MASKS
    regime = "lq=lk" if block else regimes[list(MASKS).index(name) % 3]
    mask, targets = (BLOCK_MASKS[name], False) if block else MASKS[name]
    case = _case(regime, mask, targets, "softmax")
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 7)
    out, lse = run_forward(q, k, v, qo, ko, kvi, nt, spec, config=SMALL)
    call = call_of(q, k, v, qo, ko, kvi, nt, spec)
    got = attention_backward(do, torch.full_like(out, float("nan")),
                             torch.full_like(lse, float("nan")), call, config_dkdv=DKDV_ATOMIC,
                             config_dq=DQ, recompute_stats=True)  # fmt: skip
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base = baseline(*leaves, qo, ko, kvi, nt, spec)
    base_grads = torch.autograd.grad(base, leaves, do, allow_unused=True)
    exact = reference.attention_backward(do.double(), q.double(), k.double(), v.double(), qo,
                                         ko, spec, kv_index=kvi, num_targets=nt)  # fmt: skip
    for label, g, b, e in zip(("dq", "dk", "dv"), got, base_grads, exact):
        b = torch.zeros_like(e) if b is None else b
        assert_close_to_reference(g, b, e, name=label)


@pytest.mark.parametrize("name", list(BLOCK_MASKS))
def test_block_masks(name):
    check(_case("lq=lk", BLOCK_MASKS[name], False, "softmax"))


@pytest.mark.parametrize("regime", ["lq<lk", "lq>lk"])
def test_other_activation_per_relation(regime):
    # The masks above alternate softmax / SiLU by mask; here the other one on the two masks
    # whose ranges moved in the fix (window and targets), in both unequal relations.
    check(_case(regime, dict(causal=True, window_left=6), False, "silu"))
    check(_case(regime, dict(causal=True), True, "softmax"), configs=(SMALL, DKDV_ATOMIC, DQ))


def _lengths(max_len: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, max_len), min_size=1, max_size=4)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    q_lens=_lengths(40),
    causal=st.booleans(),
    left=st.sampled_from([-1, 0, 3, 11]),
    right=st.sampled_from([-1, 0, 2, 9]),
    contextual=st.sampled_from([0, 0, 2]),
    with_targets=st.booleans(),
    activation=st.sampled_from(["softmax", "silu"]),
    tiles=st.sampled_from([(16, 16, 16, 32), (32, 16, 16, 16), (16, 32, 32, 16)]),
    dq_atomic=st.booleans(),
    bwd_tma=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_lengths_and_masks(
    data, q_lens, causal, left, right, contextual, with_targets, activation, tiles, dq_atomic,
    bwd_tma, seed,
):  # fmt: skip
    kv_lens = data.draw(st.lists(st.integers(0, 40), min_size=len(q_lens), max_size=len(q_lens)))
    targets = None
    if with_targets:
        targets = tuple(data.draw(st.integers(0, min(n, 6))) for n in kv_lens)
    spec = dict(activation=activation)
    if activation != "softmax":
        spec["normalization"] = "max_seqlen"
    case = Case(
        tuple(q_lens),
        kv_lens=tuple(kv_lens),
        targets=targets,
        heads=1,
        head_dim=16,
        spec=spec,
        mask=dict(causal=causal, window_left=left, window_right=right, contextual_len=contextual),
    )
    fm, fn, bm, bn = tiles
    configs = (
        KernelConfig(block_m=fm, block_n=fn, num_stages=1),
        KernelConfig(block_m=bm, block_n=bn, num_stages=1, dq_atomic=dq_atomic, bwd_tma=bwd_tma),
        KernelConfig(block_m=fn, block_n=fm, num_stages=1, bwd_tma=bwd_tma),
    )
    check(case, seed=seed, configs=configs)


def _gpu_lengths(n: int, max_len: int, seed: int) -> tuple[int, ...]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (n,), generator=g)
    lens[0], lens[1] = max_len, 0
    return tuple(lens.tolist())


# On the GPU every mask variant is a compilation of three kernels: the masks whose ranges
# differ most (the interpreter runs all of them).
GPU_MASKS = ["causal", "sliding_window", "window_right", "hstu_targets", "hstu_all",
             "window_targets"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("name", GPU_MASKS)
def test_gpu_mask_x_lengths_shipped_configs(name, regime):
    # The shipped (tuned) tiles at realistic lengths: 128-row tiles, TMA forward, D = 128.
    mask, targets = MASKS[name]
    short, long = _gpu_lengths(24, 300, 1), _gpu_lengths(24, 900, 2)
    q_lens, kv_lens = {"lq<lk": (short, long), "lq=lk": (long, long), "lq>lk": (long, short)}[
        regime
    ]
    activation = "silu" if targets or mask.get("contextual_len") else "softmax"
    spec = dict(activation=activation)
    if activation != "softmax":
        spec["normalization"] = "max_seqlen"
    case = Case(
        q_lens,
        kv_lens=kv_lens,
        targets=tuple(min(20, n) for n in kv_lens) if targets else None,
        heads=2,
        head_dim=128,
        spec=spec,
        mask=mask,
    )
    check(case, configs=(None, None, None), atol=1e-4)
