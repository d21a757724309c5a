"""The written bytes do not depend on how the work is cut up: threads, chunk size, piece size.

Each case converts the same checkpoint with one thread and default chunking (the serial reference)
and again with several threads and chunks so small that every tensor spans many chunks and pieces
(so chunk boundaries, out-of-order completion and the ordered writer are all exercised), then
compares the files byte for byte. Byte identity with llama.cpp's own converter is tested in
tests/convert/test_upstream.py.
"""

from __future__ import annotations

import pytest

from specconv.convert import kernels, stream
from tests.fixtures.cli import convert


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("parallel-src")
    return {
        "dense": build_qwen35(root / "dense", seed=11),
        "moe-experts": build_qwen35(root / "moe", moe=True, layout="save_pretrained", seed=12),
    }


@pytest.mark.parametrize("outtype", ["bf16", "q8_0", "f16", "q4_0", "f32"])
@pytest.mark.parametrize("kind", ["dense", "moe-experts"])
def test_serial_and_parallel_outputs_are_identical(checkpoints, tmp_path, capsys, monkeypatch, kind, outtype):
    src = checkpoints[kind]
    args = ["--outtype", outtype, "--mtp", "separate", "--split-max-size", "60K"]
    convert(capsys, src, tmp_path / "serial" / "m.gguf", *args, "--threads", "1")
    monkeypatch.setattr(kernels, "PIECE", 256)
    monkeypatch.setattr(stream, "CHUNK", 1024)
    convert(capsys, src, tmp_path / "parallel" / "m.gguf", *args, "--threads", "4")
    serial = sorted(p.name for p in (tmp_path / "serial").iterdir())
    parallel = sorted(p.name for p in (tmp_path / "parallel").iterdir())
    assert serial == parallel and len(serial) >= 3  # split shards of the trunk file and the sidecar
    for name in serial:
        a, b = (tmp_path / "serial" / name).read_bytes(), (tmp_path / "parallel" / name).read_bytes()
        assert a == b, f"{name} differs between --threads 1 and --threads 4"
    print(f"{kind} {outtype}: {len(serial)} files, {sum(len((tmp_path / 'serial' / n).read_bytes()) for n in serial)} "
          "bytes identical")
