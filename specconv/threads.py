"""How many threads torch runs a model on (`verify`, `generate`: --threads 0, the default)."""

from __future__ import annotations

import math
import os

THREADS_HELP = ("Compute threads (0: as many as the model's matrices can use, each thread getting at least the "
                "runtime's minimum share of a typical matrix, and no more than the cores other processes leave "
                "idle: a tiny model runs on one thread, a large one on every idle core).")
_DEFAULT: list[int] = []  # torch's count when first asked, before any command lowered it


def set_threads(model, requested: int = 0) -> int:
    """Set torch's thread count for running `model` and return it. `requested` 0 picks it by the runtime's own
    rule for splitting a call (runtime/dequant_native.py: MIN_THREAD_ELEMENTS values per thread), applied to
    the model's typical matrix: the size-weighted median of its 2-D tensors, where most of a forward's time
    goes; and at most the cores the other processes leave idle (the 1-minute load average), since torch's
    OpenMP threads spin while they wait for a core. Measured on a 2-core machine under a load of 6-7:
    the bundled 2.9 M-parameter model ran `verify --hf` in 82 s on two threads and 6 s on one; a 1 B
    q8_0 model's default verify did not finish in 900 s on two threads and took 85 s on one."""
    import torch

    from specconv.runtime.dequant_native import MIN_THREAD_ELEMENTS

    if not _DEFAULT:
        _DEFAULT.append(torch.get_num_threads())
    if requested:
        torch.set_num_threads(requested)
        return requested
    sizes = sorted(int(math.prod(t.shape)) for t in model.file.tensors.values() if len(t.shape) >= 2)
    typical, seen = 0, 0
    for size in sizes:
        seen += size
        if 2 * seen >= sum(sizes):
            typical = size
            break
    threads = max(1, min(_DEFAULT[0] - busy_cores(), typical // MIN_THREAD_ELEMENTS))
    torch.set_num_threads(threads)
    return threads


def busy_cores() -> int:
    """Cores other processes keep busy: the 1-minute load average, rounded down (0 where it is unknown)."""
    try:
        return int(os.getloadavg()[0])
    except OSError:
        return 0
