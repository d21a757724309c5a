"""DeepSeek Sparse Attention families (docs/dsa.md):

* GLM-5 / 5.1 (`GlmMoeDsaForCausalLM`) -> GGUF arch `glm-dsa`;
* DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) -> GGUF arch `deepseek32`.

Both are DeepSeek-V3's MLA + sigmoid-routed MoE + nextn layer (archs/deepseek2.py, written the same
way: `attn_k_b` / `attn_v_b`, latent KV) plus, in every attention block that runs one, the
"lightning indexer": `self_attn.indexer.{wq_b, wk, k_norm (LayerNorm, weight + bias),
weights_proj}` -> `blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}`, with `proj` and the norm kept
F32 as llama.cpp's converter does, and the keys `attention.indexer.{head_count, key_length, top_k}`.

GLM-5's layers may reuse the previous indexer's selection ("shared" in `indexer_types`); such a
layer has no indexer tensors. llama.cpp reads the per-layer list from `attention.indexer.types` and
without it assumes every layer is full below a 1M-token context and GLM-5.2's pattern above; the
list is written whenever transformers' reading of config.json would differ from that default.
Everything else (names, MTP routing, MoE, nextn extras) is the deepseek2 plugin's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gguf import GGUFValueType, Keys

from . import names, register
from .base import MetaKV
from .config_reader import ConfigReader
from .deepseek2 import DEEPSEEK2_TABLE, Deepseek2, Deepseek2HParams, Glm4MoeLite, Glm4MoeLiteHParams
from .errors import SpecconvError
from .hparams import HParamsReader
from .metadata import MetadataWriter
from .tensor_table import TensorSpec, TensorTable

# llama.cpp's glm-dsa loader: below this trained context every layer is "full" by default.
GLM52_CONTEXT = 1048576


def glm_indexer_types(tc: ConfigReader, num_hidden_layers: int) -> list[str]:
    """transformers' GlmMoeDsaConfig reading: `indexer_types`, else `index_topk_pattern`, else the
    `index_topk_freq` / `index_skip_topk_offset` schedule (defaults 1 / 2: every layer full)."""
    types = tc.strings("indexer_types", default=None)
    if types is None and tc.has("index_topk_pattern"):
        pattern = tc.raw("index_topk_pattern")
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise SpecconvError(f"config.json: index_topk_pattern has {bad[0]!r} (only F and S)")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            types = tc.strings("index_topk_pattern")
    if types is None:
        freq = max(tc.integer("index_topk_freq", default=1) or 1, 1)
        offset = tc.integer("index_skip_topk_offset", default=2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_hidden_layers)]
    if len(types) != num_hidden_layers or not set(types) <= {"full", "shared"}:
        raise SpecconvError(f"config.json: indexer_types {types} is not 'full'/'shared' for each of {num_hidden_layers} layers")
    if types and types[0] != "full":
        raise SpecconvError("config.json: indexer_types[0] is 'shared'; a shared layer needs an earlier full one")
    return types


@dataclass(kw_only=True)
class DsaHParams(Deepseek2HParams):
    """DeepSeek-V3's fields plus the lightning indexer: index_n_heads heads of index_head_dim, the
    index_topk keys it keeps, and per trunk layer whether it runs its own indexer ("full") or reuses
    the previous full layer's choice ("shared"); the nextn block runs its own."""

    lite_by_size: ClassVar[bool] = False  # glm-dsa / deepseek32 always read q_lora_rank (no V2-Lite rule)

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # "full" | "shared", one per trunk layer

    @property
    def index_rope_halves(self) -> bool:
        """The indexer ropes halves (llama.cpp's NEOX rope: DeepSeek-V3.2), else adjacent pairs (GLM-5)."""
        return self.arch == names.DEEPSEEK32

    def runs_indexer(self, bid: int) -> bool:
        return bid >= self.num_hidden_layers or self.indexer_types[bid] == "full"  # the nextn block runs its own

    def attention_tags(self, bid: int) -> set[str]:
        return super().attention_tags(bid) | ({"indexer"} if self.runs_indexer(bid) else set())

    @classmethod
    def indexer_types_of(cls, tc: ConfigReader, num_hidden_layers: int) -> list[str]:
        return ["full"] * num_hidden_layers

    @classmethod
    def fields_from_config(cls, cfg: ConfigReader, tc: ConfigReader) -> dict[str, Any]:
        f = super().fields_from_config(cfg, tc)
        index = {k: tc.integer(k, min=1) for k in ("index_n_heads", "index_head_dim", "index_topk")}
        if f["q_lora_rank"] is None:
            raise SpecconvError("config.json: q_lora_rank is null; the DSA indexer projects from the q_a latent")
        if f["qk_rope_head_dim"] > index["index_head_dim"]:
            raise SpecconvError(f"config.json: qk_rope_head_dim ({f['qk_rope_head_dim']}) exceeds index_head_dim "
                                f"({index['index_head_dim']}); the indexer ropes its first qk_rope_head_dim dims")
        return dict(f, **index, indexer_types=tuple(cls.indexer_types_of(tc, f["num_hidden_layers"])))

    @classmethod
    def fields_from_kv(cls, r: HParamsReader) -> dict[str, Any]:
        f = super().fields_from_kv(r)
        arch, key, n = r.arch, r.key, f["num_hidden_layers"]
        if not f["q_lora_rank"]:
            raise SpecconvError(f"{arch}: attention.q_lora_rank is 0; the DSA indexer projects from the q_a latent")
        heads, dim, topk = (key(f"attention.indexer.{k}", type=int) for k in ("head_count", "key_length", "top_k"))
        if min(heads, dim, topk) <= 0 or f["qk_rope_head_dim"] > dim:
            raise SpecconvError(f"{arch}: indexer head_count {heads}, key_length {dim}, top_k {topk} with rope "
                                f"dimension {f['qk_rope_head_dim']} (need positive sizes and key_length ≥ rope dims)")
        full = key("attention.indexer.types", None, list)
        if full is None:  # llama.cpp's default below GLM-5.2's 1M context: every layer full
            if arch == names.GLM_DSA and key("context_length", type=int) >= GLM52_CONTEXT:
                raise SpecconvError("glm-dsa file with a ≥1M context and no attention.indexer.types; "
                                    "reconvert it with specconv (the per-layer indexer list is needed)")
            full = [True] * n
        full = [bool(x) for x in full[:n]]
        if len(full) != n or not full[0]:
            raise SpecconvError(f"{arch}.attention.indexer.types must give {n} layers, the first full")
        return dict(f, index_n_heads=heads, index_head_dim=dim, index_topk=topk,
                    indexer_types=tuple("full" if x else "shared" for x in full))


@dataclass(kw_only=True)
class GlmMoeDsaHParams(DsaHParams, Glm4MoeLiteHParams):
    """GLM-5 / 5.1: GLM-4.7-Flash's reading of config.json (transformers' GlmMoeDsaConfig defaults) and
    its indexer_types (`glm_indexer_types`)."""

    family: ClassVar[str] = "glm-dsa"
    gguf_arch: ClassVar[str] = names.GLM_DSA
    config_defaults: ClassVar[dict] = {
        "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "n_shared_experts": 1,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256, "rope_interleave": True,
        "attention_bias": False, "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 32}

    @classmethod
    def indexer_types_of(cls, tc: ConfigReader, num_hidden_layers: int) -> list[str]:
        return glm_indexer_types(tc, num_hidden_layers)


@dataclass(kw_only=True)
class DeepseekV32HParams(DsaHParams):
    """DeepSeek-V3.2: DeepSeek-V3's reading of config.json (transformers' DeepseekV32Config defaults);
    every layer runs its own indexer."""

    family: ClassVar[str] = "deepseek32"
    gguf_arch: ClassVar[str] = names.DEEPSEEK32
    config_defaults: ClassVar[dict] = {  # transformers' DeepseekV32Config
        **Deepseek2HParams.config_defaults, "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 64, "max_position_embeddings": 163840}

    @classmethod
    def fields_from_config(cls, cfg: ConfigReader, tc: ConfigReader) -> dict[str, Any]:
        f = super().fields_from_config(cfg, tc)
        if not f["rope_interleave"]:
            raise SpecconvError("config.json: rope_interleave=false; DeepSeek-V3.2 always ropes adjacent pairs")
        return f


_X = "{p}self_attn.indexer."
# deepseek2's table plus, in every block that runs its own indexer, the indexer (proj and the norm F32,
# as llama.cpp's converter writes them)
DSA_TABLE = TensorTable((
    *DEEPSEEK2_TABLE.specs,
    TensorSpec("blk.{bid}.indexer.attn_q_b.weight", _X + "wq_b.weight",
               lambda s: (s.index_n_heads * s.index_head_dim, s.q_lora_rank), "indexer"),
    TensorSpec("blk.{bid}.indexer.attn_k.weight", _X + "wk.weight", lambda s: (s.index_head_dim, s.hidden_size),
               "indexer"),
    TensorSpec("blk.{bid}.indexer.k_norm.weight", _X + "k_norm.weight", lambda s: (s.index_head_dim,), "indexer",
               f32=True),
    TensorSpec("blk.{bid}.indexer.proj.weight", _X + "weights_proj.weight", lambda s: (s.index_n_heads, s.hidden_size),
               "indexer", f32=True),
    TensorSpec("blk.{bid}.indexer.k_norm.bias", _X + "k_norm.bias", lambda s: (s.index_head_dim,), "indexer",
               f32=True),
), DEEPSEEK2_TABLE.block_tags)


class DsaMixin:
    """The lightning indexer on top of a deepseek2-style plugin."""

    table: ClassVar[TensorTable] = DSA_TABLE
    llama_cpp_skips_absent_nextn: ClassVar[bool] = False  # deepseek2's rule is not the DSA arches'

    def tensor_plan(self):
        for bid in range(self.hp.num_hidden_layers):
            wk = f"model.layers.{bid}.self_attn.indexer.wk.weight"
            if not self.hp.runs_indexer(bid) and wk in self.checkpoint.tensors:
                raise SpecconvError(f"layer {bid} is a 'shared' indexer layer but the checkpoint has {wk}")
        return super().tensor_plan()

    def _indexer_kv(self, w: MetadataWriter) -> None:
        w.u32(Keys.Attention.Indexer.HEAD_COUNT, self.hp.index_n_heads)
        w.u32(Keys.Attention.Indexer.KEY_LENGTH, self.hp.index_head_dim)
        w.u32(Keys.Attention.Indexer.TOP_K, self.hp.index_topk)


@register
class GlmMoeDsa(DsaMixin, Glm4MoeLite):
    """GLM-5 / 5.1: GLM's names, tokenizer and defaults (transformers' GlmMoeDsaConfig), the indexer
    ropes adjacent pairs like the main attention (llama.cpp's NORM rope, as written)."""

    hf_architectures = ("GlmMoeDsaForCausalLM",)
    gguf_arch: ClassVar[str] = GlmMoeDsaHParams.gguf_arch
    hf_reference: ClassVar[dict[str, str]] = {"GlmMoeDsaForCausalLM": "GlmMoeDsaForCausalLM"}
    HParams = GlmMoeDsaHParams
    family: ClassVar[str] = GlmMoeDsaHParams.family

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch, super().metadata(keep_mtp))
        self._indexer_kv(w)
        # llama.cpp's default without the key: all full below GLM52_CONTEXT, GLM-5.2's pattern above
        full = [t == "full" for t in self.hp.indexer_types]
        differs = self.hp.max_position_embeddings >= GLM52_CONTEXT or not all(full)
        if ConfigReader(self.checkpoint.config).text_model().has("indexer_types") or differs:
            # one bool per trunk block (llama.cpp reads n_layer entries; the nextn block is full)
            w.array(names.indexer_types_key(names.GLM_DSA), full, GGUFValueType.BOOL)
        return w.kv


@register
class DeepseekV32(DsaMixin, Deepseek2):
    """DeepSeek-V3.2: DeepSeek-V3's names and tokenizer; the indexer rotates halves (llama.cpp's
    NEOX rope on the indexer, as written), the main attention adjacent pairs."""

    hf_architectures = ("DeepseekV32ForCausalLM",)
    gguf_arch: ClassVar[str] = DeepseekV32HParams.gguf_arch
    hf_reference: ClassVar[dict[str, str]] = {"DeepseekV32ForCausalLM": "DeepseekV32ForCausalLM"}
    HParams = DeepseekV32HParams
    family: ClassVar[str] = DeepseekV32HParams.family

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch, super().metadata(keep_mtp))
        self._indexer_kv(w)
        return w.kv
