"""Tiny GGUF files for the upload tests, written directly with gguf.GGUFWriter.

They mimic the three qwen35 layouts of docs/reference/gguf-layout.md §4.2 (embedded MTP, trunk-only,
MTP-only sidecar) with random weights, a few Q8_0 matrices and F32 norms, and a small tokenizer,
so that the upload plan sees real KV, real tensor types and real sizes without the converter.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

ARCH = "qwen35"
N_LAYER = 2  # trunk blocks; the MTP block is blk.2
H = 64
V = 96
FF = 128


def _tensors(rng: np.random.Generator, layout: str, hidden: int):
    """(name, float32 array in torch order, storage type) for one layout."""

    def mat(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32)

    def vec(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    shared = [
        ("token_embd.weight", mat(V, hidden), q8),
        ("output_norm.weight", vec(hidden), f32),
        ("output.weight", mat(V, hidden), q8),
    ]

    def block(i):
        return [
            (f"blk.{i}.attn_norm.weight", vec(hidden), f32),
            (f"blk.{i}.attn_q.weight", mat(hidden, hidden), q8),
            (f"blk.{i}.attn_k.weight", mat(hidden, hidden), q8),
            (f"blk.{i}.ffn_up.weight", mat(FF, hidden), q8),
            (f"blk.{i}.ffn_down.weight", mat(hidden, FF), q8),
            (f"blk.{i}.post_attention_norm.weight", vec(hidden), f32),
        ]

    mtp_block = block(N_LAYER) + [
        (f"blk.{N_LAYER}.nextn.eh_proj.weight", mat(hidden, 2 * hidden), q8),
        (f"blk.{N_LAYER}.nextn.enorm.weight", vec(hidden), f32),
        (f"blk.{N_LAYER}.nextn.hnorm.weight", vec(hidden), f32),
        (f"blk.{N_LAYER}.nextn.shared_head_norm.weight", vec(hidden), f32),
    ]
    trunk = [t for i in range(N_LAYER) for t in block(i)]
    if layout == "embedded":
        return shared[:1] + trunk + mtp_block + shared[1:]
    if layout == "trunk":
        return shared[:1] + trunk + shared[1:]
    if layout == "sidecar":
        return shared + mtp_block
    raise ValueError(layout)


def write_tiny_gguf(
    path: Path,
    layout: str = "embedded",
    *,
    seed: int = 0,
    name: str = "Tiny Qwen3.5",
    basename: str | None = "Tiny-Qwen3.5",
    size_label: str | None = "0.1M",
    file_type: int | None = gguf.LlamaFileType.MOSTLY_Q8_0,
    license: str | None = "apache-2.0",
    base_model_repo: str | None = "https://huggingface.co/Qwen/Qwen3.5-0.8B",
    hidden: int = H,
    arch: str = ARCH,
) -> Path:
    """Write one tiny GGUF (`layout`: embedded | trunk | sidecar) and return its path."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_type("model")
    w.add_name(name)
    if basename:
        w.add_basename(basename)
    if size_label:
        w.add_size_label(size_label)
    if file_type is not None:
        w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if license:
        w.add_license(license)
    if base_model_repo:
        w.add_base_model_count(1)
        w.add_base_model_repo_url(0, base_model_repo)
    has_mtp = layout in ("embedded", "sidecar")
    w.add_block_count(N_LAYER + (1 if has_mtp else 0))
    if has_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(FF)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_float32(f"{arch}.rope.dimension_count_fraction_test", 0.25)
    w.add_bool(f"{arch}.recurrent_test_flag", True)
    w.add_array(f"{arch}.recurrent_layers_test", [True, False, True][: N_LAYER + has_mtp])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list([f"tok{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges(["t o", "to k"])
    w.add_eos_token_id(1)
    for tname, data, ttype in _tensors(rng, layout, hidden):
        if ttype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, quantize(data, ttype), raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_bytes(paths: list[Path]) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    """name -> (ggml type, ggml shape, raw bytes) across one file or a shard set."""
    out = {}
    for p in paths:
        reader = gguf.GGUFReader(p)
        for t in reader.tensors:
            raw = bytes(reader.data[t.data_offset : t.data_offset + t.n_bytes])
            out[t.name] = (int(t.tensor_type), tuple(int(d) for d in t.shape), raw)
    return out


def write_tiny_llama_gguf(path: Path, *, seed: int = 0, n_layer: int = 2, hidden: int = 64, ff: int = 128) -> Path:
    """A complete tiny `llama` GGUF that llama.cpp loads and runs (SPM vocab with byte tokens),
    Q8_0 matrices and F32 norms, random weights. Used to check that re-split shards load in
    llama.cpp and compute exactly what the unsplit file computes."""
    rng = np.random.default_rng(seed)
    n_head, n_kv = 4, 2
    head_dim = hidden // n_head
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"▁w{i}" for i in range(61)]
    types = [2, 3, 3] + [6] * 256 + [1] * 61
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, "llama")
    w.add_type("model")
    w.add_name("Tiny Llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def mat(name, rows, cols, scale=0.2):
        w.add_tensor(name, quantize((scale * rng.standard_normal((rows, cols))).astype(np.float32), q8), raw_dtype=q8)

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden, 1.0)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        mat(f"blk.{i}.attn_q.weight", hidden, hidden)
        mat(f"blk.{i}.attn_k.weight", n_kv * head_dim, hidden)
        mat(f"blk.{i}.attn_v.weight", n_kv * head_dim, hidden)
        mat(f"blk.{i}.attn_output.weight", hidden, hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.ffn_gate.weight", ff, hidden)
        mat(f"blk.{i}.ffn_up.weight", ff, hidden)
        mat(f"blk.{i}.ffn_down.weight", hidden, ff)
    norm("output_norm.weight")
    mat("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
