"""DFlash block-diffusion drafter graph (GGUF arch `dflash`, docs/dflash.md).

Two evaluations, as in llama.cpp's src/models/dflash.cpp:
* context injection (graph type MTP through `Context.decode(..., hidden_in=features)`): each row is
  one committed target position; its features [k·H] (the target's k layer inputs, concatenated
  in `dflash.target_layers` order) give g = enc.output_norm(fc · features), and every layer
  stores K = k_norm(W_k g) (roped at the row's position) and V = W_v g in the draft's KV cache.
  The token ids of these rows are not used.
* the block (`forward_block`): tokens [anchor, mask, ...] at the positions after the context,
  embedded with the target's embedding; each layer normalises them (attn_norm), projects q/k/v
  (q/k normed per head, NEOX rope) and attends to the cached context rows and to all block rows —
  no causal mask unless the file sets `dflash.attention.causal` — then SwiGLU; logits through
  output_norm and the target's head. The block is never written to the cache.
`token_embd` and `output` are borrowed from the target (FROM_TARGET) unless the file has its own.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from specconv.archs import names
from specconv.archs.dflash import DFLASH_TABLE
from specconv.archs.dflash_hparams import DFlashHParams
from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs import draft_head
from specconv.runtime.graphs.contract import no_tensors
from specconv.runtime.graphs.ops import (
    acc, acc_dtype, add_rms_norm, by_rows, dense, head_projections, linear, normed_rope_neox, normed_rope_qk, rms_norm,
    rope_cos_sin, swiglu,
)
from specconv.runtime.memory import Batch, Memory, MemoryLayout
from specconv.runtime.types import GraphType
from specconv.runtime.validate import check_rope_width

HParams = DFlashHParams  # read from GGUF metadata by DFlashHParams.from_kv (archs/dflash_hparams.py)


# tensors llama.cpp's dflash graph uses when present, which this graph does not implement
_UNSUPPORTED = ("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.layer_output_scale.weight",
                "rope_freqs.weight", "blk.0.attn_sinks.weight", "d2t", "markov_w1.weight")


def serves(hp: HParams, file) -> set[GraphType]:
    """The decoder with its own KV cache (graph type MTP); there is no MAIN graph."""
    extra = [n for n in _UNSUPPORTED if file.has(n)]
    if extra:
        raise SpecconvError(f"{file.paths[0].name}: DFlash variant with {extra[0]}, which specconv's runtime does "
                            f"not implement (llama.cpp runs it)")
    if not file.has("blk.0.attn_v.weight"):
        raise SpecconvError(f"{file.paths[0].name}: DFlash drafter with shared K/V (no attn_v), which specconv's "
                            f"runtime does not implement (llama.cpp runs it)")
    return {GraphType.MTP}


# ---- which tensors the graph needs: the drafter's table (archs/dflash.py), shapes from the hparams

TABLE = DFLASH_TABLE


_tensors = draft_head.HeadTensors(TABLE, lambda hp: range(hp.num_hidden_layers))
OPTIONAL = tuple(TABLE.names(None, (), optional=True))  # token_embd and output: else the target's
SELECTOR = ("selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight")  # DFlash2's


def check_hparams(hp: HParams, kv: Mapping[str, Any]) -> None:
    check_rope_width(f"{hp.arch}.rope.dimension_count", hp.rotary_dim, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    """The selector's top-k fits the tokens it scores."""
    if hp.v2:
        rows = int(file.tensors["selector_successor.weight"].shape[-1]) if "selector_successor.weight" in file.tensors \
            else 0
        if rows and hp.selector_top_k > rows:
            raise SpecconvError(f"{hp.arch}.selector_top_k {hp.selector_top_k} exceeds the {rows} tokens of "
                                f"selector_successor.weight")


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.num_hidden_layers)), num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim,
                        rec_layers=[])


main_layout = mtp_layout


def _rope(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_cos_sin(positions, hp.rotary_dim, hp.rope_freq_base, dtype)


def _projected_kv(w, hp: HParams, i: int, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before its norm and rope) and V of rows g in layer i."""
    p = f"blk.{i}."
    return head_projections(g, [w[p + "attn_k.weight"], w[p + "attn_v.weight"]], (hp.num_key_value_heads,) * 2,
                            hp.head_dim)


def _context_kv(w, hp: HParams, i: int, g: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """K (normed, roped) and V of context rows g in layer i; no attn_norm on g (it is normed once)."""
    k, v = _projected_kv(w, hp, i, g)
    return normed_rope_neox(k, w[f"blk.{i}.attn_k_norm.weight"], hp.rms_norm_eps, *rope), v


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """Context injection: rows of target features at `batch.positions` -> K/V of every layer in the
    cache. Returns (empty logits [n, 0], g, g): these rows predict nothing."""
    g = rms_norm(linear(hidden_in, w[names.EAGLE3_FC]), w[names.ENC_OUTPUT_NORM], hp.rms_norm_eps)
    rope = _rope(hp, batch.positions, acc_dtype(g.dtype))
    for i in range(hp.num_hidden_layers):
        batch.attend_kv(i, *_context_kv(w, hp, i, g, rope))
    return g.new_zeros(g.shape[0], 0), g, g


def _attention(q, k, v, q_pos, k_pos, scale: float, causal: bool, window: int) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v over the keys each query sees: all of them (DFlash's block), or k_pos ≤ q_pos
    when causal; within a sliding window, only q_pos - k_pos < window. GQA: query head j reads KV j // group.
    In batch-invariant mode each query row alone (ops.by_rows)."""
    return by_rows(q.shape[0], lambda r: _attend(q[r], k, v, q_pos[r], k_pos, scale, causal, window))


def _attend(q, k, v, q_pos, k_pos, scale: float, causal: bool, window: int) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", acc(q), acc(k)) * scale
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    return torch.einsum("hnt,thd->nhd", probs, acc(v)).to(q.dtype)


def _conv(hp: HParams, h: torch.Tensor, dynamic: torch.Tensor, base, side: int) -> torch.Tensor:
    """DFlash2's dynamic depthwise convolution along the block: out_i = Σ_t W_i[t] ⊙ h_{i-t} (h_{<0} = 0),
    W_i[t, c] = dynamic_i[side, t, c // group] + base[side, t, c]; `dynamic` [n, 2·K·G] is laid out
    side, tap, group (group fastest), `base` [2, K, H]."""
    n, H = h.shape
    K, gs = hp.conv_kernel_size, hp.conv_group_size
    coeff = acc(dynamic).view(n, 2, K, H // gs)[:, side].repeat_interleave(gs, dim=-1)
    weight = coeff + dense(base, coeff.dtype)[side]
    hf = acc(h)
    out = weight[:, 0] * hf
    for tap in range(1, min(K, n)):
        out[tap:] += weight[tap:, tap] * hf[:-tap]
    return out.to(h.dtype)


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it, one ops.add_rms_norm (one
    launch on CUDA); (x, rms_norm(x)) where there is nothing to add."""
    return (x, rms_norm(x, weight, eps)) if delta is None else add_rms_norm(x, delta, weight, eps)


def forward_block(w, hp: HParams, tokens: torch.Tensor, positions: torch.Tensor, memory: Memory,
                  seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, V], final-normed hidden [n, H]) of the block `tokens` at `positions` over the
    committed context rows of `memory`. DFlash2 logits carry the logit scale and soft-capping."""
    n = tokens.shape[0]
    x = w[names.TOKEN_EMBD][tokens]
    if hp.input_embedding_scale:
        x = x * hp.input_embedding_scale
    rope = _rope(hp, positions, acc_dtype(x.dtype))
    f = None  # the last layer's FFN output, added to x together with the next norm
    for i in range(hp.num_hidden_layers):
        p = f"blk.{i}."
        x, a = _add_norm(x, f, w[p + "attn_norm.weight"], hp.rms_norm_eps)
        if hp.v2:
            dyn = linear(a, w[p + "attn_conv_proj.weight"])
            a = _conv(hp, a, dyn, w[p + "attn_conv_base"], 0)
        q = linear(a, w[p + "attn_q.weight"]).view(n, hp.num_attention_heads, hp.head_dim)
        k, v = _projected_kv(w, hp, i, a)  # the block rows' own K/V: the context's projections, on attn_norm(x)
        q, k = normed_rope_qk(q, k, w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"], hp.rms_norm_eps,
                              *rope)  # one launch on CUDA
        k_ctx, v_ctx, pos_ctx = memory.cells(seq, i)
        window = hp.sliding_window if hp.sliding_window_pattern and hp.sliding_window_pattern[i] else 0
        o = _attention(q, torch.cat([k_ctx.to(k.dtype), k]), torch.cat([v_ctx.to(v.dtype), v]), positions,
                       torch.cat([pos_ctx, positions]), hp.head_dim ** -0.5, bool(hp.causal), window)
        cur = linear(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[p + "attn_output.weight"])
        if hp.attention_value_scale:
            cur = cur * hp.attention_value_scale
        if hp.v2:
            cur = _conv(hp, cur, dyn, w[p + "attn_conv_base"], 1)
        x, f = add_rms_norm(x, cur, w[p + "ffn_norm.weight"], hp.rms_norm_eps)
        if hp.v2:
            dyn = linear(f, w[p + "ffn_conv_proj.weight"])
            f = _conv(hp, f, dyn, w[p + "ffn_conv_base"], 0)
        f = swiglu(f, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
        if hp.v2:
            f = _conv(hp, f, dyn, w[p + "ffn_conv_base"], 1)
    x, y = _add_norm(x, f, w[names.OUTPUT_NORM], hp.rms_norm_eps)
    logits = acc(linear(y, w[names.OUTPUT]))
    if hp.v2:  # the selector scores these logits, so they get the target's output transforms (as llama.cpp)
        if hp.output_multiplier:
            logits = logits * hp.output_multiplier
        softcap = hp.final_logit_softcapping
        if softcap is not None and softcap > 0:
            logits = torch.tanh(logits / softcap) * softcap
    return logits, y


def lattice(w, hp: HParams, logits: torch.Tensor, y: torch.Tensor, anchor: int):
    """DFlash2's candidate selector: (candidates [n, k] (top-k ids per block row), scores: a list where
    entry i ≥ 1 is [n_pred, k], the score of candidate s at row i after predecessor p of row i-1 (row 1:
    the anchor token)): score = Σ_r pred_codebook[p, r]·gate_i[r]·succ_codebook[s, r] + logit_i[s],
    gate_i = selector_hidden · y_i."""
    k = hp.selector_top_k
    cands = torch.topk(logits, k, dim=-1).indices
    unary = logits.gather(1, cands)
    gate = acc(linear(y, w["selector_hidden.weight"]))
    succ = acc(w["selector_successor.weight"][cands.reshape(-1)]).view(*cands.shape, -1)
    scores = [None]
    for i in range(1, logits.shape[0]):
        prev_ids = torch.tensor([anchor], device=cands.device) if i == 1 else cands[i - 1]
        pred = acc(w["selector_predecessor.weight"][prev_ids]) * gate[i]
        scores.append(pred @ succ[i].t() + unary[i][None, :])
    return cands, scores


GRAPH = draft_head.graph(
    "dflash", "dflash", "a DFlash file is a drafter: run it with --spec dflash next to its target",
    HParams=HParams,
    archs=("dflash",),  # the GGUF arches this graph runs (graph_for finds it by them)
    tensors=_tensors,
    optional_mtp_tensors=no_tensors,  # its optional tensors are whole-model ones: OPTIONAL
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_mtp=forward_mtp,
    OPTIONAL=OPTIONAL,
    serves=serves,
    FROM_TARGET=draft_head.EMBEDDING_AND_HEAD,
    check_hparams=check_hparams,
    check_values=check_values,
)
