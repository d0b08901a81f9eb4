"""``check_reads_triton_interpret`` accepts Triton's reading and rejects the readings the
packages had ("set and not 0")."""

from __future__ import annotations

import os

import pytest

from hyperrec.testing.env import check_reads_triton_interpret


def _as_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def _set_and_not_zero() -> bool:
    value = os.environ.get("TRITON_INTERPRET")
    return value is not None and value != "0"


def _not_empty_or_zero() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_triton_reading_passes(monkeypatch):
    check_reads_triton_interpret(_as_triton, monkeypatch)


@pytest.mark.parametrize("reader", [_set_and_not_zero, _not_empty_or_zero])
def test_the_old_readings_fail(monkeypatch, reader):
    with pytest.raises(AssertionError):
        check_reads_triton_interpret(reader, monkeypatch)
