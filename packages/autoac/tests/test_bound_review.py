"""Review of ``span_free_bound``: adversarial cases for the claim that ``lower_bound_s``
is a lower bound on the added time of every keep / pack / recompute plan within the
budget, whatever its regions, and for the dual solver ``_lp_bound``."""

from __future__ import annotations

import collections
import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from autoac_cases import MLPBlock, Tower, attn_tower, mlp_tower, step_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import profiler
from hyperrec.autoac.bound import _lp_bound

CFG = autoac.ProfileConfig(
    cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=4096, max_grad_error=1.0
)
EXACT = dict(solver="exact", node_limit=300_000)


def _budgets(prof, fracs=(0.0, 0.3, 0.6, 1.0)):
    lo = autoac.plan(prof, budget=10 * prof.tracked_peak, config=autoac.PlanConfig(formats=()))
    return [lo.floor + f * (lo.no_ac_peak - lo.floor) for f in fracs], lo


# ------------------------------------------------- resident bytes freed in the forward
def _batch_step(kind: str, seed: int):
    """A step whose input batch exists before the step (so the tracker counts it as
    resident) but is reduced by the first op and freed early in the forward, as a step
    that takes its batch from a prefetch queue or builds it from host data does."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "queue":
        q = collections.deque(torch.randn(256, 32, 16, generator=gen) for _ in range(16))

        def step(m):
            return m(q.popleft().mean(-1)).square().mean()

    else:
        host = torch.randn(256, 32, 16, generator=gen).numpy()

        def step(m):
            return m(torch.tensor(host).mean(-1)).square().mean()

    return step


@pytest.mark.parametrize("kind", ["queue", "host"])
def test_bound_holds_when_the_batch_is_freed_during_the_forward(kind):
    """No AC (nothing recomputed, nothing packed: adds 0 s) fits at its own peak, so the
    bound must be 0 there. The profile counts the batch in ``resident_bytes`` although
    it is freed long before the forward ends; the bound takes it as alive at the end of
    the forward and comes out positive (and above the planner's optimal plans)."""
    seed = int(np.random.default_rng().integers(2**31))
    model = mlp_tower(n=4, dim=32, seed=seed % 1000)
    step = _batch_step(kind, seed)
    prof = autoac.profile(model, step, config=CFG)
    budgets, lo = _budgets(prof)
    # the un-checkpointed step, measured: adds nothing, peaks at the planner's no-AC peak
    meas = autoac.measure_step(model, _batch_step(kind, seed))
    assert meas.peak_bytes <= lo.no_ac_peak
    bd = autoac.span_free_bound(prof, meas.peak_bytes, formats=())
    assert bd.lower_bound_s == 0.0, (bd.lower_bound_s, bd.capacity, bd.needed_bytes)
    for budget in budgets:
        for fm in ((), ("mxint8",)):
            p = autoac.plan(prof, budget=budget, config=autoac.PlanConfig(formats=fm, **EXACT))
            assert p.predicted_peak <= budget
            bd = autoac.span_free_bound(prof, budget, formats=fm)
            assert bd.lower_bound_s <= p.added_s + 1e-12, (budget, fm, bd.lower_bound_s, p.added_s)


# ------------------------------------ a region left as is, whose output a checkpoint holds
class _Up(nn.Module):
    """Draws from an explicit generator: ``profile`` leaves it un-checkpointed."""

    def __init__(self, d: int, w: int, seed: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, w)
        self.g = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return h + 0.01 * torch.randn(h.shape, generator=self.g)


class _Down(nn.Module):
    """Reads its (wide) input without saving it: only a checkpoint would hold it."""

    def __init__(self, d: int, w: int) -> None:
        super().__init__()
        self.d, self.w = d, w
        self.blk = MLPBlock(d)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.blk(y.view(y.shape[0], self.w // self.d, self.d).sum(1))


class _UpDown(nn.Module):
    def __init__(self, seed: int, d: int = 32, w: int = 1024, n: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = _Up(d, w, seed), _Down(d, w)
        self.c = nn.Sequential(*[MLPBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c(self.b(self.a(x))))


def test_bound_holds_when_an_uncheckpointable_regions_output_is_held_only_by_a_checkpoint():
    """Region ``a`` cannot be checkpointed; its wide output is alive into the backward
    in the profiled step only because region ``b``'s checkpoint holds it as an input.
    ``plain_held_bytes`` counts it and the bound adds it to ``resident`` as what "no
    plan can lower". Plans whose regions leave ``b`` un-checkpointed free it in the
    forward: with regions ``a`` and the blocks of ``c`` only, the planner's plans (and
    the measured no-AC step, which adds 0 s) fit below budgets where the bound from the
    ``a, b, c...`` profile says every plan adds a positive time."""
    seed = int(np.random.default_rng().integers(2**31))
    m = _UpDown(seed % 1000)
    step = step_for(torch.randn(256, 32))
    cfg = autoac.ProfileConfig(cost="flops", steps=1, formats=(), min_pack_bytes=4096)
    with_b = autoac.profile(m, step, regions=[m.a, m.b, *m.c], config=cfg)
    without_b = autoac.profile(m, step, regions=[m.a, *m.c], config=cfg)
    assert with_b.regions[0].modes == ("none",) and without_b.regions[0].modes == ("none",)
    # measured: no AC at all adds nothing
    meas = autoac.measure_step(m, step)
    bd = autoac.span_free_bound(with_b, meas.peak_bytes)
    assert bd.lower_bound_s == 0.0, (bd.lower_bound_s, bd.resident, bd.capacity)
    budgets, _ = _budgets(without_b)
    for budget in budgets:
        p = autoac.plan(without_b, budget=budget, config=autoac.PlanConfig(formats=(), **EXACT))
        assert p.predicted_peak <= budget
        bd = autoac.span_free_bound(with_b, budget)
        # FLOP prices are re-measured per profile: allow a few percent between them
        assert bd.lower_bound_s <= 1.1 * p.added_s + 1e-12, (budget, bd.lower_bound_s, p.added_s)


# ------------------------------------------------------- plans of the planner, other models
class _MutatedBlock(nn.Module):
    """An op output written in place later, views of one storage saved by two ops."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h2 = self.fc1(self.ln(x)) * 2.0
        h2.add_(1.0)
        a, b = h2.chunk(2, -1)
        return x + self.fc2(torch.cat([torch.sigmoid(a) * b, a * b], -1))


class _TinyBlock(nn.Module):
    """Saves only tensors below ``min_pack_bytes``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _case(name: str, seed: int):
    if name == "dropout":
        m = attn_tower(n=3, p=0.2, seed=seed)
        return m, step_for(torch.randn(4, 64, 32)), [None, [m], list(m.layers)[:2]]
    if name == "mutated":
        torch.manual_seed(seed)
        m = Tower([_MutatedBlock(32) for _ in range(3)], 32)
        return m, step_for(torch.randn(128, 32)), [None, [m]]
    if name == "bf16":
        m = mlp_tower(n=3, seed=seed).to(torch.bfloat16)
        return m, step_for(torch.randn(256, 32, dtype=torch.bfloat16)), [None, [m]]
    torch.manual_seed(seed)
    m = Tower([_TinyBlock(32) for _ in range(4)], 32)
    return m, step_for(torch.randn(16, 32)), [None, [m]]


@pytest.mark.parametrize("name", ["dropout", "mutated", "bf16", "tiny"])
def test_planner_plans_of_every_region_choice_stay_above_every_bound(name, monkeypatch):
    """Plans from each region choice (the default blocks, the whole model as one region,
    a subset) against the bound of each, FLOP prices, with and without packing. The
    FLOP and copy rates are fixed: measured per profile they are timings of a few
    hundred microseconds, which a loaded machine moved far enough between two profiles
    that the bound of one came out 12x the plan of the other (no packing involved)."""
    monkeypatch.setattr(profiler, "_measure_rates", lambda device, dtype: (2e10, 5e9))
    seed = int(np.random.default_rng().integers(1000))
    m, step, choices = _case(name, seed)
    profs = [autoac.profile(m, step, regions=r, config=CFG) for r in choices]
    for pa in profs:
        budgets, _ = _budgets(pa, (0.0, 0.4, 1.0))
        for budget in budgets:
            for fm in ((), ("mxint8",)):
                p = autoac.plan(pa, budget=budget, config=autoac.PlanConfig(formats=fm, **EXACT))
                assert p.predicted_peak <= budget
                for pb in profs:
                    bd = autoac.span_free_bound(pb, budget, formats=fm)
                    tol = 1e-12 if pb is pa else 0.1 * p.added_s + 1e-12
                    assert bd.lower_bound_s <= p.added_s + tol, (budget, fm, bd, p.added_s)
                    assert bd.lower_bound_s <= bd.full_recompute_s + 1e-12


# ----------------------------------------------------------------- the dual solver itself
def _lp_exact(t: np.ndarray, b: np.ndarray, cap: float) -> float:
    """The LP optimum in exact rationals, over its vertices: every row on one choice
    except at most one row split between two, with the capacity tight."""
    n, k = t.shape
    opts = [[j for j in range(k) if math.isfinite(t[i, j])] for i in range(n)]
    T = [{j: Fraction(float(t[i, j])) for j in opts[i]} for i in range(n)]
    B = [{j: Fraction(float(b[i, j])) for j in opts[i]} for i in range(n)]
    C = Fraction(float(cap))
    best = None
    for pick in itertools.product(*opts):
        tt = sum(T[i][p] for i, p in enumerate(pick))
        bb = sum(B[i][p] for i, p in enumerate(pick))
        if bb <= C and (best is None or tt < best):
            best = tt
        for r in range(n):
            for j in opts[r]:
                bi, bj = B[r][pick[r]], B[r][j]
                if bi == bj:
                    continue
                a = (C - (bb - bi) - bj) / (bi - bj)
                if 0 <= a <= 1:
                    v = tt - T[r][pick[r]] + a * T[r][pick[r]] + (1 - a) * T[r][j]
                    best = v if best is None or v < best else best
    return math.inf if best is None else float(best)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(1, 4),
    k=st.integers(2, 4),
    seed=st.integers(0, 2**32 - 1),
    tm=st.sampled_from([1e-12, 1e-6, 1.0, 1e4]),
    bm=st.sampled_from([1.0, 1e3, 1e6, 1e10]),
    frac=st.floats(0.0, 1.3),
    ties=st.booleans(),
    at_least=st.booleans(),
)
def test_lp_bound_is_the_exact_lp_optimum(n, k, seed, tm, bm, frac, ties, at_least):
    """Against the LP solved in rationals over its vertices: ties in times and bytes,
    several zero-byte choices, rows with only one allowed choice, integer bytes of any
    magnitude, a capacity exactly the least bytes. Tolerance: the dual's rounding,
    a few ulps of ``multiplier * (capacity + bytes)``."""
    rng = np.random.default_rng(seed)
    if ties:
        t = rng.integers(0, 3, size=(n, k)).astype(float) * tm
        b = rng.integers(0, 3, size=(n, k)).astype(float) * bm
    else:
        t = rng.uniform(0, 1, size=(n, k)) * tm
        b = np.round(rng.uniform(0, 1, size=(n, k)) * bm)
    t[:, 0] = 0.0
    b[:, 0] = b.max(axis=1) + rng.integers(0, 2, size=n)
    gone = rng.random((n, k - 1)) < 0.4
    t[:, 1:][gone] = math.inf
    b[:, 1:][gone] = math.inf
    least = float(np.where(np.isinf(t), np.inf, b).min(axis=1).sum())
    cap = least if at_least else frac * b[:, 0].sum()
    lb, lam = _lp_bound(t, b, cap)
    ex = _lp_exact(t, b, cap)
    if math.isinf(ex):
        assert lb == math.inf and lam == math.inf
        return
    fin = np.isfinite(t)
    lam_max = max(
        [0.0]
        + [
            abs(t[i, p] - t[i, q]) / abs(b[i, p] - b[i, q])
            for i in range(n)
            for p in range(k)
            for q in range(k)
            if fin[i, p] and fin[i, q] and b[i, p] != b[i, q]
        ]
    )
    tol = 1e-9 * ex + 8 * (n + 2) * 2.3e-16 * lam_max * (abs(cap) + b[fin].sum())
    assert abs(lb - ex) <= tol, (t, b, cap, lb, ex)
    assert 0.0 <= lam < math.inf


def test_lp_bound_edges():
    inf = math.inf
    t = np.array([[0.0, 1.0, 2.0], [0.0, 3.0, inf]])
    b = np.array([[10.0, 0.0, 0.0], [5.0, 0.0, inf]])
    assert _lp_bound(t, b, 0.0)[0] == pytest.approx(4.0)  # recompute both
    assert _lp_bound(t, b, -1.0)[0] == inf
    assert _lp_bound(t, b, 15.0)[0] == 0.0
    assert _lp_bound(t, b, 7.5)[0] == pytest.approx(0.75)  # half of row 0 (0.1 s/byte)
    only_keep_t, only_keep_b = np.array([[0.0, inf, inf]]), np.array([[10.0, inf, inf]])
    assert _lp_bound(only_keep_t, only_keep_b, 9.0)[0] == inf
    assert _lp_bound(only_keep_t, only_keep_b, 10.0)[0] == 0.0
    assert _lp_bound(np.zeros((0, 3)), np.zeros((0, 3)), 0.0) == (0.0, 0.0)
    assert _lp_bound(np.zeros((0, 3)), np.zeros((0, 3)), -1.0)[0] == inf


# ---------------------------------------------------------------- arguments and results
@pytest.fixture(scope="module")
def small_profile():
    return autoac.profile(mlp_tower(n=2), step_for(torch.randn(256, 32)), config=CFG)


def test_bad_arguments_name_the_argument(small_profile):
    prof = small_profile
    with pytest.raises(TypeError, match="budget"):
        autoac.span_free_bound(prof, True)
    with pytest.raises(TypeError, match="budget"):
        autoac.span_free_bound(prof, None)
    with pytest.raises(TypeError, match="formats"):
        autoac.span_free_bound(prof, 1e6, formats=("mxint8", 3))
    with pytest.raises(TypeError, match="profile"):
        autoac.span_free_bound(dict(vars(prof)), 1e6)
    with pytest.raises(ValueError, match="formats"):
        autoac.span_free_bound(prof, 1e6, formats=("mx4",))


def test_huge_integer_arguments_raise_value_error(small_profile):
    prof = small_profile
    # a budget too large for a float is an infinite budget: a ValueError naming it,
    # not an OverflowError from float()
    with pytest.raises(ValueError, match="budget"):
        autoac.span_free_bound(prof, 10**400)
    bd = autoac.span_free_bound(prof, prof.tracked_peak)
    with pytest.raises(ValueError, match="full_ac_s"):
        bd.speedup_bound(1.0, 10**400)


def test_results_are_consistent(small_profile):
    prof = small_profile
    rng = np.random.default_rng()
    budgets, lo = _budgets(prof, sorted(rng.uniform(0, 1, size=4)))
    last = math.inf
    for budget in budgets:
        for fm in ((), ("mxint8",)):
            bd = autoac.span_free_bound(prof, budget, formats=fm)
            assert bd.formats == fm and bd.budget == int(budget)
            assert bd.capacity == bd.budget - bd.resident
            assert 0.0 <= bd.lower_bound_s <= bd.full_recompute_s + 1e-12
            assert bd.multiplier >= 0
            json.dumps(bd.to_dict())
            no_ac, full_ac = rng.uniform(0.1, 1.0), 0.0
            full_ac = no_ac * rng.uniform(1.0, 1.5)
            s = bd.speedup_bound(no_ac, full_ac)
            # never faster than no AC, never slower than full AC at the budget
            assert 1.0 - 1e-12 <= s <= full_ac / no_ac + 1e-12
        plain = autoac.span_free_bound(prof, budget, formats=()).lower_bound_s
        assert plain <= last + 1e-15
        last = plain
    # a budget no AC fits: nothing to add
    assert autoac.span_free_bound(prof, lo.no_ac_peak).lower_bound_s == 0.0
