"""RoutedExperts against an independent float64 reference on adversarial routings.

The reference below is written from the docstrings alone: softmax over all experts,
keep the ``k`` largest scores (ties to the lower expert id), renormalise them if
``normalize``, and sum each kept expert's SwiGLU output weighted by its score, one
token at a time. Inputs the older tests do not use: exact ties (integer router and
inputs), every token on one expert, experts with no tokens, ``top_k`` of 1 and of
``num_experts``, zero and one token, NaN/Inf, bf16/fp16, strided inputs, and one
2-rank EP run with one rank sending nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d.experts import RoutedExperts, routed_experts_reference
from hyperrec.testing import run_on_ranks

F64 = torch.float64


def _ref(
    x: torch.Tensor,
    router: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    normalize: bool = True,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Token-by-token float64 reference; returns the output and each token's experts."""
    rows, picks = [], []
    for t in range(x.shape[0]):
        p = torch.softmax(router @ x[t], dim=0)
        pv = p.detach().tolist()
        sel = sorted(range(len(pv)), key=lambda e: (-pv[e], e))[:top_k]
        w = p[sel]
        if normalize:
            w = w / w.sum()
        y = x.new_zeros(x.shape[1])
        for j, e in enumerate(sel):
            h = F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])
            y = y + w[j] * (h @ w2[e])
        rows.append(y)
        picks.append(sel)
    out = torch.stack(rows) if rows else x * 0  # (0, dim), still on the graph
    return out, picks


def _params(m: RoutedExperts) -> list[torch.Tensor]:
    return [m.router.gate.weight, m.experts.w1, m.experts.w3, m.experts.w2]


def _ref_of(m: RoutedExperts, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Float64 leaf copies of (x, params), and the reference output on them."""
    leaves = [t.detach().to(F64).requires_grad_() for t in (x, *_params(m))]
    y, picks = _ref(*leaves, top_k=m.router.top_k, normalize=m.router.normalize)
    return leaves, y, picks


def _check_against_ref(m: RoutedExperts, x: torch.Tensor, tol: float = 1e-10) -> list:
    x = x.detach().requires_grad_()
    y = m(x)
    leaves, r, picks = _ref_of(m, x)
    torch.testing.assert_close(y, r, rtol=tol, atol=tol)
    _, ids = m.router(x.detach())
    assert ids.tolist() == picks
    want_counts = [sum(e in p for p in picks) for e in range(m.num_experts)]
    assert m.last_counts == want_counts
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *_params(m)], g)
    want = torch.autograd.grad(r, leaves, g, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=tol, atol=tol)
    # Experts that got no tokens: gradient exactly zero (not garbage, not None).
    for e, c in enumerate(m.last_counts):
        if c == 0:
            for gw in got[2:]:
                assert torch.equal(gw[e], torch.zeros_like(gw[e]))
    return picks


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 9),
    experts=st.integers(1, 6),
    top_k=st.integers(1, 6),
    dim=st.integers(1, 4),
    normalize=st.booleans(),
    integer=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_independent_reference(
    tokens: int, experts: int, top_k: int, dim: int, normalize: bool, integer: bool, seed: int
) -> None:
    """Float64 throughout; ``integer``: router and x in {-1, 0, 1}, so logits are exact
    and ties are everywhere (the tie-break must pick the lower expert id)."""
    top_k = min(top_k, experts)
    torch.manual_seed(seed)
    m = RoutedExperts(dim, 3, experts, top_k=top_k, normalize=normalize, dtype=F64)
    if integer:
        with torch.no_grad():
            m.router.gate.weight.copy_(torch.randint(-1, 2, (experts, dim)))
        x = torch.randint(-1, 2, (tokens, dim)).to(F64)
    else:
        x = torch.randn(tokens, dim, dtype=F64)
    _check_against_ref(m, x)


def test_full_tie_goes_to_lowest_ids() -> None:
    """A zero router ties every expert: each token must go to experts 0..k-1 (``topk``
    kept e.g. expert 2 of 5 for top_k=1), so every token lands on one expert."""
    for experts, top_k in ((5, 1), (8, 1), (8, 3), (5, 5)):
        torch.manual_seed(experts + top_k)
        m = RoutedExperts(3, 4, experts, top_k=top_k, dtype=F64)
        with torch.no_grad():
            m.router.gate.weight.zero_()
        picks = _check_against_ref(m, torch.randn(6, 3, dtype=F64))
        assert picks == [list(range(top_k))] * 6
        assert m.last_counts == [6] * top_k + [0] * (experts - top_k)


def test_float64_router_keeps_float64_precision() -> None:
    """Two experts whose float64 scores differ by 1e-12 are not a tie, and the weights
    are float64-accurate (a float32 softmax made them a tie routed to expert 2)."""
    m = RoutedExperts(1, 2, 5, top_k=1, dtype=F64)
    with torch.no_grad():
        m.router.gate.weight.copy_(torch.tensor([[0.0], [0.0], [0.0], [1e-12], [0.0]]))
    x = torch.ones(2, 1, dtype=F64)
    w, ids = m.router(x)
    assert ids.tolist() == [[3], [3]]
    m2 = RoutedExperts(3, 4, 4, top_k=2, normalize=False, dtype=F64)
    x2 = torch.randn(5, 3, dtype=F64)
    w2, ids2 = m2.router(x2)
    p = torch.softmax(x2 @ m2.router.gate.weight.detach().t(), dim=-1)
    torch.testing.assert_close(w2, p.gather(1, ids2), rtol=1e-15, atol=1e-15)
    assert w2.dtype == F64


def test_library_reference_agrees_on_ties() -> None:
    """``routed_experts_reference`` uses the same tie-break as the layer."""
    m = RoutedExperts(2, 3, 5, top_k=1, dtype=F64)
    with torch.no_grad():
        m.router.gate.weight.zero_()
    x = torch.randn(4, 2, dtype=F64)
    e = m.experts
    lib = routed_experts_reference(x, m.router.gate.weight, e.w1, e.w3, e.w2, top_k=1)
    torch.testing.assert_close(lib, _ref_of(m, x)[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m(x), lib, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tokens", [0, 1])
def test_zero_and_one_token(tokens: int) -> None:
    torch.manual_seed(tokens)
    m = RoutedExperts(4, 5, 3, top_k=3, dtype=F64)
    x = torch.randn(tokens, 4, dtype=F64)
    _check_against_ref(m, x)
    y = m(x.requires_grad_())
    assert y.shape == (tokens, 4)
    grads = torch.autograd.grad(y.sum(), _params(m))
    if tokens == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_strided_input() -> None:
    torch.manual_seed(1)
    m = RoutedExperts(3, 4, 4, top_k=2, dtype=F64)
    base = torch.randn(3, 14, dtype=F64)
    x = base.t()[::2]  # (7, 3), neither contiguous nor unit-stride
    assert not x.is_contiguous()
    _check_against_ref(m, x)
    torch.testing.assert_close(m(x), m(x.contiguous()), rtol=1e-13, atol=1e-13)


def test_non_finite_rows_stay_in_their_token() -> None:
    """Documented: a NaN/Inf token gets an all-NaN row; the other tokens are unchanged."""
    torch.manual_seed(2)
    m = RoutedExperts(3, 4, 4, top_k=2, dtype=F64)
    x = torch.randn(6, 3, dtype=F64)
    clean = m(x)
    bad = x.clone()
    bad[1, 0] = float("nan")
    bad[4, 2] = float("inf")
    y = m(bad)
    assert sum(m.last_counts) == 12
    assert torch.isnan(y[[1, 4]]).all()
    keep = [0, 2, 3, 5]
    torch.testing.assert_close(y[keep], clean[keep], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    """bf16/fp16 layer against the float64 reference on the same (rounded) values."""
    torch.manual_seed(3)
    m = RoutedExperts(8, 16, 4, top_k=2).to(dtype)
    x = torch.randn(12, 8).to(dtype).requires_grad_()
    y = m(x)
    assert y.dtype == dtype
    _, r, picks = _ref_of(m, x)
    _, ids = m.router(x.detach())
    assert ids.tolist() == picks
    torch.testing.assert_close(y.to(F64), r, rtol=3e-2, atol=3e-2)
    grads = torch.autograd.grad(y.float().square().sum(), [x, *_params(m)])
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


def test_deterministic_across_runs() -> None:
    def once() -> list[torch.Tensor]:
        torch.manual_seed(4)
        m = RoutedExperts(5, 6, 6, top_k=2, dtype=F64)
        x = torch.randn(9, 5, dtype=F64, requires_grad=True)
        y = m(x)
        return [y, *torch.autograd.grad(y.square().sum(), [x, *_params(m)])]

    for a, b in zip(once(), once()):
        assert torch.equal(a, b)


def _ep_rank(tokens: list[int], tie: bool) -> dict:
    """One EP rank vs the float64 reference on the same global weights."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    torch.manual_seed(0)
    full = RoutedExperts(3, 4, 4, top_k=1, dtype=F64)
    if tie:
        with torch.no_grad():
            full.router.gate.weight.zero_()
    m = RoutedExperts(
        3, 4, 4, top_k=1, ep_mesh=init_device_mesh("cpu", (2,)), expert_grad_scale=1.0, dtype=F64
    )
    e = full.experts
    m.load_full_experts_(e.w1, e.w3, e.w2, full.router.gate.weight)
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(sum(tokens), 3, generator=g, dtype=F64)
    x = x_all[sum(tokens[:rank]) : sum(tokens[: rank + 1])].clone().requires_grad_()
    y = m(x)
    got = torch.autograd.grad(y.sum(), [x, *_params(m)])
    y = y.detach()
    leaves, r, _ = _ref_of(full, x)
    want = torch.autograd.grad(r.sum(), leaves, allow_unused=True)
    want = [torch.zeros_like(lf) if w is None else w for w, lf in zip(want, leaves)]
    r = r.detach()
    for w in want[2:]:  # expert gradients: summed over the ranks whose tokens they served
        dist.all_reduce(w)
    sl = slice(m.local_experts.start, m.local_experts.stop)
    pairs = [(y, r), *zip(got[:2], want[:2]), *((a, b[sl]) for a, b in zip(got[2:], want[2:]))]
    err = max(float((a - b).abs().amax()) if a.numel() else 0.0 for a, b in pairs)
    zero_ok = all(
        torch.equal(gw[i], torch.zeros_like(gw[i]))
        for i, c in enumerate(m.last_counts)
        if c == 0
        for gw in got[2:]
    )
    return {"err": err, "counts": m.last_counts, "zero_ok": zero_ok}


def _ep_ranks() -> tuple[dict, dict]:
    return _ep_rank([5, 0], tie=True), _ep_rank([6, 3], tie=False)


def test_ep_two_ranks_one_sends_nothing() -> None:
    """EP 2: in the tie case rank 1 has no tokens; a zero router sends every token to expert 0, so
    rank 1's experts get nothing and their gradients must be exactly zero."""
    tie, rand = zip(*run_on_ranks(_ep_ranks, 2))  # one spawn for both cases
    for res in (tie, rand):
        assert all(r["err"] < 1e-12 for r in res), res
        assert all(r["zero_ok"] for r in res), res
    assert [r["counts"] for r in tie] == [[5, 0], [0, 0]]
