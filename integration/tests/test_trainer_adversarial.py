"""Adversarial sweep of config overrides, the CLI's options and checkpoint save/resume:
silent wrong results and unclear errors (CPU, the micro preset, seconds in all).

Each test names what it caught; the tests of the uninterrupted paths are in
``test_train.py``, ``test_config.py`` and ``test_faults.py``.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hyperrec.integration import (
    CheckpointError,
    EventLogConfig,
    Preset,
    Trainer,
    get_preset,
    override,
    write_example_log,
)
from hyperrec.integration.checkpoint import (
    MANIFEST,
    checkpoint_dir,
    find_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from hyperrec.integration.train import main


def _preset(model=None, **train):
    micro = get_preset("micro")
    train = {"steps": 8, "ckpt_every": 4, **train}
    out = dataclasses.replace(
        micro,
        train=dataclasses.replace(micro.train, **train),
        data=dataclasses.replace(micro.data, eval_requests=256),
    )
    if model:
        out = dataclasses.replace(out, model=dataclasses.replace(out.model, **model))
    return out


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _same_params(a, b):
    pa, pb = _params(a), _params(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run of 8 steps with checkpoints at 4 and 8 (copied by the tests that damage it)."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    Trainer(_preset(), out_dir=out, progress=False).fit(plot=False)
    return out


@pytest.fixture
def run(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine, out)
    return out


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return write_example_log(
        tmp_path_factory.mktemp("log") / "events.csv", users=60, events_per_user=20
    )


# -- exact resume with the cadence changed, metrics.json continuous ------------------------
def test_resume_with_another_cadence_continues_metrics_json_exactly(tmp_path):
    # Checkpoint at 5 (mid BBS window, between evaluations at 3 and 6), killed after 7;
    # resumed with batches built by a worker process (cadence: the same batches). The
    # metrics.json on disk continues the interrupted run's history bitwise.
    base = dict(steps=12, ckpt_every=5, eval_every=3, log_every=2, window_steps=3)
    preset = _preset(model={"dropout": 0.1}, **base)
    Trainer(preset, out_dir=tmp_path / "full", progress=False).fit(plot=False)
    Trainer(preset, out_dir=tmp_path / "cut", progress=False).fit(stop_after=7, plot=False)
    resumed = Trainer(
        _preset(model={"dropout": 0.1}, **base, data_workers=1),
        resume=tmp_path / "cut",
        progress=False,
    )
    assert resumed.step == 5
    resumed.fit(plot=False)
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    cut = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert cut["steps_completed"] == 12 and not cut["interrupted"]
    for key in ("step", "loss", "loss_ema", "ctr_loss", "ctr_auc", "lr", "grad_norm",
                "skipped", "cost_max_over_mean", "step_tflop"):  # fmt: skip
        assert cut["history"][key] == full["history"][key], key
    assert cut["history"]["step"] == [2, 4, 6, 8, 10, 12]
    assert cut["eval"] == full["eval"] and [e["step"] for e in cut["eval"]] == [3, 6, 9, 12]
    assert cut["final"] == full["final"] and cut["best_validation"] == full["best_validation"]
    assert cut["bbs"] == full["bbs"]
    assert cut["mfu"]["model_tflop_total"] == full["mfu"]["model_tflop_total"]


# -- resume with a config that must be refused ----------------------------------------------
def test_resume_past_the_runs_steps_is_refused(run, capsys):
    # Before: the checkpoint of step 8 "completed" a 4-step run: nothing trained, a
    # final evaluation, and metrics.json reporting 8 steps under train.steps=4.
    with pytest.raises(ValueError, match=r"at step 8, past this run's TrainConfig.steps=4"):
        Trainer(_preset(steps=4), resume=run, progress=False)
    assert main(["--resume", str(run), "--steps", "4", "--quiet", "--no-plot"]) == 2
    assert "past this run's TrainConfig.steps=4" in capsys.readouterr().err
    # The checkpoint of step 4 is fine for it, and the step-8 one for 8 steps.
    assert Trainer(_preset(steps=4), resume=checkpoint_dir(run, 4), progress=False).step == 4
    assert Trainer(_preset(steps=8), resume=run, progress=False).step == 8


def test_resume_on_another_kind_of_data_source_names_the_source(run, log_path):
    # Before: "trained with data.user_column=None, this run has 'user_id'" (the first
    # field of the log's config that the generator's lacks).
    preset = dataclasses.replace(_preset(), data=EventLogConfig(path=str(log_path), max_seqlen=16))
    with pytest.raises(
        ValueError, match=r"trained on data.source='synthetic', this run has 'event_log'"
    ):
        Trainer(preset, resume=run, out_dir=run.parent / "log-run", progress=False)


def test_resume_and_out_dir_of_the_wrong_type_name_the_argument(tmp_path):
    # Before: pathlib's "expected str, bytes or os.PathLike object, not int".
    with pytest.raises(TypeError, match="resume must be a checkpoint or run directory"):
        Trainer(_preset(), resume=8, progress=False)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


# -- checkpoint directories ---------------------------------------------------------------
def test_a_checkpoints_path_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    # Before: NotADirectoryError from the first save, after ckpt_every steps of training.
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    with pytest.raises(ValueError, match=r"checkpoints' exists and is not a directory"):
        Trainer(_preset(ckpt_every=2), out_dir=out, progress=False)
    args = ["--preset", "micro", "--steps", "4", "--ckpt-every", "2", "--out", str(out),
            "--quiet", "--no-plot"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoints' exists and is not a directory" in err and "Traceback" not in err
    assert not (out / "metrics.json").exists()
    # No checkpoints asked for: nothing is written there, nothing to refuse.
    done = Trainer(_preset(steps=2, ckpt_every=0), out_dir=out, progress=False).fit(plot=False)
    assert done.metrics["steps_completed"] == 2 and done.last_checkpoint is None
    assert (out / "checkpoints").read_text() == "not a directory"


def test_a_checkpoints_directory_that_is_not_writable_is_refused(tmp_path, monkeypatch):
    # (Tests run as root, for whom every directory is writable: os.access stands in.)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    real = os.access

    def access(path, mode, **kw):
        return Path(path).name != "checkpoints" and real(path, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ValueError, match=r"checkpoints' is not writable"):
        Trainer(_preset(ckpt_every=2), out_dir=out, progress=False)


# -- damaged checkpoints: a CheckpointError, and the resume falls back ----------------------
@pytest.mark.parametrize(
    "damage",
    ["list", "null", "int-entries", "entry-without-bytes", "info-not-object"],
)
def test_a_damaged_manifest_is_a_checkpoint_error_and_resume_falls_back(run, damage, capsys):
    # Before: AttributeError / TypeError / KeyError from read_manifest or verify, which
    # neither the trainer's fallback nor the CLI caught (a traceback).
    ckpt = checkpoint_dir(run, 8)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    files = manifest["files"]
    bad = {
        "list": [],
        "null": None,
        "int-entries": {**manifest, "files": {k: 3 for k in files}},
        "entry-without-bytes": {**manifest, "files": {k: {"sha256": "0"} for k in files}},
        "info-not-object": {**manifest, "info": ["preset"]},
    }[damage]
    (ckpt / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=f"{ckpt}.*unreadable {MANIFEST}"):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="unreadable"):
        Trainer(_preset(), resume=ckpt, progress=False)  # an explicit checkpoint
    resumed = Trainer(_preset(), resume=run, progress=False)
    assert resumed.step == 4 and "skipped" in resumed.resume_notes[0]
    if damage == "list":  # the CLI reads the preset from the manifest first
        assert main(["--resume", str(run), "--stop-after", "5", "--quiet", "--no-plot"]) == 0
        assert "stopped 5 steps" in capsys.readouterr().out


@pytest.mark.parametrize("cut", ["head", "tail"])
def test_an_unverified_checkpoint_with_a_truncated_file_falls_back(run, cut):
    # A checkpoint without its manifest (0.1.x, or one whose manifest was lost) is loaded
    # unverified. Before: a truncated file surfaced as DCP's CheckpointException (an
    # EOFError inside, a BaseException), and the resume did not fall back.
    ckpt = checkpoint_dir(run, 8)
    (ckpt / MANIFEST).unlink()
    (data,) = [p for p in ckpt.iterdir() if p.name.endswith(".distcp")]
    raw = data.read_bytes()
    # head: the meta entry itself is cut; tail: the meta reads, the tensors do not.
    data.write_bytes(raw[:100] if cut == "head" else raw[:-100])
    with pytest.raises(CheckpointError, match=str(ckpt)):
        Trainer(_preset(), resume=ckpt, progress=False)
    resumed = Trainer(_preset(), resume=run, progress=False)
    assert resumed.step == 4 and "skipped" in resumed.resume_notes[0]


def test_a_save_killed_between_its_renames_keeps_the_replaced_checkpoint(tmp_path, monkeypatch):
    # A save that replaces step_<N> (a run resumed from an earlier checkpoint re-writes
    # the later ones) moves the old directory aside, then renames the new one into place.
    # Before: killed in between, neither was a checkpoint any more (step 2 was lost).
    trainer = Trainer(_preset(steps=2, ckpt_every=2), out_dir=tmp_path, progress=False)
    trainer.fit(plot=False)
    first = checkpoint_dir(tmp_path, 2)
    rename = Path.rename

    def killed(self, target):
        if self.name.endswith(".partial"):
            raise KeyboardInterrupt  # stands in for the kill
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    monkeypatch.setattr(Path, "rename", rename)
    assert not first.exists()
    (found,) = list_checkpoints(tmp_path)
    assert found.name == ".step_00000002.old" and find_checkpoint(tmp_path) == found
    verify_checkpoint(found)
    resumed = Trainer(_preset(steps=2, ckpt_every=2), resume=tmp_path, progress=False)
    assert resumed.step == 2 and _same_params(trainer, resumed)
    # The next save of that step puts step_<N> back and removes the leftovers.
    trainer.save()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]
    assert list_checkpoints(tmp_path) == [first]


def test_cli_resume_of_a_checkpoint_without_a_preset(tmp_path, capsys):
    # A checkpoint written by save_checkpoint itself (no trainer info). Before: KeyError.
    model = torch.nn.Linear(2, 1)
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        meta={"step": 1},
        rank_state={},
    )
    assert main(["--resume", str(ckpt), "--quiet", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "records no preset" in err and "--preset" in err


# -- config parsing and conflicting options --------------------------------------------------
@pytest.mark.parametrize(
    ("assignment", "match"),
    [
        ("train.steps=_1_0_", "train.steps: expected an int, got '_1_0_'"),  # was 10
        ("train.steps=1__0", "expected an int"),  # was 10
        ("train.steps=10_", "expected an int"),  # was 10
        ("model.mlp_dims=64,,32", "empty entry"),  # was (64, 32)
        ("model.mlp_dims=64,32,", "empty entry"),  # was (64, 32)
        ("train.ac_layer_budgets_gb=1.5,,2", "empty entry"),  # was (1.5, 2.0)
        ("train.ac_formats=mxfp8, ,mx4", "empty entry"),  # was ("mxfp8", "mx4")
    ],
)
def test_override_refuses_ints_and_lists_it_used_to_guess(assignment, match):
    with pytest.raises(ValueError, match=match):
        override(get_preset("micro"), [assignment])


def test_override_still_takes_python_ints_and_empty_lists():
    p = override(
        get_preset("micro"),
        ["train.steps=1_000", "model.mlp_dims=", "model.head_dims= 8 , 4 ", "train.lr=1_0e-4"],
    )
    assert (p.train.steps, p.model.mlp_dims, p.model.head_dims) == (1000, (), (8, 4))
    assert p.train.lr == 1e-3


def test_preset_from_dict_refuses_an_unknown_source_and_a_non_str_name():
    d = get_preset("micro").to_dict()
    # Before: any other source built the synthetic generator; a name of None became "None".
    with pytest.raises(ValueError, match=r"data.source must be 'synthetic' or 'event_log'"):
        Preset.from_dict({**d, "data": {**d["data"], "source": "events"}})
    with pytest.raises(TypeError, match="Preset.name must be a str"):
        Preset.from_dict({**d, "name": None})
    assert Preset.from_dict(d) == get_preset("micro")


def test_cli_refuses_steps_that_epochs_would_replace(log_path, tmp_path, capsys):
    # Before: --steps 3 was dropped without a word and the run trained its epoch (16 steps).
    out = tmp_path / "run"
    args = ["--data", str(log_path), "--preset", "micro", "--set", "data.max_seqlen=16",
            "--out", str(out), "--quiet", "--no-plot"]  # fmt: skip
    assert main([*args, "--epochs", "1", "--steps", "3"]) == 2
    assert "has no effect with train.epochs=1" in capsys.readouterr().err
    assert main([*args, "--set", "train.epochs=1", "--set", "train.steps=3"]) == 2
    assert "has no effect with train.epochs=1" in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_a_log_given_twice(log_path, tmp_path, capsys):
    # Before: --set data.path silently replaced the log given to --data.
    other = tmp_path / "other.csv"
    shutil.copy(log_path, other)
    out = tmp_path / "run"
    args = ["--data", str(log_path), "--set", f"data.path={other}", "--preset", "micro",
            "--set", "data.max_seqlen=16", "--steps", "1", "--out", str(out), "--quiet",
            "--no-plot"]  # fmt: skip
    assert main(args) == 2
    assert "--data or with --set data.path, not both" in capsys.readouterr().err
    assert not out.exists()
