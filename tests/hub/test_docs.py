"""The commands at the top of docs/hub.md, run as written against the loopback Hub: a tiny Qwen3.5
checkpoint (with an MTP layer) is published as `Qwen/Qwen3.5-9B`; what the page's `convert` commands
write is published as `team/Qwen3.5-9B-GGUF` before the first `-hf` command; `me/` is the
namespace the upload token may write to.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
from huggingface_hub import constants

from specconv.cli import main
from tests.fixtures.hub.client import hub_client_env  # noqa: F401  (autouse: loopback client, write token, cwd)
from tests.fixtures.hub.server import FakeHub
from tests.fixtures.paths import ROOT

CHECKPOINT_ID = "Qwen/Qwen3.5-9B"
GGUF_ID = "team/Qwen3.5-9B-GGUF"


def doc_commands() -> list[tuple[dict, list[str]]]:
    """(environment, argv after `specconv`) of every command line in the page's first bash block."""
    text = (ROOT / "docs" / "hub.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = []
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line)
        env = {}
        while "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[0] == "specconv", line
        commands.append((env, words[1:]))
    return commands



def test_the_examples_of_docs_hub_md_run(qwen35_dir, tmp_path, monkeypatch, capsys):
    commands = doc_commands()
    assert {argv[0] for _, argv in commands} == {"convert", "inspect", "generate", "verify", "upload"}
    (tmp_path / "out").mkdir()
    with FakeHub(lifetime=600) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        source = qwen35_dir()
        hub.publish(CHECKPOINT_ID, {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()})
        published = False
        for env, argv in commands:
            if "-hf" in argv and not published:
                hub.publish(GGUF_ID, {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.gguf")})
                published = True
            monkeypatch.setattr(constants, "HF_HUB_OFFLINE", env.get("HF_HUB_OFFLINE") == "1")
            n_requests = len(hub.requests)
            capsys.readouterr()
            with pytest.raises(SystemExit) as info:
                main(argv)
                raise SystemExit(0)
            out, err = capsys.readouterr()
            with capsys.disabled():
                print(f"$ specconv {shlex.join(argv)}  -> exit {info.value.code}, {len(hub.requests) - n_requests} "
                      f"requests")
            assert info.value.code in (0, None), err
            if constants.HF_HUB_OFFLINE:
                assert len(hub.requests) == n_requests
        names = sorted(p.name for p in (tmp_path / "out").glob("*.gguf"))
        assert len(names) == 4 and sum(n.startswith("mtp-") for n in names) == 2, names  # Q8_0 and Q4_K_M pairs
        assert (tmp_path / "Qwen3.5-9B" / "config.json").is_file()  # --local-dir
        copied = hub.files("me/Qwen3.5-9B-GGUF")
        assert sum(p.endswith(".gguf") for p in copied) == 2 and any(p.startswith("mtp-") for p in copied)
    assert json.loads((source / "config.json").read_text())  # the checkpoint was real, not a stub
    shutil.rmtree(tmp_path / "hub-cache")
