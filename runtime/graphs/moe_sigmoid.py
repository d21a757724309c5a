"""The FFN of the glm4moe, deepseek2 and DSA graphs (docs/reference/model-math.md §3.2, §7.1); their
hyperparameters are archs/nextn_moe_hparams.py `NextnMoeHParams`, their tensor lists their tables'.

* `route`: sigmoid (or softmax) router, correction bias for selection only, group-limited top-k,
  un-biased weights (optionally renormalised) times the routed scale (the backend's
  `route_grouped`), with the settings of these graphs' hparams and the chained-MTP graphs'
  (runtime/graphs/chained.py).
* `sigmoid_group_moe`: the routed experts plus un-gated shared experts (ops.moe_out).
* `ffn`: dense SwiGLU for the leading dense blocks, that MoE otherwise.
"""

from __future__ import annotations

import torch

from specconv.archs.nextn_moe_hparams import NextnMoeHParams
from specconv.runtime.backend import Experts, for_device
from specconv.runtime.graphs.ops import Deferred, deferred_swiglu, linear_wide, moe_out, swiglu


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, hp) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k], chosen experts [n, k]) of the router `router` (float32 [E, H]) on x: the
    backend's `route_grouped` (sigmoid or softmax scores, the correction bias for selection only, the
    `topk_group` best of `n_group` expert groups, un-biased weights renormalised when asked, times the
    routed scale; one launch on CUDA) with the settings of a family's hparams (the nextn families',
    the chained-MTP families'), which share transformers' names for them."""
    return for_device(x.device).route_grouped(linear_wide(x, router), hp.num_experts_per_tok, hp.expert_gating_func,
                                              bias, hp.n_group, hp.topk_group, hp.norm_topk_prob,
                                              hp.routed_scaling_factor)


def sigmoid_group_moe(w, hp: NextnMoeHParams, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    weights, chosen = route(x, w[p + "ffn_gate_inp.weight"], w[p + "exp_probs_b.bias"], hp)
    experts = Experts(*(w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")), swiglu)
    shared = (swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
              if hp.n_shared_experts else None)
    return moe_out(x, weights, chosen, experts, shared)


def ffn(w, hp: NextnMoeHParams, i: int, x: torch.Tensor) -> torch.Tensor | Deferred:
    """A dense SwiGLU (its down product Deferred: made with the add and norm after it) or the MoE block."""
    p = f"blk.{i}."
    if not hp.is_moe_block(i):
        return deferred_swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    return sigmoid_group_moe(w, hp, i, x)
