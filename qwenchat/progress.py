"""A progress bar on stderr for the long commands (Rich), drawn only where stderr is a
terminal: in a pipe or a log it would be noise."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def progress_bar(err: TextIO, label: str, total: int,
                 in_bytes: bool = False) -> Iterator[Callable[[int], None]]:
    """`advance(n)` moves the bar n units on (bytes, with `in_bytes`); it shows what is done
    of `total` and the time left, and is gone once the block ends."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(file=err)
    done = DownloadColumn() if in_bytes else MofNCompleteColumn()
    with Progress(TextColumn(label), BarColumn(), done, TimeRemainingColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)
