"""H200 benchmark of hyperrec.mxfp8 against the strongest peers on the same card.

Sections (each in the same run, same process):

* ceilings: device-to-device copy (GB/s, read + write), bf16 ``torch.mm`` and FP8
  ``torch._scaled_mm`` at 8192^3;
* quantize: the fused MX quantizer's GB/s (bytes read + written) vs the copy ceiling,
  and an eager PyTorch row-wise FP8 cast as a peer;
* gemm: TFLOP/s of bf16 ``torch.mm``, ``torch._scaled_mm`` tensorwise and rowwise,
  cuBLAS 1x128 block scaling (where this torch exposes it), and ours: exact MX
  (32-wide scales), fast (128-wide scales) and ``tl.dot_scaled``;
* linear: ``MXLinear`` forward + backward vs bf16 ``nn.Linear``, with a time breakdown;
* dequantize: ``MXTensor.dequantize`` to bf16, the Triton pass vs the reference and a
  two-pass bf16 PyTorch peer, GB/s vs the copy ceiling;
* accuracy: GEMM SQNR vs dequantize-then-FP32 matmul on the GPU.

Usage: ``python bench_mxfp8.py [--quick] [--explore] [--out PATH]``. Prints tables and
writes JSON via ``hyperrec.testing.write_result``. ``--explore`` also times every
candidate tile of the Triton GEMMs per shape (the data behind ``_triton/_configs.py``'s
``MM_TABLE``) and records the quantizer tiles the table gives.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from hyperrec.mxfp8 import MXMLP, MXLinear, PrecisionPolicy, mx_mm, mx_quantize, to_mx
from hyperrec.mxfp8._triton import mm as mm_kernels
from hyperrec.testing import snr_db, write_result

RESULTS = Path(__file__).resolve().parent / "results"
DEV = "cuda"


def bench_ms(fn, grad_to_none=None) -> float:
    """Median ms over ~100 ms of repeats; Triton's do_bench flushes L2 between runs."""
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


# --------------------------------------------------------------------------- ceilings
def ceilings() -> dict:
    x = torch.empty(2**29, dtype=torch.bfloat16, device=DEV).normal_()  # 1 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return {"copy_GBps": round(2 * x.numel() * 2 / ms / 1e6, 1)}


# --------------------------------------------------------------------------- quantize
def quantize_section(m: int, k: int, explore: bool) -> list[dict]:
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    seed = torch.tensor([7], device=DEV, dtype=torch.int64)
    rows = []

    def record(name, fn, n_copies, block_size=32, extra=None):
        ms = bench_ms(fn)
        written = n_copies * (m * k + m * k // block_size)
        gbps = (2 * m * k + written) / ms / 1e6
        rows.append({"variant": name, "ms": round(ms, 4), "GBps": round(gbps, 1), **(extra or {})})

    variants = [
        ("row e4m3 bs32", {"rowwise": True}, 1, 32),
        ("row+col e4m3 bs32", {"rowwise": True, "colwise": True}, 2, 32),
        ("row+col e4m3 bs128", {"rowwise": True, "colwise": True, "block_size": 128}, 2, 128),
        ("row+col + RHT16", {"rowwise": True, "colwise": True, "hadamard": 16}, 2, 32),
        (
            "row+col + SR",
            {"rowwise": True, "colwise": True, "stochastic_rounding": True, "seed": seed},
            2,
            32,
        ),
        ("row+col + gelu", {"rowwise": True, "colwise": True, "activation": "gelu_tanh"}, 2, 32),
    ]
    for name, kw, n_copies, bs in variants:
        record(name, lambda kw=kw: mx_quantize(x, **kw), n_copies, bs)

    def torch_rowwise():  # eager per-row FP8 cast: the usual float8 training peer
        s = 448.0 / x.abs().amax(1, keepdim=True).float().clamp_min(1e-12)
        return (x * s).to(torch.float8_e4m3fn), s

    ms = bench_ms(torch_rowwise)
    rows.append(
        {
            "variant": "peer: torch eager rowwise fp8 cast",
            "ms": round(ms, 4),
            "GBps": round((2 * m * k + m * k) / ms / 1e6, 1),
        }
    )
    if explore:
        # The tiles the committed table gives these calls (bench/sweep_quantize.py times
        # every candidate to regenerate it).
        from hyperrec.mxfp8._triton._configs import device_arch, select_quantize_config

        for bs, colwise in ((32, True), (128, True), (32, False), (128, False)):
            cfg = select_quantize_config(
                arch=device_arch(DEV),
                block_size=bs,
                hadamard=0,
                rowwise=True,
                colwise=colwise,
                m=m,
                k=k,
            )
            rows.append(
                {
                    "variant": f"table config bs{bs} {'row+col' if colwise else 'row'}",
                    "config": list(cfg.tile),
                    "source": cfg.source,
                }
            )
    return rows


# --------------------------------------------------------------------------- gemm
# --------------------------------------------------------------------------- dequantize
def dequantize_section(m: int, k: int) -> list[dict]:
    """``MXTensor.dequantize`` to bf16: the one-pass Triton kernel vs the reference (four
    passes through FP32) and the two-pass bf16 PyTorch path autoac used before; GB/s of
    bytes read (elements + scales) + written, 3 freshly quantized inputs each."""
    rows = []
    for elem, block in ((torch.float8_e4m3fn, 32), (torch.float8_e4m3fn, 128)):
        per: dict[str, list[float]] = {"triton": [], "torch": [], "two_pass_bf16": []}
        for seed in range(3):
            torch.manual_seed(seed)
            q = to_mx(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), elem_dtype=elem,
                      block_size=block)  # fmt: skip
            s = torch.exp2(q.scale.float() - 127.0).to(torch.bfloat16)

            def two_pass(q=q, s=s, block=block) -> torch.Tensor:
                d = q.data.to(torch.bfloat16).view(m, k // block, block)
                return (d * s.reshape(m, k // block, 1)).view(m, k)

            per["triton"].append(
                bench_ms(lambda q=q: q.dequantize(torch.bfloat16, backend="triton"))
            )
            per["torch"].append(bench_ms(lambda q=q: q.dequantize(torch.bfloat16, backend="torch")))
            per["two_pass_bf16"].append(bench_ms(two_pass))
        moved = m * k * (1 + 1 / block + 2)
        for name, times in per.items():
            med = sorted(times)[1]
            rows.append({"elem": str(elem).split(".")[-1], "block": block, "shape": [m, k],
                         "impl": name, "ms_median": round(med, 4), "ms_min": round(min(times), 4),
                         "GBps": round(moved / med / 1e6, 1)})  # fmt: skip
    return rows


def _blockwise_peer(xq, wq, m, k, n):
    """cuBLAS DeepSeek-style block scaling (1x128 activations, 1x128 weights) through
    ``F.scaled_mm`` where this torch exposes it; tries the documented scale layouts."""
    st = getattr(F, "ScalingType", None)
    if st is None or not hasattr(F, "scaled_mm"):
        raise RuntimeError("torch.nn.functional.scaled_mm with ScalingType is not available")
    sx = torch.ones(k // 128, m, device=DEV).t()
    errors = []
    for sw in (torch.ones(k // 128, n, device=DEV).t(), torch.ones(k // 128, n, device=DEV)):

        def fn(sw=sw):
            return F.scaled_mm(
                xq,
                wq.t(),
                sx,
                st.BlockWise1x128,
                sw,
                st.BlockWise1x128,
                output_dtype=torch.bfloat16,
            )

        try:
            fn()
            torch.cuda.synchronize()
            return fn
        except Exception as e:
            errors.append(str(e).splitlines()[0][:120])
    raise RuntimeError("; ".join(errors))


def _gemm_one(m: int, k: int, n: int, explore: bool, dot_scaled: bool) -> dict:
    flop = 2 * m * n * k
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    res: dict = {"M": m, "K": k, "N": n}
    res["bf16 torch.mm"] = bench_ms(lambda: torch.mm(x, w.t()))
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    sa, sb = torch.ones(m, 1, device=DEV), torch.ones(1, n, device=DEV)
    bf16_out = torch.bfloat16
    res["_scaled_mm tensorwise"] = bench_ms(
        lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=bf16_out)
    )
    res["_scaled_mm tensorwise fast_accum"] = bench_ms(
        lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=bf16_out, use_fast_accum=True)
    )
    res["_scaled_mm rowwise"] = bench_ms(
        lambda: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=bf16_out)
    )
    try:
        res["cuBLAS blockwise 1x128 (F.scaled_mm)"] = bench_ms(_blockwise_peer(xq, wq, m, k, n))
    except Exception as e:
        res["cuBLAS blockwise error"] = str(e)[:300]
    ours = [
        ("ours exact MX (bs32 fixup)", 32, "fixup"),
        ("ours exact MX (bs32 upcast)", 32, "upcast"),
        ("ours fast (bs128 fixup)", 128, "fixup"),
        ("ours fast (bs128 cublas)", 128, "cublas"),
    ]
    if dot_scaled:
        ours.append(("ours tl.dot_scaled (bs32)", 32, "dot_scaled"))
    for name, bs, kernel in ours:
        a, b = to_mx(x, block_size=bs), to_mx(w, block_size=bs).t()
        try:
            res[name] = bench_ms(lambda a=a, b=b, kernel=kernel: mx_mm(a, b, kernel=kernel))
        except Exception as e:
            res[name + " error"] = str(e)[:300]
            continue
        if explore and kernel != "cublas":
            timed = _sweep_mm_candidates(a, b, kernel, bs)
            res[name + " candidates ms"] = timed
            ok = {key: v for key, v in timed.items() if isinstance(v, float)}
            if ok:
                res[name + " best_config"] = min(ok, key=ok.get)
    out: dict = {}
    for key, v in res.items():
        if isinstance(v, float):
            out[key + " ms"] = round(v, 4)
            out[key + " TFLOPs"] = round(flop / v / 1e9, 1)
        else:
            out[key] = v
    for key in [name for name, _, _ in ours]:
        if key in res:
            out[key + " x bf16"] = round(res["bf16 torch.mm"] / res[key], 3)
    return out


def _sweep_mm_candidates(a, b, kernel: str, bs: int) -> dict:
    """Every candidate tile of the Triton GEMM timed with an explicit config: the data
    from which ``_triton/_configs.py``'s ``MM_TABLE`` entries are copied (fastest wins)."""
    from hyperrec.mxfp8._triton._configs import mm_candidates

    out = {}
    for cfg in mm_candidates(kernel, bs):
        key = ", ".join(f"{k}: {v}" for k, v in cfg.launch_kwargs().items())

        def run(cfg=cfg):
            return mm_kernels.launch_mm(
                a.data,
                a.scale,
                b.data,
                b.scale,
                block_size=bs,
                kernel=kernel,
                out_dtype=torch.bfloat16,
                bias=None,
                alpha=1.0,
                config=cfg,
            )

        try:
            out[key] = round(bench_ms(run), 4)
        except Exception as e:  # a tile this GPU cannot run (out of resources)
            out[key] = str(e)[:120]
    return out


def gemm_section(shapes, explore: bool, with_dot_scaled: set) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        rows.append(_gemm_one(m, k, n, explore, (m, k, n) in with_dot_scaled))
        torch.cuda.empty_cache()
    return rows


def accuracy_section() -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    m = k = n = 4096
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    exact_bf16 = x.float() @ w.float().t()
    for name, bs, kernel in [
        ("exact MX bs32 fixup", 32, "fixup"),
        ("exact MX bs32 upcast", 32, "upcast"),
        ("fast bs128 fixup", 128, "fixup"),
        ("fast bs128 cublas", 128, "cublas"),
        ("dot_scaled bs32", 32, "dot_scaled"),
    ]:
        a, b = to_mx(x, block_size=bs), to_mx(w, block_size=bs).t()
        odt = torch.bfloat16 if kernel == "cublas" else torch.float32
        try:
            out = mx_mm(a, b, out_dtype=odt, kernel=kernel).float()
        except Exception as e:
            rows.append({"kernel": name, "error": str(e)[:300]})
            continue
        deq = a.dequantize(torch.float32) @ b.dequantize(torch.float32)
        rows.append(
            {
                "kernel": name,
                "SQNR vs dequantized fp32 matmul (dB)": round(snr_db(out, deq), 1),
                "SQNR vs fp32 matmul of the bf16 inputs (dB)": round(snr_db(out, exact_bf16), 1),
            }
        )
    return rows


# --------------------------------------------------------------------------- linear
def _linear_one(tokens: int, h: int, policies: dict, breakdown: bool) -> dict:
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16)
    ref = torch.nn.Linear(h, h, device=DEV, dtype=torch.bfloat16)
    params = [x, ref.weight, ref.bias]

    def step(mod):
        mod(x).backward(g)

    row: dict = {"tokens": tokens, "in": h, "out": h}
    base = bench_ms(lambda: step(ref), grad_to_none=params)
    row["bf16 nn.Linear fwd+bwd ms"] = round(base, 4)
    row["bf16 nn.Linear TFLOPs"] = round(6 * tokens * h * h / base / 1e9, 1)
    for name, pol in policies.items():
        lin = MXLinear.from_linear(ref, pol)
        try:
            ms = bench_ms(lambda lin=lin: step(lin), grad_to_none=params)
        except Exception as e:
            row[f"{name} error"] = str(e)[:300]
            continue
        row[f"{name} ms"] = round(ms, 4)
        row[f"{name} x bf16"] = round(base / ms, 3)
    pol = policies.get("MXLinear fast bs128")
    if breakdown and pol is not None:
        bs = pol.block_size
        xd, wd = x.detach(), ref.weight.detach()
        xr, xc = mx_quantize(xd, block_size=bs, colwise=True)
        wr, wc = mx_quantize(wd, block_size=bs, colwise=True)
        gr, gc = mx_quantize(g, block_size=bs, colwise=True)
        parts = {
            "quantize x (row+col)": lambda: mx_quantize(xd, block_size=bs, colwise=True),
            "quantize W (row+col)": lambda: mx_quantize(wd, block_size=bs, colwise=True),
            "quantize dY (row+col)": lambda: mx_quantize(g, block_size=bs, colwise=True),
            "GEMM fwd": lambda: mx_mm(xr, wr.t()),
            "GEMM dgrad": lambda: mx_mm(gr, wc),
            "GEMM wgrad": lambda: mx_mm(gc.t(), xc),
        }
        row["breakdown fast bs128 ms"] = {k: round(bench_ms(f), 4) for k, f in parts.items()}
    return row


def linear_section(tokens: int, hiddens, policies: dict, breakdown: bool) -> list[dict]:
    rows = []
    for h in hiddens:
        rows.append(_linear_one(tokens, h, policies, breakdown))
        torch.cuda.empty_cache()
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    for r in rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))


def mlp_section(tokens: int, dim: int, hidden: int, policy: PrecisionPolicy) -> dict:
    """GEM-style MLP block fwd+bwd: MXMLP vs Linear -> GELU(tanh) -> Linear in bf16."""
    ref = torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.GELU("tanh"), torch.nn.Linear(hidden, dim)
    ).to(DEV, torch.bfloat16)
    mx = MXMLP(dim, hidden, activation="gelu_tanh", policy=policy, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(tokens, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, device=DEV, dtype=torch.bfloat16)
    row: dict = {"tokens": tokens, "dim": dim, "hidden": hidden}
    ms_ref = bench_ms(lambda: ref(x).backward(g), grad_to_none=[x, *ref.parameters()])
    ms_mx = bench_ms(lambda: mx(x).backward(g), grad_to_none=[x, *mx.parameters()])
    row["bf16 MLP fwd+bwd ms"] = round(ms_ref, 4)
    row["MXMLP fast bs128 fwd+bwd ms"] = round(ms_mx, 4)
    row["MXMLP x bf16"] = round(ms_ref / ms_mx, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--explore", action="store_true", help="also report tuned configs")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    ap.add_argument("--skip", nargs="*", default=[], help="sections to skip")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    t0 = time.time()
    out = args.out or RESULTS / f"h200_{dt.date.today().isoformat()}.json"
    payload: dict = {"benchmark": "mxfp8", "args": vars(args) | {"out": out.name}}

    def save(section: str, rows) -> None:
        # Written after every section so a run cut short still leaves its numbers.
        payload[section] = rows
        payload["wall_s"] = round(time.time() - t0, 1)
        write_result(out, payload)
        print_table(section, rows if isinstance(rows, list) else [rows])

    save("ceilings", ceilings())
    fast = PrecisionPolicy(block_size=128)
    if "gemm" not in args.skip:
        squares = [(4096,) * 3, (8192,) * 3] + ([] if args.quick else [(16384,) * 3])
        mlp = [(16384, 4096, 16384), (16384, 16384, 4096)]
        save("gemm", gemm_section(squares + mlp, args.explore, {(8192, 8192, 8192)}))
    if "linear" not in args.skip:
        policies = {
            "MXLinear exact bs32 fixup": PrecisionPolicy(block_size=32, kernel="fixup"),
            "MXLinear exact bs32 upcast": PrecisionPolicy(block_size=32, kernel="upcast"),
            "MXLinear fast bs128": fast,
            "MXLinear fast bs128 +RHT16+SR": PrecisionPolicy(
                block_size=128, hadamard=16, stochastic_rounding=True
            ),
        }
        hiddens = [2048, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192]
        save("linear", linear_section(16384, hiddens, policies, breakdown=True))
    if "quantize" not in args.skip:
        rows = quantize_section(16384, 8192, args.explore)
        for r in rows:
            if "GBps" in r:
                r["% of copy"] = round(100 * r["GBps"] / payload["ceilings"]["copy_GBps"], 1)
        save("quantize", rows)
    if "dequantize" not in args.skip:
        rows = dequantize_section(16384, 8192)
        for r in rows:
            r["% of copy"] = round(100 * r["GBps"] / payload["ceilings"]["copy_GBps"], 1)
        save("dequantize", rows)
    if "accuracy" not in args.skip:
        save("accuracy", accuracy_section())
    if "mlp" not in args.skip:
        save("mlp", [mlp_section(16384, 4096, 16384, fast)])
    print(f"\nwrote {out} in {payload['wall_s']} s")


if __name__ == "__main__":
    main()
