"""Progress bars for long commands: rich, on stderr, and only on a terminal (a pipe, a file or
a CI log gets nothing)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["bar", "iterate"]

T = TypeVar("T")


@contextmanager
def bar(total: int, label: str) -> Iterator[Callable[[], None]]:
    """A bar of ``total`` steps; call what it yields once per step. A no-op unless stderr is a
    terminal and there are at least two steps."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda: progress.advance(task)


def iterate(items: Sequence[T], label: str) -> Iterator[T]:
    """``items``, with a bar advanced after each one."""
    with bar(len(items), label) as step:
        for item in items:
            yield item
            step()
