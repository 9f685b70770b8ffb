"""Progress bars for a person watching a terminal (rich); silent on ranks other than 0."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class _Bar:
    def __init__(self, progress: Progress | None, task_id) -> None:
        self._p, self._t = progress, task_id

    def update(self, advance: int = 1, **fields: float) -> None:
        if self._p is None:
            return
        info = "  ".join(f"{k} {v:.4g}" for k, v in fields.items())
        self._p.update(self._t, advance=advance, info=info)


@contextmanager
def progress_bar(description: str, total: int, completed: int = 0, enabled: bool = True) -> Iterator[_Bar]:
    if not enabled:
        yield _Bar(None, None)
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, transient=False) as progress:
        task_id = progress.add_task(description, total=total, completed=completed, info="")
        yield _Bar(progress, task_id)
