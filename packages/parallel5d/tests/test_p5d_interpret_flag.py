"""``TRITON_INTERPRET`` is read the way Triton reads it: "false", "off" and "" meant
"interpreter on" here while Triton compiled for a GPU (a CPU call then failed with
"0 active drivers" instead of taking the PyTorch path)."""

from __future__ import annotations

import pytest

from hyperrec.parallel5d.sparse._triton import interpreting

ON = ("1", "true", "TRUE", "on", "yes", "Yes", "y")
OFF = ("0", "false", "off", "no", "", "2", " 1", "1 ")


@pytest.mark.parametrize("value", ON + OFF)
def test_interpret_flag_matches_triton(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == (value in ON)
    try:  # Triton's own parser, where the installed build exposes it
        from triton._C.libtriton import getenv_bool
    except ImportError:
        return
    assert interpreting() == getenv_bool("TRITON_INTERPRET", False)


def test_interpret_flag_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreting()
