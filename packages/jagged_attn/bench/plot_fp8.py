"""Plot ``bench_fp8.py`` results: forward speed, training (fwd+bwd) speed, accuracy.

    python packages/jagged_attn/bench/plot_fp8.py --out packages/jagged_attn/bench/results/fp8_h200_2026-12-02.png \\
        packages/jagged_attn/bench/results/fp8_h200_2026-12-02.json \\
        packages/jagged_attn/bench/results/fp8_h200_2026-12-02_8192.json

Several result files may be given (a long-length run kept in its own file, say); a case
of a later file replaces the case of the same name from an earlier one. Every bar is the
median over the result's freshly built instances of the case; nothing is interpolated.
The targets of the FP8 issue are drawn as dashed lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: speed row of the result -> legend label
FORWARD_ROWS = (
    ("bf16/fwd_ms", "bf16 (ours)"),
    ("fp8/fwd_ms", "FP8, public call (quantization included)"),
    ("fp8_kernel/fwd_ms", "FP8 kernel alone"),
    ("flex/fwd_ms", "FlexAttention (bf16, compiled)"),
)
TRAINING_ROWS = (
    ("fp8/fwd_bwd_ms", "FP8 forward, bf16 backward"),
    ("fp8_stats_pass/fwd_bwd_ms", "same, statistics pass (<= 0.2.19)"),
    ("fp8_bwd/fwd_bwd_ms", "FP8 forward and backward (prototype)"),
    ("flex/fwd_bwd_ms", "FlexAttention"),
)
ACCURACY_ROWS = (("fp8", "FP8 (ours)"), ("naive_fp8", "naive per-tensor FP8"))


def _median(instances: list[dict[str, Any]], key: str) -> float | None:
    values = [i[key] for i in instances if isinstance(i.get(key), (int, float))]
    return statistics.median(values) if values else None


def merge(results: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    """The cases of ``section`` over all files, later files replacing earlier ones."""
    cases: dict[str, dict[str, Any]] = {}
    for r in results:
        for case in r.get(section, []):
            cases[case["name"]] = case
    return sorted(cases.values(), key=lambda c: (c.get("causal", False), c["max_len"], c["name"]))


def _bars(ax: Any, labels: list[str], series: list[tuple[str, list[float | None]]]) -> None:
    width = 0.8 / max(len(series), 1)
    for j, (name, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, v in zip(bars, values, strict=True):
            if v is None:
                bar.set_hatch("//")  # not measured in this case
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot(results: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [c for c in merge(results, "speed") if c.get("instances")]
    accuracy = merge(results, "accuracy")
    if not speed and not accuracy:
        raise SystemExit("no speed or accuracy cases in the result files")
    fig, axes = plt.subplots(1, 3, figsize=(18, 6.4))

    labels = [c["name"] for c in speed]
    fwd = []
    for key, name in FORWARD_ROWS:
        values = []
        for c in speed:
            ms = _median(c["instances"], key)
            flops = _median(c["instances"], "flops_fwd")
            values.append(flops / (ms * 1e-3) / 1e12 if ms and flops else None)
        fwd.append((name, values))
    _bars(axes[0], labels, fwd)
    axes[0].axhline(
        900, color="black", linestyle="--", linewidth=1, label="target at >= 8,192: 900"
    )
    axes[0].set_ylabel("forward TFLOP/s (median over instances)")
    axes[0].set_title("Forward", fontsize=10)
    axes[0].legend(fontsize=7)

    train = []
    for key, name in TRAINING_ROWS:
        values = []
        for c in speed:
            ms, ref = _median(c["instances"], key), _median(c["instances"], "bf16/fwd_bwd_ms")
            values.append(ref / ms if ms and ref else None)
        train.append((name, values))
    _bars(axes[1], labels, train)
    axes[1].axhline(1.0, color="gray", linewidth=1)
    axes[1].axhline(1.15, color="black", linestyle="--", linewidth=1, label="target: 1.15x")
    axes[1].set_ylabel("fwd+bwd speed vs our bf16 (x, higher is faster)")
    axes[1].set_title("Training step of the attention (forward + backward)", fontsize=10)
    axes[1].legend(fontsize=7)

    acc_labels, acc = [], {name: [] for _, name in ACCURACY_ROWS}
    for c in accuracy:
        for inp, r in c["results"].items():
            acc_labels.append(f"{c['name']} / {inp}")
            for key, name in ACCURACY_ROWS:
                acc[name].append(r.get(key, {}).get("snr_db"))
    _bars(axes[2], acc_labels, list(acc.items()))
    axes[2].axhline(30, color="black", linestyle="--", linewidth=1, label="target: 30 dB")
    axes[2].set_ylabel("forward SNR vs float64 (dB, higher is better)")
    axes[2].set_title("Accuracy", fontsize=10)
    axes[2].set_xticklabels(acc_labels, rotation=60, ha="right", fontsize=6)
    axes[2].set_ylim(0, 36)
    axes[2].legend(fontsize=7)

    machine = results[-1].get("machine", {})
    fig.suptitle(
        f"FP8 jagged attention, {machine.get('gpu') or machine.get('cpu')}, torch "
        f"{machine.get('torch')}, triton {machine.get('triton')}, "
        f"{str(machine.get('date', ''))[:10]} (H = 8, D = 128; hatched: not measured)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_fp8.py JSON files (later ones win)")
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.results]
    print(f"wrote {plot(results, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
