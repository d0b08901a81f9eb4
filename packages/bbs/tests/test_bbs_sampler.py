import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from hyperrec.bbs import BalancedBatchSampler, BalancedShuffler, CostBudgetBatcher, ImbalanceStats


def _samplers(costs, r, **kw):
    base = {"samples_per_sub_batch": 2, "sub_batches_per_step": 3, "window_steps": 4}
    return [BalancedBatchSampler(costs, rank=i, world_size=r, **{**base, **kw}) for i in range(r)]


@settings(deadline=None, max_examples=20)
@given(
    n=st.integers(24, 200),
    r=st.integers(1, 4),
    mode=st.sampled_from(["local", "global"]),
    shuffle=st.booleans(),
    seed=st.integers(0, 100),
)
def test_epoch_covers_each_sample_at_most_once_across_ranks(n, r, mode, shuffle, seed):
    costs = np.random.default_rng(seed).lognormal(0, 1, n)
    per_step = r * 3 * 2
    if n < per_step:
        return
    samplers = _samplers(costs, r, mode=mode, shuffle=shuffle, seed=seed)
    steps = n // per_step
    assert all(len(s) == steps for s in samplers)
    runs = [list(s) for s in samplers]
    seen = [i for run in runs for step in run for i in step]
    assert len(seen) == len(set(seen)) == steps * per_step
    assert all(len(step) == 6 for run in runs for step in run)


def test_global_mode_delay_bound_and_same_plan_on_every_rank():
    rng = np.random.default_rng()
    r, k, s, w = 4, 3, 2, 4
    costs = rng.lognormal(0, 1, 500)
    samplers = _samplers(costs, r, mode="global", seed=7)
    order, _ = samplers[0]._epoch_data()
    position = {int(i): p for p, i in enumerate(order)}
    for step in range(len(samplers[0])):
        for sm in samplers:
            for i in sm.step_indices(step):
                natural = position[i] // (r * k * s)
                assert abs(step - natural) <= w - 1
    # Every rank computes the same global plan (its own row of it).
    for sm in samplers[1:]:
        np.testing.assert_array_equal(sm._epoch_data()[0], order)


def test_local_mode_keeps_a_rank_on_its_own_shard():
    costs = np.random.default_rng().lognormal(0, 1, 240)
    samplers = _samplers(costs, 4, mode="local", seed=3)
    for rank, sm in enumerate(samplers):
        shard = set(np.random.default_rng([3, 0]).permutation(240)[rank::4].tolist())
        assert {i for step in sm for i in step} <= shard


def test_global_mode_balances_better_than_local_and_unbalanced():
    # One draw of these heavy-tailed costs can hold a sample so large that no window can hide
    # it (over 200 seeds, global/local reached 0.54 on single draws, median 0.15), so the
    # claim is checked on the excess summed over five fresh draws: over 100 such sums
    # local/none stayed <= 0.45 and global/local <= 0.29.
    rng = np.random.default_rng()
    r, n = 8, 8 * 8 * 16 * 48

    def excess(costs, **kw):
        sm = [
            BalancedBatchSampler(
                costs, samples_per_sub_batch=16, sub_batches_per_step=8, rank=i, world_size=r, **kw
            )
            for i in range(r)
        ]
        c = np.array([[costs[idx].sum() for idx in s] for s in sm]).T  # (steps, ranks)
        return ImbalanceStats.from_step_costs(c).excess

    none = local = glob = 0.0
    for _ in range(5):
        costs = rng.lognormal(5, 1, n) ** 1.5
        none += excess(costs, window_steps=1, mode="local")
        local += excess(costs, window_steps=8, mode="local")
        glob += excess(costs, window_steps=8, mode="global")
    assert local < 0.7 * none
    assert glob < 0.5 * local


@settings(deadline=None, max_examples=15)
@given(mode=st.sampled_from(["local", "global"]), epoch=st.integers(0, 3), data=st.data())
def test_resume_is_exact(mode, epoch, data):
    costs = np.random.default_rng(epoch).random(300)
    (a,) = _samplers(costs, 1, mode=mode)
    a.set_epoch(epoch)
    full = list(a)
    a.set_epoch(epoch)
    stop = data.draw(st.integers(0, len(full)))
    head = list(itertools.islice(iter(a), stop))
    (b,) = _samplers(costs, 1, mode=mode)
    b.load_state_dict(a.state_dict())
    assert head + list(b) == full


def test_epochs_reshuffle_and_are_reproducible():
    costs = np.random.default_rng().random(120)
    (a,) = _samplers(costs, 1)
    e0, e1 = list(a), list(a)  # iterating again moves to the next epoch
    assert e0 != e1
    a.set_epoch(0)
    assert list(a) == e0
    (c,) = _samplers(costs, 1, shuffle=False)
    assert sorted(i for step in c for i in step) == list(range(120))


def test_dataloader_integration():
    costs = np.random.default_rng().random(96)
    (sampler,) = _samplers(costs, 1)
    data = TensorDataset(torch.arange(96))
    batches = [b[0].tolist() for b in DataLoader(data, batch_sampler=sampler)]
    sampler.set_epoch(0)
    assert batches == list(sampler)


def test_states_roundtrip_through_distributed_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    costs = np.random.default_rng().random(120)
    (sampler,) = _samplers(costs, 1)
    shuffler = BalancedShuffler(list(range(40)), sub_batches_per_step=2, window_steps=3)
    batcher = CostBudgetBatcher(list(range(1, 40)), budget=30.0)
    for obj in (sampler, shuffler, batcher):
        next(itertools.islice(iter(obj), 2, None))  # advance 3 steps
    saved = {"sampler": sampler.state_dict(), "shuffler": shuffler.state_dict()}
    saved["batcher"] = batcher.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
        fresh = {
            "sampler": _samplers(costs, 1)[0].state_dict(),
            "shuffler": BalancedShuffler(
                list(range(40)), sub_batches_per_step=2, window_steps=3
            ).state_dict(),
            "batcher": CostBudgetBatcher(list(range(1, 40)), budget=30.0).state_dict(),
        }
        dcp.load(fresh, checkpoint_id=str(tmp_path), no_dist=True)
    assert fresh == saved


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"rank": 2, "world_size": 2}, ValueError, "rank"),
        ({"rank": -1, "world_size": 2}, ValueError, "rank"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"mode": "pairs"}, ValueError, "mode"),
        ({"samples_per_sub_batch": 0}, ValueError, "samples_per_sub_batch"),
        ({"window_steps": 1.0}, TypeError, "window_steps"),
        ({"shuffle": 1}, TypeError, "shuffle"),
        ({"seed": -1}, ValueError, "seed"),
        ({"samples_per_sub_batch": 100}, ValueError, "one step"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    args = {"samples_per_sub_batch": 2, "sub_batches_per_step": 2, "window_steps": 2, **kwargs}
    with pytest.raises(err, match=match):
        BalancedBatchSampler(np.ones(50), **args)


def test_bad_costs_and_states():
    with pytest.raises(ValueError, match="sample_costs"):
        BalancedBatchSampler(
            [1.0, -1.0], samples_per_sub_batch=1, sub_batches_per_step=1, window_steps=1
        )
    (a,) = _samplers(np.ones(60), 1)
    for key, value in (("seed", 5), ("samples_per_sub_batch", 3), ("mode", "global")):
        with pytest.raises(ValueError, match=key):
            a.load_state_dict({**a.state_dict(), key: value})
    with pytest.raises(ValueError, match="segments"):
        a.load_state_dict({**a.state_dict(), "segments": [[1, 2]]})
    with pytest.raises(ValueError, match="version"):
        a.load_state_dict({**a.state_dict(), "version": 7})
    with pytest.raises(ValueError, match="step"):
        a.load_state_dict({**a.state_dict(), "step": 10**6})
    with pytest.raises(ValueError, match="step"):
        a.step_indices(len(a))


def test_state_at_trained_step_resumes_there():
    costs = np.random.default_rng().random(240)
    (a,) = _samplers(costs, 1)
    full = list(a)
    a.set_epoch(0)
    it = iter(a)
    for _ in range(5):  # a DataLoader prefetched 5 steps, but only 3 were trained
        next(it)
    (b,) = _samplers(costs, 1)
    b.load_state_dict(a.state_dict(step=3))
    assert list(b) == full[3:]
    with pytest.raises(ValueError, match="step"):
        a.state_dict(step=len(a) + 1)


def _epoch_samples(samplers, epoch, stop=None):
    """Samples the ranks yield in their first ``stop`` steps of ``epoch`` (all: None)."""
    out = []
    for smp in samplers:
        smp.set_epoch(epoch)
        steps = list(itertools.islice(iter(smp), stop if stop is not None else len(smp)))
        out += [i for step in steps for i in step]
    return out


def _resume_rest(samplers, state):
    """Load ``state`` into every new rank and drain the epoch; same steps on every rank."""
    rest, counts = [], set()
    for smp in samplers:
        smp.load_state_dict(state)
        batches = list(smp)  # the rest of the epoch; then the sampler moves to the next
        per_step = smp.sub_batches_per_step * smp.samples_per_sub_batch
        assert all(len(b) == per_step for b in batches)
        counts.add(len(batches))
        rest += [i for b in batches for i in b]
    assert len(counts) == 1
    return rest


@settings(deadline=None, max_examples=25)
@given(
    mode=st.sampled_from(["local", "global"]),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    new_k=st.integers(1, 3),
    data=st.data(),
)
def test_resume_on_another_world_size_trains_each_sample_at_most_once(mode, old, new, new_k, data):
    n = 240
    costs = np.random.default_rng(10 * old + new).random(n)
    a = _samplers(costs, old, mode=mode)
    stop = data.draw(st.integers(0, len(a[0])))
    trained = _epoch_samples(a, epoch=1, stop=stop)
    state = a[0].state_dict()
    b = _samplers(costs, new, mode=mode, sub_batches_per_step=new_k)
    rest = _resume_rest(b, state)
    both = trained + rest
    assert len(both) == len(set(both))  # nothing twice in the epoch
    # Dropped: less than one step of the new layout (or of the old one, if nothing moved).
    per_step_new = new * new_k * 2
    assert n - len(both) < max(per_step_new, old * 3 * 2)
    if stop > 0 and (old, 3) != (new, new_k):
        assert n - len(both) < per_step_new
    # The next epoch is a normal one of the new layout.
    nxt = [list(smp) for smp in b]
    fresh = _samplers(costs, new, mode=mode, sub_batches_per_step=new_k)
    for smp in fresh:
        smp.set_epoch(2)
    assert nxt == [list(smp) for smp in fresh]


@pytest.mark.parametrize("mode", ["local", "global"])
def test_resume_through_several_world_sizes_in_one_epoch(mode):
    n = 600
    costs = np.random.default_rng(7).random(n)
    a = _samplers(costs, 4, mode=mode)
    trained = _epoch_samples(a, epoch=0, stop=5)
    state = a[0].state_dict()
    b = _samplers(costs, 3, mode=mode, window_steps=2)
    for smp in b:
        smp.load_state_dict(state)
    trained += [i for smp in b for step in itertools.islice(iter(smp), 4) for i in step]
    state_b = b[0].state_dict()
    assert state_b["segments"] == [[4, 3, 4, 5]] and state_b["step"] == 4
    # The saved state resumes exactly on the same layout...
    (again,) = [_samplers(costs, 3, mode=mode, window_steps=2)[1]]
    again.load_state_dict(b[1].state_dict())
    assert list(itertools.islice(iter(again), len(again))) == [
        b[1].step_indices(t) for t in range(4, len(b[1]))
    ]
    # ...and moves on to a third one.
    c = _samplers(costs, 2, mode=mode, sub_batches_per_step=5)
    rest = _resume_rest(c, state_b)
    both = trained + rest
    assert len(both) == len(set(both))
    assert n - len(both) < 2 * 5 * 2


def test_version_1_states_still_load():
    costs = np.random.default_rng(3).random(120)
    (a,) = _samplers(costs, 1)
    head = list(itertools.islice(iter(a), 3))
    old = {k: v for k, v in a.state_dict().items() if k != "segments"}
    old["version"] = 1
    (b,) = _samplers(costs, 1)
    b.load_state_dict(old)
    a.set_epoch(0)
    assert head + list(b) == list(a)
