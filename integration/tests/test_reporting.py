"""Progress bar, plot, popularity baseline and checkpoint discovery."""

import dataclasses
import io
import math

import numpy as np
import pytest
import torch

from hyperrec.integration import TRAIN, LogisticRegressionBaseline, PopularityBaseline, auc
from hyperrec.integration.checkpoint import checkpoint_dir, find_checkpoint
from hyperrec.integration.distributed import resolve_device
from hyperrec.integration.plot import plot_metrics
from hyperrec.integration.progress import ProgressBar, format_duration


def test_progress_bar_in_a_log_prints_whole_lines():
    out = io.StringIO()
    bar = ProgressBar(10, stream=out, log_interval_s=0.0)
    for step in range(1, 11):
        bar.update(step, loss=0.5, auc=0.75, samples_per_s=1234.0)
    bar.write("eval done")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[-2].startswith("[########################] 10/10 100% | loss 0.5000 | auc 0.7500")
    assert "1,234 samples/s" in lines[-2] and "ETA 0:00" in lines[-2]
    assert lines[-1] == "eval done"


def test_progress_bar_disabled_and_durations():
    out = io.StringIO()
    bar = ProgressBar(3, stream=out, enabled=False)
    bar.update(3, force=True)
    bar.write("x")
    assert out.getvalue() == ""
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"
    assert format_duration(math.nan) == "?"
    with pytest.raises(ValueError, match="total"):
        ProgressBar(0)


def test_plot_writes_a_png(tmp_path):
    metrics = {
        "preset": "x",
        "history": {"step": [1, 2, 3], "loss": [1.0, 0.9, float("nan")], "ctr_auc": [0.5, 0.6, 0.7],
                    "samples_per_s": [10.0, 11.0, 12.0], "loss_ema": [1.0, 0.95, 0.9]},
        "eval": [{"step": 3, "loss": 0.8, "ctr_auc": 0.7, "cvr_auc": 0.6}],
        "baselines": {"popularity": {"ctr_auc": 0.55}, "ground_truth": {"ctr_auc": 0.8}},
    }  # fmt: skip
    path = plot_metrics(metrics, tmp_path / "sub" / "m.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_metrics({"history": {"step": []}}, tmp_path / "n.png")


def test_popularity_baseline_counts_and_smooths():
    pop = PopularityBaseline(4, prior_strength=2.0)
    pop.update(
        torch.tensor([0, 0, 1, 3]),
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        torch.tensor([1.0, 0.0, 0.0, 0.0]),
    )
    assert pop.counts.tolist() == [[2, 1, 0, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    ctr, cvr = PopularityBaseline.rates(pop.global_counts(), 2.0)
    g = 2 / 4
    assert ctr.tolist() == pytest.approx([(1 + 2 * g) / 4, (1 + 2 * g) / 3, g, 2 * g / 3])
    assert cvr[0].item() == pytest.approx((1 + 2 * 0.5) / 3)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pop.update(torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="shape"):
        pop.load_state_dict({"counts": torch.zeros(3, 5, dtype=torch.int64)})


def test_find_checkpoint_ignores_incomplete_ones(tmp_path):
    assert find_checkpoint(tmp_path) is None
    done, partial = checkpoint_dir(tmp_path, 4), checkpoint_dir(tmp_path, 8)
    done.mkdir(parents=True)
    (done / ".metadata").write_bytes(b"")
    partial.mkdir(parents=True)  # killed while saving: no .metadata
    assert find_checkpoint(tmp_path) == done
    assert find_checkpoint(done) == done
    with pytest.raises(FileNotFoundError):
        find_checkpoint(tmp_path / "nope")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_logistic_regression_baseline_learns_ids_and_round_trips(micro_data):
    def rigged(ids):
        # Clicks decided by the user id alone: a per-user weight must find it.
        b = micro_data.batch(TRAIN, ids)
        owner = torch.repeat_interleave(torch.arange(b.num_requests), b.candidate_offsets.diff())
        click = (b.user_ids[owner] % 2 == 0).float()
        return dataclasses.replace(b, click=click, conversion=torch.zeros_like(click))

    lr = LogisticRegressionBaseline(micro_data.schema)
    info = lr.fit(rigged(np.arange(i, i + 256)) for i in range(0, 2048, 256))
    assert info["impressions"] > 2048 and info["train_log_loss"] < 0.5
    held_out = rigged(np.arange(5000, 5400))
    p = lr.predict(held_out)
    assert p.dtype == torch.float64 and bool(((p > 0) & (p < 1)).all())
    assert auc(p, held_out.click) > 0.8
    assert torch.equal(lr.ids["user"], torch.unique(lr.ids["user"]))  # sorted, no repeats
    other = LogisticRegressionBaseline(micro_data.schema)
    other.load_state_dict(lr.state_dict())
    assert torch.equal(other.predict(held_out), p)
    # An id never seen while fitting contributes nothing (the prior mean, 0).
    items = held_out.candidate_items
    unseen = lr.predict(dataclasses.replace(held_out, candidate_items=items + 10**9))
    also_unseen = lr.predict(dataclasses.replace(held_out, candidate_items=items * 0 - 1))
    assert torch.equal(unseen, also_unseen)
    with pytest.raises(ValueError, match="at least one impression"):
        LogisticRegressionBaseline(micro_data.schema).fit([])
    with pytest.raises(TypeError, match="DataSchema"):
        LogisticRegressionBaseline(micro_data.config)  # type: ignore[arg-type]


def _eval_preset(micro):
    return dataclasses.replace(
        micro,
        data=dataclasses.replace(micro.data, eval_requests=64),
        train=dataclasses.replace(
            micro.train, steps=2, eval_every=0, ckpt_every=0, global_batch_size=16,
            sub_batch_size=8,
        ),
    )  # fmt: skip


def test_evaluation_reports_the_logit_spread_and_flags_a_collapsed_model(micro, tmp_path):
    """A model that predicts one value for every impression scores ~0.5 AUC like one that
    has not learned yet; the record tells them apart (logit std, ``collapsed``) and the
    trainer says so in its log."""
    from hyperrec.integration import TEST, VALID, Trainer
    from hyperrec.integration.trainer import COLLAPSED_LOGIT_STD

    trainer = Trainer(_eval_preset(micro), out_dir=tmp_path, progress=False)
    trainer.train_step()
    record = trainer.evaluate(VALID)
    assert record["ctr_logit_std"] > 10 * COLLAPSED_LOGIT_STD
    assert record["cvr_logit_std"] > 0 and record["collapsed"] is False

    forward = trainer.model.forward

    def constant(batch):
        ctr, cvr = forward(batch)
        # the same logit everywhere, still a function of the parameters
        return ctr.mean().expand_as(ctr) * 0 + 0.3, cvr

    trainer.model.forward = constant
    flat = trainer.evaluate(TEST)
    assert flat["ctr_logit_std"] < COLLAPSED_LOGIT_STD and flat["collapsed"] is True
    assert flat["ctr_auc"] == 0.5  # every pair tied
    out = io.StringIO()
    bar = ProgressBar(2, stream=out, log_interval_s=0.0)
    trainer._eval_and_log(bar)
    assert "collapsed" in out.getvalue() and "logit std" in out.getvalue()
    trainer.model.forward = forward
    out2 = io.StringIO()
    trainer._eval_and_log(ProgressBar(2, stream=out2, log_interval_s=0.0))
    assert "collapsed" not in out2.getvalue()
