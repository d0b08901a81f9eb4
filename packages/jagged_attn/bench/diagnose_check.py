"""What the default value check adds to a host-bound call with new offsets at every call.

``bench_validate.py`` measures the default (``validate=True``) against ``validate=False``;
``profile_host.py`` spreads the difference over functions under Python's profiler, which
inflates every call. This asks narrower questions on the short softmax cases, with a new
offsets object at every call (host time per call: calls back to back, the GPU queue
drained at the end):

* ``--variants``: the default against ``validate=False`` and against variants of the
  default patched in-process: the flag asserted by ``torch._assert_async`` instead of in
  the kernel (``flag_assert``), the schedule kernel compiled without debug mode
  (``nodebug``: the assert dropped, the check kept), ``validate=False`` with the schedule
  kernel compiled in debug mode (``none_debug``), the default without the cache of
  checked offsets (``nocache``: every call is checked, which with a new object at every
  call changes nothing but the bookkeeping: the cache's cost as an upper bound), and both
  modes with Python's garbage collector off (``*_nogc``). Modes alternate over rounds in
  a rotated order; the figure per variant is the median over rounds of its difference
  to ``validate=False`` in the same round. Each variant is also split into the GPU's time per call with the host's
  issue time hidden (``device_us``) and the host's time to issue a call (``issue_us``),
  from ``bench_attention.device_and_host`` (no L2 flush, calls back to back): the wall
  time above is the larger of the two where they overlap, and the split tells whether a
  difference is the host's or a kernel's.
* ``--stages``: inclusive host time per call of the functions on the call's path (timers
  wrapped around them, the same wrappers in both modes), default against
  ``validate=False``.

    python bench/diagnose_check.py --out DIR            # GPU, about a minute
    python bench/diagnose_check.py --out DIR --smoke    # CPU interpreter, tiny

``--smoke`` exercises the mechanics only: on CPU tensors the call takes the PyTorch
backend, so the schedule-kernel variants patch code that does not run there.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))

from bench_attention import device_and_host  # noqa: E402
from bench_validate import CASES, SMOKE, _call, case_inputs  # noqa: E402
from profile_host import _host_us  # noqa: E402

# bench_validate's short host-bound softmax cases
SHORT = [CASES[i] for i in (1, 2, 3)]


class _Patches:
    """Attribute patches applied around one variant's timing."""

    def __init__(self, items: list[tuple[Any, str, Any]], nogc: bool = False) -> None:
        self.items, self.nogc, self.saved = items, nogc, []

    def __enter__(self) -> None:
        self.saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self.items]
        for obj, name, value in self.items:
            setattr(obj, name, value)
        if self.nogc:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        for obj, name, value in self.saved:
            setattr(obj, name, value)
        if self.nogc:
            gc.enable()


def _variants() -> dict[str, tuple[bool, Callable[[], _Patches]]]:
    from hyperrec.jagged_attn import _validate
    from hyperrec.jagged_attn._triton import _tiles

    launch = _tiles.launch

    def relaunch(tag: str, options: dict[str, Any]) -> Callable[..., Any]:
        # its own launch key: a variant never replays another variant's compiled kernel
        def run(kernel, grid, key, args, kw, _options):  # type: ignore[no-untyped-def]
            return launch(kernel, grid, key + (tag,), args, kw, options)

        return run

    debug = dict(num_warps=8, debug=True, sanitize_overflow=False)
    return {
        "none": (False, lambda: _Patches([])),
        "default": (True, lambda: _Patches([])),
        "flag_assert": (True, lambda: _Patches([(_tiles, "_assert_options", lambda: None)])),
        "nodebug": (True, lambda: _Patches([(_tiles, "launch",
                                             relaunch("nodebug", dict(num_warps=8)))])),
        "none_debug": (False, lambda: _Patches([(_tiles, "launch", relaunch("debug", debug))])),
        "nocache": (True, lambda: _Patches([(_validate, "_already_checked",
                                             lambda tensors, scalars: False)])),
        "none_nogc": (False, lambda: _Patches([], nogc=True)),
        "default_nogc": (True, lambda: _Patches([], nogc=True)),
    }  # fmt: skip


def run_variants(case: tuple, device: str, rounds: int, calls: int) -> dict[str, Any]:
    kind, q, k, v, off, max_len, targets = case_inputs(case, device)
    variants = _variants()
    fns = {}
    for name, (mode, patches) in variants.items():

        def fn(mode: bool = mode) -> Any:
            return _call(kind, q, k, v, off.clone(), max_len, targets, mode)

        fns[name] = fn
        with patches():
            for _ in range(5):  # compile, fill the launch caches
                fn()
    names = list(variants)
    # per variant: wall, GPU and issue time (us per call), one reading per round
    samples = {n: {"wall": [], "device": [], "issue": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with variants[name][1]():
                wall = _host_us(fns[name], calls, device)
                split = device_and_host(fns[name], reps=calls, device=device, flush=False)
            row = samples[name]
            row["wall"].append(wall)
            row["device"].append(split["device_ms"] * 1e3)
            row["issue"].append(split["host_us"])

    def over_none(name: str, kind: str) -> float:
        pairs = zip(samples[name][kind], samples["none"][kind])
        return statistics.median([a - b for a, b in pairs])

    return {
        name: dict(
            median_us=statistics.median(s["wall"]),
            over_none_us=over_none(name, "wall"),
            rounds_us=s["wall"],
            device_us=statistics.median(s["device"]),
            device_over_none_us=over_none(name, "device"),
            issue_us=statistics.median(s["issue"]),
            issue_over_none_us=over_none(name, "issue"),
        )
        for name, s in samples.items()
    }


def _stage_targets() -> list[tuple[Any, str]]:
    from hyperrec.jagged_attn import interface
    from hyperrec.jagged_attn._triton import _launch, _tiles

    return [
        (interface, "_dispatch"),
        (interface, "value_check_mode"),
        (interface, "run_value_checks"),
        (interface, "set_pending_check"),
        (interface, "attention_triton_call"),
        (_launch, "take_pending_check"),
        (_launch, "forward_schedule"),
        (_launch, "tile_schedule"),
        (_launch, "_gluon_forward"),
        (_launch, "_launch_persistent"),
        (_tiles, "launch"),
    ]


def run_stages(case: tuple, device: str, rounds: int, calls: int) -> dict[str, Any]:
    kind, q, k, v, off, max_len, targets = case_inputs(case, device)
    totals: dict[str, int] = {}
    counts: dict[str, int] = {}
    items = []
    for obj, name in _stage_targets():
        real = getattr(obj, name)
        label = f"{obj.__name__.rsplit('.', 1)[-1]}.{name}"

        def timed(*a: Any, _real: Any = real, _label: str = label, **kw: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _real(*a, **kw)
            finally:
                totals[_label] = totals.get(_label, 0) + time.perf_counter_ns() - t0
                counts[_label] = counts.get(_label, 0) + 1

        items.append((obj, name, timed))
    per: dict[str, dict[str, list[float]]] = {"False": {}, "True": {}}
    with _Patches(items):
        for mode in (False, True):
            for _ in range(5):
                _call(kind, q, k, v, off.clone(), max_len, targets, mode)
        for r in range(rounds):
            for mode in (False, True) if r % 2 == 0 else (True, False):
                totals.clear()
                counts.clear()
                host = _host_us(
                    lambda m=mode: _call(kind, q, k, v, off.clone(), max_len, targets, m),
                    calls,
                    device,
                )
                row = per[str(mode)]
                row.setdefault("call (host us)", []).append(host)
                for label, ns in totals.items():
                    row.setdefault(label, []).append(ns / calls / 1e3)
                    row.setdefault(label + " (calls)", []).append(counts[label] / calls)
    out: dict[str, Any] = {}
    for label in sorted(set(per["False"]) | set(per["True"])):
        none = statistics.median(per["False"][label]) if label in per["False"] else 0.0
        default = statistics.median(per["True"][label]) if label in per["True"] else 0.0
        out[label] = dict(none=none, default=default, difference=default - none)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON directory")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300, help="calls per timing")
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--no-stages", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny case, CPU interpreter")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error(f"--rounds and --calls must be >= 1, got {args.rounds} and {args.calls}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from hyperrec.jagged_attn import interface

        # the default's device-mode check on CPU tensors, as on CUDA ones
        def device_mode(validate: Any, device: Any) -> str:
            return "device" if validate is True else "none"

        args.rounds, args.calls = 2, 3
        with _Patches([(interface, "value_check_mode", device_mode)]):
            return _run(args, SMOKE[:1], "cpu")
    if not torch.cuda.is_available():
        sys.exit("diagnose_check.py needs a CUDA GPU (or --smoke)")
    return _run(args, SHORT, "cuda")


def _run(args: argparse.Namespace, cases: list[tuple], device: str) -> int:
    from hyperrec.testing import write_result

    result: dict[str, Any] = {"device": device, "calls": args.calls, "rounds": args.rounds,
                              "cases": {}}  # fmt: skip
    for case in cases:
        row: dict[str, Any] = {}
        if not args.no_variants:
            row["variants"] = run_variants(case, device, args.rounds, args.calls)
            for n, v in row["variants"].items():
                print(f"{case[0]:32s} {n:13s} wall {v['median_us']:7.1f} "
                      f"({v['over_none_us']:+6.1f}) gpu {v['device_us']:7.1f} "
                      f"({v['device_over_none_us']:+6.1f}) issue {v['issue_us']:7.1f} "
                      f"({v['issue_over_none_us']:+6.1f}) us", flush=True)  # fmt: skip
        if not args.no_stages:
            row["stages"] = run_stages(case, device, args.rounds, args.calls)
            for label, s in row["stages"].items():
                if "(calls)" not in label:
                    print(f"  {label:40s} none {s['none']:7.1f} default {s['default']:7.1f} "
                          f"diff {s['difference']:+6.1f}", flush=True)  # fmt: skip
        result["cases"][case[0]] = row
    name = "diagnose_check_smoke.json" if args.smoke else "diagnose_check.json"
    path = write_result(args.out / name, {
        "benchmark": "jagged_attn: host time the default value check adds per call, new "
                     "offsets at every call (variants and per-stage timers)",
        **result,
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
