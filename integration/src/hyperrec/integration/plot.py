"""The end-of-run figure: loss, AUC and throughput against the step.

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


def plot_metrics(metrics: dict[str, Any], path: str | Path) -> Path:
    """Draw ``metrics`` (the run's metrics JSON, as a dict) into a PNG at ``path``.

    Panels: training loss (per step) with held-out loss; training CTR AUC (window over
    recent steps) with held-out CTR/CVR AUC and the popularity and ground-truth AUCs as
    reference lines; samples per second; model FLOPs utilisation (MFU against the
    device's datasheet peak; on a CPU, which has none, the model TFLOP/s instead).

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
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    title = f"{metrics.get('preset', '?')} preset, {metrics.get('world_size', 1)} rank(s)"
    fig.suptitle(title)

    ax = axes[0]
    ax.plot(*_finite(steps, hist.get("loss", [])), lw=0.8, alpha=0.5, label="train (step)")
    if hist.get("loss_ema"):
        ax.plot(*_finite(steps, hist["loss_ema"]), lw=1.6, label="train (EMA)")
    if evals:
        ax.plot(
            *_finite([e["step"] for e in evals], [e.get("loss") for e in evals]),
            "o-",
            label="held-out",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("CTR + CTCVR log-loss per impression")
    ax.set_title("loss")
    ax.legend()

    ax = axes[1]
    ax.plot(*_finite(steps, hist.get("ctr_auc", [])), lw=1.0, label="train CTR (recent steps)")
    if evals:
        es = [e["step"] for e in evals]
        ax.plot(*_finite(es, [e.get("ctr_auc") for e in evals]), "o-", label="held-out CTR")
        ax.plot(*_finite(es, [e.get("cvr_auc") for e in evals]), "s-", label="held-out CVR")
    styles = {"popularity": ":", "ground_truth": "--"}
    for name, style in styles.items():
        value = (baselines.get(name) or {}).get("ctr_auc")
        if isinstance(value, float) and math.isfinite(value):
            ax.axhline(value, ls=style, color="grey", label=f"{name} CTR")
    ax.set_xlabel("step")
    ax.set_ylabel("AUC")
    ax.set_title("AUC")
    ax.legend(fontsize="small", loc="lower right")

    ax = axes[2]
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

    ax = axes[3]
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

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
