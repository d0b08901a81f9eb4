"""Bad-input catalogue of hyperrec.parallel5d: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's docstring. ``fully_shard`` cases run on a fake 2-rank
mesh: every check happens before any collective (and before any parameter moves).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d import (
    AdamW8bit,
    FSDPModule,
    MixedPrecisionPolicy,
    Muon,
    dbuffers,
    full_state_dict,
    fully_shard,
)
from hyperrec.parallel5d import fsdp as fsdp_module
from hyperrec.testing import fake_mesh
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
nan, inf = math.nan, math.inf
W = [torch.ones(4, 4)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _fs(module=None, mesh_shape=(2,), **kwargs):
    """fully_shard on a fake mesh; a rejected call must leave the module untouched."""
    with fake_mesh(mesh_shape) as mesh:
        m = _model() if module is None else module
        before = (
            {k: v.clone() for k, v in m.state_dict().items()} if isinstance(m, nn.Module) else {}
        )
        kwargs.setdefault("mesh", mesh)
        try:
            return fully_shard(m, **kwargs)
        finally:
            if isinstance(m, nn.Module) and not isinstance(m, FSDPModule):
                after = m.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)


def _sharded(fn):
    with fake_mesh((2,)) as mesh:
        return fn(fully_shard(_model(), mesh=mesh))


def _foreign_param():
    return nn.Parameter(torch.ones(3))


CASES = [
    # MixedPrecisionPolicy
    case(T, "param_dtype", MixedPrecisionPolicy, param_dtype=torch.int32),
    case(T, "param_dtype", MixedPrecisionPolicy, param_dtype=torch.complex64),
    case(T, "param_dtype", MixedPrecisionPolicy, param_dtype="bf16"),
    case(T, "reduce_dtype", MixedPrecisionPolicy, reduce_dtype=torch.int64),
    case(T, "reduce_dtype", MixedPrecisionPolicy, reduce_dtype=32),
    case(T, "output_dtype", MixedPrecisionPolicy, output_dtype=torch.bool),
    case(T, "cast_forward_inputs", MixedPrecisionPolicy, cast_forward_inputs=1),
    case(T, "cast_forward_inputs", MixedPrecisionPolicy, cast_forward_inputs=None),
    # fully_shard
    case(T, "module", _fs, "x", doc=fully_shard),
    case(T, "module", _fs, nn.Linear, doc=fully_shard),
    case(T, "mesh", _fs, mesh="cpu", doc=fully_shard),
    case(T, "mesh", _fs, mesh=2, doc=fully_shard),
    case(V, "mesh", _fs, mesh_shape=(2, 1, 1), doc=fully_shard),
    case(T, "reshard_after_forward", _fs, reshard_after_forward="yes", doc=fully_shard),
    case(T, "reshard_after_forward", _fs, reshard_after_forward=2.0, doc=fully_shard),
    case(V, "reshard_after_forward", _fs, reshard_after_forward=3, doc=fully_shard),
    case(V, "reshard_after_forward", _fs, reshard_after_forward=0, doc=fully_shard),
    case(T, "mp_policy", _fs, mp_policy="bf16", doc=fully_shard),
    case(T, "mp_policy", _fs, mp_policy=torch.bfloat16, doc=fully_shard),
    case(V, "granularity", _fs, granularity="rows?", doc=fully_shard),
    case(V, "granularity", _fs, granularity=0, doc=fully_shard),
    case(V, "granularity", _fs, granularity=-64, doc=fully_shard),
    case(T, "granularity", _fs, granularity=2.5, doc=fully_shard),
    case(T, "granularity", _fs, granularity=True, doc=fully_shard),
    case(T, "granularity", _fs, granularity=lambda fqn, p: 2.5, doc=fully_shard),
    case(V, "granularity", _fs, granularity=lambda fqn, p: "blocks", doc=fully_shard),
    case(T, "ignored_params", _fs, ignored_params=[_foreign_param(), 3], doc=fully_shard),
    case(T, "ignored_params", _fs, ignored_params=torch.ones(3), doc=fully_shard),
    case(T, "ignored_params", _fs, ignored_params={3}, doc=fully_shard),
    case(T, "ignored_params", _fs, ignored_params="weight", doc=fully_shard),
    case(V, "alignment", _fs, alignment=0, doc=fully_shard),
    case(T, "alignment", _fs, alignment=64.0, doc=fully_shard),
    case(T, "alignment", _fs, alignment=True, doc=fully_shard),
    case(V, "already applied", lambda: _sharded(lambda m: fully_shard(m)), doc=fully_shard),
    case(RuntimeError, "process group", fully_shard, nn.Linear(2, 2)),
    # FSDPModule methods
    case(
        T,
        "requires_gradient_sync",
        lambda: _sharded(lambda m: m.set_requires_gradient_sync("no")),
        doc=FSDPModule.set_requires_gradient_sync,
    ),
    case(
        T,
        "reshard_after_forward",
        lambda: _sharded(lambda m: m.set_reshard_after_forward(None)),
        doc=FSDPModule.set_reshard_after_forward,
    ),
    case(
        T,
        "reshard_after_backward",
        lambda: _sharded(lambda m: m.set_reshard_after_backward(2)),
        doc=FSDPModule.set_reshard_after_backward,
    ),
    case(
        T,
        "recurse",
        lambda: _sharded(lambda m: m.set_requires_gradient_sync(True, recurse="yes")),
        doc=FSDPModule.set_requires_gradient_sync,
    ),
    case(
        V,
        "modules",
        lambda: _sharded(lambda m: m.set_modules_to_forward_prefetch([nn.Linear(2, 2)])),
        doc=FSDPModule.set_modules_to_forward_prefetch,
    ),
    case(
        T,
        "modules",
        lambda: _sharded(lambda m: m.set_modules_to_forward_prefetch(nn.Linear(2, 2))),
        doc=FSDPModule.set_modules_to_forward_prefetch,
    ),
    case(
        T,
        "modules",
        lambda: _sharded(lambda m: m.set_modules_to_backward_prefetch(["a"])),
        doc=FSDPModule.set_modules_to_backward_prefetch,
    ),
    case(T, "module", full_state_dict, "x"),
    case(
        V,
        "device",
        lambda: _sharded(lambda m: full_state_dict(m, device="gpu")),
        doc=full_state_dict,
    ),
    case(T, "module", dbuffers, None),
    # Muon
    case(T, "lr", Muon, W, lr="x"),
    case(V, "lr", Muon, W, lr=0.0),
    case(V, "lr", Muon, W, lr=nan),
    case(V, "lr", Muon, W, lr=inf),
    case(V, "momentum", Muon, W, momentum=1.0),
    case(V, "momentum", Muon, W, momentum=nan),
    case(T, "momentum", Muon, W, momentum=None),
    case(T, "nesterov", Muon, W, nesterov="yes"),
    case(T, "ns_steps", Muon, W, ns_steps=2.0),
    case(V, "ns_steps", Muon, W, ns_steps=0),
    case(V, "weight_decay", Muon, W, weight_decay=-1.0),
    case(V, "weight_decay", Muon, W, weight_decay=nan),
    case(T, "weight_decay", Muon, W, weight_decay="0"),
    case(T, "ns_dtype", Muon, W, ns_dtype=torch.int32),
    case(T, "ns_dtype", Muon, W, ns_dtype="bf16"),
    case(V, "matrices", Muon, [torch.ones(4)]),
    # AdamW8bit
    case(T, "lr", AdamW8bit, W, lr="1"),
    case(V, "lr", AdamW8bit, W, lr=-1e-3),
    case(V, "lr", AdamW8bit, W, lr=inf),
    case(V, "betas", AdamW8bit, W, betas=(0.9,)),
    case(V, "betas", AdamW8bit, W, betas=(0.9, 1.0)),
    case(V, "betas", AdamW8bit, W, betas=(nan, 0.999)),
    case(T, "betas", AdamW8bit, W, betas="ab"),
    case(T, "betas", AdamW8bit, W, betas=0.9),
    case(V, "eps", AdamW8bit, W, eps=0.0),
    case(V, "eps", AdamW8bit, W, eps=inf),
    case(V, "weight_decay", AdamW8bit, W, weight_decay=nan),
    case(V, "weight_decay", AdamW8bit, W, weight_decay=-1),
    case(T, "weight_decay", AdamW8bit, W, weight_decay=None),
    case(T, "block_size", AdamW8bit, W, block_size=2.0),
    case(V, "block_size", AdamW8bit, W, block_size=0),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_foreign_ignored_params_warn_once_per_call_site(monkeypatch):
    """FSDP2 ignores parameters the module does not have (FSDP2 code passes one global
    set to every nested call): a UserWarning naming how many, once per call site."""
    monkeypatch.setattr(fsdp_module, "_WARNED_SITES", set())
    outside = _foreign_param()
    with fake_mesh((2,)) as mesh:

        def shard(model, ignored):
            return fully_shard(model, mesh=mesh, ignored_params=ignored)  # one call site

        with pytest.warns(UserWarning, match=r"holds 1 parameter\(s\) that are not in this"):
            shard(_model(), {outside})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            shard(_model(), {outside})  # the same call site again: silent
        # One global set for nested calls: each call warns with its own count, and the
        # parameter the set names stays unsharded.
        model = _model()
        keep = model[0].weight
        ignored = {keep, outside}
        with pytest.warns(UserWarning, match=r"holds 2 parameter"):
            fully_shard(model[1], mesh=mesh, ignored_params=ignored)
        with pytest.warns(UserWarning, match=r"holds 1 parameter"):
            fully_shard(model, mesh=mesh, ignored_params=ignored)
        assert model[0].weight is keep and not isinstance(keep, DTensor)
        assert isinstance(model[0].bias, DTensor) and isinstance(model[1].weight, DTensor)


def test_catalogue_size():
    assert len(CASES) >= 60


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_DT = st.sampled_from(
    [None, torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool, "fp32"]
)


@_FUZZ
@given(param_dtype=_DT, reduce_dtype=_DT, output_dtype=_DT, cast=st.sampled_from([True, 1]))
def test_fuzz_mixed_precision_policy(param_dtype, reduce_dtype, output_dtype, cast):
    def ok(d):
        return d is None or (isinstance(d, torch.dtype) and d.is_floating_point)

    good = ok(param_dtype) and ok(reduce_dtype) and ok(output_dtype) and cast is True
    kw = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype)
    err = rejects_cleanly(MixedPrecisionPolicy, cast_forward_inputs=cast, **kw)
    assert (err is None) == good, err


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    granularity=st.one_of(
        st.none(),
        st.integers(-2, 40),
        st.sampled_from(["element", "row", "matrix", "tensor", "rows", 2.0]),
    ),
    alignment=st.sampled_from([1, 8, 64, 0, 8.0]),
    world=st.sampled_from([1, 2, 3]),
)
def test_fuzz_fully_shard(granularity, alignment, world):
    good = (
        (granularity is None or granularity in ("element", "row", "matrix", "tensor"))
        or (isinstance(granularity, int) and granularity >= 1)
    ) and alignment in (1, 8, 64)
    good = good and not isinstance(alignment, float) and not isinstance(granularity, float)
    err = rejects_cleanly(_fs, mesh_shape=(world,), granularity=granularity, alignment=alignment)
    assert (err is None) == good, err
