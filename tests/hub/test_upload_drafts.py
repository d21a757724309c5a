"""`eagle3-` and `dflash-` draft heads in an upload: named after their target, placed where llama.cpp's `-hf`
sibling discovery finds them, a card section telling how to run each, and the files as the (fake) Hub holds
them load in llama.cpp as a target + draft pair.

Real files: a tiny Qwen3 target converted to Q8_0, an EAGLE-3 head (SpecForge layout) and a DFlash drafter
converted against it to F16 (tests/fixtures/tiny_eagle3_qwen3.py, tests/fixtures/tiny_dflash.py). llama.cpp's
resolution is applied as written in its common/download.cpp at 0c1e570 (`find_best_model`,
`find_best_sibling`, `gguf_filename_is_model`), transcribed below; a head in another folder is the control
that the transcription does reject something.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from huggingface_hub import constants

from specconv.errors import SpecconvError
from specconv.hub.client import RetryPolicy, upload_plan
from specconv.hub.naming import Role, head_own_base
from specconv.hub.plan import build_plan
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hub.ggufs import write_tiny_gguf
from tests.fixtures.hub.server import WRITE_TOKEN, FakeHub
from tests.fixtures.tiny_dflash import build_dflash
from tests.fixtures.tiny_eagle3_qwen3 import build_head
from tests.fixtures.tiny_qwen3 import build_qwen3

torch.set_num_threads(1)
REPO = "me/Tiny-Qwen3-GGUF"
MASK = 509  # tiny_dflash's default mask token id
BLOCK = 6  # the DFlash drafter's block size: llama.cpp drafts at most BLOCK - 1 tokens with it
SHAPE = {"n_layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 32}


# ---- llama.cpp's -hf resolution (common/download.cpp at 0c1e570), transcribed -------------------

_MARKERS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(m in name for m in _MARKERS)


def _quant_bits(path: str) -> int:
    """extract_quant_bits: the digits of the tag after the last '-' / '.' (shard suffix dropped): F16 -> 16."""
    prefix = re.sub(r"-\d{5}-of-\d{5}$", "", path.removesuffix(".gguf"), flags=re.I)
    tag = re.search(r"[-.]([A-Z0-9_]+)$", prefix, re.I)
    digits = re.search(r"\d+", tag.group(1)) if tag else None
    return int(digits.group()) if digits else 0


def find_best_model(files: list[str], tag: str) -> str | None:
    for t in ([tag] if tag else ["Q4_K_M", "Q8_0"]):
        for f in files:
            shard = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", f)
            if _is_model(f) and re.search(re.escape(t) + "[.-]", f, re.I) and not (shard and shard.group(1) != "00001"):
                return f
    if not tag:
        return next((f for f in files if _is_model(f) and not re.search(r"-0000[2-9]-of-", f)), None)
    return None


def find_best_sibling(files: list[str], model: str, keyword: str, tag: str = "") -> str | None:
    """A .gguf containing `keyword` whose folder is the model's folder or one of its ancestors; deepest
    first, then the exact `-TAG.` match, then the closest quantization bits."""
    model_dirs = model.split("/")[:-1]
    model_bits = int(re.search(r"\d+", tag).group()) if tag and re.search(r"\d", tag) else _quant_bits(model)
    best, best_key = None, None
    for f in files:
        if not f.endswith(".gguf") or keyword not in f:
            continue
        sib_dirs = f.split("/")[:-1]
        if sib_dirs != model_dirs[:len(sib_dirs)]:
            continue  # not in the model's folder or above it
        exact = bool(tag) and f"-{tag.upper()}." in f.upper()
        key = (len(sib_dirs), exact, -abs(_quant_bits(f) - model_bits))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def resolve(files: list[str], tag: str, spec_type: str) -> tuple[str | None, str | None]:
    """(model, draft sidecar) that `llama-server -hf REPO[:tag] --spec-type spec_type` downloads."""
    model = find_best_model(files, tag)
    keyword = {"draft-eagle3": "eagle3-", "draft-dflash": "dflash-", "draft-mtp": "mtp-"}[spec_type]
    return model, find_best_sibling(files, model or "", keyword, tag)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints and an output folder: Qwen3 target Q8_0, EAGLE-3 head F16, DFlash drafter F16."""
    root = tmp_path_factory.mktemp("updrafts")
    target = build_qwen3(root / "Tiny-Qwen3", tie=True, **SHAPE)
    eagle = build_head(root / "Qwen3-Tiny_eagle3", target, layout="specforge", ids=[0, 2, 6], seed=1)
    dflash = build_dflash(root / "Tiny-Qwen3-DFlash-b4", target, layer_ids=(0, 3, 6), block_size=BLOCK)
    out = root / "out"
    out.mkdir()
    convert_gguf(target, out / "target.gguf", outtype="q8_0")
    convert_gguf(eagle, out / "head.gguf", outtype="f16", extra_args=["--target", str(target)])
    convert_gguf(dflash, out / "dflash.gguf", outtype="f16", extra_args=["--target", str(target)])
    return root, {"target": target, "eagle": eagle, "dflash": dflash}, out


@pytest.fixture
def outputs(made, tmp_path):
    folder = tmp_path / "out"
    shutil.copytree(made[2], folder)
    return folder


def _names(plan) -> dict[Role, list[str]]:
    out: dict[Role, list[str]] = {}
    for a in plan.artifacts:
        out.setdefault(a.role, []).extend(a.paths)
    return out


# ---- tests ------------------------------------------------------------------------------------


def test_heads_are_named_after_their_target(outputs):
    plan = build_plan(outputs, repo_id=REPO)
    names = _names(plan)
    (model,) = names[Role.TRUNK]
    base = model.removesuffix("-Q8_0.gguf")
    print(f"\nplan: {[f.path_in_repo for f in plan.files]}; warnings {plan.warnings}")
    assert names[Role.EAGLE3] == [f"eagle3-{base}-F16.gguf"] and names[Role.DFLASH] == [f"dflash-{base}-F16.gguf"]
    assert not any("draft head" in w for w in plan.warnings)


@pytest.mark.parametrize("split_target", [False, True])
def test_llama_cpp_resolution_finds_each_head_next_to_the_model(outputs, split_target):
    """`-hf REPO:Q8_0` (and no tag) with --spec-type draft-eagle3 / draft-dflash resolves to the model and the
    matching head, also with the target split into its own folder (the heads stay at the root, an ancestor)."""
    size = next(p for p in outputs.iterdir() if p.name == "target.gguf").stat().st_size
    plan = build_plan(outputs, repo_id=REPO, max_file_size=size // 2 if split_target else 50 * 10**9)
    files = [f.path_in_repo for f in plan.files]
    names = _names(plan)
    for tag in ("Q8_0", ""):
        for spec_type, role in (("draft-eagle3", Role.EAGLE3), ("draft-dflash", Role.DFLASH)):
            model, head = resolve(files, tag, spec_type)
            print(f"\n-hf {REPO}{':' + tag if tag else ''} --spec-type {spec_type} -> {model} + {head}")
            assert model == names[Role.TRUNK][0] and head == names[role][0]
    assert ("/" in names[Role.TRUNK][0]) == split_target
    # the control: a head in a folder that is not an ancestor of the model's is not found
    moved = [f if not f.startswith("eagle3-") else "heads/" + f for f in files]
    assert resolve(moved, "Q8_0", "draft-eagle3")[1] is None


def test_card_tells_how_to_run_each_head(outputs):
    plan = build_plan(outputs, repo_id=REPO)
    text = plan.readme.content.decode()
    names = _names(plan)
    model, e3, df = names[Role.TRUNK][0], names[Role.EAGLE3][0], names[Role.DFLASH][0]
    section = text[text.index("## Draft heads"):]
    print("\n" + section[:2000])
    for head, spec_type, spec, n_max in ((e3, "draft-eagle3", "eagle3", 3), (df, "draft-dflash", "dflash", BLOCK - 1)):
        assert f"llama-server -hf {REPO}:Q8_0 --spec-type {spec_type} --spec-draft-n-max {n_max}" in section
        assert f"hf download {REPO} {model} {head} --local-dir ." in section
        assert f"llama-server -m {model} -md {head} --spec-type {spec_type} --spec-draft-n-max {n_max}" in section
        assert f"specconv generate {model} --spec {spec} --draft {head} --draft-max {n_max}" in section
        assert f"specconv verify {model} --draft {head} --draft-max {n_max}" in section
    # the heads are documented once, in their own section, and the file table lists their roles
    assert text.count(f"-md {e3}") == 1 and f"| `{df}` | F16 |" in text and "DFlash drafter" in text


def test_a_head_for_another_target_is_refused(made, outputs, tmp_path):
    root, dirs, _ = made
    wide = build_qwen3(root / "Wide-Qwen3", tie=True, n_layers=8, hidden=96, heads=4, kv_heads=2, head_dim=32)
    other = build_head(root / "wide_eagle3", wide, layout="specforge", ids=[0, 2, 6], seed=2)
    (outputs / "head.gguf").unlink()
    convert_gguf(other, outputs / "head.gguf", outtype="f16", extra_args=["--target", str(wide)])
    with pytest.raises(SpecconvError) as info:
        build_plan(outputs, repo_id=REPO)
    message = str(info.value)
    print(f"\n{message}")
    assert "reads target hidden states of width 96, but the model files here have width 64" in message
    assert "\n" not in message


def test_heads_without_one_target_keep_their_own_name(tmp_path):
    """No model file (or several): the head keeps its own name without its kind marker, with a warning."""
    assert head_own_base("EAGLE3-LLaMA3.1-Instruct-8B") == "LLaMA3.1-Instruct-8B"
    assert head_own_base("Qwen3-8B_eagle3") == "Qwen3-8B" and head_own_base("Qwen3-4B-DFlash-b16") == "Qwen3-4B-b16"
    write_tiny_gguf(tmp_path / "h.gguf", "sidecar", arch="eagle3", name="EAGLE3-LLaMA3.1-Instruct-8B",
                    basename="EAGLE3-LLaMA3.1-Instruct-8B", size_label=None)
    plan = build_plan(tmp_path, repo_id="me/heads")
    assert _names(plan)[Role.EAGLE3] == ["eagle3-LLaMA3.1-Instruct-8B-Q8_0.gguf"]
    assert any("draft head but no model file" in w for w in plan.warnings)
    write_tiny_gguf(tmp_path / "a.gguf", "trunk", name="Model A", basename="Model-A", size_label=None)
    write_tiny_gguf(tmp_path / "b.gguf", "trunk", name="Model B", basename="Model-B", size_label=None)
    plan = build_plan(tmp_path, repo_id="me/heads")
    assert _names(plan)[Role.EAGLE3] == ["eagle3-LLaMA3.1-Instruct-8B-Q8_0.gguf"]
    assert any("several models here (Model-A, Model-B)" in w for w in plan.warnings)
    # --name names every file, the head included
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.move(tmp_path / "h.gguf", alone / "h.gguf")
    assert _names(build_plan(alone, repo_id="me/heads", name="Mine"))[Role.EAGLE3] == ["eagle3-Mine-Q8_0.gguf"]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the fake speaks the legacy LFS protocol
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub(lifetime=120) as server:
        yield server


def test_uploaded_pairs_resolve_and_build_the_draft_context_in_llama_cpp(outputs, hub, tmp_path, llama_peer):
    """Upload to the fake Hub; resolve `-hf REPO:Q8_0 --spec-type draft-eagle3` / `draft-dflash` on the listing
    the Hub holds; llama.cpp loads the files as downloaded and builds each draft context on the target's: the
    EAGLE-3 draft logits are finite over the draft vocabulary and -inf elsewhere, the DFlash block's finite."""
    from tests.fixtures.eagle3_peer import eagle3_rows

    plan = build_plan(outputs, repo_id=REPO)
    upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=RetryPolicy(attempts=3, base_delay=0.001,
                                                                                max_delay=0.01))
    listing = sorted(hub.files(REPO))
    model, head = resolve(listing, "Q8_0", "draft-eagle3")
    assert model and head and head.startswith("eagle3-")
    local = tmp_path / "downloaded"
    local.mkdir()
    for name in (model, head):
        (local / name).write_bytes(hub.content(REPO, name))
    prompt = [5, 17, 200, 33, 4, 99, 7, 8]
    layers, _, _, logits, _ = eagle3_rows(local / model, local / head, prompt)
    finite = np.isfinite(logits)
    print(f"\nllama.cpp from the Hub's files {model} + {head}: layers {layers}, "
          f"{int(finite[0].sum())} finite draft logits per row of {logits.shape[1]}")
    assert layers == [1, 3, 7] and (finite.sum(1) == 160).all() and np.isneginf(logits[~finite]).all()

    model, head = resolve(listing, "Q8_0", "draft-dflash")
    assert head and head.startswith("dflash-")
    (local / head).write_bytes(hub.content(REPO, head))
    logits = _dflash_block(local / model, local / head, width=3 * SHAPE["hidden"])
    print(f"llama.cpp from the Hub's files {model} + {head}: a {BLOCK}-token block, logits {logits.shape}, "
          f"std {logits.std():.3f}")
    assert logits.shape == (BLOCK, 512) and np.isfinite(logits).all() and logits.std() > 0.1


def _dflash_block(target_path, head_path, width: int) -> np.ndarray:
    """llama.cpp's DFlash draft context next to the target (ctx_other lends embedding and output head): feature
    rows at positions 0..3, then one block [token, mask * (BLOCK - 1)] decoded non-causally after them."""
    import llama_cpp

    from tests.fixtures import peers

    tm, dm = peers.load_model(target_path), peers.load_model(head_path)
    tctx = peers.new_context(tm, n_ctx=64)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, 1, 1
    cp.type_k = cp.type_v = 0
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.ctx_other = tctx
    dctx = llama_cpp.llama_init_from_model(dm, cp)
    assert dctx, "llama.cpp could not build the DFlash draft context"
    try:
        llama_cpp.llama_set_causal_attn(dctx, False)
        feats = np.random.default_rng(0).standard_normal((4, width)).astype(np.float32)
        b = llama_cpp.llama_batch_init(4, width, 1)
        try:
            np.ctypeslib.as_array(b.embd, shape=(feats.size,))[:] = feats.reshape(-1)
            for i in range(4):
                b.pos[i], b.n_seq_id[i], b.logits[i] = i, 1, 0
                b.seq_id[i][0] = 0
            b.n_tokens = 4
            assert llama_cpp.llama_decode(dctx, b) == 0
        finally:
            llama_cpp.llama_batch_free(b)
        peers.decode_tokens(dctx, [17] + [MASK] * (BLOCK - 1), 4)
        return peers.row_logits(dctx, dm, BLOCK)
    finally:
        peers.free_context(dctx)
        peers.free_context(tctx)
