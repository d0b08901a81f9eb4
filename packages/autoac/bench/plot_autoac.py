"""Plot a ``bench_autoac.py`` result: measured peak memory against step time, per model.

    python packages/autoac/bench/plot_autoac.py packages/autoac/bench/results/h200_quick_2026-12-01.json

Writes ``<result>.png`` beside the JSON (or ``--out``). Every point is a measurement of
the result file (median step time, ``max_memory_allocated`` peak); nothing is
interpolated. autoac's points (keep/recompute plans at several budgets) are joined into
its memory-time curve, and so are torch's compiled budgets; the other peers are single
markers. Compiled points are drawn hollow:
they are not comparable with the eager ones on speed (see the package README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GIB = 2.0**30

#: method prefix -> (label, marker, colour); the first match wins
STYLES: tuple[tuple[str, str, str, str], ...] = (
    (
        "autoac_apply_compiled_fused_quant",
        "autoac.apply, compiled, fused pricing, MXINT8",
        "X",
        "tab:olive",
    ),  # fmt: skip
    (
        "autoac_apply_compiled_fused_search",
        "autoac.apply, compiled, with torch's partitioner searched",
        "*",
        "tab:red",
    ),  # fmt: skip
    (
        "autoac_apply_compiled_fused_calib",
        "autoac.apply, compiled, fused pricing, calibrated",
        "d",
        "tab:cyan",
    ),  # fmt: skip
    ("autoac_apply_compiled_fused", "autoac.apply, compiled, fused pricing", "d", "tab:blue"),
    ("autoac_apply_compiled_quant", "autoac.apply, compiled, MXINT8 saves", "X", "tab:pink"),
    ("autoac_apply_compiled", "autoac.apply, compiled, eager op times", "d", "tab:purple"),
    ("autoac_compiled", "autoac, compiled", "D", "tab:purple"),
    ("autoac_quant", "autoac + packed saves", "x", "tab:orange"),
    ("pack_all_mxint8", "pack every save as MXINT8", "*", "tab:olive"),
    ("autoac", "autoac (eager)", "o", "tab:blue"),
    ("no_ac", "no AC (eager)", "s", "black"),
    ("full_ac", "full AC", "^", "tab:red"),
    ("op_sac", "op-level SAC (torchtitan-style)", "v", "tab:green"),
    ("torch_budget", "torch activation_memory_budget (compiled)", "P", "tab:brown"),
    ("compiled_no_ac", "torch activation_memory_budget (compiled)", "P", "tab:brown"),
    ("pack_all", "pack every save (MXFP8) that passed", "*", "tab:gray"),
)


def _style(method: str) -> tuple[str, str, str]:
    for prefix, label, marker, colour in STYLES:
        if method.startswith(prefix):
            return label, marker, colour
    return method, ".", "tab:cyan"


def _measured(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if p.get("peak_bytes") and p.get("time_ms_median")]


def plot(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    if not models:
        raise SystemExit("the result has no models")
    fig, axes = plt.subplots(1, len(models), figsize=(6.4 * len(models), 5.8), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items(), strict=True):
        points = _measured(model["points"])
        if not points:
            ax.set_title(f"{name}: no measured points")
            continue
        seen: set[str] = set()
        curves: dict[str, list[tuple[float, float]]] = {}
        for p in points:
            label, marker, colour = _style(p["method"])
            x, y = p["peak_bytes"] / GIB, p["time_ms_median"]
            face = "none" if "compiled" in label else colour
            colours = (
                {"color": colour} if marker == "x" else {"facecolors": face, "edgecolors": colour}
            )
            ax.scatter([x], [y], marker=marker, s=60, label=None if label in seen else label,
                       zorder=3, **colours)  # fmt: skip
            seen.add(label)
            if p["method"].startswith(("autoac", "torch_budget", "compiled_no_ac")):
                curves.setdefault(label, []).append((x, y))
        for label, xy in curves.items():
            xy.sort()
            ax.plot([a for a, _ in xy], [b for _, b in xy], color=_style_colour(label),
                    linewidth=1, alpha=0.7)  # fmt: skip
        size = result.get("sizes", {}).get(name, {})
        shape = ", ".join(f"{k}={v}" for k, v in size.items())
        ax.set_title(f"{name} ({shape})", fontsize=9)
        ax.set_xlabel("measured peak memory (GiB)")
        ax.set_ylabel("median step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    machine = result.get("machine", {})
    fig.suptitle(
        f"autoac memory-time points, {machine.get('gpu') or machine.get('cpu')}, "
        f"torch {machine.get('torch')}, {str(machine.get('date', ''))[:10]} "
        f"({result.get('mode')} mode; lower left is better)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _style_colour(label: str) -> str:
    return next((c for _, lab, _, c in STYLES if lab == label), "tab:cyan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "results", nargs="+", help="bench_autoac.py JSONs (several: one figure of their models)"
    )
    p.add_argument("--out", help="PNG path (default: the first JSON's path with .png)")
    args = p.parse_args(argv)
    paths = [Path(r) for r in args.results]
    result = merge([json.loads(path.read_text()) for path in paths])
    out = Path(args.out) if args.out else paths[0].with_suffix(".png")
    print(f"wrote {plot(result, out)}")
    return 0


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of several runs' models (a model in two runs: the first run's); the
    machine block and mode of the first."""
    merged = {**results[0], "models": {}, "sizes": {}}
    for r in results:
        for name, model in r.get("models", {}).items():
            if name not in merged["models"]:
                merged["models"][name] = model
                merged["sizes"][name] = r.get("sizes", {}).get(name, {})
    return merged


if __name__ == "__main__":
    sys.exit(main())
