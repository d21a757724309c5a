"""DeepSeek Sparse Attention graphs: GGUF arches `glm-dsa` (GLM-5 / 5.1) and `deepseek32`
(DeepSeek-V3.2); docs/dsa.md.

Everything but the attention's key selection is runtime/graphs/deepseek2.py: absorbed MLA over a
latent cache row, YaRN rope, the sigmoid group-limited MoE, the nextn block. The lightning indexer
picks, per query, the `index_topk` visible keys with the largest score (equal scores: the earlier
key first, `select`)

    I(t, s) = Σ_j w_j(t) · ReLU(q_j(t) · k(s) / √D),   w(t) = proj · x_t / √H_I,

where q_j = rope(indexer.attn_q_b · c_q) (c_q: the normed q_a latent the main query starts from)
and k = rope(LayerNorm(indexer.attn_k · x)) are D-wide, roped on their first dr dims (adjacent
pairs for GLM, halves for DeepSeek-V3.2); the main attention then sees only the selected keys.
A GLM "shared" layer reuses the selection of the previous full layer.

The indexer key of every token is kept in the cache next to its MLA latent: the cache row is
`[c (kv_lora) | rope(k_pe) (dr) | indexer k (D)]` (zeros for shared layers), so decoding token by
token, rollback and sequence copies treat both alike and the cached run equals the batch; V is a
view of each row's c (the layout's value_width), kept once. The attention over the chosen keys is
the backend's `latent_attention` with the selection as its key mask (one launch on CUDA, each
chosen cell read once), between the per-head products by attn_k_b and attn_v_b
(ops.linear_per_head), all in the accumulation dtype as the torch formula computes them.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from specconv.archs.dsa import DSA_TABLE, DsaHParams
from specconv.archs.errors import SpecconvError
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import deepseek2 as ds
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.ops import (
    Deferred, acc, attend_latent_cells, attended_kv, index_scores as ops_index_scores, linear_group, linear_per_head,
    linear_wide, rms_norm, rope_neox_partial, rope_pairs,
)
from specconv.runtime.memory import Batch

LAYERNORM_EPS = 1e-6  # the indexer's k_norm: transformers' LayerNorm(eps=1e-6), llama.cpp deepseek32's f_norm_eps

HParams = DsaHParams  # from GGUF metadata by from_kv (archs/dsa.py)

# Which tensors the graphs need: the family's table (archs/dsa.py), read with the file's hparams.
TABLE = DSA_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


def _row_width(hp: HParams) -> int:
    return hp.latent_width + hp.index_head_dim


_layouts = trunk.Layouts(_row_width, trunk.nextn_block, heads=lambda hp: 1)
main_layout, mtp_layout = ds.latent_layouts(_layouts)  # V: each row's c, a view


# ---- the lightning indexer ------------------------------------------------------------------------

def _rope_front(hp: HParams, x: torch.Tensor, rope) -> torch.Tensor:
    """Rope the first dr dims of each D-wide head (the tables' width), the rest pass ([rope | nope], as
    both releases): halves (i, i + dr/2) for DeepSeek-V3.2 (llama.cpp NEOX rope), adjacent pairs for GLM."""
    return (rope_neox_partial if hp.index_rope_halves else rope_pairs)(x, *rope)


def indexer_key(w, hp: HParams, i: int, k: torch.Tensor, rope) -> torch.Tensor:
    """k = rope(LayerNorm(attn_k · x)) [n, D] from the product k = attn_k · x, in x's dtype."""
    p = f"blk.{i}.indexer."
    dtype = k.dtype
    k = acc(k)
    k = F.layer_norm(k, (hp.index_head_dim,), w[p + "k_norm.weight"].to(k.dtype), w[p + "k_norm.bias"].to(k.dtype),
                     LAYERNORM_EPS)
    return _rope_front(hp, k[:, None, :], rope)[:, 0].to(dtype)


def index_scores(w, hp: HParams, i: int, a: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, rope) -> torch.Tensor:
    """I(t, s) for this batch's queries t over every cached key s: [n, T] (float32 or float64), from
    the indexer's query product q = indexer.attn_q_b · c_q [n, H·D] (ops.index_scores: one launch on CUDA)."""
    p, n = f"blk.{i}.indexer.", a.shape[0]
    q = _rope_front(hp, q.view(n, hp.index_n_heads, hp.index_head_dim), rope)
    weights = acc(linear_wide(a, w[p + "proj.weight"]))
    return ops_index_scores(q, weights, keys, hp.index_head_dim ** -0.5, hp.index_n_heads ** -0.5)


def select(hp: HParams, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[n, T] bool: per query row, the index_topk visible keys with the largest scores (all of them
    when fewer), keys of equal score taken earliest first (docs/dsa.md "Ties").

    Exact ties are common: a key that every indexer head's ReLU zeroes scores exactly 0. torch.topk
    picks among equal scores by its algorithm, which depends on the row's length, and a verification
    batch lengthens every row by its later (masked) keys: the same query would select other keys
    inside a batch than alone. The earliest-first rule depends on the visible scores only."""
    k = min(hp.index_topk, scores.shape[1])
    scores = scores.masked_fill(~visible, float("-inf"))
    edge = scores.topk(k, dim=-1).values[:, -1:]  # the k-th largest score of each row
    above = scores > edge
    tied = scores == edge
    room = k - above.sum(dim=-1, keepdim=True)
    return (above | (tied & (tied.cumsum(dim=-1) <= room))) & visible


# ---- blocks -------------------------------------------------------------------------------------

def mla_dsa(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope, state: dict) -> Deferred:
    """Absorbed MLA (runtime/graphs/deepseek2.py `mla`) restricted to the indexer's keys."""
    n, p = a.shape[0], f"blk.{i}."
    nh, dn, dr, kvl = hp.num_attention_heads, hp.qk_nope_head_dim, hp.qk_rope_head_dim, hp.kv_lora_rank
    full = hp.runs_indexer(i)
    indexer = (w[p + "indexer.attn_k.weight"],) if full else ()
    # the products of the block's input, then those of c_q, together (one launch each on CUDA)
    cq, kv, *ik = linear_group(a, (w[p + "attn_q_a.weight"], w[p + "attn_kv_a_mqa.weight"], *indexer))
    cq = rms_norm(cq, w[p + "attn_q_a_norm.weight"], hp.rms_norm_eps)
    indexer = (w[p + "indexer.attn_q_b.weight"],) if full else ()
    q, *iq = linear_group(cq, (w[p + "attn_q_b.weight"], *indexer))
    q = q.view(n, nh, dn + dr)
    c = rms_norm(kv[:, :kvl], w[p + "attn_kv_a_norm.weight"], hp.rms_norm_eps)
    q_pe = rope_pairs(q[..., dn:], *rope)
    k_pe = rope_pairs(kv[:, None, kvl:], *rope)[:, 0]
    ik = indexer_key(w, hp, i, ik[0], rope) if full else a.new_zeros(n, hp.index_head_dim)
    rest = torch.cat([k_pe.to(c.dtype), ik.to(c.dtype)], dim=-1)[:, None, :]  # the row after c
    k_all, _, k_pos = attended_kv(batch, i, rest, c[:, None, :])  # the row [c | rest], V its c
    visible = k_pos[None, :].to(batch.positions.device) <= batch.positions[:, None]
    visible = visible.to(a.device)
    if full:
        chosen = select(hp, index_scores(w, hp, i, a, iq[0], k_all[:, 0, kvl + dr:], rope), visible)
        state["chosen"] = chosen
    else:
        chosen = state.get("chosen")
        if chosen is None or chosen.shape != visible.shape:
            raise SpecconvError(f"{hp.arch}: shared indexer layer {i} has no earlier full layer's selection")
        chosen = chosen.to(a.device)
    # the query rows over the keys their indexer chose, in the accumulation dtype throughout
    q_lat = linear_per_head(acc(q[..., :dn]), w[p + "attn_k_b.weight"])
    o = attend_latent_cells(q_lat, q_pe, k_all[..., :kvl + dr], batch.positions, k_pos, ds.softmax_scale(hp), chosen)
    o = linear_per_head(o, w[p + "attn_v_b.weight"]).to(a.dtype)
    return Deferred(o.reshape(n, nh * hp.v_head_dim), w[p + "attn_output.weight"])  # made with the add and norm


def _block(w, hp: HParams, batch: Batch, gdn_mode: str):
    state: dict = {}  # the last full indexer layer's selection, which shared-indexer layers of one forward reuse
    return trunk.prenorm(partial(mla_dsa, state=state), ms.ffn)(w, hp, batch, gdn_mode)


def _rope(w, hp: HParams, batch: Batch):
    return lambda dtype: ds.rope_cos_sin(hp, batch.positions, dtype)


GRAPH = trunk.graph(
    "dsa", HParams, _tensors, main_layout, mtp_layout,
    trunk.Trunk(_rope, _block, mtp_block=trunk.nextn_block),
    archs=("glm-dsa", "deepseek32"),  # the GGUF arches this graph runs (graph_for finds it by them)
)
