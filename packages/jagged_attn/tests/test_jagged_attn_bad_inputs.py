"""Bad-input catalogue of hyperrec.jagged_attn: one line per case, plus fuzzing.

CPU tensors only: the value checks on the CPU raise ``ValueError`` (CUDA inputs take a
sync-free path). Each case names the exception type and a substring of the message that
names the argument as the caller spelled it; every type must also be listed in the
``Raises:`` section of the public function's docstring.
"""

from __future__ import annotations

import math
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.jagged_attn import (
    AttentionSpec,
    MaskSpec,
    block_attention,
    gdpa,
    gelu_poly,
    jagged_attention,
    mask_matrix,
)
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
nan, inf = math.nan, math.inf
H, D = 2, 8
Q = torch.randn(6, H, D)
K = torch.randn(6, H, D)
VV = torch.randn(6, H, 4)
OFF = torch.tensor([0, 2, 6])
K9, V9 = torch.randn(9, H, D), torch.randn(9, H, 4)
KVO = torch.tensor([0, 4, 9])
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype API
    NESTED = torch.nested.nested_tensor([torch.randn(2, H, D)])
JA = dict(backend="torch")
G = dict(backend="torch")


def ja(**kw):
    """jagged_attention on the good inputs with ``kw`` replaced."""
    args = dict(q=Q, k=K, v=VV, offsets=OFF, max_seqlen=4, **JA)
    args.update(kw)
    return case_args(jagged_attention, args)


def gd(**kw):
    args = dict(
        q=Q, k=K9, v=V9, q_offsets=OFF, kv_offsets=KVO, max_seqlen_q=4, max_seqlen_kv=5, **G
    )
    args.update(kw)
    return case_args(gdpa, args)


def ba(**kw):
    args = dict(q=Q, k=K, v=VV, offsets=OFF, max_seqlen=4, block_size=2, backend="torch")
    args.update(kw)
    return case_args(block_attention, args)


def case_args(fn, args):
    return fn, args


def c(exc, match, built, **extra):
    fn, args = built
    return case(exc, match, fn, **args, **extra)


CASES = [
    # jagged_attention: tensors
    c(T, "q", ja(q=[[1.0]])),
    c(T, "q", ja(q=Q.int())),
    c(T, "k", ja(k=K.to(torch.complex64))),
    c(T, "q, k and v must share one dtype", ja(k=K.double())),
    c(V, "q", ja(q=Q[0])),
    c(V, "k", ja(k=K[None])),
    c(V, "same number of heads", ja(k=torch.randn(6, 3, D))),
    c(V, "k head_dim", ja(k=torch.randn(6, H, D + 1))),
    c(V, "v.shape[0]", ja(v=torch.randn(5, H, 4))),
    c(V, "v head_dim", ja(v=torch.randn(6, H, 0))),
    c(
        V,
        "q must have heads >= 1",
        ja(q=torch.randn(6, 0, D), k=torch.randn(6, 0, D), v=torch.randn(6, 0, 4)),
    ),
    c(V, "k.shape[0]", ja(k=torch.randn(5, H, D), v=torch.randn(5, H, 4))),
    c(T, "q", ja(q=NESTED)),
    # jagged_attention: offsets
    c(T, "offsets", ja(offsets=[0, 2, 6])),
    c(T, "offsets", ja(offsets=OFF.float())),
    c(V, "offsets", ja(offsets=OFF[None])),
    c(V, "offsets", ja(offsets=torch.tensor([], dtype=torch.int64))),
    c(V, "offsets[0]", ja(offsets=torch.tensor([1, 2, 6]))),
    c(V, "offsets[-1]", ja(offsets=torch.tensor([0, 2, 5]))),
    c(V, "offsets must be non-decreasing", ja(offsets=torch.tensor([0, 4, 2, 6]))),
    c(V, "max_seqlen=3", ja(max_seqlen=3)),
    c(V, "max_seqlen", ja(max_seqlen=-1)),
    c(T, "max_seqlen", ja(max_seqlen=4.0)),
    c(T, "max_seqlen", ja(max_seqlen=True)),
    # jagged_attention: kv_offsets and options
    c(V, "max_seqlen_kv is required", ja(k=K9, v=V9, kv_offsets=KVO)),
    c(V, "max_seqlen_kv is only meaningful", ja(max_seqlen_kv=4)),
    c(V, "kv_offsets", ja(k=K9, v=V9, kv_offsets=torch.tensor([0, 9]), max_seqlen_kv=9)),
    c(V, "kv_offsets[-1]", ja(k=K9, v=V9, kv_offsets=torch.tensor([0, 4, 8]), max_seqlen_kv=5)),
    c(V, "max_seqlen_kv=4", ja(k=K9, v=V9, kv_offsets=KVO, max_seqlen_kv=4)),
    c(T, "kv_offsets", ja(k=K9, v=V9, kv_offsets=KVO.tolist(), max_seqlen_kv=5)),
    c(T, "causal", ja(causal=1)),
    c(T, "scale", ja(scale="0.1")),
    c(V, "scale", ja(scale=nan)),
    c(V, "scale", ja(scale=inf)),
    c(T, "window_size", ja(window_size=3)),
    c(T, "window_size", ja(window_size=(1, 2, 3))),
    c(V, "window_size[0]", ja(window_size=(-2, 0))),
    c(T, "window_size[1]", ja(window_size=(0, 1.5))),
    c(T, "backend", ja(backend=None)),
    c(V, "backend", ja(backend="cuda")),
    c(V, "validate", ja(validate="yes")),
    c(T, "validate", ja(validate=1)),
    # gdpa
    c(T, "q_offsets", gd(q_offsets=[0, 2, 6])),
    c(V, "q_offsets[0]", gd(q_offsets=torch.tensor([2, 2, 6]))),
    c(V, "q_offsets[-1]", gd(q_offsets=torch.tensor([0, 2, 7]))),
    c(V, "kv_offsets", gd(kv_offsets=torch.tensor([0, 9]))),
    c(
        V,
        "kv_offsets must be non-decreasing",
        gd(kv_offsets=torch.tensor([0, 5, 4, 9]), kv_index=torch.tensor([0, 1])),
    ),
    c(V, "max_seqlen_q", gd(max_seqlen_q=3)),
    c(V, "max_seqlen_kv", gd(max_seqlen_kv=4)),
    c(T, "max_seqlen_kv", gd(max_seqlen_kv=5.0)),
    c(T, "activation", gd(activation=None)),
    c(V, "activation", gd(activation="tanh")),
    c(V, "normalization", gd(normalization="l2")),
    c(T, "normalization", gd(normalization=1)),
    c(V, "output_scale", gd(output_scale=nan)),
    c(T, "output_scale", gd(output_scale="1")),
    c(V, "scale", gd(scale=-inf)),
    c(V, "kv_index", gd(kv_index=torch.tensor([0, 2]))),
    c(V, "kv_index", gd(kv_index=torch.tensor([-1, 0]))),
    c(V, "kv_index", gd(kv_index=torch.tensor([0]))),
    c(T, "kv_index", gd(kv_index=torch.tensor([0.0, 1.0]))),
    c(V, "num_targets", gd(num_targets=torch.tensor([1]))),
    c(V, "num_targets", gd(num_targets=torch.tensor([-1, 0]))),
    c(V, "num_targets", gd(num_targets=torch.tensor([5, 0]))),
    c(T, "num_targets", gd(num_targets=[1, 1])),
    c(V, "contextual_len", gd(contextual_len=-1)),
    c(T, "contextual_len", gd(contextual_len=1.0)),
    c(T, "causal", gd(causal="true")),
    c(V, "window_size[1]", gd(window_size=(0, -3))),
    c(V, "backend", gd(backend="tpu")),
    # block_attention
    c(V, "block_size", ba(block_size=0)),
    c(T, "block_size", ba(block_size=2.0)),
    c(V, "num_global", ba(num_global=-1)),
    c(T, "previous_block", ba(previous_block=None)),
    c(V, "k.shape[0]", ba(k=K9, v=V9)),
    c(V, "offsets[-1]", ba(offsets=torch.tensor([0, 2, 5]))),
    c(V, "max_seqlen=3", ba(max_seqlen=3)),
    c(V, "scale", ba(scale=nan)),
    # configs and helpers
    case(T, "causal", MaskSpec, causal=1),
    case(V, "window_left", MaskSpec, window_left=-2),
    case(V, "block_previous", MaskSpec, block_previous=True),
    case(V, "block_size", MaskSpec, block_size=-1),
    case(V, "contextual_len", MaskSpec, contextual_len=-1),
    case(V, "num_targets", mask_matrix, 3, 2, MaskSpec(), num_targets=3),
    case(V, "q_len", mask_matrix, -1, 2, MaskSpec()),
    case(T, "spec", mask_matrix, 3, 2, "causal"),
    case(T, "mask", AttentionSpec, scale=1.0, max_seqlen_q=1, max_seqlen_kv=1, mask="causal"),
    case(
        V, "activation", AttentionSpec, scale=1.0, max_seqlen_q=1, max_seqlen_kv=1, activation="x"
    ),
    case(V, "scale", AttentionSpec, scale=nan, max_seqlen_q=1, max_seqlen_kv=1),
    case(T, "x", gelu_poly, [1.0]),
]


# Findings reported by the catalogue's first run, fixed since (kept empty so a new gap can
# be recorded as a strict xfail that turns into a failure once fixed).
BEHAVIOUR_GAPS: dict[str, str] = {}
DOC_GAPS: dict[str, str] = {}


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES, behaviour_gaps=BEHAVIOUR_GAPS, doc_gaps=DOC_GAPS
)


def test_catalogue_size():
    assert len(CASES) >= 80


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_offsets(offsets, total):
    return (
        len(offsets) >= 1
        and offsets[0] == 0
        and offsets[-1] == total
        and all(b >= a for a, b in zip(offsets, offsets[1:]))
    )


@_FUZZ
@given(
    offsets=st.lists(st.integers(-2, 8), max_size=5),
    total=st.integers(0, 8),
    max_seqlen=st.integers(-1, 9),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int32]),
    odtype=st.sampled_from([torch.int64, torch.int32, torch.float32]),
)
def test_fuzz_jagged_attention_offsets(offsets, total, max_seqlen, dtype, odtype):
    q = torch.ones(total, 1, 4, dtype=dtype)
    off = torch.tensor(offsets, dtype=odtype)
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    good = (
        dtype.is_floating_point
        and odtype != torch.float32
        and _valid_offsets(offsets, total)
        and max_seqlen >= max(lengths, default=0)
        and max_seqlen >= 0
    )
    err = rejects_cleanly(jagged_attention, q, q, q, off, max_seqlen, backend="torch")
    assert (err is None) == good, err
    if good:
        out = jagged_attention(q, q, q, off, max_seqlen, backend="torch")
        assert out.shape == q.shape and torch.isfinite(out.float()).all()


@_FUZZ
@given(
    q_lens=st.lists(st.integers(0, 4), max_size=4),
    k_lens=st.lists(st.integers(0, 4), max_size=4),
    index=st.one_of(st.none(), st.lists(st.integers(-1, 4), max_size=4)),
    targets=st.one_of(st.none(), st.lists(st.integers(-1, 5), max_size=4)),
)
def test_fuzz_gdpa_index_and_targets(q_lens, k_lens, index, targets):
    qo = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    ko = torch.tensor([0, *torch.tensor(k_lens, dtype=torch.int64).cumsum(0).tolist()])
    q = torch.randn(int(qo[-1]), 1, 4)
    k = torch.randn(int(ko[-1]), 1, 4)
    bq, bk = len(q_lens), len(k_lens)
    pairs = index if index is not None else list(range(bq))
    good = (
        bq == bk if index is None else len(index) == bq and all(0 <= i < bk for i in index)
    ) and (targets is None or len(targets) == bq)
    if good and targets is not None:
        good = all(0 <= t <= k_lens[m] for t, m in zip(targets, pairs))
    err = rejects_cleanly(
        gdpa,
        q,
        k,
        k,
        qo,
        ko,
        max(q_lens, default=0),
        max(k_lens, default=0),
        kv_index=None if index is None else torch.tensor(index, dtype=torch.int64),
        num_targets=None if targets is None else torch.tensor(targets, dtype=torch.int64),
        causal=True,
        backend="torch",
    )
    assert (err is None) == good, err


@_FUZZ
@given(
    lengths=st.lists(st.integers(0, 7), max_size=4),
    block_size=st.integers(-1, 5),
    num_global=st.integers(-1, 3),
    max_seqlen=st.integers(-1, 8),
    previous_block=st.booleans(),
)
def test_fuzz_block_attention(lengths, block_size, num_global, max_seqlen, previous_block):
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    q = torch.randn(int(offsets[-1]), 1, 4)
    good = (
        block_size >= 1
        and num_global >= 0
        and max_seqlen >= max(lengths, default=0)
        and max_seqlen >= 0
    )
    err = rejects_cleanly(
        block_attention,
        q,
        q,
        q,
        offsets,
        max_seqlen,
        block_size=block_size,
        num_global=num_global,
        previous_block=previous_block,
        backend="torch",
    )
    assert (err is None) == good, err
