"""Offline tuning of the Triton kernels' tile configurations (produces ``_configs.TUNED``).

For each head dim and max-length bucket it times every candidate of
``_configs.CANDIDATES`` on a representative jagged batch (bf16, softmax, non-causal):
forward alone, then the backward with each dK/dV candidate (with and without the atomic dQ
scheme) and each dQ candidate. Kernels are compiled first in parallel worker processes so
the sweep costs minutes, not tens of minutes. Writes JSON (all timings and the winners)
and prints the ``TUNED`` entries to paste into ``_configs.py``.

    python bench/tune_configs.py --out bench/results/tune_h200.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import math
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

BUCKETS = {
    # bucket: (batch, max length, heads); lengths uniform in [1, max]
    "short": (1024, 256, 8),
    "long": (64, 2048, 8),
}
HEAD_DIMS = (64, 128)


def _batch(b: int, max_len: int, heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (b,), generator=g)
    lens[0] = max_len
    offsets = torch.zeros(b + 1, dtype=torch.int32)
    offsets[1:] = lens.cumsum(0)
    t = int(offsets[-1])
    dev = "cuda"
    q, k, v, do = (
        torch.randn(t, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(4)
    )
    return q, k, v, do, offsets.to(dev), lens


def _call(q, k, v, off, max_len: int, head_dim: int):
    """The launchers' description of a softmax, non-causal self-attention call."""
    from hyperrec.jagged_attn import AttentionSpec
    from hyperrec.jagged_attn._opschema import AttentionCall

    spec = AttentionSpec(scale=1.0 / math.sqrt(head_dim), max_seqlen_q=max_len,
                         max_seqlen_kv=max_len)  # fmt: skip
    return AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip


def _compile_job(job):
    """Run one configuration once on a tiny batch so that its kernels land in the cache."""
    kind, head_dim, heads, cfg_dict = job
    from hyperrec.jagged_attn._triton import KernelConfig, attention_backward, attention_forward

    cfg = KernelConfig(**cfg_dict)
    q, k, v, do, off, _ = _batch(3, 70, heads, head_dim)
    call = _call(q, k, v, off, 70, head_dim)
    t0 = time.time()
    try:
        out, lse = attention_forward(call, config=cfg if kind == "fwd" else None)
        if kind != "fwd":
            attention_backward(
                do, out, lse, call,
                config_dkdv=cfg if kind == "dkdv" else None,
                config_dq=cfg if kind == "dq" else None,
            )  # fmt: skip
        torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as e:  # a config that does not compile (e.g. out of shared memory)
        return job, time.time() - t0, f"{type(e).__name__}: {e}"[:300]


def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def _tune_one(bucket, b, max_len, h, d, failed, results):
    """Time every candidate for one (bucket, head dim); returns the (fwd, dkdv, dq) winners."""
    from hyperrec.jagged_attn._triton import _configs, attention_backward, attention_forward

    cands = _configs.CANDIDATES
    q, k, v, do, off, lens = _batch(b, max_len, h, d)
    call = _call(q, k, v, off, max_len, d)
    flops = 4.0 * float((lens.double() ** 2).sum()) * h * d

    def ok(kind, cfg):
        return (kind, d, tuple(sorted(asdict(cfg).items()))) not in failed

    def record(kernel, ms, cfg, dq=None):
        mult = 1.0 if kernel == "fwd" else 2.5
        results.append(dict(bucket=bucket, d=d, kernel=kernel, cfg=asdict(cfg),
                            dq=None if dq is None else asdict(dq), ms=ms,
                            tflops=mult * flops / ms * 1e-9))  # fmt: skip
        return ms

    best_fwd = min(
        ((record("fwd", _ms(lambda c=c: attention_forward(call, config=c)), c), c)
         for c in cands["fwd"] if ok("fwd", c)),
        key=lambda x: x[0],
    )  # fmt: skip
    out, lse = attention_forward(call, config=best_fwd[1])

    def bwd(dkdv, dq):
        return _ms(lambda: attention_backward(do, out, lse, call, config_dkdv=dkdv,
                                              config_dq=dq))  # fmt: skip

    # dK/dV candidates with the default dQ kernel, and each with the atomic dQ scheme
    default_dq = _configs.select_config(_configs.config_key("dq", "sm90", d, True, False, max_len))
    timed = []
    for c in cands["dkdv"]:
        if not ok("dkdv", c):
            continue
        for atomic in (False, True):
            c2 = replace(c, dq_atomic=atomic)
            timed.append((record("bwd", bwd(c2, default_dq), c2, default_dq), c2, default_dq))
    best_sep = min((x for x in timed if not x[1].dq_atomic), key=lambda x: x[0])
    for c in cands["dq"]:
        if ok("dq", c):
            timed.append((record("bwd", bwd(best_sep[1], c), best_sep[1], c), best_sep[1], c))
    best_bwd = min(timed, key=lambda x: x[0])
    print(f"{bucket:5s} D={d:3d}: fwd {best_fwd[0]:.3f} ms "
          f"({flops / best_fwd[0] * 1e-9:.0f} TFLOP/s) {best_fwd[1]}; "
          f"bwd {best_bwd[0]:.3f} ms ({2.5 * flops / best_bwd[0] * 1e-9:.0f} TFLOP/s) "
          f"dkdv {best_bwd[1]} dq {best_bwd[2]}", flush=True)  # fmt: skip
    return best_fwd[1], best_bwd[1], best_bwd[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tune_h200.json"))
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()

    from hyperrec.jagged_attn._triton import _configs

    cands = _configs.CANDIDATES
    heads = {h for (_, _, h) in BUCKETS.values()}
    jobs = [
        (kind, d, h, asdict(cfg))
        for kind, d, h in itertools.product(("fwd", "dkdv", "dq"), HEAD_DIMS, heads)
        for cfg in cands[kind]
    ]
    jobs += [(kind, d, h, {**c, "dq_atomic": True}) for kind, d, h, c in jobs if kind == "dkdv"]
    t0 = time.time()
    failed = {}
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
        for job, _, err in pool.map(_compile_job, jobs):
            if err:
                failed[(job[0], job[1], tuple(sorted(job[3].items())))] = err
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f}s; {len(failed)} failed",
          flush=True)  # fmt: skip

    results, table = [], {}
    for (bucket, (b, max_len, h)), d in itertools.product(BUCKETS.items(), HEAD_DIMS):
        best = _tune_one(bucket, b, max_len, h, d, failed, results)
        for softmax, causal in itertools.product((True, False), (True, False)):
            for kernel, cfg in zip(("fwd", "dkdv", "dq"), best):
                table[repr((kernel, "sm90", d, softmax, causal, bucket))] = asdict(cfg)
        torch.cuda.empty_cache()

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
    from hyperrec.testing import write_result

    write_result(args.out, {"benchmark": "jagged_attn tile tuning", "buckets": BUCKETS,
                            "failed": {repr(k): v for k, v in failed.items()},
                            "results": results, "table": table})  # fmt: skip
    print(f"wrote {args.out}")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
