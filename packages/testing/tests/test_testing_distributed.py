import time

import pytest
import torch
import torch.distributed as dist

from hyperrec.testing import RankError, fake_mesh, run_on_ranks


def _sum_of_ranks(scale):
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise KeyError(f"boom from {bad_rank}")
    return dist.get_rank()


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 3])
def test_run_on_ranks_real_collective(world_size):
    scale = float(torch.rand(()) + 0.5)
    out = run_on_ranks(_sum_of_ranks, world_size, scale)
    expected = scale * world_size * (world_size + 1) / 2
    assert [(r, w) for r, w, _ in out] == [(r, world_size) for r in range(world_size)]
    assert all(v == pytest.approx(expected) for _, _, v in out)


def test_run_on_ranks_reports_failing_rank():
    with pytest.raises(RankError, match="boom from 1") as info:
        run_on_ranks(_raise_on_rank, 2, 1)
    assert info.value.rank == 1
    assert "KeyError" in info.value.traceback


def test_run_on_ranks_timeout():
    # Rank 1 hangs; on a loaded machine rank 0 may not have finished starting either.
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\]"):
        run_on_ranks(_hang_on_rank_one, 2, timeout_s=8)


@pytest.mark.parametrize(("bad", "err"), [(0, ValueError), (-2, ValueError), (1.5, TypeError)])
def test_run_on_ranks_bad_world_size(bad, err):
    with pytest.raises(err, match="world_size"):
        run_on_ranks(_sum_of_ranks, bad, 1.0)


def _slow_restore(seconds):
    time.sleep(seconds)
    return seconds


class _SlowToUnpickle:
    """Unpickled in each rank before it joins the group: a deterministic slow start."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return (_slow_restore, (self.seconds,))


def _identity(x):
    return x


def test_slow_start_does_not_count_against_the_deadline():
    # Each rank needs >= 4 s to start; the deadline for fn itself is 3 s. A busy CI
    # machine starts ranks this slowly just by importing torch.
    assert run_on_ranks(_identity, 2, _SlowToUnpickle(4.0), timeout_s=3) == [4.0, 4.0]


def _all_reduce_with_rank_one_gone():
    if dist.get_rank() == 1:
        time.sleep(120)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_collective_on_a_hung_peer_fails_inside_the_rank():
    # The process group times out (0.8 x the deadline) before the parent's deadline, so
    # the report is rank 0's traceback at the blocked collective, not a blind timeout.
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_all_reduce_with_rank_one_gone, 2, timeout_s=10)
    assert info.value.rank == 0
    assert "all_reduce" in info.value.traceback
    assert time.monotonic() - start < 60


def test_timeout_environment(monkeypatch):
    from hyperrec.testing.distributed import default_timeout_s

    monkeypatch.delenv("HYPERREC_TEST_TIMEOUT_S", raising=False)
    monkeypatch.delenv("HYPERREC_TEST_TIMEOUT_SCALE", raising=False)
    assert default_timeout_s() == 900.0
    monkeypatch.setenv("HYPERREC_TEST_TIMEOUT_S", "120")
    monkeypatch.setenv("HYPERREC_TEST_TIMEOUT_SCALE", "2.5")
    assert default_timeout_s() == 300.0
    for bad in ("soon", "-1", "nan", "0"):
        monkeypatch.setenv("HYPERREC_TEST_TIMEOUT_SCALE", bad)
        with pytest.raises(ValueError, match="HYPERREC_TEST_TIMEOUT_SCALE"):
            default_timeout_s()


def test_fake_mesh_structure_4096_ranks():
    with fake_mesh((2, 8, 256), ("zone", "host", "gpu"), rank=2 * 256 + 3) as mesh:
        assert dist.get_world_size() == 4096
        assert mesh.shape == (2, 8, 256)
        assert list(mesh.get_coordinate()) == [0, 2, 3]
        assert mesh["gpu"].size() == 256
        assert mesh["zone"].size() == 2
    assert not dist.is_initialized()


def test_fake_mesh_errors():
    with pytest.raises(ValueError, match="mesh_shape"), fake_mesh(()):
        pass
    with pytest.raises(ValueError, match="mesh_dim_names"), fake_mesh((2, 2), ("a",)):
        pass
    with pytest.raises(ValueError, match="rank"), fake_mesh((2, 2), rank=4):
        pass
    with fake_mesh((4,)), pytest.raises(RuntimeError, match="no default process group"):  # noqa: SIM117
        with fake_mesh((2,)):
            pass
