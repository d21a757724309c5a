"""Faults while writing: a full disk, a file-size limit, SIGINT / SIGTERM in the middle, two runs to
the same output. For `specconv convert`, `specconv mtp merge` and the hub re-split, each must end
with a one-line error, a non-zero exit and no file left behind (no partial output, no temporary).

Each run is a subprocess: the file-size limit is RLIMIT_FSIZE (writes fail with EFBIG), the full
disk a 256 KiB tmpfs (ENOSPC; skipped where mounting is not allowed), and a signal is delivered
while the process is held stopped just after its first temporary file appeared. A signal that lands
while the finished files are being renamed waits for the renames (all or none): that try must leave
exactly the complete output, and the test aims again.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SPLIT = """
import sys
from pathlib import Path
from specconv.errors import SpecconvError
from specconv.hub.split import plan_split, write_split
src, out = Path(sys.argv[1]), Path(sys.argv[2])
layout = plan_split([src], 300_000)
try:
    write_split(layout, [out / f"m-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)])
except SpecconvError as exc:  # as the CLI reports errors and interruptions
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:
    print("Interrupted.", file=sys.stderr)
    sys.exit(130)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint, and its trunk + MTP sidecar converted (the inputs of merge and split)."""
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("faults")
    src = build_qwen35(root / "hf", n_layers=8)
    trunk = convert_gguf(src, root / "in" / "t.gguf", mtp="separate")
    return {"src": src, "trunk": trunk, "mtp": trunk.with_name("mtp-t.gguf"),
            "embed": convert_gguf(src, root / "in" / "e.gguf", mtp="embed")}


def commands(files, out: Path) -> dict[str, list[str]]:
    py = [sys.executable]
    return {
        "convert": py + ["-m", "specconv", "convert", str(files["src"]), "-o", str(out / "sub" / "m.gguf"),
                         "--mkdir", "--outtype", "f32", "--mtp", "separate", "--threads", "2"],
        "merge": py + ["-m", "specconv", "mtp", "merge", str(files["trunk"]), str(files["mtp"]), "-o",
                       str(out / "sub" / "merged.gguf"), "--mkdir"],
        "split": py + ["-c", SPLIT, str(files["embed"]), str(out / "sub")],
    }


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def check_failed_cleanly(proc: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    err = error_line(proc)
    assert proc.returncode not in (0, None), proc.stderr
    assert all(w in err for w in words), proc.stderr
    assert leftovers(out) == [], leftovers(out)


def error_line(proc) -> str:
    """The one error line (progress lines may precede it; a traceback may not)."""
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith(("error:", "Interrupted", "Aborted"))]
    assert "Traceback" not in proc.stderr and len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    return errors[0]


def _fsize(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("what", ["convert", "merge", "split"])
def test_file_size_limit(files, tmp_path, what):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(commands(files, out)[what], capture_output=True, text=True, preexec_fn=_fsize(200_000),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"{what} under a 200 kB file-size limit: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    check_failed_cleanly(proc, out, "error: cannot write", "over the file-size limit")


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("what", ["convert", "merge", "split"])
def test_full_disk(files, small_disk, what):
    proc = subprocess.run(commands(files, small_disk)[what], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"{what} on a full 256 KiB disk: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    check_failed_cleanly(proc, small_disk, "error: cannot write", "the disk is full")


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".partial" in str(p.relative_to(folder))] if folder.exists() else []


def finals(folder: Path) -> list[str]:
    return [p for p in leftovers(folder) if ".partial" not in p]


def _interrupt(cmd: list[str], out: Path, sig: int, complete: list[str], tries: int = 20):
    """Run cmd; the moment a temporary file shows up under out, stop it, send sig, let it go on.
    Returns the first process stopped while writing (no final output yet), or None when every try
    finished first. A signal that lands while the finished files are being renamed is held until
    the renames are done (all or none): such a try must leave exactly the complete output, and is
    not counted; the next try aims again."""
    for _ in range(tries):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        caught = False
        while proc.poll() is None:
            if any(p.is_file() for p in temporaries(out)):
                os.kill(proc.pid, signal.SIGSTOP)
                os.kill(proc.pid, sig)
                os.kill(proc.pid, signal.SIGCONT)
                caught = True
                break
        stdout, stderr = proc.communicate(timeout=120)
        result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if caught and not finals(out):
            return result
        if caught:  # too late: the renames had begun, so all of them completed
            assert temporaries(out) == [] and finals(out) == complete, (leftovers(out), stderr)
        for p in sorted(out.rglob("*"), reverse=True):  # clean up, try again
            p.unlink() if p.is_file() else p.rmdir()
        time.sleep(0.05)
    return None


def complete_output(files, what: str) -> list[str]:
    """The names a finished run of `what` leaves under its output folder."""
    named = {"convert": ["sub", "sub/m.gguf", "sub/mtp-m.gguf"], "merge": ["sub", "sub/merged.gguf"]}
    if what in named:
        return named[what]
    from specconv.hub.split import plan_split

    n = plan_split([files["embed"]], 300_000).count
    return ["sub"] + [f"sub/m-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("what", ["convert", "merge", "split"])
def test_signal_in_the_middle(files, tmp_path, what, sig):
    out = tmp_path / "out"
    out.mkdir()
    proc = _interrupt(commands(files, out)[what], out, sig, complete_output(files, what))
    if proc is None:
        pytest.fail(f"{what} always finished before a temporary file could be seen")
    print(f"{what} + {signal.Signals(sig).name} mid-write: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    assert proc.returncode not in (0, None), proc.stderr
    if proc.stderr.strip():
        error_line(proc)
    assert leftovers(out) == [], leftovers(out)


def test_two_converts_to_one_output(files, tmp_path):
    """Started together: one writes the file, the other refuses (nothing of it is left); with --force
    both succeed one after the other and the file is whole."""
    from tests.fixtures.gguf_files import convert_gguf

    reference = convert_gguf(files["src"], tmp_path / "ref" / "m.gguf", mtp="embed").read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    for force in ([], ["--force"]):
        cmd = [sys.executable, "-m", "specconv", "convert", str(files["src"]), "-o", str(out / "m.gguf"),
               "--outtype", "f32", "--mtp", "embed", *force]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read().strip()) for p in procs]
        for p in procs:
            p.stdout.close(), p.stderr.close()
        print(f"two converts {' '.join(force) or '(no --force)'}: {results}")
        codes = sorted(code for code, _ in results)
        if force:
            assert codes == [0, 0], results
        else:
            assert codes == [0, 2], results
            err = next(e for code, e in results if code)
            assert len(err.splitlines()) == 1 and ("already exists" in err or "appeared while" in err), err
        assert leftovers(out) == ["m.gguf"] and (out / "m.gguf").read_bytes() == reference
        (out / "m.gguf").unlink()
