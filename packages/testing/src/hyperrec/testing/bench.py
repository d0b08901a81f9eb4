"""Benchmark bookkeeping: every committed result records where and when it ran."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["machine_info", "write_result"]


def machine_info() -> dict[str, Any]:
    """Machine, library versions and date for a benchmark's JSON header."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host_os": platform.platform(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["gpu"] = None
    return info


def _plain(x: Any) -> Any:
    """``x`` as strict JSON values: numpy scalars and arrays and one-element tensors as
    Python numbers and lists (``default=str`` wrote them as strings), NaN/Inf as None
    (``NaN`` is not JSON), tuples as lists."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    elif type(x).__module__ == "numpy" and hasattr(x, "tolist"):
        return _plain(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_result(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Write ``{"machine": machine_info(), **payload}`` as indented JSON; returns the path.

    Strict JSON, as the benchmarks' own writers produce it: non-finite floats become
    ``null``, numpy values and one-element tensors numbers (or lists); anything else
    JSON cannot hold is written as its ``str``.

    Raises:
        TypeError: ``path`` is not a path, or ``payload`` is not a mapping.
        ValueError: ``payload`` has a ``"machine"`` key (it would silently replace the
            recorded machine).
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload must be a mapping, got {type(payload).__name__}")
    if "machine" in payload:
        raise ValueError("payload must not have a 'machine' key: write_result records it")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = _plain({"machine": machine_info(), **payload})
    out.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n")
    return out
