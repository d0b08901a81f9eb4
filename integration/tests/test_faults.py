"""Faults in training: killed ranks under torchrun, corrupt checkpoints, non-finite steps,
and resuming on another world size (CPU, gloo, the micro preset)."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hyperrec.integration import CheckpointError, NonFiniteError, Trainer, get_preset
from hyperrec.integration.checkpoint import (
    MANIFEST,
    checkpoint_dir,
    find_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from hyperrec.integration.faults import FAULT_ENV, FaultInjector, parse_faults
from hyperrec.integration.train import main
from hyperrec.testing import run_on_ranks


def _preset(eval_requests=256, **train):
    micro = get_preset("micro")
    train = {"steps": 8, "ckpt_every": 4, **train}
    return dataclasses.replace(
        micro,
        train=dataclasses.replace(micro.train, **train),
        data=dataclasses.replace(micro.data, eval_requests=eval_requests),
    )


def _params(trainer):
    out = {}
    for k, v in trainer.model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


# -- a rank killed mid-step, and a rank killed while writing a checkpoint -------------------
def _torchrun(out, env_extra, max_restarts):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", str(max_restarts), "-m", "hyperrec.integration.train",
        "--preset", "micro", "--steps", "12", "--ckpt-every", "4", "--set",
        "data.eval_requests=256", "--out", str(out), "--auto-resume", "--sample-log",
        "--no-plot", "--quiet",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _effective_samples(out):
    """Per (rank, step): the ids of the last attempt that trained that step."""
    last = {}
    attempts = {}
    for rank in (0, 1):
        for line in (out / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            key = (rank, rec["step"])
            attempts.setdefault(key, []).append(rec["ids"])
            last[key] = rec["ids"]
    return last, attempts


@pytest.mark.slow  # tens of seconds; `nox -s lowest` leaves it to the normal session
def test_killed_ranks_restart_from_the_last_complete_checkpoint(tmp_path):
    # Attempt 0: rank 1 dies in the middle of step 6 (after backward, before the update).
    # Attempt 1 resumes from step 4 and rank 0 dies while the step-8 checkpoint is being
    # written. Attempt 2 must ignore that half-written checkpoint, resume from step 4
    # again and finish: same parameters, same losses and the same requests, each once,
    # as a run that never failed.
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    spec = "kill@step=6,rank=1; kill_in_checkpoint@step=8,rank=0,attempt=1"
    proc = _torchrun(faulty, {FAULT_ENV: spec}, max_restarts=2)
    _torchrun(clean, {}, max_restarts=0)

    last, attempts = _effective_samples(faulty)
    ref, _ = _effective_samples(clean)
    assert last == ref  # the same requests in the same steps on the same ranks
    ids = [i for v in last.values() for i in v]
    assert sorted(ids) == list(range(12 * 64))  # nothing lost, nothing trained twice
    # Steps 5-8 ran in several attempts, always on the same requests (deterministic replay).
    assert len(attempts[(0, 5)]) == 3 and len(attempts[(0, 8)]) == 2
    assert all(len({tuple(x) for x in runs}) == 1 for runs in attempts.values())
    assert "trained 12 steps" in proc.stdout

    m_faulty = json.loads((faulty / "metrics.json").read_text())
    m_clean = json.loads((clean / "metrics.json").read_text())
    assert m_faulty["history"]["loss"] == m_clean["history"]["loss"]  # bitwise
    assert m_faulty["final"] == m_clean["final"]
    assert [p.name for p in list_checkpoints(faulty)] == [f"step_{s:08d}" for s in (12, 8, 4)]
    assert not list((faulty / "checkpoints").glob(".*partial"))  # cleaned up by the next save
    # Final parameters: both 2-rank checkpoints loaded (resharded) into one process.
    preset = dataclasses.replace(
        get_preset("micro"),
        train=dataclasses.replace(get_preset("micro").train, steps=12, ckpt_every=4),
        data=dataclasses.replace(get_preset("micro").data, eval_requests=256),
    )
    a = Trainer(preset, resume=faulty, progress=False, out_dir=tmp_path / "a")
    b = Trainer(preset, resume=clean, progress=False, out_dir=tmp_path / "b")
    assert a.step == b.step == 12
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


# -- checkpoints: atomic commit, corruption detected, the previous one used ----------------
def test_a_save_killed_before_commit_leaves_no_checkpoint(tmp_path):
    trainer = Trainer(_preset(steps=2, ckpt_every=0), out_dir=tmp_path, progress=False)
    trainer.fit(plot=False)
    first = trainer.save()

    def crash():
        raise KeyboardInterrupt  # stands in for a kill between the files and the commit

    trainer.step = 3
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(
            checkpoint_dir(tmp_path, 3),
            model=trainer.model,
            optimizer=trainer.optimizer,
            meta={"step": 3},
            rank_state={},
            before_commit=crash,
        )
    assert not checkpoint_dir(tmp_path, 3).exists()
    assert (tmp_path / "checkpoints" / ".step_00000003.partial").is_dir()
    assert find_checkpoint(tmp_path) == first
    manifest = verify_checkpoint(first)
    assert manifest["step"] == 2 and manifest["info"]["preset"]["name"] == "micro"


def _corrupt(ckpt, how):
    data = sorted(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))[0]
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:100])
        return data.name, "bytes, the manifest says"
    if how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        return data.name, "does not match its SHA-256"
    if how == "missing":
        data.unlink()
        return data.name, "is missing"
    # Neither the manifest nor DCP's .metadata: e.g. a copy that was cut short.
    (ckpt / MANIFEST).unlink()
    (ckpt / ".metadata").unlink()
    return MANIFEST, "is incomplete"


@pytest.mark.parametrize("how", ["truncated", "flipped", "missing", "no-manifest"])
def test_a_corrupt_checkpoint_is_detected_and_the_previous_one_used(tmp_path, how):
    preset = _preset(steps=8, ckpt_every=4)
    full = Trainer(preset, out_dir=tmp_path / "full", progress=False)
    full.fit(plot=False)
    run = tmp_path / "run"
    Trainer(preset, out_dir=run, progress=False).fit(stop_after=8, plot=False)
    bad = checkpoint_dir(run, 8)
    name, message = _corrupt(bad, how)
    if how != "no-manifest":
        with pytest.raises(CheckpointError, match=message) as info:
            verify_checkpoint(bad)
        assert str(bad) in str(info.value) and name in str(info.value)
        with pytest.raises(CheckpointError, match=message):
            Trainer(preset, resume=bad, progress=False)  # an explicit checkpoint: no fallback
        resumed = Trainer(preset, resume=run, progress=False)
        assert resumed.step == 4 and "skipped" in resumed.resume_notes[0]
    else:
        assert find_checkpoint(run) == checkpoint_dir(run, 4)  # never a candidate
        with pytest.raises(CheckpointError, match=message):
            verify_checkpoint(bad)
        resumed = Trainer(preset, resume=run, progress=False)
        assert resumed.step == 4
    resumed.fit(plot=False)  # retrains steps 5-8: the same as the uninterrupted run
    pa, pb = _params(full), _params(resumed)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_legacy_checkpoints_without_a_manifest_still_load(tmp_path):
    preset = _preset(steps=4, ckpt_every=4)
    a = Trainer(preset, out_dir=tmp_path, progress=False)
    a.fit(plot=False)
    ckpt = checkpoint_dir(tmp_path, 4)
    (ckpt / MANIFEST).unlink()  # what 0.1.x wrote: DCP files and .metadata only
    assert verify_checkpoint(ckpt) is None
    b = Trainer(preset, resume=tmp_path, progress=False)
    assert b.step == 4
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


# -- non-finite loss or gradient -----------------------------------------------------------
@pytest.mark.parametrize("sparse", ["dense", "sharded"])
def test_nonfinite_gradient_skip_policy_drops_the_update_and_names_the_module(
    tmp_path, monkeypatch, sparse
):
    monkeypatch.setenv(FAULT_ENV, "nan_grad@step=3,rank=0,module=mlp")
    preset = _preset(steps=6, ckpt_every=0, nonfinite="skip", sparse=sparse)
    snapshots = {}
    trainer = Trainer(preset, out_dir=tmp_path, progress=False)
    assert trainer.tables == sparse

    def snap(rec):
        params = _params(trainer)
        params.update(
            {f"sparse_optim.{k}": torch.from_numpy(v) for k, v in _sparse_state(trainer).items()}
        )
        snapshots[rec.step] = (params, rec)

    trainer.on_step = snap
    result = trainer.fit(plot=False)
    before, after = snapshots[2][0], snapshots[3][0]
    # Step 3 changed nothing: parameters, sharded rows and their optimizer's states.
    assert any(k.startswith("sharded.") for k in before) == (sparse == "sharded")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert snapshots[3][1].skipped and not snapshots[4][1].skipped
    assert any(not torch.equal(after[k], snapshots[4][0][k]) for k in after)  # training goes on
    (report,) = result.metrics["nonfinite_steps"]
    assert report["step"] == 3 and report["rank"] == 0
    assert report["module"] == "mlp.0" and report["parameter"] == "mlp.0.weight"
    assert "first module with a non-finite gradient (backward order): 'mlp.0'" in report["message"]
    assert result.metrics["history"]["skipped"] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert np.isfinite(result.metrics["final"]["ctr_auc"])


def test_nonfinite_loss_stop_policy_raises_with_step_and_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "nan_loss@step=2,rank=0")
    trainer = Trainer(_preset(steps=4, ckpt_every=0), out_dir=tmp_path, progress=False)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 2.*rank\(s\) \[0\]") as info:
        trainer.fit(plot=False)
    assert trainer.step == 1
    # The NaN entered through the CTR loss: the CTR head's own output weights are the
    # first parameters backward reaches (its MLP runs before them in forward).
    assert info.value.report.module == "ctr_head" and info.value.report.rank == 0
    # The CLI: exit status 1 and the message, no traceback.
    args = ["--preset", "micro", "--steps", "3", "--out", str(tmp_path / "cli"), "--quiet",
            "--no-plot"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "non-finite loss at step 2" in err and 'nonfinite="stop"' in err


def test_stop_in_the_pipelined_loop_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    # No on_step callback: fit overlaps steps, and the check of step 4 happens when its
    # values are read, after step 5 was queued. The report comes from the per-parameter
    # flags recorded during step 4 (its gradients are gone by then).
    monkeypatch.setenv(FAULT_ENV, "nan_grad@step=4,rank=0,module=mlp")
    trainer = Trainer(_preset(steps=8, ckpt_every=3), out_dir=tmp_path, progress=False)
    with pytest.raises(NonFiniteError, match="non-finite gradient at step 4") as info:
        trainer.fit(plot=False)
    assert trainer.step == 3
    assert info.value.report.module == "mlp.0" and info.value.report.rank == 0
    assert info.value.report.parameter == "mlp.0.weight"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]
    monkeypatch.delenv(FAULT_ENV)
    resumed = Trainer(_preset(steps=8, ckpt_every=3), resume=tmp_path, progress=False)
    assert resumed.step == 3


def _one_nonfinite_run(out_dir, spec, policy):
    os.environ[FAULT_ENV] = spec
    try:
        t = Trainer(_preset(steps=4, ckpt_every=0, nonfinite=policy), out_dir=out_dir,
                    progress=False)  # fmt: skip
        try:
            t.fit(plot=False)
        except NonFiniteError as err:
            return {"error": str(err), "report": err.report.as_dict(), "step": t.step}
        return {"nonfinite": t.nonfinite, "step": t.step}
    finally:
        del os.environ[FAULT_ENV]


def _two_nonfinite_runs(tmp_path):
    # Both scenarios in one pair of processes: spawning ranks is the slow part.
    return (
        _one_nonfinite_run(tmp_path / "a", "nan_loss@step=2,rank=1", "stop"),
        _one_nonfinite_run(tmp_path / "b", "nan_grad@step=3,rank=1,module=ctr_head", "skip"),
    )


def test_nonfinite_steps_on_two_ranks_name_the_rank_that_failed(tmp_path):
    ranks = run_on_ranks(_two_nonfinite_runs, 2, tmp_path, timeout_s=300)
    for stopped, skipped in ranks:  # every rank reports the same
        assert stopped["step"] == 1 and stopped["report"]["loss_ranks"] == [1]
        assert stopped["report"]["rank"] == 1
        assert "loss non-finite on rank(s) [1]" in stopped["error"]
        (report,) = skipped["nonfinite"]
        assert skipped["step"] == 4 and report["step"] == 3 and report["rank"] == 1
        assert report["module"].startswith("ctr_head") and report["grad_ranks"] == [1]


def test_fault_specs_are_validated():
    assert parse_faults("kill@step=3,rank=1; nan_grad@step=2,rank=0,module=mlp,attempt=1") == (
        parse_faults("kill@step=3,rank=1")[0],
        parse_faults("nan_grad@step=2,rank=0,module=mlp,attempt=1")[0],
    )
    for bad, match in [
        ("explode@step=1,rank=0", "kind"),
        ("kill@step=0,rank=0", "step >= 1"),
        ("kill@rank=0", "step >= 1"),
        ("kill@step=x,rank=0", "step must be an int"),
        ("kill@step=1,rank=0,when=now", "bad field"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_faults(bad)
    assert not FaultInjector(parse_faults("kill@step=1,rank=0"), rank=0, restart=1)
    assert not FaultInjector(parse_faults("kill@step=1,rank=1"), rank=0)


# -- resuming on another world size -------------------------------------------------------
def _numpy(params):
    # Results cross process boundaries: plain arrays, not tensors in shared memory.
    return {k: v.numpy() for k, v in params.items()}


def _sparse_state(trainer):
    """The sharded tables' optimizer state as full arrays (collective), or {}."""
    opt = trainer.sparse_optimizer
    if opt is None:
        return {}
    out = {}
    for table, entries in opt.state_dict()["state"].items():
        for k, v in entries.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{table}.{k}"] = v.detach().clone().numpy()
    return out


def _train_collect(preset, out_dir, resume, stop_after, snapshot_step=0):
    records, snapshot, sparse = [], {}, {}
    t = Trainer(preset, out_dir=out_dir, resume=resume, progress=False)

    def on_step(rec):
        records.append(rec)
        if rec.step == snapshot_step:
            snapshot.update(_numpy(_params(t)))  # collective: every rank takes part
            sparse.update(_sparse_state(t))

    t.on_step = on_step
    start, loaded, loaded_sparse = t.step, _numpy(_params(t)), _sparse_state(t)
    moments = [s["exp_avg"] for s in t.optimizer.state_dict()["state"].values()]
    t.fit(stop_after=stop_after, plot=False)
    return {
        "tables": t.tables,
        "start": start,
        "loaded": loaded,
        "loaded_sparse": loaded_sparse,
        "parameters": len(list(t.model.parameters())),
        "optimizer_state": len(moments),
        "snapshot": snapshot,
        "sparse_snapshot": sparse,
        "sub_batches": [list(r.sub_batches) for r in records],
        "ids": [r.sample_ids.tolist() for r in records],
        "notes": t.resume_notes,
    }


def _sub_batches_once(segments, frontier_at_least):
    seen = [j for seg in segments for step in seg for j in step]
    assert len(seen) == len(set(seen))  # no sub-batch trained twice
    assert set(range(frontier_at_least)) <= set(seen)  # none lost below the frontier
    return seen


@pytest.mark.parametrize(
    ("before", "after", "sparse"), [(2, 1, "auto"), (1, 2, "auto"), (1, 2, "sharded")]
)
def test_resume_on_another_world_size(tmp_path, before, after, sparse):
    # W = 2 and a checkpoint at step 3: the interrupted BBS window is re-planned to find
    # the sub-batches the old ranks had not trained yet. Tables: "auto" is sharded on 2
    # ranks and dense on one process; the resumed run takes the checkpoint's placement,
    # so 2 -> 1 reshards sharded tables (rows and row-wise Adagrad states), 1 -> 2 dense
    # ones; "sharded" reshards the collection from 1 to 2 ranks.
    preset = _preset(steps=10, ckpt_every=3, window_steps=2, sparse=sparse)
    run = tmp_path / "run"

    def launch(world, *args):
        if world == 1:
            return [_train_collect(*args)]
        return run_on_ranks(_train_collect, world, *args, timeout_s=300)

    first = launch(before, preset, run, None, 4, 3)  # steps 1-4, checkpoint at 3
    second = launch(after, preset, run, checkpoint_dir(run, 3), None)  # steps 4-10
    assert all(r["start"] == 3 for r in second)
    assert f"resharded from {before} to {after} ranks" in second[0]["notes"][0]
    expected = "sharded" if (sparse == "sharded" or before == 2) else "dense"
    assert {r["tables"] for r in first + second} == {expected}
    # The model arrives intact: what the new ranks loaded is what the old ranks had
    # after step 3 (sharded tables' rows included); so does the optimizers' state (one
    # AdamW state per parameter, the row-wise Adagrad states of sharded tables).
    for r in second:
        for k, v in first[0]["snapshot"].items():
            assert np.array_equal(r["loaded"][k], v), k
        assert r["optimizer_state"] == r["parameters"]
        assert r["loaded_sparse"].keys() == first[0]["sparse_snapshot"].keys()
        assert bool(r["loaded_sparse"]) == (expected == "sharded")
        for k, v in first[0]["sparse_snapshot"].items():
            assert np.array_equal(r["loaded_sparse"][k], v), k
    # Data: steps 1-3 of the old world plus steps 4-10 of the new one train every
    # sub-batch at most once, and every one below the highest old read position.
    old = [r["sub_batches"][:3] for r in first]
    new = [r["sub_batches"] for r in second]
    k = preset.train.global_batch_size // preset.train.sub_batch_size  # sub-batches per step
    seen = _sub_batches_once(old + new, frontier_at_least=3 * k)
    assert len(seen) == 10 * k
    ids = [i for r in first for step in r["ids"][:3] for i in step]
    ids += [i for r in second for step in r["ids"] for i in step]
    assert len(ids) == len(set(ids)) == 10 * preset.train.global_batch_size
