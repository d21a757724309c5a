"""EAGLE-3 draft head graphs (GGUF arch `eagle3`), docs/reference/model-math.md §9-§10.

ENCODER: target features f = [H^(l1) ; H^(l2) ; H^(l3)] (3·Ht per row) -> g = fc · f, with an RMSNorm
(`enc.output_norm`) first when `norm_before_fc`. No memory.
Decoder (served as GraphType.MTP: token rows plus one hidden row each, its own KV cache): the row
at position t takes (token x_{t+1}, g_t):
    e = attn_norm(Emb[x]); ĝ = attn_norm_2(g); c = [e ; ĝ] (2H)
    r = (norm_before_residual ? ĝ : g) + attn_output · Attn(c)        (NORM rope at t, scale hd^-1/2)
    out = r + FFN(ffn_norm(r));  logits = output · output_norm(out)    over the draft vocabulary
The logits come back over the TARGET vocabulary: draft column i is written at target id d2t[i] and
every other id is -inf, as llama.cpp does, so nothing outside d2t can be chosen or sampled. The
hidden output ("nextn", also "pre_norm") is the pre-norm `out`, fed back as g for the next draft.
Token embedding and (without its own lm_head) the output head come from the target
(`load_model(head, share_from=target)`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from specconv.archs import names
from specconv.archs.eagle3 import EAGLE3_TABLE
from specconv.archs.eagle3_hparams import Eagle3HParams
from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs import draft_head, llama
from specconv.runtime.graphs.ops import acc, acc_dtype, add_rms_norm, dense, linear, rms_norm
from specconv.runtime.memory import Batch, MemoryLayout
from specconv.runtime.types import GraphType
from specconv.runtime.validate import check_shape

ENC_NORM = names.ENC_OUTPUT_NORM
HParams = Eagle3HParams  # read from GGUF metadata by Eagle3HParams.from_kv (archs/eagle3_hparams.py)


# ---- which tensors each graph needs: the head's table (archs/eagle3.py), shapes from the hparams ----

TABLE = EAGLE3_TABLE


def encoder_tensors(hp: HParams) -> list[str]:
    """fc, and the norm before it when the file says norm_before_fc (optional in the table)."""
    return TABLE.graph_names(hp, [0], "encoder") + ([ENC_NORM] if hp.norm_before_fc else [])


# the decoder block 0; optional: token_embd and output (else the target's), d2t (with a draft vocabulary),
# rope_freqs (llama3 rope)
_tensors = draft_head.HeadTensors(TABLE, lambda hp: [0])
MAX_VOCAB = 1 << 24


def check_hparams(hp: HParams, kv: Mapping[str, Any]) -> None:
    tokens = kv.get("tokenizer.ggml.tokens")
    if not 0 < hp.vocab_size <= MAX_VOCAB:
        raise SpecconvError(f"{hp.arch}: vocabulary size {hp.vocab_size} ({hp.arch}.vocab_size or tokenizer.ggml.tokens) "
                            f"is outside 1..{MAX_VOCAB}")
    if isinstance(tokens, list) and len(tokens) > hp.vocab_size:  # logits are scattered over n_vocab columns
        raise SpecconvError(f"{hp.arch}.vocab_size {hp.vocab_size} is smaller than the {len(tokens)} tokenizer tokens")
    llama.check_hparams(hp, kv)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    """Without d2t the head's own output spans the target vocabulary, not a draft one; with it, d2t maps
    draft ids to target ids, every entry a target id (the decoder scatters by it)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    if names.EAGLE3_D2T not in needed or names.EAGLE3_D2T not in file.tensors:
        if names.OUTPUT in needed and names.OUTPUT in file.tensors:
            check_shape(names.OUTPUT, tuple(int(d) for d in file.tensors[names.OUTPUT].shape),
                        (hp.hidden_size, hp.vocab_size), {})
        return
    if names.OUTPUT not in needed:  # the target's head spans the target vocabulary, not the draft's
        raise SpecconvError("tensor d2t maps a draft vocabulary, but the head has no output.weight of its own")
    t = file.tensors[names.EAGLE3_D2T]
    view = {Q.I32: np.int32, Q.I64: np.int64}.get(t.tensor_type)  # torch indexes with these, not I8 / I16
    if view is None:
        raise SpecconvError(f"tensor d2t has type {t.tensor_type.name}; I64 or I32 is expected")
    values = np.asarray(t.data).view(view)
    if values.size and (int(values.min()) < 0 or int(values.max()) >= hp.vocab_size):
        raise SpecconvError(f"tensor d2t holds ids outside the target vocabulary [0, {hp.vocab_size})")


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[0], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


def encoder_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


# ---- graphs -----------------------------------------------------------------------------------

def forward_encoder(w, hp: HParams, features: torch.Tensor) -> torch.Tensor:
    want = 3 * hp.target_hidden_size
    if features.shape[-1] != want:
        raise SpecconvError(f"EAGLE-3 encoder: feature rows have width {features.shape[-1]}, expected 3 x "
                            f"{hp.target_hidden_size} = {want}")
    x = rms_norm(features, w[ENC_NORM], hp.rms_norm_eps) if hp.norm_before_fc else features
    return linear(x, w[names.EAGLE3_FC])


def _needed(w, name: str) -> torch.Tensor:
    t = w.get(name)
    if t is None:
        raise SpecconvError(f"the EAGLE-3 head has no {name}; load it with load_model(head, share_from=target)")
    return t


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, g: torch.Tensor, batch: Batch):
    """Decoder rows (x_{t+1}, g_t) at positions t -> (logits over the target vocabulary, out, out)."""
    e = rms_norm(_needed(w, names.TOKEN_EMBD)[tokens], w["blk.0.attn_norm.weight"], hp.rms_norm_eps)
    g = g.to(e.dtype)
    g_norm = rms_norm(g, w["blk.0.attn_norm_2.weight"], hp.rms_norm_eps)
    rope = llama.rope_for(w, hp, batch.positions, acc_dtype(e.dtype))
    residual = g_norm if hp.norm_before_residual else g
    # each residual add with the norm after it: one ops.add_rms_norm (one launch on CUDA)
    r, x = add_rms_norm(residual, llama.attention(w, hp, 0, torch.cat([e, g_norm], dim=-1), batch, rope),
                        w["blk.0.ffn_norm.weight"], hp.rms_norm_eps)
    out, y = add_rms_norm(r, llama.ffn(w, hp, 0, x), w["output_norm.weight"], hp.rms_norm_eps)
    draft_logits = acc(linear(y, _needed(w, names.OUTPUT)))
    d2t = w.get(names.EAGLE3_D2T)
    return to_target_vocab(draft_logits, dense(d2t) if d2t is not None else None, hp.vocab_size), out, out


def to_target_vocab(draft_logits: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Scatter draft-vocabulary logits [n, Vd] to target ids [n, V]; ids outside d2t get -inf."""
    if d2t is None:
        return draft_logits
    full = torch.full((draft_logits.shape[0], vocab_size), float("-inf"), dtype=draft_logits.dtype,
                      device=draft_logits.device)
    full[:, d2t.to(draft_logits.device)] = draft_logits
    return full


GRAPH = draft_head.graph(
    "eagle3", "eagle3", "an EAGLE-3 head has no main graph; run it as ENCODER + MTP next to its target",
    HParams=HParams,
    archs=("eagle3",),  # the GGUF arches this graph runs (graph_for finds it by them)
    tensors=_tensors,
    mtp_layout=mtp_layout,
    forward_mtp=forward_mtp,
    encoder_tensors=encoder_tensors,
    encoder_layout=encoder_layout,
    forward_encoder=forward_encoder,
    serves=lambda hp, file: {GraphType.ENCODER, GraphType.MTP},
    check_hparams=check_hparams,
    check_values=check_values,
    INTEGER_TENSORS=(names.EAGLE3_D2T,),
    FROM_TARGET=draft_head.EMBEDDING_AND_HEAD,
)
