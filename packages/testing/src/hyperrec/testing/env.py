"""Environment-flag checks shared by the packages' tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TRITON_INTERPRET_OFF", "TRITON_INTERPRET_ON", "check_reads_triton_interpret"]

#: ``TRITON_INTERPRET`` values Triton reads as true, and ones it reads as false (Triton
#: does not strip spaces and treats any other value as false).
TRITON_INTERPRET_ON = ("1", "true", "TRUE", "on", "yes", "Yes", "y")
TRITON_INTERPRET_OFF = ("0", "false", "off", "no", "", "2", " 1", "1 ")


def check_reads_triton_interpret(interpreting: Callable[[], bool], monkeypatch: Any) -> None:
    """Assert that ``interpreting()`` reads ``TRITON_INTERPRET`` as Triton does, for every
    value of :data:`TRITON_INTERPRET_ON` / :data:`TRITON_INTERPRET_OFF` and unset (and
    against Triton's own parser where the installed build exposes it). ``monkeypatch``
    is pytest's fixture.

    Raises:
        AssertionError: a value read differently.
    """
    try:
        from triton._C.libtriton import getenv_bool
    except ImportError:
        getenv_bool = None
    for value in TRITON_INTERPRET_ON + TRITON_INTERPRET_OFF:
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() == (value in TRITON_INTERPRET_ON), repr(value)
        if getenv_bool is not None:
            assert interpreting() == getenv_bool("TRITON_INTERPRET", False), repr(value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreting()
