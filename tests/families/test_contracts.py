"""The plugin and graph contracts are declared, not probed (archs/base.py, runtime/graphs/contract.py).

* An AST scan of runtime/, convert/ and specconv/verify/ fails on any `getattr(x, name, default)` or
  `hasattr(x, name)` that is not in ALLOWED below (each entry with its reason), and on an ALLOWED
  entry that no longer matches anything (so the list only shrinks). The speculative loop and the
  drafters (runtime/speculative.py, runtime/spec_*.py, runtime/drafters/, specconv/verify/roundtrip.py)
  have their own guard.
* Every registered plugin is a complete ArchPlugin and every graph declares a complete Graph; an
  incomplete one is refused where it is declared, with the missing hooks named.
* Everything the runtime reads of a model's graph is a declared Graph field.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import types
from pathlib import Path

import pytest

from specconv.archs import ArchPlugin, SpecconvError, check_plugin, register, supported_architectures
from specconv.archs import _REGISTRY
from specconv.runtime import graphs
from specconv.runtime.graphs.contract import Graph, no_tensors, required_fields

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("runtime", "convert", "specconv/verify")
NOT_SCANNED = ("runtime/speculative.py", "runtime/spec_", "runtime/drafters/", "specconv/verify/roundtrip.py")

_TRANSFORMERS = "a transformers model / config object, whose attributes differ by model class and version"
_EXTENSION = "a compiled extension from an older build may lack the symbol; the Python path is used then"
_PLATFORM = "a platform constant or method that some operating systems lack"
# (file, attribute probed) -> why it is not a capability probe of our own objects (or who removes it)
ALLOWED: dict[tuple[str, str], str] = {
    ("runtime/kernels_triton/dequant.py", "name"): "a gguf GGMLQuantizationType or a raw type id from a file",
    ("runtime/gdn_native.py", "gdn"): _EXTENSION,
    ("runtime/dequant_native.py", "switches"): _EXTENSION,
    ("runtime/dequant_native.py", "i8"): _EXTENSION,
    ("convert/checkpoint.py", "MADV_DONTNEED"): _PLATFORM,
    ("convert/checkpoint.py", "MADV_WILLNEED"): _PLATFORM,
    ("convert/checkpoint.py", "O_CLOEXEC"): _PLATFORM,
    ("convert/checkpoint.py", "madvise"): _PLATFORM,
    ("specconv/verify/chained_mtp.py", "attention_type"): _TRANSFORMERS,
    ("specconv/verify/chained_mtp.py", "layer_type"): _TRANSFORMERS,
    ("specconv/verify/chained_mtp.py", "_name_or_path"): _TRANSFORMERS,
    ("specconv/verify/chained_mtp.py", "name_or_path"): _TRANSFORMERS,
    ("specconv/verify/hf_checks.py", "hf_device_map"): _TRANSFORMERS,
    ("specconv/verify/parity.py", "weight"): _TRANSFORMERS,
    ("specconv/verify/parity.py", "A_log"): _TRANSFORMERS,
    ("specconv/verify/parity.py", "name"): _TRANSFORMERS,  # float attributes of modules / configs, by name
    ("specconv/verify/parity.py", "text_config"): _TRANSFORMERS,
    ("specconv/verify/parity.py", "rope_parameters"): _TRANSFORMERS,
    ("specconv/verify/parity.py", "mlp_layer_types"): _TRANSFORMERS,
    # A GGUF tensor record from the file reader, or a header-only one from tools/fuzz_gguf.py.
    ("runtime/validate.py", "data"): "a tensor record that may be header-only (no mapped bytes)",
}


def _scanned_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(NOT_SCANNED):
                files.append(path)
    return files


def probes(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every getattr-with-default / hasattr call; a non-constant name is given as
    its source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        is_probe = (node.func.id == "getattr" and len(node.args) == 3) or (node.func.id == "hasattr" and len(node.args) == 2)
        if is_probe:
            name = node.args[1]
            found.append((node.lineno, name.value if isinstance(name, ast.Constant) else ast.unparse(name)))
    return found


def test_probe_scan_finds_getattr_with_default_and_hasattr_only():
    source = ("getattr(g, 'KIND', None)\nhasattr(g, 'serves')\ngetattr(g, 'KIND')\ng.KIND\n"
              "getattr(m, name, 0)\nx.getattr(g, 'a', 1)\n")
    assert probes(source) == [(1, "KIND"), (2, "serves"), (5, "name")]


def test_no_capability_probes_outside_the_allow_list():
    files = _scanned_files()
    assert len(files) > 50, "the scan found too few files: wrong ROOT?"
    seen, new = set(), []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, attr in probes(path.read_text()):
            seen.add((rel, attr))
            if (rel, attr) not in ALLOWED:
                new.append(f"{rel}:{line} probes {attr!r}")
    print(f"\nscanned {len(files)} files; {len(seen)} allowed probe sites, {len(new)} new")
    assert not new, ("getattr/hasattr capability probes: declare the hook in ArchPlugin (archs/base.py) or Graph "
                     "(runtime/graphs/contract.py) and read it directly:\n  " + "\n  ".join(new))
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match no probe any more (remove them): {stale}"


# ---- plugins ---------------------------------------------------------------------------------------------

def test_every_registered_plugin_is_a_complete_arch_plugin():
    archs = supported_architectures()
    classes = {cls for cls in _REGISTRY.values()}
    for cls in classes:
        assert issubclass(cls, ArchPlugin)
        check_plugin(cls)  # raises on a missing hook
        assert not cls.__abstractmethods__
        assert cls.family and cls.hf_architectures and cls.gguf_arch
        assert set(cls.hf_reference) <= set(cls.hf_architectures)  # a reference for a checkpoint it converts
    print(f"\n{len(classes)} plugin classes for {len(archs)} architectures satisfy ArchPlugin")


class _Incomplete(ArchPlugin):  # its identity written; metadata not (the one hook without a default)
    hf_architectures = ("IncompleteForCausalLM",)
    gguf_arch = "incomplete"
    family = "incomplete"


def test_an_incomplete_plugin_is_refused_at_registration_with_its_missing_hooks_named():
    supported_architectures()
    before = dict(_REGISTRY)
    with pytest.raises(SpecconvError) as err:
        register(_Incomplete)
    message = str(err.value)
    print(f"\n{message}")
    assert "metadata" in message
    for declared in ("gguf_arch", "tensor_plan", "n_mtp_layers", "n_trunk_layers", "vocab_size"):
        assert declared not in message
    assert _REGISTRY == before  # nothing registered


def test_a_plugin_without_identity_or_base_is_refused():
    class Nameless(_Incomplete):
        hf_architectures = ()
        gguf_arch = ""
        family = ""
    with pytest.raises(SpecconvError, match="family, gguf_arch, hf_architectures"):
        check_plugin(Nameless)
    with pytest.raises(SpecconvError, match="does not subclass ArchPlugin"):
        check_plugin(object)


_STRUCTURE_DEFAULTS = ("n_trunk_layers", "n_mtp_layers", "vocab_size", "sizes", "block_prefix", "blocks", "hooks",
                       "ignored_sources", "tensor_plan")


def test_plugin_defaults_are_declared_on_the_base():
    for hook in ("uses_target", "standalone_drafter", "missing_mtp", "notices", "tokenizer_dir", "refine",
                 "normalize_name", "tokenizer_model", "tokenizer_pre", "special_tokens",
                 "hf_reference") + _STRUCTURE_DEFAULTS:
        assert hook in vars(ArchPlugin), hook
        assert hook not in ArchPlugin.__abstractmethods__, hook
    # what the defaults read: the family's hparams and table, declared (set by every plugin)
    assert {"hp", "table"} <= set(ArchPlugin.__annotations__)
    assert _Incomplete.refine({}) is _Incomplete  # the default hands over to no other class


class _Complete(_Incomplete):
    def metadata(self, keep_mtp):
        return []


def _toy_plugin(ignored=()):
    """A plugin with two trunk blocks and one MTP block, written with the base's defaults only."""
    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.hparams import FamilyHParams
    from specconv.archs.tensor_table import TensorSpec, TensorTable

    table = TensorTable((TensorSpec("token_embd.weight", "model.embed_tokens.weight", lambda s: (s.vocab_dim, 4)),
                         TensorSpec("blk.{bid}.attn_norm.weight", "{p}norm.weight", lambda s: (4,), f32=True)),
                        lambda s, bid: frozenset())
    tensors = {"model.embed_tokens.weight": SourceTensor("model.embed_tokens.weight", (11, 4), "F32")}
    tensors.update({f"model.layers.{i}.{n}": SourceTensor(f"model.layers.{i}.{n}", (4,), "F32")
                    for i in range(3) for n in ("norm.weight", "dropped.weight")})

    class Toy(_Complete):
        def __init__(self, checkpoint):
            super().__init__(checkpoint)
            self.hp = FamilyHParams(arch="incomplete", num_hidden_layers=2, hidden_size=4, vocab_size=11,
                                    num_nextn_predict_layers=1)

        def ignored_sources(self):
            return list(ignored)

    Toy.table = table
    return Toy(Checkpoint(config={}, tensors=tensors))


def test_the_base_defaults_plan_the_trunk_then_the_mtp_blocks_from_the_table():
    from specconv.archs.base import Role

    p = _toy_plugin(ignored=[f"model.layers.{i}.dropped.weight" for i in range(3)] + ["model.layers.9.absent"])
    assert (p.n_trunk_layers, p.n_mtp_layers, p.vocab_size()) == (2, 1, 11)  # the embedding's rows
    assert [(b.bid, b.prefix, b.role) for b in p.blocks()] == [
        (0, "model.layers.0.", Role.TRUNK), (1, "model.layers.1.", Role.TRUNK), (2, "model.layers.2.", Role.MTP)]
    plans = p.tensor_plan()
    print(f"\n{[(t.name, t.role.value) for t in plans]}")
    assert [(t.name, t.role) for t in plans] == [("token_embd.weight", Role.SHARED)] + [
        (f"blk.{i}.attn_norm.weight", Role.TRUNK if i < 2 else Role.MTP) for i in range(3)]
    # a checkpoint tensor neither planned nor ignored is refused, as before the defaults
    with pytest.raises(SpecconvError, match="unexpected tensor.*dropped"):
        _toy_plugin().tensor_plan()


# ---- graphs ----------------------------------------------------------------------------------------------

def test_every_graph_declares_a_complete_graph():
    declared = {}
    for arch in graphs.supported_archs():
        graph = graphs.graph_for(arch)
        assert isinstance(graph, Graph)
        assert not required_fields(graph)
        assert arch in graph.archs  # found by its own declaration
        assert graph.name == graphs.graph_module(arch).__name__.rsplit(".", 1)[-1]
        declared[graph.name] = graph
    # every graph module in the folder is found (helpers declare no GRAPH)
    for path in sorted((ROOT / "runtime/graphs").glob("*.py")):
        if "\nGRAPH = " in path.read_text():  # Graph(...) or a shared maker (chained.graph)
            assert path.stem in declared, f"{path.name} declares a GRAPH but graph_for does not find it"
    print(f"\n{len(declared)} graphs declare Graph for {len(graphs.supported_archs())} GGUF arches")


def test_an_unknown_arch_names_the_supported_ones():
    with pytest.raises(SpecconvError, match="no graph for GGUF arch 'toy-arch'") as err:
        graphs.graph_for("toy-arch")
    assert all(arch in str(err.value) for arch in ("llama", "qwen35moe", "glm-dsa"))


def _minimal(**over) -> dict:
    fields = {name: no_tensors for name in required_fields()}
    fields.update(name="toy", archs=("toy-arch",), HParams=graphs.graph_for("llama").HParams)
    fields.update(over)
    return fields


def test_an_incomplete_graph_is_refused_where_it_is_declared():
    partial = _minimal()
    del partial["forward_mtp"], partial["mtp_layout"]
    with pytest.raises(SpecconvError) as err:
        Graph(**partial)
    print(f"\n{err.value}")
    assert "toy" in str(err.value) and "mtp_layout, forward_mtp" in str(err.value)
    Graph(**_minimal())  # complete: accepted


@pytest.mark.parametrize("over, message", [
    ({"MTP_ROWS": "sideways"}, "MTP_ROWS"),
    ({"TARGET_HIDDEN": "nextn"}, "TARGET_HIDDEN"),
    ({"CHAIN_HIDDEN": "post_norm"}, "CHAIN_HIDDEN"),
    ({"KIND": "sidecar"}, "KIND"),
    ({"forward_encoder": no_tensors}, "ENCODER"),
    ({"main_tensors": ("token_embd.weight",)}, "callable"),
    ({"HParams": dict}, "from_kv"),
    ({"archs": ()}, "archs"),
    ({"archs": "llama"}, "archs"),
])
def test_a_graph_with_a_bad_capability_is_refused(over, message):
    with pytest.raises(SpecconvError, match=message):
        Graph(**_minimal(**over))


def test_the_allowed_capability_values_are_the_runtime_s():
    from specconv.runtime.drafters import mtp_chain
    from specconv.runtime.graphs import contract

    assert set(contract.MTP_ROW_LAYOUTS) == set(mtp_chain.LAYOUTS)  # each a layout the MTP drafter runs


def test_a_module_without_a_graph_declaration_is_refused():
    from specconv.runtime.graphs import ops  # a helper module: no GRAPH

    with pytest.raises(SpecconvError, match="declares no GRAPH"):
        graphs.register_module(ops)


def test_a_graph_module_outside_the_package_is_found_once_registered():
    toy = types.ModuleType("toy_graph")
    toy.GRAPH = Graph(**_minimal())
    with pytest.raises(SpecconvError, match="no graph for GGUF arch 'toy-arch'"):
        graphs.graph_for("toy-arch")
    assert graphs.register_module(toy) is toy.GRAPH
    try:
        assert graphs.graph_for("toy-arch") is toy.GRAPH and "toy-arch" in graphs.supported_archs()
        assert graphs.graph_for("llama").name == "llama"  # the package's graphs are still found
    finally:
        graphs.unregister_module(toy)
    assert "toy-arch" not in graphs.supported_archs()


def test_an_arch_declared_by_two_graphs_is_refused():
    twin = types.ModuleType("twin_graph")
    twin.GRAPH = Graph(**_minimal(archs=("toy-arch", "llama")))  # llama is runtime/graphs/llama.py's
    with pytest.raises(SpecconvError, match="'llama' is declared by two graphs"):
        graphs.register_module(twin)
    assert "toy-arch" not in graphs.supported_archs()  # refused whole


def _graph_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, field) of every attribute read of a model's graph: `<model>.graph.X`, `self.graph.X` and,
    within a function, names bound to a `.graph` (`g, hp = model.graph, model.hparams`)."""
    reads = set()
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        aliases = set()
        if scope is not tree:
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                                 and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                        for t, v in pairs:
                            if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == "graph":
                                aliases.add(t.id)
        for node in ast.walk(scope):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            of_graph = (isinstance(owner, ast.Attribute) and owner.attr == "graph"
                        and ast.unparse(owner.value).split(".")[-1] in ("model", "head", "target", "self")) \
                or (isinstance(owner, ast.Name) and owner.id in aliases)
            if of_graph:
                reads.add((node.lineno, node.attr))
    return sorted(reads)


def test_the_runtime_reads_only_declared_graph_fields():
    declared = {f.name for f in dataclasses.fields(Graph)}
    files = [ROOT / p for p in ("runtime/model.py", "runtime/context.py", "runtime/step_graphs.py",
                                "runtime/validate.py", "runtime/speculative.py")]
    files += sorted((ROOT / "runtime/drafters").glob("*.py")) + sorted((ROOT / "specconv/verify").glob("*.py"))
    reads, undeclared = 0, []
    for path in files:
        for line, name in _graph_reads(ast.parse(path.read_text())):
            reads += 1
            if name not in declared:
                undeclared.append(f"{path.relative_to(ROOT)}:{line} reads graph.{name}")
    print(f"\n{reads} reads of a model's graph, all of declared fields" if not undeclared else "")
    assert reads >= 10, "the scan found too few graph reads: did Model.graph move?"
    assert not undeclared, "\n".join(undeclared)


# ---- transformers reference classes (ArchPlugin.hf_reference, specconv/verify/parity.py) ------------------

def test_every_declared_reference_is_a_transformers_class():
    import transformers

    supported_architectures()
    declared = {(cls.__name__, hf, ref) for cls in _REGISTRY.values() for hf, ref in cls.hf_reference.items()}
    for plugin, hf, ref in sorted(declared):
        assert isinstance(getattr(transformers, ref), type), f"{plugin}: {hf} -> {ref}"
    print(f"\n{len(declared)} checkpoint architectures with a transformers reference")


@pytest.mark.parametrize("architectures, arch, reference", [
    (["Qwen3_5ForConditionalGeneration"], "qwen35", "Qwen3_5ForCausalLM"),  # a release: transformers' key mapping
    (["Gemma4ForConditionalGeneration"], "gemma4", "Gemma4ForConditionalGeneration"),  # its own class
    (["Gemma4ForCausalLM"], "gemma4", "Gemma4ForCausalLM"),
    (["DeepseekV3ForCausalLM"], "deepseek2", "DeepseekV3ForCausalLM"),
    (["Glm4MoeLiteForCausalLM"], "deepseek2", "Glm4MoeLiteForCausalLM"),  # GLM-4.7-Flash, written as deepseek2
    (["LlamaForCausalLM"], "llama", "LlamaForCausalLM"),
])
def test_the_reference_class_follows_the_checkpoint(tmp_path, architectures, arch, reference):
    from specconv.verify import parity

    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    assert parity.reference_class_name(tmp_path, arch) == reference


@pytest.mark.parametrize("architectures, arch, message", [
    (["Step3p5ForCausalLM"], "step35", "no transformers reference for GGUF arch 'step35'"),
    (["LlamaForCausalLM"], "qwen35", "a llama checkpoint, not the qwen35 the GGUF file holds"),
])
def test_a_checkpoint_without_a_reference_or_of_another_arch_is_refused(tmp_path, architectures, arch, message):
    from specconv.verify import parity

    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    with pytest.raises(SpecconvError, match=message):
        parity.reference_class_name(tmp_path, arch)


def test_the_plugins_writing_one_arch_agree_on_what_header_readers_ask():
    """inspect and the hub read a file's header and ask the plugins that write its arch
    (archs.plugin_classes_writing): deepseek2's two plugins must say the same."""
    from specconv.archs import plugin_classes_writing

    supported_architectures()
    arches = {cls.gguf_arch for cls in _REGISTRY.values()}
    for arch in sorted(arches):
        plugins = plugin_classes_writing(arch)
        assert plugins and all(p.gguf_arch == arch for p in plugins)
        assert len({(p.standalone_drafter, p.llama_cpp_skips_absent_nextn) for p in plugins}) == 1, arch
    skipping = sorted(a for a in arches if plugin_classes_writing(a)[0].llama_cpp_skips_absent_nextn)
    print(f"\n{len(arches)} GGUF arches; llama.cpp runs trunk-only without nextn tensors: {skipping}")
    assert skipping == ["deepseek2", "glm4moe"]  # llama.cpp's loaders of these two mark the nextn tensors optional
    assert plugin_classes_writing("no-such-arch") == []
