"""The tensor tables (archs/tensor_table.py): one list per family from which the converter's plan, the
runtime's needed and optional tensors, the expected shapes and the storage rule derive.

Per switched family, a converted tiny checkpoint holds exactly the tensors the runtime derives from
the same table (trunk, MTP head and the optional ones it has), each of the shape the table gives,
and F32 exactly where the table keeps a tensor float. The mechanics (block tags, hooks, tensors the
converter never writes, replacing a group, the float rule's name matching) are tested on a toy table.
"""

from __future__ import annotations

import pytest

from specconv.archs.base import Role, SourceTensor
from specconv.archs.errors import SpecconvError
from specconv.archs.plan_tools import RolePlan
from specconv.archs.tensor_table import Block, GraphTensors, TensorSpec, TensorTable
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.paths import ROOT


def _qwen35(moe: bool):
    def build(root):
        from tests.fixtures.tiny_qwen35 import build_qwen35

        return build_qwen35(root, moe=moe)
    return build


def _qwen3next(root):
    from tests.fixtures.tiny_qwen3next import build_qwen3next

    return build_qwen3next(root)


def _qwen3(moe: bool):
    def build(root):
        from tests.fixtures.tiny_qwen3 import build_qwen3

        return build_qwen3(root, moe=moe)
    return build


def _nextn_moe(family: str, **over):
    def build(root):
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        return build_tiny(root, family, **over)
    return build


def _dsa(family: str, **over):
    def build(root):
        from tests.fixtures.tiny_dsa import build_tiny

        return build_tiny(root, family, **over)
    return build


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # written as rope_freqs.weight


def _llama(root):
    from tests.fixtures.tiny_eagle3 import build_llama_target

    return build_llama_target(root, rope_scaling=LLAMA3_ROPE)


def _eagle3(**head):
    """A head converted with its target: (head folder, the convert arguments naming the target)."""
    def build(root):
        from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target

        target = build_llama_target(root / "target")
        return build_eagle3_head(root / "head", target, **head), ["--target", str(target)]
    return build


def _gemma4(assistant: bool = False, **over):
    def build(root):
        from tests.fixtures import tiny_gemma4

        return tiny_gemma4.tiny_assistant() if assistant else tiny_gemma4.tiny_gemma4("hub", **over)
    return build


def _dflash(**head):
    """A DFlash drafter converted with its Qwen3 target: (drafter folder, the convert arguments)."""
    def build(root):
        from tests.fixtures.tiny_dflash import build_dflash
        from tests.fixtures.tiny_qwen3 import build_qwen3

        target = build_qwen3(root / "target", n_layers=6, seed=4, head_dim=16)
        return build_dflash(root / "dflash", target, **head), ["--target", str(target)]
    return build


def _chained_written(family: str):
    """The optional tensors a chained-MTP checkpoint gives, read off its own tensor names: each block's
    FFN, dense or routed by whether it has a router; the untied head; the family's per-checkpoint
    extras (step35's head-wise gates and the MTP blocks' own LM head, mimo2's sinks and its MTP blocks'
    fused q|k|v and output norm)."""
    router = {"hy_v3": "mlp.router.gate.weight", "step35": "moe.gate.weight", "mimo2": "mlp.gate.weight"}[family]
    bias = "exp_probs_b" if family == "hy_v3" else "exp_probs_b.bias"
    routed = ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", bias]
    routed += [] if family == "mimo2" else ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]

    def written(hp, source) -> set[str]:
        from safetensors import safe_open

        with safe_open(str(source / "model.safetensors"), "np") as f:
            hf = set(f.keys())
        out = {"output.weight"} if "lm_head.weight" in hf else set()
        for i in range(hp.num_hidden_layers + hp.num_nextn_predict_layers):
            mtp = i >= hp.num_hidden_layers
            p = f"model.mtp.layers.{i - hp.num_hidden_layers}." if family == "mimo2" and mtp else f"model.layers.{i}."
            ffn = routed if p + router in hf else ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
            extra = {"step35": ["attn_q_norm.weight", "attn_k_norm.weight"]
                     + (["attn_gate.weight"] if p + "self_attn.g_proj.weight" in hf else [])
                     + (["nextn.shared_head_head.weight"] if p + "transformer.shared_head.output.weight" in hf else [])
                     + (["nextn.embed_tokens.weight"] if p + "embed_tokens.weight" in hf else []),
                     "mimo2": (["attn_qkv.weight", "layer_output_norm.weight"] if mtp else
                               ["attn_q.weight", "attn_k.weight", "attn_v.weight"])
                     + (["attn_sinks.weight"] if p + "self_attn.attention_sink_bias" in hf else [])}.get(family, [])
            out |= {f"blk.{i}.{n}" for n in ffn + extra}
        return out
    return written


def _gemma4_v(hp, source=None) -> set[str]:
    """attn_v of the K/V-owning sliding layers (the full ones of attention_k_eq_v have none)."""
    return {f"blk.{i}.attn_v.weight" for i in range(hp.num_hidden_layers) if hp.owns_kv(i) and hp.is_sliding(i)}


def _chained(family: str, **over):
    def build(root):
        from tests.fixtures.tiny_chained import build_tiny

        return build_tiny(root, family, **over)
    return build


QWEN_MTP = {"output.weight", "blk.{n}.nextn.shared_head_norm.weight"}
NEXTN_COPIES = QWEN_MTP | {"blk.{n}.nextn.embed_tokens.weight", "blk.{n}.nextn.shared_head_head.weight"}
GLM_ATTN = {f"blk.{{i}}.{x}" for x in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight",
                                        "attn_k_norm.weight")}
# case -> (arch, tiny checkpoint builder (a folder, or with the convert arguments), MTP blocks, the optional
# tensors the converter writes for it: {n} the MTP block, {i} every block, or a function of the hparams and
# the checkpoint folder)
FAMILIES = {
    "qwen35": ("qwen35", _qwen35(False), 1, QWEN_MTP), "qwen35moe": ("qwen35moe", _qwen35(True), 1, QWEN_MTP),
    "qwen3next": ("qwen3next", _qwen3next, 1, QWEN_MTP),
    "qwen3": ("qwen3", _qwen3(False), 0, {"output.weight"}),
    "qwen3moe": ("qwen3moe", _qwen3(True), 0, {"output.weight"}),
    "glm4moe": ("glm4moe", _nextn_moe("glm4moe"), 1, NEXTN_COPIES | GLM_ATTN),
    "glm4moe-plain": ("glm4moe", _nextn_moe("glm4moe", attention_bias=False, use_qk_norm=False, copies=False), 1,
                      QWEN_MTP),
    "deepseek2": ("deepseek2", _nextn_moe("deepseek2"), 1, NEXTN_COPIES),
    "deepseek2-no-q-lora": ("deepseek2", _nextn_moe("deepseek2", q_lora_rank=None), 1, NEXTN_COPIES),
    "glm47flash": ("deepseek2", _nextn_moe("glm4moelite"), 1, NEXTN_COPIES),
    "glm-dsa-shared": ("glm-dsa", _dsa("glm-dsa", indexer_types=["full", "shared", "full"]), 1, NEXTN_COPIES),
    "deepseek32": ("deepseek32", _dsa("deepseek32"), 1, NEXTN_COPIES),
    "llama": ("llama", _llama, 0, {"output.weight", "rope_freqs.weight"}),
    # the draft vocabulary's own head and d2t; the embedding is the target's
    "eagle3": ("eagle3", _eagle3(layout="eagle"), 0, {"output.weight", "d2t"}),
    # its own embedding, the norm before fc (then required), llama3 rope, a head over the whole vocabulary
    "eagle3-speculators": ("eagle3", _eagle3(layout="speculators", norm_before_fc=True, draft_vocab=512,
                                             rope_scaling=LLAMA3_ROPE), 0,
                           {"token_embd.weight", "output.weight", "rope_freqs.weight"}),
    "eagle3-target-head": ("eagle3", _eagle3(lm_head=False), 0, set()),  # embedding and head: the target's
    # per-layer inputs, K/V-sharing tail layers, attention_k_eq_v
    "gemma4": ("gemma4", _gemma4(), 0, _gemma4_v),
    # the MoE blocks (fused gate|up experts: optional by name), no sharing, no per-layer inputs
    "gemma4-moe": ("gemma4", _gemma4(num_kv_shared_layers=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                     moe_intermediate_size=16, hidden_size_per_layer_input=0,
                                     vocab_size_per_layer_input=0), 0,
                   lambda hp, source: _gemma4_v(hp) | {f"blk.{i}.ffn_gate_up_exps.weight" for i in range(hp.num_hidden_layers)}),
    "gemma4-assistant": ("gemma4-assistant", _gemma4(assistant=True), 2, set()),
    # dense and routed blocks, k MTP blocks (their FFN optional by name: the file decides which)
    "dflash": ("dflash", _dflash(), 0, set()),  # embedding and head: the target's
    "dflash2": ("dflash", _dflash(v2=True), 0, set()),  # the convolutions and the candidate selector
    "hy_v3": ("hy_v3", _chained("hy_v3", k=2), 2, _chained_written("hy_v3")),
    "step35": ("step35", _chained("step35", k=2), 2, _chained_written("step35")),
    "mimo2": ("mimo2", _chained("mimo2", k=2), 2, _chained_written("mimo2")),
}


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_converted_file_is_what_the_runtime_derives(case, tmp_path):
    from gguf import GGMLQuantizationType as Q

    from specconv.runtime.gguf_file import GGUFModelFile
    from specconv.runtime.graphs import graph_for

    arch, build, n_mtp, optional_written = FAMILIES[case]
    built = build(tmp_path / "hf")
    source, extra_args = built if isinstance(built, tuple) else (built, ())
    path = convert_gguf(source, tmp_path / "m.gguf", outtype="f16", extra_args=extra_args)
    file = GGUFModelFile(path)
    assert file.arch == arch
    graph = graph_for(arch)
    hp = graph.HParams.from_kv(file.kv)
    assert hp.num_nextn_predict_layers == n_mtp
    required = graph.main_tensors(hp) + graph.mtp_tensors(hp) + (graph.encoder_tensors(hp) if graph.encoder_tensors
                                                                 else [])
    optional = list(graph.OPTIONAL) + graph.optional_main_tensors(hp) + graph.optional_mtp_tensors(hp)
    written = set(file.tensors)
    assert set(required) <= written, sorted(set(required) - written)
    assert written <= set(required) | set(optional), sorted(written - set(required) - set(optional))
    blocks = range(hp.num_hidden_layers + hp.num_nextn_predict_layers)
    optional_written = optional_written(hp, source) if callable(optional_written) else {
        t.format(n=hp.num_hidden_layers, i=i) for t in optional_written for i in blocks}
    assert written - set(required) == optional_written

    expected, bound = graph.expected_shapes(hp), {}
    for name, t in file.tensors.items():  # a size the file chooses ("V", "Vd") binds to its first tensor
        options = expected[name] if isinstance(expected[name], list) else [expected[name]]
        want = [bound.setdefault(d, found) if isinstance(d, str) else d for d, found in zip(options[0], t.shape)]
        assert tuple(t.shape) == tuple(want), name
        assert (t.tensor_type == Q.F32) == graph.keep_float32(name), (name, t.tensor_type.name)
    kept = sum(graph.keep_float32(n) for n in file.tensors)
    print(f"{case}: {len(file.tensors)} tensors, {kept} kept F32, {len(written - set(required))} optional written")


# ---- the mechanics, on a toy table -------------------------------------------------------------

def _toy() -> TensorTable:
    def tags(s, bid):
        return frozenset({"recurrent" if bid % 2 else "attention"} | ({"nextn"} if bid == s["n"] else set()))

    return TensorTable((
        TensorSpec("token_embd.weight", "embed", lambda s: (s["V"], 4)),
        TensorSpec("output.weight", None, lambda s: (s["V"], 4), optional=True, hook="head"),
        TensorSpec("blk.{bid}.attn_norm.weight", "{p}norm", lambda s: (4,), f32=True),
        TensorSpec("blk.{bid}.attn_q.weight", "{p}q", lambda s: (8, 4), "attention"),
        TensorSpec("blk.{bid}.ssm_a", "{p}a", lambda s: (2,), "recurrent", f32=True),
        TensorSpec("blk.{bid}.ffn_gate_exps.weight", None, lambda s: (3, 5, 4), hook="experts"),
        TensorSpec("blk.{bid}.ffn_up_exps.weight", None, lambda s: (3, 5, 4), hook="experts"),
        TensorSpec("blk.{bid}.nextn.eh_proj.weight", "fc", lambda s: (4, 8), "nextn"),
        TensorSpec("blk.{bid}.nextn.embed_tokens.weight", None, lambda s: (s["V"], 4), "nextn", optional=True),
    ), tags)


def _source_plan(names_shapes: dict[str, tuple]) -> RolePlan:
    return RolePlan({n: SourceTensor(n, s, "F32") for n, s in names_shapes.items()})


def test_plan_follows_tags_and_calls_each_hook_once_per_block():
    calls = []
    plan = _source_plan({"embed": (16, 4), "L0.norm": (4,), "L0.q": (8, 4), "L1.norm": (4,), "L1.a": (2,),
                         "fc": (4, 8)})
    hooks = {"head": lambda *a: calls.append(("head", a[2])), "experts": lambda *a: calls.append(("experts", a[2]))}
    _toy().plan(plan, {"V": 16, "n": 1}, [Block(0, "L0.", Role.TRUNK), Block(1, "L1.", Role.MTP)], hooks)
    got = {p.name: (p.sources, p.shape, p.role, p.force_type is not None) for p in plan.plans}
    assert got == {
        "token_embd.weight": (("embed",), (16, 4), Role.SHARED, False),
        "blk.0.attn_norm.weight": (("L0.norm",), (4,), Role.TRUNK, True),
        "blk.0.attn_q.weight": (("L0.q",), (8, 4), Role.TRUNK, False),
        "blk.1.attn_norm.weight": (("L1.norm",), (4,), Role.MTP, True),
        "blk.1.ssm_a": (("L1.a",), (2,), Role.MTP, True),
        "blk.1.nextn.eh_proj.weight": (("fc",), (4, 8), Role.MTP, False),  # no embed_tokens: never written
    }
    assert calls == [("head", None), ("experts", 0), ("experts", 1)]


def test_plan_checks_sources_and_hooks():
    table, sizes = _toy(), {"V": 16, "n": 5}
    with pytest.raises(SpecconvError, match="tensor L0.q has shape \\[4, 8\\], but config.json implies \\[8, 4\\]"):
        table.plan(_source_plan({"embed": (16, 4), "L0.norm": (4,), "L0.q": (4, 8)}), sizes,
                   [Block(0, "L0.", Role.TRUNK)], {"head": lambda *a: None, "experts": lambda *a: None})
    with pytest.raises(SpecconvError, match="output.weight: the plugin has no hook 'head'"):
        table.plan(_source_plan({"embed": (16, 4)}), sizes, [], {})


def test_runtime_names_and_shapes():
    table, sizes = _toy(), {"V": "V", "n": 2}
    assert table.names(sizes, range(2)) == [
        "token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_up_exps.weight", "blk.1.attn_norm.weight", "blk.1.ssm_a", "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight"]
    assert table.names(sizes, [2], roles=(), optional=True) == ["blk.2.nextn.embed_tokens.weight"]
    assert table.names(sizes, (), optional=True) == ["output.weight"]
    shapes = table.ggml_shapes(sizes, range(3))
    assert shapes["token_embd.weight"] == (4, "V") and shapes["blk.2.nextn.eh_proj.weight"] == (8, 4)
    assert "blk.1.attn_q.weight" not in shapes and "blk.1.nextn.eh_proj.weight" not in shapes


def test_graph_tensors_split_trunk_and_mtp_head():
    class HP:
        num_hidden_layers, num_nextn_predict_layers = 2, 1

    g = GraphTensors(_toy(), lambda hp: {"V": "V", "n": hp.num_hidden_layers})
    assert g.OPTIONAL == ("output.weight",)
    assert g.mtp_tensors(HP()) == ["token_embd.weight", "blk.2.attn_norm.weight", "blk.2.attn_q.weight",
                                   "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight",
                                   "blk.2.nextn.eh_proj.weight"]
    assert g.optional_mtp_tensors(HP()) == ["blk.2.nextn.embed_tokens.weight"]
    assert set(g.expected_shapes(HP())) >= set(g.main_tensors(HP()) + g.mtp_tensors(HP()))


def test_float_rule_matches_whole_names_of_the_table_only():
    table = _toy()
    assert table.keeps_float32("blk.12.attn_norm.weight") and table.keeps_float32("blk.0.ssm_a")
    for name in ("blk.x.ssm_a", "blk.0.ssm_a.bias", "blk.0.attn_q.weight", "token_embd.weight",
                 "output_norm.weight"):  # the last: ends like a norm, but is no tensor of this table
        assert not table.keeps_float32(name), name


def test_replacing_a_group_keeps_its_place():
    new = TensorSpec("blk.{bid}.ssm_ba.weight", "{p}ba", lambda s: (4, 4), "recurrent")
    replaced = _toy().replacing("recurrent", [new])
    order = [s.gguf for s in replaced.specs]
    assert order[3:6] == ["blk.{bid}.attn_q.weight", "blk.{bid}.ssm_ba.weight", "blk.{bid}.ffn_gate_exps.weight"]
    assert "blk.{bid}.ssm_a" not in order


def test_a_tensor_nothing_writes_must_be_optional():
    with pytest.raises(ValueError, match="never writes must be optional"):
        TensorSpec("blk.{bid}.x.weight", None, lambda s: (1,))


def test_worked_example_in_the_docs_is_the_qwen3_table():
    """docs/architecture.md's worked example quotes rows of archs/qwen3.py's table as they are."""
    import re

    from specconv.archs import names
    from specconv.archs.qwen3 import QWEN3_TABLE

    doc = (ROOT / "docs" / "architecture.md").read_text()
    example = doc[doc.index("#### A table written from scratch: Qwen3"):doc.index("### A new drafter kind")]
    table = {s.gguf: s for s in QWEN3_TABLE.specs}
    quoted = re.findall(r'TensorSpec\(("[^"]+"|names\.\w+), ("[^"]+"|None),\s*lambda s: (\([^)]*\))'
                        r'(?:, "(\w+)")?', example)
    assert len(quoted) >= 6
    sizes = {"vocab_dim": 7, "hidden_size": 8, "q": 9, "intermediate_size": 10, "num_experts": 11,
             "moe_intermediate_size": 12}

    class S:
        pass
    for k, v in sizes.items():
        setattr(S, k, v)
    for gguf, hf, shape, tag in quoted:
        gguf = getattr(names, gguf[6:]) if gguf.startswith("names.") else gguf.strip('"')
        spec = table[gguf]
        assert spec.hf == (None if hf == "None" else hf.strip('"')), gguf
        assert spec.shape(S) == eval(shape, {}, {"s": S}), gguf  # noqa: S307  (the doc's own expression)
        assert spec.on == (frozenset({tag}) if tag else frozenset()), gguf
    from specconv.archs.qwen3 import Qwen3HParams

    block = example[example.index("class Qwen3HParams("):example.index("def block_tags")]
    assert re.findall(r"^    (\w+): ", block, re.M) == list(Qwen3HParams.__annotations__)  # the fields it declares
    print(f"{len(quoted)} rows of the worked example match QWEN3_TABLE, its hparams fields archs/qwen3.py's")
