"""Forward-kernel variant sweep on one GPU: every variant of ``KernelConfig`` in one process.

For the cases that miss the forward target (max length 1,024-2,048, bf16, D=128), plus
L=8,192 and the HSTU-style GDPA case, it times the Triton forward with the shipped
configuration ("default") and with each variant: the forward-only flags of
:class:`hyperrec.jagged_attn._triton.KernelConfig` (``prefetch``, ``softmax_fma``,
``lazy_rescale``, ``tma`` and its parts, host- or kernel-built, ``warp_specialize``) alone
and combined, and other tile shapes.
A second phase runs the two best flag sets on every tile shape. Then fwd+bwd is timed
for the default and for the best forward variant of each case (the backward kernels are the
shipped ones either way).

Same inputs, FLOP counting and timing as ``bench_attention.py`` (whose helpers are imported):
bf16 random normal, useful FLOPs ``4 * sum(Lq * Lk) * H * D`` (allowed pairs only when
causal; fwd+bwd counted 3.5x), median of ``triton.testing.do_bench`` (L2 cleared between
calls), best of ``--rounds`` interleaved rounds (two back-to-back timings of one kernel
were seen to differ by up to ~10% on the H200). Also the median from a CUDA graph
(``fwd_tflops_graph``): the launcher's host work (schedule lookup, descriptors) excluded,
which ``do_bench`` counts whenever it exceeds the L2-clearing kernel before each call.

Correctness, recorded per variant rather than fatal: every build first runs in a worker
process (one per build, so a crash or a CUDA error costs that variant only) on a small batch
with zero- and one-length sequences, against the float64 reference; in the main process
each variant's output is compared with the default kernel's on the full case
(``max_abs_diff``, ``rel_diff``, NaN counts). A variant whose check fails is still timed,
but marked ``ok: false`` and never chosen as best.

    PYTHONPATH=packages/jagged_attn/src:packages/testing/src \\
      python packages/jagged_attn/bench/sweep_forward.py --out sweep_forward_h200.json

About two minutes on an H200 (builds run in parallel worker processes, a few seconds
each). ``--quick`` runs a few variants on two cases (a smoke test, under a minute);
``--dry-run`` prints the plan and exits (runs without a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))

import bench_attention  # noqa: E402
from bench_attention import CASES as BENCH_CASES  # noqa: E402
from bench_attention import (  # noqa: E402
    Case,
    bench_ms,
    call_of,
    lengths,
    matmul_ceiling,
    useful_flops,
)
from bench_attention import _spec as spec_of  # noqa: E402

from hyperrec.jagged_attn._triton._configs import (  # noqa: E402
    TMA_ALL,
    TMA_KV,
    TMA_O,
    TMA_Q,
    KernelConfig,
    config_key,
    select_config,
)

CASE_NAMES = [
    "u-B128-L1024-H8-D128",
    "p-B256-L2048-H4-D128",
    "u-B64-L2048-H8-D128-causal",
    "p-B1024-L1024-H4-D128",
    "u-B16-L8192-H4-D128",
    "gdpa-u-B128-L1024-H4-D128",
]
CASES = [c for c in BENCH_CASES if c.name in CASE_NAMES]
# The forward target applies to max length 1,024-2,048; these cases rank the variants.
TARGET_CASES = [n for n in CASE_NAMES if "L8192" not in n]

# Forward-only flags (on the case's shipped tile shape).
FLAG_SETS: dict[str, dict] = {
    "default": {},
    # The shipped sm90 forward entries set TMA; this measures them without it.
    "no-tma": dict(tma=0, tma_in_kernel=False),
    "fma": dict(softmax_fma=True),
    "lazy": dict(lazy_rescale=True),
    "fma+lazy": dict(softmax_fma=True, lazy_rescale=True),
    "prefetch": dict(prefetch=True),
    "tma": dict(tma=TMA_ALL),
    "tma-kv": dict(tma=TMA_KV),
    "tma-q+kv": dict(tma=TMA_Q | TMA_KV),
    "tma-q+kv+o": dict(tma=TMA_Q | TMA_KV | TMA_O),
    "tma-ik": dict(tma=TMA_ALL, tma_in_kernel=True),
    "tma-q+kv+o-ik": dict(tma=TMA_Q | TMA_KV | TMA_O, tma_in_kernel=True),
    "ws": dict(warp_specialize=True),
    "tma+ws": dict(tma=TMA_ALL, warp_specialize=True),
    "prefetch+tma": dict(prefetch=True, tma=TMA_ALL),
    "all": dict(prefetch=True, tma=TMA_ALL, softmax_fma=True, lazy_rescale=True),
    "all+ws": dict(
        prefetch=True, tma=TMA_ALL, softmax_fma=True, lazy_rescale=True, warp_specialize=True
    ),
}
# Other tile shapes (block_m, block_n, num_warps, num_stages), without flags.
TILES = [
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
]
QUICK_VARIANTS = ["default", "prefetch", "tma", "tma-ik", "ws", "tile-64x64w4s3"]
QUICK_CASES = ["u-B128-L1024-H8-D128", "gdpa-u-B128-L1024-H4-D128"]


def tile_name(t: tuple[int, int, int, int]) -> str:
    return f"tile-{t[0]}x{t[1]}w{t[2]}s{t[3]}"


def base_config(case: Case) -> KernelConfig:
    """The shipped forward configuration of ``case`` on Hopper."""
    key = config_key("fwd", "sm90", case.head_dim, case.kind == "softmax", case.causal,
                     case.max_len)  # fmt: skip
    return select_config(key)


def variant_config(name: str, base: KernelConfig) -> KernelConfig:
    """Variant ``name`` ("default", a flag set, "tile-...", or "<tile>+<flag set>")."""
    tile, _, flags = name.partition("+") if name.startswith("tile-") else ("", "", name)
    cfg = base
    if tile:
        bm, rest = tile[len("tile-") :].split("x")
        bn, rest = rest.split("w")
        w, s = rest.split("s")
        cfg = replace(cfg, block_m=int(bm), block_n=int(bn), num_warps=int(w), num_stages=int(s))
    if flags:
        cfg = replace(cfg, **FLAG_SETS[flags])
    return cfg


def variant_overrides(name: str) -> dict:
    """What variant ``name`` changes relative to the case's shipped configuration."""
    tile, _, flags = name.partition("+") if name.startswith("tile-") else ("", "", name)
    out: dict = {"tile": tile or "shipped"}
    out.update(FLAG_SETS[flags] if flags else {})
    return out


def phase1_variants(quick: bool) -> list[str]:
    names = list(FLAG_SETS) + [tile_name(t) for t in TILES]
    return [n for n in names if n in QUICK_VARIANTS] if quick else names


# ---------------------------------------------------------------------------------------
# Builds: one worker process per (variant, kernel specialisation)
# ---------------------------------------------------------------------------------------


def build_key(case: Case) -> tuple:
    """What selects a compiled forward kernel besides the config (constexprs of the case)."""
    return (case.heads, case.head_dim, case.kind, case.causal)


def _build_job(job: tuple) -> dict:
    """Compile one variant for one case's kernel specialisation and check it on a small
    batch (zero- and one-length sequences, a partial tile) against the float64 reference."""
    name, cfg_dict, case_dict = job
    res: dict = {"variant": name, "case": case_dict["name"]}
    t0 = time.perf_counter()
    try:
        from hyperrec.jagged_attn import reference
        from hyperrec.jagged_attn._triton import _launch, attention_forward

        case = Case(**case_dict)
        cfg = KernelConfig(**cfg_dict)
        lens = [case.max_len // 3 + 1, 1, 0, 50, 300]
        off = torch.zeros(len(lens) + 1, dtype=torch.int32)
        off[1:] = torch.tensor(lens).cumsum(0)
        off = off.cuda()
        t = int(off[-1])
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(t, case.heads, case.head_dim, device="cuda",
                               dtype=torch.bfloat16, generator=g) for _ in range(3))  # fmt: skip
        spec = spec_of(case, case.max_len)
        call = call_of(spec, q, k, v, off)
        out, _ = attention_forward(call, config=cfg)
        torch.cuda.synchronize()
        res["build_s"] = time.perf_counter() - t0
        exact = reference.attention_forward(q.double(), k.double(), v.double(), off, off, spec)
        res["err_vs_exact"] = float((out.double() - exact).abs().max())
        res["nan"] = int(torch.isnan(out).sum())
        res["compiled"] = compiled_info(_launch)
        failures = _launch.forward_build_failures()
        if failures:
            res["ws_build_error"] = next(iter(failures.values()))
        if name == "default":  # warm the backward kernels too (fwd+bwd timings)
            from hyperrec.jagged_attn._triton import attention_backward

            out, lse = attention_forward(call, config=cfg)
            attention_backward(torch.randn_like(out), out, lse, call)
            torch.cuda.synchronize()
    except Exception as e:  # recorded, not fatal
        res["error"] = f"{type(e).__name__}: {e}"[:600]
    res["job_s"] = time.perf_counter() - t0
    return res


def compiled_info(launch_module) -> dict:
    """Registers, spills, shared memory and IR facts of the forward kernel just built."""
    out: dict = {}
    for key, compiled in launch_module._COMPILED.items():
        if key[0] != "fwd":
            continue
        try:
            ttgir = compiled.asm.get("ttgir", "")
            out = {
                "n_regs": int(compiled.n_regs),
                "n_spills": int(compiled.n_spills),
                "shared_bytes": int(compiled.metadata.shared),
                "warp_specialized": "ttg.warp_specialize" in ttgir,
                "tma_ops": ttgir.count("async_tma_copy_global_to_local")
                + ttgir.count("async_tma_copy_local_to_global"),
                "occupancy": launch_module._OCCUPANCY.get(key),
            }
        except Exception as e:  # recorded, not fatal
            out = {"error": f"{type(e).__name__}: {e}"[:200]}
    return out


def run_builds(jobs: list[tuple], workers: int) -> list[dict]:
    """Run build jobs, each in a fresh spawned process; a crash is recorded as an error."""
    results = []
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1) as ex:
        futures = {ex.submit(_build_job, job): job for job in jobs}
        for fut in cf.as_completed(futures):
            name, _, case_dict = futures[fut]
            try:
                results.append(fut.result())
            except Exception as e:  # a worker that died
                results.append({"variant": name, "case": case_dict["name"],
                                "error": f"worker died: {type(e).__name__}: {e}"[:600]})  # fmt: skip
    return results


def build_jobs(names: list[str], cases: list[Case]) -> list[tuple]:
    """One job per (variant, distinct kernel specialisation among ``cases``)."""
    jobs, seen = [], set()
    for name in names:
        for case in cases:
            cfg = variant_config(name, base_config(case))
            key = (cfg, build_key(case))
            if key in seen:
                continue
            seen.add(key)
            jobs.append((name, asdict(cfg), asdict(case)))
    # the warp-specialised and descriptor builds are the slowest: start them first
    jobs.sort(key=lambda j: -(2 * j[1]["warp_specialize"] + j[1]["tma"]))
    return jobs


def build_verdicts(builds: list[dict], cases: list[Case]) -> dict[tuple[str, str], dict]:
    """(variant, case name) -> the build result of that case's specialisation."""
    by_spec = {}
    for r in builds:
        case = next(c for c in cases if c.name == r["case"])
        by_spec[(r["variant"], build_key(case))] = r
    return {(v, c.name): by_spec[(v, build_key(c))] for (v, _) in by_spec for c in cases
            if (v, build_key(c)) in by_spec}  # fmt: skip


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


def make_inputs(case: Case):
    return bench_attention.make_inputs(case, torch.int32)


def check_variant(case, cfg, inputs, ref) -> tuple[dict, tuple]:
    """Run once; compare with the default kernel's output ``ref`` (None for the default)."""
    from hyperrec.jagged_attn._triton import _launch, attention_forward

    _, off, q, k, v, _ = inputs
    spec = spec_of(case, case.max_len)
    res: dict = {}
    out, lse = attention_forward(call_of(spec, q, k, v, off), config=cfg)
    torch.cuda.synchronize()
    res["effective"] = _launch._forward_variants(cfg, spec.activation, spec.scale,
                                                 (q, k, v, out),
                                                 (case.head_dim, case.head_dim))  # fmt: skip
    res["nan"] = int(torch.isnan(out).sum())
    if ref is not None:
        ref_out, ref_lse = ref
        diff = float((out.float() - ref_out).abs().max())
        res["max_abs_diff"] = diff
        res["rel_diff"] = diff / max(float(ref_out.abs().max()), 1e-30)
        if case.kind == "softmax":
            fin = torch.isfinite(ref_lse)
            res["lse_max_abs_diff"] = float((lse[fin] - ref_lse[fin]).abs().max())
    return res, (out.float(), lse)


def fwd_fn(case, cfg, inputs):
    from hyperrec.jagged_attn._triton import attention_forward

    _, off, q, k, v, _ = inputs
    call = call_of(spec_of(case, case.max_len), q, k, v, off)
    return lambda: attention_forward(call, config=cfg)


def graph_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: no host (launcher) overhead."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def time_fwd_bwd(case, cfg, inputs) -> dict:
    from hyperrec.jagged_attn._triton import attention_backward, attention_forward

    lens, off, q, k, v, do = inputs
    call = call_of(spec_of(case, case.max_len), q, k, v, off)

    def fwd_bwd():
        out, lse = attention_forward(call, config=cfg)
        return attention_backward(do, out, lse, call)

    fwd_bwd()
    torch.cuda.synchronize()
    ms = min(bench_ms(fwd_bwd) for _ in range(2))
    flops = useful_flops(lens, case.heads, case.head_dim, case.causal)
    return {"fwd_bwd_ms": ms, "fwd_bwd_tflops": 3.5 * flops / ms * 1e-9}


def check_ok(r: dict, build: dict | None, default_build: dict | None) -> bool:
    """A variant is trusted if it ran, agrees with the default kernel to bf16 rounding on
    the case, and meets the accuracy rule (<= 2x the default's error + 1e-3) on the small
    batch against the float64 reference."""
    if "error" in r or r.get("nan", 0) or r.get("rel_diff", 0.0) > 2e-2:
        return False
    if build is not None and default_build is not None:
        e, e0 = build.get("err_vs_exact"), default_build.get("err_vs_exact")
        if e is None or (e0 is not None and e > 2 * e0 + 1e-3):
            return False
    return True


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "results" / "sweep_forward_h200.json")
    parser.add_argument("--quick", action="store_true", help="few variants, two cases")
    parser.add_argument("--variants", default=None, help="comma-separated variant names")
    parser.add_argument("--cases", default=None, help="run cases whose name contains this")
    parser.add_argument(
        "--all-cases", action="store_true", help="every bench_attention.py case, not the six"
    )
    parser.add_argument("--no-combine", action="store_true", help="skip the second phase")
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds (best kept)")
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    parser.add_argument("--workers", type=int, default=None, help="parallel build processes")
    parser.add_argument("--hstu", default=None, help="also time the HSTU kernel (path)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()

    pool = list(BENCH_CASES) if args.all_cases else list(CASES)
    cases = [c for c in pool if c.name in QUICK_CASES] if args.quick else pool
    if args.cases:
        cases = [c for c in cases if args.cases in c.name]
    names = args.variants.split(",") if args.variants else phase1_variants(args.quick)
    if "default" not in names:
        names.insert(0, "default")
    for n in names:
        variant_config(n, base_config(cases[0]))  # fail fast on a bad name
    jobs = build_jobs(names, cases)
    if args.dry_run:
        plan = {"cases": [c.name for c in cases], "build_jobs": len(jobs),
                "variants": {n: variant_overrides(n) for n in names}}  # fmt: skip
        print(json.dumps(plan, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("sweep_forward.py needs a CUDA GPU (use --dry-run to see the plan)")
    from hyperrec.testing import write_result

    t_start = time.perf_counter()
    workers = args.workers or max(1, min(len(jobs), (os.cpu_count() or 4) - 2))
    builds = run_builds(jobs, workers)
    print(f"phase 1 builds: {len(jobs)} in {time.perf_counter() - t_start:.0f}s", flush=True)
    for b in builds:
        if "error" in b or "ws_build_error" in b:
            print(f"  {b['variant']} / {b['case']}: {b.get('error') or b['ws_build_error']}"[:300])
    ceiling = matmul_ceiling()
    rows: list[dict] = []
    payload: dict = {
        "benchmark": "jagged attention forward variants, bf16, useful FLOPs (fwd+bwd = 3.5x)",
        "bf16_matmul_ceiling_tflops": ceiling,
        "variants": {n: variant_overrides(n) for n in names},
        "builds": builds,
        "cases": rows,
    }

    def save():
        payload["elapsed_s"] = time.perf_counter() - t_start
        write_result(args.out, payload)

    verdicts = build_verdicts(builds, cases)
    refs: dict[str, tuple] = {}  # case -> the default kernel's (out, lse)

    def measure(case: Case, row: dict, variant_names: list[str]) -> None:
        """Check and time ``variant_names`` on ``case``: ``--rounds`` interleaved rounds,
        best kept (identical kernels were seen to differ by up to ~10% between two
        back-to-back timings), then once from a CUDA graph (no launcher overhead)."""
        inputs = make_inputs(case)
        base = base_config(case)
        flops = row["flops_fwd"]
        timed: dict[str, KernelConfig] = {}
        for name in variant_names:
            build = verdicts.get((name, case.name))
            cfg = variant_config(name, base)
            r: dict = {}  # the config: the row's base_config with variants[name] applied
            row["fwd"][name] = r
            if build is None or "error" in build:
                r["error"] = "build failed: " + (build or {}).get("error", "no build")
            elif "ws_build_error" in build:
                r["error"] = "warp specialisation did not build: " + build["ws_build_error"]
            else:
                try:
                    res, got = check_variant(case, cfg, inputs, refs.get(case.name))
                    r.update(res)
                    if name == "default":
                        refs[case.name] = got
                    r["fwd_ms_rounds"] = [bench_ms(fwd_fn(case, cfg, inputs))]
                    timed[name] = cfg
                except Exception as e:  # recorded, not fatal
                    r["error"] = f"{type(e).__name__}: {e}"[:600]
                    if args.verbose:
                        traceback.print_exc()
        for _ in range(args.rounds - 1):
            for name, cfg in timed.items():
                row["fwd"][name]["fwd_ms_rounds"].append(bench_ms(fwd_fn(case, cfg, inputs)))
        for name, cfg in timed.items():
            r = row["fwd"][name]
            r["fwd_ms"] = min(r["fwd_ms_rounds"])
            r["fwd_tflops"] = flops / r["fwd_ms"] * 1e-9
            if not args.no_graph:
                try:
                    r["fwd_ms_graph"] = graph_ms(fwd_fn(case, cfg, inputs))
                    r["fwd_tflops_graph"] = flops / r["fwd_ms_graph"] * 1e-9
                except Exception as e:  # recorded, not fatal
                    r["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        d = row["fwd"].get("default", {})
        for name in variant_names:
            r = row["fwd"][name]
            for key in ("fwd_tflops", "fwd_tflops_graph"):
                if key in r and key in d:
                    r[key.replace("fwd_tflops", "speedup")] = r[key] / d[key]
            r["ok"] = check_ok(r, verdicts.get((name, case.name)),
                               verdicts.get(("default", case.name)))  # fmt: skip
            nan = float("nan")
            print(f"  {case.name:28s} {name:32s} {r.get('fwd_tflops', nan):6.1f} TFLOP/s "
                  f"x{r.get('speedup', nan):.3f} (graph {r.get('fwd_tflops_graph', nan):6.1f} "
                  f"x{r.get('speedup_graph', nan):.3f}) ok={r['ok']}"
                  + (f"  {r['error'][:150]}" if "error" in r else ""), flush=True)  # fmt: skip
        del inputs
        torch.cuda.empty_cache()

    for case in cases:
        lens = lengths(case.dist, case.batch, case.max_len)
        row = {**asdict(case), "tokens": int(lens.sum()),
               "flops_fwd": useful_flops(lens, case.heads, case.head_dim, case.causal),
               "base_config": asdict(base_config(case)), "fwd": {}}  # fmt: skip
        rows.append(row)
        measure(case, row, names)
        save()

    def scores(variant_names: list[str], key: str = "speedup") -> dict[str, float | None]:
        """Geometric-mean forward speedup over the default on the target cases (variants
        trusted on every target case that ran)."""
        target = [r for r in rows if r["name"] in TARGET_CASES]
        out = {}
        for n in variant_names:
            sp = [r["fwd"].get(n, {}).get(key) for r in target if r["fwd"].get(n, {}).get("ok")]
            if target and len(sp) == len(target):
                out[n] = geomean(sp)
        return out

    # Phase 2: the two best flag sets on every tile shape (a flag can change what a tile
    # costs: descriptors free the registers that pointer loads hold, for instance).
    combos: list[str] = []
    s1 = scores(names)
    flag_scores = {n: v for n, v in s1.items() if n in FLAG_SETS and n != "default" and v}
    if not args.no_combine and flag_scores:
        best_flags = sorted(flag_scores, key=flag_scores.get, reverse=True)[:2]
        tiles = [tile_name(t) for t in TILES]
        if args.quick:
            tiles = [n for n in names if n.startswith("tile-")]
        combos = [f"{t}+{f}" for f in best_flags for t in tiles]
        t0 = time.perf_counter()
        jobs2 = build_jobs(combos, cases)
        builds2 = run_builds(jobs2, max(1, min(len(jobs2), workers)))
        builds.extend(builds2)
        verdicts.update(build_verdicts(builds2, cases))
        print(f"phase 2 builds {combos}: {len(jobs2)} in {time.perf_counter() - t0:.0f}s")
        payload["variants"].update({n: variant_overrides(n) for n in combos})
        for case, row in zip(cases, rows):
            measure(case, row, combos)
            save()
    refs.clear()

    # fwd+bwd: the default and each case's best trusted forward variant.
    for case, row in zip(cases, rows):
        trusted = {n: r["fwd_tflops"] for n, r in row["fwd"].items()
                   if r.get("ok") and "fwd_tflops" in r}  # fmt: skip
        best = max(trusted, key=trusted.get) if trusted else None
        row["best_fwd"] = best
        row["fwd_bwd"] = {}
        inputs = make_inputs(case)
        for name in dict.fromkeys(["default", best]):
            if name is None:
                continue
            try:
                cfg = variant_config(name, base_config(case))
                row["fwd_bwd"][name] = time_fwd_bwd(case, cfg, inputs)
            except Exception as e:
                row["fwd_bwd"][name] = {"error": f"{type(e).__name__}: {e}"[:600]}
        if args.hstu and case.kind == "gdpa_silu":
            row["hstu"] = time_hstu(case, inputs, args.hstu)
        del inputs
        torch.cuda.empty_cache()
        save()
        best_tf = row["fwd"].get(best, {}).get("fwd_tflops", 0.0) if best else 0.0
        print(
            f"{case.name}: best fwd {best} {best_tf:.0f} TFLOP/s; fwd+bwd "
            f"{json.dumps(row['fwd_bwd'])}",
            flush=True,
        )

    payload["summary"] = {
        "geomean_speedup_target_cases": scores(names + combos),
        "geomean_speedup_target_cases_graph": scores(names + combos, "speedup_graph"),
        "best_fwd_per_case": {
            r["name"]: {"variant": r["best_fwd"],
                        "fwd_tflops": r["fwd"].get(r["best_fwd"] or "", {}).get("fwd_tflops"),
                        "default_tflops": r["fwd"].get("default", {}).get("fwd_tflops")}
            for r in rows
        },
        "combos": combos,
    }  # fmt: skip
    save()
    print(json.dumps(payload["summary"], indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f}s")


def time_hstu(case: Case, inputs, path: str) -> dict:
    from bench_attention import impl_hstu, load_hstu

    lens, off, q, k, v, do = inputs
    try:
        h = load_hstu(path)
        fwd, _, _ = impl_hstu(case, q, k, v, do, off.long(), lens, h)
        fwd()
        torch.cuda.synchronize()
        ms = bench_ms(fwd)
        flops = useful_flops(lens, case.heads, case.head_dim, case.causal)
        return {"fwd_ms": ms, "fwd_tflops": flops / ms * 1e-9}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600]}


if __name__ == "__main__":
    main()
