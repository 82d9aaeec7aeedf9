"""A progress bar for the long tools (bench, load, compare-workers): one line on stderr, redrawn in place.

Off when stderr is not a terminal (CI logs, `2> file`) or with `--quiet`, so captured output stays the
same as before. No dependency: tqdm would do, but a dozen lines do not justify one.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30
REDRAW_S = 0.1          # at most ten redraws a second: a bar must not slow what it measures


def enabled(quiet: bool = False, stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return not quiet and hasattr(stream, "isatty") and stream.isatty()


def bar_text(done: float, total: float, label: str, elapsed: float) -> str:
    """`label [#########.........]  12/40  30%  eta 14 s` (pure, so it can be tested alone)."""
    frac = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = int(round(frac * WIDTH))
    eta = f"eta {elapsed / frac - elapsed:.0f} s" if 0 < frac < 1 else f"{elapsed:.0f} s"
    count = f"{done:g}/{total:g}"
    return f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {count} {frac * 100:3.0f}% {eta}"


class Progress:
    """`with Progress(n, "label", on) as bar: ... bar.update()`; `bar.set(x)` for a measure (seconds)."""

    def __init__(self, total: float, label: str, on: bool | None = None, stream: TextIO | None = None):
        self.total, self.label, self.done = total, label, 0.0
        self.stream = stream or sys.stderr
        self.on = enabled(stream=self.stream) if on is None else on
        self.start = self.last = time.monotonic()
        self.width = 0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.set(self.done + n)

    def set(self, done: float) -> None:
        self.done = done
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.on or (not force and now - self.last < REDRAW_S and self.done < self.total):
            return
        self.last = now
        text = bar_text(self.done, self.total, self.label, now - self.start)
        self.stream.write("\r" + text + " " * max(0, self.width - len(text)))
        self.stream.flush()
        self.width = len(text)

    def close(self) -> None:
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")     # leave the terminal as it was
            self.stream.flush()
            self.width = 0
