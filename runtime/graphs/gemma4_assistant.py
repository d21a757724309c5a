"""The Gemma 4 assistant drafter (GGUF arch `gemma4-assistant`), docs/reference/model-math.md §8.

Served as GraphType.MTP: rows (token t, target post-norm hidden h) at the draft position P. It has
no memory of its own: every layer attends to the target context's K/V (`Context(..., kv_from=
target_ctx)`), sliding layers to the last K/V-owning sliding layer of the target and full layers to
the last full one (llama.cpp's n_layer−2 / n_layer−1 in the release layout), keys visible iff
0 ≤ P − s (and P − s < W on sliding layers).

    x = pre_projection · [E_target[t]·√Hb ; h]
    per layer: q-only attention (q_norm, rope at P, scale 1) + post_attention_norm, GeGLU with its
               sandwich norms, × layer_output_scale
    y = output_norm(x); logits = token_embd_assistant · y (tied, no soft-capping)
    h_next = post_projection · y                      (fed back as h for the next draft)
"""

from __future__ import annotations

import math

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.archs.gemma4 import ASSISTANT_TABLE
from specconv.archs.gemma4_hparams import Gemma4AssistantHParams
from specconv.runtime.graphs import draft_head, gemma4
from specconv.runtime.graphs.ops import acc, acc_dtype, linear, rms_norm
from specconv.runtime.memory import Batch, MemoryLayout

TARGET_EMBD = "target.token_embd.weight"  # the target's input embedding, taken at load time
TABLE = ASSISTANT_TABLE  # archs/gemma4.py; every tensor read by the MTP graph
_tensors = draft_head.HeadTensors(TABLE, lambda hp: range(hp.num_nextn_predict_layers))


def mtp_layout(hp) -> MemoryLayout:
    return MemoryLayout(attn_layers=[], num_key_value_heads=hp.num_key_value_heads[0], head_dim=hp.head_dim[0], rec_layers=[])


def target_layer_for(target_hp, sliding: bool) -> int:
    """The target layer whose K/V an assistant layer of this type reads."""
    layer = target_hp.store.get(sliding)
    if layer is None:
        kind = "sliding" if sliding else "full"
        raise SpecconvError(f"the target has no K/V-owning {kind}-attention layer for the assistant to read")
    return layer


def check_fits_target(hp, target_hp) -> None:
    """One-line SpecconvError unless every assistant layer can read its target layer's K/V."""
    if hp.backbone_hidden_size != target_hp.hidden_size:
        raise SpecconvError(f"the assistant reads target hidden states of width {hp.backbone_hidden_size}, the "
                            f"target's are {target_hp.hidden_size}")
    for i in range(hp.num_nextn_predict_layers):
        t = target_layer_for(target_hp, hp.is_sliding(i))
        if (hp.head_dim[i], hp.num_key_value_heads[i]) != (target_hp.head_dim[t], target_hp.num_key_value_heads[t]):
            raise SpecconvError(f"assistant layer {i} has head dim {hp.head_dim[i]} / {hp.num_key_value_heads[i]} KV "
                                f"heads, target layer {t} has {target_hp.head_dim[t]} / "
                                f"{target_hp.num_key_value_heads[t]}")
    if hp.sliding_window != target_hp.sliding_window:
        raise SpecconvError(f"assistant sliding window {hp.sliding_window} differs from the target's "
                            f"{target_hp.sliding_window}")


def forward_mtp(w, hp, tokens: torch.Tensor, h: torch.Tensor, batch: Batch, kv_from=None):
    """Rows (t, h) at batch.positions -> (logits [n, V], h_next [n, Hb], y = normed output [n, Ha])."""
    if kv_from is None:
        raise SpecconvError("the Gemma 4 assistant reads its target's K/V: create its context with kv_from=")
    emb = w[TARGET_EMBD][tokens]
    e = emb * math.sqrt(hp.backbone_hidden_size)  # (acc(emb) * s).to(emb.dtype)'s bits in one launch (gemma4.py)
    x = linear(torch.cat([e, h.to(e.dtype)], dim=-1), w[names.NEXTN_PRE_PROJECTION])
    rope = gemma4.rope_tables(w, hp, batch.positions, acc_dtype(x.dtype))
    target_hp, memory = kv_from.model.hparams, kv_from.memory
    a = rms_norm(x, w[gemma4._blk(0, "attn_norm")], hp.rms_norm_eps)
    layers = hp.num_nextn_predict_layers
    for i in range(layers):
        q = gemma4.query(w, hp, i, a, rope)
        k, v, k_pos = memory.cells(batch.seq, target_layer_for(target_hp, hp.is_sliding(i)))
        o = gemma4.attend(q, k.to(q.dtype), v.to(q.dtype), batch.positions, k_pos,
                          hp.sliding_window if hp.is_sliding(i) else 0)
        # the next layer's input norm, after the last the output norm: made with the FFN's sandwich
        scale = w[gemma4._blk(i, "layer_output_scale")]
        x, a = gemma4.ffn_block(w, hp, i, x, gemma4.attention_out(w, hp, i, o), scale,
                                gemma4.next_norm(w, i, layers, names.OUTPUT_NORM))
    y = a
    logits = acc(linear(y, w[names.TOKEN_EMBD]))
    return logits, linear(y, w[names.NEXTN_POST_PROJECTION]), y


GRAPH = draft_head.graph(
    "gemma4_assistant", "assistant", "a Gemma 4 assistant has no main graph; use it as --draft next to its target",
    HParams=Gemma4AssistantHParams,
    archs=("gemma4-assistant",),  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count_kv", "feed_forward_length"),  # per-layer lists (llama.cpp get_key_or_arr)
    tensors=_tensors,
    mtp_layout=mtp_layout,
    forward_mtp=forward_mtp,
    FROM_TARGET={TARGET_EMBD: (names.TOKEN_EMBD,)},
    NEEDS_KV_FROM=True,
    check_hparams=gemma4.check_hparams,
)
