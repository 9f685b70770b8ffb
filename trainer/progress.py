"""Progress for whoever watches: a rich bar on a terminal; elsewhere (a Prefect worker, whose flow
runs log to the Prefect UI, a log file, a rank's pipe) log lines, sparser as the work goes on, and
one at the end. Silent on ranks other than 0."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger(__name__)

FIRST_LINE_SECONDS = 30.0  # then 60, 120, 240 s in, then every 300 s
MOST_SECONDS_BETWEEN_LINES = 300.0


def _info(fields: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in fields.items())


def duration(seconds: float) -> str:
    """`1:05`, or `2:01:05` from an hour on."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Bar:
    def __init__(self, progress: Progress | None, task_id) -> None:
        self._p, self._t = progress, task_id

    def update(self, advance: int = 1, **fields: float) -> None:
        if self._p is None:
            return
        self._p.update(self._t, advance=advance, info=_info(fields))


class LogBar:
    """A progress bar as log lines: `sft: 300/850 steps (35%), 0:42 elapsed, about 1:18 left  loss 1.2`,
    the first after FIRST_LINE_SECONDS, each gap twice the last up to MOST_SECONDS_BETWEEN_LINES; then
    `finish` says how it ended. The rate counts only this run's work (not steps resumed from)."""

    def __init__(self, description: str, total: int, completed: int = 0, unit: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.description, self.total, self.unit, self._clock = description, total, unit, clock
        self.done = self._start = completed
        self._t0 = clock()
        self._gap = FIRST_LINE_SECONDS
        self._next = self._t0 + self._gap
        self._fields: dict[str, float] = {}

    def update(self, advance: int = 1, **fields: float) -> None:
        self.done += advance
        self._fields = fields  # formatted only when a line is said
        now = self._clock()
        if now >= self._next:
            self._gap = min(2 * self._gap, MOST_SECONDS_BETWEEN_LINES)
            self._next = now + self._gap
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (self._clock() if now is None else now) - self._t0
        unit = f" {self.unit}" if self.unit else ""
        text = f"{self.description}: {self.done}/{self.total}{unit}"
        if self.total > 0:
            text += f" ({100 * self.done // self.total}%)"
        text += f", {duration(elapsed)} elapsed"
        rate = (self.done - self._start) / elapsed if elapsed > 0 else 0.0
        if 0 < self.done < self.total and rate > 0:
            text += f", about {duration((self.total - self.done) / rate)} left"
        return text + (f"  {_info(self._fields)}" if self._fields else "")

    def finish(self) -> None:
        log.info("%s", self.line())


@contextmanager
def progress_bar(description: str, total: int, completed: int = 0, enabled: bool = True,
                 unit: str = "") -> Iterator[_Bar | LogBar]:
    if not enabled:
        yield _Bar(None, None)
        return
    console = Console()
    if not console.is_terminal:
        bar = LogBar(description, total, completed, unit)
        yield bar
        bar.finish()  # not on an exception: the stage's failure says what happened
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=console, transient=False) as progress:
        task_id = progress.add_task(description, total=total, completed=completed, info="")
        yield _Bar(progress, task_id)
