"""Valid tiny GGUF files of every family the project writes: the seeds `tools/fuzz_gguf.py` mutates.

Built as the tests build them (tests/fixtures: re-randomised transformers models, `specconv convert`
in-process), once per folder: a later call with the same folder reuses what is there. Each seed is
a case kind plus its files; the first file is the one the harness runs as the model, a second is
the head run next to it (an MTP sidecar, an EAGLE-3 head, a DFlash drafter, the Gemma 4 assistant).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# seed name -> (how the harness runs it, files in order: model first, then the head)
SEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen35-embed": ("mtp", ("qwen35-embed.gguf",)),
    "qwen35-sidecar": ("mtp", ("qwen35-trunk.gguf", "mtp-qwen35-trunk.gguf")),
    "qwen35moe-embed": ("mtp", ("qwen35moe-embed.gguf",)),
    "glm4moe-embed": ("mtp", ("glm4moe-embed.gguf",)),
    "deepseek2-embed": ("mtp", ("deepseek2-embed.gguf",)),
    "gemma4": ("plain", ("gemma4.gguf",)),
    "gemma4moe": ("plain", ("gemma4moe.gguf",)),
    "gemma4-assistant": ("assistant", ("gemma4.gguf", "gemma4-assistant.gguf")),
    "qwen3next-embed": ("mtp", ("qwen3next-embed.gguf",)),
    "qwen3": ("plain", ("qwen3.gguf",)),
    "qwen3moe": ("plain", ("qwen3moe.gguf",)),
    "llama": ("plain", ("llama.gguf",)),
    "eagle3": ("eagle3", ("llama.gguf", "eagle3.gguf")),
    "eagle3-qwen3": ("eagle3", ("qwen3-e3.gguf", "eagle3-qwen3.gguf")),
    "dflash": ("dflash", ("qwen3-df.gguf", "dflash-qwen3.gguf")),
    "dflash2": ("dflash", ("qwen3-df.gguf", "dflash2-qwen3.gguf")),
    "glm47flash-embed": ("mtp", ("glm47flash-embed.gguf",)),
    "hy_v3-embed": ("mtp", ("hy_v3-embed.gguf",)),
    "step35-embed": ("mtp", ("step35-embed.gguf",)),
    "mimo2-embed": ("mtp", ("mimo2-embed.gguf",)),
    "glm-dsa-embed": ("mtp", ("glm-dsa-embed.gguf",)),
    "deepseek32-embed": ("mtp", ("deepseek32-embed.gguf",)),
}
QUICK = ("qwen35-embed", "qwen35-sidecar")  # what the CI smoke run builds (seconds)


SOURCES = "sources.json"  # in a seed folder: the checkpoint folder and arguments of each file converted


def _convert(src: Path, out: Path, *extra: str) -> Path:
    from click.testing import CliRunner

    from specconv import cli

    args = ["convert", str(src), "-o", str(out), "--outtype", "f32", *extra]
    result = CliRunner().invoke(cli.cli, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"specconv {' '.join(args)} failed:\n{result.output}")
    record = Path(out).parent / SOURCES
    sources = json.loads(record.read_text()) if record.exists() else {}
    sources[Path(out).name] = [str(src), list(extra)]
    record.write_text(json.dumps(sources, indent=1))
    return out


def checkpoints(folder, names=None) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """{file: (checkpoint folder, convert arguments)} of every conversion behind the seeds `names`
    (the checkpoint fuzzer's inputs, tools/fuzz_config.py), building what the folder lacks."""
    seeds = build_seeds(folder, names)
    record = Path(folder) / SOURCES
    sources = json.loads(record.read_text()) if record.exists() else {}
    missing = [name for name, (_, paths) in seeds.items() if not any(p.name in sources for p in paths)]
    if missing:
        raise RuntimeError(f"{folder} holds the seeds {', '.join(missing)} without their sources (built before "
                           f"{SOURCES} was written): use a new folder")
    files = {p.name for _, paths in seeds.values() for p in paths} & set(sources)
    return {f: (Path(sources[f][0]), tuple(sources[f][1])) for f in sorted(files)}


def _kept(src: Path, where: Path) -> Path:
    import shutil

    shutil.copytree(src, where, dirs_exist_ok=True)
    return where


def _build(name: str, folder: Path) -> None:
    hf = folder / "hf"
    if name in ("qwen35-embed", "qwen35-sidecar", "qwen35moe-embed"):
        from tests.fixtures.tiny_qwen35 import build_qwen35

        moe = name.startswith("qwen35moe")
        src = build_qwen35(hf / name, moe=moe)
        if name == "qwen35-sidecar":
            _convert(src, folder / "qwen35-trunk.gguf", "--mtp", "separate")
        else:
            _convert(src, folder / f"{name}.gguf", "--mtp", "embed")
    elif name == "qwen3next-embed":
        from tests.fixtures.tiny_qwen3next import build_qwen3next

        _convert(build_qwen3next(hf / "qwen3next"), folder / f"{name}.gguf", "--mtp", "embed")
    elif name in ("qwen3", "qwen3moe"):
        from tests.fixtures.tiny_qwen3 import build_qwen3

        _convert(build_qwen3(hf / name, moe=name == "qwen3moe"), folder / f"{name}.gguf")
    elif name in ("glm4moe-embed", "deepseek2-embed"):
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        family = name.split("-")[0]
        src = build_tiny(hf / family, family, **({"yarn": True} if family == "deepseek2" else {}))
        _convert(src, folder / f"{name}.gguf", "--mtp", "embed")
    elif name == "gemma4moe":
        from tests.fixtures import tiny_gemma4 as g

        moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
        _convert(_kept(g.tiny_gemma4("v5", **moe), hf / "gemma4moe"), folder / "gemma4moe.gguf")
    elif name in ("gemma4", "gemma4-assistant"):
        from tests.fixtures import tiny_gemma4 as g

        if not (folder / "gemma4.gguf").exists():  # copied out of the fixture cache, which lives as long as its process
            _convert(_kept(g.tiny_gemma4("hub"), hf / "gemma4"), folder / "gemma4.gguf")
        if name == "gemma4-assistant":
            _convert(_kept(g.tiny_assistant("hub"), hf / "gemma4-assistant"), folder / "gemma4-assistant.gguf")
    elif name in ("llama", "eagle3"):
        from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target

        target = hf / "llama"
        if not (target / "config.json").exists():
            build_llama_target(target)
        if not (folder / "llama.gguf").exists():
            _convert(target, folder / "llama.gguf")
        if name == "eagle3":
            head = build_eagle3_head(hf / "eagle3", target, layer_ids=[1, 2, 4])
            _convert(head, folder / "eagle3.gguf", "--target", str(target))
    elif name == "eagle3-qwen3":
        from tests.fixtures.tiny_eagle3_qwen3 import build_head
        from tests.fixtures.tiny_qwen3 import build_qwen3

        target = build_qwen3(hf / "qwen3-e3", n_layers=8)
        _convert(target, folder / "qwen3-e3.gguf")
        _convert(build_head(hf / name, target, layout="specforge", ids=[0, 2, 6]), folder / "eagle3-qwen3.gguf",
                 "--target", str(target))
    elif name in ("dflash", "dflash2"):
        from tests.fixtures.tiny_dflash import MASK, TARGETS, build_dflash
        from tests.fixtures.tiny_qwen3 import build_qwen3

        target = hf / "qwen3-df"
        if not (target / "config.json").exists():
            build_qwen3(target, n_layers=6, seed=4, head_dim=16)
        if not (folder / "qwen3-df.gguf").exists():
            _convert(target, folder / "qwen3-df.gguf")
        draft = build_dflash(hf / name, target, layer_ids=TARGETS["qwen3"][1], mask_token_id=MASK, v2=name == "dflash2")
        _convert(draft, folder / f"{name}-qwen3.gguf", "--target", str(target))
    elif name == "glm47flash-embed":
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        _convert(build_tiny(hf / "glm47flash", "glm4moelite"), folder / f"{name}.gguf", "--mtp", "embed")
    elif name in ("hy_v3-embed", "step35-embed", "mimo2-embed"):
        from tests.fixtures.tiny_chained import build_tiny

        family = name[: -len("-embed")]
        _convert(build_tiny(hf / family, family), folder / f"{name}.gguf", "--mtp", "embed")
    elif name in ("glm-dsa-embed", "deepseek32-embed"):
        from tests.fixtures.tiny_dsa import build_tiny

        family = name[: -len("-embed")]
        _convert(build_tiny(hf / family, family), folder / f"{name}.gguf", "--mtp", "embed")
    else:
        raise ValueError(f"unknown seed {name!r}")


def build_seeds(folder, names=None) -> dict[str, tuple[str, list[Path]]]:
    """{seed name: (kind, [paths])}, building what the folder lacks."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # tests.fixtures (after the installed specconv)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names or SEEDS:
        kind, files = SEEDS[name]
        paths = [folder / f for f in files]
        if not all(p.exists() for p in paths):
            _build(name, folder)
        out[name] = (kind, paths)
    return out


if __name__ == "__main__":
    seeds = build_seeds(sys.argv[1] if len(sys.argv) > 1 else "fuzz-seeds")
    print(json.dumps({k: [v[0], [str(p) for p in v[1]]] for k, v in seeds.items()}, indent=1))
