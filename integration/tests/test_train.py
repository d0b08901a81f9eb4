import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from hyperrec.integration import Trainer
from hyperrec.integration.checkpoint import checkpoint_dir, find_checkpoint
from hyperrec.integration.train import main


def _with(preset, *, model=None, **train):
    out = dataclasses.replace(preset, train=dataclasses.replace(preset.train, **train))
    if model:
        out = dataclasses.replace(out, model=dataclasses.replace(out.model, **model))
    return out


def test_a_run_learns_and_beats_popularity(micro, tmp_path):
    preset = _with(micro, steps=100, eval_every=50)
    result = Trainer(preset, out_dir=tmp_path, progress=False).fit()
    m = result.metrics
    final, pop, truth = m["final"], m["baselines"]["popularity"], m["baselines"]["ground_truth"]
    assert final["ctr_auc"] > 0.65
    assert final["ctr_auc"] > pop["ctr_auc"] + 0.05, (final["ctr_auc"], pop["ctr_auc"])
    assert final["ctr_auc"] < truth["ctr_auc"]
    assert final["ctr_ne"] < 0.95
    assert final["cvr_auc"] > 0.55
    assert [e["step"] for e in m["eval"]] == [50, 100]
    losses = m["history"]["loss"]
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.05
    on_disk = json.loads(result.metrics_path.read_text())
    assert on_disk["final"]["ctr_auc"] == final["ctr_auc"]
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_resume_is_exact(micro, tmp_path):
    # W = 3 and a checkpoint every 4 steps: the resumed checkpoint (step 8) sits in the
    # middle of a BBS window; dropout makes the restored RNG state matter.
    preset = _with(micro, steps=16, ckpt_every=4, window_steps=3, model={"dropout": 0.1})
    full: list = []
    a = Trainer(preset, out_dir=tmp_path / "a", progress=False, on_step=full.append)
    ra = a.fit(plot=False)

    first: list = []
    b = Trainer(preset, out_dir=tmp_path / "b", progress=False, on_step=first.append)
    rb = b.fit(stop_after=10, plot=False)  # killed after step 10: steps 9-10 are lost
    assert rb.interrupted and rb.metrics["final"] is None
    assert find_checkpoint(tmp_path / "b") == checkpoint_dir(tmp_path / "b", 8)

    second: list = []
    c = Trainer(preset, resume=tmp_path / "b", progress=False, on_step=second.append)
    assert c.step == 8 and c.out_dir == tmp_path / "b"
    rc = c.fit(plot=False)

    assert [r.step for r in second] == list(range(9, 17))
    assert [r.loss for r in second] == [r.loss for r in full[8:]]  # bitwise
    ids_full = torch.cat([r.sample_ids for r in full])
    ids_resumed = torch.cat([r.sample_ids for r in first[:8] + second])
    assert torch.equal(ids_full, ids_resumed)
    assert ids_full.unique().numel() == ids_full.numel() == 16 * preset.train.global_batch_size
    assert rc.metrics["history"]["loss"] == ra.metrics["history"]["loss"]
    assert rc.metrics["final"] == ra.metrics["final"]
    pa, pc = _params(a), _params(c)
    assert all(torch.equal(pa[k], pc[k]) for k in pa)


def test_resume_from_a_checkpoint_without_newer_history_keys(micro, tmp_path, monkeypatch):
    # A run checkpointed by a trainer that did not record the GPU idle keys yet resumes:
    # their steps get NaN, so every history list keeps one entry per recorded step.
    import hyperrec.integration.trainer as trainer_mod

    preset = _with(micro, steps=8, ckpt_every=4, log_every=1)
    keys = trainer_mod._HISTORY_KEYS
    older = tuple(k for k in keys if not k.startswith("gpu_"))
    assert len(older) == len(keys) - 2
    monkeypatch.setattr(trainer_mod, "_HISTORY_KEYS", older)
    Trainer(preset, out_dir=tmp_path, progress=False).fit(stop_after=5, plot=False)
    monkeypatch.setattr(trainer_mod, "_HISTORY_KEYS", keys)
    history = Trainer(preset, resume=tmp_path, progress=False).fit(plot=False).metrics["history"]
    assert history["step"] == list(range(1, 9))
    for key in ("gpu_gap_s", "gpu_dry_at_launch"):  # NaN (null in JSON) on a CPU
        assert len(history[key]) == 8
        assert all(x is None or math.isnan(x) for x in history[key])


def test_resume_refuses_a_different_run(micro, tmp_path):
    preset = _with(micro, steps=2, ckpt_every=2)
    Trainer(preset, out_dir=tmp_path, progress=False).fit(plot=False)
    other = dataclasses.replace(preset, model=dataclasses.replace(preset.model, dim=32))
    with pytest.raises(ValueError, match="model.dim=16, this run has 32"):
        Trainer(other, resume=tmp_path, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        Trainer(preset, resume=tmp_path / "empty", progress=False)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        Trainer(preset, resume=tmp_path / "missing", progress=False)


def test_cli_stops_resumes_and_prints_paths(tmp_path, capsys):
    args = ["--preset", "micro", "--steps", "6", "--out", str(tmp_path), "--quiet", "--no-plot"]
    assert main([*args, "--ckpt-every", "3", "--stop-after", "4"]) == 0
    out = capsys.readouterr().out
    assert "stopped 4 steps" in out and f"metrics: {tmp_path / 'metrics.json'}" in out
    assert main(["--preset", "micro", "--steps", "6", "--resume", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "trained 6 steps" in out and "test CTR AUC" in out and "logistic regression" in out
    assert "model FLOPs:" in out
    assert f"plot:    {tmp_path / 'metrics.png'}" in out
    assert json.loads((tmp_path / "metrics.json").read_text())["steps_completed"] == 6


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--set", "model.heads=3"], "ModelConfig.heads"),
        (["--set", "train.global_batch_size=60"], "global_batch_size"),
        (["--set", "model.depth=3"], "has no field 'depth'"),
    ],
)
def test_cli_bad_config_exits_2_naming_the_field(argv, match, capsys):
    assert main(["--preset", "micro", "--quiet", *argv]) == 2
    assert match in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hyperrec.integration.train", "--preset", "micro", "--steps", "2",
         "--out", str(tmp_path), "--no-plot"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "metrics: " in proc.stdout and (tmp_path / "metrics.json").is_file()
    assert "2/2" in proc.stderr  # the progress bar
