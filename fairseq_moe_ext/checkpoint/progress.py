"""A one-line progress bar for long file work (``import-fairseq-moe``): bytes done of the total, the read
rate in bytes/s and the time left, redrawn in place at most twice a second, on a terminal only.

When the stream is not a terminal (a log file, a pipe, a test's captured stderr) it prints nothing:
the import's own report lines say what was done.
"""

import sys
import time
from typing import Optional, TextIO


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def human_time(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``read(n)`` for bytes read, ``file_done(size)`` when a file of ``size`` bytes is finished (the
    bytes it skipped count as done too), ``close()`` at the end. ``total``: the bytes of every file."""

    def __init__(self, what: str, stream: Optional[TextIO] = None, clock=time.monotonic, interval: float = 0.5):
        self.what, self.stream, self.clock, self.interval = what, stream or sys.stderr, clock, interval
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty())
        self.total: Optional[int] = None
        self.read_bytes = self.finished = self.position = 0
        self.start = self.clock()
        self.drawn_at: Optional[float] = None

    def set_total(self, total: int) -> None:
        self.total = total

    def read(self, count: int) -> None:
        self.read_bytes += count
        self.position += count
        self._draw()

    def file_done(self, size: int) -> None:
        self.finished += size
        self.position = self.finished
        self._draw()

    def line(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.read_bytes / elapsed
        text = f"{self.what}: {human_bytes(self.position)}"
        if self.total:
            text += f" of {human_bytes(self.total)} ({100 * self.position / self.total:.0f}%)"
        text += f", {human_bytes(rate)}/s"
        if self.total and self.position:
            left = (self.total - self.position) * elapsed / self.position
            text += f", ETA {human_time(left)}"
        return text

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if not force and self.drawn_at is not None and now - self.drawn_at < self.interval:
            return
        self.drawn_at = now
        self.stream.write("\r" + self.line() + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.drawn_at is not None:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
