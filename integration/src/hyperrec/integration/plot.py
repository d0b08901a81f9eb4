"""The end-of-run figure: loss, AUC, NE / calibration, throughput and MFU against the step.

matplotlib is imported inside :func:`plot_metrics` (with the non-interactive Agg
backend), so training never pays for it until the run is over.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot_metrics"]


def _finite(xs: list[Any], ys: list[Any]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _rolling_median(ys: list[float], k: int) -> list[float]:
    half = k // 2
    padded = np.pad(np.asarray(ys, dtype=np.float64), half, mode="edge")
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, k), axis=1).tolist()


def _reference_lines(ax: Any, baselines: dict[str, Any], key: str) -> None:
    styles = {"popularity": ":", "logistic_regression": "-.", "ground_truth": "--"}
    for name, style in styles.items():
        value = (baselines.get(name) or {}).get(key)
        if isinstance(value, float) and math.isfinite(value):
            ax.axhline(
                value, ls=style, color="grey", lw=1.0, label=f"{name.replace('_', ' ')} (test)"
            )


def plot_metrics(metrics: dict[str, Any], path: str | Path) -> Path:
    """Draw ``metrics`` (the run's metrics JSON, as a dict) into a PNG at ``path``.

    Panels: training loss (per step and smoothed) with the validation loss; AUC
    (training AUC over recent steps, validation CTR AUC, GAUC and CVR AUC, the test
    AUC of the model and of the baselines as reference lines); validation normalised
    entropy and calibration (with the test baselines' NE); samples per second; model
    FLOPs utilisation (MFU against the device's datasheet peak; on a CPU, which has
    none, the model TFLOP/s instead).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``metrics`` has no ``"history"`` with steps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = metrics.get("history") or {}
    steps = hist.get("step") or []
    if not steps:
        raise ValueError("metrics['history']['step'] is empty: nothing to plot")
    evals = metrics.get("eval") or []
    baselines = metrics.get("baselines") or {}
    final = metrics.get("final") or {}
    es = [e["step"] for e in evals]
    fig, axes = plt.subplots(2, 3, figsize=(19, 8.4))
    source = (metrics.get("data") or {}).get("source", "")
    title = f"{metrics.get('preset', '?')} preset, {metrics.get('world_size', 1)} rank(s)"
    fig.suptitle(f"{title}, {source}" if source else title)

    ax = axes[0, 0]
    ax.plot(*_finite(steps, hist.get("loss", [])), lw=0.8, alpha=0.5, label="train (step)")
    if hist.get("loss_ema"):
        ax.plot(*_finite(steps, hist["loss_ema"]), lw=1.6, label="train (EMA)")
    if evals:
        ax.plot(*_finite(es, [e.get("loss") for e in evals]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("log-loss per impression (CTR + CTCVR)")
    ax.set_title("loss")
    ax.legend()

    ax = axes[0, 1]
    ax.plot(*_finite(steps, hist.get("ctr_auc", [])), lw=1.0, label="train CTR (recent steps)")
    if evals:
        ax.plot(*_finite(es, [e.get("ctr_auc") for e in evals]), "o-", label="validation CTR")
        ax.plot(*_finite(es, [e.get("ctr_gauc") for e in evals]), "^-", label="validation GAUC")
        if any("cvr_auc" in e for e in evals):
            ax.plot(*_finite(es, [e.get("cvr_auc") for e in evals]), "s-", label="validation CVR")
    value = final.get("ctr_auc")
    if isinstance(value, float) and math.isfinite(value):
        ax.axhline(value, color="black", lw=1.0, label="model (test)")
    _reference_lines(ax, baselines, "ctr_auc")
    ax.set_xlabel("step")
    ax.set_ylabel("AUC")
    ax.set_title("AUC (reference lines: test split)")
    ax.legend(fontsize="small", loc="lower right")

    ax = axes[1, 0]
    if evals:
        ax.plot(*_finite(es, [e.get("ctr_ne") for e in evals]), "o-", label="validation CTR NE")
        ax.plot(
            *_finite(es, [e.get("ctr_calibration") for e in evals]),
            "s-",
            label="validation calibration",
        )
    _reference_lines(ax, baselines, "ctr_ne")
    ax.axhline(1.0, color="black", lw=0.6, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("NE (lower is better); calibration (1 is calibrated)")
    ax.set_title("normalised entropy and calibration (lines: test NE)")
    ax.legend(fontsize="small")

    ax = axes[0, 2]
    xs, ys = _finite(steps, hist.get("samples_per_s", []))
    ax.plot(xs, ys, lw=0.6, alpha=0.4, label="per step")
    if len(ys) >= 5:
        # A rolling median hides one-off stalls (checkpoints, evals, a busy machine).
        k = max(5, len(ys) // 25) | 1
        ax.plot(xs, _rolling_median(ys, k), lw=1.6, label=f"rolling median ({k} steps)")
    ax.legend(fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("requests / s (all ranks)")
    ax.set_title("throughput")

    ax = axes[1, 1]
    xs, ys = _finite(steps, hist.get("mfu", []))
    if ys:
        ax.plot(xs, [100.0 * y for y in ys], lw=1.0, label="MFU per step")
        ax.set_ylabel("% of peak (dense BF16 datasheet)")
        peak = (metrics.get("mfu") or {}).get("peak_tflops")
        ax.set_title(f"model FLOPs utilisation (peak {peak} TFLOP/s)")
    else:
        xs, ys = _finite(steps, hist.get("tflops_per_gpu", []))
        ax.plot(xs, ys, lw=1.0, label="model TFLOP/s per device")
        ax.set_ylabel("model TFLOP/s per device")
        ax.set_title("model FLOP rate (no peak known for this device)")
    if ys:
        ax.legend(fontsize="small")
    ax.set_xlabel("step")
    axes[1, 2].axis("off")

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
