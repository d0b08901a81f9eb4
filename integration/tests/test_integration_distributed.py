"""Two real gloo ranks (hyperrec fully_shard, and FSDP2) against one process, for the
same global batch."""

import dataclasses

import pytest
import torch.distributed as dist

from hyperrec.integration import Trainer, get_preset
from hyperrec.integration.checkpoint import checkpoint_dir
from hyperrec.testing import run_on_ranks


def _preset(sharding="hyperrec"):
    micro = get_preset("micro")
    # W = 1: every global step then holds the same requests on any world size (with
    # W > 1 each rank balances its own window, which regroups requests differently).
    # Dense tables: the single process's default, to compare with (sharded tables on
    # several ranks are tested in test_wiring.py).
    train = dataclasses.replace(
        micro.train, steps=8, ckpt_every=4, window_steps=1, sharding=sharding, sparse="dense"
    )
    data = dataclasses.replace(micro.data, eval_requests=512)
    return dataclasses.replace(micro, train=train, data=data)


def _train_then_resume(preset, out_dir):
    """Train, then resume from the step-4 checkpoint and train steps 5-8 again."""
    records, resumed = [], []
    result = Trainer(preset, out_dir=out_dir, progress=False, on_step=records.append).fit(
        plot=False
    )
    again = Trainer(
        preset, resume=checkpoint_dir(out_dir, 4), progress=False, on_step=resumed.append
    )
    again.fit(plot=False)
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "loss": [r.loss for r in records],
        "ids": [sorted(r.sample_ids.tolist()) for r in records],
        "resumed": [r.loss for r in resumed],
        "final": result.metrics.get("final"),
    }


@pytest.mark.parametrize("sharding", ["hyperrec", "fsdp2"])
def test_two_ranks_match_one_rank_and_resume_exactly(tmp_path, sharding):
    preset = _preset(sharding)
    one = _train_then_resume(preset, tmp_path / "one")
    two = run_on_ranks(_train_then_resume, 2, preset, tmp_path / "two", timeout_s=600)

    r0, r1 = two
    assert r0["loss"] == r1["loss"]  # the logged loss is the all-reduced global mean
    for step in range(8):
        assert sorted(r0["ids"][step] + r1["ids"][step]) == one["ids"][step]
        assert not set(r0["ids"][step]) & set(r1["ids"][step])
    assert r0["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)

    assert one["resumed"] == one["loss"][4:]
    assert r0["resumed"] == r0["loss"][4:]  # sharded DCP checkpoint, exact resume

    assert r1["final"] is None  # only rank 0 reports
    for key in ("ctr_auc", "cvr_auc", "ctr_ne", "loss"):
        assert r0["final"][key] == pytest.approx(one["final"][key], rel=1e-4, abs=1e-5), key
    assert r0["final"]["impressions"] == one["final"]["impressions"]

    # Another world size reshards (test_faults checks what arrives); the data position
    # is moved, not refused.
    one_rank = Trainer(preset, resume=tmp_path / "two", progress=False)
    assert one_rank.step == 8 and "resharded from 2 to 1 ranks" in one_rank.resume_notes[0]
