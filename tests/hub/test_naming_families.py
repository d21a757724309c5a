"""One naming scheme, llama.cpp's, from `convert` to the Hub (specconv/hub/naming.py, scheme_base).

Evidence:
* every fixture family converted with `-o DIR/` gives `<Name>-<Size>-<TYPE>.gguf` and, with an MTP
  head, `mtp-` + exactly that name (the size label of the model, not of the sidecar); `upload` takes
  every file of the folder and publishes it to the loopback Hub under the same name, and llama.cpp's
  -hf rules (re-implemented in tests/fixtures/hub/llamacpp_rules.py) pick that model and that sidecar from
  the repository;
* the bundled model, whose name has `Mtp` in it, is accepted (llama.cpp's marker test is
  case-sensitive: `Mtp-` is not `mtp-`); a name from metadata holding a real marker gets it in
  capitals, and `quantize` into a folder and `mtp extract` keep the scheme;
* a split conversion keeps it with the `-00001-of-0000N` suffix.
"""

from __future__ import annotations

import re

import pytest

from tests.fixtures.cli import run_cli
from tests.fixtures.hub.llamacpp_rules import lc_find_best_model, lc_find_best_sibling, lc_is_model
from tests.fixtures.hub.server import WRITE_TOKEN, FakeHub
from tests.fixtures.paths import ROOT
from tests.fixtures.hub.client import loopback_client

NAME_RE = re.compile(r"^(?P<mtp>mtp-)?(?P<base>.+)-(?P<size>(?:\d+x)?\d+(?:\.\d+)?[KMBT](?:-[\w.]+)?)-(?P<tag>[A-Z0-9_]+)\.gguf$")


def _qwen35(root, moe=False):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    return build_qwen35(root, moe=moe)


def _qwen3next(root):
    from tests.fixtures.tiny_qwen3next import build_qwen3next

    return build_qwen3next(root)


def _qwen3(root):
    from tests.fixtures.tiny_qwen3 import build_qwen3

    return build_qwen3(root)


def _glm_deepseek(family):
    def build(root):
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        return build_tiny(root, family)
    return build


def _chained(family):
    def build(root):
        from tests.fixtures.tiny_chained import build_tiny

        return build_tiny(root, family)
    return build


def _dsa(family):
    def build(root):
        from tests.fixtures.tiny_dsa import build_tiny

        return build_tiny(root, family)
    return build


def _llama(root):
    from tests.fixtures.tiny_eagle3 import build_llama_target

    return build_llama_target(root)


FAMILIES = {"qwen35": _qwen35, "qwen35moe": lambda r: _qwen35(r, moe=True), "qwen3next": _qwen3next,
            "qwen3": _qwen3, "glm4moe": _glm_deepseek("glm4moe"), "deepseek2": _glm_deepseek("deepseek2"),
            "hy_v3": _chained("hy_v3"), "step35": _chained("step35"), "mimo2": _chained("mimo2"),
            "glm-dsa": _dsa("glm-dsa"), "deepseek32": _dsa("deepseek32"), "llama": _llama}


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    loopback_client(monkeypatch, tmp_path)  # the loopback Hub; each test gives its token


def check_names(names: list[str]) -> None:
    """Every file in the scheme; each mtp- file is mtp- + a model file's name."""
    parsed = {n: NAME_RE.match(n) for n in names}
    assert all(parsed.values()), names
    models = [n for n in names if not n.startswith("mtp-")]
    assert all(lc_is_model(n) for n in models) and len(models) == 1, names
    for n in names:
        if n.startswith("mtp-"):
            assert n.removeprefix("mtp-") in models, (n, models)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_then_upload_keeps_the_names(family, tmp_path, capsys, monkeypatch):
    src = FAMILIES[family](tmp_path / "hf")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, "-o", f"{out}/", "--mtp", "separate", "--outtype", "q8_0")
    if code != 0 and "no MTP" in err:  # a family without an MTP head
        code, _, err = run_cli(capsys, "convert", src, "-o", f"{out}/", "--mtp", "none", "--outtype", "q8_0")
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    with capsys.disabled():
        print(f"\n{family}: {names}")
    check_names(names)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    with FakeHub(lifetime=120) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        repo = f"me/{family}-GGUF"
        code, _, err = run_cli(capsys, "upload", out, "--repo", repo, "--base-model", "someone/x", "--retry-delay", "0.001")
        assert code == 0, err
        published = sorted(p for p in hub.files(repo) if p.endswith(".gguf"))
    assert published == names  # accepted, and under the names convert gave
    model = lc_find_best_model(published, "Q8_0")
    assert model == next(n for n in names if not n.startswith("mtp-"))
    if len(names) > 1:
        assert lc_find_best_sibling(published, model, "mtp-", "Q8_0") == f"mtp-{model}"


@pytest.mark.skipif(not (ROOT / "specconv" / "data" / "tiny-qwen35-mtp").exists(), reason="bundled model absent")
def test_bundled_model_ladder_quantize_and_extract(tmp_path, capsys):
    src = ROOT / "specconv" / "data" / "tiny-qwen35-mtp"
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, "-o", f"{out}/", "--mtp", "separate", "--outtype", "f32,q8_0")
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert names == ["Tiny-Qwen35-Mtp-2.4M-F32.gguf", "Tiny-Qwen35-Mtp-2.4M-Q8_0.gguf",
                     "mtp-Tiny-Qwen35-Mtp-2.4M-F32.gguf", "mtp-Tiny-Qwen35-Mtp-2.4M-Q8_0.gguf"]
    code, _, err = run_cli(capsys, "upload", out, "--repo", "me/Tiny-GGUF", "--dry-run", "--json", "--base-model", "a/b")
    assert code == 0, err  # no "contains 'mtp-'" refusal
    q = tmp_path / "q"
    code, _, err = run_cli(capsys, "quantize", out / names[0], f"{q}/", "Q4_K_M")
    assert code == 0, err
    code, _, err = run_cli(capsys, "quantize", out / names[2], f"{q}/", "Q4_K_M")
    assert code == 0, err
    assert sorted(p.name for p in q.iterdir()) == ["Tiny-Qwen35-Mtp-2.4M-Q4_K_M.gguf", "mtp-Tiny-Qwen35-Mtp-2.4M-Q4_K_M.gguf"]
    emb = tmp_path / "emb"
    code, _, err = run_cli(capsys, "convert", src, "-o", f"{emb}/", "--outtype", "q8_0")
    assert code == 0, err
    (model,) = emb.iterdir()
    code, _, err = run_cli(capsys, "mtp", "extract", model)
    assert code == 0, err
    assert sorted(p.name for p in emb.iterdir()) == [model.name, f"mtp-{model.name}"]
    split = tmp_path / "split"
    code, _, err = run_cli(capsys, "convert", src, "-o", f"{split}/", "--split-max-size", "1M", "--outtype", "f32")
    shards = sorted(p.name for p in split.iterdir())
    assert code == 0 and len(shards) > 1, err
    assert all(re.fullmatch(rf"Tiny-Qwen35-Mtp-2\.9M-F32-{i + 1:05d}-of-{len(shards):05d}\.gguf", n)
               for i, n in enumerate(shards)), shards


def test_markers_in_names_from_metadata():
    from specconv.hub.naming import scheme_base, without_markers

    assert without_markers("Tiny-Qwen35-Mtp-2.4M") == "Tiny-Qwen35-Mtp-2.4M"
    assert without_markers("my-mtp-model") == "my-MTP-model" and without_markers("x-mtp") == "x-MTP"
    assert without_markers("a-mmproj-b-imatrix-eagle3-c") == "a-MMPROJ-b-IMATRIX-EAGLE3-c"
    assert scheme_base("Qwen3.5 9B Instruct", None, "9B") == "Qwen3.5-9B-Instruct"
    assert scheme_base(None, "Qwen3.5", "9B", "Instruct", "v2") == "Qwen3.5-9B-Instruct-v2"
    assert scheme_base("tiny-mtp", None, "2.4M") == "tiny-MTP-2.4M" and lc_is_model("tiny-MTP-2.4M-F16.gguf")
    assert scheme_base("tiny-mtp", None, None) == "tiny-MTP" and lc_is_model("tiny-MTP-F16.gguf")
