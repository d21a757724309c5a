"""What the chained-MTP plugins share (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

Their checkpoints hold k MTP blocks after the N trunk layers, each with `eh_proj / enorm / hnorm`
and a full decoder block, written as GGUF blocks N..N+k-1. `chained_table` is a family's tensor
table (archs/tensor_table.py): nextn inputs and head, attn_norm, attention, ffn_norm, dense or routed
FFN, the family giving its own attention, MTP head and routed rows; `ChainedMtpPlugin` plans it over
the N + k blocks (the graphs, runtime/graphs/chained.py, derive their lists from the same table);
`check_stated_count` checks the MTP count config.json states.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence


from . import names
from .base import ArchPlugin, Role, TensorPlan
from .errors import SpecconvError
from .plan_tools import RolePlan, add_output_head, embedding_rows
from .tensor_table import AttentionWidths, Block, Hook, TensorSpec, TensorTable


def check_stated_count(plugin: ArchPlugin, stated: Any, k: int, where: str, missing: str | None = None) -> None:
    """A count config.json states must be the one the checkpoint holds (`where` names its tensors).
    A checkpoint with none converts without MTP (`missing`: the reason, when given): save_pretrained
    drops MTP weights, so a stated count alone does not mean they were ever there."""
    if stated is not None and k and stated != k:
        raise SpecconvError(f"config.json says num_nextn_predict_layers={stated}, but the checkpoint holds "
                            f"{k} MTP layer(s) ({where})")
    if missing and stated and not k:
        plugin.missing_mtp = (f"config.json says num_nextn_predict_layers={stated}, but the checkpoint holds no "
                              f"{missing} tensors")


@dataclass(frozen=True)
class Sizes(AttentionWidths):
    """The dimensions of a chained-MTP table: the plugin's from config.json, the graph's from GGUF
    metadata (V = "V"). The graphs read a block's FFN widths and expert count from its tensors, so in
    the graph's sizes they are None and `block_sizes` names them per block ("F3", "Fe3", "X3", "Fs3"),
    each bound by the first tensor that has it; likewise which FFN a block holds (`moe_layers` None)."""

    num_hidden_layers: int  # trunk blocks; the k MTP blocks follow
    E: int  # hidden size
    V: int | str  # vocabulary
    heads: tuple[int, ...]  # query heads per block
    kv_heads: tuple[int, ...]  # KV heads per block
    head_dim: int
    v_head_dim: int = 0  # 0: head_dim
    moe_layers: frozenset[int] | None = None  # blocks with routed experts; None: the file decides
    ffn: int | str | None = None  # dense FFN width
    num_experts: int | str | None = None
    expert_ffn: int | str | None = None
    shared_ffn: int | str | None = None
    num_attention_heads: int = 0  # of one block (block_sizes)
    num_key_value_heads: int = 0

    @property
    def v(self) -> int:
        return self.num_key_value_heads * (self.v_head_dim or self.head_dim)

    @property
    def o(self) -> int:
        return self.num_attention_heads * (self.v_head_dim or self.head_dim)


def block_sizes(s: Sizes, bid: int) -> Sizes:
    def own(value, name: str):
        return f"{name}{bid}" if value is None else value
    return replace(s, num_attention_heads=s.heads[bid], num_key_value_heads=s.kv_heads[bid], ffn=own(s.ffn, "F"),
                   num_experts=own(s.num_experts, "X"), expert_ffn=own(s.expert_ffn, "Fe"), shared_ffn=own(s.shared_ffn, "Fs"))


def block_tags(s: Sizes, bid: int) -> frozenset[str]:
    """`trunk` or `nextn` (an MTP block); `dense` or `moe`; `split_qkv` or `fused_qkv` (mimo2 writes its
    MTP blocks' q, k and v as one matrix, as llama.cpp's MTP graph reads them). Where the file decides
    (the runtime's sizes, `moe_layers` None), both of each pair."""
    mtp = bid >= s.num_hidden_layers
    tags = {"nextn" if mtp else "trunk"}
    if s.moe_layers is None:
        return frozenset(tags | {"dense", "moe", "split_qkv", "fused_qkv"})
    return frozenset(tags | {"moe" if bid in s.moe_layers else "dense", "fused_qkv" if mtp else "split_qkv"})


NormSpec = Callable[..., TensorSpec]


def norm_spec(transform: Callable | None = None) -> NormSpec:
    """A family's RMSNorm rows: kept F32, written through `transform` (step35's 1 + w) when given."""
    def norm(gguf: str, hf: str | None, on: str = "", dim=lambda s: (s.E,), **kw) -> TensorSpec:
        return TensorSpec(gguf, hf, dim, on, f32=True, transform=(lambda s: transform) if transform else None, **kw)
    return norm


def routed_specs(router: str, bias: str, bias_hf: str, experts_hf: str | None = None,
                 shared_hf: str | None = None, router_shapes=None, router_transform=None) -> tuple[TensorSpec, ...]:
    """A routed block's tensors: router (F32), selection bias (F32), experts (from `experts_hf`
    `{gate,up,down}_proj.weight` 3-D, else the plugin's `experts` hook) and the shared expert. All
    optional: the graph runs a block's dense or routed FFN, whichever the file holds."""
    def experts(part: str, shape) -> TensorSpec:
        hf = f"{experts_hf}{part}_proj.weight" if experts_hf else None
        return TensorSpec(f"blk.{{bid}}.ffn_{part}_exps.weight", hf, shape, "moe", optional=True,
                          hook=None if experts_hf else "experts")
    specs = (
        TensorSpec("blk.{bid}.ffn_gate_inp.weight", router, lambda s: (s.num_experts, s.E), "moe", optional=True,
                   f32=True, hf_shape=router_shapes, transform=router_transform),
        TensorSpec(f"blk.{{bid}}.{bias}", bias_hf, lambda s: (s.num_experts,), "moe", optional=True, f32=True),
        experts("gate", lambda s: (s.num_experts, s.expert_ffn, s.E)),
        experts("up", lambda s: (s.num_experts, s.expert_ffn, s.E)),
        experts("down", lambda s: (s.num_experts, s.E, s.expert_ffn)),
    )
    if shared_hf is None:
        return specs
    return specs + (
        TensorSpec("blk.{bid}.ffn_gate_shexp.weight", shared_hf + "gate_proj.weight", lambda s: (s.shared_ffn, s.E),
                   "moe", optional=True),
        TensorSpec("blk.{bid}.ffn_up_shexp.weight", shared_hf + "up_proj.weight", lambda s: (s.shared_ffn, s.E),
                   "moe", optional=True),
        TensorSpec("blk.{bid}.ffn_down_shexp.weight", shared_hf + "down_proj.weight", lambda s: (s.E, s.shared_ffn),
                   "moe", optional=True),
    )


def head_copies(on_file: bool = False) -> tuple[TensorSpec, ...]:
    """An MTP block's own embedding and LM head: read when a file has them (llama.cpp prefers them);
    written when the checkpoint has them only where `on_file` (the plugin's `head_copies` hook)."""
    hook = "head_copies" if on_file else None
    return tuple(TensorSpec(f"blk.{{bid}}.nextn.{part}.weight", None, lambda s: (s.V, s.E), "nextn", optional=True,
                            hook=hook)
                 for part in (names.NEXTN_EMBED_TOKENS, names.NEXTN_SHARED_HEAD_HEAD))


def chained_table(norm: NormSpec, *, head: Sequence[TensorSpec], attention: Sequence[TensorSpec],
                  ffn_norm: Sequence[TensorSpec], routed: Sequence[TensorSpec]) -> TensorTable:
    """A chained-MTP family's table: embedding, output norm and head, each MTP block's nextn inputs and
    `head`, then every block's attn_norm, `attention`, `ffn_norm`, dense SwiGLU or `routed` FFN."""
    return TensorTable((
        TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.V, s.E)),
        norm(names.OUTPUT_NORM, "model.norm.weight"),
        TensorSpec(names.OUTPUT, None, lambda s: (s.V, s.E), optional=True, hook="output_head"),  # absent when tied
        # embedding half first, as in vLLM and llama.cpp
        TensorSpec("blk.{bid}.nextn.eh_proj.weight", "{p}eh_proj.weight", lambda s: (s.E, 2 * s.E), "nextn"),
        norm("blk.{bid}.nextn.enorm.weight", "{p}enorm.weight", "nextn"),
        norm("blk.{bid}.nextn.hnorm.weight", "{p}hnorm.weight", "nextn"),
        *head,
        norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
        *attention,
        *ffn_norm,
        TensorSpec("blk.{bid}.ffn_gate.weight", "{p}mlp.gate_proj.weight", lambda s: (s.ffn, s.E), "dense",
                   optional=True),
        TensorSpec("blk.{bid}.ffn_up.weight", "{p}mlp.up_proj.weight", lambda s: (s.ffn, s.E), "dense", optional=True),
        TensorSpec("blk.{bid}.ffn_down.weight", "{p}mlp.down_proj.weight", lambda s: (s.E, s.ffn), "dense",
                   optional=True),
        *routed,
    ), block_tags, block_sizes=block_sizes)


class ChainedMtpPlugin(ArchPlugin):
    """Sets in __init__: n, k, hidden, vocab, tied, moe_layers (block ids with a router); declares its
    `table`, `sizes()` and `hooks()`."""

    n: int
    k: int
    hidden: int
    vocab: int
    tied: bool
    moe_layers: set[int]

    @property
    def n_trunk_layers(self) -> int:
        return self.n

    @property
    def n_mtp_layers(self) -> int:
        return self.k

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable]

    def sizes(self) -> Sizes:
        """The table's sizes from the plugin's config (each family's own fields)."""
        raise NotImplementedError

    def hooks(self) -> dict[str, Hook]:
        """The family's hooks besides the output head (routed experts, tensors only some checkpoints have)."""
        return {}

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        blocks = [Block(i, self._prefix(i), Role.TRUNK if i < self.n else Role.MTP) for i in range(self.n + self.k)]
        self.table.plan(plan, self.sizes(), blocks, {"output_head": self._output_head, **self.hooks()})
        return plan.finish(self.gguf_arch)

    def _output_head(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        add_output_head(plan, self.tied, s.V, s.E)

    def _prefix(self, i: int) -> str:
        """The checkpoint prefix of GGUF block i (MTP blocks follow the trunk's numbering by default)."""
        return f"model.layers.{i}."

