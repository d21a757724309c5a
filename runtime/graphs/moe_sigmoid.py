"""The FFN of the glm4moe, deepseek2 and DSA graphs (docs/reference/model-math.md §3.2, §7.1); their
hyperparameters are archs/nextn_moe_hparams.py `NextnMoeHParams`, their tensor lists their tables'.

* `select_experts`: sigmoid (or softmax) router, correction bias for selection only, group-limited
  top-k, un-biased weights (optionally renormalised) times the routed scale; `route` reads these
  settings off the chained-MTP graphs' hparams (runtime/graphs/chained.py).
* `sigmoid_group_moe`: the routed experts plus un-gated shared experts.
* `ffn`: dense SwiGLU for the leading dense blocks, that MoE otherwise.
"""

from __future__ import annotations

import torch

from specconv.archs import names
from specconv.archs.nextn_moe_hparams import NextnMoeHParams
from specconv.runtime.backend import Experts
from specconv.runtime.graphs.ops import acc, linear, moe, swiglu

GATING_SOFTMAX = names.EXPERT_GATING_SOFTMAX
GATING_SIGMOID = names.EXPERT_GATING_SIGMOID


def select_experts(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int | None,
                   groups_used: int | None, renormalise: bool, scale: float,
                   gating: int = GATING_SIGMOID) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, top_k], chosen experts [n, top_k]): the `top_k` best experts by router score plus
    correction bias, from the `groups_used` best of `groups` expert groups (a group scores its two
    best); weights are the un-biased scores, renormalised to sum 1 when asked, times `scale`."""
    xf = acc(x)
    logits = linear(xf, router)
    scores = torch.sigmoid(logits) if gating == GATING_SIGMOID else torch.softmax(logits, dim=-1)
    choice = scores + bias.to(xf.dtype)  # the correction bias steers selection only
    if groups is not None and groups > 1:
        n, E = choice.shape
        grouped = choice.view(n, groups, E // groups)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # sum of each group's two best
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(groups_used, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // groups, dim=1), float("-inf"))
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, chosen


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, hp) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` with the routing settings of a family's hparams (the nextn families', the
    chained-MTP families'), which share transformers' names for them."""
    return select_experts(x, router, bias, hp.num_experts_per_tok, hp.n_group, hp.topk_group, hp.norm_topk_prob,
                          hp.routed_scaling_factor, hp.expert_gating_func)


def sigmoid_group_moe(w, hp: NextnMoeHParams, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    weights, chosen = route(x, w[p + "ffn_gate_inp.weight"], w[p + "exp_probs_b.bias"], hp)
    experts = Experts(*(w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")), swiglu)
    out = moe(x, weights, chosen, experts)
    if hp.n_shared_experts:
        out = out + acc(swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                               w[p + "ffn_down_shexp.weight"]))
    return out.to(x.dtype)


def ffn(w, hp: NextnMoeHParams, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    if not hp.is_moe_block(i):
        return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    return sigmoid_group_moe(w, hp, i, x)
