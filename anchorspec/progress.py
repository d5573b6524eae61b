"""Progress bars for long jobs (regeneration, Magpie queries, feature caches, training, bench) that read well both
on a terminal and in a log.

On a terminal a bar redraws in place. A job run in the background (`nohup ... > log`) writes to a file, where every
redraw is one more '\\r'-joined copy of the bar: `set_postfix_str` redraws on each call, so a regeneration logged
its bar thousands of times a minute. Off a terminal the bar is therefore written as plain lines, at most one per
LOG_EVERY_S seconds, plus its last state when it closes: a log that `tail` can read."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOG_EVERY_S = 30.0


class LogLines:
    """The stream a bar writes to off a terminal: each redraw becomes a line, at most one per `every` seconds (the
    first at once); the newest redraw is held back and written when the bar closes (tqdm then writes '\\n')."""

    def __init__(self, stream, every: float = LOG_EVERY_S, clock=None):
        self.stream, self.every = stream, every
        self.clock = clock or (lambda: time.monotonic())
        self.last = None  # when the last line was written
        self.held = ""  # the newest redraw not written yet

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            now = self.clock()
            if self.last is None or now - self.last >= self.every:
                self._emit(line)
                self.last = now
            else:
                self.held = line
        elif "\n" in text and self.held:  # the bar closed: its last state
            self._emit(self.held)

    def _emit(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self.held = ""

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, *, disable: bool = False, stream=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs) on stderr (or `stream`): redrawn in place on a terminal, as LogLines elsewhere."""
    stream = stream if stream is not None else sys.stderr
    if disable or _is_terminal(stream):
        return tqdm(iterable, file=stream, disable=disable, **kwargs)
    kwargs.pop("dynamic_ncols", None)  # a log has no width to follow
    return tqdm(iterable, file=LogLines(stream), ascii=True, ncols=100, mininterval=LOG_EVERY_S, **kwargs)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
