"""Bad-input catalogue of hyperrec.testing: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument; every type must also be listed in the ``Raises:`` section of the public
function's docstring. No case starts a process: every check runs first.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.testing import (
    assert_close_to_reference,
    fake_mesh,
    max_abs_error,
    poison_like,
    rel_error,
    run_on_ranks,
    snr_db,
    write_result,
)
from hyperrec.testing.bad_inputs import (
    Case,
    case,
    catalogue_tests,
    check_case,
    documented_exceptions,
    rejects_cleanly,
)
from hyperrec.testing.distributed import default_timeout_s

T = TypeError
V = ValueError
A = torch.ones(3)
nan, inf = math.nan, math.inf


def _mesh(*args, **kwargs):
    with fake_mesh(*args, **kwargs) as mesh:
        return mesh


def _env_timeout(monkeypatch_value):
    import os

    old = os.environ.get("HYPERREC_TEST_TIMEOUT_S")
    os.environ["HYPERREC_TEST_TIMEOUT_S"] = monkeypatch_value
    try:
        return default_timeout_s()
    finally:
        if old is None:
            del os.environ["HYPERREC_TEST_TIMEOUT_S"]
        else:
            os.environ["HYPERREC_TEST_TIMEOUT_S"] = old


CASES = [
    # run_on_ranks (rejected before any process is spawned)
    case(T, "fn", run_on_ranks, 3, 1),
    case(T, "world_size", run_on_ranks, print, 1.5),
    case(T, "world_size", run_on_ranks, print, True),
    case(V, "world_size", run_on_ranks, print, 0),
    case(V, "world_size", run_on_ranks, print, -2),
    case(V, "timeout_s", run_on_ranks, print, 1, timeout_s=0),
    case(V, "timeout_s", run_on_ranks, print, 1, timeout_s=-5.0),
    case(V, "timeout_s", run_on_ranks, print, 1, timeout_s=nan),
    case(T, "timeout_s", run_on_ranks, print, 1, timeout_s="5"),
    case(T, "backend", run_on_ranks, print, 1, backend=5),
    case(V, "HYPERREC_TEST_TIMEOUT_S", _env_timeout, "soon", doc=default_timeout_s),
    case(V, "HYPERREC_TEST_TIMEOUT_S", _env_timeout, "-1", doc=default_timeout_s),
    # fake_mesh
    case(V, "mesh_shape", _mesh, (), doc=fake_mesh),
    case(V, "mesh_shape", _mesh, (2, 0), doc=fake_mesh),
    case(T, "mesh_shape", _mesh, (2.5,), doc=fake_mesh),
    case(T, "mesh_shape", _mesh, (True,), doc=fake_mesh),
    case(T, "mesh_shape", _mesh, "ab", doc=fake_mesh),
    case(T, "mesh_shape", _mesh, 4, doc=fake_mesh),
    case(T, "mesh_dim_names", _mesh, (2, 2), "ab", doc=fake_mesh),
    case(T, "mesh_dim_names", _mesh, (2,), [1], doc=fake_mesh),
    case(V, "mesh_dim_names", _mesh, (2, 2), ("a",), doc=fake_mesh),
    case(V, "mesh_dim_names", _mesh, (2, 2), ("a", "a"), doc=fake_mesh),
    case(V, "rank", _mesh, (2, 2), rank=4, doc=fake_mesh),
    case(V, "rank", _mesh, (2,), rank=-1, doc=fake_mesh),
    case(T, "rank", _mesh, (4,), rank=1.5, doc=fake_mesh),
    case(T, "rank", _mesh, (4,), rank=True, doc=fake_mesh),
    case(T, "device_type", _mesh, (2,), device_type=3, doc=fake_mesh),
    # comparators
    case(T, "actual and expected", rel_error, [1.0], A),
    case(T, "actual and expected", max_abs_error, A, None),
    case(T, "actual", rel_error, A.to(torch.complex64), A),
    case(T, "expected", snr_db, A, A.to(torch.complex64)),
    case(V, "shape mismatch", rel_error, A, A[:2]),
    case(V, "shape mismatch", snr_db, A, A[:2]),
    case(V, "shape mismatch", max_abs_error, A[None], A),
    case(V, "factor", assert_close_to_reference, A, A, A, factor=-1.0),
    case(V, "factor", assert_close_to_reference, A, A, A, factor=nan),
    case(T, "factor", assert_close_to_reference, A, A, A, factor="2"),
    case(V, "atol", assert_close_to_reference, A, A, A, atol=-1.0),
    case(V, "atol", assert_close_to_reference, A, A, A, atol=inf),
    case(T, "atol", assert_close_to_reference, A, A, A, atol="0"),
    case(T, "name", assert_close_to_reference, A, A, A, name=3),
    case(V, "reference", assert_close_to_reference, A, A[:2], A),
    case(T, "actual", assert_close_to_reference, [1.0], A, A),
    case(T, "t", poison_like, [1.0]),
    case(T, "t", poison_like, None),
    # write_result
    case(T, "payload", write_result, "unused.json", [1]),
    case(T, "path", write_result, None, {}),
    case(V, "machine", write_result, "unused.json", {"machine": "mine"}),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 40


# ------------------------------------------------------------ the catalogue helpers
def _raises_value_error_naming(x):
    raise ValueError(f"x must be positive, got {x}")


def test_check_case_fails_on_each_kind_of_miss():
    check_case(case(ValueError, "x must", _raises_value_error_naming, 1))
    misses = [
        case(TypeError, "x", _raises_value_error_naming, 1),  # wrong type
        case(ValueError, "y must", _raises_value_error_naming, 1),  # message names another
        case(ValueError, "x", abs, 1),  # returns
    ]
    for c in misses:
        with pytest.raises(AssertionError):
            check_case(c)


def test_documented_exceptions_reads_raises_sections():
    def documented(x):
        """Do it.

        Args:
            x: a ValueError-free argument (not a Raises section).

        Raises:
            TypeError / ValueError: bad x.
            KeyError, RankError: other.

        Returns:
            Nothing about IndexError.
        """

    assert documented_exceptions(documented) == {"TypeError", "ValueError", "KeyError", "RankError"}
    assert documented_exceptions(abs) == set()
    assert Case(exc=ValueError, match="x", fn=abs).test_id == "abs-x"


def test_rejects_cleanly_flags_escapes_and_hangs():
    import time

    assert rejects_cleanly(abs, 1) is None
    assert isinstance(rejects_cleanly(_raises_value_error_naming, 1), ValueError)
    with pytest.raises(AssertionError, match="IndexError"):
        rejects_cleanly([].__getitem__, 0)
    with pytest.raises(AssertionError, match="hung"):
        rejects_cleanly(time.sleep, 5, seconds=0.2)


# ----------------------------------------------------------------------------- fuzzing
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.one_of(st.integers(-1, 3), st.just(2.0)), max_size=3),
    rank=st.one_of(st.integers(-1, 10), st.just(1.0)),
)
def test_fuzz_fake_mesh(shape, rank):
    ints = all(isinstance(s, int) for s in shape)
    good = (
        ints
        and len(shape) >= 1
        and all(s >= 1 for s in shape)
        and isinstance(rank, int)
        and 0 <= rank < math.prod(shape)
    )
    err = rejects_cleanly(_mesh, tuple(shape), rank=rank)
    assert (err is None) == good, err


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 5),
    m=st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.complex64, torch.int32]),
)
def test_fuzz_comparators(n, m, dtype):
    a, b = torch.ones(n).to(dtype), torch.ones(m)
    good = n == m and not dtype.is_complex
    for fn in (rel_error, snr_db, max_abs_error):
        err = rejects_cleanly(fn, a, b)
        assert (err is None) == good, (fn.__name__, err)
