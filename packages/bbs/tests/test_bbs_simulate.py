import json

import numpy as np
import pytest

from hyperrec.bbs.simulate import SimulationConfig, main, simulate, steps_for

SEEDS = (0, 1, 2, 3)


def _tiny(**kw):
    base = {
        "distributions": ("lognormal", "powerlaw"),
        "world_sizes": (32,),
        "windows": (1, 2, 4, 8),
        "steps": 32,
        "min_rank_steps": 0,
        "samples_per_sub_batch": 64,
        "sub_batches_per_step": 8,
    }
    return SimulationConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def runs():
    return [simulate(_tiny(seed=s)) for s in SEEDS]


def _mean(runs, dist, w, field):
    vals = [
        getattr(r, field)
        for run in runs
        for r in run.rows
        if r.distribution == dist and r.window_steps == w
    ]
    return float(np.mean(vals))


@pytest.mark.parametrize("dist", ["lognormal", "powerlaw"])
def test_skew_non_increasing_in_window(runs, dist):
    # Averaged over a fixed seed set; the gaps between windows (~30%, ~50%, ~65% cut)
    # dwarf the seed-to-seed noise, so this is not flaky, and it can fail.
    means = [_mean(runs, dist, w, "bbs") for w in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(means, means[1:])), means
    assert _mean(runs, dist, 1, "bbs") == pytest.approx(_mean(runs, dist, 1, "none"))


@pytest.mark.parametrize("dist", ["lognormal", "powerlaw"])
def test_oracle_and_budget_beat_local_bbs(runs, dist):
    for w in (1, 2, 4, 8):
        assert _mean(runs, dist, w, "oracle") < _mean(runs, dist, w, "bbs")
        assert _mean(runs, dist, w, "budget") < 0.3 * _mean(runs, dist, w, "none")


def test_delay_statistics_within_bound(runs):
    for run in runs:
        for r in run.rows:
            assert 0 <= r.bbs_mean_abs_delay <= r.window_steps - 1
            assert r.budget_sub_batches_std > 0


def test_result_dict_and_table(runs):
    d = runs[0].as_dict()
    assert len(d["rows"]) == 2 * 4 and d["config"]["seed"] == 0
    assert {t["mode"] for t in d["targets"]} == {"bbs", "budget"}
    json.dumps(d)
    table = runs[0].table()
    assert "lognormal" in table and "oracle" in table and "budget" in table


def test_deterministic():
    a = simulate(_tiny(distributions=("uniform",), windows=(1, 4)))
    b = simulate(_tiny(distributions=("uniform",), windows=(1, 4)))
    assert a.rows == b.rows


def test_steps_for_small_worlds():
    cfg = SimulationConfig(steps=16, min_rank_steps=4096)
    assert steps_for(cfg, 8) == 512 and steps_for(cfg, 4096) == 16
    odd = SimulationConfig(steps=6, min_rank_steps=100, windows=(2, 3))
    assert steps_for(odd, 8) == 18  # ceil(100 / 8) = 13, rounded up to a multiple of 6


def test_cli_writes_json_and_reports_progress(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = main(
        [
            "--distributions",
            "uniform",
            "--world-sizes",
            "8",
            "16",
            "--windows",
            "1",
            "2",
            "--steps",
            "4",
            "--min-rank-steps",
            "0",
            "--samples-per-sub-batch",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "R=16 W=2" in captured.err  # progress goes to stderr
    assert "ranks" in captured.out and "wrote" in captured.out
    data = json.loads(out.read_text())
    assert [(r["world_size"], r["window_steps"]) for r in data["rows"]] == [
        (8, 1),
        (8, 2),
        (16, 1),
        (16, 2),
    ]


@pytest.mark.parametrize(
    "argv",
    [["--steps", "3", "--windows", "2"], ["--world-sizes", "0"], ["--distributions", "zipf"]],
)
def test_cli_bad_arguments_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"windows": (1, 3), "steps": 16}, ValueError, "multiple of window 3"),
        ({"distributions": ("gamma",)}, ValueError, "unknown distribution"),
        ({"world_sizes": [8]}, TypeError, "world_sizes"),
        ({"steps": 0}, ValueError, "steps"),
        ({"cost": 1.0}, TypeError, "cost"),
        ({"method": "x"}, ValueError, "method"),
    ],
)
def test_config_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        SimulationConfig(**kwargs)
