import dataclasses

import numpy as np
import pytest
import torch

from hyperrec.integration import EVAL, TRAIN, DataConfig, SyntheticRecsysData, auc
from hyperrec.integration.data import DENSE_FEATURES


def _sample(batch, b):
    """Every field of request b of a batch, as plain tensors."""
    out = {"dense": batch.dense[b]}
    for name in ("sample_ids", "user_ids", "request_time"):
        out[name] = getattr(batch, name)[b]
    jagged = {
        "tag_offsets": ("tags",),
        "history_offsets": (
            "history_items",
            "history_categories",
            "history_actions",
            "history_time",
        ),
        "candidate_offsets": ("candidate_items", "candidate_categories", "click", "conversion"),
    }
    for off_name, names in jagged.items():
        off = getattr(batch, off_name)
        lo, hi = int(off[b]), int(off[b + 1])
        for name in names:
            out[name] = getattr(batch, name)[lo:hi]
    return out


def test_samples_are_pure_functions_of_their_index(micro_data):
    ids = np.array([5, 0, 977, 12, 5_000_000])
    together = micro_data.batch(TRAIN, ids)
    together.validate(
        num_items=micro_data.config.num_items, num_topics=micro_data.config.num_topics
    )
    for b, i in enumerate(ids):
        alone = micro_data.batch(TRAIN, [i])
        a, t = _sample(alone, 0), _sample(together, b)
        for name in a:
            assert torch.equal(a[name], t[name]), name
    again = SyntheticRecsysData(micro_data.config).batch(TRAIN, ids)
    assert torch.equal(again.history_items, together.history_items)
    assert torch.equal(again.click, together.click)


def test_splits_and_seeds_differ(micro_data):
    ids = np.arange(64)
    train = micro_data.batch(TRAIN, ids)
    held_out = micro_data.batch(EVAL, ids)
    other_seed = SyntheticRecsysData(dataclasses.replace(micro_data.config, seed=1)).batch(
        TRAIN, ids
    )
    assert not torch.equal(train.user_ids, held_out.user_ids)
    assert not torch.equal(train.user_ids, other_seed.user_ids)


def test_distribution_shapes(micro_data):
    cfg = micro_data.config
    batch = micro_data.batch(TRAIN, np.arange(20_000))
    lengths = batch.history_offsets.diff().numpy()
    assert lengths.min() >= cfg.min_seqlen and lengths.max() == cfg.max_seqlen
    assert batch.max_history_len == cfg.max_seqlen
    # Heavy tail: the mean sits well above the median and some requests hit the cap.
    assert lengths.mean() > 1.2 * np.median(lengths)
    assert 0.005 < (lengths == cfg.max_seqlen).mean() < 0.2
    # Zipf-like items: the 1% most frequent items take a large share of the events.
    counts = np.sort(np.bincount(batch.history_items.numpy(), minlength=cfg.num_items))[::-1]
    assert counts[: cfg.num_items // 100].sum() / counts.sum() > 0.1
    assert (batch.history_categories == batch.history_items % cfg.num_topics).all()
    ctr = float(batch.click.mean())
    assert 0.1 < ctr < 0.5
    assert float(batch.conversion.sum()) > 0 and bool((batch.conversion <= batch.click).all())
    assert batch.dense.shape == (20_000, len(DENSE_FEATURES)) and torch.isfinite(batch.dense).all()
    age = (
        torch.repeat_interleave(batch.request_time, batch.history_offsets.diff())
        - batch.history_time
    )
    assert (age >= 0).all()


def test_zero_length_histories_are_generated_when_allowed(micro_data):
    cfg = dataclasses.replace(micro_data.config, min_seqlen=0, seqlen_scale=0.5)
    batch = SyntheticRecsysData(cfg).batch(TRAIN, np.arange(500))
    assert (batch.history_offsets.diff() == 0).any()
    batch.validate(num_items=cfg.num_items, num_topics=cfg.num_topics)


def test_personalisation_is_what_the_labels_depend_on(micro_data):
    """The ground truth beats item popularity by a wide margin, so popularity is beatable."""
    ids = np.arange(30_000)
    batch, (p_click, _) = micro_data.batch_and_truth(TRAIN, ids)
    items, click = batch.candidate_items, batch.click
    n = micro_data.config.num_items
    half = click.numel() // 2
    imp = torch.bincount(items[:half], minlength=n).double()
    clk = torch.bincount(items[:half], weights=click[:half].double(), minlength=n)
    pop = (clk + 10 * clk.sum() / imp.sum()) / (imp + 10)
    pop_auc = auc(pop[items[half:]], click[half:])
    truth_auc = auc(p_click[half:], click[half:])
    assert truth_auc > pop_auc + 0.15, (truth_auc, pop_auc)


@pytest.mark.parametrize(
    ("ids", "split", "match"),
    [
        ([], TRAIN, "ids is empty"),
        ([3, -1], TRAIN, "non-negative"),
        ([10**6], EVAL, "eval_requests"),
        ([1], 7, "split"),
    ],
)
def test_bad_requests(micro_data, ids, split, match):
    with pytest.raises(ValueError, match=match):
        micro_data.batch(split, ids)


def test_data_config_type_checked():
    with pytest.raises(TypeError, match="DataConfig"):
        SyntheticRecsysData({"num_items": 4})  # type: ignore[arg-type]


def _broken(batch, **changes):
    return dataclasses.replace(batch, **changes)


def test_validate_rejects_bad_batches(micro_data):
    cfg = micro_data.config
    good = micro_data.batch(TRAIN, np.arange(8))
    v = dict(num_items=cfg.num_items, num_topics=cfg.num_topics)

    items = good.history_items.clone()
    items[0] = cfg.num_items
    with pytest.raises(ValueError, match=r"Batch.history_items has ids in \[.*outside \[0, 512\)"):
        _broken(good, history_items=items).validate(**v)
    cand = good.candidate_items.clone()
    cand[-1] = -3
    with pytest.raises(ValueError, match="Batch.candidate_items"):
        _broken(good, candidate_items=cand).validate(**v)
    dense = good.dense.clone()
    dense[2, 1] = float("nan")
    with pytest.raises(ValueError, match="Batch.dense contains NaN"):
        _broken(good, dense=dense).validate(**v)
    off = good.history_offsets.clone()
    off[1] = off[2] + 5  # request 0 now ends after request 1
    with pytest.raises(ValueError, match="history_offsets must start at 0 and be non-decreasing"):
        _broken(good, history_offsets=off).validate(**v)
    with pytest.raises(ValueError, match="history_offsets\\[-1\\]"):
        _broken(good, history_items=good.history_items[:-1]).validate(**v)
    conv = good.conversion.clone()
    conv[good.click == 0] = 1.0
    with pytest.raises(ValueError, match="conversion needs a click"):
        _broken(good, conversion=conv).validate(**v)
    late = good.history_time.clone()
    late[0] = good.request_time.max() + 10
    with pytest.raises(ValueError, match="later than their request_time"):
        _broken(good, history_time=late).validate(**v)
    with pytest.raises(ValueError, match="max_history_len"):
        _broken(good, max_history_len=good.max_history_len + 1).validate(**v)
    with pytest.raises(TypeError, match="Batch.click must be a torch.float32"):
        _broken(good, click=good.click.double()).validate(**v)


def test_validate_rejects_an_empty_batch(micro_data):
    good = micro_data.batch(TRAIN, np.arange(2))
    z = torch.zeros(1, dtype=torch.int64)
    empty = dataclasses.replace(
        good,
        sample_ids=good.sample_ids[:0],
        user_ids=good.user_ids[:0],
        request_time=good.request_time[:0],
        dense=good.dense[:0],
        tag_offsets=z,
        tags=good.tags[:0],
        history_offsets=z,
        history_items=good.history_items[:0],
        history_categories=good.history_categories[:0],
        history_actions=good.history_actions[:0],
        history_time=good.history_time[:0],
        candidate_offsets=z,
        candidate_items=good.candidate_items[:0],
        candidate_categories=good.candidate_categories[:0],
        click=good.click[:0],
        conversion=good.conversion[:0],
        max_history_len=0,
    )
    with pytest.raises(ValueError, match="batch is empty"):
        empty.validate(num_items=512, num_topics=16)


def test_history_lengths_match_batches(micro_data):
    ids = np.arange(100, 300)
    assert np.array_equal(
        micro_data.history_lengths(TRAIN, ids),
        micro_data.batch(TRAIN, ids).history_offsets.diff().numpy(),
    )


def test_large_vocabularies_need_no_tables():
    # O(1) memory in num_items / num_users: building the generator must be instant.
    cfg = DataConfig(num_items=2**40, num_topics=1024, num_users=10**12, max_seqlen=8)
    batch = SyntheticRecsysData(cfg).batch(TRAIN, np.arange(4))
    assert int(batch.candidate_items.max()) < 2**40
