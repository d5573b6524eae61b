"""Programs: generators that yield requests, receive the answers, and return a result. Drafting is
written this way (decode/drafting.py, the EAGLE-2 expansion in decode/tree.py) so that who answers
the requests (at once, or batched with other sequences' requests) is the caller's choice."""

from __future__ import annotations

from typing import Callable, Generator


def run(program: Generator, answer: Callable):
    """Answer each request of `program` with `answer(request)`; returns the program's result."""
    try:
        request = next(program)
        while True:
            request = program.send(answer(request))
    except StopIteration as stop:
        return stop.value


def run_nested(program: Generator, answer: Callable[..., Generator]) -> Generator:
    """`run` inside another program: `answer(request)` is itself a program, whose requests pass
    through to this one's caller (`result = yield from run_nested(...)`)."""
    try:
        request = next(program)
        while True:
            request = program.send((yield from answer(request)))
    except StopIteration as stop:
        return stop.value
