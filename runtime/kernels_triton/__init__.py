"""CUDA kernels in Triton for the runtime's hot operations (docs/runtime.md, "CUDA kernels (Triton)").

    quant_matmul(x, packed, qtype, n_out, n_in)          x @ Wᵀ, W packed in its GGUF type (result_dtype)
    quant_matmul(gate, ..., up=up, act=act)              (act(gate) · up) @ Wᵀ: a GLU's down product
    expert_matmul(x, experts, qtype, n_out, n_in, chosen)   row r @ W[chosen[r]]ᵀ: routed experts by index
    expert_matmul_pair(x, [experts, experts2], ...)      the same pairs by two expert tensors, one launch
    grouped_matmul(x, [packed, ...], qtype, [n_out, ...], n_in)   x @ Wᵢᵀ for several matrices, one launch
    quant_matmul_add_rms_norm(x, packed, qtype, n_out, n_in, h, weight, eps)   (h + x @ Wᵀ, its RMSNorm):
                                                         a residual add and norm ending the product's launch
    quant_matmul_add_normed(x, packed, ..., h, weight, eps, scale=None, then=None)   (h + rms_norm(x @ Wᵀ))
                                                         (· scale), its RMSNorm by `then`: Gemma's sandwich norm
    dequantize_rows(packed, qtype, rows, n_in, dtype)    packed rows -> values
    gdn_step(q, k, v, g, beta, states, src_slot, dst_slots, group=1)   the gated delta rule, 1-16 tokens
             (eps=, scale=, gate_weights=, conv=)        with q, k's norms, the gates and the conv in it
    causal_conv(m, states, weight, src_slot, dst_slots)       the short causal conv + SiLU
    rms_norm(x, weight, eps, residual=None, gate=None)   RMSNorm (+ the residual add, or a SiLU gate)
    l2_norm(x, eps, scale=None)                          x / ‖x‖ (· scale) (Gated DeltaNet's q and k)
    rope(x, cos, sin, style)                             NEOX / NORM rope of q or k
    rope_qk(q, k, cos, sin, style)                       q's and k's rope (and norms) in one launch
    rope_qk_store(q, k, v, ..., k_cache, v_cache, cells)  the same, k and v written into the caches
    rope_table(positions, inv_freq, divisor, scale)      a batch's rope cos / sin [n, half], one launch
    glu(gate, up, act)                                   a GLU's act(gate) · up (act "silu", "gelu_tanh")
    silu_mul(gate, up)                                   SwiGLU's silu(gate) · up
    softmax_topk(logits, k)                              the MoE softmax router: top-k experts, weights
    moe_combine(y, weights, chosen, shared, out_dtype)   Σ weight · routed expert output per row (+ shared)
    add_gated_shared(routed, shared, gate)               routed + shared · σ(gate), in shared's dtype
    add_shared(routed, shared)                           routed + shared, in shared's dtype
    grouped_topk(logits, k, sigmoid, bias, groups, ...)  the MoE router with a selection bias and groups
    gelu_mul(gate, up)                                   GeGLU's gelu_tanh(gate) · up
    gdn_gates(b, alpha, a, dt_bias)                      the Gated DeltaNet's decay and β
    attention(q, k, v, q_pos, k_pos, scale, gate=None, window=0, sinks=None, keep=None, q_rest=None)
                                                         causal attention over a whole K/V buffer
                                                         (sliding window, sinks, output gate, a key
                                                         mask, MLA's latent cells with V in K)
    write_kv(k_cache, v_cache, cells, k, v)              a batch's K/V into those buffers, in place
    gdn_chunked(q, k, v, g, beta, states, src_slot, dst_slots, group=1)   the gated delta rule for
                                                         prompts: chunks of 64 tokens, one launch
    index_scores(q, weights, keys, scale)                DeepSeek Sparse Attention's indexer scores [n, cells]

Importing this package does not import Triton; the first call does (a SpecconvError if it is not
installed). A Triton older than MIN_TRITON (3.6, the oldest they are tested on) counts as none:
`why_unavailable()` says so, and the CUDA backend warns once and runs the torch reference instead.
The kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1
set before the first call), which is how the tests check them without a GPU.
"""

from specconv.runtime.kernels_triton._common import MIN_TRITON, available, why_unavailable
from specconv.runtime.kernels_triton.activation import gdn_gates, gelu_mul, glu, silu_mul
from specconv.runtime.kernels_triton.attention import MAX_HEAD_DIM as MAX_ATTENTION_HEAD_DIM, attention, write_kv
from specconv.runtime.kernels_triton.conv import causal_conv
from specconv.runtime.kernels_triton.dequant import KERNEL_TYPES, dequantize_rows
from specconv.runtime.kernels_triton.gdn import MAX_TOKENS, gdn_step
from specconv.runtime.kernels_triton.indexer import MAX_INDEX_DIM, index_scores
from specconv.runtime.kernels_triton.matmul import (FUSED_MAX_ROWS, expert_matmul, expert_matmul_pair,
                                                    grouped_matmul, quant_matmul, quant_matmul_add_normed,
                                                    quant_matmul_add_rms_norm, result_dtype)
from specconv.runtime.kernels_triton.norm import MAX_WIDTH as MAX_NORM_WIDTH, l2_norm, rms_norm
from specconv.runtime.kernels_triton.rope import rope, rope_qk, rope_qk_store, rope_table
from specconv.runtime.kernels_triton.routing import (MAX_EXPERTS as MAX_ROUTED_EXPERTS, add_gated_shared, add_shared,
                                                     grouped_topk, moe_combine, softmax_topk)
from specconv.runtime.kernels_triton.gdn_chunked import gdn_chunked

__all__ = ["add_gated_shared", "attention", "available", "causal_conv", "dequantize_rows", "expert_matmul",
           "expert_matmul_pair", "gdn_gates", "gdn_step", "gelu_mul", "glu", "grouped_matmul", "l2_norm", "moe_combine",
           "quant_matmul", "quant_matmul_add_normed", "quant_matmul_add_rms_norm", "result_dtype", "rms_norm", "rope",
           "rope_qk", "rope_qk_store", "rope_table", "silu_mul", "softmax_topk",
           "why_unavailable", "write_kv", "FUSED_MAX_ROWS", "MIN_TRITON",
           "KERNEL_TYPES", "MAX_ATTENTION_HEAD_DIM", "MAX_NORM_WIDTH", "MAX_ROUTED_EXPERTS", "MAX_TOKENS",
           "gdn_chunked", "add_shared", "grouped_topk", "index_scores", "MAX_INDEX_DIM"]
