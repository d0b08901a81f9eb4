"""MXINT8 packed saves traced into compiled regions (``_compiled_pack``).

CPU: ``aot_eager_decomp_partition`` (AOTAutograd with the min-cut partitioner, where the
hooks are inlined) for the plans, Inductor once for the fused code."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import mlp_tower, step_for
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec import autoac
from hyperrec.autoac import _compiled_pack as cp
from hyperrec.autoac import formats
from hyperrec.autoac import runtime as rt
from hyperrec.autoac._exec import RegionDecisions
from hyperrec.autoac.profiler import grad_error

BACKEND = {"backend": "aot_eager_decomp_partition"}

pytestmark = pytest.mark.skipif(
    not cp.compiled_packing_supported(), reason="torch does not inline saved-tensor hooks"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _special(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, :32] = 0  # an all-zero block
    x[1, 3] = float("nan")
    x[2, 40] = float("-inf")
    x[3, 5] = torch.finfo(x.dtype).tiny / 4 if x.dtype != torch.float16 else 1e-7
    x[4, 33] = torch.finfo(x.dtype).max
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    rows=st.integers(5, 12),
    blocks=st.integers(2, 4),
    decades=st.integers(0, 30),
    seed=st.integers(0, 2**16),
)
def test_flat_pack_writes_the_bytes_of_quantize_mxint8(dtype, rows, blocks, decades, seed):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-decades, decades, rows) if dtype != torch.float16 else torch.ones(rows)
    x = _special((torch.randn(rows, 32 * blocks, generator=g) * spread[:, None]).to(dtype))
    ref = formats.quantize_mxint8(x.reshape(-1, 32), backend="torch")
    data, scale = cp.mxint8_pack_flat(x)
    assert torch.equal(data, ref.data)
    assert torch.equal(scale, ref.scale.reshape(-1))
    back = cp.mxint8_unpack_flat(data, scale, dtype, x.shape)
    assert back.shape == x.shape and back.dtype == dtype
    assert _same(back.reshape(-1, 32), formats.dequantize_mxint8(ref, dtype, backend="torch"))


def test_flat_pack_compiled_by_inductor_writes_the_same_bytes():
    x = _special(torch.randn(16, 96, dtype=torch.bfloat16) * 3)
    data, scale = cp.mxint8_pack_flat(x)
    cdata, cscale = torch.compile(cp.mxint8_pack_flat, backend="inductor")(x)
    assert torch.equal(cdata, data) and torch.equal(cscale, scale)
    back = torch.compile(cp.mxint8_unpack_flat, backend="inductor")(data, scale, x.dtype, x.shape)
    assert _same(back, cp.mxint8_unpack_flat(data, scale, x.dtype, x.shape))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.silu(self.fc1(self.ln(x))) * 2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_hooks_pack_the_named_classes_inside_the_graph(backend):
    torch.manual_seed(0)
    m, x = _Block(), torch.randn(32, 64, requires_grad=True)
    m(x).square().sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    pack, unpack, counts = cp.pack_hooks({"aten.addmm.default": "mxint8"}, 0)
    cm = torch.compile(m, backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = cm(x)
    saved = y.grad_fn.saved_tensors
    # the first linear's (32, 128) fp32 output is held as int8 elements + E8M0 scales
    assert any(t.dtype == torch.int8 and t.numel() == 32 * 128 for t in saved)
    assert any(t.dtype == torch.uint8 and t.numel() == 32 * 128 // 32 for t in saved)
    assert counts  # the hook chose a node while the graph was built
    y.square().sum().backward()
    got = [p.grad for p in m.parameters()]
    err = grad_error(ref, got)
    assert 0 < err < 0.01  # packed (not exact), within MXINT8's error
    # packing does not touch the forward: bit-identical without code generation, and
    # within Inductor's reassociation with it
    with torch.no_grad():
        out, ref_out = cm(x), m(x)
    if backend == "inductor":
        torch.testing.assert_close(out, ref_out)
    else:
        assert torch.equal(out, ref_out)


def test_hooks_outside_graph_building_leave_saves_alone():
    pack, unpack, counts = cp.pack_hooks({"aten.mm.default": "mxint8"}, 0)
    a = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = (a @ a).sin()
    y.sum().backward()
    expect = torch.autograd.grad((a @ a).sin().sum(), a)[0]
    assert torch.equal(a.grad, expect) and counts == {}


def test_pack_hooks_reject_eager_only_formats():
    with pytest.raises(ValueError, match="classes"):
        cp.pack_hooks({"aten.mm.default": "mxfp8"}, 0)


def test_packed_classes_of_a_region():
    mm, gelu = "aten.mm.default", "aten.gelu.default"
    d = RegionDecisions("sac", {(mm, 0): "mxint8", (mm, 1): "keep", (gelu, 0): "mxint8"})
    assert rt._packed_classes(d) == {mm: "mxint8", gelu: "mxint8"}
    assert rt._packed_classes(RegionDecisions("sac", {(mm, 0): "keep"})) is None
    mixed = RegionDecisions("none", {(mm, 0): "mxint8", (mm, 1): "mxfp8"})
    assert rt._packed_classes(mixed) is None


def _plans():
    """Two plans with MXINT8 saves, built from the profile (not left to the planner,
    whose choice on the CPU follows measured rates and the machine's load): layer 0
    checkpointed keeping its first packable save packed; layer 1 un-checkpointed with
    every packable save packed; the rest as planned at the floor."""
    model = mlp_tower(n=3, dim=64)
    step = step_for(torch.randn(128, 64))
    ref = autoac.measure_step(model, step, keep_grads=True).grads
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    )
    base = autoac.plan(prof, budget=autoac.plan(prof, budget=1e15).floor)
    packable = [[o.key for o in r.ops if o.needed and "mxint8" in o.formats] for r in prof.regions]
    assert packable[0] and packable[1]
    regions = list(base.regions)
    regions[0] = dataclasses.replace(regions[0], mode="sac", saves={packable[0][0]: "mxint8"})
    sac = dataclasses.replace(base, regions=tuple(regions))
    regions = list(base.regions)
    regions[1] = dataclasses.replace(
        regions[1], mode="none", saves=dict.fromkeys(packable[1], "mxint8")
    )
    none = dataclasses.replace(base, regions=tuple(regions))
    assert sac.packed and none.packed
    return model, step, ref, [sac, none]


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_plans_pack_in_the_graph_not_eagerly(monkeypatch, dynamic):
    """``dynamic=True``: the selective-checkpoint policy's decisions used to become
    symbolic ints there, the checkpoint a graph break run eagerly, and the packed saves
    of a checkpointed region were then never packed (silently: more memory than
    planned). No graph break is allowed now."""
    from torch._dynamo.utils import counters

    model, step, ref, plans = _plans()
    eager = []
    orig = rt._eager_region
    monkeypatch.setattr(rt, "_eager_region", lambda *a, **k: (eager.append(1), orig(*a, **k))[1])
    modes = set()
    counters.clear()
    for p in plans:
        torch._dynamo.reset()
        kwargs = BACKEND if dynamic is None else {**BACKEND, "dynamic": dynamic}
        h = autoac.apply_plan(model, p, compile=True, compile_kwargs=kwargs)
        try:
            got = autoac.measure_step(model, step, keep_grads=True, track=False).grads
            packed = {n for n, nodes in h.packed_in_graph.items() if nodes}
        finally:
            h.remove()
        quantized = {r.name for r in p.regions if any(d == "mxint8" for d in r.saves.values())}
        modes |= {r.mode for r in p.regions if r.name in quantized}
        assert packed == quantized
        assert 0 < grad_error(ref, got) < 0.01
    assert modes == {"sac", "none"}
    assert eager == []
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_without_support_packed_regions_run_eagerly(monkeypatch):
    model, step, ref, plans = _plans()
    monkeypatch.setattr(rt, "compiled_packing_supported", lambda: False)
    eager = []
    orig = rt._eager_region
    monkeypatch.setattr(rt, "_eager_region", lambda *a, **k: (eager.append(1), orig(*a, **k))[1])
    h = autoac.apply_plan(model, plans[0], compile=True, compile_kwargs=BACKEND)
    try:
        got = autoac.measure_step(model, step, keep_grads=True, track=False).grads
        assert h.packed_in_graph == {}
    finally:
        h.remove()
    assert eager and 0 < grad_error(ref, got) < 0.01
    with pytest.raises(ValueError, match="inline"):
        autoac.apply(model, budget=1e9, step_fn=step, formats=("mxint8",), compile=True)


def test_apply_compiled_with_mxint8_verifies_the_error():
    model, step, _, plans = _plans()
    with pytest.raises(ValueError, match="mxfp8"):
        autoac.apply(model, budget=1e12, step_fn=step, formats=("mxfp8",), compile=True)
    # apply's verification step on a compiled plan with packed saves (a plan made here:
    # whether the planner packs on the CPU depends on measured rates)
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    )
    base = autoac.plan(prof, budget=1e15)
    h = autoac.apply_plan(model, plans[1], compile=True, compile_kwargs=BACKEND)
    h.profile = prof
    try:
        rt._verify(h, step, base.no_ac_peak, None, None)
        v = h.verification
        assert v is not None and h.plan.packed
        # verified on the CPU under the memory tracker: the plan ran eagerly, packed
        assert v["grad_error"] is not None and 0 < v["grad_error"] <= v["max_grad_error"]
        autoac.measure_step(model, step, track=False)
        assert any(h.packed_in_graph.values())
    finally:
        h.remove()


def test_a_tracked_step_does_not_stop_the_regions_compiling():
    """Dynamo does not compile a frame first called under a dispatch mode and then skips
    it for good: before, a compiled plan verified on the CPU (the tracker is a dispatch
    mode) never compiled its regions afterwards. Tracked steps now run the plan eagerly."""
    model, step, _, plans = _plans()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h = autoac.apply_plan(model, plans[1], compile=True, compile_kwargs={"backend": counting})
    # a compiled function of the model outside the regions: the same holds for it
    head = model.head.forward
    model.head.forward = torch.compile(head, backend=counting)
    try:
        autoac.measure_step(model, step, track=True)
        assert graphs == []
        autoac.measure_step(model, step, track=False)
        # the plain regions share one graph, the packing one has its own, the head one
        assert len(graphs) >= 3
    finally:
        h.remove()
        model.head.forward = head


def test_compiled_plans_price_packing_without_the_eager_call():
    model = mlp_tower(n=2, dim=64)
    step = step_for(torch.randn(128, 64))
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    )
    eager = {
        "pack_per_elem_s": 1e-9,
        "pack_call_s": 1e-4,
        "unpack_per_elem_s": 2e-9,
        "unpack_call_s": 5e-5,
        "pack_ws_per_elem": 0.0,
        "unpack_ws_per_elem": 0.0,
    }
    prof = dataclasses.replace(prof, pack_costs={"mxint8": dict(eager), "mxfp8": dict(eager)})
    c = autoac.for_compiled_packing(prof).pack_costs
    assert c["mxint8"] == {**eager, "pack_call_s": 0.0, "unpack_call_s": 0.0}
    assert c["mxfp8"] == eager  # packs eagerly: its costs stay
    assert prof.pack_costs["mxint8"] == eager  # the profile given is left as it was
    with pytest.raises(TypeError, match="profile_"):
        autoac.for_compiled_packing("profile")
    h = autoac.apply(
        model,
        budget=1e12,
        step_fn=step,
        formats=("mxint8",),
        compile=True,
        compile_kwargs=BACKEND,
        profile_config=autoac.ProfileConfig(cost="time", steps=1),
        verify=False,
    )
    try:
        assert h.profile is not None
        assert h.profile.pack_costs["mxint8"]["pack_call_s"] == 0.0
    finally:
        h.remove()


def test_hooks_under_dynamic_shapes_pack_every_batch_size():
    torch.manual_seed(0)
    m = _Block()
    pack, unpack, counts = cp.pack_hooks({"aten.addmm.default": "mxint8"}, 0)
    cm = torch.compile(m, backend="aot_eager", dynamic=True)
    for n in (32, 48, 7):  # 7 x 128 elements: still whole blocks of 32
        x = torch.randn(n, 64)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = cm(x)
        assert any(t.dtype == torch.int8 for t in y.grad_fn.saved_tensors)
        y.square().sum().backward()
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(x).square().sum().backward()
        ref = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        assert 0 < grad_error(ref, got) < 0.01


def test_eager_packed_regions_leave_the_models_compiled_functions_compiling():
    """A model whose blocks call a ``torch.compile``d function, with an eager plan that
    packs saves: the packed regions run under autoac's dispatch modes, and a compiled
    function first called there was skipped by Dynamo for good (every block then ran it
    eagerly). Packed regions now run the model's compiled functions under force_eager."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def gelu_mul(h):
        return torch.nn.functional.gelu(h) * 1.5

    compiled = torch.compile(gelu_mul, backend=counting)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            return x + self.fc2(compiled(self.fc1(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    step = step_for(torch.randn(128, 64))
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    )
    free = autoac.plan(prof, budget=1e15)
    packable = [o.key for o in prof.regions[0].ops if o.needed and "mxint8" in o.formats]
    assert packable
    for mode in ("none", "sac"):
        torch._dynamo.reset()
        graphs.clear()
        regions = list(free.regions)
        regions[0] = dataclasses.replace(
            regions[0], mode=mode, saves=dict.fromkeys(packable, "mxint8")
        )
        h = autoac.apply_plan(model, dataclasses.replace(free, regions=tuple(regions)))
        try:
            step(model).backward()  # block 0 first: packed, under autoac's modes
            assert len(graphs) >= 1  # blocks 1 and 2 still compiled the function
        finally:
            h.remove()
