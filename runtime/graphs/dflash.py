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

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.ops import (
    acc, causal_attention, linear, rms_norm, rope_cos_sin, rope_neox_partial, swiglu,
)
from specconv.runtime.memory import Batch, Memory, MemoryLayout
from specconv.runtime.types import GraphType

KIND = "dflash"
OPTIONAL = (names.TOKEN_EMBD, names.OUTPUT)
SHAREABLE: tuple[str, ...] = ()  # a draft's own tensors are never replaced by the target's
FROM_TARGET = {names.TOKEN_EMBD: (names.TOKEN_EMBD,), names.OUTPUT: (names.OUTPUT, names.TOKEN_EMBD)}


@dataclass
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    eps: float
    n_ff: int
    block_size: int
    target_layers: list[int] = field(default_factory=list)  # target layer INPUTS (llama.cpp's convention)
    mask_token_id: int = 0
    causal: bool = False
    n_vocab: int = 0
    context_length: int = 0
    n_nextn: int = 0

    @property
    def n_embd_in(self) -> int:
        """Width of one context row: the k target layers' hidden states, concatenated."""
        return len(self.target_layers) * self.n_embd

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        arch = kv["general.architecture"]

        def get(key, default=None):
            v = kv.get(f"{arch}.{key}", default)
            if v is None:
                raise SpecconvError(f"GGUF metadata lacks {arch}.{key}")
            return v

        n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        layers = kv.get(f"{arch}.target_layers")
        if not layers:
            raise SpecconvError(f"GGUF metadata lacks {arch}.target_layers (the target layers a DFlash drafter reads)")
        mask = kv.get(names.MASK_TOKEN_ID_KEY)
        if mask is None:
            raise SpecconvError(f"GGUF metadata lacks {names.MASK_TOKEN_ID_KEY} (the DFlash block's mask token)")
        unsupported = [k for k in ("conv_kernel_size", "attention.sliding_window", "logit_scale",
                                   "final_logit_softcapping", "embedding_scale", "attention.value_scale",
                                   "hyper_connection_count") if f"{arch}.{k}" in kv]
        if unsupported:
            kind = "a DFlash2 drafter" if unsupported[0] == "conv_kernel_size" else "this DFlash variant"
            raise SpecconvError(f"{arch}.{unsupported[0]}: {kind} is not supported by specconv's runtime "
                                f"(llama.cpp runs it)")
        sections = kv.get(f"{arch}.rope.dimension_sections")
        n_rot = int(get("rope.dimension_count", head_dim))
        if sections is not None and [int(x) for x in sections] != [n_rot // 2, 0, 0, 0]:
            raise SpecconvError(f"{arch}.rope.dimension_sections {list(sections)}: only the temporal section "
                                f"[{n_rot // 2}, 0, 0, 0] (drafts for M-RoPE targets) is supported")
        tokens = kv.get("tokenizer.ggml.tokens")
        return cls(arch=arch, n_layer=int(get("block_count")), n_embd=n_embd, n_head=n_head,
                   n_head_kv=int(get("attention.head_count_kv", n_head)), head_dim=head_dim,
                   n_rot=int(get("rope.dimension_count", head_dim)), rope_base=float(get("rope.freq_base", 10000.0)),
                   eps=float(get("attention.layer_norm_rms_epsilon")), n_ff=int(get("feed_forward_length")),
                   block_size=int(get("block_size", 16)), target_layers=[int(j) for j in layers],
                   mask_token_id=int(mask), causal=bool(get("attention.causal", False)),
                   n_vocab=len(tokens) if tokens is not None else 0, context_length=int(get("context_length", 0)))


def serves(hp: HParams, file) -> set[GraphType]:
    return {GraphType.MTP}  # the decoder with its own KV cache; there is no MAIN graph


def n_vocab(hp: HParams) -> int:
    return hp.n_vocab


def _block_names(i: int) -> list[str]:
    return [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                           "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]


def main_tensors(hp: HParams) -> list[str]:
    return []


def mtp_tensors(hp: HParams) -> list[str]:
    return ([names.EAGLE3_FC, names.ENC_OUTPUT_NORM, names.OUTPUT_NORM]
            + [n for i in range(hp.n_layer) for n in _block_names(i)])


def optional_mtp_tensors(hp: HParams) -> list[str]:
    return []


def keep_float32(name: str) -> bool:
    return name.endswith("norm.weight")


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.n_layer)), n_head_kv=hp.n_head_kv, head_dim=hp.head_dim,
                        rec_layers=[])


main_layout = mtp_layout


def _rope(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_cos_sin(positions, hp.n_rot, hp.rope_base, dtype)


def _context_kv(w, hp: HParams, i: int, g: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """K (normed, roped) and V of context rows g in layer i; no attn_norm on g (it is normed once)."""
    n, p = g.shape[0], f"blk.{i}."
    k = rms_norm(linear(g, w[p + "attn_k.weight"]).view(n, hp.n_head_kv, hp.head_dim), w[p + "attn_k_norm.weight"], hp.eps)
    v = linear(g, w[p + "attn_v.weight"]).view(n, hp.n_head_kv, hp.head_dim)
    return rope_neox_partial(k, *rope), v


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """Context injection: rows of target features at `batch.positions` -> K/V of every layer in the
    cache. Returns (empty logits [n, 0], g, g): these rows predict nothing."""
    g = rms_norm(linear(hidden_in, w[names.EAGLE3_FC]), w[names.ENC_OUTPUT_NORM], hp.eps)
    rope = _rope(hp, batch.positions, acc(g).dtype)
    for i in range(hp.n_layer):
        batch.attend_kv(i, *_context_kv(w, hp, i, g, rope))
    return g.new_zeros(g.shape[0], 0), g, g


def forward_block(w, hp: HParams, tokens: torch.Tensor, positions: torch.Tensor, memory: Memory,
                  seq: int = 0) -> torch.Tensor:
    """Logits [n, V] of the block `tokens` at `positions` over the committed context rows of `memory`."""
    n = tokens.shape[0]
    x = w[names.TOKEN_EMBD][tokens]
    rope = _rope(hp, positions, acc(x).dtype)
    # non-causal: every block row sees every context row and every block row
    q_pos = positions if hp.causal else positions.new_full((n,), int(positions.max()))
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        a = rms_norm(x, w[p + "attn_norm.weight"], hp.eps)
        q = rms_norm(linear(a, w[p + "attn_q.weight"]).view(n, hp.n_head, hp.head_dim), w[p + "attn_q_norm.weight"], hp.eps)
        q = rope_neox_partial(q, *rope)
        k, v = _context_kv(w, hp, i, a, rope)  # the block rows' own K/V: same projections, on attn_norm(x)
        k_ctx, v_ctx, pos_ctx = memory.cells(seq, i)
        k_all = torch.cat([k_ctx.to(k.dtype), k])
        v_all = torch.cat([v_ctx.to(v.dtype), v])
        o = causal_attention(q, k_all, v_all, q_pos, torch.cat([pos_ctx, positions]), hp.head_dim ** -0.5)
        x = x + linear(o.reshape(n, hp.n_head * hp.head_dim), w[p + "attn_output.weight"])
        x = x + swiglu(rms_norm(x, w[p + "ffn_norm.weight"], hp.eps), w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"],
                       w[p + "ffn_down.weight"])
    return acc(linear(rms_norm(x, w[names.OUTPUT_NORM], hp.eps), w[names.OUTPUT]))


def forward_main(*args, **kwargs):
    raise SpecconvError("a DFlash file is a drafter: run it with --spec dflash next to its target")
