"""The Gluon (warp-specialised, sm_90) forward on one H200: correctness first, then speed.

    python bench/bench_gluon.py --out results/            # GPU: <= 4 minutes
    python bench/bench_gluon.py --out /tmp/smoke --smoke  # CPU: tiny sizes, no Gluon

1. **Correctness** (GPU, in a child process with a timeout, so a hang or a crash of the
   new kernel is recorded instead of stopping the run): jagged batches with fresh random
   inputs, lengths that are not multiples of the tiles, zero-length sequences, a single
   long sequence, query and key lengths that differ (bottom-right causal), many tiny
   sequences; causal and not; softmax (head dim 128 and 64) and GDPA-SiLU; with and
   without the ping-pong schedule. Outputs are allocated from a NaN-poisoned allocator
   (best effort), so a row the kernel never writes shows up. Each output is compared with
   a float64 reference written here; the rule is FlashAttention's:
   ``max|out - ref| <= 2 * max|baseline - ref| + 1e-3`` with ``baseline`` the same math
   in plain bf16 PyTorch; LSE (base 2) within ``2e-3 * max(1, |ref|)``. The report lists
   max errors and the first mismatching (sequence, row, head, dim) entries. The package's
   Triton forward runs through the same harness as a control.
2. **Speed**: the Gluon forward against the package's Triton forward
   (``hyperrec.jagged_attn.jagged_attention(..., backend="triton")``), FlexAttention
   (compiled, document mask over the packed tokens, mask built outside the timing) and
   dense ``scaled_dot_product_attention`` on the same tokens viewed as ``(B, H, L, D)``
   (the lengths are equal, so the dense call does exactly the jagged work): bf16, H=8,
   D=128, L in {1024, 2048, 8192} with B = 65536 / L, causal and not. Each case builds
   >= 5 fresh instances (new tensors); per instance the median of 10 CUDA-event timings,
   across instances the median and the minimum. Throughput counts useful FLOPs
   (``4 * sum(Lq * Lk) * H * D``, only the allowed pairs when causal); the H200's dense
   bf16 ceiling is ~780 TFLOP/s (measured here with a GEMM too).

Writes ``bench_gluon.json`` into ``--out`` (machine, versions, date, every number, every
error text) and prints a table. Any exception in a Gluon step is recorded and the run
goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
TOKENS, HEADS, HEAD_DIM = 65536, 8, 128
LENGTHS = (1024, 2048, 8192)
INSTANCES, REPS, WARMUP = 5, 10, 3
GEMM_CEILING_NOMINAL = 780.0
BUDGET_S = 225.0  # the whole run, including compilation; the limit is 4 minutes
CHILD_TIMEOUT_S = 150.0


# ----------------------------------------------------------------------------------------
# Inputs, references, checks
# ----------------------------------------------------------------------------------------


def offsets_of(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int64, device=device)  # fmt: skip


def fresh(tokens: int, heads: int, dim: int, device, seed: int, dtype=torch.bfloat16):
    """New q/k/v tensors (new allocations every call: instance-to-instance effects such as
    base-pointer alignment are part of what is measured)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(tokens, heads, dim, generator=g, device=device, dtype=dtype)
            for _ in range(3)]  # fmt: skip


def poison_allocator(nbytes: int, device) -> None:
    """Fill freed caching-allocator blocks with NaN so that a following ``torch.empty`` of
    a similar size likely returns NaN-filled memory (best effort: it is a cache)."""
    if torch.device(device).type != "cuda" or nbytes <= 0:
        return
    blocks = [torch.full((max(nbytes // 4, 1),), float("nan"), device=device) for _ in range(3)]
    del blocks


def reference(q, k, v, qo, ko, causal, scale, act="softmax", coef=1.0):
    """float64 per-sequence attention: (out (Tq, H, D) float64, lse (H, Tq) base 2)."""
    tq, h, d = q.shape
    out = torch.zeros(tq, h, d, dtype=torch.float64, device=q.device)
    lse = torch.full((h, tq), math.inf, dtype=torch.float64, device=q.device)
    qo_l, ko_l = qo.tolist(), ko.tolist()
    for b in range(len(qo_l) - 1):
        q0, q1, k0, k1 = qo_l[b], qo_l[b + 1], ko_l[b], ko_l[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qb = q[q0:q1].double().transpose(0, 1)  # (H, lq, D)
        kb = k[k0:k1].double().transpose(0, 1)
        vb = v[k0:k1].double().transpose(0, 1)
        s = scale * qb @ kb.transpose(1, 2)
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            allowed = j <= i + (lk - lq)
        if act == "softmax":
            s = s.masked_fill(~allowed, -math.inf)
            m = s.amax(-1, keepdim=True)
            has = torch.isfinite(m)
            m = torch.where(has, m, torch.zeros_like(m))
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            o = (p @ vb) / torch.where(has, l, torch.ones_like(l)) * coef
            out[q0:q1] = o.transpose(0, 1)
            row_lse = ((m + torch.log(l)) / math.log(2)).squeeze(-1)
            lse[:, q0:q1] = torch.where(has.squeeze(-1), row_lse, math.inf)
        else:
            w = F.silu(s) * allowed
            out[q0:q1] = (coef * (w @ vb)).transpose(0, 1)
    return out, lse


def baseline(q, k, v, qo, ko, causal, scale, act="softmax", coef=1.0):
    """The same math in plain bf16 PyTorch (bf16 GEMMs, fp32 softmax), for the error rule."""
    tq, h, d = q.shape
    out = torch.zeros(tq, h, d, dtype=torch.float32, device=q.device)
    qo_l, ko_l = qo.tolist(), ko.tolist()
    for b in range(len(qo_l) - 1):
        q0, q1, k0, k1 = qo_l[b], qo_l[b + 1], ko_l[b], ko_l[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qb, kb, vb = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        s = (qb @ kb.transpose(1, 2)).float() * scale
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            allowed = j <= i + (lk - lq)
        if act == "softmax":
            w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        else:
            w = F.silu(s) * allowed
        o = (w.to(q.dtype) @ vb).float() * coef
        out[q0:q1] = o.transpose(0, 1)
    return out.to(q.dtype)


def locate(flat_index: int, shape, qo: list[int]) -> dict:
    t, rem = divmod(flat_index, shape[1] * shape[2])
    hh, dd = divmod(rem, shape[2])
    b = max(i for i in range(len(qo) - 1) if qo[i] <= t) if t < qo[-1] else -1
    return {"token": t, "seq": b, "row": t - qo[b] if b >= 0 else None, "head": hh, "dim": dd}


def check(out, lse, ref_out, ref_lse, base_out, qo, softmax: bool) -> dict:
    """Errors of one forward against the float64 reference, FlashAttention's rule."""
    err = (out.double() - ref_out).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    base_err = float((base_out.double() - ref_out).abs().max()) if ref_out.numel() else 0.0
    tol = 2.0 * base_err + 1e-3
    max_err = float(err.max()) if err.numel() else 0.0
    qo_l = qo.tolist()
    report = {
        "max_err": max_err,
        "baseline_err": base_err,
        "tol": tol,
        "non_finite": int((~torch.isfinite(out)).sum()),
        "ok": max_err <= tol,
    }
    if err.numel():
        report["argmax"] = locate(int(err.argmax()), out.shape, qo_l)
    bad = (err > tol).flatten().nonzero().flatten()[:8].tolist()
    report["first_mismatches"] = [
        {
            **locate(i, out.shape, qo_l),
            "got": float(out.flatten()[i]),
            "want": float(ref_out.flatten()[i]),
        }  # fmt: skip
        for i in bad
    ]
    if softmax and lse is not None and lse.numel():
        both_inf = torch.isinf(ref_lse) & (lse.double() == ref_lse)
        lerr = torch.where(both_inf, 0.0, (lse.double() - ref_lse).abs())
        lerr = torch.where(torch.isnan(lerr), math.inf, lerr)
        ltol = 2e-3 * ref_lse.abs().clamp(min=1.0).where(torch.isfinite(ref_lse), 1.0)
        report["lse_max_err"] = float(lerr.max())
        lbad = (lerr > ltol).flatten().nonzero().flatten()[:8].tolist()
        report["lse_first_mismatches"] = [
            {
                "head": i // lse.shape[1],
                "token": i % lse.shape[1],
                "got": float(lse.flatten()[i]),
                "want": float(ref_lse.flatten()[i]),
            }  # fmt: skip
            for i in lbad
        ]
        report["ok"] = report["ok"] and not lbad
    return report


def correctness_batches(smoke: bool) -> list[dict]:
    g = torch.Generator().manual_seed(1234)
    rand = torch.randint(0, 700, (24,), generator=g).tolist()
    rand[3] = rand[11] = 0
    tiny = torch.randint(0, 21, (200,), generator=g).tolist()
    batches = [
        {"name": "ragged-edges", "q": [0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 1000, 17]},
        {"name": "random-0..700", "q": rand},
        {"name": "many-tiny", "q": tiny},
        {"name": "one-long", "q": [4097]},
        {"name": "lq!=lk", "q": [100, 300, 0, 64, 200], "kv": [300, 100, 50, 0, 333]},
    ]
    if smoke:
        batches = [
            {"name": "ragged-edges", "q": [0, 1, 5, 17, 0, 33]},
            {"name": "lq!=lk", "q": [10, 30, 0, 6], "kv": [30, 10, 5, 0]},
        ]
    return batches


def correctness_variants(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(head_dim=32, causal=c, act="softmax", pingpong=True) for c in (False, True)]
    out = []
    for causal in (False, True):
        for pingpong in (True, False):
            out.append(dict(head_dim=128, causal=causal, act="softmax", pingpong=pingpong))
    out.append(dict(head_dim=64, causal=True, act="softmax", pingpong=True))
    out.append(dict(head_dim=128, causal=True, act="silu", pingpong=True))
    return out


def run_correctness(impl, variants, batches, device, heads: int, log) -> list[dict]:
    """``impl(q, k, v, qo, ko, max_q, max_k, causal, scale, act, coef, pingpong) -> (out, lse)``."""
    results = []
    for vi, var in enumerate(variants):
        for bi, batch in enumerate(batches):
            q_lens = batch["q"]
            kv_lens = batch.get("kv", q_lens)
            qo, ko = offsets_of(q_lens, device), offsets_of(kv_lens, device)
            d = var["head_dim"]
            q, _, _ = fresh(sum(q_lens), heads, d, device, seed=100 * vi + bi)
            _, k, v = fresh(sum(kv_lens), heads, d, device, seed=100 * vi + bi + 50)
            scale = 1.0 / math.sqrt(d)
            act = var["act"]
            coef = 1.0 / max(max(kv_lens), 1) if act == "silu" else 1.0
            row = {"variant": var, "batch": batch["name"]}
            t0 = time.perf_counter()
            try:
                poison_allocator(q.numel() * q.element_size(), device)
                out, lse = impl(q, k, v, qo, ko, max(q_lens), max(kv_lens), var["causal"],
                                scale, act, coef, var["pingpong"])  # fmt: skip
                if device != "cpu":
                    torch.cuda.synchronize()
                ref_out, ref_lse = reference(q, k, v, qo, ko, var["causal"], scale, act, coef)
                base = baseline(q, k, v, qo, ko, var["causal"], scale, act, coef)
                row.update(check(out, lse, ref_out, ref_lse, base, qo, act == "softmax"))
            except Exception as e:  # record and go on
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000],
                           traceback=traceback.format_exc()[-3000:])  # fmt: skip
            row["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(row)
            log(row)
    return results


# ----------------------------------------------------------------------------------------
# Implementations for timing; each returns a zero-argument forward closure
# ----------------------------------------------------------------------------------------


def gluon_impl(q, k, v, qo, ko, max_q, max_k, causal, scale, act, coef, pingpong):
    from hyperrec.jagged_attn._gluon import GluonConfig, default_config, jagged_attention_fwd_gluon

    cfg = default_config(q.shape[2])
    cfg = GluonConfig(block_n=cfg.block_n, num_stages=cfg.num_stages, pingpong=pingpong)
    same = ko is qo or torch.equal(ko, qo)
    kw = {} if same else {"kv_offsets": ko, "max_seqlen_kv": max_k}
    if act == "silu":
        kw.update(activation="silu", normalization="max_seqlen",
                  max_seqlen_kv=max_k, kv_offsets=ko)  # fmt: skip
    return jagged_attention_fwd_gluon(q, k, v, qo, max_q, causal=causal, scale=scale,
                                      config=cfg, **kw)  # fmt: skip


def triton_impl(q, k, v, qo, ko, max_q, max_k, causal, scale, act, coef, pingpong):
    """The package's public API with ``backend="triton"`` (only the public API: the
    internal layout of the Triton subpackage may change)."""
    import hyperrec.jagged_attn as ja

    del pingpong
    if act == "silu":
        out = _call_validate_off(ja.gdpa, q, k, v, qo, ko, max_q, max_k, activation="silu",
                                 scale=scale, normalization="max_seqlen", causal=causal,
                                 backend="triton")  # fmt: skip
    else:
        kw = {} if ko is qo or torch.equal(ko, qo) else {"kv_offsets": ko, "max_seqlen_kv": max_k}
        out = _call_validate_off(ja.jagged_attention, q, k, v, qo, max_q, causal=causal,
                                 scale=scale, backend="triton", **kw)  # fmt: skip
    return out, None


def _call_validate_off(fn, *args, **kw):
    try:
        return fn(*args, validate=False, **kw)
    except TypeError as e:  # the keyword may have been renamed
        if "validate" not in str(e):
            raise
        return fn(*args, **kw)


def make_flex(causal: bool, device, tokens: int = TOKENS, compiled: bool = True):
    """(compiled flex, document-id buffer, build(lens) -> block mask). One compilation per
    mask function: the document ids live in one buffer updated in place per case."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.zeros(tokens, dtype=torch.int32, device=device)
    pos = torch.zeros(tokens, dtype=torch.int32, device=device)
    if causal:

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (pos[ki] <= pos[qi])

    else:

        def mask_mod(b, h, qi, ki):
            return doc[qi] == doc[ki]

    def build(lens: list[int]):
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                      torch.tensor(lens, device=device))  # fmt: skip
        starts = offsets_of(lens, device)[:-1]
        doc.copy_(seq.to(torch.int32))
        pos.copy_((torch.arange(tokens, device=device) - starts[seq]).to(torch.int32))
        return create_block_mask(mask_mod, None, None, tokens, tokens, device=device,
                                 _compile=compiled)  # fmt: skip

    return (torch.compile(flex_attention, dynamic=False) if compiled else flex_attention), build


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def time_ms(fn, device) -> float:
    if device == "cpu":
        fn()
        ts = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    for _ in range(WARMUP):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def useful_flops(lens: list[int], heads: int, dim: int, causal: bool) -> float:
    pairs = sum(x * (x + 1) / 2 if causal else x * x for x in lens)
    return 4.0 * pairs * heads * dim


def timing_cases(smoke: bool) -> list[dict]:
    if smoke:
        return [{"L": 32, "B": 2, "causal": c} for c in (False, True)]
    return [{"L": L, "B": TOKENS // L, "causal": c} for L in LENGTHS for c in (False, True)]


def summarise(ms_list: list[float], flops: float) -> dict:
    med, lo = statistics.median(ms_list), min(ms_list)
    return {
        "ms_per_instance": [round(x, 4) for x in ms_list],
        "ms_median": med,
        "ms_min": lo,
        "spread_max_over_min": max(ms_list) / lo,
        "tflops_median": flops / med * 1e-9,
        "tflops_best": flops / lo * 1e-9,
    }


def time_case(name: str, case: dict, make_fn, device, heads, dim, instances) -> dict:
    lens = [case["L"]] * case["B"]
    flops = useful_flops(lens, heads, dim, case["causal"])
    ms = []
    try:
        for inst in range(instances):
            q, k, v = fresh(sum(lens), heads, dim, device, seed=1000 + inst)
            fn = make_fn(q, k, v, lens)
            ms.append(time_ms(fn, device))
            del q, k, v, fn
        return {"impl": name, **summarise(ms, flops)}
    except Exception as e:  # record and go on
        return {"impl": name, "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-3000:], "ms_per_instance": ms}  # fmt: skip


def peer_makers(case: dict, device, smoke: bool, flex_cache: dict):
    causal = case["causal"]
    scale = 1.0 / math.sqrt(HEAD_DIM if not smoke else 32)

    def triton(q, k, v, lens):
        qo = offsets_of(lens, device)
        return lambda: triton_impl(q, k, v, qo, qo, max(lens), max(lens), causal, scale,
                                   "softmax", 1.0, True)  # fmt: skip

    def sdpa(q, k, v, lens):
        b, length = len(lens), lens[0]
        qd, kd, vd = (x.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)
                      for x in (q, k, v))  # fmt: skip
        return lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)

    def flex(q, k, v, lens):
        if causal not in flex_cache:
            # eager (uncompiled) on the CPU smoke run: it only checks the plumbing
            flex_cache[causal] = make_flex(causal, device, sum(lens), compiled=not smoke)
        compiled, build = flex_cache[causal]
        mask = build(lens)
        qf, kf, vf = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
        return lambda: compiled(qf, kf, vf, block_mask=mask, scale=scale)

    return {"triton": triton, "flex": flex, "sdpa_dense": sdpa}


def gemm_ceiling(device) -> float | None:
    if device == "cpu":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / time_ms(lambda: a @ b, device) * 1e-9


# ----------------------------------------------------------------------------------------
# The Gluon child process (everything that runs the new kernel)
# ----------------------------------------------------------------------------------------


def child_main(path: Path, smoke: bool, deadline: float) -> None:
    """Correctness, then timing, of the Gluon forward; one JSON line per result, flushed,
    so that the parent keeps everything written before a hang or a crash."""
    device = "cuda"
    fh = path.open("a")

    def log(row):
        fh.write(json.dumps({"section": "gluon_correctness", **row}, default=str) + "\n")
        fh.flush()
        status = "ok " if row.get("ok") else "BAD"
        print(f"  [gluon] {status} {row['variant']} {row['batch']}: "
              f"max_err {row.get('max_err')} (tol {row.get('tol')}) "
              f"lse {row.get('lse_max_err')} {row.get('error', '')[:300]}", flush=True)  # fmt: skip
        for mm in row.get("first_mismatches", [])[:3] + row.get("lse_first_mismatches", [])[:3]:
            print(f"        mismatch {mm}", flush=True)

    impl, heads, dim = gluon_impl, HEADS, HEAD_DIM
    if os.environ.get("BENCH_GLUON_STAND_IN") == "triton":
        # --smoke on a machine without Gluon: exercise this process's plumbing with the
        # package's Triton forward standing in for the Gluon one (labelled as such).
        impl, device, heads, dim = triton_impl, "cpu", 2, 32
        fh.write(json.dumps({"section": "note", "stand_in": "triton"}) + "\n")
    run_correctness(impl, correctness_variants(smoke), correctness_batches(smoke), device, heads,
                    log)  # fmt: skip
    for case in timing_cases(smoke):
        for pingpong in (True, False):
            if time.time() > deadline:
                fh.write(json.dumps({"section": "gluon_timing", "case": case,
                                     "skipped": "time budget"}) + "\n")  # fmt: skip
                fh.flush()
                continue
            causal = case["causal"]

            def make(q, k, v, lens, causal=causal, pingpong=pingpong):
                qo = offsets_of(lens, device)
                scale = 1.0 / math.sqrt(q.shape[2])
                return lambda: impl(q, k, v, qo, qo, max(lens), max(lens), causal, scale,
                                    "softmax", 1.0, pingpong)  # fmt: skip

            name = "gluon" if pingpong else "gluon_no_pingpong"
            row = time_case(name, case, make, device, heads, dim, INSTANCES if not smoke else 1)
            fh.write(json.dumps({"section": "gluon_timing", "case": case, **row}) + "\n")
            fh.flush()
            print(f"  [gluon] {name} L={case['L']} causal={causal}: "
                  f"{row.get('tflops_median', row.get('error'))}", flush=True)  # fmt: skip
    fh.close()


def run_child(path: Path, smoke: bool, timeout: float, stand_in: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path)]
    if smoke:
        cmd.append("--smoke")
    env = dict(os.environ, BENCH_GLUON_DEADLINE=str(time.time() + timeout - 20))
    if stand_in:
        env["BENCH_GLUON_STAND_IN"] = "triton"
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True,
                             check=False)  # fmt: skip
        status = {"returncode": res.returncode, "stdout_tail": res.stdout[-6000:],
                  "stderr_tail": res.stderr[-6000:]}  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        status = {"returncode": None, "timeout_s": timeout, "stdout_tail": out[-6000:],
                  "stderr_tail": err[-6000:]}  # fmt: skip
    status["seconds"] = round(time.perf_counter() - t0, 1)
    print(status["stdout_tail"])
    if status["returncode"] != 0:
        print(f"[gluon child] exit {status['returncode']}; stderr tail:\n{status['stderr_tail']}")
    return status


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


def machine() -> dict:
    try:
        from hyperrec.testing.bench import machine_info

        return machine_info()
    except ImportError:
        import platform

        import triton

        return {"torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description="Gluon forward: correctness and speed")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child, args.smoke,
                   float(os.environ.get("BENCH_GLUON_DEADLINE", time.time() + 100)))  # fmt: skip
        return 0

    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke and device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton control path on the CPU
    args.out.mkdir(parents=True, exist_ok=True)
    heads, dim = (HEADS, HEAD_DIM) if not args.smoke else (2, 32)
    result: dict = {"machine": machine(), "config": {
        "tokens": TOKENS, "heads": heads, "head_dim": dim, "lengths": LENGTHS,
        "instances": INSTANCES, "reps": REPS, "smoke": args.smoke, "dtype": "bfloat16"}}  # fmt: skip

    from hyperrec.jagged_attn._gluon import gluon_supported, unsupported_reason

    can_gluon = device == "cuda" and gluon_supported(device)
    result["gluon_supported"] = can_gluon
    result["gluon_unsupported_reason"] = "" if can_gluon else (
        unsupported_reason(device) if device == "cuda" else "no CUDA device (smoke run)")  # fmt: skip
    print(f"device {device}; gluon: {can_gluon} {result['gluon_unsupported_reason']}")

    # 1. Gluon first (the subject; it gets the time it needs): correctness and timing in a
    # child process with a timeout, so that a hang or a crash is recorded, not fatal.
    child_log = args.out / "bench_gluon_child.jsonl"
    child_log.unlink(missing_ok=True)
    if can_gluon:
        timeout = min(CHILD_TIMEOUT_S, BUDGET_S - (time.time() - t_start) - 60)
        print(f"gluon child (timeout {timeout:.0f} s)")
        result["gluon_child"] = run_child(child_log, args.smoke, timeout)
    elif args.smoke:
        print("gluon child with the Triton forward standing in (smoke: plumbing only)")
        result["gluon_child"] = run_child(child_log, True, 120, stand_in=True)
    else:
        result["gluon_child"] = {"skipped": result["gluon_unsupported_reason"]}

    def out_of_time() -> bool:
        return time.time() - t_start > BUDGET_S

    # 2. The same harness on the package's Triton forward: a control for the error levels.
    variants = correctness_variants(args.smoke)
    # the two softmax variants the timing uses too (their compilation is shared)
    control_variants = [v for v in variants if v["pingpong"]][:2] if not args.smoke else variants
    print("correctness control: package Triton forward")
    result["triton_correctness"] = run_correctness(
        triton_impl, control_variants, correctness_batches(args.smoke)[:2], device, heads,
        lambda row: print(f"  [triton] {'ok ' if row.get('ok') else 'BAD'} {row['variant']} "
                          f"{row['batch']}: max_err {row.get('max_err')} "
                          f"{row.get('error', '')[:300]}"),
    )  # fmt: skip

    # 3. Peers' timings.
    cases = timing_cases(args.smoke)
    instances = INSTANCES if not args.smoke else 1
    ceiling = gemm_ceiling(device)
    result["gemm_tflops_measured"] = ceiling
    result["gemm_tflops_nominal"] = GEMM_CEILING_NOMINAL
    timings: list[dict] = []
    flex_cache: dict = {}
    for case in cases:
        for name, make in peer_makers(case, device, args.smoke, flex_cache).items():
            compile_pending = name == "flex" and case["causal"] not in flex_cache
            if out_of_time() or (compile_pending and time.time() - t_start > BUDGET_S - 45):
                row = {"impl": name, "skipped": "time budget"}
            else:
                row = time_case(name, case, make, device, heads, dim, instances)
            row["case"] = case
            timings.append(row)
            print(f"  {name:18s} L={case['L']:5d} causal={case['causal']:d}: "
                  f"{row.get('tflops_median', row.get('error', row.get('skipped', '')))}")  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()

    result["gluon_correctness"] = []
    if child_log.exists():
        for line in child_log.read_text().splitlines():
            row = json.loads(line)
            section = row.pop("section")
            if section == "note":
                result["gluon_note"] = row
            elif section == "gluon_correctness":
                result["gluon_correctness"].append(row)
            else:
                timings.append(row)
    result["timings"] = timings
    result["seconds"] = round(time.time() - t_start, 1)
    print_table(timings, ceiling)
    bad = [r for r in result["gluon_correctness"] if not r.get("ok")]
    result["gluon_all_correct"] = bool(result["gluon_correctness"]) and not bad
    out = args.out / "bench_gluon.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"gluon correctness: {len(result['gluon_correctness']) - len(bad)} ok, {len(bad)} bad")
    print(f"wrote {out} ({result['seconds']} s)")
    return 0


def print_table(timings: list[dict], ceiling: float | None) -> None:
    print(f"\nTFLOP/s, median [min-time best] over instances; GEMM ceiling measured {ceiling}")
    by_case: dict = {}
    for r in timings:
        key = (r["case"]["L"], r["case"]["causal"])
        by_case.setdefault(key, {})[r["impl"]] = r
    names = ["gluon", "gluon_no_pingpong", "triton", "flex", "sdpa_dense"]
    print(f"{'L':>6s} {'causal':>6s} " + " ".join(f"{n:>22s}" for n in names) + "  gluon/best-peer")
    for (length, causal), rows in sorted(by_case.items()):
        cells = []
        for n in names:
            r = rows.get(n, {})
            t = r.get("tflops_median")
            cells.append(f"{t:10.1f} [{r['tflops_best']:7.1f}]" if t else f"{'-':>22s}")
        g = rows.get("gluon", {}).get("tflops_median")
        peers = [rows.get(n, {}).get("tflops_median") for n in ("triton", "flex", "sdpa_dense")]
        peers = [p for p in peers if p]
        ratio = f"{g / max(peers):.2f}x" if g and peers else "-"
        print(f"{length:6d} {causal:6d} " + " ".join(cells) + f"  {ratio}")


if __name__ == "__main__":
    sys.exit(main())
