"""Bad-input catalogue of hyperrec.mxfp8: one line per case, plus fuzzing of every public op.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's docstring.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from hyperrec.mxfp8 import (
    MXMLP,
    MXLinear,
    MXTensor,
    PrecisionPolicy,
    convert,
    get_format,
    mx_linear,
    mx_mm,
    mx_quantize,
    native_mx_supported,
    plan_conversion,
    to_mx,
)
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
x32 = torch.randn(4, 64)
w32 = torch.randn(8, 64)
A = to_mx(x32)  # (4, 64) blocked along K
B = to_mx(w32).t()  # (64, 8) blocked along K
A64 = to_mx(x32, block_size=64)
A3 = to_mx(torch.randn(2, 4, 64))
LIN = MXLinear(64, 32)
MLP = MXMLP(64, 128)
nan, inf = math.nan, math.inf


def _mx4_triton():
    a4 = to_mx(x32, elem_dtype="e2m1")
    return mx_mm(a4, to_mx(w32, elem_dtype="e2m1").t(), backend="triton")


CASES = [
    # to_mx
    case(T, "x", to_mx, "abc"),
    case(T, "x", to_mx, [1.0, 2.0]),
    case(T, "x", to_mx, torch.ones(4, 32, dtype=torch.int32)),
    case(T, "x", to_mx, torch.ones(4, 32, dtype=torch.float64)),
    case(V, "x", to_mx, torch.tensor(1.0)),
    case(V, "elem_dtype", to_mx, x32, elem_dtype=torch.float32),
    case(V, "elem_dtype", to_mx, x32, elem_dtype="e9m9"),
    case(T, "elem_dtype", to_mx, x32, elem_dtype=3),
    case(V, "block_size", to_mx, x32, block_size=33),
    case(V, "block_size", to_mx, x32, block_size=0),
    case(T, "block_size", to_mx, x32, block_size=32.0),
    case(T, "block_size", to_mx, x32, block_size=True),
    case(V, "scale_mode", to_mx, x32, scale_mode="ceil"),
    case(T, "scale_mode", to_mx, x32, scale_mode=None),
    case(V, "axis", to_mx, x32, axis=2),
    case(V, "axis", to_mx, x32, axis=-3),
    case(T, "axis", to_mx, x32, axis=1.0),
    case(T, "axis", to_mx, x32, axis=None),
    case(V, "along axis", to_mx, torch.ones(4, 33), elem_dtype="e2m1"),
    case(V, "backend", to_mx, x32, backend="cuda"),
    case(T, "backend", to_mx, x32, backend=None),
    case(T, "stochastic_rounding", to_mx, x32, stochastic_rounding="yes"),
    case(V, "seed", to_mx, x32, seed=5),
    case(V, "seed", to_mx, x32, stochastic_rounding=True, seed=-1),
    case(T, "seed", to_mx, x32, stochastic_rounding=True, seed=1.5),
    case(V, "seed", to_mx, x32, stochastic_rounding=True, seed=torch.tensor([1.0])),
    case(V, "seed", to_mx, x32, stochastic_rounding=True, seed=torch.tensor([1, 2])),
    # mx_quantize
    case(T, "x", mx_quantize, None),
    case(V, "x", mx_quantize, torch.ones(2, 4, 32)),
    case(V, "x", mx_quantize, torch.ones(32)),
    case(V, "rowwise", mx_quantize, x32, rowwise=False, colwise=False),
    case(T, "rowwise", mx_quantize, x32, rowwise=1),
    case(T, "colwise", mx_quantize, x32, colwise="no"),
    case(V, "activation", mx_quantize, x32, activation="tanh"),
    case(V, "hadamard", mx_quantize, x32, colwise=True, hadamard=8),
    case(V, "hadamard", mx_quantize, x32, hadamard=16),
    case(T, "hadamard", mx_quantize, x32, colwise=True, hadamard="16"),
    case(V, "hadamard", mx_quantize, x32, colwise=True, hadamard=32, block_size=16),
    case(T, "hadamard_seed", mx_quantize, x32, colwise=True, hadamard=16, hadamard_seed=1.5),
    case(V, "hadamard_seed", mx_quantize, x32, colwise=True, hadamard_seed=3),
    case(V, "elem_dtype", mx_quantize, x32, elem_dtype="fp8"),
    case(V, "block_size", mx_quantize, x32, block_size=256),
    case(V, "scale_mode", mx_quantize, x32, scale_mode="round"),
    case(V, "even", mx_quantize, torch.ones(3, 32), colwise=True, elem_dtype="e2m1"),
    case(V, "seed", mx_quantize, x32, seed=1),
    case(V, "backend", mx_quantize, x32, backend="tpu"),
    # mx_mm
    case(T, "a", mx_mm, x32, B),
    case(T, "b", mx_mm, A, None),
    case(V, "a", mx_mm, A3, B),
    case(V, "b", mx_mm, A, A3),
    case(V, "a must be blocked", mx_mm, to_mx(x32, axis=0), B),
    case(V, "b must be blocked", mx_mm, A, to_mx(w32)),
    case(V, "a is (4, 64)", mx_mm, A, to_mx(torch.randn(8, 32)).t()),
    case(V, "block sizes differ", mx_mm, A64, B),
    case(T, "out_dtype", mx_mm, A, B, out_dtype=torch.int8),
    case(T, "out_dtype", mx_mm, A, B, out_dtype="bf16"),
    case(T, "bias", mx_mm, A, B, bias=torch.ones(8, dtype=torch.int32)),
    case(T, "bias", mx_mm, A, B, bias=[0.0] * 8),
    case(V, "bias", mx_mm, A, B, bias=torch.ones(4)),
    case(V, "kernel", mx_mm, A, B, kernel="fast"),
    case(T, "alpha", mx_mm, A, B, alpha="2"),
    case(T, "alpha", mx_mm, A, B, alpha=True),
    case(T, "alpha", mx_mm, A, B, alpha=torch.tensor(2.0)),
    case(V, "alpha", mx_mm, A, B, alpha=nan),
    case(V, "alpha", mx_mm, A, B, alpha=inf),
    case(V, "alpha", mx_mm, A, B, alpha=-inf),
    case(V, "backend", mx_mm, A, B, backend="x"),
    case(V, "MX4", _mx4_triton, doc=mx_mm),
    # mx_linear
    case(T, "x", mx_linear, "abc", w32),
    case(T, "x", mx_linear, torch.ones(4, 64, dtype=torch.float64), w32),
    case(V, "x", mx_linear, torch.tensor(1.0), w32),
    case(V, "in_features", mx_linear, torch.ones(4, 48), w32),
    case(V, "in_features", mx_linear, torch.ones(4, 1), w32),
    case(T, "weight", mx_linear, x32, None),
    case(T, "weight", mx_linear, x32, w32.int()),
    case(V, "weight", mx_linear, x32, torch.ones(64)),
    case(V, "weight", mx_linear, x32, torch.ones(2, 8, 64)),
    case(T, "bias", mx_linear, x32, w32, torch.ones(8, dtype=torch.int64)),
    case(V, "bias", mx_linear, x32, w32, torch.ones(9)),
    case(T, "policy", mx_linear, x32, w32, policy="mxfp8"),
    case(V, "input_activation", mx_linear, x32, w32, input_activation="tanh"),
    # MXLinear
    case(T, "in_features", MXLinear, 2.5, 4),
    case(T, "in_features", MXLinear, "64", 4),
    case(V, "in_features", MXLinear, -1, 4),
    case(T, "out_features", MXLinear, 4, None),
    case(V, "out_features", MXLinear, 4, -2),
    case(T, "policy", MXLinear, 4, 4, policy={"block_size": 32}),
    case(V, "input_activation", MXLinear, 4, 4, input_activation="gelu"),
    case(V, "in_features", LIN, torch.ones(4, 48), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(4, 1), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(4, 16), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(4, 32), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(4, 96), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(2, 3, 48), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(4, 48, dtype=torch.float64), doc=MXLinear),
    case(V, "in_features", LIN, torch.ones(0, 48), doc=MXLinear),
    case(T, "x", LIN, "abc", doc=MXLinear),
    case(T, "x", LIN, [[1.0] * 64], doc=MXLinear),
    case(V, "x", LIN, torch.tensor(1.0), doc=MXLinear),
    case(T, "linear", MXLinear.from_linear, nn.Conv1d(2, 2, 1)),
    case(T, "policy", MXLinear.from_linear, nn.Linear(4, 4), policy=3),
    case(V, "input_activation", MXLinear.from_linear, nn.Linear(4, 4), input_activation="x"),
    # MXMLP
    case(V, "dim", MXMLP, 0, 8),
    case(T, "dim", MXMLP, 2.5, 8),
    case(T, "hidden_dim", MXMLP, 8, "8"),
    case(V, "hidden_dim", MXMLP, 8, -8),
    case(V, "activation", MXMLP, 8, 8, activation="none"),
    case(V, "activation", MXMLP, 8, 8, activation="tanh"),
    case(T, "policy", MXMLP, 8, 8, policy=1),
    case(V, "in_features", MLP, torch.ones(4, 48), doc=MXMLP),
    case(V, "in_features", MLP, torch.ones(4, 128), doc=MXMLP),
    case(T, "x", MLP, None, doc=MXMLP),
    # PrecisionPolicy
    case(V, "block_size", PrecisionPolicy, block_size=48),
    case(T, "block_size", PrecisionPolicy, block_size="32"),
    case(V, "elem_dtype", PrecisionPolicy, elem_dtype=torch.float16),
    case(V, "elem_dtype", PrecisionPolicy, elem_dtype="e2m1"),
    case(V, "grad_dtype", PrecisionPolicy, grad_dtype="mx4"),
    case(T, "grad_dtype", PrecisionPolicy, grad_dtype=8),
    case(V, "scale_mode", PrecisionPolicy, scale_mode="x"),
    case(V, "hadamard", PrecisionPolicy, hadamard=64),
    case(V, "hadamard", PrecisionPolicy, hadamard=32, block_size=16),
    case(T, "stochastic_rounding", PrecisionPolicy, stochastic_rounding=1),
    case(T, "wgrad_high_precision", PrecisionPolicy, wgrad_high_precision="no"),
    case(T, "keep_first", PrecisionPolicy, keep_first=None),
    case(T, "keep_last", PrecisionPolicy, keep_last=0),
    case(T, "keep", PrecisionPolicy, keep=["head"]),
    case(T, "keep", PrecisionPolicy, keep=("head", 1)),
    case(V, "min_features", PrecisionPolicy, min_features=-1),
    case(T, "min_features", PrecisionPolicy, min_features=4096.0),
    case(T, "min_tokens", PrecisionPolicy, min_tokens=1.5),
    case(V, "min_tokens", PrecisionPolicy, min_tokens=-3),
    case(V, "hadamard_seed", PrecisionPolicy, hadamard_seed=-1),
    case(V, "kernel", PrecisionPolicy, kernel="x"),
    case(V, "backend", PrecisionPolicy, backend="gpu"),
    # convert / plan_conversion / get_format / MXTensor
    case(T, "model", convert, "model"),
    case(T, "policy", convert, nn.Linear(4, 4), policy="x"),
    case(T, "model", plan_conversion, None),
    case(T, "policy", plan_conversion, nn.Linear(4, 4), policy=PrecisionPolicy),
    case(V, "elem_dtype", get_format, "x"),
    case(V, "elem_dtype", get_format, torch.int8),
    case(T, "elem_dtype", get_format, None),
    case(V, "t()", MXTensor.t, A3),
    case(T, "device", native_mx_supported, 3),
    case(V, "device", native_mx_supported, "gpu"),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 100


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
_ELEMS = [torch.float8_e4m3fn, torch.float8_e5m2, "e2m1", torch.float32, "bad"]


@_FUZZ
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dtype=st.sampled_from(_DTYPES),
    elem=st.sampled_from(_ELEMS),
    block=st.sampled_from([16, 32, 64, 128, 24, 0]),
    axis=st.integers(-4, 3),
)
def test_fuzz_to_mx(shape, dtype, elem, block, axis):
    x = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.ones(shape, dtype=dtype)
    good = (
        dtype in (torch.float32, torch.bfloat16, torch.float16)
        and len(shape) >= 1
        and block in (16, 32, 64, 128)
        and elem != torch.float32
        and elem != "bad"
        and -len(shape) <= axis < len(shape)
        and not (elem == "e2m1" and shape[axis] % 2)
    )
    err = rejects_cleanly(to_mx, x, elem_dtype=elem, block_size=block, axis=axis, backend="torch")
    assert (err is None) == good, err
    if good:
        q = to_mx(x, elem_dtype=elem, block_size=block, axis=axis, backend="torch")
        assert q.shape == x.shape


@_FUZZ
@given(
    m=st.integers(0, 9),
    k=st.integers(1, 80),
    k2=st.integers(1, 80),
    n=st.integers(1, 9),
    alpha=st.sampled_from([1.0, 0.5, 2, nan, inf, -inf]),
)
def test_fuzz_mx_mm(m, k, k2, n, alpha):
    a = to_mx(torch.randn(m, k), backend="torch")
    b = to_mx(torch.randn(n, k2), backend="torch").t()
    good = k == k2 and math.isfinite(alpha)
    err = rejects_cleanly(mx_mm, a, b, alpha=alpha, backend="torch")
    assert (err is None) == good, err


@_FUZZ
@given(
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=2),
    features=st.integers(0, 100),
    dtype=st.sampled_from(_DTYPES),
    min_tokens=st.sampled_from([0, 1000]),
)
def test_fuzz_mx_linear_module(lead, features, dtype, min_tokens):
    layer = MXLinear(64, 8, policy=PrecisionPolicy(min_tokens=min_tokens, backend="torch"))
    x = torch.ones(*lead, features, dtype=dtype)
    # Floats of any width take a path (MX or the high-precision fallback); only the
    # feature count decides.
    good = features == 64 and dtype.is_floating_point
    err = rejects_cleanly(layer, x)
    assert (err is None) == good, err
    if good:
        assert layer(x).shape == (*lead, 8)


@_FUZZ
@given(
    m=st.integers(0, 40),
    k=st.integers(0, 40),
    rowwise=st.booleans(),
    colwise=st.booleans(),
    hadamard=st.sampled_from([0, 16, 32, 8]),
    block=st.sampled_from([16, 32, 64]),
    elem=st.sampled_from([torch.float8_e4m3fn, "e2m1"]),
)
def test_fuzz_mx_quantize(m, k, rowwise, colwise, hadamard, block, elem):
    good = (
        (rowwise or colwise)
        and hadamard in (0, 16, 32)
        and (hadamard == 0 or (colwise and block % hadamard == 0))
        and not (elem == "e2m1" and ((rowwise and k % 2) or (colwise and m % 2)))
    )
    x = torch.randn(m, k)
    kw = dict(
        rowwise=rowwise, colwise=colwise, hadamard=hadamard, block_size=block, elem_dtype=elem
    )
    err = rejects_cleanly(mx_quantize, x, backend="torch", **kw)
    assert (err is None) == good, err
    if good:
        row, col = mx_quantize(x, backend="torch", **kw)
        assert (row is not None) == rowwise and (col is not None) == colwise
