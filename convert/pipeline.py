"""An ordered work pipeline: jobs run on worker threads, their results are consumed in submission order.

The conversion engine submits one job per chunk of a tensor (read, encode, write at its place) and
follows each with what to do with the result (account for the bytes, report progress); markers
(start a tensor, finish it, release its source) queue between them. Results are consumed on the
submitting thread strictly in order, so every check and progress report happens in tensor order
whatever the number of threads (numpy kernels, the native encoder and file reads and writes all run
outside the GIL). At most `backlog` jobs are in flight, which bounds the work queued ahead.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


SPARE_WORKERS = 2  # workers beyond the cores: they encode while others wait on the disk


def default_workers() -> int:
    """Workers for a conversion: one per core, plus spares, since a worker spends part of its time
    blocked in a read or a write (measured: docs/benchmarks.md, "Reading the conversion figures")."""
    return available_cores() + SPARE_WORKERS


class OrderedPool:
    """`submit(job, then)` runs job() on a worker and then(result) here, in submission order.

    With threads <= 1 every job runs immediately on the calling thread: the serial reference.
    """

    def __init__(self, threads: int, backlog: int | None = None):
        self.threads = max(1, threads)
        self.backlog = backlog or 2 * self.threads + 2
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="specconv-encode") \
            if self.threads > 1 else None
        self._pending: deque[tuple[Future | None, Callable[[Any], None]]] = deque()

    def submit(self, job: Callable[[], Any], then: Callable[[Any], None]) -> None:
        if self._executor is None:
            then(job())
            return
        while len(self._pending) >= self.backlog:
            self._consume_one()
        self._pending.append((self._executor.submit(job), then))

    def after(self, step: Callable[[], None]) -> None:
        """Run step() once everything submitted before it has been consumed."""
        if self._executor is None or not self._pending:
            step()
            return
        self._pending.append((None, lambda _: step()))

    def drain(self) -> None:
        while self._pending:
            self._consume_one()

    def _consume_one(self) -> None:
        future, then = self._pending.popleft()
        then(future.result() if future is not None else None)
        while self._pending and self._pending[0][0] is None:  # markers right behind it
            self._pending.popleft()[1](None)

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self.drain()
            except BaseException:
                self._shutdown()
                raise
        self._shutdown()
        return False

    def _shutdown(self) -> None:
        for future, _ in self._pending:
            if future is not None:
                future.cancel()
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
