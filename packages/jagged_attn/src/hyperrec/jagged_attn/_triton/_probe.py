"""Capability probes: may the Triton kernels run here, and which Hopper features exist.

Nothing here imports Triton at module import time; every probe is cheap and cached.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from hyperrec.jagged_attn._triton import interpreting

__all__ = ["supports", "triton_available", "hopper_features"]


# Plain module-level caches (not functools.cache): these probes run while torch.compile
# traces the dispatcher, and Dynamo warns about tracing through lru_cache wrappers.
_TRITON_FOUND: list[bool] = []
_CAPABILITY: dict[int | None, tuple[int, int]] = {}


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported."""
    if not _TRITON_FOUND:
        _TRITON_FOUND.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_FOUND[0]


def supports(device: torch.device | str, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels can run on ``device`` (and ``dtype``, if given).

    CUDA GPUs of compute capability >= 8.0 (bf16 tensor cores), or any CPU tensor while the
    Triton interpreter is on. Inputs must be bf16 or fp16.
    """
    if not triton_available():
        return False
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return False
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if interpreting():
        return device.type == "cpu"
    if device.type != "cuda":
        return False
    if device.index not in _CAPABILITY and not torch.cuda.is_available():
        return False
    return _capability(device.index)[0] >= 8


def _capability(index: int | None) -> tuple[int, int]:
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


@functools.cache
def hopper_features(index: int | None = None) -> dict[str, bool]:
    """Hopper-only features present on this GPU and in this Triton.

    ``tma``: the bulk tensor copy engine (sm90) and Triton's tensor descriptors, built in
    the kernel (``tl.make_tensor_descriptor``) and on the host
    (``triton.tools.tensor_descriptor``); ``warp_specialize``: sm90 and
    ``tl.range(warp_specialize=...)`` in this Triton (whether a given loop builds is only
    known by building it). The forward uses them only in the variants that ask for them
    (``KernelConfig.tma``, set in the shipped sm90 forward entries, and
    ``KernelConfig.warp_specialize``, off).
    """
    if not triton_available() or interpreting() or not torch.cuda.is_available():
        return {"tma": False, "warp_specialize": False}
    import inspect

    import triton.language as tl

    sm90 = _capability(index)[0] >= 9
    has_desc = hasattr(tl, "make_tensor_descriptor") and (
        importlib.util.find_spec("triton.tools.tensor_descriptor") is not None
    )
    has_ws = "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    return {"tma": sm90 and has_desc, "warp_specialize": sm90 and has_ws}
