"""Review of packing a region's inputs (0.1.18): adversarial callers.

Every test asserts the correct behaviour: an input is offered only where packing it
frees it (no other holder), ``pack_all``'s predicted peak is not under the measured one
by more than 10 %, gradients stay within ``max_grad_error`` and the key ``(INPUT, k)``
packs the ``k``-th distinct storage among the call's tensor arguments.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from autoac_cases import MLPBlock, attn_tower, measure_under, step_for
from torch import nn

from hyperrec import autoac
from hyperrec.autoac._exec import INPUT, input_storages
from hyperrec.autoac.profiler import grad_error

CFG = autoac.ProfileConfig(
    cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=4096, max_grad_error=0.05
)
PACK_ALL = autoac.PlanConfig(strategy="pack_all")
PACK_ALL_NO_INPUTS = autoac.PlanConfig(strategy="pack_all", pack_inputs=False)
TOL = 0.10


def _offered(prof) -> dict[str, list[tuple[str, int]]]:
    return {r.name: [o.key for o in r.ops if o.is_input] for r in prof.regions}


# --------------------------------------------------------------------------- blocks
class _Thin(nn.Module):
    """LayerNorm (saves the block's input) and one linear layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x))


class _Blk(nn.Module):
    """LayerNorm + 2x MLP, optional dropout; extra tensor args (positional / kw-only)."""

    def __init__(self, dim: int, p: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.p = p

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, *, z: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.ln(x)
        if y is not None:
            h = h * y  # saves y
        if z is not None:
            h = h + z.sin()  # saves z
        h = F.gelu(self.fc1(h))
        if self.p:
            h = F.dropout(h, self.p, self.training)
        return self.fc2(h)


class _Tower(nn.Module):
    def __init__(self, blk=_Blk, n: int = 3, dim: int = 32, seed: int = 3, **kw) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dim = dim
        self.inp = nn.Linear(dim, 2 * dim)
        self.layers = nn.ModuleList([blk(dim, **kw) for _ in range(n)])
        self.head = nn.Linear(dim, 1)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)[:, : self.dim].contiguous()


# ---- 1./2./3. another holder the trace shows: a node outside the regions whose backward
# reads the region's input *after* the region's recomputation
class _ReluBetween(nn.Module):
    """``x = relu(layer(x))`` in the caller: ReLU saves its output for its backward,
    which is the next layer's input; ReLU's backward runs after that layer's backward,
    so the ReLU node holds the input whatever the layer packs."""

    def __init__(self, n: int = 4, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Thin(dim) for _ in range(n)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)  # a Linear's output: nothing but layers.0 holds it
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class _GatedSkip(nn.Module):
    """``x = x * alpha + layer(x)`` (a learnable skip gate, computed before the layer):
    the product saves ``x`` for ``alpha``'s gradient and runs its backward after the
    layer's."""

    def __init__(self, n: int = 4, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Thin(dim) for _ in range(n)])
        self.alpha = nn.Parameter(torch.ones(n, dim))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = x * self.alpha[i] + layer(x)
        return self.head(x)


# region -> whether its input may be offered (no other holder)
_OUTSIDE_HOLDER = {
    "relu_between": (
        _ReluBetween,
        {"layers.0": True, "layers.1": False, "layers.2": False, "layers.3": False},
    ),  # fmt: skip
    "gated_skip": (_GatedSkip, {f"layers.{i}": False for i in range(4)}),
}


@pytest.fixture(scope="module")
def outside_holder_runs():
    out = {}
    x = torch.randn(512, 32)
    for name, (cls, _) in _OUTSIDE_HOLDER.items():
        model = cls()
        step = step_for(x)
        prof = autoac.profile(model, step, config=CFG)
        with_in = autoac.plan(prof, config=PACK_ALL)
        without = autoac.plan(prof, config=PACK_ALL_NO_INPUTS)
        out[name] = (
            prof,
            with_in,
            measure_under(model, step, with_in),
            measure_under(model, step, without),
            autoac.measure_step(model, step, keep_grads=True),
        )
    return out


@pytest.mark.parametrize("name", sorted(_OUTSIDE_HOLDER))
def test_input_held_by_a_node_outside_the_regions_is_not_offered(name, outside_holder_runs):
    prof = outside_holder_runs[name][0]
    expected = _OUTSIDE_HOLDER[name][1]
    got = {k: bool(v) for k, v in _offered(prof).items()}
    assert got == expected, _offered(prof)


@pytest.mark.parametrize("name", sorted(_OUTSIDE_HOLDER))
def test_pack_all_peak_is_not_under_predicted_when_a_node_holds_the_input(
    name, outside_holder_runs
):
    prof, p, m_in, m_out, ref = outside_holder_runs[name]
    assert grad_error(ref.grads, m_in.grads) <= CFG.max_grad_error
    ratio = m_in.peak_bytes / p.predicted_peak
    assert ratio <= 1 + TOL, (
        f"measured {m_in.peak_bytes} vs predicted {p.predicted_peak} ({ratio:.3f}x); "
        f"without inputs packed: measured {m_out.peak_bytes}"
    )


@pytest.mark.parametrize("name", sorted(_OUTSIDE_HOLDER))
def test_packing_inputs_does_not_raise_the_measured_peak(name, outside_holder_runs):
    """Packing an input another node holds frees nothing and adds its packed copy."""
    _, _, m_in, m_out, _ = outside_holder_runs[name]
    assert m_in.peak_bytes <= m_out.peak_bytes, (m_in.peak_bytes, m_out.peak_bytes)


# ---- 2./3. a Python reference the caller keeps (no op reads it): the trace, where every
# region is checkpointed and so holds its inputs itself, cannot tell it from no holder
class _Unrolled(nn.Module):
    """``h1 = l0(h0); h2 = l1(h1); ...``: every layer's input stays a local of the
    forward until it returns, so no input is freed in the forward, packed or not."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Thin(dim) for _ in range(4)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h0 = self.inp(x)
        h1 = self.layers[0](h0)
        h2 = self.layers[1](h1)
        h3 = self.layers[2](h2)
        h4 = self.layers[3](h3)
        return self.head(h4)


class _HiddenStates(nn.Module):
    """HF-style ``output_hidden_states``: the forward returns every layer's input; the
    step drops them only when the forward has returned (with thin layers the forward's
    end is the peak)."""

    def __init__(self, block=None, n: int = 8, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([(block or _Thin)(dim) for _ in range(n)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.inp(x)
        hs = []
        for layer in self.layers:
            hs.append(x)
            x = layer(x)
        return self.head(x), hs


_X1024 = torch.randn(1024, 32)
_PY_HOLDERS = {
    "unrolled_locals": (_Unrolled, step_for(_X1024)),
    "hidden_states_returned": (_HiddenStates, lambda m: m(_X1024)[0].square().mean()),
}


@pytest.mark.parametrize("name", list(_PY_HOLDERS))
def test_pack_all_peak_with_inputs_kept_by_python_references(name):
    make, step = _PY_HOLDERS[name]
    model = make()
    prof = autoac.profile(model, step, config=CFG)
    p = autoac.plan(prof, config=PACK_ALL)
    m_in = measure_under(model, step, p)
    m_out = measure_under(model, step, autoac.plan(prof, config=PACK_ALL_NO_INPUTS))
    ratio = m_in.peak_bytes / p.predicted_peak
    assert ratio <= 1 + TOL, (
        f"measured {m_in.peak_bytes} vs predicted {p.predicted_peak} ({ratio:.3f}x); "
        f"without inputs packed: measured {m_out.peak_bytes}; offered {_offered(prof)}"
    )


# --------------------------------------------------------------------------- regressions
# Callers that pass inputs in many shapes and ways; all should pack safely.
class _KwArgs(_Tower):
    def forward(self, x):
        h = self.inp(x)
        a, b = h[:, : self.dim].contiguous(), h[:, self.dim :].contiguous()
        for layer in self.layers:
            a, b = layer(a, b), b * 1.5  # two distinct activations, the second positional
        return self.head(a)


class _KwOnly(_Tower):
    def forward(self, x):
        h = self.inp(x)
        a, b = h[:, : self.dim].contiguous(), h[:, self.dim :].contiguous()
        for layer in self.layers:
            nb = b * 0.5
            a, b = layer(a, z=b), nb  # a keyword-only tensor
        return self.head(a)


class _Twice(_Tower):
    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = layer(h, h, z=h)  # one storage, three arguments
        return self.head(h)


class _Slice(_Tower):
    """The input is a slice of a bigger tensor whose other half the caller reads later."""

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            o = layer(h[:, : self.dim])
            h = torch.cat([o, h[:, self.dim :] + o], -1)
        return self.head(h[:, : self.dim] + h[:, self.dim :])


class _ColumnMajor(_Tower):
    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = h + layer(h.t().contiguous().t())  # non-contiguous input
        return self.head(h)


class _Expanded(_Tower):
    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = layer(h.unsqueeze(1).expand(-1, 4, -1)).mean(1)  # stride-0 input
        return self.head(h)


class _NoGradInput(_Tower):
    def forward(self, x):
        with torch.no_grad():
            h = self.first(x)  # an activation that does not require grad
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _Residual(_Tower):
    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = h + layer(h)  # residual done by the caller
        return self.head(h)


class _UsedAfter(_Tower):
    def forward(self, x):
        h = self.first(x)
        acc = 0
        for layer in self.layers:
            o = layer(h)
            acc = acc + h.sum()  # the caller reads the input after the region
            h = o
        return self.head(h) + acc


class _IntMixed(_Tower):
    def forward(self, x):
        h = self.first(x)
        idx = (x[:, :1] > 0).long()
        for layer in self.layers:
            h = layer(h, z=idx.float().expand_as(h).contiguous()) + idx
        return self.head(h)


class _Dropout(_Tower):
    def __init__(self):
        super().__init__(p=0.3)

    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class _ListCat(nn.Module):
    """The caller keeps every layer's output for a final concatenation."""

    def __init__(self, n: int = 4, dim: int = 48) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([MLPBlock(dim) for _ in range(n)])
        self.head = nn.Linear(dim * n, 1)

    def forward(self, x):
        x = self.inp(x)
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return self.head(torch.cat(outs, -1))


class _OnBatch(nn.Module):
    """The first region's input is the step's batch."""

    def __init__(self, n: int = 3, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([_Blk(dim) for _ in range(n)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Wide(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 8 * dim)
        self.fc2 = nn.Linear(8 * dim, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


class _WideTower(nn.Module):
    """The forward's peak is inside a region, while its input is still an argument of
    the running call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(64, 64)
        self.layers = nn.ModuleList([_Wide(64)])
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.layers[0](self.inp(x)))


def _bf16_residual():
    return _Residual().to(torch.bfloat16)


_X = torch.randn(512, 32)
_X48 = torch.randn(384, 48)
_PATTERNS = {
    "kwargs_two_inputs": (_KwArgs, step_for(_X)),
    "kw_only_input": (_KwOnly, step_for(_X)),
    "same_tensor_three_times": (_Twice, step_for(_X)),
    "slice_of_bigger": (_Slice, step_for(_X)),
    "column_major": (_ColumnMajor, step_for(_X)),
    "expanded": (_Expanded, step_for(_X)),
    "no_grad_input": (_NoGradInput, step_for(_X)),
    "caller_residual": (_Residual, step_for(_X)),
    "used_after_region": (_UsedAfter, step_for(_X)),
    "int_mixed": (_IntMixed, step_for(_X)),
    "dropout": (_Dropout, step_for(_X)),
    "list_cat": (_ListCat, step_for(_X48)),
    "hidden_states_dropped": (
        lambda: _HiddenStates(MLPBlock, n=4, dim=48),
        lambda m: m(_X48)[0].square().mean(),
    ),
    "batch_resident": (_OnBatch, step_for(_X)),
    "batch_clone": (_OnBatch, lambda m: m(_X.clone()).square().mean()),
    "batch_requires_grad": (_OnBatch, lambda m: m(_X.clone().requires_grad_()).square().mean()),
    "bf16": (_bf16_residual, step_for(_X.bfloat16())),
    "wide_single_region": (_WideTower, step_for(torch.randn(512, 64))),
    "attn_dropout": (
        lambda: attn_tower(n=2, dim=32, heads=4, p=0.1, seed=3),
        step_for(torch.randn(4, 64, 32)),
    ),
}


@pytest.mark.parametrize("name", list(_PATTERNS))
def test_caller_patterns_pack_inputs_safely(name):
    make, step = _PATTERNS[name]
    model = make()
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=CFG)
    for r in prof.regions:
        for o in r.ops:
            if o.is_input:
                (lv,) = o.storages
                assert lv.fwd_alloc < lv.fwd_free <= lv.rc_alloc <= lv.rc_free, (r.name, lv)
    p = autoac.plan(prof, config=PACK_ALL)
    m = measure_under(model, step, p)
    assert grad_error(ref.grads, m.grads) <= CFG.max_grad_error
    assert m.peak_bytes / p.predicted_peak <= 1 + TOL, (m.peak_bytes, p.predicted_peak)
    if name == "batch_resident":
        # the step's batch is resident: held by the caller anyway
        assert _offered(prof)["layers.0"] == []


# ---- 4. the key's k is the k-th distinct storage of the call's tensor arguments
class _Pair(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lna, self.lnb = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fa, self.fb = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, scale, idx, a, *, b, a_again=None):
        return self.fa(self.lna(a) * scale) + self.fb(self.lnb(b)) + idx.unsqueeze(-1)


class _PairModel(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.pa, self.pb = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.layers = nn.ModuleList([_Pair(dim)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        idx = (x[:, 0] > 0).long()
        a = self.pa(x)
        # k: 0 the buffer (resident), 1 idx (int), 2 a, 3 b; a[:4] shares a's storage
        return self.head(self.layers[0](self.scale, idx, a, b=self.pb(x), a_again=a[:4]))


def test_input_key_packs_the_argument_it_names():
    model = _PairModel()
    x = torch.randn(512, 32)
    step = step_for(x)
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=CFG)
    assert sorted(_offered(prof)["layers.0"]) == [(INPUT, 2), (INPUT, 3)]
    p = autoac.plan(prof, config=PACK_ALL)
    names = [n for n, _ in model.named_parameters()]
    for k, packed, exact in ((2, "lna.", "lnb."), (3, "lnb.", "lna.")):
        (r,) = p.regions
        only = dataclasses.replace(r, saves={(INPUT, k): "mxint8"})
        m = measure_under(model, step, dataclasses.replace(p, regions=(only,)))
        assert grad_error(ref.grads, m.grads) <= CFG.max_grad_error
        diff = {n: not torch.equal(g0, g1) for n, g0, g1 in zip(names, ref.grads, m.grads)}
        # only the LayerNorm that saved the packed argument sees a quantized input
        assert diff[f"layers.0.{packed}weight"], (k, diff)
        assert not diff[f"layers.0.{exact}weight"], (k, diff)
        assert not diff[f"layers.0.{exact}bias"], (k, diff)
    # the runtime numbers the same call the same way
    a = torch.randn(4, 32)
    b = torch.randn(4, 32)
    idx = torch.zeros(4, dtype=torch.long)
    got = input_storages(((model.scale, idx, a), {"b": b, "a_again": a[:2]}))
    assert [t is u for t, u in zip(got, (model.scale, idx, a, b))] == [True] * 4
    assert len(got) == 4


# ---- the bound: an input class too sensitive to pack is not packed
class _Offset(nn.Module):
    """Each layer's input carries a large common offset that its LayerNorm removes:
    quantized, the LayerNorm's backward sees mostly rounding error."""

    def __init__(self, n: int = 3, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Blk(dim) for _ in range(n)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h + 300.0)
        return self.head(h)


def test_inputs_too_sensitive_to_pack_stay_unpacked():
    model = _Offset()
    step = step_for(torch.randn(512, 32))
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=CFG)
    assert prof.pack_errors[(INPUT, "mxint8")] > CFG.max_grad_error
    assert all(not o.formats for r in prof.regions for o in r.ops if o.is_input)
    p = autoac.plan(prof, config=PACK_ALL)
    assert all(k[0] != INPUT for r in p.regions for k in r.saves)
    m = measure_under(model, step, p)
    assert grad_error(ref.grads, m.grads) <= CFG.max_grad_error


# ---- other holders the trace shows: two regions, one storage
class _TwoSlices(nn.Module):
    """Two regions take two halves of one storage: packing one half's storage in one
    region frees nothing (the other region holds the storage)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, 2 * dim)
        self.layers = nn.ModuleList([_Blk(dim), _Blk(dim)])
        self.head = nn.Linear(dim, 1)
        self.dim = dim

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.layers[0](h[:, : self.dim]) * self.layers[1](h[:, self.dim :]))


class _Doubled(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return F.gelu(self.fc(x * 2.0))  # saves x * 2, not x


class _CallerWrites(nn.Module):
    """The caller writes into a region's input after the region returned (the region
    does not save it, so the step is valid): the input is not offered."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Doubled(dim)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        y = self.layers[0](h)
        g = h.detach()
        g.mul_(0.5)  # writes h's storage
        return self.head(y) + g.sum()


@pytest.mark.parametrize("cls", [_TwoSlices, _CallerWrites])
def test_inputs_with_a_visible_other_holder_are_not_offered(cls):
    model = cls()
    step = step_for(torch.randn(512, 32))
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=CFG)
    assert all(not v for v in _offered(prof).values()), _offered(prof)
    m = measure_under(model, step, autoac.plan(prof, config=PACK_ALL))
    assert grad_error(ref.grads, m.grads) <= CFG.max_grad_error
