"""What a long measurement is doing, on stderr: rewritten in place on a terminal, a plain
line per step when the output goes to a file or a pipe (a CI log keeps every line)."""

import sys
import time
from typing import Callable, TextIO

# Not tqdm: `python -m shmloader.compare` draws this bar in the base install, whose only
# dependencies are torch and numpy, and tqdm would become every loader user's dependency
# for it; and where stderr is a file or a pipe tqdm redraws its one line with "\r" (or,
# with disable=None, writes nothing), where a CI log needs a plain line per step.
REDRAW_S = 0.2  # at most this often on a terminal: redrawing costs the loop CPU
BAR_WIDTH = 24


class StatusLine:
    """One status line: prefix, then the message of the step under way."""

    def __init__(self, prefix: str = "", stream: TextIO | None = None):
        self._prefix = prefix
        self._stream = stream or sys.stderr
        self.tty = self._stream.isatty()
        self._width = 0

    def __call__(self, message: str) -> None:
        self._write(f"{self._prefix} {message}" if self._prefix else message)

    def _write(self, line: str) -> None:
        if self.tty:  # pad over the remains of a longer previous line
            self._width = max(self._width, len(line))
            print(line.ljust(self._width), end="\r", file=self._stream, flush=True)
        else:
            print(line, file=self._stream, flush=True)

    def clear(self) -> None:
        if self.tty:
            print(" " * self._width, end="\r", file=self._stream, flush=True)


class ProgressBar(StatusLine):
    """A status line that also counts batches: done of `total` (None: not known), the
    rate so far, and the time left at that rate. Call it with each step's name; call
    tick() for each batch."""

    def __init__(
        self,
        total: int | None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__("", stream)
        self.total = total
        self.done = 0
        self._step = ""
        self._clock = clock
        self._start = clock()
        self._drawn_at = float("-inf")

    def __call__(self, message: str) -> None:
        self._step = message
        self._draw()

    def tick(self) -> None:
        self.done += 1
        if self.tty and self._clock() - self._drawn_at >= REDRAW_S:
            self._draw()

    def line(self) -> str:
        """The status line as it stands: [bar] percent on a terminal, then the step, the
        batches, the rate and the time left."""
        elapsed = self._clock() - self._start
        rate = self.done / elapsed if self.done and elapsed > 0 else None
        fraction = min(self.done / self.total, 1.0) if self.total else None
        parts = []
        if fraction is not None:
            filled = round(fraction * BAR_WIDTH)
            bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] " if self.tty else ""
            parts.append(f"{bar}{fraction:4.0%}")
        parts.append(self._step)
        parts.append(f"{self.done:,}{f' of {self.total:,}' if self.total else ''} batches")
        if rate is not None:
            parts.append(f"{rate:,.1f} batches/s")
            if self.total:
                parts.append(f"ETA {duration(max(self.total - self.done, 0) / rate)}")
        return "  ".join(parts)

    def _draw(self) -> None:
        self._drawn_at = self._clock()
        self._write(self.line())


def duration(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
