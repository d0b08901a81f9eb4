"""The Gluon forward on an sm_90 GPU against a float64 reference (``gpu`` tests).

Gluon has no CPU interpreter: these tests only run on Hopper with the Triton version the
kernel targets (``_gluon.SUPPORTED_TRITON``), and are skipped elsewhere. The CPU suite
checks the host side (``test_gluon_validation.py``) and a model of the kernel's
synchronisation (``test_gluon_protocol.py``).

Rule (FlashAttention's): ``max|out - ref| <= 2 * max|baseline - ref| + 1e-3``, ``ref`` in
float64, ``baseline`` the same math in plain bf16 PyTorch; LSE (base 2) within
``2e-3 * max(1, |ref|)``, ``+inf`` exactly where a row sees no key. Outputs come from a
NaN-poisoned allocator (best effort), so rows the kernel skips are caught.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hyperrec.jagged_attn._gluon import (
    GluonConfig,
    default_config,
    gluon_supported,
    jagged_attention_fwd_gluon,
    unsupported_reason,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not gluon_supported("cuda"):
    pytest.skip(
        f"the Gluon forward needs sm_90 + Triton 3.6: "
        f"{unsupported_reason('cuda') if torch.cuda.is_available() else 'no CUDA'}",
        allow_module_level=True,
    )

DEV = "cuda"


def _offsets(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)


def _reference(q, k, v, qo, ko, causal, scale, act, coef, dtype):
    """(out, lse) in float64 (``dtype=torch.float64``), or the plain-PyTorch baseline in
    ``q.dtype`` (``dtype=q.dtype``: bf16 GEMMs, fp32 softmax)."""
    exact = dtype == torch.float64
    tq, h, d = q.shape
    out = torch.zeros(tq, h, d, dtype=torch.float64, device=DEV)
    lse = torch.full((h, tq), math.inf, dtype=torch.float64, device=DEV)
    for b in range(qo.numel() - 1):
        q0, q1, k0, k1 = int(qo[b]), int(qo[b + 1]), int(ko[b]), int(ko[b + 1])
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qb, kb, vb = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        if exact:
            qb, kb, vb = qb.double(), kb.double(), vb.double()
        s = (qb @ kb.transpose(1, 2)).double() * scale
        i = torch.arange(lq, device=DEV)[:, None]
        j = torch.arange(lk, device=DEV)[None, :]
        ok = (j <= i + lk - lq) if causal else torch.ones(lq, lk, dtype=torch.bool, device=DEV)
        if act == "softmax":
            s = s.masked_fill(~ok, -math.inf)
            row_lse = torch.logsumexp(s, -1) / math.log(2)  # -inf for a row without keys
            lse[:, q0:q1] = torch.where(torch.isneginf(row_lse), math.inf, row_lse)
            w = torch.softmax(s, -1).nan_to_num(0.0)
        else:
            w = F.silu(s) * ok * coef
        if not exact:
            w = w.to(q.dtype)
        out[q0:q1] = (w @ vb).double().transpose(0, 1)
    return out, lse


def _check(lens, kv_lens=None, *, causal, head_dim=128, act="softmax", pingpong=True, seed=0,
           dynamic=True):  # fmt: skip
    kv_lens = lens if kv_lens is None else kv_lens
    torch.manual_seed(seed)
    heads = 4
    q = torch.randn(sum(lens), heads, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(sum(kv_lens), heads, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(sum(kv_lens), heads, head_dim, device=DEV, dtype=torch.bfloat16)
    qo, ko = _offsets(lens), _offsets(kv_lens)
    scale = 1.0 / math.sqrt(head_dim)
    coef = 1.0 / max(max(kv_lens), 1)
    base_cfg = default_config(head_dim)
    cfg = GluonConfig(block_n=base_cfg.block_n, num_stages=base_cfg.num_stages, pingpong=pingpong,
                      dynamic=dynamic)  # fmt: skip
    kw = dict(kv_offsets=ko, max_seqlen_kv=max(kv_lens), causal=causal, scale=scale, config=cfg)
    if act == "silu":
        kw.update(activation="silu", normalization="max_seqlen")
    # poison the caching allocator: the output is likely to land on NaN-filled memory
    junk = torch.full((q.numel(),), float("nan"), dtype=q.dtype, device=DEV)
    del junk
    out, lse = jagged_attention_fwd_gluon(q, k, v, qo, max(lens), **kw)
    ref, ref_lse = _reference(q, k, v, qo, ko, causal, scale, act, coef, torch.float64)
    base, _ = _reference(q, k, v, qo, ko, causal, scale, act, coef, q.dtype)
    base = base.to(q.dtype).double()
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.double() - ref).abs().nan_to_num(math.inf)
    tol = 2 * float((base - ref).abs().max()) + 1e-3
    if err.numel() and float(err.max()) > tol:
        bad = (err > tol).nonzero()[:5].tolist()
        pytest.fail(
            f"max error {float(err.max()):.3g} > {tol:.3g}; first (token, head, dim): {bad}"
        )
    if act == "softmax":
        assert lse.shape == (heads, sum(lens)) and lse.dtype == torch.float32
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        lerr = (lse.double() - ref_lse)[finite].abs()
        ltol = 2e-3 * ref_lse[finite].abs().clamp(min=1.0)
        assert bool((lerr <= ltol).all()), float(lerr.max())
    return out, lse


RAGGED = [0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 1000, 17]


@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_ragged_batch(head_dim, causal, pingpong):
    _check(RAGGED, causal=causal, head_dim=head_dim, pingpong=pingpong)


@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_softmax_schedule_variants_change_no_bit(head_dim, causal, act, monkeypatch):
    """``overlap_pv`` only moves where ptxas waits for the ``P V`` GEMM and the row-max
    tree (``_launch.ROW_MAX_TREE``) only the order of exact maxima: outputs and LSE are
    bit-identical across all four combinations (and within the reference's tolerance)."""
    from hyperrec.jagged_attn._gluon import _launch as gluon_launch

    torch.manual_seed(3)
    q, k, v = (torch.randn(sum(RAGGED), 4, head_dim, device=DEV, dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    qo = _offsets(RAGGED)
    kw = dict(causal=causal)
    if act == "silu":
        kw.update(activation="silu", normalization="max_seqlen")
    runs = []
    for overlap in (True, False):
        for tree in (True, False):
            monkeypatch.setattr(gluon_launch, "ROW_MAX_TREE", tree)
            base = default_config(head_dim)
            cfg = GluonConfig(block_n=base.block_n, num_stages=base.num_stages,
                              overlap_pv=overlap)  # fmt: skip
            runs.append(jagged_attention_fwd_gluon(q, k, v, qo, max(RAGGED), config=cfg, **kw))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0])
        if act == "softmax":
            assert torch.equal(lse, runs[0][1])
    _check(RAGGED, causal=causal, head_dim=head_dim, act=act)


@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_static_snake_schedule(causal, act):
    """``GluonConfig(dynamic=False)``: CTAs take items in snake order, no counter."""
    _check(RAGGED, causal=causal, act=act, dynamic=False)


@pytest.mark.parametrize("causal", [False, True])
def test_dynamic_schedule_many_items_per_cta(causal):
    """Far more items than CTAs, of very different costs: every CTA claims many, the ring
    of item indices wraps many times, and every row is written once (NaN-poisoned
    output, compared in full)."""
    g = torch.Generator().manual_seed(11)
    lens = [int(x) for x in torch.randint(0, 700, (300,), generator=g)]
    lens[5] = 4000
    _check(lens, causal=causal, seed=3)


@pytest.mark.parametrize("causal", [False, True])
def test_random_lengths_with_empty_sequences(causal):
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 700, (32,), generator=g).tolist()
    lens[2] = lens[20] = 0
    _check(lens, causal=causal, seed=1)


@pytest.mark.parametrize("causal", [False, True])
def test_query_and_key_lengths_differ(causal):
    # bottom-right causal; Lq > Lk leaves the first Lq - Lk queries without keys
    _check([100, 300, 0, 64, 200, 5], [300, 100, 50, 0, 333, 1], causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_many_tiny_and_one_long(causal):
    g = torch.Generator().manual_seed(3)
    _check(torch.randint(0, 21, (300,), generator=g).tolist(), causal=causal)
    _check([4097], causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_gdpa_silu_hstu_normalisation(causal):
    _check(RAGGED, causal=causal, act="silu")


def test_deterministic():
    a, la = _check(RAGGED, causal=True, seed=5)
    b, lb = _check(RAGGED, causal=True, seed=5)
    assert torch.equal(a, b) and torch.equal(la, lb)


def _poisoned_neighbours(head_dim, causal, act, isolate, seed=0):
    """Sequences whose key lengths are not multiples of the tile, each followed by a
    sequence whose values (and keys, queries) are NaN/Inf: the finite sequences' outputs
    must equal the reference computed on them alone."""
    torch.manual_seed(seed)
    lens = [100, 7, 130, 5, 255, 3, 64, 9]  # poisoned: the odd positions
    heads = 2
    qo = _offsets(lens)
    q, k, v = (torch.randn(sum(lens), heads, head_dim, device=DEV, dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    for b in range(1, len(lens), 2):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        v[rows, :, ::2] = float("nan")
        v[rows, :, 1::2] = float("inf")
        k[rows] = float("nan")
        q[rows] = float("-inf")
    cfg = GluonConfig(num_stages=default_config(head_dim).num_stages, isolate_values=isolate)
    kw = dict(causal=causal, config=cfg)
    if act == "silu":
        kw.update(activation="silu", normalization="max_seqlen")
    out, _ = jagged_attention_fwd_gluon(q, k, v, qo, max(lens), **kw)
    scale = 1.0 / math.sqrt(head_dim)
    bad = []
    for b in range(0, len(lens), 2):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        one = _offsets([lens[b]])
        ref, _ = _reference(q[rows], k[rows], v[rows], one, one, causal, scale, act,
                            1.0 / max(lens), torch.float64)  # fmt: skip
        if not bool(torch.isfinite(out[rows]).all()):
            bad.append(b)
            continue
        assert float((out[rows].double() - ref).abs().max()) < 0.05
    return bad


@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_non_finite_values_stay_in_their_sequence(head_dim, causal, act):
    assert _poisoned_neighbours(head_dim, causal, act, isolate=True) == []


def test_without_isolation_non_finite_values_leak():
    # The guard is what keeps them apart: without it every finite sequence whose last key
    # tile reaches into its poisoned neighbour turns NaN (this test fails if the poison
    # does not reach the kernel's reads, i.e. if the check above proved nothing).
    assert _poisoned_neighbours(128, False, "softmax", isolate=False) != []


def test_empty_inputs():
    q = torch.zeros(0, 2, 128, device=DEV, dtype=torch.bfloat16)
    out, lse = jagged_attention_fwd_gluon(q, q, q, torch.zeros(1, dtype=torch.int64, device=DEV), 0)
    assert out.shape == (0, 2, 128) and lse.shape == (2, 0)
    # queries whose key sequences are all empty: zeros and LSE = +inf
    q = torch.randn(10, 2, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(0, 2, 128, device=DEV, dtype=torch.bfloat16)
    qo = torch.tensor([0, 4, 10], device=DEV)
    ko = torch.zeros(3, dtype=torch.int64, device=DEV)
    out, lse = jagged_attention_fwd_gluon(q, k, k, qo, 6, kv_offsets=ko, max_seqlen_kv=0)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isinf(lse).all())


def test_layout_errors():
    q = torch.randn(64, 128, 2, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    qo = torch.tensor([0, 64], device=DEV)
    with pytest.raises(ValueError, match="packed heads"):
        jagged_attention_fwd_gluon(q, q, q, qo, 64)


def test_direct_relaunch_is_bit_identical(monkeypatch):
    from hyperrec.jagged_attn._triton import _direct

    torch.manual_seed(3)
    outs = {}
    for direct in ("0", "1"):
        monkeypatch.setenv(_direct.DIRECT_ENV, direct)
        for lens in (RAGGED, [700, 3, 129], RAGGED):  # new token counts between the calls
            q, k, v = (torch.randn(sum(lens), 4, 128, device=DEV, dtype=torch.bfloat16,
                                   generator=torch.Generator(DEV).manual_seed(len(lens)))
                       for _ in range(3))  # fmt: skip
            outs.setdefault(direct, []).append(
                jagged_attention_fwd_gluon(q, k, v, _offsets(lens), max(lens), causal=True)
            )
    for (a, la), (b, lb) in zip(outs["0"], outs["1"]):
        assert torch.equal(a, b) and torch.equal(la, lb)
    keys = [key for key in _direct.RELAUNCH if key[0] == "gluon_fwd"]
    assert keys and all(_direct.RELAUNCH[key].ok for key in keys)
