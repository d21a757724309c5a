"""The torch reference backend (runtime/backend.py): torch operations only, on any device.

It is what the tests hold the other backends to, what runs where no faster kernel applies, and the
backend of devices without kernels of their own (`meta` included, which is how the forward is
checked for host reads: tests/runtime/test_backend.py).

* `linear`: a stored matrix of up to stored.CHUNK_ELEMENTS values is dequantized whole and
  multiplied once (bit for bit what a dense weight computes); a larger one a chunk of rows at a
  time, so it never exists whole in the compute dtype. In batch-invariant mode (backend.rows_alone)
  each row is multiplied alone, in float32, by the same values as in a one-row batch.
* `moe`: batches of up to GATHER_MAX_ROWS rows (decode steps, verification) take each row's
  experts by index (`StoredWeight.take`: no host read, only the routed experts' bytes); longer
  batches (prompts) group the rows by expert, one product per routed expert, which reads the
  expert list on the host. Both sum a row's experts in increasing expert order.
* `attention`: ops.causal_attention, or with a window or sinks ops.windowed_attention (einsums, a
  mask and torch's softmax; in batch-invariant mode each query row alone), then an optional sigmoid
  output gate. `write_kv`: a batch's K/V into a layer's fixed-size buffers by cell index
  (index_copy_); `normed_rope_store`: (v's weightless norm,) `normed_rope` of q, of k, then
  `write_kv`, in that order.
* `causal_conv`, `delta_rule`: the torch forms of runtime/graphs/gdn.py; in batch-invariant mode
  the delta rule runs token by token, each token as a batch of one would (`exact`).
  `causal_conv_slots`, `delta_rule_slots`: the same forms reading and writing the memory's ring of
  states by slot index tensors (what a backend with `slot_states` is given; the reference of the
  CUDA backend's kernels); `delta_rule_from_conv_slots`: the q, k norms and the gates, then
  `delta_rule_slots` (and `gated_rms_norm` of its output where given the layer's output norm);
  `conv_delta_rule_slots`: the conv, then `delta_rule_from_conv_slots`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specconv.archs import names
from specconv.runtime import dequant, stored
from specconv.runtime.backend import Experts, rows_alone
from specconv.runtime.graphs import gdn, ops
from specconv.runtime.stored import StoredWeight

GATHER_MAX_ROWS = 16  # MoE batches up to this many rows take each row's experts by index


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of `dtype`: float32, or float64 when computing in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _product(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x @ valuesᵀ. In batch-invariant mode row by row, each row a fresh one-row float32 product: the
    same call, on the same values, whatever the number of rows, so its sums run in the same order."""
    if not rows_alone() or x.numel() == 0:
        return x @ values.t()
    wide = _wide(x.dtype)
    columns = values.to(wide).t()
    xs = x.reshape(-1, x.shape[-1])
    out = torch.cat([torch.mm(xs[i:i + 1].to(wide, copy=True), columns) for i in range(xs.shape[0])])
    return out.to(x.dtype).reshape(*x.shape[:-1], values.shape[0])


def _take(w, index: torch.Tensor):
    """Rows `index` of a 3-D expert tensor (stored: still packed), None for an absent tensor."""
    if w is None:
        return None
    return w.take(index) if isinstance(w, StoredWeight) else w.index_select(0, index.to(w.device))


def _largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row, in decreasing order, equal values by lowest index
    (contiguous, as topk's: the routed-expert code reshapes them)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


class TorchBackend:
    name = "torch"
    # attention over each layer's whole fixed-size K/V buffer (ops.cached_attention) even where rows
    # need not be alone: the shapes a captured CUDA graph needs; slices of the written cells otherwise
    static_kv = False
    # Gated DeltaNet states read from and written straight into the memory's ring slots, addressed by
    # index tensors (causal_conv_slots / delta_rule_slots: a rollback picks a slot, a captured graph
    # replays with new slots); otherwise the state tensors in and out (causal_conv / delta_rule), the
    # states after a batch left pending where the batched forms compute them
    slot_states = False

    # ---- weights ----------------------------------------------------------------------------------
    def stored_type(self, qtype, shape: tuple[int, ...]):
        """The type a weight of `qtype` and torch-order `shape` is kept in on this backend's device: the
        file's (the CUDA backend keeps Q8_0 matrices as runtime/rows_first.py's Q8_0_ROWS)."""
        return qtype

    def dequantize_rows(self, raw: torch.Tensor, qtype, dtype: torch.dtype) -> torch.Tensor:
        return dequant.dequantize_rows(raw, qtype, dtype)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ wᵀ for a matrix in torch order [out, in]."""
        if not isinstance(w, StoredWeight):
            return _product(x, w.to(x.dtype))
        if w.ndim != 2:
            raise ValueError(f"linear needs a 2-D weight, got {tuple(w.shape)}")
        if w.numel() <= stored.CHUNK_ELEMENTS:
            return _product(x, w.dense(x.dtype))
        out = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
        for start, values in w.row_chunks(x.dtype):
            out[..., start:start + values.shape[0]] = _product(x, values)
        return out

    def linear_wide(self, x: torch.Tensor, w) -> torch.Tensor:
        """x in the accumulation dtype, then `linear`."""
        return self.linear(ops.acc(x), w)

    def linear_wide_group(self, x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
        """(acc(x) @ w₀ᵀ, acc(x) @ w₁ᵀ, ...): `linear_wide` by each weight in turn."""
        return tuple(self.linear_wide(x, w) for w in ws)

    def linear_per_head(self, x: torch.Tensor, w) -> torch.Tensor:
        """y[:, h] = x[:, h] @ w[h]ᵀ for x [n, heads, in] and a 3-D weight [heads, out, in] (stored or
        dense; multi-head latent attention's attn_k_b / attn_v_b): float32 products of w's values,
        rounded into x's dtype [n, heads, out]; each row alone in batch-invariant mode (ops.by_rows)."""
        values = ops.dense(w, _wide(x.dtype))
        return ops.by_rows(x.shape[0], lambda r: torch.einsum("nhi,hoi->nho", ops.acc(x[r]), values)).to(x.dtype)

    def linear_group(self, x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
        """(x @ w₀ᵀ, x @ w₁ᵀ, ...): `linear` by each weight in turn."""
        return tuple(self.linear(x, w) for w in ws)

    # ---- mixture of experts -----------------------------------------------------------------------
    def moe(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts) -> torch.Tensor:
        """Σ over each row's k slots of weights[row, slot] · expert chosen[row, slot](x[row]), in the
        accumulation dtype [n, out]. weights, chosen: [n, k]."""
        if x.shape[0] <= GATHER_MAX_ROWS:
            return self.moe_by_index(x, weights, chosen, experts)
        return self.moe_by_expert(x, weights, chosen, experts)

    def moe_out(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """A MoE block's output in x's dtype: `moe`'s sum (accumulation dtype) rounded, or with
        shared experts' output shared [n, out] (x's dtype) `add_shared`'s sum, or `add_gated_shared`'s
        with a shared expert gated by σ(shared_gate [n, 1])."""
        out = self.moe(x, weights, chosen, experts)
        if shared is None:
            return out.to(x.dtype)
        return self.add_shared(out, shared) if shared_gate is None else self.add_gated_shared(out, shared, shared_gate)

    def route_softmax_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen) [n, k] of a softmax router: softmax over the experts, the k largest, the
        weights renormalised over the chosen k (docs/reference/model-math.md §3.1)."""
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), chosen

    def route_grouped(self, logits: torch.Tensor, k: int, gating: int, bias: torch.Tensor | None = None,
                      groups: int | None = 1, groups_used: int | None = 1, renormalise: bool = True,
                      scale: float = 1.0,
                      expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen) [n, k] of a router with a selection bias and expert groups
        (docs/reference/model-math.md §3.2): scores σ(logits) (gating names.EXPERT_GATING_SIGMOID) or
        softmax(logits); the choice scores + bias (selection only); with more than one group, each
        group of consecutive experts scored by its two best choices and only the `groups_used` best
        kept; the k best choices, in decreasing order, equal ones by lowest index (a stable sort:
        torch.topk's order of ties is the C++ library's on the CPU); weights the un-biased scores,
        over (their sum + 1e-20) when `renormalise`, times expert_scale[expert] (a per-expert
        scale, Gemma 4's) where given, times `scale` (where not 1)."""
        scores = torch.sigmoid(logits) if gating == names.EXPERT_GATING_SIGMOID else torch.softmax(logits, dim=-1)
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if groups is not None and groups > 1:
            n, n_experts = choice.shape
            grouped = choice.view(n, groups, n_experts // groups)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # each group's two best: their order does not matter
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, _largest(group_score, groups_used), True)
            choice = choice.masked_fill(~keep.repeat_interleave(n_experts // groups, dim=1), float("-inf"))
        chosen = _largest(choice, k)
        weights = scores.gather(1, chosen)
        if renormalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if expert_scale is not None:
            weights = weights * expert_scale.to(weights.dtype)[chosen]
        return (weights if scale == 1.0 else weights * scale), chosen

    def add_shared(self, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """A MoE block's output with an un-gated shared expert: routed [n, out] (accumulation dtype)
        plus shared [n, out] widened to it, the sum rounded into shared's dtype."""
        return (routed + shared.to(routed.dtype)).to(shared.dtype)

    def add_gated_shared(self, routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """A MoE block's output with a sigmoid-gated shared expert: routed [n, out] (accumulation dtype)
        and shared [n, out] · σ(gate [n, 1]) each rounded into shared's dtype, then added."""
        return routed.to(shared.dtype) + (shared.to(_wide(shared.dtype)) * torch.sigmoid(gate)).to(shared.dtype)

    def moe_by_expert(self, x, weights, chosen, experts: Experts) -> torch.Tensor:
        """One product per routed expert over the rows routed to it (the expert list read on the host)."""
        out = torch.zeros(x.shape[0], experts.down.shape[1], dtype=_wide(x.dtype), device=x.device)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            y = experts.ffn(x[rows], experts.gate[e], None if experts.up is None else experts.up[e], experts.down[e])
            out.index_add_(0, rows, y.to(out.dtype) * weights[rows, slot][:, None])
        return out

    def moe_by_index(self, x, weights, chosen, experts: Experts) -> torch.Tensor:
        """Each row through its own k experts, taken by index: no host read, no shape that depends on
        the routing. A row's terms are added in increasing expert order, as moe_by_expert adds them."""
        order = chosen.argsort(dim=-1)
        chosen, weights = chosen.gather(1, order), weights.gather(1, order)
        rows = []
        for i in range(x.shape[0]):
            gate, up, down = (_take(t, chosen[i]) for t in (experts.gate, experts.up, experts.down))
            total = torch.zeros(1, experts.down.shape[1], dtype=_wide(x.dtype), device=x.device)
            for s in range(chosen.shape[1]):
                y = experts.ffn(x[i:i + 1], gate[s], None if up is None else up[s], down[s])
                total = total + y.to(total.dtype) * weights[i:i + 1, s:s + 1]
            rows.append(total)
        return torch.cat(rows)

    # ---- around the products: norms, rope, gated activations ----------------------------------------
    def rms_norm(self, x: torch.Tensor, weight, eps: float) -> torch.Tensor:
        """x · (mean(x²) + ε)^(-1/2) ⊙ w over the last axis, in the accumulation dtype, then x's dtype
        (the GGUF weight already holds any +1)."""
        xf = x.to(_wide(x.dtype))
        # torch's own op: the same arithmetic in the same order (bit for bit), one call instead of six
        values = None if weight is None else (weight.dense(xf.dtype) if isinstance(weight, StoredWeight)
                                               else weight.to(xf.dtype))
        return F.rms_norm(xf, (xf.shape[-1],), values, eps).to(x.dtype)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight, eps: float):
        """(h + delta, rms_norm(h + delta)): a block's residual add and the norm after it."""
        total = h + delta
        return total, self.rms_norm(total, weight, eps)

    def linear_add_rms_norm(self, x: torch.Tensor, w, h: torch.Tensor, weight, eps: float,
                            up: torch.Tensor | None = None, act: str | None = None):
        """add_rms_norm(h, delta, weight) for delta = linear(x, w) (with `up`: linear_glu(x, up, w, act)):
        the product that ends a block's mixer or FFN, its residual add and the norm after it."""
        delta = self.linear(x, w) if up is None else self.linear_glu(x, up, w, act)
        return self.add_rms_norm(h, delta, weight, eps)

    def linear_add_normed(self, x: torch.Tensor, w, h: torch.Tensor, weight, eps: float, scale=None, then=None,
                          up: torch.Tensor | None = None, act: str | None = None):
        """(s, o): s = add_normed(h, delta, weight, eps, scale) for delta = linear(x, w) (with `up`:
        linear_glu(x, up, w, act)), o = rms_norm(s, then) where `then` is given, else None: a product
        whose output joins the residual stream through a sandwich norm (Gemma), and the norm that
        reads the stream next."""
        delta = self.linear(x, w) if up is None else self.linear_glu(x, up, w, act)
        s = self.add_normed(h, delta, weight, eps, scale)
        return s, (None if then is None else self.rms_norm(s, then, eps))

    def add_normed(self, h: torch.Tensor, x: torch.Tensor, weight, eps: float, scale=None) -> torch.Tensor:
        """h + rms_norm(x) (a sandwich norm's output joining the residual stream), times a one-value
        `scale` in the accumulation dtype when given, rounded into h's dtype (Gemma 4's layer output
        scale)."""
        out = h + self.rms_norm(x, weight, eps)
        if scale is None:
            return out
        wide = _wide(out.dtype)
        return (out.to(wide) * scale.to(wide)).to(out.dtype)

    def gated_rms_norm(self, x: torch.Tensor, weight, gate: torch.Tensor, eps: float,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """rms_norm(x) · silu(gate) in the accumulation dtype (Gated DeltaNet's output norm), rounded
        into `out_dtype` when given (the dtype of the product that reads it)."""
        y = self.rms_norm(x, weight, eps) * F.silu(gate.to(_wide(gate.dtype)))
        return y if out_dtype is None else y.to(out_dtype)

    def l2_norm(self, x: torch.Tensor, eps: float, scale: float | None = None) -> torch.Tensor:
        """x · (Σ x² + ε)^(-1/2) over the last axis, in the accumulation dtype, then times `scale`
        when given (a second rounding: Gated DeltaNet's q · dk^(-1/2))."""
        xf = x.to(_wide(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
        return y if scale is None else y * scale

    def rope_table(self, positions: torch.Tensor, inv_freq: torch.Tensor, divisor: float | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [n, half] of the angles p · inv_freq[i] in inv_freq's dtype, p each position (divided
        by `divisor` first: linear rope scaling), times `scale` when given (YaRN's attention factor)."""
        p = positions.to(inv_freq.dtype)
        if divisor is not None:
            # by a tensor on p's device: a Python number would make CUDA multiply by its reciprocal
            # (not the correctly rounded quotient the CPU and the rope_table kernel give)
            p = p / torch.full((), divisor, dtype=p.dtype, device=p.device)
        angles = p[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        return (cos, sin) if scale is None else (cos * scale, sin * scale)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        """Rotate the first d = 2·cos.shape[-1] dims of every head of x [n, heads, hd] by the angles of
        its token's row: pairs (i, i + d/2) for "neox", adjacent pairs (2i, 2i + 1) for "norm"."""
        half = cos.shape[-1]
        d = 2 * half
        xr = x[..., :d].to(_wide(x.dtype))
        c, s = cos[:, None, :], sin[:, None, :]
        if style == "neox":
            x1, x2 = xr[..., :half], xr[..., half:]
            rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        elif style == "norm":
            pairs = xr.unflatten(-1, (half, 2))
            x1, x2 = pairs[..., 0], pairs[..., 1]
            rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
        else:
            raise ValueError(f"rope style must be 'neox' or 'norm', not {style!r}")
        rotated = rotated.to(x.dtype)
        return rotated if d == x.shape[-1] else torch.cat([rotated, x[..., d:]], dim=-1)

    def normed_rope(self, x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    style: str) -> torch.Tensor:
        """rope(rms_norm(x, weight) over each head): a per-head q or k norm and the rotation after it;
        without a weight (a family whose q or k has no norm) the rotation alone."""
        return self.rope(x if weight is None else self.rms_norm(x, weight, eps), cos, sin, style)

    def normed_rope_qk(self, q: torch.Tensor, k: torch.Tensor, q_weight, k_weight, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed_rope(q, q_weight), normed_rope(k, k_weight)): an attention layer's q and k, in that
        order, with the same angles."""
        return (self.normed_rope(q, q_weight, eps, cos, sin, style),
                self.normed_rope(k, k_weight, eps, cos, sin, style))

    def normed_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight, k_weight, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, style: str, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, cells: torch.Tensor, v_norm: bool = False) -> torch.Tensor:
        """normed_rope_qk, then write_kv of the roped k and of v (with `v_norm` rms_norm(v, None, eps)
        first) at `cells` (a layer's whole buffers): the roped q."""
        if v_norm:
            v = self.rms_norm(v, None, eps)
        q, k = self.normed_rope_qk(q, k, q_weight, k_weight, eps, cos, sin, style)
        self.write_kv(k_cache, v_cache, cells, k, v)
        return q

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up (SwiGLU's product before its down projection)."""
        return F.silu(gate) * up

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) · up (GeGLU's product before its down projection)."""
        return F.gelu(gate, approximate="tanh") * up

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) · up for a GLU activation: "silu" (silu_mul) or "gelu_tanh" (gelu_mul)."""
        if act == "silu":
            return self.silu_mul(gate, up)
        if act == "gelu_tanh":
            return self.gelu_mul(gate, up)
        raise ValueError(f"GLU activation must be 'silu' or 'gelu_tanh', not {act!r}")

    def linear_glu(self, gate: torch.Tensor, up: torch.Tensor, w, act: str) -> torch.Tensor:
        """(act(gate) · up) @ wᵀ: a GLU feed-forward's down product, `glu` then `linear`."""
        return self.linear(self.glu(gate, up, act), w)

    # ---- attention ---------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  scale: float, gate: torch.Tensor | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q·kᵀ·scale) v over the cells with k_pos ≤ q_pos (q [n, nh, dk], k, v [cells, nkv, d]),
        then the output gate ops.sigmoid_gated(o, gate) where given. Without `window` and `sinks`
        ops.causal_attention; with them (window 0 = no limit) ops.windowed_attention, the formula of
        the graphs that attend their own cells (ops.attend_cells). In batch-invariant mode each query
        row alone."""
        if window is None and sinks is None:
            def formula(qr, kk, vv, qp):
                return ops.causal_attention(qr, kk, vv, qp, k_pos, scale)
        else:
            def formula(qr, kk, vv, qp):
                return ops.windowed_attention(qr, kk, vv, qp, k_pos, scale, window or 0, sinks)
        if not rows_alone() or q.shape[0] <= 1:
            o = formula(q, k, v, q_pos)
        else:
            k, v = ops.acc(k), ops.acc(v)  # widened once for all rows
            o = torch.cat([formula(q[i:i + 1], k, v, q_pos[i:i + 1]) for i in range(q.shape[0])])
        return ops.sigmoid_gated(o, gate)

    def latent_attention(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, scale: float, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """Multi-head latent attention over latent cells kv [cells, 1, kv_lora + dr] = [c | rope(k_pe)]:
        scores (q_lat·c + q_pe·k_pe)·scale (q_lat [n, heads, kv_lora], q_pe [n, heads, dr]), values c:
        o [n, heads, kv_lora] in q_lat's dtype.

        Over every cell visible by position: `attention` of the joined query over kv as both K and V,
        then o's first kv_lora entries (runtime/graphs/deepseek2.py). Over the cells `chosen` [n, cells]
        (bool: DeepSeek Sparse Attention's selection, runtime/graphs/dsa.py, a subset of the visible
        ones): the masked softmax in the accumulation dtype, q_pe widened; each row alone in
        batch-invariant mode."""
        if chosen is None:
            o = self.attention(torch.cat([q_lat, q_pe], dim=-1), kv, kv, q_pos, k_pos, scale)
            return o[..., :q_lat.shape[-1]]
        lat = ops.acc(kv[:, 0])
        kvl = q_lat.shape[-1]

        def attend(r):
            scores = torch.einsum("nhl,tl->hnt", torch.cat([q_lat[r], ops.acc(q_pe[r])], dim=-1), lat) * scale
            probs = torch.softmax(scores.masked_fill(~chosen[None, r], float("-inf")), dim=-1)
            return torch.einsum("hnt,tl->nhl", probs, lat[:, :kvl])

        return ops.by_rows(q_lat.shape[0], attend).to(q_lat.dtype)

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                     weight_scale: float = 1.0) -> torch.Tensor:
        """DeepSeek Sparse Attention's indexer scores [n, cells]: Σ_j w_j · ReLU((q[:, j] · keys) · scale),
        w = weights · weight_scale (q [n, heads, D], weights [n, heads] and the result in the
        accumulation dtype, keys [cells, D]); each row alone in batch-invariant mode."""
        keys = ops.acc(keys)
        weights = weights * weight_scale

        def scores(r):
            qk = torch.einsum("nhd,td->nht", ops.acc(q[r]), keys) * scale
            return torch.einsum("nh,nht->nt", weights[r], F.relu(qk))

        return ops.by_rows(q.shape[0], scores)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """k_cache[cells] = k, v_cache[cells] = v in the caches' dtype (caches [cells, nkv, d], cells an
        int64 tensor on their device: what a captured graph replays with other cells)."""
        k_cache.index_copy_(0, cells, k.to(k_cache.dtype))
        v_cache.index_copy_(0, cells, v.to(v_cache.dtype))

    # ---- Gated DeltaNet ---------------------------------------------------------------------------
    def gdn_gates(self, b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor):
        """(g, β) [n, heads] of the delta rule (runtime/graphs/gdn.py `gates`): β = σ(b),
        g = a · softplus(alpha + dt_bias), in the accumulation dtype; b, alpha [n, heads] or
        [n, groups, heads / groups] in any float dtype (cast and made [n, heads] rows first), a,
        dt_bias [heads] in the accumulation dtype.

        On the CPU a batch of up to gdn.MAX_ALONE_ROWS tokens (decode, verification) is computed one
        token at a time: torch's CPU kernels take the last values of a call (under two vectors)
        through scalar code whose sigmoid and softplus round differently from its vector code, so a
        token's gates would depend on how many tokens share the call, and an 8-bit activation
        product downstream (runtime/dq_dot_i8.inc) can turn that last bit into another code: a
        verification batch would not give the bits of one-token decode steps."""
        def one(bb, aa):
            return a * F.softplus(aa + dt_bias), torch.sigmoid(bb)

        n = b.shape[0]
        b, alpha = (x.to(_wide(x.dtype)).flatten(1) for x in (b, alpha))
        if b.device.type != "cpu" or not 1 < n <= gdn.MAX_ALONE_ROWS:
            return one(b, alpha)
        rows = [one(b[t:t + 1], alpha[t:t + 1]) for t in range(n)]
        return torch.cat([g for g, _ in rows]), torch.cat([beta for _, beta in rows])

    def causal_conv(self, m: torch.Tensor, conv_state: torch.Tensor, weight, keep: int):
        """Depthwise causal conv + SiLU: (activations [n, C], windows after the last `keep` tokens)."""
        k_size = weight.shape[1]
        n = m.shape[0]
        x = torch.cat([conv_state.to(m.dtype), m], dim=0)  # [K-1+n, C]
        windows = x.unfold(0, k_size, 1)  # [n, C, K]
        wide = _wide(m.dtype)
        out = F.silu((windows.to(wide) * weight.to(wide)).sum(-1)).to(m.dtype)
        # the state after token i is inputs i+1 .. i+K-1 of x, i.e. x[i+1 : i+K]
        first = n - keep
        states = x.unfold(0, k_size - 1, 1)[first + 1: n + 1].transpose(1, 2)  # [keep, K-1, C]
        return out, states

    def delta_rule(self, q, k, v, g, beta, state, keep: int, lazy: bool = False, out: torch.Tensor | None = None,
                   exact: bool = False):
        """Outputs for every token and the states after each of the last `keep` tokens (with `lazy`, as
        gdn.PendingStates where the batched form computes them). The chunked form up to the last
        `keep` tokens, then the batched form for those (see gdn.delta_rule). `out` is where the
        caller will keep the state after the batch; forms that compute it directly write it there.
        `exact`: token by token, each token computed as a batch of that one token (the states as a
        tensor [keep, ...]): a token's output and state do not depend on the batch around it."""
        if exact:
            return token_by_token(self._one_token, q, k, v, g, beta, state, keep)
        n = q.shape[0]
        head = n - keep
        if keep <= gdn.BATCHED_MAX:
            def tail_form(*args, keep):
                return gdn.batched_delta_rule(*args, keep=keep, lazy=lazy)
        else:  # rings beyond a chunk
            tail_form = gdn.recurrent_delta_rule
        if head <= 0:
            return tail_form(q, k, v, g, beta, state, keep=keep)
        o_head, state = gdn.chunked_delta_rule(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
        o_tail, states = tail_form(q[head:], k[head:], v[head:], g[head:], beta[head:], state, keep=keep)
        return torch.cat([o_head, o_tail]), states

    def causal_conv_slots(self, m: torch.Tensor, ring: torch.Tensor, weight, src_slot: torch.Tensor,
                          dst_slots: torch.Tensor) -> torch.Tensor:
        """The conv with its windows in a ring [slots, K-1, C]: the window before the batch read from
        ring[src_slot[0]], the window after each of the last len(dst_slots) tokens written to
        ring[dst_slots[i]]; returns the activations [n, C]. Slots are int64 tensors on the ring's
        device, never read on the host."""
        out, windows = self.causal_conv(m, ring.index_select(0, src_slot)[0], weight, dst_slots.shape[0])
        ring.index_copy_(0, dst_slots, windows.to(ring.dtype))
        return out

    def delta_rule_slots(self, q, k, v, g, beta, ring: torch.Tensor, src_slot: torch.Tensor,
                         dst_slots: torch.Tensor, key_heads: str = gdn.TILED) -> torch.Tensor:
        """The delta rule with its states in a ring [slots, nv, dk, dv] (as causal_conv_slots); every
        kept token's state written whole. q, k may hold the key heads only (in the `key_heads`
        layout), v, g, beta the compute dtype (gdn.rule_inputs). Returns o [n, nv, dv] in the ring's
        dtype."""
        q, k, v, g, beta = gdn.rule_inputs(q, k, v, g, beta, ring.dtype, key_heads)
        o, states = self.delta_rule(q, k, v, g, beta, ring.index_select(0, src_slot)[0], dst_slots.shape[0],
                                    exact=rows_alone())
        ring.index_copy_(0, dst_slots, states.to(ring.dtype))
        return o

    def delta_rule_from_conv_slots(self, q, k, v, b, alpha, a, dt_bias, eps: float, scale: float,
                                   ring: torch.Tensor, src_slot: torch.Tensor, dst_slots: torch.Tensor,
                                   key_heads: str = gdn.TILED, gated_norm=None) -> torch.Tensor:
        """`delta_rule_slots` from the conv's q, k not yet normed and the gates' projections b, alpha
        with the per-head weights a, dt_bias (gdn.rule_from_conv: the norms, then the gates); with
        `gated_norm` = (weight, gate, eps, out_dtype), `gated_rms_norm` of its output after it."""
        q, k, g, beta = gdn.rule_from_conv(q, k, b, alpha, a, dt_bias, eps, scale)
        o = self.delta_rule_slots(q, k, v, g, beta, ring, src_slot, dst_slots, key_heads)
        return o if gated_norm is None else self.gated_rms_norm(o, *gated_norm)

    def conv_delta_rule_slots(self, m, windows: torch.Tensor, conv_weight, heads: tuple[int, int, int, int], b,
                              alpha, a, dt_bias, eps: float, scale: float, ring: torch.Tensor, src_slot: torch.Tensor,
                              dst_slots: torch.Tensor, key_heads: str = gdn.TILED, gated_norm=None) -> torch.Tensor:
        """`causal_conv_slots` of the pre-conv rows m into the windows ring, then
        `delta_rule_from_conv_slots` of its gdn.qkv_heads (heads = (nk, dk, nv, dv)), `gated_norm`
        included. The caller guarantees the source slot is not a destination
        (gdn.Recurrence.conv_delta_rule)."""
        c = self.causal_conv_slots(m, windows, conv_weight, src_slot, dst_slots)
        return self.delta_rule_from_conv_slots(*gdn.qkv_heads(c, heads), b, alpha, a, dt_bias, eps, scale, ring,
                                               src_slot, dst_slots, key_heads, gated_norm)

    def _one_token(self, q, k, v, g, beta, state):
        """(o [1, nv, dv], the state after the token) for a batch of one token."""
        o, states = gdn.recurrent_delta_rule(q, k, v, g, beta, state, keep=1)
        return o, states[0]


def token_by_token(step, q, k, v, g, beta, state, keep: int):
    """The delta rule one token at a time through `step` (a one-token form), each token's inputs a
    fresh tensor as in a batch of one: (o [n, nv, dv], states after the last `keep` tokens)."""
    n = q.shape[0]
    outs, kept = [], []
    for t in range(n):
        o, state = step(*(x[t:t + 1].clone() for x in (q, k, v, g, beta)), state)
        outs.append(o)
        if t >= n - keep:
            kept.append(state)
    return torch.cat(outs), torch.stack(kept)
