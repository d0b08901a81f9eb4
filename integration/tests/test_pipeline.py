import numpy as np
import pytest

from hyperrec.integration import TrainStream
from hyperrec.integration.pipeline import default_cost_model


def _stream(data, *, rank=0, world=1, k=3, w=4, s=8):
    return TrainStream(
        data,
        sub_batch_size=s,
        sub_batches_per_step=k,
        window_steps=w,
        rank=rank,
        world_size=world,
        cost=default_cost_model(16),
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_cover_every_request_once_within_the_delay_bound(micro_data, world):
    k, w, s, steps = 3, 4, 8, 12
    seen = []
    for rank in range(world):
        stream = _stream(micro_data, rank=rank, world=world, k=k, w=w, s=s)
        for step in range(steps):
            item = stream.next()
            assert len(item.sub_batches) == k
            ids = item.batch.sample_ids.numpy()
            assert len(ids) == k * s
            seen.append(ids)
            for j in item.sub_batches:
                assert j % world == rank
                arrival_step = (j // world) // k
                assert abs(step - arrival_step) <= w - 1
    seen = np.concatenate(seen)
    assert len(seen) == len(set(seen.tolist())) == world * steps * k * s
    assert set(seen.tolist()) == set(range(world * steps * k * s))


def test_bbs_flattens_step_costs(micro_data):
    stream = _stream(micro_data, k=4, w=8, s=4)
    items = [stream.next() for _ in range(64)]
    bbs = np.array([i.cost for i in items]).reshape(8, 8)
    arrival = np.array([i.arrival_cost for i in items]).reshape(8, 8)
    # Same work per window, spread far more evenly over its steps.
    np.testing.assert_allclose(bbs.sum(axis=1), arrival.sum(axis=1))
    excess = lambda c: (c.max(axis=1) / c.mean(axis=1) - 1).mean()  # noqa: E731
    assert excess(bbs) < 0.5 * excess(arrival), (excess(bbs), excess(arrival))


def test_resume_mid_window_replays_the_same_batches(micro_data):
    a = _stream(micro_data, rank=1, world=2)
    for _ in range(5):  # 5 = one window of 4 + 1 step into the next
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(6)]
    b = _stream(micro_data, rank=1, world=2)
    b.load_state_dict(state)
    got = [b.next() for _ in range(6)]
    for x, y in zip(expected, got):
        assert x.sub_batches == y.sub_batches
        assert np.array_equal(x.batch.sample_ids.numpy(), y.batch.sample_ids.numpy())
        assert x.arrival_cost == y.arrival_cost


def test_state_from_another_layout_is_rejected(micro_data):
    state = _stream(micro_data, rank=0, world=2).state_dict()
    with pytest.raises(ValueError, match="stream state was saved with"):
        _stream(micro_data, rank=1, world=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rank": 2, "world": 2}, "rank"), ({"s": 0}, "sub_batch_size"), ({"w": 0}, "window_steps")],
)
def test_bad_stream_arguments(micro_data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _stream(micro_data, **kwargs)
