"""Progress bars for long work (generation, scoring, training), drawn with rich on stderr.

Why only on a terminal: a scheduled job's log should hold log lines, not redraw codes; when stderr is not a
terminal (cron, Kubernetes, CI) the bar is a no-op and the stages' own log lines say what happened.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@functools.cache
def stderr_console():
    """The rich Console on stderr that bars draw on; give it to a RichHandler so log lines print above a bar."""
    from rich.console import Console

    return Console(stderr=True)


class ProgressBar:
    """What ``progress`` yields: ``advance(amount)`` after each unit of work (a shard, a micro-batch), or
    ``update(...)`` when the work reports absolute counts (the update's optimizer steps, from another process)."""

    def __init__(self, bar=None, task_id=None, total: int | None = None):
        self._bar, self._task_id = bar, task_id
        self.completed, self.total = 0, total

    @property
    def drawn(self) -> bool:
        """Whether anything is shown: callers can skip gathering progress nobody sees."""
        return self._bar is not None

    def advance(self, amount: int = 1) -> None:
        self.completed += amount
        if self._bar is not None:
            self._bar.advance(self._task_id, amount)

    def update(self, *, completed: int | None = None, total: int | None = None, description: str | None = None) -> None:
        """Set the count done, the total (a spinner becomes a bar) and/or the label; None leaves one as it is."""
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if self._bar is not None:
            self._bar.update(self._task_id, completed=completed, total=total, description=description)


@contextlib.contextmanager
def progress(total: int | None, description: str, *, enabled: bool = True, console=None) -> Iterator[ProgressBar]:
    """A bar of ``total`` units (None: unknown, a spinner) labelled ``description``, e.g.
    ``with progress(len(jobs), "iter 0 generate: shards") as bar: ... bar.advance()``.

    Drawn when ``enabled`` (tracking.progress_bars) and the console is a terminal (default: stderr_console()).
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = console or stderr_console()
    if not enabled or not console.is_terminal:
        yield ProgressBar(total=total)
        return
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False, redirect_stderr=False, redirect_stdout=False) as bar:
        yield ProgressBar(bar, bar.add_task(description, total=total), total=total)
