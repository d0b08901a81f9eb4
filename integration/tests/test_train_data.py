"""Training on data sources other than the generator: event logs, a Python source,
epochs, validation, early stopping, the test split, baselines, and the CLI around them."""

import dataclasses
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from hyperrec.integration import (
    TEST,
    TRAIN,
    VALID,
    DataSource,
    EventLogConfig,
    EventLogSource,
    SyntheticRecsysData,
    Trainer,
    get_preset,
    write_example_log,
)
from hyperrec.integration.checkpoint import checkpoint_dir
from hyperrec.integration.train import main


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return write_example_log(
        tmp_path_factory.mktemp("log") / "events.csv", users=60, events_per_user=20
    )


def _log_preset(path, *, data=None, **train):
    micro = get_preset("micro")
    cfg = EventLogConfig(path=str(path), max_seqlen=16, category_column="category",
                         user_feature_columns=("country",), dense_columns=("price",))  # fmt: skip
    if data:
        cfg = dataclasses.replace(cfg, **data)
    return dataclasses.replace(micro, data=cfg, train=dataclasses.replace(micro.train, **train))


def test_an_event_log_trains_for_epochs_with_validation_test_and_baselines(log_path, tmp_path):
    preset = _log_preset(log_path, epochs=2, eval_every=10, window_steps=1)
    ids = []
    trainer = Trainer(preset, out_dir=tmp_path, progress=False,
                      on_step=lambda r: ids.extend(r.sample_ids.tolist()))  # fmt: skip
    n_train = trainer.source.num_requests(TRAIN)
    assert trainer.preset.train.steps == math.ceil(2 * n_train / 64)
    assert trainer.model.cvr_head is None  # no conversion label: CTR only
    result = trainer.fit()
    m = result.metrics
    # Two passes: every training request twice, plus the start of a third pass to fill
    # the last batch; every request of a pass exactly once (positions map to epochs).
    counts = Counter(ids)
    assert len(counts) == n_train and set(counts.values()) <= {2, 3}
    assert sum(v == 3 for v in counts.values()) == len(ids) - 2 * n_train
    assert m["epochs_trained"] == pytest.approx(len(ids) / n_train)
    assert [e["split"] for e in m["eval"]] == ["validation"] * len(m["eval"])
    assert [e["step"] for e in m["eval"]][-1] == trainer.preset.train.steps
    assert m["test"]["split"] == "test"
    assert m["test"]["requests"] == trainer.source.num_requests(TEST)
    final = m["final"]
    assert {"ctr_auc", "ctr_gauc", "ctr_ne", "ctr_calibration", "loss"} <= set(final)
    assert not {"cvr_auc", "ctcvr_auc"} & set(final)
    assert set(m["baselines"]) == {"popularity", "logistic_regression"}  # no ground truth
    assert m["logistic_regression_fit"]["impressions"] == n_train
    assert m["data"]["source"] == "EventLogSource"
    assert m["data"]["schema"]["tasks"] == ["ctr"]
    assert m["data"]["event_log"]["splits"]["train"] == n_train
    assert result.plot_path.read_bytes()[:4] == b"\x89PNG"
    on_disk = json.loads(result.metrics_path.read_text())
    assert on_disk["final"]["ctr_gauc"] == final["ctr_gauc"]


def test_resume_with_an_event_log_equals_an_uninterrupted_run(log_path, tmp_path):
    # W = 2, a checkpoint every 4 steps, dropout, and several epochs: the resumed run must
    # read the same requests in the same order across the epoch boundaries.
    preset = _log_preset(log_path, epochs=3, ckpt_every=4, window_steps=2, eval_every=8)
    preset = dataclasses.replace(preset, model=dataclasses.replace(preset.model, dropout=0.1))
    full = []
    a = Trainer(preset, out_dir=tmp_path / "a", progress=False, on_step=full.append)
    ra = a.fit(plot=False)
    steps = a.preset.train.steps
    assert steps > 2 * 15  # several epochs of about 15 steps

    first = []
    b = Trainer(preset, out_dir=tmp_path / "b", progress=False, on_step=first.append)
    b.fit(stop_after=steps - 5, plot=False)
    stop = (steps - 5) // 4 * 4
    second = []
    c = Trainer(preset, resume=tmp_path / "b", progress=False, on_step=second.append)
    assert c.step == stop
    rc = c.fit(plot=False)
    assert [r.loss for r in second] == [r.loss for r in full[stop:]]  # bitwise
    resumed = torch.cat([r.sample_ids for r in first[:stop] + second])
    assert torch.equal(torch.cat([r.sample_ids for r in full]), resumed)
    assert rc.metrics["history"]["loss"] == ra.metrics["history"]["loss"]
    assert rc.metrics["final"] == ra.metrics["final"]
    assert rc.metrics["eval"] == ra.metrics["eval"]
    pa, pc = a.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(pa[k], pc[k]) for k in pa)


def test_epochs_read_every_request_and_resume_inside_the_short_last_window(tmp_path):
    # Before: with steps (from epochs) not a multiple of window_steps, BBS planned its
    # last window as a full one: sub-batches of the last pass dealt to steps after the
    # run's end never trained and sub-batches of the next pass trained in their place.
    seed = int(np.random.SeedSequence().entropy % 2**31)
    log = write_example_log(tmp_path / "events.csv", users=30, events_per_user=14, seed=seed)
    epochs = 2
    n_train = EventLogSource.open(_log_preset(log).data, tmp_path / "prep").num_requests(TRAIN)
    steps = math.ceil(epochs * n_train / 64)
    # A window the steps do not fill, with a checkpoint inside the short last window.
    w = next(w for w in range(3, steps) if steps % w >= 2)
    cache = {"cache_dir": str(tmp_path / "prep")}
    preset = _log_preset(log, epochs=epochs, window_steps=w, ckpt_every=steps - 1, eval_every=0,
                         baseline_requests=0, data=cache)  # fmt: skip
    full = []
    a = Trainer(preset, out_dir=tmp_path / "a", progress=False, on_step=full.append)
    assert a.preset.train.steps == steps
    a.fit(plot=False)
    counts = Counter(torch.cat([r.sample_ids for r in full]).tolist())
    where = (seed, n_train, steps, w)
    assert len(full) == steps, where
    per_step = 64 // preset.train.sub_batch_size
    trained = sorted(j for r in full for j in r.sub_batches)
    assert trained == list(range(steps * per_step)), where  # none dropped past the end
    assert len(counts) == n_train and min(counts.values()) >= epochs, where
    assert sum(counts.values()) - epochs * n_train < 64, where  # less than a batch more

    first = []
    b = Trainer(preset, out_dir=tmp_path / "b", progress=False, on_step=first.append)
    b.fit(stop_after=steps - 1, plot=False)  # checkpoint at steps - 1, mid-window
    second = []
    c = Trainer(preset, resume=tmp_path / "b", progress=False, on_step=second.append)
    assert c.step == steps - 1
    c.fit(plot=False)
    assert [r.loss for r in first + second] == [r.loss for r in full], where  # bitwise
    resumed = torch.cat([r.sample_ids for r in first + second])
    assert torch.equal(torch.cat([r.sample_ids for r in full]), resumed), where


def test_a_resume_against_other_data_is_refused(log_path, tmp_path):
    preset = _log_preset(log_path, steps=4, ckpt_every=4)
    Trainer(preset, out_dir=tmp_path / "run", progress=False).fit(plot=False)
    other_log = write_example_log(tmp_path / "other.csv", users=30, events_per_user=10, seed=5)
    other = dataclasses.replace(preset, data=dataclasses.replace(preset.data, path=str(other_log)))
    with pytest.raises(ValueError, match="a resumed run must read the same data"):
        Trainer(other, resume=tmp_path / "run", out_dir=tmp_path / "run2", progress=False)
    split = dataclasses.replace(preset, data=dataclasses.replace(preset.data, split="user"))
    with pytest.raises(ValueError, match="data.split='time', this run has 'user'"):
        Trainer(split, resume=tmp_path / "run", out_dir=tmp_path / "run3", progress=False)


def test_validation_subset_and_conversion_labels(tmp_path):
    rows = ["user_id,item_id,timestamp,label,bought"]
    rng = np.random.default_rng(0)
    for i in range(900):
        click = int(rng.random() < 0.4)
        rows.append(
            f"u{i % 40},{rng.integers(0, 30)},{i},{click},{click * int(rng.random() < 0.5)}"
        )
    path = tmp_path / "conv.csv"
    path.write_text("\n".join(rows) + "\n")
    preset = _log_preset(path, steps=6, data={"conversion_column": "bought", "valid_requests": 50,
                                             "category_column": "", "user_feature_columns": (),
                                             "dense_columns": ()})  # fmt: skip
    result = Trainer(preset, out_dir=tmp_path / "run", progress=False).fit(plot=False)
    m = result.metrics
    assert m["data"]["schema"]["tasks"] == ["ctr", "cvr"]
    assert m["eval"][-1]["requests"] == 50  # the fixed validation subset
    assert m["data"]["evaluated_requests"] == {"validation": 50, "test": 90}
    assert {"cvr_auc", "ctcvr_auc"} <= set(m["final"])
    assert "cvr_auc" in m["baselines"]["popularity"]


class FiniteSynthetic:
    """A DataSource written by hand: a finite, CTR-only view of the generator."""

    def __init__(self, n_train=384, n_eval=128, seed=0):
        self.inner = SyntheticRecsysData(dataclasses.replace(get_preset("micro").data, seed=seed))
        self.sizes = {TRAIN: n_train, VALID: n_eval, TEST: n_eval}
        self.seed = seed

    @property
    def schema(self):
        return dataclasses.replace(self.inner.schema, tasks=("ctr",))

    def num_requests(self, split):
        return self.sizes[split]

    def history_lengths(self, split, ids):
        return self.inner.history_lengths(split, ids)

    def batch(self, split, ids):
        b = self.inner.batch(split, ids)
        return dataclasses.replace(b, conversion=torch.zeros_like(b.conversion))

    def truth(self, split, ids):
        return None

    def state_dict(self):
        return {"finite_synthetic": self.seed}

    def load_state_dict(self, state):
        if state != self.state_dict():
            raise ValueError(f"other data: {state}")


def test_a_python_data_source_trains_resumes_and_is_checked(tmp_path):
    preset = get_preset("micro")
    preset = dataclasses.replace(
        preset, train=dataclasses.replace(preset.train, epochs=2, ckpt_every=4, eval_every=0)
    )
    src = FiniteSynthetic()
    assert isinstance(src, DataSource)
    t = Trainer(preset, data=src, out_dir=tmp_path / "run", progress=False)
    assert t.preset.train.steps == 12  # 2 * 384 / 64
    result = t.fit(plot=False)
    assert set(result.metrics["baselines"]) == {"popularity", "logistic_regression"}
    assert result.metrics["data"]["source"] == "FiniteSynthetic"
    again = Trainer(preset, data=FiniteSynthetic(), resume=tmp_path / "run", progress=False)
    assert again.step == 12
    with pytest.raises(ValueError, match="other data"):
        Trainer(preset, data=FiniteSynthetic(seed=1), resume=tmp_path / "run", progress=False)
    with pytest.raises(TypeError, match="DataSource protocol"):
        Trainer(preset, data=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a finite data source"):
        Trainer(preset, out_dir=tmp_path / "x", progress=False)  # the generator is endless
    # The CLI cannot rebuild a Python source: it says so.
    assert main(["--resume", str(tmp_path / "run"), "--quiet"]) == 2


def test_early_stopping_stops_checkpoints_and_tests_once(tmp_path, monkeypatch):
    micro = get_preset("micro")
    preset = dataclasses.replace(
        micro,
        train=dataclasses.replace(
            micro.train, steps=20, eval_every=2, ckpt_every=5, early_stopping_patience=2
        ),  # fmt: skip
        data=dataclasses.replace(micro.data, eval_requests=128),
    )
    aucs = iter([0.60, 0.70, 0.65, 0.69, 0.9, 0.9])
    calls = Counter()
    original = Trainer.evaluate

    def scripted(self, split=VALID, **kw):
        calls[split] += 1
        record = original(self, split, **kw)
        if split == VALID and record:
            record["ctr_auc"] = next(aucs)  # best at step 4, then two evals without gain
        return record

    monkeypatch.setattr(Trainer, "evaluate", scripted)
    result = Trainer(preset, out_dir=tmp_path, progress=False).fit(plot=False)
    m = result.metrics
    assert result.stopped_early and not result.interrupted and m["stopped_early"]
    assert m["steps_completed"] == 8 and [e["step"] for e in m["eval"]] == [2, 4, 6, 8]
    assert m["best_validation"] == {"step": 4, "ctr_auc": 0.70}
    assert calls[TEST] == 1 and m["final"] is not None
    assert result.last_checkpoint == checkpoint_dir(tmp_path, 8)
    # A resumed run that had stopped early does not train on.
    again = Trainer(preset, resume=tmp_path, progress=False)
    assert again.fit(plot=False).metrics["steps_completed"] == 8


def test_cli_trains_on_a_log_in_one_command_and_resumes_without_the_preset(
    log_path, tmp_path, capsys
):
    out = tmp_path / "run"
    args = ["--data", str(log_path), "--preset", "micro", "--epochs", "1", "--ckpt-every", "5",
            "--set", "data.category_column=category", "--set", "data.max_seqlen=16",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "test CTR AUC" in printed and "logistic regression" in printed
    assert "GAUC" in printed and "ground truth" not in printed
    assert (out / "metrics.png").is_file() and (out / "data" / "vocab" / "item.jsonl").is_file()
    first = json.loads((out / "metrics.json").read_text())
    # Resume: the preset and the log come from the run; one more epoch.
    assert main(["--resume", str(out), "--epochs", "2", "--quiet", "--no-plot"]) == 0
    second = json.loads((out / "metrics.json").read_text())
    assert second["steps_completed"] == 2 * first["steps_completed"] or (
        second["steps_completed"] > first["steps_completed"]
    )
    assert second["config"]["data"]["path"] == str(log_path)
    assert second["config"]["data"]["max_seqlen"] == 16


def test_cli_resume_of_a_run_dir_takes_its_preset(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--preset", "micro", "--steps", "4", "--ckpt-every", "2", "--out", str(out), "--quiet",
            "--no-plot"]  # fmt: skip
    assert main([*base, "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert main(["--resume", str(out), "--quiet", "--no-plot"]) == 0  # no --preset
    printed = capsys.readouterr().out
    assert "trained 4 steps" in printed
    assert json.loads((out / "metrics.json").read_text())["preset"] == "micro"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--out", "{file}"], "exists and is not a directory"),
        (["--stop-after", "-1"], "--stop-after must be a positive step number, got -1"),
        (["--stop-after", "0"], "--stop-after must be a positive"),
        (["--auto-resume"], "--auto-resume needs --out"),
        (["--data", "{missing}"], "--data: no such file"),
        (["--resume", "{missing}"], "no such checkpoint or run directory"),
        (["--epochs", "2"], "needs a finite data source"),
        (["--set", "train.nonfinite=maybe"], "TrainConfig.nonfinite"),
        (["--set", "train.early_stopping_metric=acc"], "early_stopping_metric"),
    ],
)
def test_cli_checks_everything_before_any_work(tmp_path, capsys, monkeypatch, argv, match):
    monkeypatch.chdir(tmp_path)  # the default run directory would be ./runs/...
    existing = tmp_path / "a-file"
    existing.write_text("not a directory")
    argv = [a.format(file=existing, missing=tmp_path / "missing") for a in argv]
    assert main(["--preset", "micro", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert existing.read_text() == "not a directory"
    assert not list(tmp_path.glob("**/metrics.json"))
    assert not (tmp_path / "runs").exists()


def test_cli_auto_resume_starts_fresh_then_continues(tmp_path, capsys):
    out = tmp_path / "job"
    args = ["--preset", "micro", "--steps", "4", "--ckpt-every", "2", "--out", str(out),
            "--auto-resume", "--quiet", "--no-plot"]  # fmt: skip
    assert main([*args, "--stop-after", "3"]) == 0  # nothing to resume: starts
    assert main(args) == 0  # resumes from step 2
    printed = capsys.readouterr().out
    assert "trained 4 steps" in printed
