"""Reading a source of items from a given position, for exact resume.

Three kinds of source, told apart by :func:`source_kind`:

- ``"sized"``: ``__len__`` and ``__getitem__`` (lists, arrays, map-style datasets with
  a length): items ``source[i]`` for ``i < len(source)``, reached directly by index.
- ``"index_only"``: ``__getitem__`` without ``__len__`` or ``__iter__`` (endless or
  unknown-length readers, map-style datasets without a length): items ``source[0],
  source[1], ...`` until ``source[i]`` raises ``IndexError`` or ``StopIteration``,
  exactly Python's sequence iteration protocol; reached directly by index as well.
- ``"iterable"``: anything else (generators, ``IterableDataset``, classes with
  ``__iter__`` but no length): re-iterated from the start, the first items dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, cast

T_co = TypeVar("T_co", covariant=True)


class IndexedSource(Protocol[T_co]):
    """A source read by index only (``source[i]``; no ``__iter__`` needed)."""

    def __getitem__(self, index: int, /) -> T_co: ...


__all__ = ["SourceKind", "open_at", "source_kind"]

SourceKind = Literal["sized", "index_only", "iterable"]


def source_kind(source: Any) -> SourceKind:
    """How :func:`open_at` reads ``source``, and so how a resume reaches a position.

    The checks are on the type, like Python's own ``iter()``: an object whose class
    defines ``__iter__`` is iterated by it, so a class with ``__iter__`` and
    ``__getitem__`` but no ``__len__`` is ``"iterable"``: nothing says its
    ``__getitem__`` indexes the order its ``__iter__`` produces.
    """
    try:
        from torch.utils.data import IterableDataset

        # torch's Dataset base class defines __getitem__ (raising NotImplementedError),
        # so an IterableDataset would otherwise look indexable.
        if isinstance(source, IterableDataset):
            return "iterable"
    except ImportError:  # pragma: no cover - torch is a declared dependency
        pass
    if isinstance(source, Iterator | Mapping):
        return "iterable"
    cls = type(source)
    if not hasattr(cls, "__getitem__"):
        return "iterable"
    if hasattr(cls, "__len__"):
        return "sized"
    if hasattr(cls, "__iter__"):
        return "iterable"
    return "index_only"


def open_at(source: Iterable[Any] | IndexedSource[Any], position: int) -> Iterator[Any]:
    """Iterate ``source`` from item ``position`` on (see the module docstring).

    ``"sized"`` and ``"index_only"`` sources are indexed from ``position``: nothing
    before it is read, whatever ``position`` is. An ``"iterable"`` source is iterated
    again from its start and its first ``position`` items are read and dropped, which
    requires it to replay the same order.
    """
    kind = source_kind(source)
    if kind == "sized":
        sized = cast(Sequence[Any], source)  # source_kind checked __len__ and __getitem__
        return (sized[i] for i in range(position, len(sized)))
    if kind == "index_only":
        return _index_from(source, position)
    it = iter(source)
    if position:
        next(itertools.islice(it, position, position), None)
    return it


def _index_from(source: Any, position: int) -> Iterator[Any]:
    # Python's sequence protocol: the first IndexError or StopIteration ends the data,
    # and nothing is indexed after it. StopIteration has to be caught here, because
    # inside a generator it would turn into a RuntimeError (PEP 479).
    for i in itertools.count(position):
        try:
            item = source[i]
        except (IndexError, StopIteration):
            return
        yield item
