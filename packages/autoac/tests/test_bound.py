"""``span_free_bound``: a lower bound on any plan's added time, whatever its regions."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from autoac_cases import AttnBlock, Tower, attn_tower, mlp_tower, step_for
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec import autoac
from hyperrec.autoac.bound import _lp_bound

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)


def _profile(model, step, formats=("mxint8",)):
    cfg = dataclasses.replace(FLOPS, formats=formats, min_pack_bytes=4096, max_grad_error=1.0)
    return autoac.profile(model, step, config=cfg)


@pytest.fixture(scope="module")
def attn_profile():
    return _profile(attn_tower(n=3, dim=32, heads=4), step_for(torch.randn(4, 64, 32)))


@pytest.fixture(scope="module")
def mlp_profile():
    return _profile(mlp_tower(n=4, dim=32), step_for(torch.randn(256, 32)))


def _budgets(prof):
    lo = autoac.plan(prof, budget=10 * prof.tracked_peak, config=autoac.PlanConfig(formats=()))
    return [lo.floor + f * (lo.no_ac_peak - lo.floor) for f in (0.0, 0.1, 0.3, 0.6, 1.0)]


@pytest.mark.parametrize("which", ["attn_profile", "mlp_profile"])
@pytest.mark.parametrize("formats", [(), ("mxint8",)])
def test_no_plan_beats_the_bound(request, which, formats):
    """At every budget from the floor to no AC, the planner's best plan (exact solver:
    proven optimal among region plans) adds at least the bound, and the bound is
    positive below no AC's peak (it says something)."""
    prof = request.getfixturevalue(which)
    cfg = autoac.PlanConfig(formats=formats, solver="exact", node_limit=2_000_000)
    seen_positive = False
    for budget in _budgets(prof):
        p = autoac.plan(prof, budget=budget, config=cfg)
        bd = autoac.span_free_bound(prof, budget, formats=formats)
        assert p.predicted_peak <= budget
        assert bd.lower_bound_s <= p.added_s + 1e-12, (budget, bd, p.added_s)
        assert bd.lower_bound_s <= bd.full_recompute_s + 1e-12
        seen_positive |= bd.lower_bound_s > 0
    assert seen_positive


def test_bound_falls_with_budget_and_formats(attn_profile):
    prof = attn_profile
    budgets = _budgets(prof)
    plain = [autoac.span_free_bound(prof, b, formats=()).lower_bound_s for b in budgets]
    packed = [autoac.span_free_bound(prof, b).lower_bound_s for b in budgets]
    assert all(x >= y - 1e-15 for x, y in itertools.pairwise(plain))
    assert all(x >= y - 1e-15 for x, y in itertools.pairwise(packed))
    assert all(q <= p + 1e-15 for p, q in zip(plain, packed, strict=True))
    # Everything autograd needs fits when the budget holds it all: nothing to add.
    bd = autoac.span_free_bound(prof, prof.resident_bytes + 10 * prof.tracked_peak)
    assert bd.lower_bound_s == 0.0
    # nothing added: a plan could run at no AC's speed
    assert bd.speedup_bound(0.1, 0.13) == pytest.approx(1.3)


def test_speedup_bound_reprices_with_the_measured_recompute(attn_profile):
    prof = attn_profile
    bd = autoac.span_free_bound(prof, _budgets(prof)[0])
    lb, full = bd.lower_bound_s, bd.full_recompute_s
    assert 0 < lb < full
    # measured recompute half the profile's: the re-priced estimate is the larger
    no_ac, full_ac = 1.0, 1.0 + full / 2
    assert bd.speedup_bound(no_ac, full_ac) == pytest.approx(full_ac / (no_ac + lb / 2))
    # measured recompute twice the profile's: the unscaled one is the larger
    full_ac = 1.0 + 2 * full
    assert bd.speedup_bound(no_ac, full_ac) == pytest.approx(full_ac / (no_ac + lb))
    # the plan the planner finds at that budget runs no faster than the bound says
    p = autoac.plan(prof, budget=bd.budget)
    k = (full_ac - no_ac) / full
    assert full_ac / (no_ac + k * p.added_s) <= bd.speedup_bound(no_ac, full_ac) + 1e-12
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="no_ac_s"):
            bd.speedup_bound(bad, 1.0)
        with pytest.raises(ValueError, match="full_ac_s"):
            bd.speedup_bound(1.0, bad)
    with pytest.raises(ValueError, match="full_ac_s must be >= no_ac_s"):
        bd.speedup_bound(2.0, 1.0)
    with pytest.raises(TypeError, match="no_ac_s"):
        bd.speedup_bound("1", 2.0)


def test_bound_below_resident_is_infinite(mlp_profile):
    bd = autoac.span_free_bound(mlp_profile, 0)
    assert bd.capacity < 0 and bd.lower_bound_s == math.inf
    assert bd.speedup_bound(1.0, 1.5) == 0.0
    assert bd.to_dict()["lower_bound_s"] is None


def test_bound_counts_only_needed_outputs(mlp_profile):
    bd = autoac.span_free_bound(mlp_profile, mlp_profile.tracked_peak)
    # a region's inputs (0.1.18) are another region's outputs: not items of the bound
    ops = [o for r in mlp_profile.regions for o in r.ops if not o.is_input]
    need = sum(lv.nbytes for o in ops for lv in o.storages if lv.needed)
    rows = sum(1 for o in ops if any(lv.needed for lv in o.storages))
    assert bd.needed_bytes == need and bd.decisions == rows > 0
    assert bd.resident == mlp_profile.resident_at_backward == mlp_profile.resident_bytes


def test_bad_arguments(mlp_profile):
    with pytest.raises(TypeError, match="profile"):
        autoac.span_free_bound(object(), 1.0)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="budget"):
            autoac.span_free_bound(mlp_profile, bad)
    with pytest.raises(TypeError, match="budget"):
        autoac.span_free_bound(mlp_profile, "1e9")
    with pytest.raises(TypeError, match="formats"):
        autoac.span_free_bound(mlp_profile, 1e9, formats=["mxint8"])
    with pytest.raises(ValueError, match="formats"):
        autoac.span_free_bound(mlp_profile, 1e9, formats=("nope",))
    with pytest.raises(ValueError, match="formats"):
        autoac.span_free_bound(mlp_profile, 1e9, formats=("mxfp8",))


# ------------------------------------------------------------------ the relaxation itself
def _brute(t, b, cap):
    best = math.inf
    for pick in itertools.product(range(t.shape[1]), repeat=t.shape[0]):
        tt = sum(t[i, k] for i, k in enumerate(pick))
        bb = sum(b[i, k] for i, k in enumerate(pick))
        if math.isfinite(tt) and bb <= cap:
            best = min(best, tt)
    return best


def _lp_primal(t, b, cap):
    """The relaxation solved from the primal side (no dual): start every row at its
    least-bytes choice, then spend the capacity on the steepest time-per-byte upgrades
    along each row's lower convex hull (the classical greedy for the LP of the
    multiple-choice knapsack)."""
    rows = []
    total_b, total_t = 0.0, 0.0
    upgrades = []
    for i in range(t.shape[0]):
        pts = sorted((b[i, k], t[i, k]) for k in range(t.shape[1]) if math.isfinite(t[i, k]))
        # least time for each byte count, then the lower hull from the fewest bytes
        hull = [pts[0]]
        for p in pts[1:]:
            if p[0] == hull[-1][0]:
                continue
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            if p[1] < hull[-1][1]:
                hull.append(p)
        rows.append(hull)
        total_b += hull[0][0]
        total_t += hull[0][1]
        for (x1, y1), (x2, y2) in itertools.pairwise(hull):
            upgrades.append(((y1 - y2) / (x2 - x1), x2 - x1, y1 - y2))
    if total_b > cap:
        return math.inf
    left = cap - total_b
    for _, db, dt in sorted(upgrades, key=lambda u: -u[0]):
        if left <= 0:
            break
        f = min(1.0, left / db)
        total_t -= f * dt
        left -= f * db
    return total_t


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    k=st.integers(2, 4),
    seed=st.integers(0, 2**31 - 1),
    frac=st.floats(0.0, 1.2),
)
def test_relaxation_is_exact_lp_and_below_integer_optimum(n, k, seed, frac):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0, 10, size=(n, k)).round(3)
    b = rng.uniform(0, 100, size=(n, k)).round(1)
    t[:, 0] = 0.0  # keep: free, most bytes
    b[:, 0] = b.max(axis=1) + 1
    if k > 2:
        gone = rng.random((n, k - 1)) < 0.3
        t[:, 1:][gone] = math.inf
        b[:, 1:][gone] = math.inf
    cap = frac * b[:, 0].sum()
    lb, lam = _lp_bound(t, b, cap)
    primal = _lp_primal(t, b, cap)
    integer = _brute(t, b, cap)
    if math.isinf(primal):
        assert math.isinf(lb) and math.isinf(integer)
        return
    assert lb == pytest.approx(primal, rel=1e-9, abs=1e-9)
    assert lb <= integer + 1e-9
    # the LP leaves at most one row split between two choices
    spread = max(np.nanmax(np.where(np.isinf(t[i]), np.nan, t[i])) for i in range(n))
    assert integer - lb <= spread + 1e-9
    assert lam >= 0


class _SplitBlock(AttnBlock):
    """The test tower's block as two spans (attention half, MLP half)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads)
        self.attn_span = autoac.Span(self._attn)
        self.mlp_span = autoac.Span(self._mlp)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.silu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_span(self.attn_span(x))


def test_plans_of_finer_regions_stay_above_the_bound_of_coarse_ones():
    """The bound from a profile with whole blocks as regions holds for plans of other
    regions: two spans per block (FLOP prices, the same in both profiles)."""
    torch.manual_seed(0)
    model = Tower([_SplitBlock(32, 4) for _ in range(3)], 32)
    step = step_for(torch.randn(4, 64, 32))
    cfg = dataclasses.replace(FLOPS, formats=("mxint8",), min_pack_bytes=4096, max_grad_error=1.0)
    coarse = autoac.profile(model, step, regions=list(model.layers), config=cfg)
    spans = [s for layer in model.layers for s in (layer.attn_span, layer.mlp_span)]
    fine = autoac.profile(model, step, regions=spans, config=cfg)
    assert len(fine.regions) == 6 and coarse.resident_bytes == fine.resident_bytes
    lo = autoac.plan(fine, budget=10 * fine.tracked_peak, config=autoac.PlanConfig(formats=()))
    checked = 0
    for f in (0.0, 0.2, 0.5, 0.8):
        budget = lo.floor + f * (lo.no_ac_peak - lo.floor)
        for fm in ((), ("mxint8",)):
            p = autoac.plan(fine, budget=budget, config=autoac.PlanConfig(formats=fm))
            bd = autoac.span_free_bound(coarse, budget, formats=fm)
            assert p.predicted_peak <= budget
            assert bd.lower_bound_s <= p.added_s + 1e-12, (f, fm, bd.lower_bound_s, p.added_s)
            checked += bd.lower_bound_s > 0
    assert checked >= 2
