"""Helpers shared by the mxfp8 tests (a plain module: ``conftest`` is not importable by
name once several packages' tests run in one pytest process)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Marks tests that run the Triton kernels on CPU tensors through the interpreter.
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton kernels on CPU need TRITON_INTERPRET=1"
)


def u8(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (any 1-byte dtype, any strides), on the CPU."""
    return t.contiguous().view(torch.uint8).cpu()
