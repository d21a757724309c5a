"""A family lives in its own files: no other module names it (docs/architecture.md, "A new architecture
family").

The rule. A family group is one plugin module of archs/ (the module whose classes `@register`
them); its names are the `gguf_arch` and the `hf_architectures` of those classes. Its files are
  1. its plugin module;
  2. the graph modules whose `GRAPH` declares one of its GGUF arches (runtime/graphs/);
  3. any module that imports the modules of 1-2 of this group and of no other group: code written
     for this family alone (a family built on another's module: dsa on deepseek2, qwen3next on
     qwen35, eagle3 on llama; the Gemma 4 assistant's drafter on its graph);
  4. a module of archs/ or runtime/graphs/ that only the plugin and graph modules of this group,
     and of groups built on it, import (a family's own helper: archs/gemma4_hparams.py,
     archs/qwen35_hparams.py, which Qwen3-Next reuses), and the helpers shared by a few families
     listed in FAMILY_HELPERS, for the groups whose files import them and the groups built on those.
A string literal equal to a group's name (AST scan of archs/, runtime/, convert/, specconv/;
tests/, docs/ and tools/ are not scanned), or a use of an archs/names.py constant holding one
(`names.GEMMA4`), may occur only in that group's files; names.py, where those constants are
defined, is read through its uses. Names that are also
a drafter kind (runtime/graphs/contract.py KINDS: "eagle3", "dflash") are the kind's name there, which
the drafters, `--spec` and the hub name, so they are not held to the rule. What generic code still
names is in ALLOWED, each entry with its reason; an entry that matches nothing fails (the list only
shrinks).

The second test adds a family from outside the package in two files (a copy of the llama family
under the GGUF arch "llama-copy" and the HF architecture "LlamaCopyForCausalLM"): discovered,
converted and run, it gives the real llama family's logits, tensors and metadata.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

from specconv.archs import _REGISTRY, supported_architectures
from specconv.archs import names as names_module
from specconv.runtime import graphs
from specconv.runtime.graphs.contract import KINDS

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("archs", "runtime", "convert", "specconv")
PACKAGES = {"specconv.archs": "archs", "specconv.runtime": "runtime", "specconv.convert": "convert",
            "specconv": "specconv"}

# Shared helpers of a few families (rule 4): each may name the families whose files import it.
FAMILY_HELPERS: dict[str, str] = {
    "archs/nextn_moe_hparams.py": "the nextn-MoE families' shared hyperparameters (llama.cpp's default "
                                  "expert gating differs by arch among them)",
}

_TOKENIZER = "a tokenizer name of llama.cpp (tokenizer.ggml.model / .pre) that the arch string happens to equal"
_MODEL_TYPE = ("a config.json `model_type` of a target without a plugin of its own (its tokenizer.ggml.pre "
               "fallback), equal to the arch string")
_CHAINED_REFERENCE = ("verify's own transformers reference for a chained-MTP family whose release transformers "
                      "cannot load (docs/mtp.md): reference code imports transformers, which plugins and graphs do not")
# (file, name) -> why generic code still names one family (or who removes it).
ALLOWED: dict[tuple[str, str], str] = {
    ("runtime/tokenizer.py", "gemma4"): _TOKENIZER,
    ("runtime/tokenizer.py", "qwen35"): _TOKENIZER,
    ("convert/tokenizer.py", "gemma4"): _TOKENIZER,
    ("archs/plan_tools.py", "llama"): _MODEL_TYPE,
    ("archs/plan_tools.py", "qwen3"): _MODEL_TYPE,
    ("specconv/verify/chained_mtp.py", "hy_v3"): _CHAINED_REFERENCE,
    ("specconv/verify/chained_mtp.py", "step35"): _CHAINED_REFERENCE,
    ("specconv/verify/chained_mtp.py", "mimo2"): _CHAINED_REFERENCE,
    ("convert/quant_rules.py", "llama"): "llama.cpp's quantizer keys its \"70B\" attn_v rule by arch (llama-quant.cpp), "
                                         "mirrored with the other arches it names",
}


def _rel(path: Path | str) -> str:
    return Path(path).resolve().relative_to(ROOT).as_posix()


def _module_file(module: str) -> str | None:
    """The repository file of a dotted `specconv...` module name, or None (not ours, or a package)."""
    for prefix in sorted(PACKAGES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").replace(".", "/")
            path = ROOT / PACKAGES[prefix] / rest
            if path.with_suffix(".py").is_file():
                return _rel(path.with_suffix(".py"))
            return None
    return None


def _imports(rel: str, tree: ast.AST) -> set[str]:
    """The repository modules a file imports: `import a.b`, `from a import b` (b a module or a name)."""
    package = rel.rsplit("/", 1)[0]
    dotted = next(k for k, v in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1])) if package.startswith(v))
    here = dotted + package[len(PACKAGES[dotted]):].replace("/", ".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_module_file(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(_module_file(base))
            found |= {_module_file(f"{base}.{a.name}") for a in node.names}
    return found - {None}


# archs/names.py's string constants (`names.GEMMA4`): a use stands for the string it holds
_CONSTANTS = {k: v for k, v in vars(names_module).items() if k.isupper() and isinstance(v, str)}
DEFINITIONS = "archs/names.py"  # where the constants are written; their uses are scanned instead


def _strings(tree: ast.AST) -> dict[str, int]:
    """Every string a file writes -> its first line: string literals (docstrings included) and the
    archs/names.py constants it uses (`names.X`, or X imported from names)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.setdefault(node.value, node.lineno)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "names"
              and node.attr in _CONSTANTS):
            found.setdefault(_CONSTANTS[node.attr], node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "names":
            for alias in node.names:
                if alias.name in _CONSTANTS:
                    found.setdefault(_CONSTANTS[alias.name], node.lineno)
    return found


def _scan() -> dict[str, tuple[dict[str, int], set[str]]]:
    out = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = _rel(path)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            out[rel] = ({} if rel == DEFINITIONS else _strings(tree), _imports(rel, tree))
    return out


def family_groups() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(plugin module -> its names, plugin module -> its own files by rules 1-2)."""
    supported_architectures()
    names: dict[str, set[str]] = defaultdict(set)
    arches: dict[str, str] = {}
    for cls in set(_REGISTRY.values()):
        module = _rel(inspect.getsourcefile(cls))
        names[module] |= {cls.gguf_arch, *cls.hf_architectures}
        arches[cls.gguf_arch] = module
    own = {module: {module} for module in names}
    for arch in graphs.supported_archs():
        own[arches[arch]].add(_rel(graphs.graph_module(arch).__file__))
    return dict(names), own


def family_files() -> tuple[dict[str, set[str]], dict[str, set[str]], dict]:
    names, own = family_groups()
    scan = _scan()
    group_of = {f: g for g, files in own.items() for f in files}
    files = {g: set(fs) for g, fs in own.items()}
    for rel, (_, imported) in scan.items():  # rule 3
        groups = {group_of[m] for m in imported if m in group_of} - {group_of.get(rel)}
        if len(groups) == 1:
            files[groups.pop()].add(rel)
    # the groups each group builds on: whose plugin or graph modules its own ones import
    builds_on = {g: {group_of[m] for f in fs for m in scan[f][1] if m in group_of} - {g} for g, fs in own.items()}
    for rel in scan:  # rule 4: a helper of one group (and of the groups built on it) only
        if rel.startswith(("archs/", "runtime/graphs/")) and rel not in group_of:
            importers = [f for f, (_, imported) in scan.items() if rel in imported]
            if not importers or not all(f in group_of for f in importers):
                continue
            groups = {group_of[f] for f in importers}
            base = [b for b in groups if all(g == b or b in builds_on[g] for g in groups)]
            if len(base) == 1:
                files[base[0]].add(rel)
    for helper in FAMILY_HELPERS:  # rule 4: the listed shared helpers, for the groups (and those built on them)
        users = {g for g, fs in own.items() if any(helper in scan[f][1] for f in fs)}
        for g in own:
            if g in users or builds_on[g] & users:
                files[g].add(helper)
    return names, files, scan


def test_every_plugin_arch_has_a_graph_and_every_graph_a_plugin():
    names, own = family_groups()
    plugin_arches = {cls.gguf_arch for cls in _REGISTRY.values()}
    print(f"\n{len(names)} family groups, {len(plugin_arches)} GGUF arches, "
          f"{sum(len(f) for f in own.values())} plugin and graph modules")
    assert plugin_arches == set(graphs.supported_archs())


def _leaks(names: dict[str, set[str]], files: dict[str, set[str]], scan: dict) -> tuple[list[str], set]:
    """(every site that names a family outside its files and is not ALLOWED, every ALLOWED site seen)."""
    kinds = {k for k in KINDS if k}
    leaks, seen = [], set()
    for group, group_names in sorted(names.items()):
        for name in sorted(group_names - kinds):
            for rel, (strings, _) in scan.items():
                if name in strings and rel not in files[group]:
                    if (rel, name) in ALLOWED:
                        seen.add((rel, name))
                    else:
                        leaks.append(f"{rel}:{strings[name]} names {name!r} ({group}'s)")
    return leaks, seen


def test_no_module_names_a_family_outside_its_files():
    names, files, scan = family_files()
    leaks, seen = _leaks(names, files, scan)
    print(f"\nscanned {len(scan)} files for {sum(len(n) for n in names.values())} family names; "
          f"{len(seen)} allowed sites, {len(leaks)} leaks")
    assert not leaks, ("a family named outside its files: declare the fact in its plugin (archs/base.py) or "
                       "graph (runtime/graphs/contract.py) and read it there:\n  " + "\n  ".join(leaks))
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_the_scan_sees_a_family_named_in_generic_code():
    """A per-arch branch planted in generic code, and a name in a family's file that another family's
    files use, are both found; the family's own files and a drafter kind's name are not."""
    names, files, scan = family_files()
    planted = {
        "runtime/context.py": 'if arch == "qwen35moe": pass',  # generic code
        "runtime/graphs/llama.py": 'NAME = "Glm4MoeForCausalLM"',  # another family's graph
        "runtime/graphs/qwen35.py": 'ARCH = "qwen35moe"',  # its own graph: fine
        "runtime/model.py": "if arch == names.GEMMA4_ASSISTANT: pass",  # through a names.py constant
        "runtime/speculative.py": 'KIND = "eagle3"',  # a drafter kind's name: not held to the rule
    }
    for rel, code in planted.items():
        strings, imported = scan[rel]
        scan[rel] = ({**strings, **_strings(ast.parse(code))}, imported)
    leaks, _ = _leaks(names, files, scan)
    new = sorted(leak.split(":")[0] + " " + leak.split(" names ")[1].split(" ")[0] for leak in leaks)
    print("\n" + "\n".join(leaks))
    assert new == ["runtime/context.py 'qwen35moe'", "runtime/graphs/llama.py 'Glm4MoeForCausalLM'",
                   "runtime/model.py 'gemma4-assistant'"]


def test_the_family_helpers_serve_only_families():
    """A listed helper is imported only inside the families' packages (archs/, runtime/graphs/), not by
    generic code, and names some family (else it needs no entry)."""
    names, files, scan = family_files()
    all_names = set().union(*names.values())
    for helper, why in FAMILY_HELPERS.items():
        importers = {rel for rel, (_, imported) in scan.items() if helper in imported}
        generic = {rel for rel in importers if not rel.startswith(("archs/", "runtime/graphs/"))}
        assert not generic, f"{helper} ({why}) is imported by generic code: {sorted(generic)}"
        assert all_names & set(scan[helper][0]), f"{helper} names no family: remove it from FAMILY_HELPERS"


# ---- a family added from outside the package, in two files -------------------------------------------

COPY_ARCH, COPY_HF = "llama-copy", "LlamaCopyForCausalLM"


def _copy_family(tmp_path: Path) -> tuple[str, str]:
    """The llama family's two files rewritten as a new family: its plugin module under another HF
    architecture and GGUF arch (imports made absolute), its graph module reading that plugin's table."""
    import re

    plugin = (ROOT / "archs/llama.py").read_text(encoding="utf-8")
    plugin = re.sub(r"^from \.(\w+) import", r"from specconv.archs.\1 import", plugin, flags=re.M)
    plugin = re.sub(r"^from \. import", "from specconv.archs import", plugin, flags=re.M)
    plugin = plugin.replace('"LlamaForCausalLM"', f'"{COPY_HF}"').replace('"llama"', f'"{COPY_ARCH}"')
    graph = (ROOT / "runtime/graphs/llama.py").read_text(encoding="utf-8")
    graph = graph.replace("from specconv.archs.llama import", "from llama_copy import")
    graph = graph.replace('"llama"', f'"{COPY_ARCH}"')
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "llama_copy.py").write_text(plugin, encoding="utf-8")
    (tmp_path / "llama_copy_graph.py").write_text(graph, encoding="utf-8")
    return plugin, graph


def _kv_and_tensors(path: Path, arch: str) -> tuple[dict, dict]:
    """(KV with `{arch}.` keys written `ARCH.`, general.architecture left out; tensor name -> bytes)."""
    from gguf import GGUFReader

    from tests.fixtures.gguf_files import field_value

    reader = GGUFReader(str(path))
    kv = {("ARCH." + k[len(arch) + 1:] if k.startswith(arch + ".") else k): field_value(f)
          for k, f in reader.fields.items() if k != "general.architecture" and not k.startswith("GGUF.")}
    return kv, {t.name: bytes(t.data.tobytes()) for t in reader.tensors}


def test_a_family_in_two_files_outside_the_package_converts_and_runs(tmp_path, monkeypatch):
    """Nothing but the two files: discovered (register, graphs.register_module), converted through the
    plugin and run through the graph, the copy writes the llama family's tensors and metadata under its
    own arch and gives its logits exactly."""
    import shutil

    import torch

    from specconv import archs
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_eagle3 import build_llama_target

    supported_architectures()
    monkeypatch.setattr(archs, "_REGISTRY", dict(archs._REGISTRY))  # the copy registers into a scratch registry
    plugin_text, graph_text = _copy_family(tmp_path / "family")
    monkeypatch.syspath_prepend(str(tmp_path / "family"))
    plugin_module = importlib.import_module("llama_copy")
    graph_module = importlib.import_module("llama_copy_graph")
    lines = [len(plugin_text.splitlines()), len(graph_text.splitlines())]
    print(f"\nthe family's two files: plugin {lines[0]} lines, graph {lines[1]} lines")
    assert max(lines) < 300  # issue 35's budget for a family's file
    assert archs.plugin_class_for({"architectures": [COPY_HF]}).__module__ == plugin_module.__name__
    graphs.register_module(graph_module)
    try:
        assert graphs.graph_for(COPY_ARCH) is graph_module.GRAPH
        real = build_llama_target(tmp_path / "real" / "model", seed=3)
        copy = tmp_path / "copy" / "model"
        shutil.copytree(real, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "architectures": [COPY_HF]}))
        real_gguf = convert_gguf(real, tmp_path / "real.gguf")
        copy_gguf = convert_gguf(copy, tmp_path / "copy.gguf")
        real_kv, real_tensors = _kv_and_tensors(real_gguf, "llama")
        copy_kv, copy_tensors = _kv_and_tensors(copy_gguf, COPY_ARCH)
        assert copy_kv == real_kv and copy_tensors == real_tensors
        prompt = [5, 17, 240, 3, 99, 12, 400, 7]
        logits = []
        for path in (real_gguf, copy_gguf):
            model = load_model(path, device="cpu", dtype=torch.float32)
            logits.append(Context(model, GraphType.MAIN, n_ctx=len(prompt)).decode(prompt).logits)
        assert model.arch == COPY_ARCH and model.graph is graph_module.GRAPH
        delta = float((logits[0] - logits[1]).abs().max())
        print(f"{len(copy_tensors)} tensors and {len(copy_kv)} KV pairs as the llama family's; "
              f"max |Δlogit| vs llama {delta:.1e} over {logits[0].shape[0]} positions")
        assert torch.equal(logits[0], logits[1])
    finally:
        graphs.unregister_module(graph_module)
        for name in ("llama_copy", "llama_copy_graph"):
            sys.modules.pop(name, None)
    assert COPY_ARCH not in graphs.supported_archs()


def test_the_worked_example_in_the_docs_quotes_the_family_s_two_files():
    """docs/architecture.md's worked example (Qwen3-Next) quotes its plugin and graph modules as they
    are: every quoted line but `...` is a line of the file, in the file's order."""
    import re

    doc = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    start = doc.index("\n", doc.index("#### Worked example: Qwen3-Next"))
    example = doc[start:start + re.search(r"^#{2,4} ", doc[start:], flags=re.M).start()]  # to the next heading
    steps = re.split(r"^Step \d, ", example, flags=re.M)[1:]
    quoted = 0
    for step in steps:
        files = re.findall(r"`((?:archs|runtime/graphs)/\w+\.py)`", step.split("\n\n")[0])
        if not files:
            continue
        lines = (ROOT / files[0]).read_text(encoding="utf-8").splitlines()
        for block in re.findall(r"```python\n(.*?)```", step, flags=re.S):
            at = 0
            for line in block.splitlines():
                if not line.strip() or "..." in line:
                    continue
                assert line in lines[at:], f"{files[0]}: not as quoted (or out of order): {line!r}"
                at = lines.index(line, at) + 1
                quoted += 1
    print(f"\n{quoted} quoted lines of the worked example are the files' own")
    assert quoted >= 30
