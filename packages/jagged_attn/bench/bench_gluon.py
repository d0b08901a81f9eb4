"""The Gluon (warp-specialised, sm_90) forward on one H200: correctness first, then speed.

    python bench/bench_gluon.py --out results/                    # GPU: <= 8.5 minutes
    python bench/bench_gluon.py --public --out results/           # GPU: section 3, <= 4.5
    python bench/bench_gluon.py --out /tmp/smoke --smoke          # CPU: tiny sizes, no Gluon
    python bench/bench_gluon.py --out /tmp/smoke --smoke --public # CPU: section 3 only

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
2. **Speed**: the Gluon forward against the package's public forward
   (``hyperrec.jagged_attn.jagged_attention(..., backend="triton")``, reported as
   ``triton``: since 0.2.14 that call takes the Gluon forward itself on a Hopper GPU
   for sequences longer than 256 tokens, so the row is the public default), FlexAttention
   (compiled, document mask over the packed tokens, mask built outside the timing) and
   dense ``scaled_dot_product_attention`` on the same tokens viewed as ``(B, H, L, D)``
   (the lengths are equal, so the dense call does exactly the jagged work): bf16, H=8,
   D=128, L in {1024, 2048, 8192} with B = 65536 / L, causal and not. Each case builds
   >= 5 fresh instances (new tensors); per instance the median of 10 CUDA-event timings,
   across instances the median and the minimum. Throughput counts useful FLOPs
   (``4 * sum(Lq * Lk) * H * D``, only the allowed pairs when causal); the H200's dense
   bf16 ceiling is ~780 TFLOP/s (measured here with a GEMM too).
3. **Through the public dispatch, on batches of varying lengths** (``--public`` alone, or
   after sections 1-2; in a child process with a timeout, as section 1): what decides
   whether the Gluon forward may become the default. The calls are the public API's as
   the integration model makes them: ``jagged_attention(..., causal=True or False,
   validate=False)`` and HSTU's ``gdpa(..., activation="silu", causal=True,
   output_scale=1/max_seqlen, validate=False)``, each with ``JAGGED_ATTN_GLUON=1``
   ("gluon") and ``=0`` ("triton"). The backward is the Triton kernels in both, so
   fwd+bwd shows the end-to-end effect of the Gluon forward (its LSE feeds that backward).
   Each instance records whether the Gluon kernel actually ran: its launches are counted
   around an untimed call, next to the launcher's ``gluon_unsupported`` verdict. Lengths,
   65,536 tokens per batch (the last sequence cut to fit), H=8, D=128, bf16: uniform in
   [1, 2048]; the integration GEM preset's power law (Lomax, alpha 1.5, >= 32, scale 600
   for a mean of ~800) capped at 4,096; uniform in [512, 1024]; uniform in [1, 128]
   (~1,000 short sequences). 5 fresh instances per case: new lengths from a new seed
   (one draw shared by the three calls) and new tensors. Per instance and pass (forward;
   forward+backward): the median of 10 CUDA-event timings back to back as in section 2
   (where the host is slower than the GPU, that is the host's time), the median of 10
   with the GPU given a head start so that the events see only kernels, and the host's
   time per call; across instances the median, the minimum and the spread (max / min).
   FlexAttention's forward (compiled, document mask, causal for the causal call; the
   block mask built per instance outside the timing) for the softmax calls, for reference
   (its backward is left out: compiling it would take much of the budget). Every instance
   compares the two paths' outputs and dq/dk/dv (max |difference| / max |value|); the
   first instance of each case also checks both outputs against the float64 reference
   under section 1's rule (outputs only: the public API returns no LSE). Throughput counts
   useful FLOPs as section 2, fwd+bwd 3.5x the forward (backward 2.5x, as
   ``bench_attention.py``). The Triton kernels and FlexAttention are first compiled in
   parallel worker processes (the Gluon kernel in the measuring process); no step starts
   after ~230 s, and steps left out are listed as skipped. Without Gluon (``--smoke``,
   on the CPU) the opt-in calls are served by the Triton kernels, which the records show.

Writes ``bench_gluon.json`` into ``--out`` (machine, versions, date, every number, every
error text; section 3 under ``public_varying``, its per-step log in
``bench_gluon_public.jsonl``) and prints tables. Any exception in a Gluon step is recorded
and the run goes on.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import math
import multiprocessing as mp
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
    internal layout of the Triton subpackage may change). Since 0.2.14 this dispatches
    to the Gluon forward where that is the default (Hopper, sequences over 256 tokens)."""
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


def log_rows(path: Path) -> list[tuple[str, dict]]:
    """``(section, row)`` of every line of a child's JSON-lines log (none if it wrote no
    log)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row.pop("section"), row) for row in rows]


def _tail(text: str) -> str:
    """The last 6,000 characters of a child's output, file paths made relative to the
    repository (result files must not record where the checkout lives)."""
    return text.replace(f"{HERE.parents[2]}/", "")[-6000:]


def run_child(path: Path, smoke: bool, timeout: float, stand_in: bool = False,
              flag: str = "--child") -> dict:  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), flag, str(path)]
    if smoke:
        cmd.append("--smoke")
    env = dict(os.environ, BENCH_GLUON_DEADLINE=str(time.time() + timeout - 20))
    if stand_in:
        env["BENCH_GLUON_STAND_IN"] = "triton"
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True,
                             check=False)  # fmt: skip
        status = {"returncode": res.returncode, "stdout_tail": _tail(res.stdout),
                  "stderr_tail": _tail(res.stderr)}  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        status = {"returncode": None, "timeout_s": timeout, "stdout_tail": _tail(out),
                  "stderr_tail": _tail(err)}  # fmt: skip
    status["seconds"] = round(time.perf_counter() - t0, 1)
    print(status["stdout_tail"])
    if status["returncode"] != 0:
        print(f"[gluon child] exit {status['returncode']}; stderr tail:\n{status['stderr_tail']}")
    return status


# ----------------------------------------------------------------------------------------
# Section 3: through the public dispatch, on batches of varying lengths (in a child process)
# ----------------------------------------------------------------------------------------

# Length laws. "lomax" is the integration GEM preset's history law
# (``lo + floor(scale * (u ** (-1 / alpha) - 1))``, alpha 1.5, at least 32 events) with
# the scale raised from 512 to 600 so that the mean stays ~800 under a 4,096 cap (GEM caps
# at 8,192, where scale 512 gives that mean).
PUBLIC_DISTS = (
    {"name": "uniform-1..2048", "law": "uniform", "lo": 1, "hi": 2048},
    {"name": "gem-lomax-cap4096", "law": "lomax", "lo": 32, "hi": 4096, "scale": 600.0,
     "alpha": 1.5},
    {"name": "uniform-512..1024", "law": "uniform", "lo": 512, "hi": 1024},
    {"name": "short-1..128", "law": "uniform", "lo": 1, "hi": 128},
)  # fmt: skip
SMOKE_DISTS = (
    {"name": "uniform-1..24", "law": "uniform", "lo": 1, "hi": 24},
    {"name": "lomax-cap32", "law": "lomax", "lo": 2, "hi": 32, "scale": 6.0, "alpha": 1.5},
)
# HSTU first: it is what the integration model runs (model.py: gdpa, SiLU, causal,
# output_scale = 1 / max_seqlen); then softmax, causal and not (jagged_attention).
PUBLIC_KINDS = ("hstu", "softmax_causal", "softmax")
PUBLIC_PATHS = ("gluon", "triton")
PUBLIC_INSTANCES = 5
PUBLIC_SMOKE_TOKENS = 40
# The child stops starting new (case, instance) steps this long after it starts, and is
# killed 20 s later: the section stays within ~4 minutes whatever the compile times are.
PUBLIC_TIMEOUT_S = 250.0
# Backward counted as 2.5x the forward (_triton/_flops.py, bench_attention.py).
FWD_BWD_FLOPS = 3.5
# The float64 reference holds H x L x L scores per sequence (1 GiB at L = 4,096, H = 8).
REF_MAX_LEN = 4096
REF_MIN_LEFT_S = 45.0  # no reference when less time than this is left


def draw_lengths(dist: dict, tokens: int, seed: int) -> list[int]:
    """Sequence lengths from ``dist`` until they hold ``tokens`` tokens; the last one is cut
    so that every instance holds exactly ``tokens`` (FlexAttention's document buffer has
    one size, and the instances of a case do comparable work)."""
    g = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    total = 0
    while total < tokens:
        if dist["law"] == "uniform":
            chunk = torch.randint(dist["lo"], dist["hi"] + 1, (256,), generator=g)
        else:
            u = torch.rand(256, generator=g, dtype=torch.float64).clamp_min(1e-12)
            tail = (dist["scale"] * (u ** (-1.0 / dist["alpha"]) - 1.0)).floor()
            chunk = (dist["lo"] + tail).clamp(max=dist["hi"]).long()
        for x in chunk.tolist():
            x = min(int(x), tokens - total)
            lens.append(x)
            total += x
            if total == tokens:
                break
    return lens


def public_call(kind: str, q, k, v, offsets, max_len: int):
    """The public API as the integration model calls it (``validate=False`` in its hot
    path, ``max_seqlen`` the batch's longest sequence, the default backend). On the CPU the
    default backend is the PyTorch reference, so the smoke run asks for the (interpreted)
    Triton kernels by name."""
    import hyperrec.jagged_attn as ja

    scale = 1.0 / math.sqrt(q.shape[2])
    backend = "auto" if q.device.type == "cuda" else "triton"
    if kind == "hstu":
        return ja.gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="silu",
                       scale=scale, causal=True, output_scale=1.0 / max_len, backend=backend,
                       validate=False)  # fmt: skip
    return ja.jagged_attention(q, k, v, offsets, max_len, causal=kind == "softmax_causal",
                               scale=scale, backend=backend, validate=False)  # fmt: skip


@contextlib.contextmanager
def gluon_env(on: bool):
    """``JAGGED_ATTN_GLUON`` = "1" or "0" inside (the dispatcher reads it at every call)."""
    from hyperrec.jagged_attn._triton._launch import GLUON_ENV

    old = os.environ.get(GLUON_ENV)
    os.environ[GLUON_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GLUON_ENV, None)
        else:
            os.environ[GLUON_ENV] = old


@contextlib.contextmanager
def observe_dispatch():
    """What the dispatcher did inside: the launcher's verdict for each forward
    (``gluon_unsupported``, None = eligible) and the number of Gluon kernel launches.

    Wraps two module attributes that the launchers look up at call time (``src/`` is not
    changed): only around untimed calls, since the wrappers cost host time.
    """
    from hyperrec.jagged_attn._gluon import _launch as _gluon
    from hyperrec.jagged_attn._triton import _launch

    seen: dict = {"verdicts": [], "gluon_launches": 0}
    # the dispatcher launches through the unchecked entry point ``_gluon._launch._run``
    forward, gluon_fwd = _launch.attention_forward, _gluon._run

    def observed_forward(call, **kw):
        seen["verdicts"].append(_launch.gluon_unsupported(call))
        return forward(call, **kw)

    def observed_gluon(*args, **kw):
        seen["gluon_launches"] += 1
        return gluon_fwd(*args, **kw)

    _launch.attention_forward = observed_forward
    _gluon._run = observed_gluon
    try:
        yield seen
    finally:
        _launch.attention_forward = forward
        _gluon._run = gluon_fwd


def time_split(fn, device) -> dict:
    """Per-call medians over REPS: ``ms``, CUDA events back to back as in section 2 (where
    the host is slower than the GPU this is the host's time: what an eager step sees);
    ``device_ms``, the same with the GPU given a head start long enough for the host to
    issue every repetition, so the events see only kernels; ``host_us``, the host's time to
    issue one call. ``host_hidden`` is False when the head start ran out first (then
    ``device_ms`` is an upper bound). The last three are ``bench_attention.py``'s
    ``device_and_host`` without its L2 flush."""
    import bench_attention  # same directory

    if device == "cpu":  # the interpreter: one call, wall clock (plumbing, not a number)
        split = bench_attention.device_and_host(fn, device=device)
        return {"ms": split["device_ms"], **split}
    ms = time_ms(fn, device)
    return {"ms": ms, **bench_attention.device_and_host(fn, REPS, device, flush=False)}


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-3000:]}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``a`` against ``b``: max |a - b|, max |b| and their ratio; non-finite entries of a."""
    diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    top = float(b.float().abs().max()) if b.numel() else 0.0
    return {"max_abs_diff": diff, "max_abs": top, "rel": diff / top if top else diff,
            "non_finite": int((~torch.isfinite(a)).sum())}  # fmt: skip


def public_instance(case: dict, lens: list[int], lengths_seed: int, inst: int, device,
                    heads: int, dim: int, paths: tuple[str, ...], flex_cache: dict,
                    with_reference: str | None) -> dict:  # fmt: skip
    """One fresh instance of one case (``lens`` drawn with ``lengths_seed``, new tensors):
    the dispatch paths in ``paths`` and, for softmax, FlexAttention. ``with_reference``:
    None to check the outputs against the float64 reference, else why not."""
    kind = case["kind"]
    causal = kind != "softmax"
    tokens, max_len = sum(lens), max(lens)
    seed = case["tensor_seed"] + inst
    off = offsets_of(lens, device)
    q, k, v = fresh(tokens, heads, dim, device, seed)
    do = fresh(tokens, heads, dim, device, seed + 7919)[0]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    flops = useful_flops(lens, heads, dim, causal)
    row: dict = {"dist": case["dist"], "kind": kind, "instance": inst,
                 "lengths_seed": lengths_seed, "tensor_seed": seed, "n_seq": len(lens),
                 "tokens": tokens, "max_len": max_len, "mean_len": tokens / len(lens),
                 "flops_fwd": flops, "dispatch": {}, "compare": {}, "timings": {},
                 "errors": {}}  # fmt: skip

    def fwd():
        return public_call(kind, q, k, v, off, max_len)

    def fwd_bwd():
        return torch.autograd.grad(public_call(kind, *leaves, off, max_len), leaves, do)

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    # Alternate which path goes first, so that clock or thermal drift within an instance
    # does not always favour the same one.
    order = paths if inst % 2 == 0 else paths[::-1]
    results: dict = {}
    for path in order:  # untimed first calls (schedules, compiles), observed
        try:
            with gluon_env(path == "gluon"), observe_dispatch() as seen:
                out = fwd()
                grads = fwd_bwd()
                sync()
            verdicts = sorted({"eligible" if r is None else r for r in seen["verdicts"]})
            row["dispatch"][path] = {"env": "1" if path == "gluon" else "0",
                                     "forwards": len(seen["verdicts"]),
                                     "gluon_launches": seen["gluon_launches"],
                                     "taken": seen["gluon_launches"] > 0, "verdicts": verdicts}  # fmt: skip
            results[path] = (out, *grads)
        except Exception as e:  # record and go on
            row["errors"][f"{path}/first_calls"] = _error(e)
    if len(results) == 2:
        for name, a, b in zip(("out", "dq", "dk", "dv"), results["gluon"], results["triton"]):
            row["compare"][name] = _max_diff(a, b)
    if with_reference is None and results:
        try:
            t0 = time.perf_counter()
            act, coef = ("silu", 1.0 / max_len) if kind == "hstu" else ("softmax", 1.0)
            scale = 1.0 / math.sqrt(dim)
            ref_out, _ = reference(q, k, v, off, off, causal, scale, act, coef)
            base = baseline(q, k, v, off, off, causal, scale, act, coef)
            row["reference"] = {path: check(res[0], None, ref_out, None, base, off, False)
                                for path, res in results.items()}  # fmt: skip
            row["reference"]["seconds"] = round(time.perf_counter() - t0, 2)
            del ref_out, base
        except Exception as e:  # record and go on
            row["reference"] = _error(e)
    else:
        row["reference"] = {"skipped": with_reference or "no output to check"}
    triton_out = results.get("triton", (None,))[0]
    del results

    for path in order:
        for pass_, fn, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, FWD_BWD_FLOPS)):
            try:
                with gluon_env(path == "gluon"):
                    t = time_split(fn, device)
                t["tflops"] = mult * flops / t["ms"] * 1e-9
                t["tflops_device"] = mult * flops / t["device_ms"] * 1e-9
                row["timings"].setdefault(path, {})[pass_] = t
            except Exception as e:  # record and go on
                row["errors"][f"{path}/{pass_}"] = _error(e)
    if kind != "hstu":
        try:
            if causal not in flex_cache:
                # eager (uncompiled) on the CPU smoke run: it only checks the plumbing
                flex_cache[causal] = make_flex(causal, device, tokens, compiled=device != "cpu")
            compiled, build = flex_cache[causal]
            t0 = time.perf_counter()
            mask = build(lens)  # outside the timing, as a caller would reuse it across layers
            sync()
            row["flex_mask_build_ms"] = (time.perf_counter() - t0) * 1e3
            qf, kf, vf = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
            scale = 1.0 / math.sqrt(dim)

            def flex():
                return compiled(qf, kf, vf, block_mask=mask, scale=scale)

            if triton_out is not None:  # its timing means something only if it is right
                row["compare"]["flex_out_vs_triton"] = _max_diff(flex()[0].transpose(0, 1),
                                                                  triton_out)  # fmt: skip
            t = time_split(flex, device)
            t["tflops"] = flops / t["ms"] * 1e-9
            t["tflops_device"] = flops / t["device_ms"] * 1e-9
            row["timings"]["flex"] = {"fwd": t}
        except Exception as e:  # record and go on
            row["errors"]["flex/fwd"] = _error(e)
    return row


def _public_warm(task: tuple) -> str:
    """Compile one call's Triton kernels (or FlexAttention) in a worker process, so that the
    measuring process finds them in Triton's (and Inductor's) on-disk caches instead of
    compiling one by one. Not the Gluon kernel: a hang of the new kernel here would stall
    the pool, out of reach of the per-step records; it compiles in the measuring process."""
    try:
        if task[0] == "flex":
            compiled, build = make_flex(task[1], "cuda", TOKENS)
            mask = build([TOKENS // 2 - 100, 100, TOKENS // 2])
            q, k, v = (x.transpose(0, 1).unsqueeze(0)
                       for x in fresh(TOKENS, HEADS, HEAD_DIM, "cuda", 0))  # fmt: skip
            compiled(q, k, v, block_mask=mask, scale=1.0 / math.sqrt(HEAD_DIM))
        else:
            kind, max_len = task
            lens = [max_len, max_len // 3 + 1, 1, 47]
            lens.append(16 - sum(lens) % 16)  # a token count divisible by 16, like TOKENS
            off = offsets_of(lens, "cuda")
            q, k, v = fresh(sum(lens), HEADS, HEAD_DIM, "cuda", 0)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            with gluon_env(False):
                torch.autograd.grad(public_call(kind, *leaves, off, max_len), leaves, q)
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{task}: {type(e).__name__}: {e}"[:500]


def public_child(path: Path, smoke: bool, deadline: float) -> None:
    """The docstring's section 3; one JSON line per step, flushed, so that the parent
    keeps everything written before a hang or a crash of the new kernel."""
    fh = path.open("a")
    t_start = time.time()

    def emit(row: dict) -> None:
        fh.write(json.dumps(row, default=str) + "\n")
        fh.flush()

    device = "cpu" if smoke else "cuda"
    heads, dim = (1, 64) if smoke else (HEADS, HEAD_DIM)
    tokens = PUBLIC_SMOKE_TOKENS if smoke else TOKENS
    dists = SMOKE_DISTS if smoke else PUBLIC_DISTS
    instances = 2 if smoke else PUBLIC_INSTANCES
    from hyperrec.jagged_attn._gluon import gluon_supported, unsupported_reason

    can_gluon = device == "cuda" and gluon_supported(device)
    reason = "" if can_gluon else ("no CUDA device (smoke run)" if device == "cpu"
                                   else unsupported_reason(device))  # fmt: skip
    # Without Gluon the GPU run times the Triton path alone. The smoke run still calls the
    # public API with the opt-in set, to exercise this section's plumbing: the dispatcher
    # then serves it with the Triton kernels, which its dispatch record shows.
    paths = PUBLIC_PATHS if can_gluon or smoke else ("triton",)
    emit({"section": "public_meta", "device": device, "tokens": tokens, "heads": heads,
          "head_dim": dim, "instances": instances, "reps": REPS, "warmup": WARMUP,
          "dists": dists, "kinds": PUBLIC_KINDS, "paths": paths,
          "gluon": "available" if can_gluon else f"gluon not available: {reason}"})  # fmt: skip
    print(f"  [public] device {device}; gluon: {can_gluon} {reason}; paths {paths}", flush=True)

    if device == "cuda":
        t0 = time.perf_counter()
        # both configuration buckets (max_seqlen <= 256 or not) of each call
        tasks = [(kind, max_len) for kind in PUBLIC_KINDS for max_len in (128, 2048)]
        tasks += [("flex", True), ("flex", False)]
        try:
            ctx = mp.get_context("spawn")
            with cf.ProcessPoolExecutor(min(len(tasks), os.cpu_count() or 1),
                                        mp_context=ctx) as ex:  # fmt: skip
                errors = [e for e in ex.map(_public_warm, tasks) if e]
        except Exception as e:  # the measuring process then compiles on its own
            errors = [f"pool: {type(e).__name__}: {e}"[:500]]
        emit({"section": "public_warm", "seconds": round(time.perf_counter() - t0, 1),
              "errors": errors})  # fmt: skip
        print(f"  [public] compiled in workers: {time.perf_counter() - t0:.0f} s {errors}",
              flush=True)  # fmt: skip

    cases = [{"dist": d["name"], "kind": kind,
              "tensor_seed": 20000 + 1000 * (len(PUBLIC_KINDS) * di + ki)}
             for di, d in enumerate(dists) for ki, kind in enumerate(PUBLIC_KINDS)]  # fmt: skip
    flex_cache: dict = {}
    referenced: set = set()
    # Instances outermost: when the time runs out every case has its first instances.
    for inst in range(instances):
        for di, dist in enumerate(dists):
            # one draw per (distribution, instance), shared by its kinds: they compare on
            # the same batches
            lengths_seed = 7000 + 100 * di + inst
            lens = draw_lengths(dist, tokens, lengths_seed)
            emit({"section": "public_lengths", "dist": dist["name"], "instance": inst,
                  "seed": lengths_seed, "lengths": ",".join(map(str, lens))})  # fmt: skip
            for case in cases:
                if case["dist"] != dist["name"]:
                    continue
                name = f"{case['dist']} {case['kind']} #{inst}"
                if time.time() > deadline:
                    emit({"section": "public_skipped", "dist": case["dist"],
                          "kind": case["kind"], "instance": inst, "skipped": "time budget"})  # fmt: skip
                    print(f"  [public] {name}: skipped (time budget)", flush=True)
                    continue
                key = (case["dist"], case["kind"])
                why_not = None
                if key in referenced:
                    why_not = "checked on the case's first instance only"
                elif max(lens) > REF_MAX_LEN:
                    why_not = f"longest sequence {max(lens)} > {REF_MAX_LEN} (float64 scores)"
                elif deadline - time.time() < REF_MIN_LEFT_S:
                    why_not = "time budget"
                referenced.add(key)
                t0 = time.perf_counter()
                try:
                    row = public_instance(case, lens, lengths_seed, inst, device, heads, dim,
                                          paths, flex_cache, why_not)  # fmt: skip
                except Exception as e:  # the inputs themselves (each step inside is guarded)
                    row = {"dist": case["dist"], "kind": case["kind"], "instance": inst,
                           "lengths_seed": lengths_seed, "dispatch": {}, "compare": {},
                           "timings": {}, "reference": {"skipped": "no inputs"},
                           "errors": {"inputs": _error(e)}}  # fmt: skip
                row["seconds"] = round(time.perf_counter() - t0, 2)
                emit({"section": "public_instance", **row})
                tim = row["timings"]
                cells = [f"{p}/{s} {tim[p][s]['tflops']:.1f}" for p in ("gluon", "triton", "flex")
                         for s in ("fwd", "fwd_bwd") if s in tim.get(p, {})]  # fmt: skip
                taken = row["dispatch"].get("gluon", {}).get("taken")
                print(f"  [public] {name}: {', '.join(cells)} TFLOP/s; gluon taken {taken}; "
                      f"errors {list(row['errors'])} ({row['seconds']} s)", flush=True)  # fmt: skip
            if device == "cuda":
                torch.cuda.empty_cache()
    emit({"section": "public_done", "seconds": round(time.time() - t_start, 1)})
    fh.close()


def _stats(values: list[float]) -> dict:
    lo, hi = min(values), max(values)
    return {"median": statistics.median(values), "min": lo, "max": hi,
            "spread_max_over_min": hi / lo if lo > 0 else None}  # fmt: skip


def summarise_public(rows: list[dict]) -> list[dict]:
    """Per case and (path, pass): the per-instance numbers' median, min, max and spread;
    per-instance Gluon-over-Triton speedups (Triton's time / Gluon's); the largest
    Gluon-Triton differences; whether Gluon ran."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["dist"], r["kind"]), []).append(r)
    out = []
    for (dist, kind), rs in by_case.items():
        s: dict = {"dist": dist, "kind": kind, "instances": len(rs),
                   "gluon_taken": sum(bool(r["dispatch"].get("gluon", {}).get("taken"))
                                      for r in rs),
                   "gluon_verdicts": sorted({v for r in rs
                                             for v in r["dispatch"].get("gluon", {}).get("verdicts", [])}),
                   "instances_with_errors": sum(bool(r["errors"]) for r in rs)}  # fmt: skip
        for path in ("gluon", "triton", "flex"):
            for pass_ in ("fwd", "fwd_bwd"):
                ts = [r["timings"].get(path, {}).get(pass_) for r in rs]
                ts = [t for t in ts if t]
                if ts:
                    s[f"{path}/{pass_}"] = {
                        key: _stats([t[key] for t in ts])
                        for key in ("ms", "device_ms", "host_us", "tflops", "tflops_device")
                    } | {"host_hidden_all": all(t["host_hidden"] for t in ts)}
        for pass_ in ("fwd", "fwd_bwd"):
            for key in ("ms", "device_ms"):
                pairs = [(r["timings"].get("triton", {}).get(pass_),
                          r["timings"].get("gluon", {}).get(pass_)) for r in rs]  # fmt: skip
                ratios = [t[key] / g[key] for t, g in pairs if t and g]
                if ratios:
                    s[f"gluon_speedup/{pass_}/{key}"] = _stats(ratios)
        for name in ("out", "dq", "dk", "dv", "flex_out_vs_triton"):
            cmp = [r["compare"][name] for r in rs if name in r["compare"]]
            if cmp:
                s[f"max_rel_diff/{name}"] = max(c["rel"] for c in cmp)
                s[f"max_abs_diff/{name}"] = max(c["max_abs_diff"] for c in cmp)
                s[f"non_finite/{name}"] = sum(c["non_finite"] for c in cmp)
        checked: dict = {}
        for r in rs:
            for p in PUBLIC_PATHS:
                c = r.get("reference", {}).get(p)
                if c:
                    agg = checked.setdefault(p, {"ok": True, "max_err_over_tol": 0.0})
                    agg["ok"] = agg["ok"] and bool(c.get("ok"))
                    agg["max_err_over_tol"] = max(agg["max_err_over_tol"], c["max_err"] / c["tol"])
        why = {str(r.get("reference", {}).get("skipped") or r.get("reference", {}).get("error"))
               for r in rs}  # fmt: skip
        s["reference"] = checked or "not checked: " + "; ".join(sorted(why))
        out.append(s)
    return out


def run_public(out_dir: Path, smoke: bool) -> dict:
    """The docstring's section 3 in a child process with a timeout (a hang or a crash of
    the Gluon kernel is recorded, not fatal), assembled from its log."""
    log = out_dir / "bench_gluon_public.jsonl"
    log.unlink(missing_ok=True)
    print(f"public dispatch, varying lengths (child, timeout {PUBLIC_TIMEOUT_S:.0f} s)")
    status = run_child(log, smoke, PUBLIC_TIMEOUT_S, flag="--child-public")
    res: dict = {"child": status, "log": log.name, "instances": [], "skipped": [],
                 "lengths": {}}  # fmt: skip
    for section, row in log_rows(log):
        if section == "public_meta":
            res["config"] = row
        elif section == "public_warm":
            res["compile_in_workers"] = row
        elif section == "public_lengths":
            res["lengths"].setdefault(row["dist"], []).append(row)
        elif section == "public_instance":
            res["instances"].append(row)
        elif section == "public_skipped":
            res["skipped"].append(row)
        elif section == "public_done":
            res["child_seconds"] = row["seconds"]
    res["notes"] = {
        "timing": "per instance, median of REPS calls: ms = CUDA events back to back (the "
                  "host's time where it is slower than the GPU), device_ms = GPU only (the "
                  "GPU given a head start), host_us = host time to issue one call; no L2 "
                  "flush. gluon = the public call with JAGGED_ATTN_GLUON=1, triton = with 0; "
                  "the backward is the Triton kernels in both",
        "flops": f"useful FLOPs: fwd 4 * sum(allowed pairs) * H * D, fwd_bwd {FWD_BWD_FLOPS}x",
        "spread": "max / min over instances; instances hold the same token count but "
                  "different lengths, so the tflops spread is the one to read",
        "reference": "float64, FlashAttention's rule (see section 1) on the outputs, on the "
                     "first instance of each case; the public API returns no LSE, so only "
                     "outputs are checked against it; gradients are compared Gluon vs Triton",
        "flex": "forward only (compiling its backward as well would take a large share of "
                "the section's budget; bench_attention.py times FlexAttention fwd+bwd)",
    }  # fmt: skip
    res["summary"] = summarise_public(res["instances"])
    print_public_table(res["summary"])
    return res


def print_public_table(summary: list[dict]) -> None:
    print("\nPublic dispatch, varying lengths: TFLOP/s median [best] over instances, events "
          "back to back; speedup = Triton time / Gluon time, median over instances, back to "
          "back / GPU only; taken = instances where the Gluon kernel ran; rel diff = max over "
          "instances of max|gluon - triton| / max|triton| (out; worst of dq, dk, dv); ref = "
          "float64 check of the outputs, first instance")  # fmt: skip
    head = (f"{'lengths':19s} {'kind':15s} {'pass':7s} {'triton':>15s} {'gluon':>15s} "
            f"{'flex':>15s} {'speedup':>13s} {'taken':>5s} {'rel diff':>8s} {'ref g/t':>8s}")  # fmt: skip
    print(head)

    def cell(s, key):
        t = s.get(key, {}).get("tflops")
        return f"{t['median']:7.1f} [{t['max']:5.1f}]" if t else "-"

    for s in summary:
        for pass_ in ("fwd", "fwd_bwd"):
            sp = [
                s.get(f"gluon_speedup/{pass_}/{k}", {}).get("median") for k in ("ms", "device_ms")
            ]
            speed = "/".join(f"{x:.2f}" for x in sp if x) or "-"
            names = ("out",) if pass_ == "fwd" else ("dq", "dk", "dv")
            diffs = [s[f"max_rel_diff/{n}"] for n in names if f"max_rel_diff/{n}" in s]
            diff = f"{max(diffs):.1e}" if diffs else "-"
            ref = s["reference"]
            ref = "/".join("ok" if ref[p]["ok"] else "BAD" for p in PUBLIC_PATHS
                           if p in ref) if isinstance(ref, dict) else "-"  # fmt: skip
            print(f"{s['dist']:19s} {s['kind']:15s} {pass_:7s} {cell(s, f'triton/{pass_}'):>15s} "
                  f"{cell(s, f'gluon/{pass_}'):>15s} {cell(s, f'flex/{pass_}'):>15s} "
                  f"{speed:>13s} {s['gluon_taken']}/{s['instances']:<3d} {diff:>8s} {ref:>8s}")  # fmt: skip


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
    ap.add_argument("--public", action="store_true",
                    help="only section 3: the public dispatch on batches of varying lengths")  # fmt: skip
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-public", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    deadline = float(os.environ.get("BENCH_GLUON_DEADLINE", time.time() + 100))
    if args.child is not None:
        child_main(args.child, args.smoke, deadline)
        return 0
    if args.child_public is not None:
        public_child(args.child_public, args.smoke, deadline)
        return 0

    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke and device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton control path on the CPU
    args.out.mkdir(parents=True, exist_ok=True)
    heads, dim = (HEADS, HEAD_DIM) if not args.smoke else (2, 32)
    result: dict = {"machine": machine(), "config": {
        "sections": ["public"] if args.public else ["correctness", "equal_lengths", "public"],
        "tokens": TOKENS, "heads": heads, "head_dim": dim, "lengths": LENGTHS,
        "instances": INSTANCES, "reps": REPS, "smoke": args.smoke, "dtype": "bfloat16"}}  # fmt: skip

    from hyperrec.jagged_attn._gluon import gluon_supported, unsupported_reason

    can_gluon = device == "cuda" and gluon_supported(device)
    result["gluon_supported"] = can_gluon
    result["gluon_unsupported_reason"] = "" if can_gluon else (
        unsupported_reason(device) if device == "cuda" else "no CUDA device (smoke run)")  # fmt: skip
    print(f"device {device}; gluon: {can_gluon} {result['gluon_unsupported_reason']}")
    out = args.out / "bench_gluon.json"

    def write() -> None:
        result["seconds"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    if args.public:
        result["gemm_tflops_measured"] = gemm_ceiling(device)
        result["gemm_tflops_nominal"] = GEMM_CEILING_NOMINAL
    else:
        try:
            run_equal_lengths(args, result, device, heads, dim, can_gluon, t_start)
        except Exception as e:  # record and go on to the next section
            result["equal_lengths_error"] = _error(e)
            print(f"sections 1-2 failed: {result['equal_lengths_error']['error']}")
        write()  # the next section takes minutes: keep these results if the run is cut short
    if device == "cuda":
        torch.cuda.empty_cache()  # for the child process
    try:
        result["public_varying"] = run_public(args.out, args.smoke)
    except Exception as e:  # record and go on
        result["public_varying"] = _error(e)
        print(f"public section failed: {result['public_varying']['error']}")
    write()
    print(f"wrote {out} ({result['seconds']} s)")
    return 0


def run_equal_lengths(args, result: dict, device, heads: int, dim: int, can_gluon: bool,
                      t_start: float) -> None:  # fmt: skip
    """Sections 1 and 2 (batches of equal lengths), into ``result``."""
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
    for section, row in log_rows(child_log):
        if section == "note":
            result["gluon_note"] = row
        elif section == "gluon_correctness":
            result["gluon_correctness"].append(row)
        else:
            timings.append(row)
    result["timings"] = timings
    print_table(timings, ceiling)
    bad = [r for r in result["gluon_correctness"] if not r.get("ok")]
    result["gluon_all_correct"] = bool(result["gluon_correctness"]) and not bad
    print(f"gluon correctness: {len(result['gluon_correctness']) - len(bad)} ok, {len(bad)} bad")


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
