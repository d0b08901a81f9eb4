"""One-process GPU sweep of the quantizer and the fast (128-block, cuBLAS) path.

Sections, all in the same run (results written to ``--out`` after each one):

* ``ceilings``: device copy bandwidth of the same bytes each quantize shape moves.
* ``quantize``: every quantizer variant (row; row+col with 32- and 128-blocks; + RHT16;
  + stochastic rounding; + fused GELU) on BF16 ``16384 x 4096`` and ``8192 x 16384``:
  the public call (eager and replayed from a CUDA graph) and each launch config
  (graph-replayed, device time only), as GB/s (bytes read + written) and % of the copy
  ceiling. Every config's bytes are compared with the default output, and the default
  output of the first 256 rows with the PyTorch reference.
* ``gemm``: the fast-path ``mx_mm`` wrapper against a direct ``F.scaled_mm`` (cuBLAS
  1x128 block scaling) on the same quantized operands, at 4096^3 and 8192^3, eager and
  graphed, plus the wrapper with E8M0-only operands (scales converted per call).
* ``linear``: ``MXLinear`` (``PrecisionPolicy(block_size=128)``) forward + backward
  against BF16 ``nn.Linear`` at 16,384 tokens, hidden 4096 and 8192, eager and graphed,
  with a per-part breakdown.
* ``host``: host microseconds and device kernels per call at small shapes.

Each measurement catches and records its own exception, and a time budget
(``--budget-s``) skips what is left once spent, so a run always ends with a JSON file.

Usage: ``python sweep_quantize.py --out results/sweep.json [--quick] [--budget-s 220]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback
from pathlib import Path

import torch

from hyperrec.mxfp8._triton._configs import (
    device_arch,
    quantize_candidates,
    select_quantize_config,
)

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((16384, 4096), (8192, 16384))
#: Launch configs tried besides the built-in candidates: (BLOCK_M, BLOCK_K, num_warps).
EXTRA_CONFIGS = ((32, 64, 1), (64, 64, 2), (64, 128, 2), (128, 64, 4), (128, 256, 16))
VARIANTS = {
    "row+col e4m3 bs32": {"colwise": True, "block_size": 32},
    "row+col e4m3 bs128": {"colwise": True, "block_size": 128},
    "row e4m3 bs32": {"rowwise": True, "block_size": 32},
    "row+col bs32 +RHT16": {"colwise": True, "block_size": 32, "hadamard": 16},
    "row+col bs32 +SR": {"colwise": True, "block_size": 32, "stochastic_rounding": True},
    "row+col bs32 +gelu": {"colwise": True, "block_size": 32, "activation": "gelu_tanh"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    ap.add_argument("--quick", action="store_true", help="first shape, built-in configs only")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop starting new work after")
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["quantize", "gemm", "linear", "host"],
        help="sections to skip",
    )
    ap.add_argument("--variants", nargs="*", default=None, help="quantize variants to run")
    args = ap.parse_args(argv)
    if args.variants is not None:
        unknown = set(args.variants) - set(VARIANTS)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    return args


class Run:
    """Budget, error capture and incremental JSON output."""

    def __init__(self, out: Path, budget_s: float, payload: dict) -> None:
        self.out, self.budget_s, self.payload = out, budget_s, payload
        self.t0 = time.time()

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def attempt(self, row: dict, key: str, fn):
        """``row[key] = fn()``; on failure ``row[key + ' error']`` holds the exception."""
        if self.left() <= 0:
            row[key + " skipped"] = "time budget spent"
            return None
        try:
            val = fn()
        except Exception as e:  # recorded, never fatal
            row[key + " error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row[key + " trace"] = traceback.format_exc(limit=3)[-600:]
            torch.cuda.synchronize()
            return None
        row[key] = val
        return val

    def save(self, section: str, rows) -> None:
        from hyperrec.testing import write_result

        self.payload[section] = rows
        self.payload["wall_s"] = round(time.time() - self.t0, 1)
        write_result(self.out, self.payload)


# --------------------------------------------------------------------------- timing
def bench_ms(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return round(
        do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median"), 4
    )


def graph_ms(fn, reps: int = 10, before_capture=None) -> float:
    """Device ms per ``fn()`` call: ``reps`` calls captured in one CUDA graph, replayed."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, tune, workspaces) off the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    ms = do_bench(graph.replay, warmup=5, rep=50, return_mode="median") / reps
    del graph
    return round(ms, 4)


def host_us(fn, n: int = 200) -> float:
    """Host microseconds per call (the device keeps up at these small shapes)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 1)


def kernels_per_call(fn) -> dict:
    """Device kernels and CPU-side aten ops in one ``fn()`` call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    dev = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    aten = [e for e in events if e.name.startswith("aten::") and e.device_type.name == "CPU"]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {
        "device kernels": len(dev),
        "aten ops (top level)": len(top),
        "aten ops (all)": len(aten),
        "kernel names": sorted({e.name[:60] for e in dev}),
    }


def _bytes_of(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _outputs(row, col) -> list[torch.Tensor]:
    """The public call's output tensors: per copy data, E8M0 scale, FP32 scale (if any)."""
    outs = []
    for q in (row, col):
        if q is not None:
            outs += [q.data, q.scale] + ([q.scale_fp32] if q.scale_fp32 is not None else [])
    return outs


def _launch_outputs(outs, rowwise: bool, colwise: bool, fp32: bool) -> list[torch.Tensor]:
    """``launch_quantize_2d``'s tuple in the order of :func:`_outputs`."""
    got = []
    if rowwise:
        got += [outs[0], outs[1]] + ([outs[4]] if fp32 else [])
    if colwise:
        got += [outs[2], outs[3]] + ([outs[5]] if fp32 else [])
    return got


# --------------------------------------------------------------------------- sections
def ceiling_section(run: Run, shapes) -> dict:
    """GB/s (read + write) of a device copy moving as many bytes as the row+col bs32
    quantizer does on each shape (the per-shape ceiling)."""
    return {f"{m}x{k}": _ceiling_one(run, 2 * m * k + 2 * (m * k + m * k // 32)) for m, k in shapes}


def _ceiling_one(run: Run, moved: int) -> dict:
    n = moved // 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    row: dict = {"bytes moved": 2 * n}
    run.attempt(row, "eager ms", lambda: bench_ms(lambda: dst.copy_(src)))
    run.attempt(row, "graph ms", lambda: graph_ms(lambda: dst.copy_(src)))
    ms = row.get("graph ms") or row.get("eager ms")
    if ms:
        row["GBps"] = round(2 * n / ms / 1e6, 1)
    return row


def quantize_section(run: Run, shapes, variants, ceilings, quick: bool) -> list[dict]:
    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ceil = ceilings.get(f"{m}x{k}", {}).get("GBps")
        rows += [_quantize_variant(run, x, name, ceil, quick) for name in variants]
        del x
        torch.cuda.empty_cache()
    return rows


def _quantize_variant(run: Run, x: torch.Tensor, name: str, ceil, quick: bool) -> dict:
    from hyperrec.mxfp8 import mx_quantize
    from hyperrec.mxfp8 import reference as ref

    m, k = x.shape
    kw = dict(VARIANTS[name])
    if kw.get("stochastic_rounding"):
        kw["seed"] = torch.tensor([7], device="cuda", dtype=torch.int64)
    row: dict = {"shape": [m, k], "variant": name}

    def public():
        return mx_quantize(x, **kw)

    ref_out = run.attempt(row, "default output", lambda: _outputs(*public()))
    if ref_out is None:
        return row
    row.pop("default output")
    moved = 2 * m * k + _bytes_of(*ref_out)
    row["bytes moved"] = moved
    row["table config"] = _table_config(x, kw)
    run.attempt(row, "reference check", lambda: _reference_check(x, kw, ref_out, ref))
    for mode, timer in (("eager", bench_ms), ("graph", graph_ms)):
        ms = run.attempt(row, f"public {mode} ms", lambda timer=timer: timer(public))
        if ms:
            row[f"public {mode} GBps"] = round(moved / ms / 1e6, 1)
            if ceil:
                row[f"public {mode} % of copy"] = round(100 * moved / ms / 1e6 / ceil, 1)
    bs, had = kw.get("block_size", 32), kw.get("hadamard", 0)
    rowwise, colwise = kw.get("rowwise", True), kw.get("colwise", False)
    configs = quantize_candidates(bs, had, rowwise=rowwise, colwise=colwise)
    if not quick:
        bm_min, bk_min = max(bs if colwise else 1, had, 16), max(bs if rowwise else 1, 32)
        configs += [
            c for c in EXTRA_CONFIGS if c not in configs and c[0] >= bm_min and c[1] >= bk_min
        ]
    fp32 = any(t.dtype == torch.float32 for t in ref_out)
    per_cfg = []
    for cfg in configs:
        cres: dict = {"config": list(cfg)}
        per_cfg.append(cres)
        launch = _config_launcher(x, kw, cfg, fp32)

        def exact(launch=launch):
            got = _launch_outputs(launch(), rowwise, colwise, fp32)
            return len(got) == len(ref_out) and all(map(_same, got, ref_out))

        if run.attempt(cres, "bit-exact vs default", exact) is None:
            continue
        ms = run.attempt(cres, "graph ms", lambda launch=launch: graph_ms(launch))
        if ms:
            cres["GBps"] = round(moved / ms / 1e6, 1)
            if ceil:
                cres["% of copy"] = round(100 * moved / ms / 1e6 / ceil, 1)
    row["configs"] = per_cfg
    good = [c for c in per_cfg if c.get("GBps") and c.get("bit-exact vs default")]
    if good:
        best = max(good, key=lambda c: c["GBps"])
        row["best config"] = best["config"]
        row["best % of copy"] = best.get("% of copy")
    row["all configs bit-exact"] = all(
        c.get("bit-exact vs default") for c in per_cfg if "bit-exact vs default" in c
    )
    return row


def _table_config(x: torch.Tensor, kw: dict) -> dict:
    """The tile the public call takes from the committed table, and its evidence."""
    cfg = select_quantize_config(
        arch=device_arch(x.device),
        block_size=kw.get("block_size", 32),
        hadamard=kw.get("hadamard", 0),
        rowwise=kw.get("rowwise", True),
        colwise=kw.get("colwise", False),
        m=x.shape[0],
        k=x.shape[1],
    )
    return {"config": list(cfg.tile), "source": cfg.source}


def _config_launcher(x: torch.Tensor, kw: dict, cfg: tuple, fp32: bool):
    from hyperrec.mxfp8._triton import quantize as qk
    from hyperrec.mxfp8.formats import E4M3

    def launch():
        return qk.launch_quantize_2d(
            x,
            fmt=E4M3,
            block_size=kw.get("block_size", 32),
            rceil=True,
            rowwise=kw.get("rowwise", True),
            colwise=kw.get("colwise", False),
            act=kw.get("activation", "none"),
            hadamard=kw.get("hadamard", 0),
            seed=kw.get("seed"),
            config=cfg,
            scale_fp32=fp32,
        )

    return launch


def _reference_check(x, kw, got, ref) -> dict:
    """The default output's first 256 rows (whole column blocks) against the PyTorch
    reference on the CPU: fractions of differing element bytes and scale bytes (0 means
    bit-exact; the tanh of GELU and the tensor-core sums of the Hadamard transform may
    move rare elements by one code)."""
    from hyperrec.mxfp8.formats import E4M3

    rows, bs = 256, kw.get("block_size", 32)
    seed = kw.get("seed")
    want = ref.quantize_2d(
        x[:rows].cpu(),
        fmt=E4M3,
        block_size=bs,
        scale_mode="rceil",
        rowwise=kw.get("rowwise", True),
        colwise=kw.get("colwise", False),
        activation=kw.get("activation", "none"),
        hadamard=kw.get("hadamard", 0),
        seed=None if seed is None else int(seed.item()),
    )
    fp32 = any(t.dtype == torch.float32 for t in got)
    it = iter(got)
    res = {}
    for name, wd, ws in (("row", want[0], want[1]), ("col", want[2], want[3])):
        if wd is None:
            continue
        gd, gs = next(it), next(it)
        gf = next(it) if fp32 else None
        cut = rows if name == "row" else rows // bs
        gd, gs = gd[:rows].cpu(), gs[:cut].cpu()
        diff = gd.contiguous().view(torch.uint8) != wd.contiguous().view(torch.uint8)
        res[f"{name} element bytes differing"] = round(diff.float().mean().item(), 6)
        res[f"{name} scale bytes differing"] = round((gs != ws).float().mean().item(), 6)
        if gf is not None:
            dec = ref.e8m0_to_fp32(ws)
            res[f"{name} FP32 scales exact"] = _same(gf[:cut].cpu(), dec) or bool(
                torch.equal(gf[:cut].cpu().view(torch.int32), dec.view(torch.int32))
            )
    return res


def gemm_section(run: Run, sizes) -> list[dict]:
    rows = []
    for n in sizes:
        rows.append(_gemm_one(run, n))
        torch.cuda.empty_cache()
    return rows


def _gemm_one(run: Run, n: int) -> dict:
    import torch.nn.functional as F

    from hyperrec.mxfp8 import mx_mm, mx_quantize

    row: dict = {"M=K=N": n}
    flop = 2 * n**3
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a, _ = mx_quantize(x, block_size=128)
    b = mx_quantize(w, block_size=128)[0].t()
    row["operands carry FP32 scales"] = a.scale_fp32 is not None and b.scale_fp32 is not None
    a8 = dataclasses.replace(a, scale_fp32=None)
    b8 = dataclasses.replace(b, scale_fp32=None)
    calls = {
        "ours": lambda: mx_mm(a, b),
        "ours E8M0-only": lambda: mx_mm(a8, b8),
    }
    scaling = getattr(F, "ScalingType", None)
    if scaling is not None and a.scale_fp32 is not None:
        errors = []
        for sb in (b.scale_fp32.t(), b.scale_fp32):

            def direct(sb=sb):
                return F.scaled_mm(
                    a.data,
                    b.data,
                    a.scale_fp32,
                    scaling.BlockWise1x128,
                    sb,
                    scaling.BlockWise1x128,
                    output_dtype=torch.bfloat16,
                )

            try:
                direct()
            except Exception as e:
                errors.append(str(e).splitlines()[0][:160])
                continue
            calls["direct"] = direct
            row["direct B-scale shape"] = list(sb.shape)
            break
        if errors:
            row["direct layout errors"] = errors
    if "direct" in calls:
        run.attempt(
            row, "ours == direct (bitwise)", lambda: torch.equal(calls["ours"](), calls["direct"]())
        )
    for label, fn in calls.items():
        for mode, timer in (("eager", bench_ms), ("graph", graph_ms)):
            ms = run.attempt(row, f"{label} {mode} ms", lambda fn=fn, timer=timer: timer(fn))
            if ms:
                row[f"{label} {mode} TFLOPs"] = round(flop / ms / 1e9, 1)
    if row.get("ours eager ms") and row.get("direct eager ms"):
        row["wrapper overhead eager ms"] = round(row["ours eager ms"] - row["direct eager ms"], 4)
    return row


def _linear_parts(x, weight, bias, g, bs):
    from hyperrec.mxfp8 import mx_mm, mx_quantize

    xd, wd = x.detach(), weight.detach()
    xr, xc = mx_quantize(xd, block_size=bs, colwise=True)
    wr, wc = mx_quantize(wd, block_size=bs, colwise=True)
    gr, gc = mx_quantize(g, block_size=bs, colwise=True)
    bd = None if bias is None else bias.detach()
    return {
        "quantize x (row+col)": lambda: mx_quantize(xd, block_size=bs, colwise=True),
        "quantize W (row+col)": lambda: mx_quantize(wd, block_size=bs, colwise=True),
        "quantize dY (row+col)": lambda: mx_quantize(g, block_size=bs, colwise=True),
        "GEMM fwd (+bias)": lambda: mx_mm(xr, wr.t(), bias=bd),
        "GEMM dgrad": lambda: mx_mm(gr, wc),
        "GEMM wgrad": lambda: mx_mm(gc.t(), xc),
    }


def linear_section(run: Run, tokens: int, hiddens) -> list[dict]:
    rows = []
    for h in hiddens:
        rows.append(_linear_one(run, tokens, h))
        torch.cuda.empty_cache()
    return rows


def _linear_one(run: Run, tokens: int, h: int) -> dict:
    from hyperrec.mxfp8 import MXLinear, PrecisionPolicy

    row: dict = {"tokens": tokens, "in": h, "out": h}
    ref = torch.nn.Linear(h, h, device="cuda", dtype=torch.bfloat16)
    mx = MXLinear.from_linear(ref, PrecisionPolicy(block_size=128))
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    params = [x, ref.weight, ref.bias]

    def no_grads():
        for p in params:
            p.grad = None

    for label, mod in (("bf16 nn.Linear", ref), ("MXLinear fast bs128", mx)):

        def step(mod=mod):
            mod(x).backward(g)

        run.attempt(row, f"{label} eager ms", lambda step=step: bench_ms(step, params))
        run.attempt(
            row,
            f"{label} graph ms",
            lambda step=step: graph_ms(step, reps=1, before_capture=no_grads),
        )
        no_grads()
    for mode in ("eager", "graph"):
        base = row.get(f"bf16 nn.Linear {mode} ms")
        ours = row.get(f"MXLinear fast bs128 {mode} ms")
        if base and ours:
            row[f"{mode} x bf16"] = round(base / ours, 3)
    parts = _linear_parts(x, ref.weight, ref.bias, g, 128)
    for mode, timer in (("eager", bench_ms), ("graph", graph_ms)):
        br: dict = {}
        for name, fn in parts.items():
            run.attempt(br, name, lambda fn=fn, timer=timer: timer(fn))
        ms = [v for v in br.values() if isinstance(v, float)]
        if len(ms) == len(parts):
            br["sum"] = round(sum(ms), 4)
        row[f"breakdown {mode} ms"] = br
    return row


def host_section(run: Run) -> dict:
    """Small shapes: the host cost of each public call and its device kernels."""
    from hyperrec.mxfp8 import MXLinear, PrecisionPolicy, mx_mm, mx_quantize

    res: dict = {}
    n = 512
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a, _ = mx_quantize(x, block_size=128)
    b = mx_quantize(x, block_size=128)[0].t()
    lin = MXLinear(
        n, n, policy=PrecisionPolicy(block_size=128), device="cuda", dtype=torch.bfloat16
    )
    ref = torch.nn.Linear(n, n, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    g = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    calls = {
        "mx_quantize row+col bs128": lambda: mx_quantize(x, block_size=128, colwise=True),
        "mx_mm fast bs128": lambda: mx_mm(a, b),
        "MXLinear fwd+bwd bs128": lambda: lin(xg).backward(g),
        "peer: x.to(float8_e4m3fn)": lambda: x.to(torch.float8_e4m3fn),
        "peer: torch.mm bf16": lambda: x @ x,
        "peer: nn.Linear fwd+bwd bf16": lambda: ref(xg).backward(g),
    }
    for name, fn in calls.items():
        row: dict = {}
        run.attempt(row, "host us", lambda fn=fn: host_us(fn))
        run.attempt(row, "per call", lambda fn=fn: kernels_per_call(fn))
        res[name] = row
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this sweep needs a CUDA GPU")
    torch.manual_seed(0)
    out = args.out or RESULTS / f"sweep_{time.strftime('%Y-%m-%d')}.json"
    shapes = SHAPES[:1] if args.quick else SHAPES
    variants = args.variants or list(VARIANTS)
    payload = {
        "benchmark": "mxfp8 quantizer / fast-path sweep",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    run = Run(out, args.budget_s, payload)
    ceilings = ceiling_section(run, shapes)
    run.save("ceilings", ceilings)
    # The short sections first: the config sweep takes what the budget leaves.
    if "gemm" not in args.skip:
        run.save("gemm", gemm_section(run, (4096, 8192)))
    if "linear" not in args.skip:
        run.save("linear", linear_section(run, 16384, (4096, 8192)))
    if "host" not in args.skip:
        run.save("host", host_section(run))
    if "quantize" not in args.skip:
        run.save("quantize", quantize_section(run, shapes, variants, ceilings, args.quick))
    from hyperrec.mxfp8 import _cublas

    payload["cublas state"] = {k: str(v) for k, v in _cublas._STATE.items()}
    run.save("wall_s", round(time.time() - run.t0, 1))
    print(f"wrote {out} in {payload['wall_s']} s")
    _print_summary(payload)


def _print_summary(payload: dict) -> None:
    for r in payload.get("quantize", []):
        keys = ("public graph % of copy", "best config", "best % of copy", "all configs bit-exact")
        print(r["shape"], r["variant"], {k: r.get(k) for k in keys}, r.get("reference check"))
    for r in payload.get("gemm", []):
        print({k: v for k, v in r.items() if "ms" in k or "==" in k})
    for r in payload.get("linear", []):
        print({k: v for k, v in r.items() if not k.startswith("breakdown")})
    for name, r in payload.get("host", {}).items():
        per = r.get("per call", {})
        print(name, r.get("host us"), per.get("device kernels"), per.get("aten ops (top level)"))


if __name__ == "__main__":
    main()
