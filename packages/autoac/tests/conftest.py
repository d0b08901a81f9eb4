"""Fixtures for the autoac tests."""

from __future__ import annotations

import pytest
import torch
from autoac_cases import attn_tower, mlp_tower, step_for


@pytest.fixture
def mlp_case():
    model = mlp_tower()
    x = torch.randn(256, 32)
    return model, step_for(x)


@pytest.fixture
def attn_case():
    model = attn_tower()
    x = torch.randn(2, 64, 32)
    return model, step_for(x)
