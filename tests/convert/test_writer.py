"""Positioned writes: a tensor's chunks may land in any order, from any thread, and the file is the same
bytes gguf-py's own writer makes from whole tensors (alignment padding included, shards included)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError
from specconv.convert.writer import AtomicOutputs, GgufOutput, TensorEntry

F32, BF16 = GGMLQuantizationType.F32, GGMLQuantizationType.BF16
KV = [MetaKV("general.name", "tiny", GGUFValueType.STRING), MetaKV("tiny.block_count", 2, GGUFValueType.UINT32)]


def tensors(seed: int) -> list[tuple[TensorEntry, np.ndarray]]:
    """Sizes that are not multiples of the alignment, so every tensor but the last is padded."""
    rng = np.random.default_rng(seed)
    out = []
    for i, shape in enumerate([(3, 5), (7,), (4, 9, 3), (11, 2)]):
        ggml_type = BF16 if i % 2 else F32
        data = rng.integers(0, 256, size=int(np.prod(shape)) * (2 if ggml_type == BF16 else 4), dtype=np.uint8)
        out.append((TensorEntry(f"t{i}.weight", shape, ggml_type, data.size), data))
    return out


def output_of(path, items, **kwargs) -> GgufOutput:
    return GgufOutput(path, "tiny", KV, [entry for entry, _ in items], **kwargs)


def reference_files(tmp_path, items, split_max_size: int = 0, shard_counts=None) -> list[bytes]:
    """The same KV and tensors through gguf-py's writer, whole tensors in sequence (shards cut by
    gguf-py at `split_max_size`, or after the given numbers of tensors)."""
    w = GGUFWriter(None, "tiny", split_max_size=split_max_size)
    for kv in KV:
        w.add_key_value(kv.key, kv.value, kv.vtype)
    for entry, data in items:
        per_value = 2 if entry.ggml_type == BF16 else 4
        byte_shape = (*entry.shape[:-1], entry.shape[-1] * per_value)  # gguf-py takes raw bytes by their byte shape
        if shard_counts and len(w.tensors[-1]) == shard_counts[len(w.tensors) - 1]:
            w.tensors.append({})  # gguf-py's own way to start the next shard
        w.add_tensor(entry.name, data.reshape(byte_shape), raw_dtype=entry.ggml_type)
    stem = tmp_path / "ref.gguf"
    w.write_header_to_file(stem)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [p.read_bytes() for p in sorted(tmp_path.glob("ref*.gguf"))]


@pytest.mark.parametrize("split_max_size", [0, 200])
def test_chunks_written_backwards_give_gguf_pys_bytes(tmp_path, split_max_size):
    items = tensors(seed=split_max_size + 1)
    output = output_of(tmp_path / "out" / "m.gguf", items, split_max_size=split_max_size)
    with AtomicOutputs([output]):
        for entry, data in reversed(items):  # last tensor first, each one's chunks last first
            place = output.place(entry.name)
            for start in reversed(range(0, data.size, 6)):
                output.write_at(place, start, data[start:start + 6])
        for entry, data in items:  # the ordered bookkeeping the engine does on its own thread
            output.begin(entry.name, entry.nbytes)
            output.written(entry.nbytes)
            output.end()
    ours = [p.read_bytes() for p in output.final_paths]
    expected = reference_files(tmp_path, items, split_max_size)
    assert len(ours) == len(expected) and (len(ours) > 1) == bool(split_max_size)
    assert ours == expected


def test_write_at_refuses_bytes_outside_the_tensor(tmp_path):
    items = tensors(seed=3)
    output = output_of(tmp_path / "m.gguf", items)
    with pytest.raises(SpecconvError, match="do not fit"):
        with AtomicOutputs([output]):
            entry, data = items[0]
            output.write_at(output.place(entry.name), 4, data)  # 4 bytes past the end
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_accounted_short_is_an_error(tmp_path):
    items = tensors(seed=4)
    output = output_of(tmp_path / "m.gguf", items)
    with pytest.raises(SpecconvError, match="bytes short"):
        with AtomicOutputs([output]):
            entry, _ = items[0]
            output.begin(entry.name, entry.nbytes)
            output.written(entry.nbytes - 1)
            output.end()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_copies_tensors_file_to_file(tmp_path, monkeypatch, kernel_copy):
    """Whole tensors copied from another file (the hub re-split): by the kernel, or through a small
    buffer where the kernel cannot; shards cut where `shard_counts` says, bytes as gguf-py's."""
    import errno
    import os

    from specconv.convert import writer

    items = tensors(seed=5)
    source = tmp_path / "source.bin"
    source.write_bytes(b"".join(data.tobytes() for _, data in items))
    if not kernel_copy:
        def refused(*args):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refused)
        monkeypatch.setattr(writer, "COPY_BUFFER", 7)  # several pieces per tensor
    output = output_of(tmp_path / "out" / "m.gguf", items, shard_counts=[1, 3])
    fd = os.open(source, os.O_RDONLY)
    try:
        with AtomicOutputs([output]):
            at = 0
            for entry, data in items:
                output.copy(entry.name, fd, at)
                at += data.size
    finally:
        os.close(fd)
    assert len(output.final_paths) == 2
    assert [p.read_bytes() for p in output.final_paths] == reference_files(tmp_path, items, shard_counts=[1, 3])


def test_shard_counts_must_cover_every_tensor(tmp_path):
    items = tensors(seed=6)
    with pytest.raises(SpecconvError, match="shards of"):
        output_of(tmp_path / "m.gguf", items, shard_counts=[1, 2])
