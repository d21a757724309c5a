"""Hostile and broken GGUF files: each validation of the readers and of runtime/validate.py has a
crafted file here that would reach a graph, a reshape or the tokenizers library without it, and must
instead give a one-line SpecconvError naming the file and the key or tensor.

Files are valid tiny seeds (tools/fuzz_seeds.py, built as the other tests build theirs) edited as
documents (tools/fuzz_mutate.py) and written back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from tests.fixtures.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))

from fuzz_mutate import Doc  # noqa: E402

from specconv.archs.errors import SpecconvError  # noqa: E402
from tests.fixtures.hostile import load, refused, set_kv, tensor  # noqa: E402


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from fuzz_seeds import build_seeds

    built = build_seeds(tmp_path_factory.mktemp("seeds"), ["qwen35-embed", "qwen35moe-embed", "eagle3", "gemma4"])
    return {p.name: p for _, paths in built.values() for p in paths}


def edited(seeds, name: str, tmp_path: Path, edit) -> Path:
    doc = Doc.parse(seeds[name])
    edit(doc)
    out = tmp_path / name
    out.write_bytes(doc.to_bytes())
    return out


# ---- the header reader (every command) --------------------------------------------------------

def test_seed_files_load(seeds):
    for name in ("qwen35-embed.gguf", "llama.gguf", "gemma4.gguf"):
        model = load(seeds[name])
        assert model.tokenizer.encode("def f(x):")


@pytest.mark.parametrize("dims, words", [
    ([1 << 32, 1 << 32, 64], ["token_embd.weight", "too many elements"]),  # numpy's product wraps to 0
    ([64, 512, 1, 1, 1], ["token_embd.weight", "5 dimensions"]),
])
def test_reader_refuses_impossible_tensor_shapes(seeds, tmp_path, dims, words):
    from specconv.runtime.gguf_reader import open_gguf

    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: setattr(tensor(d, "token_embd.weight"), "dims", dims))
    with pytest.raises(SpecconvError, match="qwen35-embed.gguf") as info:
        open_gguf(path)
    assert all(w in str(info.value) for w in words)


def test_reader_refuses_partial_blocks_and_misaligned_data(seeds, tmp_path):
    from specconv.runtime.gguf_reader import open_gguf

    def partial(d):
        t = tensor(d, "blk.0.ssm_a")  # 4 values: not a whole Q8_0 block of 32
        t.qtype = int(Q.Q8_0)
    with pytest.raises(SpecconvError, match="blk.0.ssm_a: rows of 4 are not whole Q8_0 blocks"):
        open_gguf(edited(seeds, "qwen35-embed.gguf", tmp_path, partial))
    with pytest.raises(SpecconvError, match="output_norm.weight data offset .* not a multiple of the alignment"):
        open_gguf(edited(seeds, "qwen35-embed.gguf", tmp_path,
                         lambda d: setattr(tensor(d, "output_norm.weight"), "offset", tensor(d, "output_norm.weight").offset + 4)))
    for value, vtype in ((0, V.UINT32), (b"32", V.STRING)):
        with pytest.raises(SpecconvError, match="general.alignment .* is not a power of two"):
            open_gguf(edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "general.alignment", value, vtype)))


def test_reader_names_are_printable(seeds, tmp_path):
    from specconv.runtime.gguf_reader import open_gguf

    path = edited(seeds, "qwen35-embed.gguf", tmp_path,
                  lambda d: setattr(tensor(d, "output_norm.weight"), "dims", [64, 1, 1, 1, 1]))
    raw = bytearray(path.read_bytes())
    at = raw.index(b"output_norm.weight")
    raw[at + 3] = 0x0A  # a newline inside the name
    path.write_bytes(bytes(raw))
    with pytest.raises(SpecconvError) as info:
        open_gguf(path)
    assert "\n" not in str(info.value) and "out\\nut_norm" in str(info.value)


def test_inspect_mtp_upload_refuse_non_string_arch_and_split_keys(seeds, tmp_path):
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.convert.gguf_summary import summarize
    from specconv.hub.plan import build_plan

    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "general.architecture", 7, V.UINT32))
    with pytest.raises(SpecconvError, match="qwen35-embed.gguf: no general.architecture"):
        summarize(path)
    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "split.no", float("nan"), V.FLOAT32))
    with pytest.raises(SpecconvError, match="qwen35-embed.gguf: split.no must be an integer"):
        build_plan(tmp_path, repo_id="user/model")
    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "qwen35.block_count", b"5", V.STRING))
    with pytest.raises(SpecconvError, match="qwen35.block_count must be an integer"):
        open_gguf(path).block_count()


# ---- hyperparameters (check_kv in every from_kv, check_hparams) -------------------------------

@pytest.mark.parametrize("key, value, vtype, words", [
    ("qwen35.block_count", b"5", V.STRING, ["qwen35.block_count must be an integer"]),
    ("qwen35.ssm.time_step_rank", 0, V.UINT32, ["qwen35.ssm.time_step_rank = 0 is outside"]),
    ("qwen35.full_attention_interval", 0, V.UINT32, ["full_attention_interval = 0"]),
    ("qwen35.attention.key_length", 1 << 31, V.UINT32, ["attention.key_length = 2147483648 is outside"]),
    ("qwen35.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32, ["layer_norm_rms_epsilon = nan"]),
    ("qwen35.nextn_predict_layers", 9, V.UINT32, ["nextn_predict_layers 9 exceeds block_count 5"]),
    ("tokenizer.ggml.tokens", True, V.BOOL, ["tokenizer.ggml.tokens must be an array"]),
])
def test_kv_types_and_ranges(seeds, tmp_path, key, value, vtype, words):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, key, value, vtype)), *words)


def test_per_layer_arrays_have_block_count_entries(seeds, tmp_path):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path,
                   lambda d: set_kv(d, "qwen35.attention.recurrent_layers", [True, True], V.ARRAY, V.BOOL)),
            "qwen35.attention.recurrent_layers has 2 entries for block_count 5")
    refused(edited(seeds, "gemma4.gguf", tmp_path,
                   lambda d: set_kv(d, "gemma4.attention.head_count_kv", [2, 2, 2], V.ARRAY, V.UINT32)),
            "gemma4.attention.head_count_kv has 3 entries for block_count 6")
    refused(edited(seeds, "llama.gguf", tmp_path,
                   lambda d: set_kv(d, "llama.attention.head_count_kv", [2] * 6, V.ARRAY, V.UINT32)),
            "llama.attention.head_count_kv: the llama graph needs one value")


@pytest.mark.parametrize("key, value, words", [
    ("qwen35.attention.head_count_kv", 3, ["head_count 4 is not a multiple of head_count_kv 3"]),
    ("qwen35.rope.dimension_count", 18, ["rope.dimension_count 18 must be even and at most the head size 16"]),
    ("qwen35.rope.dimension_count", 3, ["rope.dimension_count 3 must be even"]),
])
def test_hparams_consistent(seeds, tmp_path, key, value, words):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, key, value)), *words)


def test_rope_sections_fit(seeds, tmp_path):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path,
                   lambda d: set_kv(d, "qwen35.rope.dimension_sections", [2, 1, 0, 0], V.ARRAY, V.INT32)),
            "rope.dimension_sections [2, 1, 0, 0] do not fit rope.dimension_count 4")


# ---- tensors (check_tensor_dims) --------------------------------------------------------------

def test_wrong_shape_names_tensor_expected_found(seeds, tmp_path):
    msg = refused(edited(seeds, "qwen35-embed.gguf", tmp_path,
                         lambda d: setattr(tensor(d, "blk.3.attn_k.weight"), "dims", [32, 64])),
                  "tensor blk.3.attn_k.weight has the wrong shape")
    assert "expected [64, 32], found [32, 64]" in msg


def test_hparam_that_disagrees_with_tensors(seeds, tmp_path):
    # consistent with itself, not with the file: the GDN blocks were written for 4 value heads
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "qwen35.ssm.time_step_rank", 2)),
            "blk.0.ssm_beta.weight", "expected [64, 2], found [64, 4]")
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "qwen35.embedding_length", 32)),
            "token_embd.weight", "expected [32, *], found [64, 512]")


def test_trailing_dimension_and_vocabulary_mismatch(seeds, tmp_path):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path,
                   lambda d: setattr(tensor(d, "blk.3.attn_v.weight"), "dims", [64, 32, 1])),
            "blk.3.attn_v.weight", "found [64, 32, 1]")

    def more_tokens(d):  # 88 tokens without an embedding row
        kv = {k.key: k for k in d.kvs}
        kv["tokenizer.ggml.tokens"].value += [f"<extra{i}>".encode() for i in range(88)]
        kv["tokenizer.ggml.token_type"].value += [1] * 88
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, more_tokens),
            "tokenizer.ggml.tokens has 600 entries, more than the 512 rows")

    def fewer_tokens(d):  # padded embedding rows without a token, as llama.cpp's Gemma files have: runs
        kv = {k.key: k for k in d.kvs}
        kv["tokenizer.ggml.tokens"].value = kv["tokenizer.ggml.tokens"].value[:-4]
        kv["tokenizer.ggml.token_type"].value = kv["tokenizer.ggml.token_type"].value[:-4]
        kv["tokenizer.ggml.eos_token_id"].value, kv["tokenizer.ggml.padding_token_id"].value = 500, 501
        left = set(kv["tokenizer.ggml.tokens"].value)
        kv["tokenizer.ggml.merges"].value = [m for m in kv["tokenizer.ggml.merges"].value
                                             if {*m.split(b" "), m.replace(b" ", b"")} <= left]
    model = load(edited(seeds, "qwen35-embed.gguf", tmp_path, fewer_tokens))
    assert model.vocab_size == 512 and model.tokenizer.vocab_size == 508


def test_integer_and_unsupported_storage_types(seeds, tmp_path):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path,
                   lambda d: setattr(tensor(d, "blk.0.ssm_a"), "qtype", int(Q.I32))),
            "tensor blk.0.ssm_a has type I32")


def test_eagle3_d2t_ids_inside_the_target_vocabulary(seeds, tmp_path):
    import numpy as np

    target = load(seeds["llama.gguf"])

    def corrupt(d):
        t = tensor(d, "d2t")
        d.data[t.offset:t.offset + 8] = np.int64(4096).tobytes()
    refused(edited(seeds, "eagle3.gguf", tmp_path, corrupt), "tensor d2t holds ids outside", share_from=target)

    def narrow(d):  # I16 ids: torch cannot index with them
        tensor(d, "d2t").qtype = int(Q.I16)
    refused(edited(seeds, "eagle3.gguf", tmp_path, narrow), "tensor d2t has type I16; I64 or I32 is expected",
            share_from=target)
    refused(edited(seeds, "eagle3.gguf", tmp_path, lambda d: set_kv(d, "eagle3.vocab_size", (1 << 31) - 1)),
            "vocabulary size 2147483647", share_from=target)


# ---- the tokenizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda d: set_kv(d, "tokenizer.ggml.token_type", [1] * 10, V.ARRAY, V.INT32),
     ["tokenizer.ggml.token_type must be an array of 512 entries", "found 10"]),
    (lambda d: set_kv(d, "tokenizer.ggml.eos_token_id", 512), ["tokenizer.ggml.eos_token_id = 512 is not a token id"]),
    (lambda d: set_kv(d, "tokenizer.ggml.bos_token_id", -1, V.INT32), ["tokenizer.ggml.bos_token_id = -1"]),
    (lambda d: set_kv(d, "tokenizer.ggml.merges", [b"\xc4\xa0\xc4\xa0"], V.ARRAY, V.STRING),
     ["tokenizer.ggml.merges[0]", "is not two tokens"]),
    (lambda d: set_kv(d, "tokenizer.ggml.merges", [b"zzq qqz"], V.ARRAY, V.STRING),
     ["tokenizer.ggml.merges[0]", "'zzq' is not in tokenizer.ggml.tokens"]),
    (lambda d: set_kv(d, "tokenizer.ggml.merges", [3, 4], V.ARRAY, V.INT32), ["merges must be an array of strings"]),
    (lambda d: set_kv(d, "tokenizer.ggml.pre", b"nope", V.STRING), ["tokenizer.ggml.pre", "'nope' is not known"]),
    (lambda d: set_kv(d, "tokenizer.ggml.model", b"llama", V.STRING), ["'llama'", "not supported"]),
])
def test_tokenizer_kv(seeds, tmp_path, edit, words):
    refused(edited(seeds, "qwen35-embed.gguf", tmp_path, edit), *words)


def test_a_tokenizer_kind_the_runtime_cannot_build_runs_on_token_ids(seeds, tmp_path):
    """SentencePiece ('llama') vocabularies load and decode token ids; only tokenizing text is refused."""
    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "tokenizer.ggml.model", b"llama", V.STRING))
    model = load(path, None)
    from specconv.runtime.generate import generate

    assert len(generate(model, [1, 2, 3], 2).tokens) == 2
    refused(path, "'llama'", "not supported")


def test_tokenizers_library_failures_become_one_line_errors(monkeypatch):
    """Whatever the tokenizers library still rejects comes back as a SpecconvError naming the keys."""
    from specconv.runtime import tokenizer as tk

    class Broken:
        def __init__(self, *a, **k):
            raise Exception("Error while initializing BPE: failed to extract enum PyMerges\nmore")

    monkeypatch.setattr(tk, "Tokenizer", Broken)
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": ["a", "b", "ab"],
          "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(SpecconvError) as info:
        tk.GGUFTokenizer(kv)
    msg = str(info.value)
    assert "\n" not in msg and "tokenizer.ggml.tokens/merges" in msg and "PyMerges" in msg


# ---- every command that opens GGUF files --------------------------------------------------------

def _truncated(doc: Doc) -> None:
    doc.data = doc.data[: len(doc.data) // 2]


def _bad_shape(doc: Doc) -> None:
    tensor(doc, "blk.3.attn_k.weight").dims = [32, 64]


def _bad_merges(doc: Doc) -> None:
    set_kv(doc, "tokenizer.ggml.merges", [b"zzq qqz"], V.ARRAY, V.STRING)


@pytest.mark.parametrize("edit", [_truncated, _bad_shape, _bad_merges])
def test_commands_give_one_line_errors(seeds, tmp_path, capsys, edit):
    """inspect, generate, verify (alone and as --mtp), mtp extract / merge and upload --dry-run on a
    hostile file: one line naming the file, no traceback, a non-zero exit (verify: a failed check)."""
    from specconv.cli import main

    path = edited(seeds, "qwen35-embed.gguf", tmp_path, edit)
    good = seeds["qwen35-embed.gguf"]
    runs = {"inspect": ["inspect", str(path)], "generate": ["generate", str(path), "-p", "x = 1", "-n", "1"],
            "verify": ["verify", str(path), "-n", "1", "--draft-max", "1"],
            "verify --mtp": ["verify", str(good), "--mtp", str(path), "-n", "1", "--draft-max", "1"],
            "mtp extract": ["mtp", "extract", str(path), "-o", str(tmp_path / "out" / "x.gguf"), "--mkdir"],
            "mtp merge": ["mtp", "merge", str(path), str(path), "-o", str(tmp_path / "out" / "y.gguf"), "--mkdir"],
            "upload": ["upload", str(tmp_path), "--repo", "user/model", "--dry-run"]}
    seen = []
    for name, argv in runs.items():
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        seen.append(f"{edit.__name__} {name}: exit {code}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
        if code == 0:  # a file that still holds what the command reads (inspect of a bad shape)
            assert name in ("inspect", "upload", "mtp extract", "mtp merge") and edit is not _truncated, err
            continue
        assert "Traceback" not in err
        if name.startswith("verify"):  # a report on stdout: the failed check says which file and why
            assert code == 1 and "qwen35-embed.gguf" in out and "loads" in out, out
        else:
            line = err.strip().splitlines()[-1]
            assert line.startswith("error: ") and "qwen35-embed.gguf" in line and "(run with --debug" not in line, err
    with capsys.disabled():
        print("\n".join(seen))


def test_resplit_of_a_file_with_an_empty_array(seeds, tmp_path):
    """The writer leaves empty arrays out (GGUF cannot say their item type usefully): the re-split's
    planned sizes must leave them out too, or every shard is refused as 'internal error'."""
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.hub.split import plan_split, write_split

    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "general.tags", [], V.ARRAY, V.STRING))
    layout = plan_split([path], 400_000)
    outs = [tmp_path / "out" / f"m-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)]
    write_split(layout, outs)
    assert [p.stat().st_size for p in outs] == layout.sizes and layout.count > 1
    assert len(open_gguf(outs[0]).tensors) == len(open_gguf(path).tensors)


def test_dense_lead_below_the_mtp_block(seeds, tmp_path):
    from fuzz_seeds import build_seeds

    glm = build_seeds(tmp_path / "glm", ["glm4moe-embed"])["glm4moe-embed"][1][0]
    refused(edited({glm.name: glm}, glm.name, tmp_path, lambda d: set_kv(d, "glm4moe.leading_dense_block_count", 255)),
            "glm4moe.leading_dense_block_count 255 reaches the MTP block 3")


def test_mtp_extract_of_a_file_with_an_empty_expert_tensor(seeds, tmp_path):
    """A tensor with an empty dimension holds no parameters: the size label is counted without it
    (gguf-py's counter divided by an expert count of 0)."""
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.convert.mtp_graft import plan_extract, write_plan

    def empty(d):
        t = tensor(d, "blk.0.ffn_down_exps.weight")
        t.dims = [t.dims[0], t.dims[1], 0]
    path = edited(seeds, "qwen35moe-embed.gguf", tmp_path, empty)
    out = write_plan(plan_extract(open_gguf(path)), tmp_path / "out" / "mtp.gguf")
    assert open_gguf(out[0]).get("general.size_label")


def test_resplit_refuses_a_key_that_is_not_utf8(seeds, tmp_path):
    """A key read with replacement characters would be written longer than planned."""
    from specconv.hub.split import plan_split

    path = edited(seeds, "qwen35-embed.gguf", tmp_path, lambda d: set_kv(d, "general.type", b"model", V.STRING))
    raw = bytearray(path.read_bytes())
    at = raw.index(b"general.type")
    raw[at + 3] = 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(SpecconvError, match="qwen35-embed.gguf: KV key .* is not UTF-8; the file cannot be re-split"):
        plan_split([path], 400_000)
