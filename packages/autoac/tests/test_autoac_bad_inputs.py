"""Bad-input catalogue of hyperrec.autoac: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's (or class's) docstring. Budgets below the floor must
name the smallest feasible budget, so those cases match on the floor itself.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from hyperrec.autoac import (
    AutoAC,
    MemoryTracker,
    Plan,
    PlanConfig,
    ProfileConfig,
    Span,
    apply,
    apply_plan,
    measure_step,
    plan,
    profile,
    remove,
    resolve_regions,
)
from hyperrec.autoac.formats import can_pack, pack_storage, packed_nbytes
from hyperrec.testing.bad_inputs import case, catalogue_tests, rejects_cleanly

T = TypeError
V = ValueError
nan, inf = math.nan, math.inf


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _MLP(nn.Module):
    """Two MLP blocks behind an input layer (so block 1's input is an activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


torch.manual_seed(0)
MODEL = _MLP()
X = torch.randn(16, 8)
ONE = ProfileConfig(steps=1)


def STEP(m: nn.Module) -> torch.Tensor:
    return m(X).square().mean()


def _twice(m: nn.Module) -> torch.Tensor:
    return m.layers[0](m.layers[0](X)).square().mean()


PROF = profile(MODEL, STEP, config=ONE)
PLAN = plan(PROF, budget=1e15)
FLOOR = PLAN.floor
BELOW = f"budget must be a finite number of bytes >= {FLOOR} "
RB_FLOOR = PROF.regions[1].input_bytes  # a full checkpoint holds the block's input
RB_BELOW = f"region_budgets['layers.1'] must be a finite number of bytes >= {RB_FLOOR} "
# The same plan under region names another model has.
PLAN_OTHER = dataclasses.replace(
    PLAN,
    regions=tuple(dataclasses.replace(r, name=f"blocks.{i}") for i, r in enumerate(PLAN.regions)),
)
D = PLAN.to_dict()
OTHER_STATE = {"plan": PLAN_OTHER.to_dict()}
HANDLE = apply_plan(_MLP(), PLAN)
OTHER = nn.Sequential(nn.Linear(2, 2))


def _region(**kw):
    return {**D, "regions": [{**D["regions"][0], **kw}, *D["regions"][1:]]}


def _set_then_check(p):
    # A rejected plan leaves the one in force, with its regions still wrapped.
    try:
        HANDLE.set_plan(p)
    finally:
        assert HANDLE.plan is PLAN, "a rejected set_plan replaced the plan in force"
        assert all("_autoac" in b.__dict__ for b in HANDLE.model.layers), "regions unwrapped"


def _load_then_check(state):
    try:
        HANDLE.load_state_dict(state)
    finally:
        assert HANDLE.plan is PLAN, "a rejected load_state_dict replaced the plan in force"


def _apply(**kw):
    kw.setdefault("budget", 1e15)
    kw.setdefault("profile_config", ONE)
    return apply(MODEL, **kw)


CASES = [
    # profile(model, step_fn, *, regions, config)
    case(T, "model", profile, "model", STEP),
    case(T, "model", profile, None, STEP),
    case(T, "step_fn", profile, MODEL, 3),
    case(T, "step_fn", profile, MODEL, None),
    case(T, "step_fn", profile, MODEL, lambda: X.sum()),
    case(T, "step_fn", profile, MODEL, lambda m, batch: m(batch).sum()),
    case(T, "step_fn", profile, MODEL, lambda m: None, config=ONE),
    case(T, "step_fn", profile, MODEL, lambda m: 1.0, config=ONE),
    case(T, "step_fn", profile, MODEL, lambda m: m(X), config=ONE),
    case(T, "step_fn", profile, MODEL, lambda m: m(X).detach().sum(), config=ONE),
    case(T, "config", profile, MODEL, STEP, config={"steps": 1}),
    case(T, "config", profile, MODEL, STEP, config=PlanConfig()),
    case(T, "regions", profile, MODEL, STEP, regions=3),
    case(T, "regions", profile, MODEL, STEP, regions=[1.5]),
    case(V, "regions", profile, MODEL, STEP, regions=["nothing.*"]),
    case(V, "regions", profile, MODEL, STEP, regions=[nn.Linear(2, 2)]),
    case(V, "regions", profile, MODEL, STEP, regions=[MODEL.layers[0], MODEL.layers[0].fc1]),
    case(V, "regions", profile, MODEL, _twice, regions=[MODEL.layers[0]], config=ONE),
    case(V, "regions", profile, nn.Linear(8, 1), lambda m: m(X).sum()),
    # ProfileConfig
    case(V, "steps", ProfileConfig, steps=0),
    case(T, "steps", ProfileConfig, steps=1.5),
    case(T, "steps", ProfileConfig, steps=True),
    case(T, "steps", ProfileConfig, steps="2"),
    case(V, "cost", ProfileConfig, cost="wall"),
    case(T, "cost", ProfileConfig, cost=None),
    case(T, "formats", ProfileConfig, formats="mxfp8"),
    case(T, "formats", ProfileConfig, formats=["mxfp8"]),
    case(V, "formats entry", ProfileConfig, formats=("bf16",)),
    case(T, "formats entry", ProfileConfig, formats=(8,)),
    case(V, "max_grad_error", ProfileConfig, max_grad_error=-0.1),
    case(V, "max_grad_error", ProfileConfig, max_grad_error=nan),
    case(V, "max_grad_error", ProfileConfig, max_grad_error=inf),
    case(T, "max_grad_error", ProfileConfig, max_grad_error="0.1"),
    case(V, "min_pack_bytes", ProfileConfig, min_pack_bytes=-1),
    case(T, "min_pack_bytes", ProfileConfig, min_pack_bytes=1.5),
    case(V, "seed", ProfileConfig, seed=-1),
    case(T, "seed", ProfileConfig, seed=None),
    case(T, "seed", ProfileConfig, seed=1.0),
    # PlanConfig
    case(V, "solver", PlanConfig, solver="ilp"),
    case(T, "solver", PlanConfig, solver=1),
    case(T, "formats", PlanConfig, formats="mx4"),
    case(T, "formats", PlanConfig, formats=["mx4"]),
    case(V, "formats entry", PlanConfig, formats=("int8",)),
    case(T, "allow_none", PlanConfig, allow_none=1),
    case(V, "exact_max_groups", PlanConfig, exact_max_groups=-1),
    case(T, "exact_max_groups", PlanConfig, exact_max_groups=2.5),
    case(V, "node_limit", PlanConfig, node_limit=0),
    case(T, "node_limit", PlanConfig, node_limit=None),
    case(V, "bound_iters", PlanConfig, bound_iters=-1),
    case(T, "bound_iters", PlanConfig, bound_iters=1.0),
    # plan(profile, *, budget, region_budgets, config)
    case(T, "profile", plan, "profile", budget=1e9),
    case(T, "profile", plan, PLAN, budget=1e9),
    case(T, "config", plan, PROF, budget=1e9, config={}),
    case(T, "config", plan, PROF, budget=1e9, config=ONE),
    case(V, "budget or region_budgets", plan, PROF),
    case(V, "budget or region_budgets", plan, PROF, region_budgets={}),
    case(V, BELOW, plan, PROF, budget=-1),
    case(V, BELOW, plan, PROF, budget=0),
    case(V, BELOW, plan, PROF, budget=nan),
    case(V, BELOW, plan, PROF, budget=inf),
    case(V, BELOW, plan, PROF, budget=-inf),
    case(V, BELOW, plan, PROF, budget=FLOOR - 1),
    case(V, BELOW, plan, PROF, budget=FLOOR * 0.999),
    case(T, "budget", plan, PROF, budget="1GB"),
    case(T, "budget", plan, PROF, budget=True),
    case(T, "budget", plan, PROF, budget=torch.tensor(1e9)),
    case(T, "budget", plan, PROF, budget=[1e9]),
    case(T, "budget", plan, PROF, budget=1e9 + 0j),
    case(T, "region_budgets", plan, PROF, region_budgets=[("layers.0", 1e9)]),
    case(T, "region_budgets", plan, PROF, region_budgets="layers.0"),
    case(V, "region_budgets", plan, PROF, region_budgets={"nope": 1e9}),
    case(V, RB_BELOW, plan, PROF, region_budgets={"layers.1": RB_FLOOR - 1}),
    case(V, RB_BELOW, plan, PROF, region_budgets={"layers.1": -1}),
    case(V, RB_BELOW, plan, PROF, region_budgets={"layers.1": nan}),
    case(V, RB_BELOW, plan, PROF, region_budgets={"layers.1": inf}),
    case(T, "region_budgets['layers.1']", plan, PROF, region_budgets={"layers.1": "1GB"}),
    case(T, "region_budgets['layers.1']", plan, PROF, region_budgets={"layers.1": None}),
    case(V, "config.formats", plan, PROF, budget=1e15, config=PlanConfig(formats=("mxfp8",))),
    # apply(model, *, budget, region_budgets, regions, step_fn, sample_inputs, loss_fn, ...)
    case(T, "model", apply, "model", budget=1e9, step_fn=STEP),
    case(V, "step_fn or sample_inputs", _apply, doc=apply),
    case(V, "step_fn or sample_inputs", _apply, step_fn=STEP, sample_inputs=(X,), doc=apply),
    case(T, "sample_inputs", _apply, sample_inputs=[X], doc=apply),
    case(T, "sample_inputs", _apply, sample_inputs=X, doc=apply),
    case(T, "loss_fn", _apply, sample_inputs=(X,), loss_fn=3, doc=apply),
    case(V, "loss_fn", _apply, step_fn=STEP, loss_fn=torch.sum, doc=apply),
    case(V, "budget or region_budgets", _apply, budget=None, step_fn=STEP, doc=apply),
    case(T, "budget", _apply, budget="1GB", step_fn=STEP, doc=apply),
    case(T, "budget", _apply, budget=False, step_fn=STEP, doc=apply),
    case(T, "region_budgets", _apply, region_budgets=["layers.0"], step_fn=STEP, doc=apply),
    case(V, BELOW, _apply, budget=FLOOR - 1, step_fn=STEP, doc=apply),
    case(V, BELOW, _apply, budget=nan, step_fn=STEP, doc=apply),
    case(V, RB_BELOW, _apply, budget=None, region_budgets={"layers.1": 0}, step_fn=STEP, doc=apply),
    case(T, "step_fn", _apply, step_fn=3, doc=apply),
    case(T, "step_fn", _apply, step_fn=lambda m: None, doc=apply),
    case(T, "formats", _apply, step_fn=STEP, formats="mxfp8", doc=apply),
    case(T, "formats", _apply, step_fn=STEP, formats=["mxfp8"], doc=apply),
    case(V, "formats entry", _apply, step_fn=STEP, formats=("bf16",), doc=apply),
    case(V, "formats", _apply, step_fn=STEP, formats=("mxfp8",), compile=True, doc=apply),
    case(T, "verify", _apply, step_fn=STEP, verify=1, doc=apply),
    case(T, "compile", _apply, step_fn=STEP, compile="yes", doc=apply),
    case(T, "profile_config", _apply, step_fn=STEP, profile_config={}, doc=apply),
    case(T, "profile_config", _apply, step_fn=STEP, profile_config=PlanConfig(), doc=apply),
    case(T, "plan_config", _apply, step_fn=STEP, plan_config=ONE, doc=apply),
    case(T, "compile_kwargs", _apply, step_fn=STEP, compile_kwargs=3, doc=apply),
    case(V, "regions", _apply, step_fn=STEP, regions=["nope"], doc=apply),
    # apply_plan(model, plan_, *, compile, compile_kwargs) and AutoAC
    case(T, "model", apply_plan, "model", PLAN),
    case(T, "plan", apply_plan, MODEL, "plan"),
    case(T, "plan", apply_plan, MODEL, D),
    case(T, "compile", apply_plan, MODEL, PLAN, compile=1),
    case(T, "compile_kwargs", apply_plan, MODEL, PLAN, compile_kwargs=[("mode", "x")]),
    case(V, "plan has regions", apply_plan, OTHER, PLAN),
    case(V, "plan has regions", apply_plan, MODEL, PLAN_OTHER),
    case(T, "model", AutoAC, "model", PLAN),
    case(T, "plan", AutoAC, MODEL, {"plan": D}),
    case(T, "plan", _set_then_check, "plan", doc=AutoAC.set_plan),
    case(T, "plan", _set_then_check, D, doc=AutoAC.set_plan),
    case(V, "plan has regions", _set_then_check, PLAN_OTHER, doc=AutoAC.set_plan),
    case(T, "state", _load_then_check, [("plan", D)], doc=AutoAC.load_state_dict),
    case(V, "state", _load_then_check, {}, doc=AutoAC.load_state_dict),
    case(T, "state['plan']", _load_then_check, {"plan": 3}, doc=AutoAC.load_state_dict),
    case(V, "state['plan']", _load_then_check, {"plan": {}}, doc=AutoAC.load_state_dict),
    case(V, "plan has regions", _load_then_check, OTHER_STATE, doc=AutoAC.load_state_dict),
    # remove
    case(T, "model", remove, "model"),
    case(T, "model", remove, None),
    # measure_step(model, step_fn, *, track, seed, keep_grads)
    case(T, "model", measure_step, "model", STEP),
    case(T, "step_fn", measure_step, MODEL, None),
    case(T, "step_fn", measure_step, MODEL, lambda: X.sum()),
    case(T, "step_fn", measure_step, MODEL, lambda m: None),
    case(T, "step_fn", measure_step, MODEL, lambda m: m(X)),
    case(T, "step_fn", measure_step, MODEL, lambda m: torch.ones(())),
    case(T, "track", measure_step, MODEL, STEP, track=1),
    case(T, "keep_grads", measure_step, MODEL, STEP, keep_grads="yes"),
    case(T, "seed", measure_step, MODEL, STEP, seed="0"),
    case(T, "seed", measure_step, MODEL, STEP, seed=1.5),
    case(V, "seed", measure_step, MODEL, STEP, seed=-1),
    # resolve_regions(model, regions)
    case(T, "model", resolve_regions, "model", None),
    case(T, "regions", resolve_regions, MODEL, 3),
    case(T, "regions", resolve_regions, MODEL, int),
    case(T, "regions", resolve_regions, MODEL, [None]),
    case(V, "regions", resolve_regions, MODEL, "nope"),
    case(V, "regions", resolve_regions, MODEL, []),
    case(V, "regions", resolve_regions, MODEL, nn.Conv1d),
    case(V, "regions", resolve_regions, MODEL, nn.Linear(2, 2)),
    case(V, "regions", resolve_regions, MODEL, [MODEL.layers[0], MODEL.layers[0].fc1]),
    case(V, "regions", resolve_regions, nn.Linear(2, 2), None),
    # Span, MemoryTracker
    case(T, "fn", Span, 3),
    case(T, "fn", Span, None),
    case(T, "fn", Span, "torch.relu"),
    case(T, "record_ops", MemoryTracker, record_ops=1),
    case(T, "time_ops", MemoryTracker, time_ops="yes"),
    case(V, "device", MemoryTracker, device="gpu"),
    case(T, "device", MemoryTracker, device=1.5),
    case(T, "device", MemoryTracker, device=[0]),
    # Plan.from_dict (a saved plan: checked field by field, never cast)
    case(T, "d", Plan.from_dict, [("version", 1)]),
    case(T, "d", Plan.from_dict, None),
    case(V, "version", Plan.from_dict, {}),
    case(V, "version", Plan.from_dict, {**D, "version": 2}),
    case(V, "'regions'", Plan.from_dict, {k: v for k, v in D.items() if k != "regions"}),
    case(T, "d is not a plan", Plan.from_dict, {**D, "regions": None}),
    case(T, "d is not a plan", Plan.from_dict, {**D, "regions": [1]}),
    case(V, "mode", Plan.from_dict, _region(mode="full")),
    case(V, "decision", Plan.from_dict, _region(saves=[["aten.mm.default", 0, "bf16"]])),
    case(T, "occurrence", Plan.from_dict, _region(saves=[["aten.mm.default", 0.5, "keep"]])),
    case(T, "name", Plan.from_dict, _region(name=3)),
    case(T, "held_bytes", Plan.from_dict, _region(held_bytes=2.7)),
    case(V, "held_bytes", Plan.from_dict, _region(held_bytes=-1)),
    case(V, "added_s", Plan.from_dict, _region(added_s=nan)),
    case(T, "proven_optimal", Plan.from_dict, {**D, "proven_optimal": "no"}),
    case(T, "budget", Plan.from_dict, {**D, "budget": "1GB"}),
    case(T, "region_budgets", Plan.from_dict, {**D, "region_budgets": {"layers.0": 1.5}}),
    # formats
    case(V, "fmt", packed_nbytes, 32, "bf16"),
    case(V, "numel", packed_nbytes, -1, "mxfp8"),
    case(T, "numel", packed_nbytes, 1.5, "mxfp8"),
    case(V, "fmt", can_pack, torch.float32, 32, "fp16"),
    case(T, "fmt", can_pack, torch.float32, 32, None),
    case(T, "t", pack_storage, "tensor", "mxfp8"),
    case(V, "fmt", pack_storage, torch.ones(32), "fp4"),
    case(V, "t must be", pack_storage, torch.ones(33), "mxfp8"),
    case(V, "t must be", pack_storage, torch.ones(32, dtype=torch.int32), "mxfp8"),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 60


def test_fixture_is_meaningful():
    # The region-budget floor cases test a real floor, and a failed call left no wrapper.
    assert RB_FLOOR > 0 and FLOOR > 0
    assert not any("_autoac" in m.__dict__ for m in MODEL.modules())


def test_budget_beyond_int64_constrains_nothing():
    # Found by the fuzzing below: a budget of 2**63 bytes or more overflowed the solver's
    # int64 caps (OverflowError). It is a valid budget that constrains nothing.
    for b in (2.0**63, 1e300, 2**70):
        p = plan(PROF, budget=b, region_budgets={"layers.1": b})
        assert p.predicted_peak == PLAN.predicted_peak and p.budget == int(b)


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_JUNK = st.sampled_from([None, "1", True, [1], 1j, torch.tensor(1.0), object()])
_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**40), 2**40),
    st.sampled_from([FLOOR - 1, FLOOR, FLOOR + 1]),
)


def _ok_bytes(v, floor):
    return (
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= floor
    )


@_FUZZ
@given(budget=st.one_of(st.none(), _NUMBER, _JUNK), rb=st.one_of(st.none(), _NUMBER, _JUNK))
def test_fuzz_plan_budgets(budget, rb):
    region_budgets = None if rb is None else {"layers.1": rb}
    err = rejects_cleanly(plan, PROF, budget=budget, region_budgets=region_budgets, seconds=10)
    good = (budget is not None or rb is not None) and (
        (budget is None or _ok_bytes(budget, FLOOR)) and (rb is None or _ok_bytes(rb, RB_FLOOR))
    )
    assert (err is None) == good, err
    if good:
        p = plan(PROF, budget=budget, region_budgets=region_budgets)
        assert budget is None or p.predicted_peak <= budget
        assert rb is None or p.regions[1].held_bytes <= rb


_FIELD = st.one_of(
    st.integers(-3, 300_000), st.floats(-1, 2), st.sampled_from(["auto", "time"]), _JUNK
)


@_FUZZ
@given(
    field=st.sampled_from(["steps", "max_grad_error", "min_pack_bytes", "seed", "cost"]),
    value=_FIELD,
)
def test_fuzz_profile_config(field, value):
    err = rejects_cleanly(ProfileConfig, **{field: value})
    is_int = isinstance(value, int) and not isinstance(value, bool)
    good = {
        "steps": is_int and value >= 1,
        "min_pack_bytes": is_int and value >= 0,
        "seed": is_int and value >= 0,
        "max_grad_error": _ok_bytes(value, 0.0),
        "cost": value == "time",
    }[field]
    assert (err is None) == good, err


@_FUZZ
@given(
    field=st.sampled_from(
        ["solver", "exact_max_groups", "node_limit", "bound_iters", "allow_none"]
    ),
    value=st.one_of(_FIELD, st.booleans()),
)
def test_fuzz_plan_config(field, value):
    err = rejects_cleanly(PlanConfig, **{field: value})
    is_int = isinstance(value, int) and not isinstance(value, bool)
    good = {
        "solver": value == "auto",
        "exact_max_groups": is_int and value >= 0,
        "node_limit": is_int and value >= 1,
        "bound_iters": is_int and value >= 0,
        "allow_none": isinstance(value, bool),
    }[field]
    assert (err is None) == good, err
    if good and field != "solver":
        # A good config plans (an exact search of a few nodes stays fast).
        assert plan(PROF, budget=FLOOR, config=PlanConfig(**{field: value})).predicted_peak <= FLOOR


_NAMES = [n for n, _ in MODEL.named_modules() if n] + ["nope", "layers.*", "*", "layers.?.fc*"]


@_FUZZ
@given(
    regions=st.one_of(
        st.none(),
        st.sampled_from(_NAMES),
        st.lists(st.one_of(st.sampled_from(_NAMES), _JUNK), max_size=4),
        _JUNK,
    )
)
def test_fuzz_resolve_regions(regions):
    err = rejects_cleanly(resolve_regions, MODEL, regions)
    if err is None:
        mods, names = resolve_regions(MODEL, regions)
        assert len(mods) == len(names) >= 1
        named = {n or "<root>": m for n, m in MODEL.named_modules()}
        assert all(named[n] is m for n, m in zip(names, mods))
        # No region inside another.
        assert not any(a is not b and b in a.modules() for a in mods for b in mods)


@_FUZZ
@given(
    key=st.sampled_from(
        sorted(k for k in D if k != "version") + ["regions.0." + k for k in D["regions"][0]]
    ),
    value=st.one_of(_NUMBER, _JUNK, st.text(max_size=3), st.lists(st.integers(), max_size=2)),
)
def test_fuzz_plan_from_dict(key, value):
    # A saved plan with one field replaced by anything: a clean rejection, or the plan
    # that field describes (round-trips exactly: nothing was cast).
    if key.startswith("regions.0."):
        d = _region(**{key.removeprefix("regions.0."): value})
    else:
        d = {**D, key: value}
    err = rejects_cleanly(Plan.from_dict, d)
    if err is None:
        got = Plan.from_dict(d).to_dict()
        assert got == d or (key == "lower_bound_s" and value is None), (key, value)


_LOSSES = {
    "loss": lambda m: m(X).square().mean(),
    "vector": lambda m: m(X),
    "detached": lambda m: m(X).detach().sum(),
    "none": lambda m: None,
    "float": lambda m: 1.0,
    "two-element": lambda m: m(X)[0, :2].sum(0, keepdim=True).repeat(2),
}


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(sorted(_LOSSES)), measure=st.booleans())
def test_fuzz_step_fn_results(kind, measure):
    fn = measure_step if measure else profile
    kw = {} if measure else {"config": ONE}
    before = [p.grad for p in MODEL.parameters()]
    err = rejects_cleanly(fn, MODEL, _LOSSES[kind], seconds=10, **kw)
    assert (err is None) == (kind == "loss"), err
    # Success or not, the model is left as it was: gradients and no wrappers.
    assert all(a is b for a, b in zip(before, (p.grad for p in MODEL.parameters())))
    assert not any("_autoac" in m.__dict__ for m in MODEL.modules())
