"""Progress bars of long jobs (progress.py): redrawn in place on a terminal; in a log, plain lines at most one per
LOG_EVERY_S seconds, and the bar's last state when it closes."""

import io

import pytest

from anchorspec import progress
from anchorspec.progress import LogLines, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_bar(stream, steps=1000, seconds_per_step=0.1):
    """A regeneration-like bar: each step updates and sets a postfix (which redraws), the clock advancing."""
    bar = progress_bar(total=steps, desc="regenerate", unit="prompt", stream=stream)
    for i in range(steps):
        bar.update(1)
        bar.set_postfix_str(f"{i} new tok/s")
        yield
    bar.close()


def test_a_logged_bar_writes_a_line_per_interval_and_its_last_state(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    log = io.StringIO()
    for _ in run_bar(log):
        clock.now += 0.1  # 1,000 steps over 100 s
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 3 <= len(lines) <= 100 / progress.LOG_EVERY_S + 3  # the first at once, then one per interval, the last
    assert "1000/1000" in lines[-1] and "999 new tok/s" in lines[-1]
    assert "1000/1000" not in lines[-2]  # the last state came from the close, not a lucky interval


def test_a_terminal_bar_redraws_in_place():
    tty = Terminal()
    for _ in run_bar(tty, steps=50):
        pass
    assert tty.getvalue().count("\r") >= 50  # tqdm's own drawing: every postfix redraws


def test_log_lines_without_a_clock_gap_hold_back_all_but_the_first(monkeypatch):
    """Negative control for the interval: with the clock still, only the first redraw and the closing one land."""
    out = io.StringIO()
    lines = LogLines(out, every=30, clock=lambda: 5.0)
    for i in range(10):
        lines.write(f"\rstep {i}")
    assert out.getvalue() == "step 0\n"
    lines.write("\n")
    assert out.getvalue() == "step 0\nstep 9\n"


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["log", "terminal"])
def test_a_disabled_bar_writes_nothing(stream):
    bar = progress_bar(total=3, stream=stream, disable=True)
    bar.update(3)
    bar.close()
    assert stream.getvalue() == ""
