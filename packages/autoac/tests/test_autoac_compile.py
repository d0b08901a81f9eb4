"""Plans under torch.compile (CPU, ``aot_eager_decomp_partition``: AOT autograd with the
min-cut partitioner, no code generation)."""

from __future__ import annotations

import pytest
import torch
from autoac_cases import mlp_tower, step_for
from torch.utils.checkpoint import CheckpointPolicy

from hyperrec import autoac
from hyperrec.autoac import _exec
from hyperrec.autoac import runtime as rt

BACKEND = {"backend": "aot_eager_decomp_partition"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def _profiled(n):
    """A tower of ``n`` MLP blocks, its step, reference gradients, profile and the plan
    of an unlimited budget."""
    model = mlp_tower(n=n)
    step = step_for(torch.randn(64, 32))
    ref = autoac.measure_step(model, step, keep_grads=True).grads
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(cost="flops", steps=1))
    return model, step, ref, prof, autoac.plan(prof, budget=1e15)


def _compiled_grads(model, p, step):
    h = autoac.apply_plan(model, p, compile=True, compile_kwargs=BACKEND)
    try:
        return autoac.measure_step(model, step, keep_grads=True, track=False).grads
    finally:
        h.remove()


def _setup():
    model, step, ref, prof, base = _profiled(2)
    p = autoac.plan(
        prof,
        budget=base.floor + 0.5 * (base.no_ac_peak - base.floor),
        config=autoac.PlanConfig(formats=(), allow_none=False),
    )
    assert any(r.saves for r in p.regions)
    return model, step, ref, p


def test_compiled_regions_follow_the_policy(monkeypatch):
    assert autoac.compile_mechanism() == "sac"
    model, step, ref, p = _setup()
    seen = []
    orig = _exec._policy

    def spy(func, args, kwargs, decision):
        out = orig(func, args, kwargs, decision)
        seen.append((str(func), decision, out))
        return out

    monkeypatch.setattr(_exec, "_policy", spy)
    assert _close(ref, _compiled_grads(model, p, step))
    kept = {(op, d) for op, d, pol in seen if pol is CheckpointPolicy.MUST_SAVE}
    planned = {(k[0], d) for r in p.regions for k, d in r.saves.items()}
    traced = {op for op, _, _ in seen}
    # Every kept op of the plan that the trace still contains was marked MUST_SAVE; ops
    # the compiler decomposes (here GELU) are the partitioner's to choose.
    assert {(op, d) for op, d in planned if op in traced} <= kept
    assert any(op == "aten.addmm.default" for op, _ in planned & kept)


def test_whole_model_compile_after_eager_apply():
    model, step, ref, p = _setup()
    h = autoac.apply_plan(model, p)
    try:
        cm = torch.compile(model, **BACKEND)
        got = autoac.measure_step(cm, step, keep_grads=True, track=False).grads
    finally:
        h.remove()
    assert _close(ref, got)


def test_memory_budget_fallback(monkeypatch):
    model, step, ref, p = _setup()
    monkeypatch.setattr(rt, "compile_mechanism", lambda: "memory_budget")
    h = autoac.apply_plan(model, p, compile=True, compile_kwargs=BACKEND)
    try:
        assert h.mechanism == "memory_budget"
        got = autoac.measure_step(model, step, keep_grads=True, track=False).grads
    finally:
        h.remove()
    assert _close(ref, got)
    for r in p.regions:
        assert 0.0 <= r.saved_fraction <= 1.0


def test_packed_regions_stay_eager_under_compile():
    model = mlp_tower(n=2)
    with pytest.raises(ValueError, match="compile"):
        autoac.apply(
            model, budget=1e9, sample_inputs=(torch.randn(8, 32),), formats=("mxfp8",), compile=True
        )


def test_profiling_adds_nothing_to_the_models_compile_caches():
    """A model whose blocks call a ``torch.compile``d function (as the integration model
    does for its small ops): profiling and verification run it eagerly, so the training
    steps after ``apply`` compile it once, as without autoac. Before, each profiling
    context compiled its own variant, which counts against Dynamo's recompile limit."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    gelu_mul = torch.compile(lambda h: torch.nn.functional.gelu(h) * 1.5, backend=counting)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

        def forward(self, x):
            return x + self.fc2(gelu_mul(self.fc1(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    step = step_for(torch.randn(64, 32))
    handle = autoac.apply(
        model,
        budget=1e12,
        step_fn=step,
        profile_config=autoac.ProfileConfig(cost="time", steps=1),
    )
    assert handle.verification is not None
    assert graphs == []  # nothing compiled while profiling or verifying
    step(model).backward()
    compiled = len(graphs)
    assert compiled >= 1
    for _ in range(2):
        step(model).backward()
    assert len(graphs) == compiled


def test_regions_stay_compiled_past_dynamos_recompile_limit():
    """The layers share one code object, so each region's plan and each new plan is one
    more compiled entry of it; past ``recompile_limit`` Dynamo would run the layers
    eagerly for good, the plan silently out of force (seen on the GPU: a no-AC peak
    under a packed Llama plan). Here the limit starts at 1 and hitting it is an error:
    the regions must make the room they need."""
    import torch._dynamo.config as dconfig

    model, step, ref, prof, base = _profiled(4)
    modes = set()
    with dconfig.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for f in (0.7, 0.4, 0.1):
            p = autoac.plan(prof, budget=base.floor + f * (base.no_ac_peak - base.floor))
            modes |= {r.mode for r in p.regions}
            assert _close(ref, _compiled_grads(model, p, step))
        assert dconfig.recompile_limit > 1
    assert modes == {"none", "sac"}  # both kinds of region were compiled
