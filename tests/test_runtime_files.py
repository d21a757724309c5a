"""Files the runtime must load or refuse: storage types, split shards, damaged files, the MTP-only
sidecar as MAIN; the GGUF tokenizer against the HF tokenizer; the generate command."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv.archs.errors import SpecconvError
from specconv.runtime import Context, GraphType, load_model
from tests.fixtures import hf_reference as ref
from tests.test_runtime_common import DEVICES, max_abs, prompt_ids, skip_unless_device, tiny_gguf

# max |Δlogit| against transformers' float32 logits (logits of std ~1) over 64 positions. The tiny
# random Gated DeltaNet layers amplify weight rounding strongly (float32 rounding alone gives ~1e-4),
# so these are loose: about twice the values measured here (f16 0.15, bf16 1.1, q8_0 1.4), plus
# argmax agreement; they prove the types load, dequantize and run, not their accuracy on real models.
STORAGE_BOUNDS = {"f16": 0.5, "bf16": 3.0, "q8_0": 3.0, "q4_0": 6.0}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("outtype", list(STORAGE_BOUNDS))
def test_storage_types_load_and_run(tmp_path_factory, device, outtype):
    skip_unless_device(device)
    src, path = tiny_gguf(tmp_path_factory, outtype=outtype)
    model = load_model(path, device=device)
    ids = prompt_ids()
    logits = Context(model, GraphType.MAIN, n_ctx=len(ids)).decode(ids).logits
    reference = ref.hf_logits(src, ids)
    diff = max_abs(logits, reference)
    agree = float((logits.argmax(-1).cpu().numpy() == reference.argmax(-1)).mean())
    types = sorted({model.file.tensor_type(n).name for n in model.file.tensors})
    print(f"\n[{outtype} {device}] tensor types {types}: max|Δlogit| vs transformers f32 {diff:.3e}, "
          f"argmax agreement {agree:.2f}")
    assert np.isfinite(logits.cpu().numpy()).all() and diff <= STORAGE_BOUNDS[outtype] and agree >= 0.7


def test_split_shards_load_from_any_shard_and_match(tmp_path_factory, tmp_path):
    src, whole = tiny_gguf(tmp_path_factory)
    out = tmp_path / "split"
    out.mkdir()
    from tests.fixtures.gguf_files import convert_gguf

    convert_gguf(src, out / "model.gguf", extra_args=("--split-max-size", "200K"))
    shards = sorted(out.glob("*-of-*.gguf"))
    assert len(shards) >= 3, shards
    ids = prompt_ids(16)
    expected = Context(load_model(whole)).decode(ids).logits
    for given in (shards[0], shards[-1], shards):
        got = Context(load_model(given)).decode(ids).logits
        assert torch.equal(got, expected)
    shards[1].unlink()
    with pytest.raises(SpecconvError, match="missing shard"):
        load_model(shards[0])


def test_truncated_and_foreign_files_are_refused(tmp_path_factory, tmp_path):
    _, path = tiny_gguf(tmp_path_factory)
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(SpecconvError, match="truncated"):
        load_model(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(SpecconvError, match="not a readable GGUF"):
        load_model(junk)


def test_sidecar_serves_only_mtp_and_is_refused_as_main(tmp_path_factory):
    _, (trunk, side) = tiny_gguf(tmp_path_factory, mtp="separate")
    sidecar, target = load_model(side), load_model(trunk)
    assert sidecar.serves == {GraphType.MTP} and target.serves == {GraphType.MAIN}
    with pytest.raises(SpecconvError, match="MTP-only sidecar"):
        Context(sidecar, GraphType.MAIN)
    with pytest.raises(SpecconvError, match="no MTP head"):
        Context(target, GraphType.MTP)
    _, embedded = tiny_gguf(tmp_path_factory)
    assert load_model(embedded).serves == {GraphType.MAIN, GraphType.MTP}
    # a sidecar may share the target's embedding and head: same logits, one copy in memory
    shared = load_model(side, share_from=target)
    assert shared.weights["token_embd.weight"] is target.weights["token_embd.weight"]
    h = torch.randn(5, target.n_embd, generator=torch.Generator().manual_seed(0))
    a = Context(sidecar, GraphType.MTP).decode([1, 2, 3, 4, 5], hidden_in=h).logits
    b = Context(shared, GraphType.MTP).decode([1, 2, 3, 4, 5], hidden_in=h).logits
    assert torch.equal(a, b)


TEXTS = [
    "Hello world! This is a test.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Numbers 1234567 and 3.14159, symbols @#$%^&*()",
    "Ünïcödé: café, naïve, 日本語のテキスト, emoji 😀🚀",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't they're I'll we've",
    "a" * 50 + " " + "xyz" * 20,
]


def test_tokenizer_matches_hf(tmp_path_factory):
    from transformers import AutoTokenizer

    src, path = tiny_gguf(tmp_path_factory)
    ours = load_model(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(src))
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text
    print(f"\n[tokenizer] {len(TEXTS)} texts: encode and decode equal to the HF tokenizer")


def test_generate_command_greedy_matches_transformers(tmp_path_factory):
    from specconv import cli

    src, path = tiny_gguf(tmp_path_factory)
    prompt = [int(t) for t in prompt_ids(12, seed=9)]
    result = CliRunner().invoke(cli.cli, ["generate", str(path), "--tokens", ",".join(map(str, prompt)),
                                          "-n", "16", "--device", "cpu", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output.strip().splitlines()[-1])
    assert {"tokens", "text", "seconds"} <= set(payload)
    main, _ = ref.load_hf(src)
    with torch.no_grad():
        hf = main.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert payload["tokens"] == hf[0, len(prompt):].tolist()
    assert payload["text"] == load_model(path).tokenizer.decode(payload["tokens"])
    bad = CliRunner().invoke(cli.cli, ["generate", str(path), "-n", "2"])
    assert bad.exit_code != 0
