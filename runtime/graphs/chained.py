"""Pieces the chained-MTP graphs share (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

Each of those graphs keeps what is its own (attention, rope; its hyperparameters are its family's
dataclass, archs/<family>.py); the rest is written once here: the tensor lists from the family's
table (trunk blocks, then k MTP blocks with their nextn inputs) and the checks of which FFN a block
holds, the KV-cache layouts, which MTP block a context runs (`hp.mtp_block`), the dense-or-routed
SwiGLU FFN, and the forwards and Graph through trunk.py (pre-norm residual blocks run by decoder.py,
so multi-device placement comes with them). Their windowed attention with optional sinks is the
backend's (ops.attend_cells).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.tensor_table import GraphTensors, TensorTable
from specconv.runtime.backend import Experts
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.ops import Deferred, deferred_swiglu, made, moe_out, swiglu


# ---- tensors and caches -------------------------------------------------------------------------------------

def tensor_lists(table: TensorTable) -> GraphTensors:
    """A chained-MTP graph's lists from its family's table (archs/chained_mtp.py), whose shapes read the
    family's hparams as they are: the trunk blocks, then every MTP block with its nextn inputs and head;
    a block's dense or routed FFN, whichever the file holds."""
    return GraphTensors(table, _as_is, chained=True)


def _as_is(hp):
    return hp


def check_ffn(file, hp, needed: list[str], bias: str, shared: bool) -> None:
    """Each block the graph runs holds a whole dense FFN or a whole routed one (with shared expert), and
    its routing fits its experts."""
    have = set(needed)
    for i in range(hp.num_hidden_layers + hp.num_nextn_predict_layers):
        p = f"blk.{i}."
        if p + "attn_norm.weight" not in have:
            continue  # a block this graph type does not run
        if p + "ffn_gate_inp.weight" in have:
            want = [p + n for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", bias)]
            if shared:
                want += [p + f"ffn_{n}_shexp.weight" for n in ("gate", "up", "down")]
            missing = [n for n in want if n not in have]
            if missing:
                raise SpecconvError(f"missing tensor {missing[0]} (block {i} has a router, ffn_gate_inp)")
            check_routing(hp, int(file.tensors[p + "ffn_gate_inp.weight"].shape[-1]), f"block {i}")
        else:
            missing = [p + f"ffn_{n}.weight" for n in ("gate", "up", "down") if p + f"ffn_{n}.weight" not in have]
            if missing:
                raise SpecconvError(f"missing tensor {missing[0]} (block {i} has no router, so a dense FFN)")


def check_routing(hp, X: int, where: str) -> None:
    used, groups, groups_used = hp.num_experts_per_tok, hp.n_group, hp.topk_group
    if not 1 <= used <= X:
        raise SpecconvError(f"{hp.arch}.expert_used_count {used} must be within 1..{X} (the experts of {where})")
    if groups > 1 and (X % groups or X // groups < 2 or not 1 <= groups_used <= groups
                       or used > groups_used * (X // groups)):
        raise SpecconvError(f"{hp.arch}: {groups} expert groups ({groups_used} used) of the {X} experts of {where} "
                            f"cannot give {used} experts (groups must divide them, 2 or more each)")


def mtp_block_id(hp) -> int:
    """The block an MTP context runs: n_layer + hp.mtp_block (runtime/drafters/mtp.py sets mtp_block)."""
    if not 0 <= hp.mtp_block < max(hp.num_nextn_predict_layers, 1):
        raise SpecconvError(f"{hp.arch}: MTP block {hp.mtp_block} out of range (the file has {hp.num_nextn_predict_layers})")
    return hp.num_hidden_layers + hp.mtp_block


def layouts(width: Callable[[Any], int]) -> trunk.Layouts:
    """The KV-cache layouts of a chained graph whose cells are `width(hp)` wide: the trunk's blocks, and
    the MTP block a context runs (KV heads per block where the file gives them per block)."""
    return trunk.Layouts(width, mtp_block_id)


# ---- compute ------------------------------------------------------------------------------------------------

def ffn(w, hp, i: int, x: torch.Tensor, bias: str, dense=deferred_swiglu, expert=swiglu,
        shared: bool = True) -> torch.Tensor | Deferred:
    """A dense SwiGLU (blocks without `ffn_gate_inp`) or the routed experts (ms.route, selection bias
    `blk.i.<bias>`) plus, when `shared`, the always-on shared expert. `dense(x, gate, up, down)` runs the
    dense and shared SwiGLUs, `expert(...)` each routed one (step35 clamps them differently); a dense
    block's output may stay a Deferred product (made with the add and norm after it)."""
    p = f"blk.{i}."
    if p + "ffn_gate_inp.weight" not in w:
        if p + "ffn_gate.weight" not in w:
            raise SpecconvError(f"{hp.arch}: block {i} has neither a router (ffn_gate_inp) nor a dense FFN (ffn_gate)")
        return dense(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    weights, chosen = ms.route(x, w[p + "ffn_gate_inp.weight"], w[p + bias], hp)
    experts = Experts(*(w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")), expert)
    always_on = made(dense(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                           w[p + "ffn_down_shexp.weight"])) if shared else None
    return moe_out(x, weights, chosen, experts, always_on)


def forwards(rope: trunk.RopeOf, attention: trunk.Attention, ffn_: trunk.Ffn) -> trunk.Trunk:
    """The forwards of a chained graph made of pre-norm residual blocks; its MTP forward runs block
    `hp.mtp_block` (decoder.forward_nextn: (logits, z = shared_head_norm(y), y = pre-norm output))."""
    return trunk.Trunk(rope, trunk.prenorm(attention, ffn_), mtp_block=mtp_block_id)


def graph(name: str, HParams: type, tensors: GraphTensors, layouts_: trunk.Layouts, forwards_: trunk.Trunk,
          **family) -> Graph:
    """The Graph of a chained-MTP family (trunk.graph) with what every chained graph declares (the
    release's shifted MTP rows, k blocks drafting positions 1..k); `family` holds the rest
    (check_hparams, check_values, CHAIN_HIDDEN, TARGET_HIDDEN, or a forward_mtp of its own)."""
    return trunk.graph(name, HParams, tensors, layouts_.main_layout, layouts_.mtp_layout, forwards_, **{
        "CHAINED_MTP": True,  # block i drafts position i (runtime/drafters/mtp.py)
        # the release's rows: from (x_1, h_0), no zero-state row (docs/reference/model-math.md §12)
        "MTP_ROWS": "shifted",
        **family})
