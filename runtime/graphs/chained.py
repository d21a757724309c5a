"""Pieces the chained-MTP graphs share (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

Each of those graphs keeps what is its own (attention, rope; its hyperparameters are its family's
dataclass, archs/<family>.py); the rest is written once here: the tensor lists from the family's
table (trunk blocks, then k MTP blocks with their nextn inputs) and the checks of which FFN a block
holds, the KV-cache layouts, which MTP block a context runs (`hp.mtp_block`), a windowed attention
with optional sinks, the dense-or-routed SwiGLU FFN, the pre-norm residual block, and the trunk / MTP
forwards through decoder.py (so multi-device placement comes with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.tensor_table import GraphTensors, TensorTable
from specconv.runtime.backend import Experts
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import forward_nextn, forward_trunk
from specconv.runtime.graphs.ops import acc, by_rows, moe, rms_norm, swiglu
from specconv.runtime.memory import Batch, MemoryLayout


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


def _layout(layers: list[int], num_key_value_heads: int | list[int], width: int) -> MemoryLayout:
    if isinstance(num_key_value_heads, list):  # KV heads per block: each layer's cells get their own shape
        return MemoryLayout(attn_layers=layers, num_key_value_heads=num_key_value_heads[layers[0] if layers else 0], head_dim=width,
                            rec_layers=[], layer_shapes={i: (num_key_value_heads[i], width) for i in layers})
    return MemoryLayout(attn_layers=layers, num_key_value_heads=num_key_value_heads, head_dim=width, rec_layers=[])


@dataclass(frozen=True)
class Layouts:
    """The KV-cache layouts of a graph whose cells are `width(hp)` wide."""
    width: Callable[[Any], int]

    def main_layout(self, hp, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
        return _layout(list(range(hp.num_hidden_layers)), hp.num_key_value_heads, self.width(hp))

    def mtp_layout(self, hp) -> MemoryLayout:
        return _layout([mtp_block_id(hp)], hp.num_key_value_heads, self.width(hp))


# ---- compute ------------------------------------------------------------------------------------------------

def attend(q, k, v, q_pos, k_pos, scale: float, window: int, sinks=None) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v with GQA; a key is visible iff 0 ≤ q_pos - k_pos (< window when window > 0).
    `sinks` [heads]: one more logit per head whose probability mass is dropped (attention sinks).
    In batch-invariant mode each query row alone (k, v: the whole buffer of ops.attended_kv)."""
    return by_rows(q.shape[0], lambda r: _attend(q[r], k, v, q_pos[r], k_pos, scale, window, sinks))


def _attend(q, k, v, q_pos, k_pos, scale: float, window: int, sinks) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", acc(q), acc(k)) * scale
    dist = q_pos[:, None] - k_pos[None, :]
    visible = (dist >= 0) & (dist < window) if window > 0 else dist >= 0
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnt,thd->nhd", probs, acc(v)).to(q.dtype)


def ffn(w, hp, i: int, x: torch.Tensor, bias: str, dense=swiglu, expert=swiglu, shared: bool = True) -> torch.Tensor:
    """A dense SwiGLU (blocks without `ffn_gate_inp`) or the routed experts (ms.route, selection bias
    `blk.i.<bias>`) plus, when `shared`, the always-on shared expert. `dense(x, gate, up, down)` runs the
    dense and shared SwiGLUs, `expert(...)` each routed one (step35 clamps them differently)."""
    p = f"blk.{i}."
    if p + "ffn_gate_inp.weight" not in w:
        if p + "ffn_gate.weight" not in w:
            raise SpecconvError(f"{hp.arch}: block {i} has neither a router (ffn_gate_inp) nor a dense FFN (ffn_gate)")
        return dense(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    weights, chosen = ms.route(x, w[p + "ffn_gate_inp.weight"], w[p + bias], hp)
    out = moe(x, weights, chosen, Experts(*(w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")), expert))
    if shared:
        out = out + acc(dense(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                              w[p + "ffn_down_shexp.weight"]))
    return out.to(x.dtype)


# attention(w, hp, i, a, batch, rope) / ffn(w, hp, i, x): a graph's own halves of a block
Attention = Callable[..., torch.Tensor]
Ffn = Callable[..., torch.Tensor]


def block(w, hp, i: int, h: torch.Tensor, batch: Batch, rope, attention: Attention, ffn_: Ffn) -> torch.Tensor:
    """Pre-norm residual block: h + attention(attn_norm(h)), then + ffn(ffn_norm(h))."""
    h = h + attention(w, hp, i, rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.rms_norm_eps), batch, rope)
    return h + ffn_(w, hp, i, rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], hp.rms_norm_eps))


@dataclass(frozen=True)
class Forwards:
    """The trunk and MTP forwards of a graph made of `block`s; `make_rope(hp, batch)(dtype)` builds its
    rope tables. The MTP forward runs block `hp.mtp_block` through decoder.forward_nextn:
    (logits, z = shared_head_norm(y), y = the block's pre-norm output)."""
    make_rope: Callable[[Any, Batch], Callable]
    attention: Attention
    ffn: Ffn

    def _block(self, w, hp, batch: Batch):
        return lambda i, h, rope: block(w, hp, i, h, batch, rope, self.attention, self.ffn)

    def forward_main(self, w, hp, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                     want_logits: torch.Tensor | None):
        """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
        return forward_trunk(w, hp.num_hidden_layers, hp.rms_norm_eps, tokens, want_layers, want_logits,
                             self.make_rope(hp, batch), self._block(w, hp, batch))

    def forward_mtp(self, w, hp, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
        return forward_nextn(w, mtp_block_id(hp), hp.rms_norm_eps, tokens, hidden_in, self.make_rope(hp, batch),
                             self._block(w, hp, batch))


def graph(name: str, HParams: type, tensors: GraphTensors, layouts: Layouts, forwards: Forwards,
          **family) -> Graph:
    """The Graph of a chained-MTP family: its lists, layouts and forwards, and what every chained graph
    declares (the release's shifted MTP rows, k blocks drafting positions 1..k, blocks placed over
    devices, captured decode steps); `family` holds the rest (keep_float32, check_hparams,
    check_values, CHAIN_HIDDEN, TARGET_HIDDEN, or a forward_mtp of its own)."""
    return Graph(**{
        "name": name, "HParams": HParams, "CAPTURABLE": True,
        "main_tensors": tensors.main_tensors, "mtp_tensors": tensors.mtp_tensors,
        "optional_mtp_tensors": tensors.optional_mtp_tensors, "OPTIONAL": tensors.OPTIONAL,
        "optional_main_tensors": tensors.optional_main_tensors, "expected_shapes": tensors.expected_shapes,
        "main_layout": layouts.main_layout, "mtp_layout": layouts.mtp_layout,
        "forward_main": forwards.forward_main, "forward_mtp": forwards.forward_mtp,
        "MULTI_DEVICE": True,  # runs through decoder.forward_trunk / forward_nextn
        "CHAINED_MTP": True,  # block i drafts position i (runtime/drafters/mtp.py)
        # the release's rows: from (x_1, h_0), no zero-state row (docs/reference/model-math.md §12)
        "MTP_ROWS": "shifted",
        **family})
