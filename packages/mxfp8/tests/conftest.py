"""Fixtures of the mxfp8 tests. Kernel tests need the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, set by the nox session) or a GPU; helpers are in ``mx_helpers``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _mxfp8_seed():
    torch.manual_seed(1234)
