"""BBS must never communicate: every public entry point runs with collectives patched to
raise, in-process and on 2 real gloo ranks (where the global mode must also agree)."""

import numpy as np
import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyperrec.bbs import (
    BalancedBatchSampler,
    BalancedShuffler,
    CostBudgetBatcher,
    CostModel,
    global_shuffle_plan,
    shuffle_plan,
)
from hyperrec.bbs.simulate import SimulationConfig, simulate
from hyperrec.testing import run_on_ranks

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class CollectiveCalled(RuntimeError):
    pass


def _raiser(name):
    def fail(*args, **kwargs):
        raise CollectiveCalled(f"torch.distributed.{name} was called")

    return fail


def _forbid_collectives(setattr_fn=setattr):
    patched = []
    for module in (dist, c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                setattr_fn(module, name, _raiser(name))
                patched.append(name)
    return patched


def _workload(rank, world_size):
    """What a rank runs: every public entry point, on a shared seeded index."""
    rng = np.random.default_rng(1234)  # the shared index: same on every rank
    lengths = rng.integers(1, 2048, 3000)
    costs = CostModel(linear=1.0, quadratic=1 / 512).sample_costs(lengths)
    kw = {"samples_per_sub_batch": 8, "sub_batches_per_step": 4, "window_steps": 4}
    out = {
        "global_sampler": list(BalancedBatchSampler(costs, mode="global", **kw)),
        "local_sampler": list(BalancedBatchSampler(costs, mode="local", **kw)),
        "rank": (rank, world_size),
    }
    sb = costs[: 8 * 4 * 4 * world_size * 8].reshape(-1, 8).sum(axis=1)
    out["global_plan"] = global_shuffle_plan(
        sb[: 4 * world_size * 4], world_size=world_size, sub_batches_per_step=4, window_steps=4
    )
    mine = sb[rank::world_size]
    out["plan"] = shuffle_plan(mine[:16], sub_batches_per_step=4, window_steps=4)
    out["stream"] = list(
        BalancedShuffler(list(mine), sub_batches_per_step=4, window_steps=4, cost=float)
    )
    out["budget"] = list(CostBudgetBatcher(list(mine), budget=float(mine.mean() * 4)))
    sim = simulate(
        SimulationConfig(
            distributions=("uniform",),
            world_sizes=(4,),
            windows=(1, 2),
            steps=4,
            min_rank_steps=0,
            samples_per_sub_batch=8,
        )
    )
    out["sim_rows"] = len(sim.rows)
    return out


def _rank_main():
    _forbid_collectives()
    return _workload(dist.get_rank(), dist.get_world_size())


def test_patch_really_raises(monkeypatch):
    assert "all_reduce" in _forbid_collectives(monkeypatch.setattr)
    with pytest.raises(CollectiveCalled):
        dist.all_reduce(None)
    with pytest.raises(CollectiveCalled):
        c10d.broadcast(None, 0)


def test_everything_runs_without_collectives_in_process(monkeypatch):
    _forbid_collectives(monkeypatch.setattr)
    out = _workload(0, 1)
    assert out["sim_rows"] == 2 and out["global_sampler"] and out["budget"]


def test_two_gloo_ranks_agree_without_communicating():
    results = run_on_ranks(_rank_main, 2, timeout_s=240)
    assert [r["rank"] for r in results] == [(0, 2), (1, 2)]
    # The global mode: every rank computed the same plan with no communication ...
    assert results[0]["global_plan"] == results[1]["global_plan"]
    # ... and the ranks' sampler outputs are its disjoint rows, step by step.
    g0, g1 = results[0]["global_sampler"], results[1]["global_sampler"]
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        assert not set(a) & set(b)
    # Each rank's output equals what the same sampler gives in this process.
    rng = np.random.default_rng(1234)
    costs = CostModel(linear=1.0, quadratic=1 / 512).sample_costs(rng.integers(1, 2048, 3000))
    kw = {"samples_per_sub_batch": 8, "sub_batches_per_step": 4, "window_steps": 4}
    for rank, res in enumerate(results):
        for mode in ("global", "local"):
            here = BalancedBatchSampler(costs, mode=mode, rank=rank, world_size=2, **kw)
            assert res[f"{mode}_sampler"] == list(here)
