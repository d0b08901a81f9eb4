"""May the Gluon forward run here? (cheap, cached, imports nothing heavy at module load)

The kernel is written against the Gluon API of Triton 3.6 (``triton.experimental.gluon``
changes between releases: names, signatures and layouts moved from 3.5 to 3.6 and again
later), and uses Hopper-only instructions (TMA, wgmma, setmaxnreg), so it needs both an
sm_90 GPU and a Triton whose version is in :data:`SUPPORTED_TRITON`.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["SUPPORTED_TRITON", "gluon_supported", "unsupported_reason"]

#: Triton versions (major.minor) whose Gluon API the kernel was written and compiled for.
SUPPORTED_TRITON: tuple[str, ...] = ("3.6",)

_REASON: dict[int | None, str] = {}


def _triton_reason() -> str:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    import triton

    version = ".".join(triton.__version__.split(".")[:2])
    if version not in SUPPORTED_TRITON:
        return f"triton {triton.__version__} is not one of {SUPPORTED_TRITON}"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as e:  # pragma: no cover - a broken install
        return f"triton.experimental.gluon is not importable ({e})"
    return ""


def unsupported_reason(device: torch.device | str) -> str:
    """Why the Gluon forward cannot run on ``device`` ('' if it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _REASON:
        major, minor = torch.cuda.get_device_capability(index)
        if major != 9:
            _REASON[index] = f"compute capability {major}.{minor} is not sm_90 (Hopper)"
        else:
            _REASON[index] = _triton_reason()
    return _REASON[index]


def gluon_supported(device: torch.device | str) -> bool:
    """Whether :func:`~hyperrec.jagged_attn._gluon.jagged_attention_fwd_gluon` can run on
    ``device``: an sm_90 CUDA device and a Triton in :data:`SUPPORTED_TRITON`."""
    return unsupported_reason(device) == ""
