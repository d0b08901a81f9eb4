"""Held-out quality of the sequence tower's attention precisions at equal steps.

Trains one preset for ``--steps`` steps per attention precision (``train.attention_precision``:
``bf16``, ``fp8`` (FP8 forward, bf16 backward), ``fp8_bwd`` (FP8 backward too)) and per
initialisation seed (``train.seed``; the synthetic world, ``data.seed``, stays fixed), each
in a fresh process through the ``hyperrec-train`` command line, and records the test
evaluation (CTR / CVR / CTCVR AUC, NE) of every run and the per-seed differences against
``bf16``. On a CPU the FP8 attention runs ``hyperrec.jagged_attn``'s pure-PyTorch
specification (the kernels' quantized operands bit for bit; the accumulation differs),
so a CPU run measures the quality effect of the FP8 numerics, not of the GPU kernels.

With ``--seq-linears`` the variants are ``train.seq_linear_precision`` ``bf16`` and ``fp8``
instead (the sequence layers' projections in row-wise FP8; on a CPU the FP8 GEMMs are
emulated in float32 from the same quantized operands).

With ``--variant NAME=SECTION.FIELD=VALUE,...`` (repeatable, as ``step_variants.py``'s,
``@ENV=VALUE`` items set for that variant's process only, e.g. a kernel switch) the
variants are given outright; the first is the baseline. Each run records the gradient
norms of its logged steps (``grad_norm``: max, median, how many above the clip of 1.0).

With ``--rows`` the variants are rows of the ablation table instead (``bench/ablation.py``:
each row's composed overrides, e.g. ``--rows naive all``): the held-out quality of the full
stack against the naive baseline at equal steps, the other half of the ablation's
speed-at-equal-quality claim. The first variant is the baseline of the differences.

    python integration/bench/precision_quality.py --out DIR                  # tiny, CPU
    python integration/bench/precision_quality.py --out DIR --rows naive all
    python integration/bench/precision_quality.py --out DIR --seq-linears
    python integration/bench/precision_quality.py --out DIR --device cuda --preset small \
        --variant float32= --variant bf16=train.residual_dtype=autocast
    python integration/bench/precision_quality.py --out DIR --steps 40 --seeds 0 --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ablation
from step_variants import parse_variant

PRECISIONS = ("bf16", "fp8", "fp8_bwd")
#: Also accepted by ``--precisions`` (not run by default): ``fp8_fused`` is ``fp8``'s
#: numerics on the CPU (equal bit for bit), so it tells something only on a GPU.
EXTRA_PRECISIONS = ("fp8_fused",)
SEQ_LINEAR_PRECISIONS = ("bf16", "fp8")
METRICS = ("ctr_auc", "cvr_auc", "ctcvr_auc", "ctr_ne", "loss")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def child_env(parallel: int, env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment of one run's process: ``env`` over this one's, and with
    ``parallel > 1`` the host's cores split between the runs (``OMP_NUM_THREADS`` and
    Inductor's compile workers, unless already set): each torch process otherwise starts
    one thread per core, and side by side they oversubscribe the host. None: inherit."""
    if parallel <= 1 and not env:
        return None
    out = dict(os.environ)
    if parallel > 1:
        share = str(max(1, (os.cpu_count() or 1) // parallel))
        for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
            out.setdefault(name, share)
    out.update(env or {})
    return out


def run_one(
    args: argparse.Namespace,
    overrides: list[str],
    seed: int,
    out: Path,
    env: dict[str, str] | None = None,
) -> dict:
    """One training run in a fresh process; its test evaluation and wall time. One
    assignment per field (the command line refuses two): the variant's ``overrides``,
    then the seed, then ``--set``, later ones winning. ``env``: variables set for that
    process only (a variant's ``@NAME=VALUE`` items)."""
    merged = ablation.compose(overrides, [f"train.seed={seed}"], args.extra)
    cmd = [
        sys.executable, "-m", "hyperrec.integration.train", "--preset", args.preset,
        "--steps", str(args.steps), "--eval-every", "0", "--ckpt-every", "0",
        *(x for item in merged for x in ("--set", item)),
        "--out", str(out), "--device", args.device, "--no-plot", "--quiet",
    ]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=child_env(args.parallel, env))  # fmt: skip
    except subprocess.TimeoutExpired as e:
        # one slow run must not cost the others (nor the record of those already done)
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {"status": "timeout", "error": (tail or "")[-1500:],
                "wall_s": time.perf_counter() - t0}  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"status": "failed", "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": wall}
    doc = json.loads((out / "metrics.json").read_text())
    final = doc.get("final") or {}
    ac = doc.get("autoac")
    # memory and speed beside quality: a variant that changes what is saved (packed
    # activations) is judged on all three
    # a collapsed run (one prediction for everything) reads as chance AUC: say which
    # the gradient norms of the logged steps: a collapse diagnosis (clipping at 1.0 scales
    # every step whose norm exceeds it)
    norms = [g for g in (doc.get("history") or {}).get("grad_norm", []) if g is not None]
    grad = None if not norms else {
        "max": max(norms), "median": statistics.median(norms), "logged": len(norms),
        "above_1": sum(g > 1.0 for g in norms)}  # fmt: skip
    return {"status": "ok", "wall_s": wall, "grad_norm": grad, **{m: final.get(m) for m in METRICS},
            "ctr_logit_std": final.get("ctr_logit_std"), "collapsed": final.get("collapsed"),
            "steps": doc.get("steps_completed"), "peak_memory_gb": doc.get("peak_memory_gb"),
            "train_time_s": doc.get("train_time_s"),
            "autoac": None if ac is None else {
                k: ac.get(k) for k in ("budget_gb", "predicted_peak_gb", "no_ac_peak_gb",
                                       "floor_gb", "added_s", "solver", "verification")} | {
                "modes": {n: r.get("mode") for n, r in (ac.get("regions") or {}).items()},
                # what a mode alone does not say: the op outputs packed, per format
                "packed": {n: r.get("packed") for n, r in (ac.get("regions") or {}).items()}}}  # fmt: skip


def variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` per variant; the first is the baseline. A ``--variant``'s
    environment items (``@NAME=VALUE``) go to ``args.variant_env[label]``."""
    args.variant_env = {}
    if args.variant:
        out = []
        for text in args.variant:
            name, overrides, env = parse_variant(text)
            if env:
                args.variant_env[name] = env
            out.append((name, overrides))
        return out
    if args.seq_linears:
        return [(p, [f"train.seq_linear_precision={p}"]) for p in SEQ_LINEAR_PRECISIONS]
    if not args.rows:
        return [(p, [f"train.attention_precision={p}"]) for p in args.precisions]
    # As the ablation's smoke mode off a GPU: no Inductor build, and autoac needs an
    # explicit budget.
    cpu = ["train.data_workers=1", "train.ac_budget_gb=1"] if args.device == "cpu" else []
    configs = {row.name: (ov, why) for row, ov, why in ablation.row_configs(args.preset, cpu)}
    out = []
    for name in args.rows:
        if name not in configs:
            raise SystemExit(f"--rows: no ablation row {name!r}; rows: {list(configs)}")
        overrides, why = configs[name]
        if why is not None:
            raise SystemExit(f"--rows: row {name!r} is not available here: {why}")
        if args.device == "cpu":
            overrides = ablation.without_inductor(ablation.compose(overrides, cpu))
        out.append((name, overrides))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS + EXTRA_PRECISIONS
    )
    p.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                   help="compare rows of the ablation table instead (e.g. naive all)")  # fmt: skip
    p.add_argument("--seq-linears", action="store_true",
                   help="compare train.seq_linear_precision bf16 and fp8 instead")  # fmt: skip
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=SECTION.FIELD=VALUE,... (repeat; the first is the baseline)")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at a time (default 1); above 1 they share the device and "
                        "split the host's cores, so their train_time_s is contended: a "
                        "quality comparison only, and on one GPU rarely faster overall")  # fmt: skip
    p.add_argument("--tag", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny data sizes (a code-path check)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="SECTION.FIELD=VALUE for every run (e.g. longer histories)")  # fmt: skip
    args = p.parse_args(argv)
    if sum(map(bool, (args.seq_linears, args.rows, args.variant))) > 1:
        p.error("--seq-linears, --rows and --variant compare different things; give one")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.parallel < 1:
        p.error("--parallel must be >= 1")
    args.extra = list(args.overrides)
    if args.smoke:
        args.extra += ["data.eval_requests=256", "train.global_batch_size=32"]
    chosen = variants(args)
    base_name = chosen[0][0]
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(seed, name, overrides) for seed in args.seeds for name, overrides in chosen]
    done: dict[int, dict] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        seed, name, overrides = jobs[i]
        slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
        env = args.variant_env.get(name)
        r = run_one(args, overrides, seed, args.out / f"run-{slug}-seed{seed}",
                    **({"env": env} if env else {}))  # fmt: skip
        with lock:
            done[i] = {"variant": name, "seed": seed, **r}
            _report(name, seed, r)
            # the record so far, after every run: a caller stopped mid-way keeps what finished
            summarise([done[k] for k in sorted(done)])

    def _report(name: str, seed: int, r: dict) -> None:
        print(f"{name:12s} seed {seed}: " + (
            " ".join(f"{m} {_fmt(r[m])}" for m in ("ctr_auc", "cvr_auc", "ctcvr_auc"))
            + f" ({r['wall_s']:.0f} s)" + (" COLLAPSED (constant predictions)" if r.get("collapsed") else "")
            if r["status"] == "ok" else f"{r['status'].upper()}: {r['error'][-300:]}"), flush=True)  # fmt: skip

    def summarise(runs: list[dict]) -> tuple[Path, dict]:
        # per-seed differences against the baseline (paired: same seed, same data); a metric
        # a run could not score (None in metrics.json: an AUC with one class) has no pair
        base = {r["seed"]: r for r in runs if r["variant"] == base_name and r["status"] == "ok"}
        diffs: dict[str, dict[str, dict[str, float]]] = {}
        for name, _ in chosen[1:]:
            per = {m: [r[m] - base[r["seed"]][m] for r in runs
                       if r["variant"] == name and r["status"] == "ok" and r["seed"] in base
                       and r[m] is not None and base[r["seed"]][m] is not None]
                   for m in METRICS}  # fmt: skip
            diffs[name] = {m: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)}
                           for m, v in per.items() if v}  # fmt: skip
        # seed-to-seed spread of the baseline itself: the noise floor of the comparison
        spread = {}
        for m in METRICS:
            vals = [r[m] for r in base.values() if r[m] is not None]
            if len(vals) > 1:
                spread[m] = max(vals) - min(vals)
        kind, stem = (
            ("ablation rows", "ablation")
            if args.rows
            else ("sequence-linear precision", "seq_linear")
            if args.seq_linears
            else ("given variants", "variants")
            if args.variant
            else ("attention precision", "precision")
        )
        tag = args.tag or f"{args.preset}_{args.device}"
        from hyperrec.testing.bench import write_result

        path = write_result(
            args.out / f"{stem}_quality_{tag}.json",
            {"benchmark": f"{kind}: held-out quality at equal steps",
             "preset": args.preset, "overrides": args.overrides, "steps": args.steps,
             "seeds": args.seeds, "variants": dict(chosen), "variant_env": args.variant_env,
             "baseline": base_name, "parallel": args.parallel,
             "complete": len(runs) == len(jobs), "runs": runs,
             "difference_vs_baseline": diffs, "baseline_seed_spread": spread},
        )  # fmt: skip
        return path, diffs

    if args.parallel == 1:
        for i in range(len(jobs)):
            one(i)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.parallel) as pool:
            for f in [pool.submit(one, i) for i in range(len(jobs))]:
                f.result()
    runs = [done[k] for k in sorted(done)]
    path, diffs = summarise(runs)
    print(json.dumps(diffs, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
