"""prefer_expandable_segments: when the trainer asks for expandable segments."""

from __future__ import annotations

import os

import pytest
import torch

from hyperrec.integration.trainer import ALLOCATOR_CONF, prefer_expandable_segments

_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture
def clean_env(monkeypatch):
    saved = {n: os.environ.pop(n) for n in _NAMES if n in os.environ}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield monkeypatch
    for n in _NAMES:  # what the function under test set is not monkeypatch's to undo
        os.environ.pop(n, None)
    os.environ.update(saved)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_sets_the_allocator_conf_before_cuda_starts(clean_env, device):
    assert prefer_expandable_segments(device) is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_CONF


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_keeps_a_setting_of_the_user(clean_env, name):
    clean_env.setenv(name, "max_split_size_mb:128")
    assert prefer_expandable_segments("cuda") is False
    assert os.environ[name] == "max_split_size_mb:128"
    other = (set(_NAMES) - {name}).pop()
    assert other not in os.environ


def test_leaves_cpu_runs_and_started_cuda_alone(clean_env):
    assert prefer_expandable_segments("cpu") is False
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    assert prefer_expandable_segments("auto") is False
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    assert prefer_expandable_segments("cuda") is False
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
