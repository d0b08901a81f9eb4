"""A small progress bar on stderr: step, loss, AUC, samples/s, MFU and ETA.

On a terminal it redraws one line in place; otherwise (CI logs, pipes) it prints a
complete line at most every ``log_interval_s`` seconds so logs stay short.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"1:02:03"`` / ``"2:03"``; ``"?"`` for unknown (NaN/inf/negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Progress of ``total`` steps.

    Args:
        total: number of steps (>= 1).
        stream: where to draw; default ``sys.stderr``.
        enabled: False makes every method a no-op (non-zero ranks, ``--quiet``).
        width: characters of the bar itself.
        log_interval_s: minimum seconds between lines when ``stream`` is not a terminal.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 24,
        log_interval_s: float = 5.0,
    ):
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be a positive int, got {total!r}")
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.log_interval_s = log_interval_s
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start: float | None = None
        self._start_step = 0
        self._last_draw = -math.inf
        self._last_len = 0

    def update(
        self,
        step: int,
        *,
        loss: float = math.nan,
        auc: float = math.nan,
        samples_per_s: float = math.nan,
        mfu: float = math.nan,
        force: bool = False,
    ) -> None:
        """Report that ``step`` steps are done (1-based), with the latest metrics.

        ``mfu`` (a fraction of the device's peak) is shown when finite; a CPU run has no
        peak and shows none."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:
            # ETA is measured from the first report, so start-up cost does not skew it.
            self._start, self._start_step = now, step
            if not force and step < self.total:
                return
        elapsed = now - self._start
        done = step - self._start_step
        eta = elapsed / done * (self.total - step) if done > 0 else math.nan
        interval = 0.1 if self._tty else self.log_interval_s
        if not force and step < self.total and now - self._last_draw < interval:
            return
        self._last_draw = now
        frac = min(max(step / self.total, 0.0), 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"[{bar}] {step}/{self.total} {frac:4.0%} | loss {loss:.4f} | auc {auc:.4f} | "
            f"{samples_per_s:,.0f} samples/s | "
            + (f"MFU {mfu:.1%} | " if math.isfinite(mfu) else "")
            + f"ETA {format_duration(eta)}"
        )
        if self._tty:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a full line without breaking the bar."""
        if not self.enabled:
            return
        if self._tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (terminal mode)."""
        if self.enabled and self._tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
