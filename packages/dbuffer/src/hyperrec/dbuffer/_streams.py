"""Stream and event plumbing that is a no-op on the CPU.

On CUDA every collective runs on a caller-chosen side stream that first waits for the
current stream (so it sees the latest parameter values), and completion is published
as an event that the consumer waits on. Waiting on events rather than on streams keeps
the order of work fixed by program order, so results do not depend on timing. On the
CPU (gloo) collectives are synchronous and none of this is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["Pending", "on_stream"]


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """Run the body on ``stream`` after everything already queued on the current stream."""
    if stream is None or device.type != "cuda":
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


class Pending:
    """Completion of work issued by :func:`on_stream`: an event (CUDA) or a done flag."""

    __slots__ = ("_event", "_host", "_keepalive")

    def __init__(self, device: torch.device, keepalive: object = None, host: bool = False) -> None:
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        # Memory used on a side stream must not return to the allocator before that
        # stream is done with it; holding a reference until `wait` guarantees it.
        self._keepalive = keepalive
        # Work whose result the host reads (an asynchronous device-to-host copy).
        self._host = host

    def wait(self) -> None:
        """Make the current stream (and, for host-read results, the host) wait for the
        work; release what it kept alive."""
        if self._event is not None:
            if self._host:
                self._event.synchronize()
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        self._keepalive = None
