"""MXINT8 packed saves traced into compiled regions (``_compiled_pack``).

CPU: ``aot_eager_decomp_partition`` (AOTAutograd with the min-cut partitioner, where the
hooks are inlined) for the plans, Inductor once for the fused code."""

from __future__ import annotations

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
    with torch.no_grad():
        assert torch.equal(cm(x), m(x)) or backend == "inductor"  # the forward is exact


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
    model = mlp_tower(n=3, dim=64)
    step = step_for(torch.randn(128, 64))
    ref = autoac.measure_step(model, step, keep_grads=True).grads
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    )
    base = autoac.plan(prof, budget=1e15)
    out = []
    for f in (0.0, 0.8):  # checkpointed regions with packed saves; un-checkpointed ones
        p = autoac.plan(prof, budget=base.floor + f * (base.no_ac_peak - base.floor))
        assert p.packed
        out.append(p)
    return model, step, ref, out


def test_compiled_plans_pack_in_the_graph_not_eagerly(monkeypatch):
    model, step, ref, plans = _plans()
    eager = []
    orig = rt._eager_region
    monkeypatch.setattr(rt, "_eager_region", lambda *a, **k: (eager.append(1), orig(*a, **k))[1])
    modes = set()
    for p in plans:
        torch._dynamo.reset()
        h = autoac.apply_plan(model, p, compile=True, compile_kwargs=BACKEND)
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
    model = mlp_tower(n=3, dim=64)
    step = step_for(torch.randn(128, 64))
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(cost="flops", steps=1))
    base = autoac.plan(prof, budget=1e15)
    with pytest.raises(ValueError, match="mxfp8"):
        autoac.apply(model, budget=base.no_ac_peak, step_fn=step, formats=("mxfp8",), compile=True)
    h = autoac.apply(
        model,
        budget=base.floor,
        step_fn=step,
        formats=("mxint8",),
        compile=True,
        compile_kwargs=BACKEND,
        profile_config=autoac.ProfileConfig(cost="flops", steps=1),
    )
    try:
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
    try:
        autoac.measure_step(model, step, track=True)
        assert graphs == []
        autoac.measure_step(model, step, track=False)
        assert len(graphs) >= 2  # the plain regions share one graph; the packing one has its own
    finally:
        h.remove()


def test_compiled_plans_price_packing_without_the_eager_call():
    model = mlp_tower(n=2, dim=64)
    step = step_for(torch.randn(128, 64))
    prof = autoac.profile(
        model, step, config=autoac.ProfileConfig(cost="time", steps=1, formats=("mxint8", "mxfp8"))
    )
    c = autoac.for_compiled_packing(prof).pack_costs
    assert c["mxint8"]["pack_call_s"] == c["mxint8"]["unpack_call_s"] == 0.0
    for k in ("pack_per_elem_s", "unpack_per_elem_s"):
        assert c["mxint8"][k] == prof.pack_costs["mxint8"][k]
    assert c["mxfp8"] == prof.pack_costs["mxfp8"]  # packs eagerly: its costs stay
    assert prof.pack_costs["mxint8"]["pack_call_s"] + prof.pack_costs["mxint8"]["unpack_call_s"] > 0
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
