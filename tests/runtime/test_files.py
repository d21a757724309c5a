"""Files the runtime must load or refuse: storage types, split shards, damaged files, the MTP-only
sidecar as MAIN; the GGUF tokenizer against the HF tokenizer; the generate command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv.archs.errors import SpecconvError
from specconv.runtime import Context, GraphType, load_model
from tests.fixtures import hf_reference as ref
from tests.fixtures.runtime_common import (
    DEVICE_DTYPES, LOW_PRECISION_MULTIPLE, hf_logits_token_by_token, max_abs, parity, prompt_ids, skip_unless_device,
    tiny_gguf,
)
from tests.fixtures import hf_reference as ref

# max |Δlogit| against transformers' float32 logits (logits of std ~1) over 64 positions. The tiny
# random Gated DeltaNet layers amplify weight rounding strongly (float32 rounding alone gives ~1e-4),
# so logits only show that the types load and run (measured: f16 0.15, bf16 1.1, q8_0 1.4, q4_0 5.1,
# where llama.cpp running the same q4_0 file is 5.1 from transformers as well and 0.96 from us).
# Dequantization itself is checked exactly, weight by weight, in test_dequantized_weights_*.
# These are float32-compute bounds; a model computed in a 16-bit float adds that dtype's own rounding
# (test_storage_types_load_and_run).
LOGIT_BOUNDS = {"f16": (0.5, 0.9), "bf16": (3.0, 0.7), "q8_0": (3.0, 0.7), "q4_0": (None, None)}
# GGUF tensors stored without any transform, and their HF sources (save_pretrained layout)
UNTRANSFORMED = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.3.attn_k.weight": "model.layers.3.self_attn.k_proj.weight",
    "blk.4.nextn.eh_proj.weight": "mtp.fc.weight",
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("outtype", list(LOGIT_BOUNDS))
def test_storage_types_load_and_run(tmp_path_factory, device, dtype, outtype):
    skip_unless_device(device)
    src, path = tiny_gguf(tmp_path_factory, outtype=outtype)
    model = load_model(path, device=device, dtype=dtype)
    ids = prompt_ids()
    logits = Context(model, GraphType.MAIN, n_ctx=len(ids)).decode(ids).logits.float().cpu()
    reference = ref.hf_logits(src, ids)
    diff = max_abs(logits, reference)
    agree = float((logits.argmax(-1).numpy() == reference.argmax(-1)).mean())
    types = sorted({model.file.tensor_type(n).name for n in model.file.tensors})
    bound, min_agree = LOGIT_BOUNDS[outtype]
    line = (f"\n[{outtype} {device} {str(model.dtype).removeprefix('torch.')}] tensor types {types}: "
            f"max|Δlogit| vs transformers f32 {diff:.3e}, argmax agreement {agree:.2f}")
    # the file type's rounding and the compute dtype's add up: a 16-bit compute dtype adds its own
    # rounding, transformers in that dtype against its float32 self (times dtype_parity's multiple), to
    # the type's float32 bounds
    compute_noise = 0.0
    if model.dtype in (torch.bfloat16, torch.float16):
        low = ref.hf_logits(src, ids, dtype=model.dtype)
        noise, noise_agree = max_abs(low, reference), float((low.argmax(-1) == reference.argmax(-1)).mean())
        compute_noise = LOW_PRECISION_MULTIPLE * noise
        line += (f"; transformers' own {str(model.dtype).removeprefix('torch.')} max|Δlogit| {noise:.3f}, "
                 f"argmax agreement {noise_agree:.2f}")
        if bound is not None:
            bound += compute_noise
            min_agree -= LOW_PRECISION_MULTIPLE * (1 - noise_agree)
            line += f" -> bounds max|Δlogit| {bound:.3f}, agreement {min_agree:.2f}"
    assert np.isfinite(logits.numpy()).all()
    if bound is None:  # too coarse for this tiny model: the peer running the same file is the reference
        from tests.fixtures import peers

        peers.require_llama_cpp()
        peer = peers.llama_logits(path, ids)
        peer_bound = 0.5 * max_abs(peer, reference) + compute_noise
        line += (f"; vs llama.cpp on the same file {max_abs(logits, peer):.3e} (llama.cpp vs transformers "
                 f"{max_abs(peer, reference):.3e}; bound {peer_bound:.3f})")
        print(line)
        assert max_abs(logits, peer) < peer_bound
    else:
        print(line)
        assert diff <= bound and agree >= min_agree


# |dequantized − original| per element, in units of the 32-element block's max |w| (block types) or of |w|
STEP = {"f16": ("rel", 2.0 ** -11), "bf16": ("rel", 2.0 ** -8), "q8_0": ("block", 1 / 127), "q4_0": ("block", 1 / 7)}


@pytest.mark.parametrize("outtype", list(STEP))
def test_dequantized_weights_match_the_checkpoint(tmp_path_factory, outtype):
    from safetensors.torch import load_file

    src, path = tiny_gguf(tmp_path_factory, outtype=outtype)
    model = load_model(path)
    hf = load_file(str(src / "model.safetensors"))
    kind, step = STEP[outtype]
    worst = 0.0
    for gguf_name, hf_name in UNTRANSFORMED.items():
        w, orig = model.weights[gguf_name].double(), hf[hf_name].double()
        assert w.shape == orig.shape and model.file.tensor_type(gguf_name).name == outtype.upper()
        err = (w - orig).abs()
        if kind == "rel":
            scale = orig.abs()
        else:
            scale = orig.reshape(-1, 32).abs().amax(-1, keepdim=True).expand(-1, 32).reshape(orig.shape)
        floor = 2.0 ** -24 if outtype == "f16" else 1e-12  # f16 subnormals have an absolute spacing of 2^-24
        ratio = float((err / (scale * step + floor)).max())
        worst = max(worst, ratio)
    print(f"\n[{outtype}] dequantized vs checkpoint weights: max error = {worst:.2f} x the type's step")
    assert worst <= 1.0


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
    h = torch.randn(5, target.hidden_size, generator=torch.Generator().manual_seed(0))
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


def test_runs_files_written_by_llama_cpp_converter(tmp_path):
    """The runtime follows the GGUF contract, not our converter: llama.cpp's own converter's file
    (skips unless SPECCONV_LLAMA_CPP_SRC names a llama.cpp tree) gives the same logits as transformers."""
    from tests.fixtures.gguf_files import convert_gguf_upstream
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = build_qwen35(tmp_path / "hf")
    path = convert_gguf_upstream(src, tmp_path / "up.gguf")
    model = load_model(path)
    ids = prompt_ids()
    logits, reference = Context(model).decode(ids).logits, ref.hf_logits(src, ids)
    noise = max_abs(reference, hf_logits_token_by_token(src, ids))
    print(f"\n[llama.cpp-converted file] serves {sorted(g.value for g in model.serves)}, prompt max|Δlogit| "
          f"{max_abs(logits, reference):.2e} (transformers batched vs cached {noise:.2e})")
    assert model.serves == {GraphType.MAIN, GraphType.MTP}
    parity(logits, reference, noise)
