"""Simulate step-cost skew across data-parallel ranks with and without BBS.

Run ``python -m hyperrec.bbs.simulate`` (``--help`` for options): it shows progress on
stderr, prints a table and writes JSON (default ``runs/bbs_simulation.json``). The
embedded default takes well under a minute on 2 CPU cores.

Model. Each of ``R`` ranks has its own reader emitting sub-batches of ``s`` samples
whose lengths are i.i.d. from a distribution; a sample of length ``L`` costs
``cost(L)`` (default ``L + L^2/512``) and a step trains ``k`` sub-batches per rank.
Skew is the :attr:`~hyperrec.bbs.ImbalanceStats.excess` of max over mean step cost
(``sum_s max_r / sum_s mean_r - 1``). Compared, on the very same sub-batches:

- ``none``: arrival order, no balancing.
- ``bbs``: every rank alone deals its own window of ``W`` steps (``shuffle_plan``); no
  communication, ``|delay| <= W - 1``.
- ``oracle``: a global view: the same partitioner (KK + swaps) over all ``R * W * k``
  sub-batches of the window, free to move any sub-batch to any rank and any step of
  its window (equal count ``k`` per rank and step); groups of similar load share a
  step. Needs an all-to-all of data per step in practice; it is also exactly what the
  global mode computes for readers that share an index. A heuristic, so a strong
  reference rather than a proven optimum.
- ``budget``: cost-budget batching per rank (``CostBudgetBatcher``) with
  ``max_wait_steps = W`` and the budget ``k * s * mean sample cost`` from a separate
  calibration sample of the distribution; the sub-batch count per step varies.

Every (distribution, world size) pair draws its own streams from a seeded generator;
all modes of that pair (and all windows) run on the very same sub-batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyperrec.bbs._validate import check_int
from hyperrec.bbs.budget import BudgetConfig, _Buffers, budget_from_costs
from hyperrec.bbs.cost import CostModel
from hyperrec.bbs.lengths import DISTRIBUTIONS, sample_lengths
from hyperrec.bbs.metrics import ImbalanceStats
from hyperrec.bbs.plan import _check_method, plan_global_windows, plan_windows

__all__ = [
    "SimulationConfig",
    "SimulationResult",
    "SimulationRow",
    "main",
    "simulate",
]

DEFAULT_OUT = "runs/bbs_simulation.json"
_CHUNK_SAMPLES = 1 << 22  # samples generated per chunk: bounds the temporary memory
_CALIBRATION_SAMPLES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """What to simulate. The defaults are the CLI's embedded run (well under a minute)."""

    distributions: tuple[str, ...] = ("lognormal", "powerlaw", "uniform")
    """Names from :data:`hyperrec.bbs.lengths.DISTRIBUTIONS`."""
    world_sizes: tuple[int, ...] = (8, 64, 512, 4096)
    """Numbers of data-parallel ranks."""
    windows: tuple[int, ...] = (1, 2, 4, 8, 16)
    """BBS windows ``W`` (steps); each must divide :attr:`steps`."""
    steps: int = 16
    """Steps simulated per rank at the largest world sizes; must be a multiple of every
    window. Smaller world sizes run more steps, see :attr:`min_rank_steps`."""
    min_rank_steps: int = 4096
    """Each world size ``R`` runs ``max(steps, ceil(min_rank_steps / R))`` steps (rounded
    up to a multiple of every window), so small worlds get as many samples of the
    per-step maximum as large ones at little cost."""
    samples_per_sub_batch: int = 128
    """``s``: samples per reader sub-batch."""
    sub_batches_per_step: int = 8
    """``k``: sub-batches per rank and step (``k * s`` samples per local batch)."""
    cost: CostModel = CostModel(linear=1.0, quadratic=1.0 / 512.0)
    """Per-sample cost model; default ``L + L^2 / 512`` (attention-heavy)."""
    max_len: int = 4096
    """Lengths are truncated to ``[1, max_len]``."""
    seed: int = 0
    """Seed of every random stream (results are reproducible)."""
    method: str = "auto"
    """Partition algorithm for BBS and the oracle."""
    oracle: bool = True
    """Also run the global oracle."""
    budget: bool = True
    """Also run cost-budget batching."""

    def __post_init__(self) -> None:
        for name in ("distributions", "world_sizes", "windows"):
            if not isinstance(getattr(self, name), tuple) or not getattr(self, name):
                raise TypeError(f"{name} must be a non-empty tuple")
        for d in self.distributions:
            if d not in DISTRIBUTIONS:
                raise ValueError(f"unknown distribution {d!r}; known: {sorted(DISTRIBUTIONS)}")
        for r in self.world_sizes:
            check_int("world_sizes[i]", r, minimum=1)
        steps = check_int("steps", self.steps, minimum=1)
        check_int("min_rank_steps", self.min_rank_steps, minimum=0)
        for w in self.windows:
            check_int("windows[i]", w, minimum=1)
            if steps % w:
                raise ValueError(f"steps={steps} is not a multiple of window {w}")
        check_int("samples_per_sub_batch", self.samples_per_sub_batch, minimum=1)
        check_int("sub_batches_per_step", self.sub_batches_per_step, minimum=1)
        check_int("max_len", self.max_len, minimum=1)
        check_int("seed", self.seed, minimum=0)
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"cost must be a CostModel, got {type(self.cost).__name__}")
        _check_method(self.method)


@dataclass(frozen=True, kw_only=True)
class SimulationRow:
    """One (distribution, world size, window) cell. Excesses as in :class:`ImbalanceStats`."""

    distribution: str
    world_size: int
    window_steps: int
    steps: int
    """Steps simulated per rank (fixed-count modes)."""
    none: float
    """Excess without balancing (arrival order)."""
    bbs: float
    """Excess with per-rank BBS (no communication)."""
    bbs_reduction: float
    """``1 - bbs / none``."""
    bbs_p99_rank: float
    """BBS: mean over steps of the 99th-percentile rank's cost over the mean."""
    bbs_mean_abs_delay: float
    """BBS: mean ``|trained step - natural step|`` over sub-batches (bound: ``W - 1``)."""
    oracle: float | None = None
    """Excess of the global oracle (``None`` if not run)."""
    oracle_reduction: float | None = None
    budget: float | None = None
    """Excess of cost-budget batching (``None`` if not run)."""
    budget_reduction: float | None = None
    budget_steps: int | None = None
    """Steps the budget run completed before a rank's data ran out."""
    budget_sub_batches_mean: float | None = None
    """Mean sub-batches per rank and step in budget mode (fixed-count: ``k``)."""
    budget_sub_batches_std: float | None = None
    """Their standard deviation: sample counts vary in budget mode."""
    budget_max_over_budget: float | None = None
    """Largest step cost / budget - 1 (> 0 only through forced or oversized items)."""


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """All rows plus the inputs that produced them."""

    config: SimulationConfig
    rows: tuple[SimulationRow, ...]
    budgets: dict[str, float]
    """The cost budget used per distribution."""
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        cfg = asdict(self.config)
        return {
            "config": cfg,
            "distributions": {d: DISTRIBUTIONS[d].describe() for d in self.config.distributions},
            "budgets": self.budgets,
            "rows": [asdict(r) for r in self.rows],
            "targets": targets(self.rows),
            "elapsed_s": round(self.elapsed_s, 2),
        }

    def table(self) -> str:
        """The human-readable table (one block per distribution)."""
        return format_table(self.rows, self.config)


def simulate(
    config: SimulationConfig | None = None, *, progress: Callable[[str], None] | None = None
) -> SimulationResult:
    """Run the simulation described by ``config`` (default: :class:`SimulationConfig()`).

    Args:
        config: what to run.
        progress: called with one line of text after each finished cell.

    Returns:
        :class:`SimulationResult`, rows ordered by distribution, world size, window.
    """
    cfg = SimulationConfig() if config is None else config
    if not isinstance(cfg, SimulationConfig):
        raise TypeError(f"config must be a SimulationConfig, got {type(cfg).__name__}")
    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    cells = len(cfg.distributions) * len(cfg.world_sizes) * len(cfg.windows)
    say(
        f"simulating {cells} cells: {', '.join(cfg.distributions)} x world sizes "
        f"{list(cfg.world_sizes)} x W {list(cfg.windows)}"
    )
    rows: list[SimulationRow] = []
    budgets: dict[str, float] = {}
    for name in cfg.distributions:
        dist_rows, budgets[name] = _simulate_distribution(name, cfg, say, t0)
        rows += dist_rows
    return SimulationResult(
        config=cfg, rows=tuple(rows), budgets=budgets, elapsed_s=time.perf_counter() - t0
    )


def sub_batch_costs(
    name: str,
    ranks: int,
    sub_batches: int,
    samples_per_sub_batch: int,
    cost: CostModel,
    rng: np.random.Generator,
    max_len: int = 4096,
) -> np.ndarray:
    """``(ranks, sub_batches)`` float64 costs of freshly sampled sub-batches."""
    s = samples_per_sub_batch
    out = np.empty((ranks, sub_batches))
    per_rank = sub_batches * s
    rows = max(1, _CHUNK_SAMPLES // max(per_rank, 1))
    lin, quad, const = (np.float32(cost.linear), np.float32(cost.quadratic), cost.constant)
    for r0 in range(0, ranks, rows):
        r1 = min(ranks, r0 + rows)
        x = sample_lengths(name, (r1 - r0) * per_rank, rng, max_len=max_len)
        c = x * (lin + quad * x)
        out[r0:r1] = c.reshape(r1 - r0, sub_batches, s).sum(axis=2, dtype=np.float64)
        out[r0:r1] += const * s
    return out


def steps_for(cfg: SimulationConfig, world_size: int) -> int:
    """Steps simulated at ``world_size``: see :attr:`SimulationConfig.min_rank_steps`."""
    lcm = int(np.lcm.reduce(np.array(cfg.windows)))
    want = max(cfg.steps, -(-cfg.min_rank_steps // world_size))
    return -(-want // lcm) * lcm


def _simulate_distribution(
    name: str, cfg: SimulationConfig, say: Callable[[str], None], t0: float
) -> tuple[list[SimulationRow], float]:
    k, s = cfg.sub_batches_per_step, cfg.samples_per_sub_batch
    key = sorted(DISTRIBUTIONS).index(name)
    # The budget comes from "dataset statistics": a separate calibration sample.
    calib = sample_lengths(
        name, _CALIBRATION_SAMPLES, np.random.default_rng([cfg.seed, key, 0]), max_len=cfg.max_len
    )
    budget = budget_from_costs(cfg.cost.sample_costs(calib), k * s)
    rows = []
    for r in cfg.world_sizes:
        steps = steps_for(cfg, r)
        rng = np.random.default_rng([cfg.seed, key, r])
        c = sub_batch_costs(name, r, steps * k, s, cfg.cost, rng, cfg.max_len)
        none = ImbalanceStats.from_step_costs(c.reshape(r, steps, k).sum(axis=2).T)
        for w in cfg.windows:
            bbs_steps, delay = _local_bbs(c, k, w, cfg.method)
            bbs = ImbalanceStats.from_step_costs(bbs_steps)
            row: dict[str, Any] = {
                "distribution": name,
                "world_size": r,
                "window_steps": w,
                "steps": steps,
                "none": none.excess,
                "bbs": bbs.excess,
                "bbs_reduction": _cut(bbs.excess, none.excess),
                "bbs_p99_rank": bbs.p99_rank_over_mean,
                "bbs_mean_abs_delay": delay,
            }
            if cfg.oracle:
                oracle = ImbalanceStats.from_step_costs(_oracle(c, k, w, cfg.method))
                row["oracle"] = oracle.excess
                row["oracle_reduction"] = _cut(oracle.excess, none.excess)
            if cfg.budget:
                step_costs, counts = _budget_run(c, budget, w, k)
                if step_costs.shape[0]:
                    st = ImbalanceStats.from_step_costs(step_costs)
                    row.update(
                        budget=st.excess,
                        budget_reduction=_cut(st.excess, none.excess),
                        budget_steps=int(step_costs.shape[0]),
                        budget_sub_batches_mean=float(counts.mean()),
                        budget_sub_batches_std=float(counts.std()),
                        budget_max_over_budget=float(step_costs.max() / budget - 1.0),
                    )
            rows.append(SimulationRow(**row))
            say(
                f"[{time.perf_counter() - t0:6.1f}s] {name} R={r} W={w} ({steps} steps):"
                f" none {none.excess:.3f} bbs {bbs.excess:.3f}"
                + (f" oracle {row['oracle']:.3f}" if "oracle" in row else "")
                + (f" budget {row['budget']:.3f}" if "budget" in row else "")
            )
    return rows, budget


def _cut(value: float, baseline: float) -> float:
    return 1.0 - value / baseline if baseline > 0 else 0.0


def _local_bbs(c: np.ndarray, k: int, w: int, method: str) -> tuple[np.ndarray, float]:
    """Every rank plans its own windows: ``(steps, ranks)`` step costs, mean |delay|."""
    r, n = c.shape
    nwin = n // (w * k)
    windows = c.reshape(r * nwin, w * k)
    plan = plan_windows(windows, k, w, method=method)  # (r * nwin, w, k)
    flat = plan.reshape(r * nwin, w * k)
    step_costs = np.take_along_axis(windows, flat, 1).reshape(r * nwin, w, k).sum(axis=2)
    trained = np.broadcast_to(np.arange(w)[:, None], (w, k)).reshape(-1)
    delay = np.abs(trained[None, :] - flat // k).mean()
    return step_costs.reshape(r, nwin * w).T, float(delay)


def _oracle(c: np.ndarray, k: int, w: int, method: str) -> np.ndarray:
    """Global view of each window of all ranks: ``(steps, ranks)`` step costs."""
    r, n = c.shape
    nwin = n // (w * k)
    # Natural order within a window: step-major, then rank, then sub-batch.
    windows = c.reshape(r, nwin, w, k).transpose(1, 2, 0, 3).reshape(nwin, w * r * k)
    plan = plan_global_windows(windows, r, k, w, method=method)  # (nwin, w, r, k)
    flat = plan.reshape(nwin, -1)
    step_costs = np.take_along_axis(windows, flat, 1).reshape(nwin, w, r, k).sum(axis=3)
    return step_costs.reshape(nwin * w, r)


def _budget_run(c: np.ndarray, budget: float, w: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Cost-budget batching on every rank at once (same code path as CostBudgetBatcher).

    Stops before the first step at which some rank has run out of data, so every
    recorded step had a full look-ahead on every rank.
    """
    r, n = c.shape
    base = BudgetConfig(budget=budget, max_wait_steps=w)
    cfg = BudgetConfig(
        budget=budget, max_wait_steps=w, max_buffer_items=int(np.ceil(base.lookahead * k * 4))
    )
    bufs = _Buffers(r, cfg)
    ptr = np.zeros(r, dtype=np.int64)
    out_costs, out_counts = [], []
    for t in range(n):
        if bufs.fill(c, ptr, t):
            break
        taken = bufs.select(t)
        out_costs.append(np.where(taken, bufs.cost, 0.0).sum(axis=1))
        out_counts.append(taken.sum(axis=1))
    if not out_costs:
        return np.zeros((0, r)), np.zeros((0, r))
    return np.stack(out_costs), np.stack(out_counts)


def targets(rows: Sequence[SimulationRow]) -> list[dict[str, Any]]:
    """The issue's targets at ``W = 8`` on log-normal and power-law lengths.

    BBS must remove >= 60% of the no-balancing excess, cost-budget >= 90%; checked at
    every simulated world size (the minimum is reported).
    """
    out = []
    for dist in ("lognormal", "powerlaw"):
        cells = [r for r in rows if r.distribution == dist and r.window_steps == 8]
        if not cells:
            continue
        checks = [("bbs", 0.60, [r.bbs_reduction for r in cells])]
        budget = [r.budget_reduction for r in cells if r.budget_reduction is not None]
        if budget:
            checks.append(("budget", 0.90, budget))
        for mode, goal, values in checks:
            worst = min(values)
            out.append(
                {
                    "distribution": dist,
                    "window_steps": 8,
                    "mode": mode,
                    "goal_reduction": goal,
                    "min_reduction_over_world_sizes": round(worst, 4),
                    "met": bool(worst >= goal),
                }
            )
    return out


def format_table(rows: Sequence[SimulationRow], cfg: SimulationConfig) -> str:
    """Render rows as fixed-width text blocks, one per distribution."""
    lines = []
    for dist in dict.fromkeys(r.distribution for r in rows):
        lines.append(
            f"{dist} ({DISTRIBUTIONS[dist].describe()}); cost = {_describe_cost(cfg.cost)}; "
            f"{cfg.sub_batches_per_step} x {cfg.samples_per_sub_batch} samples per rank-step"
        )
        head = f"{'ranks':>6} {'W':>3} {'none':>7} {'bbs':>7} {'cut':>5} {'|delay|':>7}"
        if cfg.oracle:
            head += f" {'oracle':>7} {'cut':>5}"
        if cfg.budget:
            head += f" {'budget':>7} {'cut':>5} {'sb/step':>10}"
        lines += [head, "-" * len(head)]
        for r in (x for x in rows if x.distribution == dist):
            line = (
                f"{r.world_size:>6} {r.window_steps:>3} {r.none:>7.3f} {r.bbs:>7.3f} "
                f"{r.bbs_reduction:>5.0%} {r.bbs_mean_abs_delay:>7.2f}"
            )
            if cfg.oracle:
                line += f" {r.oracle:>7.3f} {r.oracle_reduction:>5.0%}"
            if cfg.budget:
                if r.budget is None:
                    line += f" {'n/a':>7} {'':>5} {'':>10}"
                else:
                    spread = f"{r.budget_sub_batches_mean:.2f}+-{r.budget_sub_batches_std:.2f}"
                    line += f" {r.budget:>7.3f} {r.budget_reduction:>5.0%} {spread:>10}"
            lines.append(line)
        lines.append("")
    lines.append(
        "excess = sum over steps of max-rank cost / sum of mean-rank cost - 1; cut = share of "
        "the 'none' excess removed; |delay| = mean steps a sub-batch moves (bound W-1)."
    )
    return "\n".join(lines)


def _describe_cost(cost: CostModel) -> str:
    parts = []
    if cost.constant:
        parts.append(f"{cost.constant:g}")
    if cost.linear:
        parts.append(f"{cost.linear:g}*L")
    if cost.quadratic:
        parts.append(
            f"L^2/{1 / cost.quadratic:g}" if cost.quadratic < 1 else f"{cost.quadratic:g}*L^2"
        )
    return " + ".join(parts) or "0"


def _parser() -> argparse.ArgumentParser:
    d = SimulationConfig()
    p = argparse.ArgumentParser(
        prog="python -m hyperrec.bbs.simulate",
        description="Skew of per-rank step cost with and without Base Batch Shuffling.",
    )
    p.add_argument(
        "--distributions", nargs="+", default=list(d.distributions), choices=sorted(DISTRIBUTIONS)
    )
    p.add_argument("--world-sizes", nargs="+", type=int, default=list(d.world_sizes))
    p.add_argument("--windows", nargs="+", type=int, default=list(d.windows))
    p.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help="steps per rank; a multiple of every window (default %(default)s)",
    )
    p.add_argument(
        "--min-rank-steps",
        type=int,
        default=d.min_rank_steps,
        help="small world sizes run at least this many rank-steps (default %(default)s)",
    )
    p.add_argument("--samples-per-sub-batch", type=int, default=d.samples_per_sub_batch)
    p.add_argument("--sub-batches-per-step", type=int, default=d.sub_batches_per_step)
    p.add_argument(
        "--quadratic",
        type=float,
        default=d.cost.quadratic,
        help="attention coefficient b in cost = L + b*L^2 (default 1/512)",
    )
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--method", default=d.method)
    p.add_argument("--no-oracle", action="store_true", help="skip the global oracle")
    p.add_argument("--no-budget", action="store_true", help="skip cost-budget batching")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON output path (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (2 on bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cfg = SimulationConfig(
            distributions=tuple(args.distributions),
            world_sizes=tuple(args.world_sizes),
            windows=tuple(args.windows),
            steps=args.steps,
            min_rank_steps=args.min_rank_steps,
            samples_per_sub_batch=args.samples_per_sub_batch,
            sub_batches_per_step=args.sub_batches_per_step,
            cost=CostModel(linear=1.0, quadratic=args.quadratic),
            max_len=args.max_len,
            seed=args.seed,
            method=args.method,
            oracle=not args.no_oracle,
            budget=not args.no_budget,
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = simulate(cfg, progress=None if args.quiet else progress)
    print(result.table())
    for t in result.as_dict()["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        print(
            f"target {t['distribution']:>9} {t['mode']:>6} W=8: cut >= {t['goal_reduction']:.0%}"
            f" at every world size -> min {t['min_reduction_over_world_sizes']:.1%} ({verdict})"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    print(f"wrote {out} ({result.elapsed_s:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
