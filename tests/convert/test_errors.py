"""Bad input to `specconv convert`: non-zero exit, one line that names the problem, no file left behind.

Each test breaks a freshly built tiny checkpoint in one way and runs the real entry point in-process."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.fixtures.cli import assert_refused, run_cli



@pytest.fixture
def build(tmp_path):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    def make(**kw) -> Path:
        return build_qwen35(tmp_path / "src", **kw)

    return make


def _edit_config(src: Path, edit) -> None:
    path = src / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_unknown_architecture_lists_supported(build, tmp_path, capsys):
    src = build()
    _edit_config(src, lambda c: c.update(architectures=["FooBarForCausalLM"]))
    assert_refused(capsys, src, tmp_path / "out", expect=["FooBarForCausalLM", "Qwen3_5ForCausalLM",
                                                          "Qwen3_5MoeForConditionalGeneration"])


def test_missing_shard(build, tmp_path, capsys):
    src = build(sharded=True)
    (src / "model-00002-of-00002.safetensors").unlink()
    assert_refused(capsys, src, tmp_path / "out", expect=["model-00002-of-00002.safetensors", "missing"])


def test_truncated_safetensors(build, tmp_path, capsys):
    src = build()
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    assert_refused(capsys, src, tmp_path / "out", expect=["model.safetensors", "truncated"])


def test_corrupt_header(build, tmp_path, capsys):
    src = build()
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00garbage"  # inside the JSON header
    path.write_bytes(bytes(data))
    assert_refused(capsys, src, tmp_path / "out", expect=["model.safetensors", "corrupt"])


def test_header_length_beyond_the_file(build, tmp_path, capsys):
    src = build()
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    path.write_bytes(bytes(data))
    assert_refused(capsys, src, tmp_path / "out", expect=["model.safetensors", "header"])


def test_config_and_tensor_shapes_disagree(build, tmp_path, capsys):
    src = build()
    _edit_config(src, lambda c: c.update(intermediate_size=96))  # tensors are 128 wide
    assert_refused(capsys, src, tmp_path / "out", expect=["shape", "[128, 64]", "config.json"])


def test_mtp_only_without_mtp_tensors(build, tmp_path, capsys):
    src = build(mtp=False)
    assert_refused(capsys, src, tmp_path / "out", "--mtp", "only", expect=["--mtp only", "no MTP tensors"])


def test_mtp_separate_without_mtp_tensors(build, tmp_path, capsys):
    src = build(mtp=False)
    assert_refused(capsys, src, tmp_path / "out", "--mtp", "separate", expect=["--mtp separate", "no MTP tensors"])


def test_stripped_mtp_head_is_never_dropped_silently(build, tmp_path, capsys):
    """config.json declares an MTP layer but its weights are gone: refused unless --mtp none."""
    src = build(mtp=False)
    _edit_config(src, lambda cfg: cfg.update(mtp_num_hidden_layers=1))
    for mode in ("embed", "only", "separate"):
        assert_refused(capsys, src, tmp_path / "out", "--mtp", mode,
                       expect=["mtp_num_hidden_layers=1", "--mtp none"])
    rc, _, err = run_cli(capsys, "convert", src, "-o", tmp_path / "out" / "trunk.gguf", "--mtp", "none")
    assert rc == 0, err
    assert (tmp_path / "out" / "trunk.gguf").is_file()


def test_existing_output_needs_force(build, tmp_path, capsys):
    src = build()
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.gguf").write_bytes(b"keep me")
    assert_refused(capsys, src, out, expect=["model.gguf", "already exists", "--force"])
    assert (out / "model.gguf").read_bytes() == b"keep me"
    # The sidecar of --mtp separate counts too.
    (out / "model.gguf").unlink()
    (out / "mtp-model.gguf").write_bytes(b"keep me")
    assert_refused(capsys, src, out, "--mtp", "separate", expect=["mtp-model.gguf", "already exists"])
    rc, _, err = run_cli(capsys, "convert", src, "-o", out / "model.gguf", "--mtp", "separate", "--force")
    assert rc == 0, err
    assert (out / "mtp-model.gguf").read_bytes()[:4] == b"GGUF"


def test_integer_tensor_where_a_float_is_needed(build, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    src = build()
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(src / "model.safetensors"))
    assert_refused(capsys, src, tmp_path / "out", expect=[name, "I32"])


def test_unsupported_dtype_in_header(build, tmp_path, capsys):
    src = build()
    path = src / "model.safetensors"
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n].replace(b'"F32"', b'"F99"', 1)  # same length: offsets stay valid
    path.write_bytes(data[:8] + header + data[8 + n:])
    assert_refused(capsys, src, tmp_path / "out", expect=["unsupported dtype F99"])


def test_no_config(build, tmp_path, capsys):
    src = build()
    (src / "config.json").unlink()
    assert_refused(capsys, src, tmp_path / "out", expect=["config.json"])


def test_only_pickled_weights_are_refused(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    assert_refused(capsys, src, tmp_path / "out", expect=["no safetensors", "pytorch_model.bin", "pickle"])


@pytest.mark.parametrize("mode", ["embed", "separate"])
@pytest.mark.parametrize("split", [False, True])
def test_interrupted_conversion_leaves_no_file(build, tmp_path, capsys, monkeypatch, mode, split):
    """Ctrl-C (KeyboardInterrupt) from inside tensor writing: exit 130, no file, no temporary file."""
    from specconv.convert import writer

    src = build(moe=True)
    real_write, calls = writer.GgufOutput.write_at, {"n": 0}

    def interrupted(self, place, offset, data):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return real_write(self, place, offset, data)

    monkeypatch.setattr(writer.GgufOutput, "write_at", interrupted)
    out = tmp_path / "out" / "sub"  # a folder the run creates: removed again
    extra = ["--split-max-size", "60K"] if split else []
    rc, _, err = run_cli(capsys, "convert", src, "-o", out / "model.gguf", "--mkdir", "--mtp", mode, *extra)
    assert rc == 130 and calls["n"] >= 20, err  # workers may finish the chunks already in flight
    assert not (tmp_path / "out" / "sub").exists()
    assert list((tmp_path / "out").iterdir()) == [] if (tmp_path / "out").exists() else True


def test_error_while_writing_leaves_no_file(build, tmp_path, capsys, monkeypatch):
    """Any failure mid-write (here a disk error) removes every partial file of every output."""
    from specconv.convert import writer

    src = build()
    real_write, calls = writer.GgufOutput.write_at, {"n": 0}

    def failing(self, place, offset, data):
        calls["n"] += 1
        if calls["n"] == 30:
            raise OSError(28, "No space left on device")
        return real_write(self, place, offset, data)

    monkeypatch.setattr(writer.GgufOutput, "write_at", failing)
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = run_cli(capsys, "convert", src, "-o", out / "model.gguf", "--mtp", "separate")
    assert rc != 0 and "No space left" in err
    assert list(out.iterdir()) == []


def test_error_on_an_encoding_thread_leaves_no_file(build, tmp_path, capsys, monkeypatch):
    """A failure inside a worker thread (here: the encoder) reaches the user as one error; no file stays."""
    from specconv.archs.errors import SpecconvError
    from specconv.convert import stream

    src = build()
    real_encode, calls = stream.encode_run, {"n": 0}

    def failing(values, ggml_type, out=None):
        calls["n"] += 1
        if calls["n"] == 25:
            raise SpecconvError("simulated encoder failure")
        return real_encode(values, ggml_type, out)

    monkeypatch.setattr(stream, "encode_run", failing)
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = run_cli(capsys, "convert", src, "-o", out / "model.gguf", "--mtp", "separate", "--threads", "3")
    assert rc == 2 and "simulated encoder failure" in err and calls["n"] >= 25, err
    assert list(out.iterdir()) == []
