"""Bad-input catalogue of hyperrec.dbuffer: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's docstring.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.dbuffer import (
    DBuffer,
    ReduceOptions,
    clip_grad_norm_,
    flat_params,
    grad_norm,
    zero_grad_,
)
from hyperrec.testing import fake_mesh
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
K = KeyError
BUF = DBuffer.from_tensors([torch.ones(4), torch.ones(2, 3)], names=["w", "b"])
f32, f64 = torch.ones(2), torch.ones(2, dtype=torch.float64)


def _on_mesh(shape, fn):
    with fake_mesh(shape) as mesh:
        return fn(mesh)


def _copy_then_check(tensors):
    # A failing copy must not have written anything (checks run before the first copy).
    buf = DBuffer.from_tensors([torch.zeros(2), torch.zeros(3)])
    try:
        buf.copy_from_full_(tensors)
    finally:
        assert torch.count_nonzero(buf.shard) == 0, "a rejected copy wrote into the shard"


def _load_then_check(state, **kwargs):
    buf = DBuffer.from_tensors([torch.zeros(2), torch.zeros(3)], names=["a", "b"])
    try:
        buf.load_state_dict(state, **kwargs)
    finally:
        assert torch.count_nonzero(buf.shard) == 0, "a rejected load wrote into the shard"


CASES = [
    # DBuffer(shapes, ...)
    case(T, "shapes", DBuffer, "abc"),
    case(T, "shapes", DBuffer, None),
    case(T, "shapes", DBuffer, torch.zeros(3)),
    case(T, "shapes", DBuffer, 7),
    case(T, "shapes[0]", DBuffer, [4]),
    case(T, "shapes[1]", DBuffer, [(4,), (2, 2.5)]),
    case(T, "shapes[0]", DBuffer, [("a",)]),
    case(T, "shapes[0]", DBuffer, [(True, 2)]),
    case(T, "trainable", DBuffer, [(2,)], trainable=1),
    case(T, "trainable", DBuffer, [(2,)], trainable="yes"),
    case(V, "shapes[0]", DBuffer, [(4, -1)]),
    case(V, "shapes[1]", DBuffer, [(4,), (-3,)]),
    case(T, "dtype", DBuffer, [(2,)], dtype="float32"),
    case(T, "dtype", DBuffer, [(2,)], dtype=torch.int32),
    case(T, "param_dtype", DBuffer, [(2,)], param_dtype=torch.int8),
    case(T, "reduce_dtype", DBuffer, [(2,)], reduce_dtype="fp32"),
    case(T, "granularities", DBuffer, [(4,)], granularities=3),
    case(T, "granularities", DBuffer, [(4,)], granularities="4"),
    case(T, "granularities[0]", DBuffer, [(4,)], granularities=[2.7]),
    case(T, "granularities[0]", DBuffer, [(4,)], granularities=[2.0]),
    case(T, "granularities[0]", DBuffer, [(4,)], granularities=["x"]),
    case(T, "granularities[0]", DBuffer, [(4,)], granularities=[None]),
    case(T, "granularities[0]", DBuffer, [(4,)], granularities=[True]),
    case(V, "granularities", DBuffer, [(4,)], granularities=[1, 2]),
    case(V, "granularities", DBuffer, [(4,)], granularities=[0]),
    case(V, "granularities", DBuffer, [(4,)], granularities=[-2]),
    case(T, "alignment", DBuffer, [(4,)], alignment=2.0),
    case(T, "alignment", DBuffer, [(4,)], alignment=True),
    case(V, "alignment", DBuffer, [(4,)], alignment=0),
    case(T, "names", DBuffer, [(4,), (2,)], names="ab"),
    case(T, "names[0]", DBuffer, [(4,)], names=[1]),
    case(V, "names", DBuffer, [(4,), (2,)], names=["a", "a"]),
    case(V, "names", DBuffer, [(4,), (2,)], names=["a"]),
    case(T, "mesh", DBuffer, [(4,)], mesh="cpu"),
    case(T, "mesh", DBuffer, [(4,)], mesh=4),
    case(V, "device", DBuffer, [(4,)], device="gpu"),
    case(T, "device", DBuffer, [(4,)], device=3.5),
    case(V, "mesh", lambda: _on_mesh((2, 2, 2), lambda m: DBuffer([(4,)], mesh=m)), doc=DBuffer),
    # from_tensors / copy_from_full_
    case(T, "tensors", DBuffer.from_tensors, []),
    case(T, "tensors", DBuffer.from_tensors, torch.ones(3)),
    case(T, "tensors", DBuffer.from_tensors, [torch.ones(2), [1.0]]),
    case(T, "dtype", DBuffer.from_tensors, [f32, f64]),
    case(T, "dtype", DBuffer.from_tensors, [f64, f32, f32]),
    case(T, "dtype", DBuffer.from_tensors, [f32], dtype=torch.bfloat16),
    case(T, "dtype", DBuffer.from_tensors, [torch.ones(2, dtype=torch.int32)]),
    case(T, "foo", DBuffer.from_tensors, [f32], foo=1),
    case(T, "tensors[0]", _copy_then_check, [1, 2], doc=DBuffer.copy_from_full_),
    case(T, "tensors", _copy_then_check, torch.zeros(2), doc=DBuffer.copy_from_full_),
    case(
        T,
        "tensors[1]",
        _copy_then_check,
        [torch.ones(2), torch.ones(3, dtype=torch.float64)],
        doc=DBuffer.copy_from_full_,
    ),
    case(
        V,
        "tensors[1]",
        _copy_then_check,
        [torch.ones(2), torch.ones(4)],
        doc=DBuffer.copy_from_full_,
    ),
    case(V, "expected 2", _copy_then_check, [torch.ones(2)], doc=DBuffer.copy_from_full_),
    # views and group ops on one buffer
    case(V, "flat", BUF.flat_view, torch.ones(3), 0),
    case(T, "flat", BUF.flat_view, [1.0], 0),
    case(V, "flat", BUF.gather_full, torch.ones(2)),
    case(T, "flat", BUF.gather_full, "x"),
    case(V, "other", BUF.add_, torch.ones(3)),
    case(T, "other", BUF.add_, [1.0]),
    case(T, "alpha", BUF.add_, torch.ones(BUF.shard_numel), alpha="x"),
    case(T, "factor", BUF.scale_grad_, "x"),
    case(T, "flat", BUF.set_grad_, [1.0, 2.0]),
    case(T, "options", BUF.reduce_grad, options="average"),
    case(T, "keep", BUF.reshard, keep="x"),
    case(T, "zero", BUF.begin_grad, zero="no"),
    case(T, "release", BUF.drop_grad_, release=1),
    case(
        T,
        "strict",
        _load_then_check,
        {"a": torch.ones(2), "b": torch.ones(3)},
        strict="no",
        doc=DBuffer.load_state_dict,
    ),
    # ReduceOptions: a zero factor divided by zero, a negative one flipped the sign
    case(V, "divide_factor", ReduceOptions, divide_factor=0.0),
    case(V, "divide_factor", ReduceOptions, divide_factor=-4.0),
    case(V, "divide_factor", ReduceOptions, divide_factor=float("nan")),
    case(V, "divide_factor", ReduceOptions, divide_factor=float("inf"), force_sum=True),
    case(T, "divide_factor", ReduceOptions, divide_factor="2"),
    case(T, "force_sum", ReduceOptions, force_sum="no"),
    case(T, "all_reduce", ReduceOptions, all_reduce=0),
    case(T, "hook", ReduceOptions, hook="print"),
    case(T, "reduce_scatter", ReduceOptions, reduce_scatter=3),
    # load_state_dict
    case(K, "zz", _load_then_check, {"zz": torch.ones(1)}, doc=DBuffer.load_state_dict),
    case(K, "missing key 'b'", _load_then_check, {"a": torch.ones(2)}, doc=DBuffer.load_state_dict),
    case(
        V,
        "'b'",
        _load_then_check,
        {"a": torch.ones(2), "b": torch.ones(4)},
        doc=DBuffer.load_state_dict,
    ),
    case(
        T,
        "'b'",
        _load_then_check,
        {"a": torch.ones(2), "b": [1.0, 2.0, 3.0]},
        doc=DBuffer.load_state_dict,
    ),
    case(T, "state_dict", _load_then_check, [("a", torch.ones(2))], doc=DBuffer.load_state_dict),
    # group ops over several buffers
    case(T, "buffers", grad_norm, BUF),
    case(T, "buffers", grad_norm, None),
    case(T, "buffers", grad_norm, [BUF, 3]),
    case(T, "buffers", clip_grad_norm_, BUF, 1.0),
    case(T, "buffers", clip_grad_norm_, [1], 1.0),
    case(V, "max_norm", clip_grad_norm_, [BUF], 0),
    case(V, "max_norm", clip_grad_norm_, [BUF], -1.0),
    case(V, "max_norm", clip_grad_norm_, [BUF], float("nan")),
    case(T, "max_norm", clip_grad_norm_, [BUF], "1"),
    case(T, "max_norm", clip_grad_norm_, [BUF], None),
    case(V, "eps", clip_grad_norm_, [BUF], 1.0, eps=-1.0),
    case(V, "eps", clip_grad_norm_, [BUF], 1.0, eps=float("inf")),
    case(T, "eps", clip_grad_norm_, [BUF], 1.0, eps="x"),
    case(T, "buffers", zero_grad_, [None]),
    case(T, "buffers", zero_grad_, 5),
    case(T, "buffers", flat_params, [3]),
    case(T, "buffers", flat_params, "ab"),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 60


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_DIM = st.one_of(st.integers(-2, 6), st.sampled_from([2.5, "3", None, True]))
_GRAN = st.one_of(st.integers(-1, 9), st.sampled_from([2.7, "x", None, False]))


@_FUZZ
@given(
    shapes=st.lists(st.lists(_DIM, max_size=3), max_size=4),
    grans=st.one_of(st.none(), st.lists(_GRAN, max_size=4)),
    alignment=st.sampled_from([1, 4, 0, 2.0]),
)
def test_fuzz_constructor(shapes, grans, alignment):
    def ok_dim(d):
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    def ok_gran(g):
        return isinstance(g, int) and not isinstance(g, bool) and g >= 1

    good = (
        all(ok_dim(d) for s in shapes for d in s)
        and (grans is None or (len(grans) == len(shapes) and all(ok_gran(g) for g in grans)))
        and alignment in (1, 4)
        and not isinstance(alignment, float)
    )
    err = rejects_cleanly(DBuffer, shapes, granularities=grans, alignment=alignment)
    assert (err is None) == good, err
    if good:
        buf = DBuffer(shapes, granularities=grans, alignment=alignment)
        assert [tuple(s) for s in buf.shapes] == [tuple(s) for s in shapes]


@_FUZZ
@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), max_size=4),
)
def test_fuzz_from_tensors(sizes, dtypes):
    dtypes = (dtypes + [torch.float32] * len(sizes))[: len(sizes)]
    tensors = [torch.randn(n).to(dt) for n, dt in zip(sizes, dtypes)]
    good = len(set(dtypes)) == 1
    err = rejects_cleanly(DBuffer.from_tensors, tensors)
    assert (err is None) == good, err
    if good:
        buf = DBuffer.from_tensors(tensors)
        assert all(torch.equal(buf.full_view(i), t) for i, t in enumerate(tensors))
