"""The tools' progress bar (tools/progress.py): drawn on a terminal only, cleared when done."""
from __future__ import annotations

import io

from laya_pool.tools.progress import Progress, bar_text, enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_text():
    assert bar_text(0, 40, "bench", 0.0).startswith("bench [" + "." * 30 + "] 0/40   0%")
    half = bar_text(20, 40, "bench", 10.0)
    assert "#" * 15 + "." * 15 in half and "20/40" in half and "50%" in half and "eta 10 s" in half
    assert "100%" in bar_text(50, 40, "x", 3.0)            # clamped


def test_drawn_on_a_terminal_and_cleared():
    tty = _Tty()
    with Progress(3, "load", stream=tty) as bar:
        for _ in range(3):
            bar.update()
    out = tty.getvalue()
    assert "load [" in out and "3/3" in out
    assert out.endswith("\r") and out.rstrip("\r ").count("\r") >= 1


def test_silent_off_a_terminal_or_quiet():
    plain = io.StringIO()
    with Progress(3, "load", stream=plain) as bar:
        bar.update(3)
    assert plain.getvalue() == ""
    assert not enabled(quiet=True, stream=_Tty())
    assert enabled(stream=_Tty()) and not enabled(stream=io.StringIO())
