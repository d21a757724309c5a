"""What the chained-MTP plugins share (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

Their checkpoints hold k MTP blocks after the N trunk layers, each with `eh_proj / enorm / hnorm`
and a full decoder block, written as GGUF blocks N..N+k-1. `ChainedHParams` is the base of each
family's one hparams dataclass (built from config.json by the plugin, from GGUF metadata by the
graph); `chained_table` is a family's tensor table (archs/tensor_table.py), whose shapes read that
dataclass: nextn inputs and head, attn_norm, attention, ffn_norm, dense or routed FFN, the family
giving its own attention, MTP head and routed rows; `ChainedMtpPlugin` plans it over the N + k
blocks (the graphs, runtime/graphs/chained.py, derive their lists from the same table);
`check_stated_count` checks the MTP count config.json states.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence


from . import names
from .base import ArchPlugin, Checkpoint
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .plan_tools import output_head
from .tensor_table import AttentionWidths, Hook, TensorSpec, TensorTable, expert_specs, swiglu_specs


def check_stated_count(stated: Any, k: int, where: str) -> None:
    """A count config.json states must be the one the checkpoint holds (`where` names its tensors).
    A checkpoint with none converts without MTP (ChainedHParams.missing_mtp): save_pretrained drops
    MTP weights, so a stated count alone does not mean they were ever there."""
    if stated is not None and k and stated != k:
        raise SpecconvError(f"config.json says num_nextn_predict_layers={stated}, but the checkpoint holds "
                            f"{k} MTP layer(s) ({where})")


@dataclass(kw_only=True)
class ChainedHParams(AttentionWidths, FamilyHParams):
    """The hyperparameters every chained-MTP family has, under transformers' names (each family's
    dataclass adds its own). Converting, config.json and the checkpoint's tensors give every width and
    which blocks are routed; loading a file, the graph reads a block's FFN widths and (num_experts 0)
    its expert count from its tensors: those fields are None and `block_sizes` names them per block
    ("F3", "Fe3", "X3", "Fs3"), each bound by the first tensor that has it; likewise which FFN a block
    holds (`moe_layers` None)."""

    rms_norm_eps: float
    tie_word_embeddings: bool = False  # config.json's; a file without output.weight is tied
    intermediate_size: int | str | None = None  # dense FFN width
    moe_intermediate_size: int | str | None = None  # one routed expert's width
    shared_expert_intermediate_size: int | str | None = None  # the shared expert's width
    moe_layers: frozenset[int] | None = None  # blocks with a router (the checkpoint's); None: the file's tensors
    mtp_layers_in_config: int | None = None  # the MTP count config.json states (None: none stated)
    # routing (moe_sigmoid.route): top-k weights renormalised, then scaled; sigmoid or softmax scores;
    # the experts in n_group groups of which the best topk_group are eligible
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    expert_gating_func: int = names.EXPERT_GATING_SIGMOID  # GGUF's scoring function id
    n_group: int = 1
    topk_group: int = 1
    mtp_block: int = 0  # which MTP block an MTP context runs (0..k-1; runtime/drafters/mtp.py)

    def missing_mtp(self, where: str) -> str | None:
        """Why a checkpoint converts without MTP although config.json states a count (`where`: the
        tensors it lacks)."""
        if self.mtp_layers_in_config and not self.num_nextn_predict_layers:
            return (f"config.json says num_nextn_predict_layers={self.mtp_layers_in_config}, but the checkpoint "
                    f"holds no {where} tensors")
        return None


def kv_fields(r: HParamsReader) -> dict[str, Any]:
    """The ChainedHParams fields a GGUF file states, read the same way for every chained family (each
    family's from_kv reads its own keys first). The expert count is the family's: where it is 0 the
    shapes bind each block's to its router."""
    num_hidden_layers, num_nextn_predict_layers = r.block_counts()
    gating = r.key("expert_gating_func", names.EXPERT_GATING_SIGMOID, int)
    if gating not in (names.EXPERT_GATING_SOFTMAX, names.EXPERT_GATING_SIGMOID):
        raise SpecconvError(f"{r.arch}.expert_gating_func is {gating}; supported: softmax (1), sigmoid (2)")
    return dict(arch=r.arch, num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=num_nextn_predict_layers,
                hidden_size=r.key("embedding_length", type=int), max_position_embeddings=r.key("context_length", 0, int),
                rms_norm_eps=r.key("attention.layer_norm_rms_epsilon", type=float),
                num_experts_per_tok=r.key("expert_used_count", 0, int), expert_gating_func=gating, from_file=True)


def block_sizes(hp: ChainedHParams, bid: int) -> ChainedHParams:
    """`hp` as block `bid`'s shapes read it: its own head counts, and where the file decides, its FFN
    widths and expert count named after it."""
    def own(value, name: str):
        return f"{name}{bid}" if value is None else value
    return replace(hp, num_attention_heads=hp.per_block(hp.num_attention_heads)[bid],
                   num_key_value_heads=hp.per_block(hp.num_key_value_heads)[bid],
                   intermediate_size=own(hp.intermediate_size, "F"), num_experts=own(hp.num_experts or None, "X"),
                   moe_intermediate_size=own(hp.moe_intermediate_size, "Fe"),
                   shared_expert_intermediate_size=own(hp.shared_expert_intermediate_size, "Fs"))


def block_tags(hp: ChainedHParams, bid: int) -> frozenset[str]:
    """`trunk` or `nextn` (an MTP block); `dense` or `moe`; `split_qkv` or `fused_qkv` (mimo2 writes its
    MTP blocks' q, k and v as one matrix, as llama.cpp's MTP graph reads them). Where the file decides
    (`moe_layers` None), both of each pair."""
    mtp = bid >= hp.num_hidden_layers
    tags = {"nextn" if mtp else "trunk"}
    if hp.moe_layers is None:
        return frozenset(tags | {"dense", "moe", "split_qkv", "fused_qkv"})
    return frozenset(tags | {"moe" if bid in hp.moe_layers else "dense", "fused_qkv" if mtp else "split_qkv"})


NormSpec = Callable[..., TensorSpec]


def norm_spec(transform: Callable | None = None) -> NormSpec:
    """A family's RMSNorm rows: kept F32, written through `transform` (step35's 1 + w) when given."""
    def norm(gguf: str, hf: str | None, on: str = "", dim=lambda s: (s.hidden_size,), **kw) -> TensorSpec:
        return TensorSpec(gguf, hf, dim, on, f32=True, transform=(lambda s: transform) if transform else None, **kw)
    return norm


def routed_specs(router: str, bias: str, bias_hf: str, experts_hf: str | None = None,
                 shared_hf: str | None = None, router_shapes=None, router_transform=None) -> tuple[TensorSpec, ...]:
    """A routed block's tensors: router (F32), selection bias (F32), experts (from `experts_hf`
    `{gate,up,down}_proj.weight` 3-D, else the plugin's `experts` hook) and the shared expert. All
    optional: the graph runs a block's dense or routed FFN, whichever the file holds."""
    specs = (
        TensorSpec("blk.{bid}.ffn_gate_inp.weight", router, lambda s: (s.num_experts, s.hidden_size), "moe",
                   optional=True, f32=True, hf_shape=router_shapes, transform=router_transform),
        TensorSpec(f"blk.{{bid}}.{bias}", bias_hf, lambda s: (s.num_experts,), "moe", optional=True, f32=True),
        *expert_specs(experts_hf, optional=True),
    )
    if shared_hf is None:
        return specs
    return specs + swiglu_specs(shared_hf, "moe", lambda s: s.shared_expert_intermediate_size, "_shexp", optional=True)


def head_copies(on_file: bool = False) -> tuple[TensorSpec, ...]:
    """An MTP block's own embedding and LM head: read when a file has them (llama.cpp prefers them);
    written when the checkpoint has them only where `on_file` (the plugin's `head_copies` hook)."""
    hook = "head_copies" if on_file else None
    return tuple(TensorSpec(f"blk.{{bid}}.nextn.{part}.weight", None, lambda s: (s.vocab_dim, s.hidden_size), "nextn",
                            optional=True, hook=hook)
                 for part in (names.NEXTN_EMBED_TOKENS, names.NEXTN_SHARED_HEAD_HEAD))


def chained_table(norm: NormSpec, *, head: Sequence[TensorSpec], attention: Sequence[TensorSpec],
                  ffn_norm: Sequence[TensorSpec], routed: Sequence[TensorSpec]) -> TensorTable:
    """A chained-MTP family's table: embedding, output norm and head, each MTP block's nextn inputs and
    `head`, then every block's attn_norm, `attention`, `ffn_norm`, dense SwiGLU or `routed` FFN."""
    return TensorTable((
        TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.vocab_dim, s.hidden_size)),
        norm(names.OUTPUT_NORM, "model.norm.weight"),
        TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True,
                   hook="output_head"),  # absent when tied
        # embedding half first, as in vLLM and llama.cpp
        TensorSpec("blk.{bid}.nextn.eh_proj.weight", "{p}eh_proj.weight", lambda s: (s.hidden_size, 2 * s.hidden_size),
                   "nextn"),
        norm("blk.{bid}.nextn.enorm.weight", "{p}enorm.weight", "nextn"),
        norm("blk.{bid}.nextn.hnorm.weight", "{p}hnorm.weight", "nextn"),
        *head,
        norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
        *attention,
        *ffn_norm,
        *swiglu_specs("{p}mlp.", "dense", optional=True),
        *routed,
    ), block_tags, block_sizes=block_sizes)


class ChainedMtpPlugin(ArchPlugin):
    """Builds `hp` (its family's `HParams`, from config.json and the checkpoint's tensor names);
    a family declares its `HParams`, its `table` and its `hooks()`."""

    HParams: ClassVar[type[ChainedHParams]]
    hp: ChainedHParams

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp = self.HParams.from_config(checkpoint)
        # a stated MTP count without its weights converts trunk-only, never dropping the head silently
        self.missing_mtp = self.hp.missing_mtp(self.mtp_source())

    def mtp_source(self) -> str:
        """The checkpoint tensors that hold the MTP blocks (named when config.json states blocks it lacks)."""
        return f"model.layers.{self.hp.num_hidden_layers}.*"

    def hooks(self) -> dict[str, Hook]:
        """The output head; a family adds its own (routed experts, tensors only some checkpoints have)."""
        return {"output_head": output_head}
