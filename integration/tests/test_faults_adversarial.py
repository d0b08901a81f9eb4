"""Adversarial sweep of fault handling and run bookkeeping: restarts from the last complete
checkpoint, the non-finite policies, metrics.json across resumes, fault specs, resuming
on other world sizes (CPU, gloo, the micro preset).

Each test that caught a bug says what it caught ("Before: ..."); the others pin down
behaviour that held under attack. The uninterrupted paths are tested in
``test_faults.py``, ``test_train.py`` and ``test_trainer_adversarial.py``.
"""

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from test_faults import _params
from test_faults import _preset as _faults_preset

from hyperrec.integration import VALID, NonFiniteError, Trainer, get_preset, override
from hyperrec.integration.checkpoint import checkpoint_dir
from hyperrec.integration.faults import FAULT_ENV
from hyperrec.integration.plot import plot_metrics
from hyperrec.integration.train import main
from hyperrec.integration.trainer import lr_factor
from hyperrec.testing import run_on_ranks


def _preset(**train):
    return _faults_preset(eval_requests=128, **train)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Deterministic per-step keys of metrics.json (the rest are wall-clock timings).
_KEYS = ("step", "loss", "loss_ema", "ctr_loss", "ctr_auc", "lr", "grad_norm", "skipped",
         "cost_max_over_mean", "step_tflop")  # fmt: skip


# -- two gloo ranks: one spawn for three scenarios (spawning is the slow part) -------------
# The reshard chain 1 -> 2 -> 1: checkpoints every step, BBS windows of 3 steps, so each
# hop resumes mid-window and the 2-rank segment's checkpoint (step 5) is taken while the
# backlog from the first hop is still being read.
_CHAIN = {"steps": 10, "ckpt_every": 1, "window_steps": 3}
_CUTS = (3, 5)  # segment i is resumed from its checkpoint of step _CUTS[i]


def _segment(out, resume, stop_after):
    records = []
    t = Trainer(_preset(**_CHAIN), out_dir=out, resume=resume, progress=False,
                on_step=records.append)  # fmt: skip
    start = t.step
    t.fit(stop_after=stop_after, plot=False)
    return start, [(r.step, list(r.sub_batches), r.sample_ids.tolist()) for r in records]


def _nan_grad_on_rank1(out, policy, on_step):
    os.environ[FAULT_ENV] = "nan_grad@step=3,rank=1,module=mlp"
    try:
        t = Trainer(_preset(steps=5, ckpt_every=0, nonfinite=policy), out_dir=out,
                    progress=False, on_step=(lambda r: None) if on_step else None)  # fmt: skip
        try:
            t.fit(plot=False)
        except NonFiniteError as err:
            return err.report.as_dict()
        return t.nonfinite[0]
    finally:
        del os.environ[FAULT_ENV]


def _two_rank_job(tmp):
    out = {"rank": dist.get_rank()}
    # 1. metrics.json of a run killed after step 6 and resumed from step 4.
    p = _preset(steps=8, ckpt_every=4, eval_every=2)
    out["full"] = Trainer(p, out_dir=tmp / "full", progress=False).fit(plot=False).metrics
    Trainer(p, out_dir=tmp / "cut", progress=False).fit(stop_after=6, plot=False)
    resumed = Trainer(p, resume=tmp / "cut", progress=False)
    out["loaded_evals"] = [e["step"] for e in resumed.evals]
    out["resumed"] = resumed.fit(plot=False).metrics
    # 2. A NaN written into rank 1's gradient shard only, under each policy, pipelined
    #    (the "stop" check one step later, from flags) and step by step (on_step).
    out["reports"] = {
        (policy, on_step): _nan_grad_on_rank1(tmp / f"nan-{policy}-{on_step}", policy, on_step)
        for policy in ("stop", "skip")
        for on_step in (False, True)
    }
    # 3. The middle hop of the reshard chain.
    out["segment"] = _segment(tmp / "chain", checkpoint_dir(tmp / "chain", _CUTS[0]), _CUTS[1])
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    first = _segment(tmp / "chain", None, _CUTS[0] + 1)  # one process; step 4 is lost
    ranks = run_on_ranks(_two_rank_job, 2, tmp, timeout_s=600)
    last = _segment(tmp / "chain", checkpoint_dir(tmp / "chain", _CUTS[1]), None)
    return {"ranks": ranks, "chain": [[first], [r["segment"] for r in ranks], [last]]}


def test_two_rank_resume_keeps_the_evaluations_and_rank0_training_auc(two_ranks):
    # Before: the checkpoint's meta (step, history, evaluations) was saved from whichever
    # rank DCP's dedup picked, here rank 1, which holds no evaluations (they are kept on
    # rank 0) and its own training AUC. A resumed 2-rank run then reported validations
    # [6, 8] instead of [2, 4, 6, 8] (best_validation and early stopping's patience lost
    # the ones before the checkpoint) and rank 1's training AUC for the steps before it.
    r0, r1 = two_ranks["ranks"]
    assert r0["loaded_evals"] == r1["loaded_evals"] == [2, 4]  # every rank: rank 0's
    full, resumed = r0["full"], r0["resumed"]
    assert [e["step"] for e in resumed["eval"]] == [2, 4, 6, 8]
    assert resumed["eval"] == full["eval"] and resumed["final"] == full["final"]
    assert resumed["best_validation"] == full["best_validation"]
    for key in _KEYS:
        assert resumed["history"][key] == full["history"][key], key
    assert resumed["history"]["step"] == list(range(1, 9))  # no step twice, none missing
    assert r1["full"] == r1["resumed"] == {}  # only rank 0 reports


def test_stop_names_the_rank_whose_gradient_is_nonfinite(two_ranks):
    # Before: under nonfinite="stop" the report came from per-parameter flags computed
    # after the all-reduce of the squared norms, so every rank flagged the parameter and
    # a NaN in rank 1's gradient shard was reported "on rank 0", grad_ranks [0, 1];
    # "skip" (from the gradients themselves) said rank 1, grad_ranks [1].
    for r in two_ranks["ranks"]:
        for (policy, on_step), report in r["reports"].items():
            where = (r["rank"], policy, on_step)
            assert report["step"] == 3 and report["loss_ranks"] == [], where
            assert report["rank"] == 1 and report["grad_ranks"] == [1], where
            assert report["module"] == "mlp.0" and report["parameter"] == "mlp.0.weight", where
            assert "'mlp.0' (parameter 'mlp.0.weight') on rank 1" in report["message"], where


def test_resume_1_2_1_ranks_trains_every_request_once(two_ranks):
    # No bug found: checkpoints mid-window and mid-backlog, resharded twice.
    segments = two_ranks["chain"]
    assert [seg[0][0] for seg in segments] == [0, *_CUTS]
    ids, subs = [], []
    for i, seg in enumerate(segments):
        last = _CUTS[i] if i < len(_CUTS) else _CHAIN["steps"]  # the later steps were lost
        for _, records in seg:
            for step, sub_batches, sample_ids in records:
                if step <= last:
                    ids += sample_ids
                    subs += sub_batches
    preset = _preset(**_CHAIN)
    assert len(ids) == len(set(ids)) == _CHAIN["steps"] * preset.train.global_batch_size
    k = preset.train.global_batch_size // preset.train.sub_batch_size
    assert len(subs) == len(set(subs)) == _CHAIN["steps"] * k
    # Nothing skipped early in the stream (BBS may reorder within its last window only).
    window = preset.train.window_steps * k
    assert set(range(len(subs) - window)) <= set(subs)


# -- one process -------------------------------------------------------------------------
def test_skip_at_the_first_and_last_steps_and_in_a_row_then_resume(tmp_path, monkeypatch):
    # No bug found in the policy itself: skips at step 1 (no optimizer state yet), 3 and 4
    # in a row (a NaN gradient, then a NaN loss) and at the last step, 8; a checkpoint at
    # 4 (a skipped step), killed after 6 and resumed: the same parameters, history,
    # reports and evaluations as the uninterrupted run, each step once. (It did catch the
    # learning-rate history of the pipelined loop: the uninterrupted run here finishes
    # each step at once for its on_step callback, the resumed one is pipelined; see
    # test_the_history_records_each_steps_own_learning_rate.)
    monkeypatch.setenv(
        FAULT_ENV,
        "nan_loss@step=1,rank=0; nan_grad@step=3,rank=0,module=ctr_head; "
        "nan_loss@step=4,rank=0; nan_loss@step=8,rank=0",
    )
    preset = _preset(steps=8, ckpt_every=4, eval_every=3, nonfinite="skip")
    snaps = {}
    full = Trainer(preset, out_dir=tmp_path / "full", progress=False)
    start = _params(full)
    full.on_step = lambda rec: snaps.__setitem__(rec.step, _params(full))
    m_full = full.fit(plot=False).metrics
    assert _same(start, snaps[1]) and _same(snaps[2], snaps[4]) and _same(snaps[7], snaps[8])
    assert not _same(snaps[1], snaps[2]) and not _same(snaps[6], snaps[7])
    hist = m_full["history"]
    assert hist["skipped"] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert hist["loss_ema"][0] is None and hist["loss_ema"][3] == hist["loss_ema"][1]
    assert [r["step"] for r in m_full["nonfinite_steps"]] == [1, 3, 4, 8]
    assert m_full["nonfinite_steps"][1]["module"] == "ctr_head"
    assert math.isfinite(m_full["final"]["ctr_auc"])

    Trainer(preset, out_dir=tmp_path / "cut", progress=False).fit(stop_after=6, plot=False)
    resumed = Trainer(preset, resume=tmp_path / "cut", progress=False)
    assert resumed.step == 4
    m_cut = resumed.fit(plot=False).metrics
    assert _same(_params(full), _params(resumed))
    for key in _KEYS:
        assert m_cut["history"][key] == hist[key], key
    assert m_cut["nonfinite_steps"] == m_full["nonfinite_steps"]  # step 8's once
    assert m_cut["eval"] == m_full["eval"] and m_cut["final"] == m_full["final"]

    # Resumed at the final step: nothing trained, the run reported once more, the same.
    again = Trainer(preset, resume=tmp_path / "cut", progress=False)
    assert again.step == 8
    m_again = again.fit(plot=False).metrics
    assert m_again["history"] == m_cut["history"]
    assert [e["step"] for e in m_again["eval"]] == [3, 6, 8]  # the final one not twice
    assert m_again["final"] == m_cut["final"]
    on_disk = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert on_disk["history"]["step"] == list(range(1, 9))


def test_the_history_records_each_steps_own_learning_rate(tmp_path):
    # Before: fit's pipelined loop read the optimizer's rate when it finished step n,
    # after step n + 1 had set its own, so metrics.json's "lr" was each step's
    # successor's (warm-up and decay one step early), except at the steps finished at
    # once (checkpoints, evaluations, the last), which made the curve depend on cadence.
    preset = _preset(steps=9, ckpt_every=3, warmup_steps=4)
    history = Trainer(preset, out_dir=tmp_path, progress=False).fit(plot=False).metrics["history"]
    want = [preset.train.lr * lr_factor(step, preset.train) for step in range(1, 10)]
    assert history["lr"] == pytest.approx(want, rel=1e-12)


def test_a_checkpoint_before_any_update_does_not_change_the_run(tmp_path, monkeypatch):
    # Before: saving while AdamW had no state yet (every step so far skipped) let DCP's
    # get_state_dict create it with a zero-lr step(), so the optimizer counted one step
    # more from then on: the checkpoint cadence (ckpt_every, free to change on resume)
    # changed the trained parameters, and a resume from that checkpoint did not match a
    # run that had not saved there.
    monkeypatch.setenv(FAULT_ENV, "nan_loss@step=1,rank=0")
    plain = Trainer(_preset(steps=3, ckpt_every=0, nonfinite="skip"), out_dir=tmp_path / "a",
                    progress=False)  # fmt: skip
    plain.fit(plot=False)
    saving = Trainer(_preset(steps=3, ckpt_every=1, nonfinite="skip"), out_dir=tmp_path / "b",
                     progress=False)  # fmt: skip
    saving.fit(plot=False)
    assert _same(_params(plain), _params(saving))
    resumed = Trainer(_preset(steps=3, ckpt_every=0, nonfinite="skip"), progress=False,
                      resume=checkpoint_dir(tmp_path / "b", 1))  # fmt: skip
    assert resumed.step == 1 and not resumed.optimizer.state
    resumed.fit(plot=False)
    assert _same(_params(plain), _params(resumed))


def test_resume_of_an_early_stopped_run_follows_its_own_early_stopping(tmp_path):
    # Before: a checkpoint written when the run stopped early kept "stopped" whatever the
    # resumed run's early stopping said: resumed with the patience set to 0 (cadence, free
    # to change on resume) it trained nothing and reported an early stop again.
    stopping = _preset(steps=30, eval_every=1, ckpt_every=100, early_stopping_patience=1,
                       early_stopping_metric="loss")  # fmt: skip
    first = Trainer(stopping, out_dir=tmp_path, progress=False).fit(plot=False)
    assert first.stopped_early
    stopped_at = first.metrics["steps_completed"]
    assert stopped_at < 30 and first.last_checkpoint == checkpoint_dir(tmp_path, stopped_at)
    # The same rule: still stopped, nothing trained (test_train_data checks this too).
    same = Trainer(stopping, resume=tmp_path, progress=False)
    assert same.stopped_early and same.fit(plot=False).metrics["steps_completed"] == stopped_at
    unlimited = dataclasses.replace(
        stopping, train=dataclasses.replace(stopping.train, early_stopping_patience=0)
    )
    again = Trainer(unlimited, resume=tmp_path, progress=False)
    assert again.step == stopped_at and not again.stopped_early
    result = again.fit(plot=False)
    assert not result.stopped_early and result.metrics["steps_completed"] == 30
    assert result.metrics["history"]["step"] == list(range(1, 31))


def test_a_nan_grad_fault_naming_no_module_is_refused_before_training(
    tmp_path, monkeypatch, capsys
):
    # Before: a misspelt module was found only at the fault's step, on its rank (a
    # traceback after training up to it); under torchrun --max-restarts that attempt
    # was restarted and the next one, where the fault does not fire, passed the drill
    # without a NaN ever injected. Every rank checks the job's faults, whatever their
    # rank and attempt.
    monkeypatch.setenv(FAULT_ENV, "kill@step=2,rank=0,attempt=1; nan_grad@step=2,rank=3,module=mpl")
    with pytest.raises(ValueError, match=r"HYPERREC_FAULT: .*module 'mpl', which has no param"):
        Trainer(_preset(steps=2), out_dir=tmp_path / "a", progress=False)
    args = ["--preset", "micro", "--steps", "2", "--out", str(tmp_path / "cli"), "--quiet",
            "--no-plot", "--sample-log"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "module 'mpl'" in err and "Traceback" not in err
    assert not (tmp_path / "cli" / "samples").exists()  # nothing trained
    # A module that exists (here a prefix of its children's parameters) is fine.
    monkeypatch.setenv(FAULT_ENV, "nan_grad@step=2,rank=3,module=seq_layers.0")
    assert Trainer(_preset(steps=2), out_dir=tmp_path / "b", progress=False).step == 0


def test_plot_of_a_history_with_gaps_and_nonfinite_values(tmp_path):
    # No bug found: skipped steps (None: NaN in JSON), Inf, log_every gaps, evaluations
    # without some metrics, no baselines, no MFU (CPU) all draw.
    metrics = {
        "history": {
            "step": [1, 2, 5, 9, 10],
            "loss": [None, float("nan"), 0.5, float("inf"), 0.4],
            "loss_ema": [None, None, 0.5, 0.5, 0.45],
            "ctr_auc": [None] * 5,
            "samples_per_s": [None, 1.0, None, 2.0, 3.0],
            "mfu": [None] * 5,
            "tflops_per_gpu": [None, 0.1, 0.1, None, 0.2],
        },
        "eval": [{"step": 5, "loss": None, "ctr_auc": float("nan")}, {"step": 10}],
        "baselines": {"popularity": None},
        "final": None,
        "mfu": None,
        "data": None,
    }
    assert plot_metrics(metrics, tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_trains_every_step_is_not_stopped_early(tmp_path):
    """The validation after the last step met the patience rule and the run was reported
    as stopped early though it trained every step (an audit found it)."""
    p = override(
        get_preset("micro"),
        ["train.steps=6", "train.eval_every=1", "train.early_stopping_patience=1",
         "train.early_stopping_metric=ctr_auc", "data.eval_requests=128", "train.seed=0"],
    )  # fmt: skip
    t = Trainer(p, out_dir=tmp_path, progress=False)
    # The validation AUCs are scripted (every one improves but the last): a seed that
    # happened to give that trajectory stopped giving it when the model changed.
    real, script = t.evaluate, iter([0.50, 0.51, 0.52, 0.53, 0.54, 0.53])

    def scripted(split=VALID, **kwargs):
        record = real(split, **kwargs)
        if split == VALID and record:
            record["ctr_auc"] = next(script)
        return record

    t.evaluate = scripted
    m = t.fit(plot=False).metrics
    t.close()
    assert m["steps_completed"] == 6 and not m["stopped_early"]
    aucs = [e["ctr_auc"] for e in m["eval"]]
    assert aucs[-1] < max(aucs[:-1])  # the case: the last validation did not improve
