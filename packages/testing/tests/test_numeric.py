import math

import pytest
import torch

from hyperrec.testing import (
    assert_close_to_reference,
    max_abs_error,
    poison_like,
    rel_error,
    snr_db,
)


def test_errors_on_known_values():
    e = torch.tensor([3.0, 4.0])
    a = torch.tensor([3.0, 4.5])
    assert max_abs_error(a, e) == pytest.approx(0.5)
    assert rel_error(a, e) == pytest.approx(0.5 / 5.0)
    assert snr_db(a, e) == pytest.approx(10 * math.log10(25 / 0.25))
    assert snr_db(e, e) == math.inf
    assert snr_db(a, torch.zeros(2)) == -math.inf
    assert rel_error(a, torch.zeros(2)) == pytest.approx(float(torch.linalg.vector_norm(a)))
    assert max_abs_error(torch.empty(0), torch.empty(0)) == 0.0


def test_shape_and_type_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_error(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="tensors"):
        snr_db([1.0], torch.zeros(1))


def test_reference_rule_pass_and_fail():
    exact = torch.randn(256, dtype=torch.float64)
    ref = exact.to(torch.bfloat16)
    good = exact.to(torch.bfloat16)
    assert_close_to_reference(good, ref, exact)
    bad = good.double() + 0.05
    with pytest.raises(AssertionError, match="exceeds 2.0 x"):
        assert_close_to_reference(bad, ref, exact)


def test_reference_rule_nan_pattern():
    exact = torch.randn(8, dtype=torch.float64)
    exact[3] = float("nan")
    exact[5] = float("inf")
    ok = exact.clone()
    assert_close_to_reference(ok, exact, exact)
    moved = exact.clone()
    moved[3], moved[4] = 0.0, float("nan")
    with pytest.raises(AssertionError, match="NaN/Inf pattern"):
        assert_close_to_reference(moved, exact, exact)
    flipped = exact.clone()
    flipped[5] = -float("inf")
    with pytest.raises(AssertionError, match="NaN/Inf pattern"):
        assert_close_to_reference(flipped, exact, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_poison_like(dtype):
    p = poison_like(torch.zeros(5, dtype=dtype))
    assert p.dtype == dtype and p.shape == (5,)
    if dtype.is_floating_point:
        assert torch.isnan(p).all()
    elif dtype == torch.bool:
        assert p.all()
    else:
        assert (p == torch.iinfo(dtype).max).all()


def test_write_result_records_machine(tmp_path):
    import json

    from hyperrec.testing import write_result

    out = write_result(tmp_path / "sub" / "r.json", {"rows": [{"x": 1}]})
    data = json.loads(out.read_text())
    assert data["rows"] == [{"x": 1}]
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["date"].endswith("Z")
