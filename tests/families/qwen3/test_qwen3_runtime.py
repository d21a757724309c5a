"""qwen3 / qwen3moe files in the runtime and in llama.cpp, against transformers 5.23.

* the runtime (reading only the GGUF) reproduces transformers' logits (one batch and cached token by
  token), post-norm and per-layer hidden states, and its greedy tokens;
* llama.cpp (llama-cpp-python 0.3.36) on our f32 files is within 1e-4 of transformers and gives the
  runtime's greedy tokens;
* a small qwen3 / qwen3moe file drafts for a bigger qwen3 target (`--spec draft`): speculative
  greedy output equals plain greedy (snapshot and checkpoint rollback), in the API and the CLI;
* `specconv verify --hf` passes on a clean pair and fails on a swapped tensor.
Every measured difference is printed.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv import cli
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_qwen3 import build_qwen3, load_hf

torch.set_num_threads(1)
TOL = 1e-4
IDS = [int(x) for x in np.random.default_rng(5).integers(0, 509, 40)]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}  # 4 x 1024 = 4096 positions
VARIANTS = {"dense": {}, "moe": {"moe": True}, "dense-tied": {"tie": True},
            "moe-no-norm-topk": {"moe": True, "norm_topk_prob": False},
            "dense-yarn": {"rope_scaling": YARN}, "dense-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}
TARGET = {"n_layers": 6, "hidden": 96, "heads": 6, "kv_heads": 2, "head_dim": 32, "seed": 1}
_files: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("q3rt")


def conv(root, name, **kw):
    """(checkpoint dir, f32 GGUF) per fixture name, cached for the module."""
    if name not in _files:
        src = build_qwen3(root / name, **kw)
        _files[name] = (src, convert_gguf(src, root / f"{name}.gguf"))
    return _files[name]


def max_abs(a, b) -> float:
    a = a.detach().double().numpy() if torch.is_tensor(a) else np.asarray(a, np.float64)
    b = b.detach().double().numpy() if torch.is_tensor(b) else np.asarray(b, np.float64)
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


@torch.no_grad()
def hf_forward(src, ids):
    hf = load_hf(src)
    out = hf(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0], [h[0] for h in out.hidden_states]


@torch.no_grad()
def hf_steps(src, ids):
    hf, rows, cache = load_hf(src), [], None
    for t in ids:
        out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def hf_greedy(src, ids, n):
    out = load_hf(src).generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return [int(x) for x in out[0, len(ids):]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_runtime_matches_transformers(root, variant):
    src, path = conv(root, variant, **VARIANTS[variant])
    model = load_model(path, device="cpu")
    assert model.serves == {GraphType.MAIN}
    ref, ref_h = hf_forward(src, IDS)
    L = model.hparams.num_hidden_layers
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    out = ctx.decode(IDS, hidden=("post_norm",), layers=(0, 2, L))
    ctx.clear()
    steps = torch.cat([ctx.decode([t]).logits for t in IDS])
    d_batch, d_steps = max_abs(out.logits, ref), max_abs(steps, hf_steps(src, IDS))
    d_post = max_abs(out.hidden["post_norm"], ref_h[L])
    d_layers = max(max_abs(out.hidden[f"layer:{j}"], ref_h[j]) for j in (0, 2, L))
    print(f"\n[runtime {model.arch} {variant}] {len(IDS)} positions vs transformers: max|Δlogit| {d_batch:.2e} "
          f"(batch), {d_steps:.2e} (cached, token by token); post-norm hidden {d_post:.2e}; layer inputs {d_layers:.2e}")
    assert max(d_batch, d_steps, d_post, d_layers) <= TOL


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_runtime_greedy_equals_transformers_generate(root, variant):
    src, path = conv(root, variant, **VARIANTS[variant])
    ours = generate(load_model(path, device="cpu"), IDS[:12], 24).tokens
    assert ours == hf_greedy(src, IDS[:12], 24)


def test_norm_topk_prob_matters(root):
    """The no-renormalisation fixture is a real test: renormalising it moves the logits."""
    src, path = conv(root, "moe-no-norm-topk", **VARIANTS["moe-no-norm-topk"])
    model = load_model(path, device="cpu")
    model.hparams.norm_topk_prob = True
    wrong = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits
    d = max_abs(wrong, hf_forward(src, IDS)[0])
    print(f"\n[qwen3moe norm_topk_prob=false] renormalising anyway moves the logits by {d:.2f}")
    assert d > 0.05


@pytest.mark.peer
def test_rope_scaling_matters(root):
    """The scaled fixtures are real tests: the same weights without scaling give other logits."""
    ref = hf_forward(conv(root, "dense")[0], IDS)[0]
    for variant in ("dense-yarn", "dense-linear"):
        d = max_abs(hf_forward(conv(root, variant, **VARIANTS[variant])[0], IDS)[0], ref)
        print(f"\n[{variant}] transformers' logits move by {d:.2f} against unscaled rope")
        assert d > 0.1


@pytest.mark.peer
@pytest.mark.parametrize("variant", ["dense", "moe", "dense-tied", "dense-yarn", "dense-linear"])
def test_llama_cpp_matches_transformers(root, variant, llama_peer):
    src, path = conv(root, variant, **VARIANTS[variant])
    ref = hf_forward(src, IDS)[0]
    ll = llama_peer.llama_logits(path, IDS)
    ll_steps = llama_peer.llama_logits(path, IDS, one_by_one=True)
    ours = Context(load_model(path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits
    ll_tokens = llama_peer.llama_greedy(path, IDS[:12], 24)
    our_tokens = generate(load_model(path, device="cpu"), IDS[:12], 24).tokens
    d_ref, d_steps, d_ours = max_abs(ll, ref), max_abs(ll_steps, ref), max_abs(ours, ll)
    print(f"\n[llama.cpp {variant}] our f32 file, {len(IDS)} positions: max|Δlogit| vs transformers {d_ref:.2e} "
          f"(batch), {d_steps:.2e} (token by token); vs our runtime {d_ours:.2e}; greedy 24 tokens equal: "
          f"{ll_tokens == our_tokens}")
    assert max(d_ref, d_steps, d_ours) <= TOL
    assert ll_tokens == our_tokens


# ------------------------------------------------------------------ as a draft model


def near_target(root):
    """The target with its output head perturbed: a draft that agrees often but not always, so rounds
    end with partial acceptances and rollbacks."""
    from safetensors.torch import load_file, save_file

    if "near" not in _files:
        t_src, _ = conv(root, "target", **TARGET)
        src = root / "near"
        shutil.copytree(t_src, src)
        t = load_file(str(src / "model.safetensors"))
        gen = torch.Generator().manual_seed(7)
        t["lm_head.weight"] = t["lm_head.weight"] + 0.02 * torch.randn(t["lm_head.weight"].shape, generator=gen)
        save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
        _files["near"] = (src, convert_gguf(src, root / "near.gguf"))
    return _files["near"][1]


@pytest.mark.parametrize("draft", ["dense", "moe", "target", "near"])
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_speculative_draft_equals_plain_greedy(root, draft, rollback):
    t_src, t_path = conv(root, "target", **TARGET)
    target = load_model(t_path, device="cpu")
    d_path = {"target": t_path, "near": near_target(root) if draft == "near" else None}.get(draft) or \
        conv(root, draft, **VARIANTS[draft])[1]
    prompt, n = IDS[:10], 30
    plain = generate(target, prompt, n).tokens
    drafter = build_drafter("draft", target, n_ctx=64, draft_max=4, draft_path=d_path)
    res = speculative_generate(target, drafter, prompt, n, SpecConfig(draft_max=4, rollback=rollback))
    s = res.stats["speculative"]
    print(f"\n[--spec draft {draft} -> qwen3 target, {rollback}] {s['accepted']}/{s['drafted']} drafts accepted; "
          f"equal to plain greedy: {res.tokens == plain}")
    assert res.tokens == plain and s["drafted"] > 0
    if draft == "target":
        assert s["acceptance_rate"] == 1.0
    if draft == "near":  # both outcomes occur: full and partial acceptance
        assert 0 < s["accepted"] < s["drafted"]
    assert plain == hf_greedy(t_src, prompt, n)


def test_cli_generate_spec_draft(root):
    _, t_path = conv(root, "target", **TARGET)
    _, d_path = conv(root, "dense", **VARIANTS["dense"])

    def run(*args):
        res = CliRunner().invoke(cli.cli, ["generate", str(t_path), "--tokens", ",".join(map(str, IDS[:8])), "-n", "12",
                                           "--json", "--device", "cpu", *args], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.strip().splitlines()[-1])

    plain = run()
    spec = run("--spec", "draft", "--draft", str(d_path), "--draft-max", "3")
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"] == "draft"


def test_verify_passes_clean_pair_and_fails_swapped_tensor(root, tmp_path):
    from gguf import GGUFReader

    from specconv.cli import main as cli_main

    t_src, t_path = conv(root, "target", **TARGET)
    _, d_path = conv(root, "dense", **VARIANTS["dense"])
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\\n    return x\nimport os\n")

    def verify(path):
        report = tmp_path / "r.json"
        with pytest.raises(SystemExit) as exc:
            cli_main(["verify", str(path), "--draft", str(d_path), "--hf", str(t_src), "--prompts", str(prompts),
                      "--report", str(report), "-n", "6", "--draft-max", "2", "--device", "cpu"])
        return exc.value.code, json.loads(report.read_text())

    code, rep = verify(t_path)
    print(f"\n[verify qwen3 target + qwen3 draft] passed {rep['passed']}, parity {rep['parity']}")
    assert code == 0 and rep["passed"] and rep["parity"]["max_abs_logit_diff"] < 2e-3
    bad = tmp_path / "bad.gguf"
    shutil.copy(t_path, bad)
    reader = GGUFReader(bad, "r+")
    a, b = (next(t for t in reader.tensors if t.name == n) for n in ("blk.1.attn_q.weight", "blk.2.attn_q.weight"))
    tmp = np.array(a.data)
    a.data[...] = b.data
    b.data[...] = tmp
    del reader
    code, rep = verify(bad)
    failed = [c["name"] for c in rep["checks"] if not c["passed"]]
    print(f"[verify, blk.1/blk.2 attn_q swapped] failed checks: {failed}")
    assert code != 0 and any("parity" in n for n in failed)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_q8_0_file_runs_close_to_transformers(root, variant, tmp_path):
    """Weights kept in Q8_0 (experts sliced packed): close to transformers (verify's Q8_0 tolerance is a
    relative RMS of 0.4), the same argmax at most rows (rounded router inputs flip near-tie expert
    choices at a few positions)."""
    src, _ = conv(root, variant, **VARIANTS[variant])
    model = load_model(convert_gguf(src, tmp_path / "q8.gguf", outtype="q8_0"), device="cpu")
    got, ref = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits, hf_forward(src, IDS)[0]
    rel = float(((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt())
    same = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\n[q8_0 {variant}] runtime vs transformers: max|Δlogit| {max_abs(got, ref):.3f}, relative RMS {rel:.4f}, "
          f"same argmax {same:.0%}")
    assert rel < 0.1 and same >= 0.85
