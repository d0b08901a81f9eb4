"""``TRITON_INTERPRET`` is read the way Triton reads it: "false", "off" and "" meant
"interpreter on" here while Triton compiled for a GPU (a CPU call then failed with
"0 active drivers" instead of taking the PyTorch path)."""

from __future__ import annotations

from hyperrec.parallel5d.sparse._triton import interpreting
from hyperrec.testing.env import check_reads_triton_interpret


def test_interpret_flag_matches_triton(monkeypatch):
    check_reads_triton_interpret(interpreting, monkeypatch)
