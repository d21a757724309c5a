"""transformers' DSA indexers (GLM-5 `GlmMoeDsaIndexer`, DeepSeek-V3.2 `DeepseekV32Indexer`) with the
key selection's exact ties broken as our runtime breaks them (runtime/graphs/dsa.py `select`,
docs/dsa.md "Ties"): of keys whose index score equals the k-th largest, the earlier ones first.

transformers takes `index_scores.topk(k)`, and torch.topk picks among equal scores by its algorithm,
which depends on the row's length: its full forward re-picks past rows' ties as the sequence grows,
and a prompt with a tie at the boundary (a key every head's ReLU zeroes scores exactly 0) may select
other keys than any fixed rule. A forward hook re-picks such rows only; every other row keeps
transformers' own selection. Forwards without a cache only (the hook recomputes the keys from the
forward's hidden states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specconv.errors import SpecconvError

DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


def _indexer_classes() -> tuple[type, ...]:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    return GlmMoeDsaIndexer, DeepseekV32Indexer


def index_scores(ix, hidden_states, q_resid, position_embeddings, attention_mask) -> torch.Tensor:
    """The indexer's scores before its top-k, [B, S, T], masked keys -inf, recomputed with the module's
    own pieces (its forward returns only the indices)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                        apply_rotary_pos_emb_interleave)
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    b, s, _ = hidden_states.shape
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    dr = ix.qk_rope_head_dim
    rot = apply_rotary_pos_emb_interleave if isinstance(ix, GlmMoeDsaIndexer) else apply_rotary_pos_emb
    q_rot, k_rot = rot(q[..., :dr], k[..., :dr], *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., dr:]], dim=-1)
    k = torch.cat([k_rot, k[..., dr:]], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads ** -0.5
    out = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    visible = attention_mask if attention_mask.dtype == torch.bool else \
        attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return out.masked_fill(~visible, float("-inf"))


class EarliestOnTies:
    """Hooks every DSA indexer of `model`; `rows` counts the query rows that had an exact tie at the
    top-k boundary (re-picked by the rule). Usable as a context manager (hooks removed on exit)."""

    def __init__(self, model):
        classes = _indexer_classes()
        self.rows = 0
        self.hooks = [m.register_forward_hook(self._repick, with_kwargs=True)
                      for m in model.modules() if isinstance(m, classes)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def _repick(self, module, args, kwargs, indices):
        if kwargs.get("past_key_values") is not None:
            raise SpecconvError("DSA tie rule: the reference forward must run without a cache (use_cache=False)")
        scores = index_scores(module, *args[:4])
        k = indices.shape[-1]
        if k >= scores.shape[-1]:
            return indices
        ranked = scores.sort(dim=-1, descending=True).values
        edge = ranked[..., k - 1:k]
        tied_rows = (edge == ranked[..., k:k + 1])[..., 0] & torch.isfinite(edge[..., 0])
        if not tied_rows.any():
            return indices
        above, tied = scores > edge, scores == edge
        chosen = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        out = indices.clone()
        for b, s in tied_rows.nonzero().tolist():
            out[b, s] = chosen[b, s].nonzero()[:, 0].to(out.dtype)
        self.rows += int(tied_rows.sum())
        return out
