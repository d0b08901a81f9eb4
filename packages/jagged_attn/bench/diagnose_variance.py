"""Why does the forward's throughput change between fresh instances of one case?

Issue: re-creating q/k/v or the offsets of one length distribution moved the causal
forward between 105 and 220 TFLOP/s on an H200, while re-timing the same tensors was
stable. Each hypothesis below is tested directly, on the same case, in one run; every
number goes to JSON (``--out``), a summary to stdout.

* ``instances``: fresh lengths, offsets and tensors (seeds 0..N-1), with what the launcher
  chose for each (configuration, grid, occupancy, compiled-kernel count) and the load
  imbalance the static schedule predicts (cost model of ``_schedule.py``).
* ``same_data_new_allocations``: the very same values copied into newly allocated tensors
  (addresses change, nothing else).
* ``base_alignment``: the same values at base-pointer offsets of 0, 8, 16, 128, 1 Ki,
  64 Ki and 2 Mi bytes inside a larger buffer (8 is below the 16-byte alignment tensor
  descriptors need: the launcher drops TMA there, recorded).
* ``new_offsets_objects``: the same lengths in new offsets tensors (the schedule cache is
  keyed by tensor object: first call builds, later calls hit), with the first (cold) call
  timed separately.
* ``length_order``: the same multiset of lengths, sorted both ways and shuffled.
* ``occupancy``: the persistent grid with the measured occupancy and forced to 1 and 2
  programs per SM (a grid larger than what is resident runs a second wave).
* ``schedule``: the shipped static cost-sorted schedule against the opt-in
  ``dynamic_schedule`` (atomic work counter) and ``work_order="sequence"`` (a sequence's
  tiles together, for K/V reuse in L2), on several instances.
* ``l2``: with the L2 flushed before every call (``do_bench``) and back-to-back calls.
* GPU clocks / temperature around the run (if pynvml is present).

Then (section ``fixes``, first in the run) one check per fix of round 2, each with its
criterion and ``confirmed``: the spread of the GPU's time over fresh instances of the
quick benchmark's small cases (the do_bench spread was host-bound), the host's time per
call at each layer (public API, eager path, custom op, launcher; SDPA and a bare Triton
launch for scale), the default checks' host cost on a new offsets object, and misaligned
inputs through the public API (copied) against the kernel given them directly.

    python bench/diagnose_variance.py --out bench/results          # <= 8 minutes on one H200
    python bench/diagnose_variance.py --out /tmp/d --quick         # <= 3 minutes
    python bench/diagnose_variance.py --out /tmp/d --fixes-only    # ~1 minute: "fixes" only
    python bench/diagnose_variance.py --explain RESULT.json --out D  # CPU: per-instance
                                              # launcher decisions of a benchmark run

(Estimates; no new case starts after ``--budget-min`` minutes, 6 or 2 with ``--quick``, and
the JSON lists cases left out under ``skipped_for_time``.)
    python bench/diagnose_variance.py --out /tmp/d --smoke         # CPU interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))

from bench_attention import Case, call_of, lengths, useful_flops  # noqa: E402
from bench_attention import _spec as spec_of  # noqa: E402

FULL = [
    Case("u-B64-L2048-H8-D128-causal", "uniform", 64, 2048, 8, 128, causal=True),
    Case("u-B128-L1024-H8-D128", "uniform", 128, 1024, 8, 128),
    Case("p-B1024-L1024-H4-D128", "powerlaw", 1024, 1024, 4, 128),
]
QUICK = FULL[:2]
SMOKE = [Case("smoke-causal", "uniform", 3, 40, 1, 16, causal=True)]


class Timer:
    """Median ms of ``fn``: ``do_bench`` (L2 flushed before each call) on a GPU, wall clock
    under the interpreter."""

    def __init__(self, device: str, rep_ms: int) -> None:
        self.device, self.rep_ms = device, rep_ms

    def __call__(self, fn, flush: bool = True) -> float:
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if flush:
            from triton.testing import do_bench

            return do_bench(fn, warmup=5, rep=self.rep_ms, return_mode="median")
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def cold(self, fn) -> float:
        """One call's time, nothing warmed for it (events on a GPU)."""
        if self.device != "cuda":
            return self(fn)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def instance(case: Case, seed: int, device: str, lens: torch.Tensor | None = None) -> dict:
    """Fresh lengths (unless given), offsets and q/k/v of ``case``."""
    lens = lengths(case.dist, case.batch, case.max_len, seed) if lens is None else lens
    off = torch.zeros(case.batch + 1, dtype=torch.int32)
    off[1:] = lens.cumsum(0)
    t = int(lens.sum())
    g = torch.Generator(device=device).manual_seed(1000 + seed)
    q, k, v = (torch.randn(t, case.heads, case.head_dim, device=device, dtype=torch.bfloat16,
                           generator=g) for _ in range(3))  # fmt: skip
    flops = useful_flops(lens, case.heads, case.head_dim, case.causal or case.kind != "softmax")
    return dict(lens=lens, off=off.to(device), q=q, k=k, v=v, flops=flops)


def forward_fn(case: Case, inst: dict, config=None):
    from hyperrec.jagged_attn._triton import attention_forward

    call = call_of(spec_of(case, case.max_len), inst["q"], inst["k"], inst["v"], inst["off"])
    return lambda: attention_forward(call, config=config)


def shipped_config(case: Case, device: str):
    from hyperrec.jagged_attn._triton import _configs, _launch

    arch = _launch._arch(torch.device(device))
    key = _configs.config_key("fwd", arch, case.head_dim, case.kind == "softmax",
                              case.causal or case.kind != "softmax", case.max_len)  # fmt: skip
    return _configs.select_config(key)


def compiled_count() -> int:
    """Compiled variants of the forward kernel held by Triton (any version's cache layout)."""
    from hyperrec.jagged_attn._triton import _kernels

    fn = _kernels._fwd_kernel
    caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", {})
    total = 0
    for c in caches.values():
        total += len(c[0] if isinstance(c, tuple) else c)
    return total


class LaunchLog:
    """Records the forward launches' work bound, occupancy and key (wraps the launcher)."""

    def __init__(self) -> None:
        from hyperrec.jagged_attn._triton import _launch

        self.launch = _launch
        self.real = _launch._launch_persistent
        self.last: dict = {}

        def wrapped(kernel, work, device, cfg, key, args, kw):
            if key[0] == "fwd":
                occ = _launch._OCCUPANCY.get(key, 1)
                self.last = dict(work_upper_bound=work, occupancy=occ,
                                 grid=max(1, min(work, _launch._num_sms(device) * occ)),
                                 tma=kw.get("TMA"), dynamic=kw.get("DYNAMIC"), key=key)  # fmt: skip
            return self.real(kernel, work, device, cfg, key, args, kw)

        _launch._launch_persistent = wrapped

    def fwd_keys(self) -> list:
        return [k for k in self.launch._OCCUPANCY if k[0] == "fwd"]


def predicted_imbalance(case: Case, inst: dict, cfg, programs: int) -> dict:
    """max/mean of per-program work under the static snake assignment and under greedy
    list scheduling, from the schedule's own cost model (keys visited + block_m)."""
    import heapq

    from hyperrec.jagged_attn._triton._schedule import q_tile_schedule

    causal = case.causal or case.kind != "softmax"
    off = inst["off"].cpu()
    seq, idx, total = q_tile_schedule(off, off, None, cfg.block_m, causal, int(off[-1]),
                                      cfg.work_order)  # fmt: skip
    n = int(total)
    lens = inst["lens"].long()
    s, i = seq[:n].long(), idx[:n].long()
    keys = lens[s]
    if causal:
        keys = torch.minimum((i + 1) * cfg.block_m, lens[s]).clamp(min=0)
    cost = (keys + cfg.block_m).double().repeat_interleave(case.heads)  # heads vary fastest
    items = cost.numel()
    p = max(1, min(programs, items))
    r = torch.arange(items) // p
    pos = torch.arange(items) % p
    prog = torch.where(r % 2 == 0, pos, p - 1 - pos)
    per = torch.zeros(p, dtype=torch.float64).index_add_(0, prog, cost)
    heap = [0.0] * p
    for c in cost.tolist():
        heapq.heapreplace(heap, heap[0] + c)
    mean = float(cost.sum()) / p
    return dict(
        items=items,
        programs=p,
        static_max_over_mean=float(per.max()) / mean,
        greedy_max_over_mean=max(heap) / mean,
    )


def gpu_state() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return dict(sm_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                    mem_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                    temperature_c=pynvml.nvmlDeviceGetTemperature(h, 0),
                    power_w=pynvml.nvmlDeviceGetPowerUsage(h) / 1000)  # fmt: skip
    except Exception as e:  # pynvml missing or no permission: recorded, not fatal
        return dict(error=f"{type(e).__name__}: {e}"[:200])


def run_case(case: Case, args, device: str, timer: Timer, log: LaunchLog) -> dict:
    out: dict = dict(case=asdict(case))
    cfg = shipped_config(case, device)
    out["shipped_config"] = asdict(cfg)
    n_inst = 2 if args.smoke else (4 if args.quick else 8)

    def tflops(inst, ms):
        return inst["flops"] / ms * 1e-9

    # instances
    rows = []
    for seed in range(n_inst):
        before = compiled_count()
        inst = instance(case, seed, device)
        fn = forward_fn(case, inst)
        cold = timer.cold(fn)
        ms = timer(fn)
        launch = dict(log.last)
        launch.pop("key", None)
        rows.append(dict(seed=seed, tokens=int(inst["lens"].sum()), ms=ms,
                         tflops=tflops(inst, ms), first_call_ms=cold,
                         new_compiled_kernels=compiled_count() - before, launch=launch,
                         predicted=predicted_imbalance(case, inst, cfg, launch.get("grid", 1))))  # fmt: skip
        del inst
    out["instances"] = rows
    tf = [r["tflops"] for r in rows]
    out["instances_spread"] = max(tf) / min(tf)

    base = instance(case, 0, device)
    base_fn = forward_fn(case, base)
    base_fn()
    base_ms = timer(base_fn)
    out["base"] = dict(ms=base_ms, tflops=tflops(base, base_ms))

    # same values, new allocations
    realloc = []
    keep = []
    for i in range(2 if args.smoke else 4):
        keep.append(torch.empty(1 << (20 + i), dtype=torch.uint8, device=device))  # move the
        copy = dict(base, q=base["q"].clone(), k=base["k"].clone(), v=base["v"].clone())  # heap
        ms = timer(forward_fn(case, copy))
        realloc.append(dict(ms=ms, tflops=tflops(base, ms),
                            ptr_mod_2mib=[t.data_ptr() % (2 << 20) for t in
                                          (copy["q"], copy["k"], copy["v"])]))  # fmt: skip
    out["same_data_new_allocations"] = realloc
    del keep

    # base-pointer alignment
    align = []
    for shift in (0, 8, 16, 128) if args.smoke else (0, 8, 16, 128, 1024, 65536, 2 << 20):
        moved = {}
        for name in ("q", "k", "v"):
            t = base[name]
            buf = torch.empty(t.numel() * 2 + shift + 64, dtype=torch.uint8, device=device)
            view = buf[shift : shift + t.numel() * 2].view(torch.bfloat16).view(t.shape)
            view.copy_(t)
            moved[name] = view
        ms = timer(forward_fn(case, dict(base, **moved)))
        align.append(dict(shift_bytes=shift, ms=ms, tflops=tflops(base, ms),
                          tma=log.last.get("tma")))  # fmt: skip
    out["base_alignment"] = align

    # new offsets objects with the same values
    offs = []
    for _ in range(2 if args.smoke else 3):
        fresh = dict(base, off=base["off"].clone())
        fn = forward_fn(case, fresh)
        cold = timer.cold(fn)
        ms = timer(fn)
        offs.append(dict(first_call_ms=cold, ms=ms, tflops=tflops(base, ms)))
    out["new_offsets_objects"] = offs

    # order of the same lengths
    orders = []
    lens = base["lens"]
    perms = {"descending": torch.argsort(lens, descending=True),
             "ascending": torch.argsort(lens)}  # fmt: skip
    for j in range(1 if args.smoke else 3):
        perms[f"shuffle{j}"] = torch.randperm(lens.numel(), generator=torch.Generator()
                                              .manual_seed(j))  # fmt: skip
    for name, perm in perms.items():
        inst = instance(case, 0, device, lens=lens[perm].clone())
        ms = timer(forward_fn(case, inst))
        orders.append(dict(order=name, ms=ms, tflops=tflops(inst, ms)))
    out["length_order"] = orders

    # occupancy: measured, forced 1 and 2
    occ = []
    keys = log.fwd_keys()
    measured = {k: log.launch._OCCUPANCY[k] for k in keys}
    out["occupancy_measured"] = sorted(set(measured.values()))
    if device == "cuda":
        for key, compiled in log.launch._COMPILED.items():
            if key in measured:
                try:
                    out["compiled"] = dict(n_regs=int(compiled.n_regs),
                                           n_spills=int(compiled.n_spills),
                                           shared=int(compiled.metadata.shared))  # fmt: skip
                except Exception as e:  # recorded, not fatal
                    out["compiled"] = dict(error=f"{type(e).__name__}: {e}"[:200])
        for forced in (1, 2):
            for k in keys:
                log.launch._OCCUPANCY[k] = forced
            ms = timer(base_fn)
            occ.append(dict(programs_per_sm=forced, ms=ms, tflops=tflops(base, ms)))
        log.launch._OCCUPANCY.update(measured)
    out["occupancy"] = occ

    # schedule variants on several instances
    variants = {
        "shipped": cfg,
        "dynamic": replace(cfg, dynamic_schedule=True),
        "sequence_order": replace(cfg, work_order="sequence"),
        "dynamic_sequence_order": replace(cfg, dynamic_schedule=True, work_order="sequence"),
    }
    if args.quick or args.smoke:
        variants.pop("dynamic_sequence_order")
    sched = []
    for seed in range(2 if (args.quick or args.smoke) else 4):
        inst = instance(case, seed, device)
        row = dict(seed=seed)
        for name, c in variants.items():
            fn = forward_fn(case, inst, c)
            fn()
            row[name] = tflops(inst, timer(fn))
        sched.append(row)
        del inst
    out["schedule"] = sched

    # L2: flushed before every call vs back to back
    out["l2"] = dict(flushed_tflops=tflops(base, timer(base_fn, flush=True)),
                     back_to_back_tflops=tflops(base, timer(base_fn, flush=False)))  # fmt: skip
    return out


def summary(r: dict) -> str:
    inst = [x["tflops"] for x in r["instances"]]
    sched = r["schedule"]
    names = [k for k in sched[0] if k != "seed"]
    sched_txt = " ".join(
        f"{n}={min(s[n] for s in sched):.0f}-{max(s[n] for s in sched):.0f}" for n in names
    )
    return (
        f"{r['case']['name']}: instances {min(inst):.0f}-{max(inst):.0f} TFLOP/s "
        f"(spread {r['instances_spread']:.2f}); realloc "
        f"{[round(x['tflops']) for x in r['same_data_new_allocations']]}; align "
        f"{[(x['shift_bytes'], round(x['tflops'])) for x in r['base_alignment']]}; order "
        f"{[(x['order'], round(x['tflops'])) for x in r['length_order']]}; occupancy "
        f"{r['occupancy_measured']} forced {[(x['programs_per_sm'], round(x['tflops'])) for x in r['occupancy']]}; "
        f"schedule {sched_txt}; l2 {r['l2']['flushed_tflops']:.0f}/"
        f"{r['l2']['back_to_back_tflops']:.0f}"
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# The fixes of round 2, each checked on the GPU (section "fixes" of the JSON)
# ---------------------------------------------------------------------------------------

# The two quick-benchmark cases that lost to FlexAttention with a 2x spread (2026-12-01).
FIX_CASES = [
    Case("u-B64-L1024-H4-D128", "uniform", 64, 1024, 4, 128),
    Case("tiny-u-B2048-L64-H4-D128", "uniform", 2048, 64, 4, 128),
]
SMOKE_FIX_CASES = [Case("smoke-u-B3-L40-H1-D16", "uniform", 3, 40, 1, 16)]


def public_fn(case: Case, inst: dict, *, validate=True, off=None, qkv=None):
    """The public forward on an instance (the path the benchmark times)."""
    from hyperrec.jagged_attn import jagged_attention

    q, k, v = qkv if qkv is not None else (inst["q"], inst["k"], inst["v"])
    off = inst["off"] if off is None else off
    backend = "auto" if q.device.type == "cuda" else "triton"
    return lambda: jagged_attention(q, k, v, off, case.max_len, causal=case.causal,
                                    validate=validate, backend=backend)  # fmt: skip


def _spread(values: list[float]) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def _misaligned(t: torch.Tensor, shift: int) -> torch.Tensor:
    buf = torch.empty(t.numel() * t.element_size() + shift + 64, dtype=torch.uint8,
                      device=t.device)  # fmt: skip
    view = buf[shift : shift + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return view.copy_(t)


def check_fixes(args, device: str, timer: Timer) -> dict:
    """One GPU check per fix; each entry says what it measured and ``confirmed``."""
    from bench_attention import device_and_host, first_call_ms

    from hyperrec.jagged_attn._opschema import AttentionCall
    from hyperrec.jagged_attn._triton._launch import attention_forward
    from hyperrec.jagged_attn._triton.ops import attention_triton, attention_triton_fwd

    cases = SMOKE_FIX_CASES if args.smoke else FIX_CASES
    n_inst = 2 if args.smoke else 5
    out: dict = {}

    # 1. The 2x spread came from host-bound timing: per fresh instance, do_bench (host
    #    counts) against the GPU's time alone, and the host's time per call.
    host_bound = {}
    for case in cases:
        warm = instance(case, 99, device)  # compile outside the first-call timings
        public_fn(case, warm)()
        del warm
        rows = []
        for seed in range(n_inst):
            inst = instance(case, seed, device)
            fn = public_fn(case, inst)
            first = first_call_ms(fn, device)  # schedules + checks for this offsets object
            ms = timer(fn)
            dh = device_and_host(fn, device=device)
            rows.append(dict(seed=seed, flops=inst["flops"], first_call_ms=first, ms=ms,
                             tflops=inst["flops"] / ms * 1e-9, **dh,
                             device_tflops=inst["flops"] / dh["device_ms"] * 1e-9))  # fmt: skip
            del inst
        spread_dev = _spread([r["device_tflops"] for r in rows])
        host = statistics.median(r["host_us"] for r in rows)
        dev = statistics.median(r["device_ms"] for r in rows) * 1e3
        host_bound[case.name] = dict(
            instances=rows, spread_do_bench=_spread([r["tflops"] for r in rows]),
            spread_device=spread_dev, host_us_median=host, device_us_median=dev,
            criterion="GPU-time spread <= 1.10 over fresh instances",
            confirmed=spread_dev <= 1.10,
        )  # fmt: skip
    out["host_bound_timing"] = host_bound

    # 2. Host time per call, by layer: public API (default checks, and none), the eager
    #    path below it, the custom op, the launcher; a torch op and one small Triton launch
    #    for scale.
    case = cases[0]
    inst = instance(case, 0, device)
    call = call_of(spec_of(case, case.max_len), inst["q"], inst["k"], inst["v"], inst["off"])
    op_args = call.op_args()
    from hyperrec.jagged_attn._triton._checks import values_ok

    off = inst["off"]
    pad = torch.zeros(1, case.heads, 64, case.head_dim, device=device, dtype=torch.bfloat16)
    layers = {
        "public_default": public_fn(case, inst),
        "public_validate_false": public_fn(case, inst, validate=False),
        "eager_path": lambda: attention_triton(*op_args),
        "custom_op": lambda: attention_triton_fwd(*op_args),
        "launcher": lambda: attention_forward(call),
        "torch_sdpa_64_tokens": lambda: torch.nn.functional.scaled_dot_product_attention(
            pad, pad, pad),
        "triton_launch_small_kernel": lambda: values_ok(
            inst["q"].shape[0], inst["q"].shape[0], off, off, case.max_len, case.max_len,
            None, None),
    }  # fmt: skip
    for fn in layers.values():
        fn()
    host_us = {name: device_and_host(fn, device=device)["host_us"] for name, fn in layers.items()}
    # the direct relaunch (_triton/_direct.py, on by default): the public call without it
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._direct import DIRECT_ENV

    before = os.environ.get(DIRECT_ENV)
    os.environ[DIRECT_ENV] = "0"
    try:
        fn = layers["public_default"]
        host_us["public_default_without_direct_launch"] = device_and_host(
            fn, device=device)["host_us"]  # fmt: skip
    finally:
        if before is None:
            os.environ.pop(DIRECT_ENV, None)
        else:
            os.environ[DIRECT_ENV] = before
    host_us["direct_launch_replayable"] = float(
        bool(_direct.RELAUNCH) and all(r.ok for r in _direct.RELAUNCH.values())
    )
    out["host_us_per_call"] = dict(
        case=case.name, **host_us,
        criterion="the public call's host time below its GPU time at this case",
        device_us=host_bound[case.name]["device_us_median"],
        confirmed=host_us["public_default"] < host_bound[case.name]["device_us_median"],
    )  # fmt: skip

    # 3. A new offsets object (a new batch): first call (schedules + value checks) against
    #    the cached call, with the default checks and without; the checks' share.
    fresh: dict = {}
    for validate in (True, False):
        firsts, cached, hosts = [], [], []
        for _ in range(n_inst):
            fn = public_fn(case, inst, validate=validate, off=off.clone())
            firsts.append(first_call_ms(fn, device))
            cached.append(first_call_ms(fn, device))
        # host time of a call with a new offsets object each time (the clone is in both)
        hosts.append(device_and_host(lambda v=validate: public_fn(
            case, inst, validate=v, off=off.clone())(), device=device)["host_us"])  # fmt: skip
        fresh[str(validate)] = dict(first_call_ms=statistics.median(firsts),
                                    cached_call_ms=statistics.median(cached),
                                    fresh_call_host_us=hosts[0])  # fmt: skip
    check_us = fresh["True"]["fresh_call_host_us"] - fresh["False"]["fresh_call_host_us"]
    out["fresh_offsets"] = dict(
        case=case.name, **fresh, checks_host_us=check_us,
        checks_over_device_time=check_us / host_bound[case.name]["device_us_median"],
        criterion="the default checks cost <= 5% of the call's GPU time on a new batch",
        confirmed=check_us <= 0.05 * host_bound[case.name]["device_us_median"],
    )  # fmt: skip

    # 4. Misaligned q/k/v (8 bytes off): the public API copies them (the launcher, given
    #    them directly, shows the slow kernel variant they used to get).
    moved = tuple(_misaligned(inst[n], 8) for n in ("q", "k", "v"))
    timings = {
        "aligned_public": public_fn(case, inst),
        "misaligned_public": public_fn(case, inst, qkv=moved),
        "misaligned_launcher": lambda: attention_forward(AttentionCall(
            q=moved[0], k=moved[1], v=moved[2], q_offsets=off, kv_offsets=off, kv_index=None,
            num_targets=None, spec=call.spec)),
    }  # fmt: skip
    align = {}
    for name, fn in timings.items():
        fn()
        align[name] = device_and_host(fn, device=device)["device_ms"]
    ref = timings["aligned_public"]()
    exact = bool(torch.equal(timings["misaligned_public"](), ref))
    ratio = align["misaligned_public"] / align["aligned_public"]
    out["misaligned_inputs"] = dict(
        case=case.name, device_ms=align, misaligned_over_aligned=ratio,
        misaligned_launcher_over_aligned=align["misaligned_launcher"] / align["aligned_public"],
        same_output=exact,
        criterion="misaligned within 1.6x of aligned (three copies), below the kernel's "
                  "own misaligned time, same output",
        confirmed=exact and ratio <= 1.6 and align["misaligned_public"]
        < align["misaligned_launcher"],
    )  # fmt: skip
    return out


def fixes_summary(f: dict) -> str:
    hb = "; ".join(f"{n}: GPU spread {r['spread_device']:.2f} (do_bench {r['spread_do_bench']:.2f}), "
                   f"host {r['host_us_median']:.0f} us vs GPU {r['device_us_median']:.0f} us"
                   for n, r in f["host_bound_timing"].items())  # fmt: skip
    h = f["host_us_per_call"]
    fo = f["fresh_offsets"]
    m = f["misaligned_inputs"]
    return (f"fixes: {hb}\n  host us/call: " + ", ".join(
        f"{k}={v:.0f}" for k, v in h.items() if isinstance(v, float)) +
        f"\n  new offsets: first call {fo['True']['first_call_ms']:.2f} ms vs cached "
        f"{fo['True']['cached_call_ms']:.2f}; checks {fo['checks_host_us']:.0f} us host "
        f"({fo['checks_over_device_time']:.1%} of the GPU time)\n  misaligned: "
        f"{m['misaligned_over_aligned']:.2f}x aligned (kernel alone "
        f"{m['misaligned_launcher_over_aligned']:.2f}x), same output {m['same_output']}\n"
        f"  confirmed: " + str({k: v.get("confirmed") if "confirmed" in v else
                              {n: r["confirmed"] for n, r in v.items()}
                              for k, v in f.items()}))  # fmt: skip


# ---------------------------------------------------------------------------------------
# --explain: what the launcher does for each instance of a committed benchmark run (CPU)
# ---------------------------------------------------------------------------------------


def _corr(xs: list[float], ys: list[float]) -> float | None:
    import statistics

    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


# The forward kernel's integer arguments (launcher order) and whether Triton specialises
# them (a value divisible by 16, or equal to 1, selects another compiled variant).
def _fwd_int_args(tokens: int, heads: int, head_dim: int) -> dict[str, int]:
    hd = heads * head_dim
    return dict(stride_qt=hd, stride_qh=head_dim, stride_kt=hd, stride_kh=head_dim,
                stride_vt=hd, stride_vh=head_dim, stride_ot=hd, stride_oh=head_dim,
                stride_lh=tokens, n_q_rows=tokens, n_kv_rows=tokens)  # fmt: skip


def explain_instances(result: dict, num_sms: int = 132, programs_per_sm: int = 1) -> dict:
    """For every instance of a ``bench_attention.py`` result: what the launcher chose and
    computed (configuration, length bucket, tiles, work items, persistent grid, rounds,
    static load imbalance, the specialisation key of the forward's integer arguments) and
    the correlation of each quantity with the measured per-instance times. CPU only: the
    lengths are regenerated with the benchmark's own generator from the recorded seeds."""
    from hyperrec.jagged_attn._triton import _configs, _kernels
    from hyperrec.jagged_attn._triton._schedule import work_upper_bound

    not_specialised = set(_kernels.FWD_NOT_SPECIALISED)
    cases = []
    for c in result["cases"]:
        case = Case(**{k: c[k] for k in ("name", "dist", "batch", "max_len", "heads",
                                          "head_dim", "causal", "kind")})  # fmt: skip
        causal = case.causal or case.kind != "softmax"
        cfg = _configs.select_config(_configs.config_key(
            "fwd", "sm90", case.head_dim, case.kind == "softmax", causal, case.max_len))  # fmt: skip
        rows = []
        for inst in c["instances"]:
            lens = lengths(case.dist, case.batch, case.max_len, inst["seed"])
            tokens = int(lens.sum())
            assert tokens == inst["tokens"], "the generator no longer reproduces the run"
            tiles = int(((lens + cfg.block_m - 1) // cfg.block_m).sum())
            items = tiles * case.heads
            bound = work_upper_bound(tokens, case.batch, cfg.block_m) * case.heads
            grid = max(1, min(bound, num_sms * programs_per_sm))
            ints = _fwd_int_args(tokens, case.heads, case.head_dim)
            spec_key = tuple((n, v % 16 == 0, v == 1) for n, v in ints.items()
                             if n not in not_specialised)  # fmt: skip
            pred = predicted_imbalance(case, dict(off=_offsets(lens), lens=lens), cfg, grid)
            row = dict(seed=inst["seed"], tokens=tokens, flops_fwd=inst["flops_fwd"],
                       max_len=int(lens.max()),
                       bucket=_configs.config_key("fwd", "sm90", case.head_dim, True, causal,
                                                  case.max_len)[-1],
                       tiles=tiles, work_items=items, work_upper_bound=bound, grid=grid,
                       rounds=-(-items // grid), static_max_over_mean=pred["static_max_over_mean"],
                       tokens_mod_16=tokens % 16, specialisation_key=str(spec_key))  # fmt: skip
            row.update({k: v for k, v in inst.items() if k.endswith("_ms")})
            rows.append(row)
        timed = sorted({k for r in rows for k in r if k.endswith("_ms")})
        numeric = ("tokens", "flops_fwd", "tiles", "work_items", "rounds",
                   "static_max_over_mean", "tokens_mod_16")  # fmt: skip
        corr = {t: {q: _corr([float(r[q]) for r in rows], [r[t] for r in rows])
                    for q in numeric} for t in timed}  # fmt: skip
        ms = [r["hyperrec/fwd_ms"] for r in rows if "hyperrec/fwd_ms" in r]
        # host-bound timings share the host's noise: compare ours with every other column
        between = {t: _corr([r["hyperrec/fwd_ms"] for r in rows], [r[t] for r in rows])
                   for t in timed if t != "hyperrec/fwd_ms"} if ms else {}  # fmt: skip
        cases.append(dict(
            name=case.name, shipped_fwd_config=asdict(cfg), instances=rows,
            distinct=dict(config=1, bucket=len({r["bucket"] for r in rows}),
                          specialisation_key=len({r["specialisation_key"] for r in rows}),
                          grid=len({r["grid"] for r in rows})),
            correlation_with_time=corr,
            correlation_hyperrec_fwd_ms_with=between,
            hyperrec_fwd_ms=dict(min=min(ms), max=max(ms)) if ms else None,
            gflop_fwd=dict(min=min(r["flops_fwd"] for r in rows) * 1e-9,
                           max=max(r["flops_fwd"] for r in rows) * 1e-9),
        ))  # fmt: skip
    return dict(source_machine=result.get("machine"), num_sms=num_sms,
                programs_per_sm=programs_per_sm, cases=cases)  # fmt: skip


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    off = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    return off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="JSON directory")
    parser.add_argument("--quick", action="store_true", help="two cases, fewer instances")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no new case after this many minutes (default 6; 2 with "
                             "--quick)")  # fmt: skip
    parser.add_argument("--fixes-only", action="store_true",
                        help="only the checks of the round-2 fixes (~1 minute)")  # fmt: skip
    parser.add_argument("--explain", type=Path, default=None,
                        help="CPU only: explain the per-instance times of this "
                             "bench_attention.py JSON (writes explain_<name>.json)")  # fmt: skip
    args = parser.parse_args()
    budget = args.budget_min if args.budget_min is not None else (2.0 if args.quick else 6.0)
    from hyperrec.testing import write_result

    if args.explain is not None:
        import json

        report = explain_instances(json.loads(args.explain.read_text()))
        for c in report["cases"]:
            corr = c["correlation_with_time"].get("hyperrec/fwd_ms", {})
            print(f"{c['name']}: hyperrec fwd {c['hyperrec_fwd_ms']} ms, "
                  f"{c['gflop_fwd']['min']:.1f}-{c['gflop_fwd']['max']:.1f} GFLOP; distinct "
                  f"{c['distinct']}; corr(fwd ms, .) "
                  f"{ {k: None if v is None else round(v, 2) for k, v in corr.items()} }")  # fmt: skip
        path = write_result(args.out / f"explain_{args.explain.stem}.json", {
            "benchmark": f"per-instance launcher decisions for {args.explain.name} "
                         "(computed on the CPU from the recorded seeds)",
            **report,
        })  # fmt: skip
        print(f"wrote {path}")
        return

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, cases, timer = "cpu", SMOKE, Timer("cpu", 0)
    else:
        if not torch.cuda.is_available():
            sys.exit("diagnose_variance.py needs a CUDA GPU (or --smoke)")
        device, cases = "cuda", QUICK if args.quick else FULL
        timer = Timer("cuda", 25 if args.quick else 40)
    random.seed(0)
    torch.manual_seed(0)
    log = LaunchLog()
    t0 = time.perf_counter()
    results = []
    suffix = "smoke" if args.smoke else ("quick" if args.quick else "h200")
    path = args.out / f"diagnose_variance_{suffix}.json"
    state_before = gpu_state() if device == "cuda" else {}
    skipped = []
    fixes: dict = {}

    def save():
        write_result(path, {
            "benchmark": "jagged_attn forward: variance between fresh instances, by hypothesis",
            "device": device,
            "gpu_state_before": state_before,
            "gpu_state_after": gpu_state() if device == "cuda" else {},
            "seconds": time.perf_counter() - t0,
            "skipped_for_time": skipped,
            "fixes": fixes,
            "cases": results,
        })  # fmt: skip

    try:
        fixes.update(check_fixes(args, device, timer))
        print(fixes_summary(fixes), flush=True)
    except Exception as e:  # recorded; the hypothesis cases still run
        fixes["error"] = f"{type(e).__name__}: {e}"[:800]
        print(f"fixes check failed: {fixes['error']}", flush=True)
    save()
    for case in [] if args.fixes_only else cases:
        if time.perf_counter() - t0 > 60 * budget:
            skipped.append(case.name)
            continue
        results.append(run_case(case, args, device, timer, log))
        print(summary(results[-1]), flush=True)
        save()
    print(f"{time.perf_counter() - t0:.0f}s; wrote {path}")


if __name__ == "__main__":
    main()
