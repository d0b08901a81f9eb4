"""Reading a source of items from a given position, for exact resume."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def _is_indexable(source: Any) -> bool:
    try:
        from torch.utils.data import IterableDataset

        if isinstance(source, IterableDataset):
            return False
    except ImportError:  # pragma: no cover - torch is a declared dependency
        pass
    if isinstance(source, Iterator | Mapping):
        return False
    cls = type(source)
    return hasattr(cls, "__len__") and hasattr(cls, "__getitem__")


def open_at(source: Iterable[Any], position: int) -> Iterator[Any]:
    """Iterate ``source`` from item ``position`` on.

    Indexable sources (lists, map-style datasets with ``__len__``) are indexed
    directly; anything else is re-iterated from its start and the first ``position``
    items are read and dropped, which requires the source to replay the same order.
    """
    if _is_indexable(source):
        return (source[i] for i in range(position, len(source)))  # type: ignore[index]
    it = iter(source)
    if position:
        next(itertools.islice(it, position, position), None)
    return it
