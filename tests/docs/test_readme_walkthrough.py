"""README.md's "From the Hub to a verified upload", run as written against the loopback Hub.

The bundled model (specconv/data/tiny-qwen35-mtp, trained: its MTP head's drafts are accepted) is
published as the checkpoint id the README uses; `me/` is the namespace the upload token may write to.
Only the Hub's endpoint and token (environment) and the working folder (a temporary one) differ from
a user's run. Each step's outcome is checked against what it claims, with gguf-py and the
re-implementation of llama.cpp's -hf rules (tests/fixtures/hub/llamacpp_rules.py) as the independent readers:
the ladder's names and roles, verify's verdict and the bytes it recorded, the repository's files and
the figures its card carries, the `-hf` download's bytes, and speculative tokens equal to plain ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from pathlib import Path

import gguf
import pytest
import yaml
from gguf.utility import naming_convention
from huggingface_hub import constants

from specconv.cli import main
from specconv.demo.bundled import bundled_model_dir
from tests.fixtures.hub.client import hub_client_env  # noqa: F401  (autouse: loopback client, write token, cwd)
from tests.fixtures.hub.cards import table_rows
from tests.fixtures.hub.llamacpp_rules import lc_find_best_model, lc_find_best_sibling
from tests.fixtures.hub.server import FakeHub
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.slow

SECTION = "## From the Hub to a verified upload"


def walkthrough() -> list[list[str]]:
    """argv after `specconv` of every command line in the section's bash block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = []
    for line in block.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            words = shlex.split(line)
            assert words[0] == "specconv", line  # nothing else for a user to type
            commands.append(words[1:])
    return commands


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == name]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return f.contents() if f is not None else None


def file_tag(reader: gguf.GGUFReader) -> str:
    """The quant tag of general.file_type, by gguf-py's enum (MOSTLY_Q4_K_M -> Q4_K_M)."""
    return gguf.LlamaFileType(field(reader, "general.file_type")).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def role(reader: gguf.GGUFReader) -> str:
    """llama.cpp's reading (docs/reference/gguf-layout.md §4.3): nextn layers and no trunk block is an
    MTP sidecar, nextn layers with the trunk an embedded head, no nextn layers a trunk only."""
    arch = field(reader, "general.architecture")
    nextn = field(reader, f"{arch}.nextn_predict_layers") or 0
    if not any(t.name == "blk.0.attn_norm.weight" for t in reader.tensors):
        return "sidecar" if nextn > 0 else "no trunk and no head"
    return "embedded" if nextn > 0 else "trunk"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def close(cell: str, value: float, places: int = 3) -> bool:
    """A card figure (`places` decimals, or 4 significant digits) is the report's figure."""
    return math.isclose(float(cell), value, rel_tol=1e-3, abs_tol=0.5 * 10 ** -places)


def test_the_readme_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = walkthrough()
    assert [argv[0] for argv in commands] == ["convert", "verify", "verify", "upload", "generate"]
    convert, *verifies, upload, generate = commands
    checkpoint_id = convert[1]
    source = bundled_model_dir()
    published = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    with FakeHub(lifetime=600) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.publish(checkpoint_id, published)

        # 1. convert: a ladder named from -o, each quant a trunk and its mtp- sidecar
        code, _, err = run(convert, capsys)
        assert code == 0, err
        downloaded = {path for path, _, _ in hub.downloads}
        assert "model.safetensors" in downloaded and downloaded <= set(published)
        assert "heldout.json" not in downloaded  # only what convert reads
        stem = Path(option(convert, "-o")[0])
        quants = [q.upper() for q in option(convert, "--outtype")[0].split(",")]
        expected = {f"{stem.stem}-{q}.gguf": (q, "trunk") for q in quants}
        expected |= {f"mtp-{stem.stem}-{q}.gguf": (q, "sidecar") for q in quants}
        written = {p.name: gguf.GGUFReader(p) for p in stem.parent.iterdir()}
        assert set(written) == set(expected)
        for name, reader in written.items():
            assert (file_tag(reader), role(reader)) == expected[name], name

        # 2. verify each quant with its sidecar against the checkpoint by id
        reports = {}
        for argv in verifies:
            code, out, err = run(argv, capsys)
            assert code == 0, out + err
            assert out.rstrip().endswith("PASSED")  # the report is on stdout
            report = json.loads(Path(option(argv, "--report")[0]).read_text())
            model, mtp = Path(argv[1]), Path(option(argv, "--mtp")[0])
            assert report["passed"] and all(c["passed"] for c in report["checks"])
            assert report["files"]["model"]["sha256"] == sha256(model.read_bytes())
            assert report["files"]["mtp"]["sha256"] == sha256(mtp.read_bytes())
            spec, parity = report["speculative"], report["parity"]
            assert spec["exact"] and spec["drafter"] == "mtp" and 0 < spec["accepted"] <= spec["drafted"]
            assert "transformers" in parity["reference"] and parity["mtp"] is not None
            reports[file_tag(written[model.name])] = report
            with capsys.disabled():
                print(f"\nverify {model.name}: parity max |dlogit| trunk {parity['trunk']:.3g}, MTP "
                      f"{parity['mtp']:.3g}; MTP accepted {spec['accepted']}/{spec['drafted']}")
        assert set(reports) == set(quants)

        # 3. upload: the four files under llama.cpp's names and a card with each file's own figures
        code, _, err = run(upload, capsys)
        assert code == 0, err
        repo = option(upload, "--repo")[0]
        files = hub.files(repo)
        assert set(files) - {".gitattributes"} == {*(n for n in files if n.endswith(".gguf")), "README.md"}
        assert sorted(b.sha256 for n, b in files.items() if n.endswith(".gguf")) == sorted(
            sha256((stem.parent / name).read_bytes()) for name in expected)
        card = hub.content(repo, "README.md").decode()
        front = yaml.safe_load(card.split("---")[1])
        assert front["base_model"] == option(upload, "--base-model")[0] == checkpoint_id
        rows = {r[0].strip("`"): r for r in table_rows(card, "| File |")}
        paths = sorted(files)
        for q in quants:
            local = stem.parent / f"{stem.stem}-{q}.gguf"
            reader = written[local.name]
            base = naming_convention(*(field(reader, f"general.{k}") for k in
                                       ("name", "basename", "finetune", "version", "size_label")), q)
            model = lc_find_best_model(paths, q)
            sidecar = lc_find_best_sibling(paths, model, "mtp-", q)
            assert (model, sidecar) == (f"{base}.gguf", f"mtp-{base}.gguf")
            assert files[model].sha256 == sha256(local.read_bytes())
            assert files[sidecar].sha256 == sha256((stem.parent / f"mtp-{local.name}").read_bytes())
            report, row = reports[q], rows[model]
            assert close(row[6], report["parity"]["max_abs_logit_diff"]), row
            rate, length = re.fullmatch(r"(\S+) \(length (\S+)\)", row[7]).groups()
            assert close(rate, report["speculative"]["acceptance_rate"])
            assert close(length, report["speculative"]["acceptance_length"], places=2)
            assert row[9] == "passed" and rows[sidecar][9] == f"with `{model}`"

        # 4. generate -hf REPO:QUANT --spec mtp: the files fetched are the uploaded bytes
        before = len(hub.downloads)
        code, text, err = run(generate, capsys)
        assert code == 0, err
        hf = option(generate, "-hf")[0]
        tag = hf.split(":")[1]
        model = lc_find_best_model(paths, tag)
        pair = {model, lc_find_best_sibling(paths, model, "mtp-", tag)}
        assert {path for path, _, _ in hub.downloads[before:]} == pair
        cache = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
        for path in pair:
            (fetched,) = cache.glob(f"*/{path}")
            assert sha256(fetched.read_bytes()) == files[path].sha256

        # the README's run, with --json, and plain decoding (all from the cache now)
        spec = json.loads(run([*generate, "--json", "--no-baseline"], capsys)[1])
        i = generate.index("--spec")
        plain = json.loads(run([*generate[:i], *generate[i + 2:], "--json"], capsys)[1])
        assert len(hub.downloads) == before + 2
        assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) == int(option(generate, "-n")[0])
        assert text.rstrip("\n") == plain["text"].rstrip("\n")
        assert spec["speculative"]["accepted"] > 0  # the trunk has no head: these are the sidecar's drafts
        with capsys.disabled():
            print(f"generate -hf {hf} --spec mtp: {spec['speculative']['accepted']}/"
                  f"{spec['speculative']['drafted']} drafts accepted, tokens = plain decoding's")
