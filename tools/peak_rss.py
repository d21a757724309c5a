"""Wall time and peak resident memory of a command and everything it starts, as the OS reports them.

    python3 tools/peak_rss.py RESULT.json -- COMMAND [ARGS...]

Run this launcher as its own small process. Linux carries a process's memory high-water mark
across fork and exec (a child of a 800 MB test process "peaks" at 800 MB before doing anything), so
the measured command must be started from a process that is itself small. Two readings, the larger
is reported: `ru_maxrss` of the waited-for children (the peak of the largest single process of the
tree, file-backed pages included) and the largest sum of VmRSS over the whole tree, sampled every
10 ms from /proc (for commands that start helpers). Also sampled: the largest sum of RssAnon (the
anonymous memory the kernel cannot evict, unlike the pages of a memory-mapped file). RESULT.json
gets `wall_s`, `peak_rss_bytes`, `peak_single_bytes`, `peak_tree_sampled_bytes`,
`peak_anon_sampled_bytes`, `returncode`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return pids


def _status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(cmd: list[str], interval: float = 0.01) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak_tree = peak_anon = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_tree, peak_anon
        while not done.is_set():
            pids = _tree(proc.pid)
            peak_tree = max(peak_tree, sum(_status(p, "VmRSS:") for p in pids))
            peak_anon = max(peak_anon, sum(_status(p, "RssAnon:") for p in pids))
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    if os.path.isdir("/proc"):
        sampler.start()
    returncode = proc.wait()
    wall = time.perf_counter() - start
    done.set()
    if sampler.is_alive():
        sampler.join()
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    single = kib * 1024 if sys.platform != "darwin" else kib  # macOS reports bytes
    return {"wall_s": wall, "peak_rss_bytes": max(single, peak_tree), "peak_single_bytes": single,
            "peak_tree_sampled_bytes": peak_tree, "peak_anon_sampled_bytes": peak_anon, "returncode": returncode}


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    result = measure(sys.argv[3:])
    Path(sys.argv[1]).write_text(json.dumps(result))
    sys.exit(0 if result["returncode"] == 0 else 1)


if __name__ == "__main__":
    main()
