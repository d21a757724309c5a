"""SIGINT at every point of an atomic write, delivered deterministically.

CPython runs a Python-level signal handler in the main thread at its check points (a call, a loop
jumping back), with the frame it interrupted, so a signal can surface at any call or line. `SignalAt`
does that on purpose: at the n-th time a given line runs (or function is called) between
`AtomicOutputs.__enter__` and the end of `__exit__`, it calls the SIGINT handler then in force with
that frame, which is what a real Ctrl-C arriving at that moment does. After a first run has loaded
everything, the sweep aims at the first and the last time each line of the writer's own code runs
(and at every k-th event elsewhere: the caller's loop, gguf-py, pathlib, all alike). That covers the
windows a real signal (test_write_faults.py) hits only by chance: the first instruction of
`__exit__`, opening the files, the renames, the removal of the temporaries.

For convert (`--mtp separate`: two files), `mtp merge` (into a folder `--mkdir` creates) and the hub
re-split (several shards), each replacing a previous output: every interrupted run must end as
Ctrl-C does (exit 130 / KeyboardInterrupt), with no temporary file left, and with either the
previous files untouched (and a created folder gone) or the complete new output, never a mix.
"""

from __future__ import annotations

import inspect
import signal
import sys
from pathlib import Path

import pytest

from specconv.convert.writer import AtomicOutputs

WRITER_CODE = str(Path(sys.modules[AtomicOutputs.__module__].__file__))
OTHERS_EVERY = 500  # of the other events (one step of the caller's loop is like the next), one in this many
# A generator's 'call' event is also its resumption, or its close when it is dropped unfinished (where
# an exception is only reported, "Exception ignored"); CPython checks for signals at neither.
RESUMED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


Site = tuple[str, int, str]  # (file, line, 'call' or 'line')


class SignalAt:
    """A trace function: records the call / line events of the main thread from the call of
    `AtomicOutputs.__enter__` to the return of `__exit__`, and at `at` (a site and which time it is
    reached, from 1; None: never) calls the SIGINT handler in force with that event's frame. An
    exception it raises goes into that frame (CPython then stops tracing: one signal per run)."""

    def __init__(self, at: tuple[Site, int] | None = None):
        self.at = at
        self.events: list[Site] = []
        self._seen: dict[Site, int] = {}
        self.where = ""  # where the signal was delivered
        self._active = self._done = False

    def __call__(self, frame, event, arg):  # sys.settrace: every call
        if not self._active:
            if self._done or frame.f_code is not AtomicOutputs.__enter__.__code__:
                return None
            self._active = True
            caller = frame.f_back
            while caller is not None:  # the caller's lines (the body of its `with`) count too
                caller.f_trace, caller.f_trace_lines = self._local, True
                caller = caller.f_back
        return self._local(frame, event, arg)

    def _local(self, frame, event, arg):
        if not self._active:
            return None
        if event == "line" or (event == "call" and not frame.f_code.co_flags & RESUMED):
            site = (frame.f_code.co_filename, frame.f_lineno, event)
            self.events.append(site)
            self._seen[site] = self._seen.get(site, 0) + 1
            if (site, self._seen[site]) == self.at:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name} ({event})"
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)
        elif event == "return" and frame.f_code is AtomicOutputs.__exit__.__code__:
            self._active, self._done = False, True
        return self._local


def traced(run, tracer: SignalAt) -> BaseException | None:
    """`run()` under `tracer`; the exception it ended with (None: it returned)."""
    sys.settrace(tracer)
    try:
        run()
    except (KeyboardInterrupt, SystemExit) as exc:
        return exc
    finally:
        sys.settrace(None)
    return None


def interrupted(exc: BaseException | None) -> bool:
    """Ended as Ctrl-C ends it: KeyboardInterrupt in-process, exit 130 through the CLI."""
    return isinstance(exc, KeyboardInterrupt) or (isinstance(exc, SystemExit) and exc.code == 130)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint, and its trunk + MTP sidecar and embedded conversions (the inputs)."""
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("signal_windows")
    src = build_qwen35(root / "hf", n_layers=4)
    trunk = convert_gguf(src, root / "in" / "t.gguf", mtp="separate")
    return {"src": src, "trunk": trunk, "mtp": trunk.with_name("mtp-t.gguf"),
            "embed": convert_gguf(src, root / "in" / "e.gguf", mtp="embed")}


def job(files, what: str, out: Path):
    """(run, the final files, the folder the run creates or None) for `what` writing under `out`."""
    from specconv import cli

    def main(*args):
        return lambda: cli.main([*args])

    if what == "convert":
        finals = [out / "m.gguf", out / "mtp-m.gguf"]
        return main("convert", str(files["src"]), "-o", str(finals[0]), "--outtype", "f32", "--mtp", "separate",
                    "--threads", "1", "--force"), finals, None
    if what == "merge":
        finals = [out / "sub" / "merged.gguf"]
        return main("mtp", "merge", str(files["trunk"]), str(files["mtp"]), "-o", str(finals[0]), "--mkdir"), \
            finals, out / "sub"
    from specconv.hub.split import plan_split, write_split

    layout = plan_split([files["embed"]], 300_000)
    assert layout.count >= 3
    finals = [out / f"m-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)]
    return lambda: write_split(layout, finals), finals, None


def previous_output(finals: list[Path], created: Path | None) -> dict[Path, bytes]:
    """The files a run is to replace (none where it writes into a folder it creates)."""
    if created is not None:
        return {}
    previous = {p: f"previous {p.name}\n".encode() for p in finals}
    for p, data in previous.items():
        p.write_bytes(data)
    return previous


def state(out: Path, finals: list[Path], previous: dict[Path, bytes], complete: dict[Path, bytes],
          created: Path | None) -> str:
    """'previous' (nothing of the run), 'complete' (all of it), or what is wrong."""
    temporaries = sorted(str(p.relative_to(out)) for p in out.rglob("*") if ".partial" in p.name)
    if temporaries:
        return f"temporaries left: {temporaries}"
    files = {p: p.read_bytes() for p in finals if p.exists()}
    if files == complete:
        return "complete"
    if files == previous and (created is None or not created.exists()):
        return "previous"
    return f"a mix: {sorted(p.name for p in files)}, complete {[files.get(p) == complete[p] for p in finals]}" \
           + (f", {created.name} left" if created is not None and created.exists() else "")


def aimed_at(events: list[Site]) -> list[tuple[Site, int]]:
    """In the order they come: the first and the last time each site of the writer is reached, and every
    k-th other event (each as a site and which time it is reached)."""
    seen: dict[Site, int] = {}
    numbered = []
    for site in events:
        seen[site] = seen.get(site, 0) + 1
        numbered.append((site, seen[site]))
    return [(site, k) for n, (site, k) in enumerate(numbered, start=1)
            if (site[0] == WRITER_CODE and k in (1, seen[site])) or n % OTHERS_EVERY == 0]


@pytest.mark.parametrize("what", ["convert", "merge", "split"])
def test_sigint_at_every_point_of_the_write(files, tmp_path, what):
    for name in ("warm-up", "reference"):  # the first run imports what it needs; the second is counted
        (tmp_path / name).mkdir()
        run, finals, created = job(files, what, tmp_path / name)
        previous_output(finals, created)  # as in the runs aimed at: the same steps
        counting = SignalAt()
        assert traced(run, counting) is None
    complete = [p.read_bytes() for p in finals]
    aims = aimed_at(counting.events)
    assert len(aims) > 100

    outcomes: dict[str, int] = {}
    for i, aim in enumerate(aims):
        out = tmp_path / f"at-{i}"
        out.mkdir()
        run, finals, created = job(files, what, out)
        previous = previous_output(finals, created)
        tracer = SignalAt(aim)
        exc = traced(run, tracer)
        assert tracer.where, f"{aim} was not reached"
        assert interrupted(exc), f"SIGINT at {tracer.where}: the run ended with {exc!r}, not as Ctrl-C ends it"
        got = state(out, finals, previous, dict(zip(finals, complete)), created)
        assert got in ("previous", "complete"), f"SIGINT at {tracer.where}: {got}"
        outcomes[got] = outcomes.get(got, 0) + 1
    print(f"{what}: SIGINT at {len(aims)} of {len(counting.events)} events: {outcomes}")
    assert outcomes.get("previous") and outcomes.get("complete")  # both sides of the renames were aimed at


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_taken_by_another_thread_waits_for_the_renames(tmp_path, monkeypatch, sig):
    """The kernel hands a process's signal to any thread that does not block it (a progress bar's, an
    encoder's), and Python then runs the handler in the main thread at its next check: a signal mask
    set in the main thread alone does not hold it back. Here it comes between the renames of two
    outputs (shards in two folders, one created by the run); both must be renamed, then it is raised."""
    import os
    import threading

    from specconv.convert.writer import Terminated
    from tests.convert.test_writer import output_of, reference_files, tensors

    items = tensors(seed=7)
    outputs = [output_of(tmp_path / "a.gguf", items, shard_counts=[2, 2],
                         shard_names=[tmp_path / "a-1.gguf", tmp_path / "new" / "a-2.gguf"]),
               output_of(tmp_path / "b.gguf", items)]
    finals = [p for o in outputs for p in o.final_paths]
    (tmp_path / "a-1.gguf").write_bytes(b"previous a-1")
    (tmp_path / "b.gguf").write_bytes(b"previous b")
    for ref in ("ref-a", "ref-b"):
        (tmp_path / ref).mkdir()
    expected = [*reference_files(tmp_path / "ref-a", items, shard_counts=[2, 2]),
                *reference_files(tmp_path / "ref-b", items)]

    go, sent = threading.Event(), threading.Event()

    def other_thread():  # SIGINT / SIGTERM delivered to this thread, as the kernel may choose
        if go.wait(timeout=60):
            signal.pthread_kill(threading.get_ident(), sig)
            sent.set()

    helper = threading.Thread(target=other_thread, daemon=True)
    helper.start()
    real_replace, renamed = os.replace, []

    def replace(src, dst):
        if len(renamed) == 1:  # between the first rename and the second
            go.set()
            assert sent.wait(timeout=60)
        real_replace(src, dst)
        renamed.append(dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Terminated if sig == signal.SIGTERM else KeyboardInterrupt):
        with AtomicOutputs(outputs, overwrite=True):
            for o in outputs:
                for entry, data in items:
                    o.write(entry.name, data)
    helper.join()
    assert renamed == finals
    assert [p.read_bytes() for p in finals] == expected
    assert sorted(p.name for p in tmp_path.rglob("*") if ".partial" in p.name) == []
