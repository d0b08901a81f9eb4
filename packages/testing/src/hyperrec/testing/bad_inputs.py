"""Table-driven bad-input catalogues: one line per case, checked the same way everywhere.

A catalogue is a list of :class:`Case` s built with :func:`case`::

    CASES = [
        case(ValueError, "offsets", jagged_attention, q, k, v, bad_offsets, 8),
        case(TypeError, "scale", jagged_attention, q, k, v, offsets, 8, scale="x"),
    ]

:func:`check_case` runs one case and asserts the exception type and that the message
names the argument; :func:`catalogue_tests` turns a catalogue into the two parametrized
tests every package runs; :func:`documented_exceptions` reads the ``Raises:`` section of the
public function's (or class's) docstring, so a test can assert that every exception a
case expects is documented where users look. :func:`rejects_cleanly` is the property
for fuzzing: a call either succeeds or raises ``TypeError``/``ValueError``, never
anything else, and never runs past a time limit.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Case",
    "case",
    "catalogue_tests",
    "check_case",
    "documented_exceptions",
    "rejects_cleanly",
    "time_limit",
]

#: What bad input may raise (the project's rule: never an assert, never anything else).
CLEAN = (TypeError, ValueError)


@dataclass(frozen=True)
class Case:
    """One bad call: ``fn(*args, **kwargs)`` must raise ``exc`` with ``match`` in its message."""

    exc: type[BaseException]
    """The exception type the call must raise (subclasses accepted)."""
    match: str
    """A plain substring of the message: the argument as the caller spelled it."""
    fn: Callable[..., Any]
    """The public function, class or bound method that is called."""
    args: tuple[Any, ...] = ()
    """Positional arguments (built once, when the catalogue is defined)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments."""
    doc: Any = None
    """Whose docstring documents the error; default ``fn`` (give it when ``fn`` is a
    lambda that sets up state before the public call)."""
    id: str = ""
    """A short test id; default ``<fn name>-<match>``."""

    @property
    def documented_by(self) -> Any:
        """The object whose ``Raises:`` section must name :attr:`exc`."""
        return self.fn if self.doc is None else self.doc

    @property
    def test_id(self) -> str:
        """Stable pytest id."""
        if self.id:
            return self.id
        name = getattr(self.documented_by, "__qualname__", type(self.documented_by).__name__)
        return f"{name}-{self.match}"


def case(
    exc: type[BaseException],
    match: str,
    fn: Callable[..., Any],
    *args: Any,
    doc: Any = None,
    id: str = "",
    **kwargs: Any,
) -> Case:
    """Build a :class:`Case`: ``case(ValueError, "world_size", plan_layout, [4], 1, 0)``."""
    return Case(exc=exc, match=match, fn=fn, args=args, kwargs=kwargs, doc=doc, id=id)


def check_case(c: Case) -> BaseException:
    """Run ``c`` and return the exception it raised.

    Raises:
        AssertionError: the call returned, raised another type, or the message does not
            contain ``c.match``.
    """
    try:
        c.fn(*c.args, **c.kwargs)
    except BaseException as e:
        if not isinstance(e, c.exc):
            raise AssertionError(
                f"{c.test_id}: expected {c.exc.__name__}, got {type(e).__name__}: {e}"
            ) from e
        if c.match not in str(e):
            raise AssertionError(
                f"{c.test_id}: {type(e).__name__} message does not name {c.match!r}: {e}"
            ) from e
        return e
    raise AssertionError(f"{c.test_id}: expected {c.exc.__name__}, but the call returned")


_SECTION = re.compile(r"^(\s*)Raises:\s*$", re.MULTILINE)
_HEADER = re.compile(r"^\s*[A-Z][A-Za-z ]*:{1,2}\s*$")
_NAME = re.compile(r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Exit|Interrupt))\b")


def _raises_text(doc: str) -> str:
    out = []
    for m in _SECTION.finditer(doc):
        indent = len(m.group(1))
        for line in doc[m.end() :].splitlines()[1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break  # the next section (or the end of the Raises block)
            out.append(line)
    return "\n".join(out)


def documented_exceptions(obj: Any) -> set[str]:
    """Exception class names listed in the ``Raises:`` section(s) of ``obj``'s docstring.

    For a class, the class docstring and ``__init__``'s are read (and ``__post_init__``'s
    for dataclasses); for a bound method, the method's.
    """
    docs = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj):
        for name in ("__init__", "__post_init__"):
            member = obj.__dict__.get(name)
            if member is not None and member.__doc__:
                docs.append(inspect.cleandoc(member.__doc__))
    return {n for d in docs for n in _NAME.findall(_raises_text(d))}


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the block after ``seconds`` (SIGALRM; main thread only,
    elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def _expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"call ran past {seconds}s")

    old = signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def rejects_cleanly(
    fn: Callable[..., Any],
    *args: Any,
    allowed: Sequence[type[BaseException]] = CLEAN,
    seconds: float = 20.0,
    **kwargs: Any,
) -> BaseException | None:
    """Call ``fn``; return ``None`` if it succeeds, the exception if it is ``allowed``.

    The fuzzing property: bad input is rejected with a ``TypeError``/``ValueError``, never
    an ``AssertionError``, ``IndexError``, ``RuntimeError`` from deep inside, a crash or
    a hang.

    Raises:
        AssertionError: another exception escaped, or the call ran past ``seconds``.
    """
    try:
        with time_limit(seconds):
            fn(*args, **kwargs)
    except tuple(allowed) as e:
        return e
    except TimeoutError as e:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} hung: {e}") from e
    except BaseException as e:
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)} raised {type(e).__name__} (not a clean "
            f"TypeError/ValueError): {e}"
        ) from e
    return None


def catalogue_tests(
    cases: Sequence[Case],
    *,
    behaviour_gaps: dict[str, str] | None = None,
    doc_gaps: dict[str, str] | None = None,
) -> tuple[Callable[[Case], None], Callable[[Case], None]]:
    """The two catalogue tests of a package, parametrized over ``cases``::

        test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = (
            catalogue_tests(CASES)
        )

    The first runs :func:`check_case`; the second asserts that each case's exception type
    is listed in the ``Raises:`` section of the documenting docstring. A known, not yet
    fixed gap is given by test id in ``behaviour_gaps`` / ``doc_gaps`` (id -> reason) and
    becomes a strict xfail, so it fails as soon as it is fixed and must be removed.
    """
    import pytest  # dev-only helper: pytest is this package's test extra

    def params(gaps: dict[str, str] | None) -> list[Any]:
        gaps = gaps or {}
        unknown = sorted(set(gaps) - {c.test_id for c in cases})
        if unknown:
            raise ValueError(f"gaps name cases that are not in the catalogue: {unknown}")
        return [
            pytest.param(
                c,
                id=c.test_id,
                marks=[pytest.mark.xfail(strict=True, reason=gaps[c.test_id])]
                if c.test_id in gaps
                else [],
            )
            for c in cases
        ]

    @pytest.mark.parametrize("c", params(behaviour_gaps))
    def test_bad_input_is_rejected_naming_the_argument(c: Case) -> None:
        check_case(c)

    @pytest.mark.parametrize("c", params(doc_gaps))
    def test_exception_type_is_documented(c: Case) -> None:
        documented = documented_exceptions(c.documented_by)
        assert c.exc.__name__ in documented, (
            f"{c.test_id}: {c.exc.__name__} is not in the Raises: section ({sorted(documented)})"
        )

    return test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented
