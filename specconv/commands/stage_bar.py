"""One rich progress bar on stderr for a long job that reports its stages (compare, imatrix): the job
calls `progress(description, advance=0, total=None)`; the bar goes when the job ends."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def stage_bar() -> Iterator[Callable[..., None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def progress(description: str, advance: int = 0, total: int | None = None) -> None:
            bar.update(task, description=description, advance=advance, **({"total": total} if total else {}))

        yield progress
