"""RoutedExperts: dense reference, bad input, and EP + fully_shard parity on gloo ranks.

The 8-rank parity run shares its spawn with the mesh membership checks
(test_p5d_mesh.py::test_eight_gloo_ranks_on_two_hosts).
"""

from __future__ import annotations

import pytest
import torch
from _p5d_moe import check_parity, moe_parity
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d.experts import RoutedExperts, routed_experts_reference
from hyperrec.parallel5d.mesh import MeshSpec
from hyperrec.parallel5d.topology import Topology
from hyperrec.testing import run_on_ranks


def _reference(m: RoutedExperts, x: torch.Tensor) -> torch.Tensor:
    e = m.experts
    return routed_experts_reference(x, m.router.gate.weight, e.w1, e.w3, e.w2, top_k=m.router.top_k)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 20),
    experts=st.integers(1, 6),
    top_k=st.integers(1, 3),
    dim=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_reference(
    tokens: int, experts: int, top_k: int, dim: int, seed: int
) -> None:
    top_k = min(top_k, experts)
    torch.manual_seed(seed)
    m = RoutedExperts(dim, 5, experts, top_k=top_k, dtype=torch.float64)
    x = torch.randn(tokens, dim, dtype=torch.float64, requires_grad=True)
    y, r = m(x), _reference(m, x)
    torch.testing.assert_close(y, r, rtol=1e-12, atol=1e-12)
    assert sum(m.last_counts) == tokens * top_k
    g = torch.randn_like(y)
    params = [x, m.router.gate.weight, m.experts.w1, m.experts.w3, m.experts.w2]
    got = torch.autograd.grad(y, params, g, allow_unused=True)
    want = torch.autograd.grad(r, params, g, allow_unused=True)
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        RoutedExperts(4, 4, 2, top_k=3)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        RoutedExperts(4, 4, 2.0)
    with pytest.raises(TypeError, match="ep_mesh must be a 1-D DeviceMesh"):
        RoutedExperts(4, 4, 2, ep_mesh="ep")
    m = RoutedExperts(4, 4, 2, top_k=1)
    with pytest.raises(ValueError, match=r"x must have 4 columns, got shape \(3, 5\)"):
        m(torch.randn(3, 5))
    with pytest.raises(ValueError, match="x must be 2-D"):
        m(torch.randn(3))
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        m(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"w1 must have shape \(2, 4, 4\)"):
        m.load_full_experts_(torch.zeros(3, 4, 4), m.experts.w3, m.experts.w2, torch.zeros(2, 4))
    # a bad router after good expert weights: nothing is copied (the experts were)
    before = [t.detach().clone() for t in (m.experts.w1, m.experts.w3, m.experts.w2)]
    with torch.no_grad(), pytest.raises(ValueError, match="router must have shape"):
        m.load_full_experts_(*(torch.ones_like(t) for t in before), torch.zeros(3, 4))
    after = (m.experts.w1, m.experts.w3, m.experts.w2)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    with pytest.raises(ValueError, match="expert_grad_scale must be >= 0.0"):
        RoutedExperts(4, 4, 2, expert_grad_scale=-1.0)


@pytest.mark.parametrize(
    ("world", "topology", "spec", "counts"),
    [
        # 2 ranks, one host: EP over both; uneven tokens.
        (2, Topology(gpus_per_host=2, hosts=1), MeshSpec(fsdp=2, ep=2), [7, 3]),
        # 4 ranks: EP over all four (efsdp = 1); one rank has no tokens at all.
        # (A rank without tokens at 2 ranks: test_ep_two_ranks_one_sends_nothing.)
        pytest.param(
            4,
            Topology(gpus_per_host=4, hosts=1),
            MeshSpec(fsdp=4, ep=4),
            [5, 0, 9, 2],
            marks=pytest.mark.slow,  # not in `nox -s lowest`
        ),
    ],
    ids=["2ranks", "4ranks"],
)
def test_ep_parity_with_single_process(
    world: int, topology: Topology, spec: MeshSpec, counts: list[int]
) -> None:
    results = run_on_ranks(moe_parity, world, topology, spec, counts)
    check_parity(results)
