"""The sequence layer's two compiled regions with bf16 or row-wise FP8 projections.

Times, forward + backward, the model's own region functions (``_project_region``: layer
norm, the ``dim -> 4 dim`` projection, SiLU, split; ``_gate_region``: layer norm, gate,
the ``dim -> dim`` projection, residual) compiled as the model compiles them, with the
parameters as ``nn.Parameter`` s (static widths, as in the model) and the token count
dynamic. Variants: ``bf16`` (``F.linear``), ``fp8`` (what ``seq_linear_precision="fp8"``
runs: FP8 forward in the projection, FP8 forward and dgrad in the gate) and, for the
projection, ``fp8_dgrad`` (its dgrad in FP8 too, which the model does not use).

Each case: ``--instances`` freshly drawn inputs, ``--reps`` timed calls each (CUDA
events), median and minimum over all calls. The bf16 and FP8 GEMM ceilings are measured
in the same run. GPU only.

    python integration/bench/seq_fp8.py --out integration/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from hyperrec.integration.model import _gate_region, _project_region, _region


def ceilings(n: int = 8192) -> dict[str, float]:
    """bf16 ``torch.mm`` and FP8 row-wise ``torch._scaled_mm`` TFLOP/s at n x n x n."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    out = {}
    for name, fn in (
        ("bf16_mm_tflops", lambda: a @ b),
        (
            "fp8_scaled_mm_tflops",
            lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16),
        ),
    ):
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        torch.cuda.synchronize()
        out[name] = 2 * n**3 * 20 / (s.elapsed_time(e) / 1e3) / 1e12
    return out


class Case:
    """One region's parameters and a way to draw fresh activations for it."""

    def __init__(self, region: str, dim: int, mode: str):
        self.region, self.dim, self.mode = region, dim, mode
        out_f = 4 * dim if region == "project" else dim
        self.norm = nn.LayerNorm(dim).cuda().bfloat16()
        self.lin = nn.Linear(dim, out_f).cuda().bfloat16()
        self.fn = _region(_gate_region if region == "gate" else _project_region, "inductor")

    def inputs(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        def act() -> torch.Tensor:
            return torch.randn(n, self.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        if self.region == "project":
            grads = [
                torch.randn(n, self.dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
            ]
            return [act()], grads
        return [act(), act(), act()], [
            torch.randn(n, self.dim, device="cuda", dtype=torch.bfloat16)
        ]

    def run(self, acts: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        n, lin = self.norm, self.lin
        if self.region == "project":
            outs = self.fn(acts[0], n.weight, n.bias, n.eps, lin.weight, lin.bias,
                           self.mode != "bf16", self.mode == "fp8_dgrad")  # fmt: skip
        else:
            outs = (self.fn(*acts, n.weight, n.bias, n.eps, lin.weight, lin.bias, 0.0, True,
                            self.mode == "fp8"),)  # fmt: skip
        torch.autograd.backward(outs, grads)


def time_case(case: Case, n: int, instances: int, reps: int) -> list[float]:
    times = []
    for _ in range(instances):
        acts, grads = case.inputs(n)
        case.run(acts, grads)  # first call on this instance (and shape) not timed
        for _ in range(reps):
            for t in (*acts, case.lin.weight, case.lin.bias, case.norm.weight, case.norm.bias):
                t.grad = None
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            case.run(acts, grads)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tokens", type=int, nargs="+", default=[65856, 98752, 131648])
    p.add_argument("--instances", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("seq_fp8.py needs a CUDA GPU")
    variants = {"project": ("bf16", "fp8", "fp8_dgrad"), "gate": ("bf16", "fp8")}
    doc: dict = {
        "benchmark": "seq_fp8",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dim": args.dim,
        "instances": args.instances,
        "reps": args.reps,
        "ceilings": ceilings(),
        "cases": [],
    }
    for region, modes in variants.items():
        cases = {m: Case(region, args.dim, m) for m in modes}
        for n in args.tokens:
            row: dict = {"region": region, "tokens": n}
            for m, case in cases.items():
                # A fresh count per variant, so each compiles (or reuses) the dynamic graph.
                ts = time_case(case, n, args.instances, args.reps)
                row[m] = {"median_ms": statistics.median(ts), "min_ms": min(ts)}
            for m in modes[1:]:
                row[f"{m}_speedup"] = row["bf16"]["median_ms"] / row[m]["median_ms"]
            print(json.dumps(row), flush=True)
            doc["cases"].append(row)
    out = Path(args.out) / f"seq_fp8_{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
