"""Pieces shared by the glm4moe and deepseek2 graphs (docs/reference/model-math.md §3.2, §7.1).

* `MoeKV`: the hyperparameters both read the same way from GGUF metadata.
* `sigmoid_group_moe`: sigmoid router, correction bias for selection only, group-limited top-k,
  un-biased weights (optionally renormalised) times the routed scale, plus un-gated shared experts.
* `ffn`: dense SwiGLU for blocks < leading_dense_block_count, that MoE otherwise (the tensor lists
  of glm4moe / deepseek2 / DSA are their tables': archs/nextn_moe.py).
* `NEXTN_REQUIRED` / `NEXTN_OPTIONAL`: the chained-MTP families' head tensors (runtime/graphs/chained.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.hparams import FamilyHParams
from specconv.archs.nextn_moe import Sizes
from specconv.runtime.backend import Experts
from specconv.archs.hparams import HParamsReader
from specconv.runtime.graphs.ops import acc, linear, moe, swiglu
from specconv.runtime.validate import check_kv

GATING_SOFTMAX = 1
GATING_SIGMOID = 2


@dataclass(kw_only=True)
class MoeKV(FamilyHParams):
    arch: str
    num_hidden_layers: int
    num_nextn_predict_layers: int
    hidden_size: int
    num_attention_heads: int
    eps: float
    rope_base: float
    n_ff: int
    num_experts: int
    num_experts_per_tok: int
    n_ff_exp: int
    n_expert_shared: int
    n_dense_lead: int
    n_group: int
    n_group_used: int
    weights_scale: float
    weights_norm: bool
    gating: int = GATING_SIGMOID

    @classmethod
    def read(cls, kv: Mapping[str, Any]) -> "MoeKV":
        check_kv(kv)  # types and ranges first: nothing below divides by 0 or compares a str
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        block_count = key("block_count", type=int)
        num_nextn_predict_layers = key("nextn_predict_layers", 0, int)
        if num_nextn_predict_layers > block_count:
            raise SpecconvError(f"{arch}.nextn_predict_layers ({num_nextn_predict_layers}) exceeds block_count ({block_count})")
        # A missing key means what it means to llama.cpp: sigmoid for glm4moe, softmax for deepseek2
        # (except its GLM-4.7-Flash special case), which is wrong for DeepSeek-V3 but is what files
        # from llama.cpp's converter say (docs/reference/gguf-layout.md §7.5); the runtime runs the file as written.
        lite_glm = key("vocab_size", 0, int) == 154880 and block_count - num_nextn_predict_layers in (47, 48)
        default = GATING_SIGMOID if arch == "glm4moe" or lite_glm else GATING_SOFTMAX
        gating = key("expert_gating_func", default, int)
        if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
            raise SpecconvError(f"{arch}.expert_gating_func is {gating}; supported: softmax (1), sigmoid (2)")
        m = cls(
            arch=arch, num_hidden_layers=block_count - num_nextn_predict_layers, num_nextn_predict_layers=num_nextn_predict_layers, hidden_size=key("embedding_length", type=int),
            num_attention_heads=key("attention.head_count", type=int), eps=key("attention.layer_norm_rms_epsilon", type=float),
            rope_base=key("rope.freq_base", 10000.0, float), n_ff=key("feed_forward_length", 0, int),
            num_experts=key("expert_count", type=int), num_experts_per_tok=key("expert_used_count", type=int),
            n_ff_exp=key("expert_feed_forward_length", type=int), n_expert_shared=key("expert_shared_count", 0, int),
            n_dense_lead=key("leading_dense_block_count", 0, int), n_group=key("expert_group_count", 1, int) or 1,
            n_group_used=key("expert_group_used_count", 1, int) or 1,
            weights_scale=key("expert_weights_scale", 1.0, float) or 1.0,
            weights_norm=key("expert_weights_norm", False, bool), gating=gating,
        )
        if m.n_group > 1 and (m.num_experts % m.n_group or not 0 < m.n_group_used < m.n_group):
            raise SpecconvError(f"{arch}: {m.n_group} expert groups ({m.n_group_used} used) do not fit "
                                f"{m.num_experts} experts")
        if m.n_dense_lead > block_count:
            raise SpecconvError(f"{arch}.leading_dense_block_count {m.n_dense_lead} exceeds block_count {block_count}")
        if m.num_experts < 1:
            raise SpecconvError(f"{arch}: expert_used_count {m.num_experts_per_tok} must be within 1..expert_count "
                                f"{m.num_experts}")
        if m.n_group > 1 and (m.num_experts // m.n_group < 2
                              or m.num_experts_per_tok > m.n_group_used * (m.num_experts // m.n_group)):
            raise SpecconvError(f"{arch}: {m.n_group} expert groups ({m.n_group_used} used) of {m.num_experts} experts "
                                f"cannot give {m.num_experts_per_tok} experts (and need 2 per group)")
        return m

    def table_sizes(self, **attention: Any) -> Sizes:
        """The sizes of the family's tensor table (archs/nextn_moe.py); `attention`: its attention fields."""
        return Sizes(num_hidden_layers=self.num_hidden_layers, E=self.hidden_size, V="V", num_attention_heads=self.num_attention_heads, ffn=self.n_ff,
                     num_experts=self.num_experts, expert_ffn=self.n_ff_exp, n_shared=self.n_expert_shared,
                     first_dense=self.n_dense_lead, **attention)


def is_moe_block(hp, i: int) -> bool:
    return i >= hp.n_dense_lead


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, hp) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k], chosen experts [n, k]) of the sigmoid (or softmax), group-limited router."""
    xf = acc(x)
    logits = linear(xf, router)
    scores = torch.sigmoid(logits) if hp.gating == GATING_SIGMOID else torch.softmax(logits, dim=-1)
    choice = scores + bias.to(xf.dtype)  # the correction bias steers selection only
    if hp.n_group > 1:
        n, E = choice.shape
        grouped = choice.view(n, hp.n_group, E // hp.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # sum of each group's two best
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(hp.n_group_used, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // hp.n_group, dim=1), float("-inf"))
    chosen = choice.topk(hp.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, chosen)
    if hp.weights_norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * hp.weights_scale, chosen


def sigmoid_group_moe(w, hp, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    weights, chosen = route(x, w[p + "ffn_gate_inp.weight"], w[p + "exp_probs_b.bias"], hp)
    experts = Experts(*(w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")), swiglu)
    out = moe(x, weights, chosen, experts)
    if hp.n_expert_shared:
        out = out + acc(swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                               w[p + "ffn_down_shexp.weight"]))
    return out.to(x.dtype)


def ffn(w, hp, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    if not is_moe_block(hp, i):
        return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    return sigmoid_group_moe(w, hp, i, x)


def keep_float32(name: str) -> bool:
    """Norms, biases and the router stay float32 whatever the compute dtype (they are F32 in GGUF)."""
    return name.endswith("norm.weight") or name.endswith(".bias") or "ffn_gate_inp" in name


# ---- the MTP head's ends (docs/reference/model-math.md §7.1) --------------------------------------------------

NEXTN_REQUIRED = ("eh_proj", "enorm", "hnorm")
NEXTN_OPTIONAL = ("shared_head_norm", "embed_tokens", "shared_head_head")
