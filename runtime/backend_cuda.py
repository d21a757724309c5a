"""The CUDA backend (runtime/backend.py): the Triton kernels of runtime/kernels_triton where Triton is
installed and the call fits, the torch reference it inherits otherwise (float64, offloaded bytes
still in host memory, types without a kernel: Q2_K, Q3_K, the legacy and IQ4 types).

* `dequantize_rows`: kernels_triton.dequantize_rows for KERNEL_TYPES (runtime/dequant.py's values).
* `linear`: kernels_triton.quant_matmul for a stored matrix of a KERNEL_TYPE, or a dense float32
  matrix (read as F32 bytes, no copy: the weights a graph keeps float32, MoE routers and gates, in
  `--weights dense`), where its result has the torch reference's dtype (x's) — up to
  FUSED_MAX_ROWS rows in one pass over the packed weights whose per-row result does not depend on
  the number of rows; more rows (prompts) by dequantized tiles and cuBLAS, or, inside
  `batch_invariant(True)`, as pieces of FUSED_MAX_ROWS rows through the one-pass kernel, so that
  every row of a prompt gets the bits of a decode step.
* `linear_glu`: a GLU's down product (SwiGLU, GeGLU; routed experts' `PairedExperts` too) as one
  launch of the same product kernel reading act(gate) · up as its input rows (kernels_triton
  quant_matmul / expert_matmul with `up`): the bits of `glu` then `linear`, no launch for the GLU
  up to FUSED_MAX_ROWS rows (and in batch-invariant mode in pieces of that many); longer batches
  run glu's kernel, then the prompt path.
* `linear_group`: the weights that are stored matrices of a KERNEL_TYPE, grouped by type, through
  kernels_triton.grouped_matmul for up to FUSED_MAX_ROWS rows: one launch per type (per GROUP_MAX
  matrices) instead of one per weight, each output the bits of that weight's `linear`; a weight
  alone in its group, other weights and longer batches through `linear`.
* attention over each layer's whole fixed-size K/V buffer, written in place (`static_kv`): the
  same shapes at every step, as CUDA-graph capture needs. `attention` runs kernels_triton.attention,
  one launch for all rows and heads with the output gate (per value or per head), a sliding window
  and attention sinks fused (float32 / bfloat16 / float16, head dimensions up to
  MAX_ATTENTION_HEAD_DIM): the online softmax over fixed blocks and pieces of cells, one program per
  row, piece and KV head (its query heads as one tile), the pieces combined in a fixed order, so
  batch-invariant without a per-row loop. `write_kv`: a batch's K and
  V into those buffers by cell index, one launch (kernels_triton.write_kv) where the dtypes match.
* multi-head latent attention (DeepSeek-V3, DSA): `linear_per_head` (the absorption products by
  attn_k_b / attn_v_b) runs kernels_triton.expert_matmul with each (row, head) pair's head as its
  expert, the weights read packed; `latent_attention` runs kernels_triton.attention over the
  latent cells with V the view of their first kv_lora entries (each cell read once), the query in
  its two pieces and DSA's chosen keys as the key mask; `index_scores` (DSA's lightning indexer)
  runs kernels_triton.index_scores. One launch each, one program per row (batch-invariant).
* Gated DeltaNet states in ring slots (`slot_states`): `causal_conv_slots` and `delta_rule_slots`
  run kernels_triton.causal_conv / gdn_step, one launch each for up to MAX_TOKENS tokens, reading
  the state before the batch from its slot and writing each kept token's state into its own slot
  (slot indices as device tensors: nothing read on the host, a rollback picks a slot). Longer
  inputs take kernels_triton.gdn_chunked for the delta rule (chunks of 64 tokens, one launch) and
  the torch conv; inside `batch_invariant(True)` only a prompt's prefix does (`prompt_prefix`),
  other long batches take the kernels in pieces of MAX_TOKENS tokens, so that each of their tokens
  gets the bits of a decode step. float64 states take the torch forms.
  `delta_rule_from_conv_slots` hands gdn_step the conv's q, k
  and the gates' projections as they are: the L2 norms and the gates are computed in its launch
  (the bits of the separate kernels under the interpreter). `conv_delta_rule_slots` folds the
  conv in as well (gdn_step's `conv=`) for a batch of up to MAX_TOKENS whose source slot is not a
  destination (gdn.Recurrence: the memory's spare slot), and both fold the layer's gated output
  norm (gdn_step's `gated_norm=`, the bits of `gated_rms_norm`'s kernel) where that kernel would
  take it: the mixer is one launch between its products.
* `linear_add_rms_norm`: the product that ends a block's mixer or FFN (`linear`'s, `linear_glu`'s)
  with the residual add and RMSNorm after it in the product's launch (kernels_triton
  quant_matmul_add_rms_norm: its last tile to finish adds and normalises the rows, the bits of
  the product then `add_rms_norm`), up to FUSED_MAX_ROWS rows (in batch-invariant mode in pieces
  of that many); the two launches otherwise.
* around the products, one launch each where the tensors are float32 / bfloat16 / float16 on the
  kernels' device: `rms_norm` (also with the residual add before it, `add_rms_norm`, a SiLU gate
  after it, `gated_rms_norm`, or its output added to the residual stream and scaled, `add_normed`),
  `l2_norm`, `rope` (NEOX and NORM pairs; `normed_rope`: a per-head RMS norm first), `silu_mul`
  (SwiGLU's product), `gelu_mul` (GeGLU's; both kernels_triton.glu) and `gdn_gates`
  (kernels_triton.norm, .rope, .activation): float32 inside, the reference formula's operations in
  its order, each row reduced by one program (batch-invariant). `normed_rope_qk`: a layer's q and
  k in one launch (kernels_triton.rope_qk, each head the bits of its own `normed_rope`);
  `normed_rope_store`: that launch also writes k and v into the layer's buffers (rope_qk_store), so
  an attention layer's norms, rope and K/V store are one launch.
* `route_softmax_topk`: a softmax router's softmax, top-k and renormalisation in one launch
  (kernels_triton.softmax_topk), one program per row.
* `route_grouped`: a router with a selection bias, expert groups and scales (sigmoid or softmax
  scores: DeepSeek-V3, GLM-4.5, Gemma 4, Qwen3-MoE without renormalisation) in one launch
  (kernels_triton.grouped_topk), one program per row.
* `add_gated_shared`, `add_shared`: a MoE block's routed sum plus its (sigmoid-gated) shared
  expert, one launch. `moe_out`: by pairs, the un-gated shared experts' add and the rounding into
  the compute dtype inside the combine launch (no launch of their own).
* `moe`: decode and verification batches (up to GATHER_MAX_ROWS rows) of stored experts of a
  KERNEL_TYPE pair every row with each of its k experts and run experts.ffn once over the n·k
  pairs, each product `kernels_triton.expert_matmul` (one launch: the expert index read on the
  device, no gathered copy of the experts' bytes or of x; gate and up together,
  `expert_matmul_pair`, where `linear_group` gets both); the pairs' outputs summed per row in
  increasing expert order by `kernels_triton.moe_combine` (one launch), as the torch reference's
  by-index form sums them, with the same bits. Longer batches and other weights take the torch
  reference.
"""

from __future__ import annotations

import sys

import torch
from gguf import GGMLQuantizationType as QType

from specconv.archs import names
from specconv.runtime import dequant, rows_first
from specconv.runtime.backend import Experts, prompt_prefix, rows_alone
from specconv.runtime.backend_torch import GATHER_MAX_ROWS, TorchBackend
from specconv.runtime.graphs import gdn
from specconv.runtime.graphs.ops import dense
from specconv.runtime.stored import StoredWeight

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CudaBackend(TorchBackend):
    name = "cuda"
    static_kv = True
    slot_states = True

    def __init__(self, kernels=None, device_types: tuple[str, ...] = ("cuda",)):
        """`kernels`: the kernel module (runtime/kernels_triton; found by itself when None: none without
        Triton). `device_types`: where the kernels run (the CPU too under TRITON_INTERPRET=1, which is
        how the tests run this backend without a GPU)."""
        self.kernels = _triton_kernels() if kernels is None else kernels
        self.device_types = device_types
        self._head_indices: dict = {}  # (heads, device) -> linear_per_head's pair -> head index

    def stored_type(self, qtype, shape: tuple[int, ...]):
        """A Q8_0 matrix whose rows the kernels read 16 bytes at a time once rearranged is kept as Q8_0_ROWS
        (runtime/rows_first.py) where the kernels run."""
        kept = rows_first.kept_as(qtype, shape) if self.kernels is not None else None
        return qtype if kept is None else kept

    def _kernel_for(self, raw: torch.Tensor, qtype) -> bool:
        return (self.kernels is not None and qtype in self.kernels.KERNEL_TYPES
                and raw.device.type in self.device_types and raw.numel() > 0)

    def dequantize_rows(self, raw: torch.Tensor, qtype, dtype: torch.dtype) -> torch.Tensor:
        # F32 rows into another dtype: torch's one cast launch, rounded as the reference rounds
        if (self._kernel_for(raw, qtype) and dtype in KERNEL_DTYPES and not dequant.is_view(qtype, dtype)
                and qtype != QType.F32):
            dequant.check_rows(raw, qtype, dtype)
            block, size = dequant.block_geometry(qtype)
            row_bytes = raw.shape[-1]
            rows, n_in = raw.numel() // row_bytes, row_bytes // size * block
            values = self.kernels.dequantize_rows(raw.reshape(rows, row_bytes), qtype, rows, n_in, dtype)
            return values.reshape(*raw.shape[:-1], n_in)
        return super().dequantize_rows(raw, qtype, dtype)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, PairedExperts):
            n_out, n_in = w.shape
            xs, fanout = w.rows_of(x)
            return self.kernels.expert_matmul(xs, w.experts.raw, w.experts.qtype, n_out, n_in, w.pairs, fanout)
        if self._stored_matrix(x, w, x.dtype) or self._dense_float32(x, w, x.dtype):
            return self._kernel_product(x, w)
        return super().linear(x, w)

    def linear_wide(self, x: torch.Tensor, w) -> torch.Tensor:
        """By an F32 weight the product kernel reads 16-bit rows as they are and widens them inside
        (the bits of acc(x)): no cast launch first."""
        if x.dtype in (torch.bfloat16, torch.float16) and (self._stored_matrix(x, w, torch.float32)
                                                           or self._dense_float32(x, w, torch.float32)):
            return self._kernel_product(x, w)
        return super().linear_wide(x, w)

    def linear_glu(self, gate: torch.Tensor, up: torch.Tensor, w, act: str) -> torch.Tensor:
        """The product kernel computes act(gate) · up where it reads its input rows (the bits of glu
        then linear), for the weights `linear` gives the kernel; glu then linear otherwise."""
        if self._glu_input(gate, up):
            if isinstance(w, PairedExperts):
                n_out, n_in = w.shape
                xs, fanout = w.rows_of(gate)
                return self.kernels.expert_matmul(xs, w.experts.raw, w.experts.qtype, n_out, n_in, w.pairs, fanout,
                                                  up=up.reshape(xs.shape), act=act)
            if self._stored_matrix(gate, w, gate.dtype) or self._dense_float32(gate, w, gate.dtype):
                return self._kernel_product(gate, w, up, act)
        return super().linear_glu(gate, up, w, act)

    def _glu_input(self, gate: torch.Tensor, up: torch.Tensor) -> bool:
        """Whether the product kernel reads act(gate) · up itself: one kernel dtype, device and shape,
        contiguous last dimensions (the halves of a fused gate/up product are read in place)."""
        return (self._pointwise(gate, up) and gate.dtype == up.dtype and gate.shape == up.shape and gate.dim() > 0
                and gate.stride(-1) == 1 and up.stride(-1) == 1)

    @staticmethod
    def _weight_bytes(w) -> tuple[torch.Tensor, QType]:
        """(bytes, type) the product kernel reads for w: a stored matrix's (counted as a use), a dense
        float32 one's as F32."""
        if isinstance(w, StoredWeight):
            _count(w)
            return w.raw, w.qtype
        return w.view(torch.uint8), QType.F32

    def _kernel_product(self, x: torch.Tensor, w, up: torch.Tensor | None = None, act: str | None = None):
        """x @ wᵀ by the product kernel (_weight_bytes; with `up`, (act(x) · up) @ wᵀ)."""
        return self._packed_product(x, *self._weight_bytes(w), *w.shape, up, act)

    def _in_pieces(self, xs: torch.Tensor, us: torch.Tensor | None, product) -> list:
        """product(first row, x rows, up rows or None) over pieces of FUSED_MAX_ROWS rows of xs [rows,
        n_in] (and us): a batch-invariant batch's rows each through the one-pass kernel, as in a
        decode step."""
        step = self.kernels.FUSED_MAX_ROWS
        return [product(i, xs[i:i + step], None if us is None else us[i:i + step])
                for i in range(0, xs.shape[0], step)]

    def _packed_product(self, x: torch.Tensor, raw: torch.Tensor, qtype, n_out: int, n_in: int,
                        up: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
        """x @ Wᵀ (with `up`, (act(x) · up) @ Wᵀ) by kernels_triton.quant_matmul, W's bytes `raw`
        [n_out, row bytes]; in batch-invariant mode a longer batch in pieces of FUSED_MAX_ROWS rows
        (_in_pieces)."""
        if up is None:
            x = x.contiguous()
        xs = x.reshape(-1, n_in)
        if rows_alone() and xs.shape[0] > self.kernels.FUSED_MAX_ROWS:
            pieces = self._in_pieces(xs, None if up is None else up.reshape(-1, n_in),
                                     lambda _, xp, up_rows: self.kernels.quant_matmul(xp, raw, qtype, n_out, n_in,
                                                                                      up=up_rows, act=act))
            return torch.cat(pieces).reshape(*x.shape[:-1], n_out)
        return self.kernels.quant_matmul(x, raw, qtype, n_out, n_in, up=up, act=act)

    def _stored_matrix(self, x: torch.Tensor, w, dtype: torch.dtype) -> bool:
        """Whether the quantized-product kernels take x @ wᵀ with a result in `dtype` (the torch
        reference's: x's for `linear`, float32 for `linear_wide`)."""
        return (isinstance(w, StoredWeight) and w.ndim == 2 and self._kernel_for(w.raw, w.qtype)
                and x.dtype in KERNEL_DTYPES and x.device == w.raw.device
                and self.kernels.result_dtype(w.qtype, x.dtype) == dtype)

    def _dense_float32(self, x: torch.Tensor, w, dtype: torch.dtype) -> bool:
        """Whether the product kernel takes x @ wᵀ for a dense float32 matrix (its bytes read as F32):
        where the reference's result `dtype` is float32 (`linear` multiplies w in x's dtype: float32
        rows only; `linear_wide` any), up to FUSED_MAX_ROWS rows (or any number in batch-invariant
        mode); cuBLAS through torch otherwise."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return (self.kernels is not None and isinstance(w, torch.Tensor) and w.dtype == torch.float32
                and w.dim() == 2 and w.numel() > 0 and w.stride(-1) == 1 and dtype == torch.float32
                and x.dtype in KERNEL_DTYPES and x.shape[-1] == w.shape[1] and w.device == x.device
                and w.device.type in self.device_types
                and (0 < rows <= self.kernels.FUSED_MAX_ROWS or (rows > 0 and rows_alone())))

    def linear_group(self, x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
        if len(ws) == 2 and all(isinstance(w, PairedExperts) for w in ws) and ws[0].pairs_with(ws[1]):
            xs, fanout = ws[0].rows_of(x, ws[1])  # an expert FFN's gate and up by pairs: one launch
            n_out, n_in = ws[0].shape
            return self.kernels.expert_matmul_pair(xs, [w.experts.raw for w in ws], ws[0].experts.qtype, n_out, n_in,
                                                   ws[0].pairs, fanout)
        out = [None] * len(ws)
        groups: dict = {}  # qtype -> indices of the weights of that type the kernels take
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if self.kernels is not None and 0 < rows <= self.kernels.FUSED_MAX_ROWS:
            for i, w in enumerate(ws):
                if self._stored_matrix(x, w, x.dtype) and w.shape[1] == x.shape[-1]:
                    groups.setdefault(w.qtype, []).append(i)
        packed_x = x.contiguous() if groups else x
        for qtype, members in groups.items():
            if len(members) < 2:
                continue
            for i in members:
                _count(ws[i])
            ys = self.kernels.grouped_matmul(packed_x, [ws[i].raw for i in members], qtype,
                                             [ws[i].shape[0] for i in members], x.shape[-1])
            for i, y in zip(members, ys):
                out[i] = y
        return tuple(self.linear(x, w) if y is None else y for w, y in zip(ws, out))

    def linear_per_head(self, x: torch.Tensor, w) -> torch.Tensor:
        """Decode and verification batches (up to GATHER_MAX_ROWS rows; any number in batch-invariant
        mode, in pieces of that many) by a stored 3-D weight of a KERNEL_TYPE: kernels_triton.expert_matmul
        with the head as the expert of each (row, head) pair, x read in place (a strided q[..., :dn]
        too), one launch per piece; each pair the bits of a one-row product by its head's matrix."""
        n, heads, n_in = x.shape
        if not (isinstance(w, StoredWeight) and w.ndim == 3 and w.shape[0] == heads and w.shape[2] == n_in
                and self._kernel_for(w.raw, w.qtype) and x.dtype in KERNEL_DTYPES and x.device == w.raw.device
                and self.kernels.result_dtype(w.qtype, x.dtype) == x.dtype and (n <= GATHER_MAX_ROWS or rows_alone())
                and x.stride(-1) == 1 and x.stride(0) == heads * x.stride(1)):
            return super().linear_per_head(x, w)
        index = self._head_index(heads, x.device)
        if w.counter is not None:
            w.counter.bytes += w.raw.numel() * n  # each (row, head) pair reads its head's matrix
        pieces = [self.kernels.expert_matmul(x[a:a + GATHER_MAX_ROWS].reshape(-1, n_in), w.raw, w.qtype, w.shape[1],
                                             n_in, index[:min(GATHER_MAX_ROWS, n - a) * heads])
                  for a in range(0, n, GATHER_MAX_ROWS)]
        return _joined(pieces).view(n, heads, w.shape[1])

    def _head_index(self, heads: int, device: torch.device) -> torch.Tensor:
        """[GATHER_MAX_ROWS · heads] int32: pair r's head r % heads, made on the device once (its first
        call is an eager forward: a CUDA graph's warm-up precedes its capture) and sliced per batch."""
        key = (heads, device)
        if key not in self._head_indices:
            self._head_indices[key] = torch.arange(GATHER_MAX_ROWS * heads, dtype=torch.int32, device=device) % heads
        return self._head_indices[key]

    # ---- routed experts ------------------------------------------------------------------------------
    def moe(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts) -> torch.Tensor:
        if self._pairs_fit(x, weights, experts):
            return self.moe_by_pairs(x, weights, chosen, experts)
        return super().moe(x, weights, chosen, experts)

    def moe_out(self, x, weights, chosen, experts: Experts, shared=None) -> torch.Tensor:
        """By pairs, the shared experts' add and the rounding into x's dtype inside the combine launch
        (shared: x's dtype and shape [n, out], on x's device)."""
        width = experts.down.shape[1]
        if self._pairs_fit(x, weights, experts) and (shared is None or (
                shared.dtype == x.dtype and shared.device == x.device and shared.shape == (x.shape[0], width))):
            return self.moe_by_pairs(x, weights, chosen, experts, shared, x.dtype)
        return super().moe_out(x, weights, chosen, experts, shared)

    def _pairs_fit(self, x: torch.Tensor, weights: torch.Tensor, experts: Experts) -> bool:
        """Whether moe_by_pairs takes the batch: decode / verification rows, stored experts of a kernel type."""
        stored = [w for w in (experts.gate, experts.up, experts.down) if w is not None]
        return (0 < x.shape[0] <= GATHER_MAX_ROWS and x.dtype in KERNEL_DTYPES and weights.dtype in KERNEL_DTYPES
                and all(isinstance(w, StoredWeight) and w.ndim == 3 and self._kernel_for(w.raw, w.qtype)
                        and w.raw.device == x.device and self.kernels.result_dtype(w.qtype, x.dtype) == x.dtype
                        for w in stored))

    def route_softmax_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch (kernels_triton.softmax_topk) for float32 logits of up to MAX_ROUTED_EXPERTS
        experts: the chosen set is the reference's where no logits tie (a tie: the lowest index)."""
        if not (self._pointwise(logits, dtypes=(torch.float32,)) and logits.dim() == 2
                and 0 < k <= logits.shape[-1] <= self.kernels.MAX_ROUTED_EXPERTS):
            return super().route_softmax_topk(logits, k)
        return self.kernels.softmax_topk(logits.contiguous(), k)

    def route_grouped(self, logits, k, gating, bias=None, groups=1, groups_used=1, renormalise=True, scale=1.0,
                      expert_scale=None):
        """One launch (kernels_triton.grouped_topk) for float32 logits of up to MAX_ROUTED_EXPERTS experts
        and float32 bias / expert scale vectors on their device: the reference's chosen experts
        (equal choices: the lowest index) wherever the kernel's scores have its bits."""
        n_experts = logits.shape[-1] if logits.dim() == 2 else 0
        vectors = [t for t in (bias, expert_scale) if t is not None]
        grouped = groups is not None and groups > 1 and groups_used != groups
        if not (self._pointwise(logits, *vectors, dtypes=(torch.float32,)) and 0 < k <= n_experts
                and n_experts <= self.kernels.MAX_ROUTED_EXPERTS and all(t.shape == (n_experts,) for t in vectors)
                and gating in (names.EXPERT_GATING_SIGMOID, names.EXPERT_GATING_SOFTMAX)
                and (not grouped or (n_experts % groups == 0 and n_experts // groups >= 2
                                     and 0 < groups_used < groups and k <= groups_used * (n_experts // groups)))):
            return super().route_grouped(logits, k, gating, bias, groups, groups_used, renormalise, scale, expert_scale)
        bias, expert_scale = (None if t is None else t.contiguous() for t in (bias, expert_scale))
        return self.kernels.grouped_topk(logits.contiguous(), k, gating == names.EXPERT_GATING_SIGMOID, bias,
                                         groups=groups if grouped else 1, groups_used=groups_used if grouped else 1,
                                         renormalise=renormalise, scale=scale, expert_scale=expert_scale)

    def add_shared(self, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """One launch (kernels_triton.add_shared) for a float32 routed sum."""
        if not (self._pointwise(shared) and self._pointwise(routed, dtypes=(torch.float32,)) and shared.dim() == 2
                and routed.shape == shared.shape and routed.device == shared.device):
            return super().add_shared(routed, shared)
        return self.kernels.add_shared(routed.contiguous(), shared.contiguous())

    def add_gated_shared(self, routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """One launch (kernels_triton.add_gated_shared) for float32 routed sums and gate logits."""
        if not (self._pointwise(shared) and self._pointwise(routed, gate, dtypes=(torch.float32,))
                and shared.dim() == 2 and routed.shape == shared.shape and gate.shape == (shared.shape[0], 1)
                and routed.device == gate.device == shared.device):
            return super().add_gated_shared(routed, shared, gate)
        return self.kernels.add_gated_shared(routed.contiguous(), shared.contiguous(), gate.contiguous())

    def moe_by_pairs(self, x, weights, chosen, experts: Experts, shared=None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every (row, slot) pair through its expert at once: experts.ffn over the n·k pairs in row-major
        order, each product expert_matmul (the first ones read each row of x once for its k pairs);
        then kernels_triton.moe_combine adds a row's terms in increasing expert order, as the by-index
        reference does (then `shared`, rounded into out_dtype: moe_out). No sort, gather or repeated
        copy of x: one launch per product, one to combine."""
        pairs = chosen.reshape(-1)
        y = experts.ffn(x, *(None if w is None else PairedExperts(w, pairs)
                             for w in (experts.gate, experts.up, experts.down)))
        return self.kernels.moe_combine(y.reshape(pairs.shape[0], -1), weights.contiguous(), chosen.contiguous(),
                                        None if shared is None else shared.contiguous(), out_dtype)

    # ---- around the products: one kernel each ------------------------------------------------------
    def _pointwise(self, *tensors: torch.Tensor, dtypes=KERNEL_DTYPES) -> bool:
        """Whether the one-launch kernels of norms, rope and activations take these tensors."""
        return (self.kernels is not None and all(t.device.type in self.device_types and t.dtype in dtypes
                                                  and t.device == tensors[0].device for t in tensors))

    def _norm_weight(self, weight, x: torch.Tensor):
        """A norm's weight as a tensor the kernel reads (None: no weight), or False where it cannot."""
        if weight is None:
            return None
        values = weight.dense(torch.float32) if isinstance(weight, StoredWeight) else weight
        fits = values.dim() == 1 and values.shape[0] == x.shape[-1] and self._pointwise(x, values)
        return values if fits else False

    def _norm_fits(self, x: torch.Tensor) -> bool:
        return self._pointwise(x) and x.dim() > 0 and 0 < x.shape[-1] <= self.kernels.MAX_NORM_WIDTH

    def rms_norm(self, x: torch.Tensor, weight, eps: float) -> torch.Tensor:
        values = self._norm_weight(weight, x) if self._norm_fits(x) else False
        if values is False:
            return super().rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, values, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight, eps: float):
        values = self._norm_weight(weight, h) if self._norm_fits(h) and self._pointwise(h, delta) else False
        if values is False or delta.dtype != h.dtype or delta.shape != h.shape:
            return super().add_rms_norm(h, delta, weight, eps)
        return self.kernels.rms_norm(h, values, eps, residual=delta)

    def linear_add_rms_norm(self, x: torch.Tensor, w, h: torch.Tensor, weight, eps: float,
                            up: torch.Tensor | None = None, act: str | None = None):
        """For the weights `linear` (`linear_glu` with `up`) gives the product kernel and a norm
        add_rms_norm gives its kernel, up to FUSED_MAX_ROWS rows: kernels_triton.quant_matmul_add_rms_norm
        (one launch, the product's, which ends with the residual add and the norm where the rows' width
        allows, else the two launches: the same bits either way); in batch-invariant
        mode longer batches in pieces of that many rows (each row as in a decode step); otherwise
        the product, then add_rms_norm."""
        product = (not isinstance(w, PairedExperts) and (up is None or self._glu_input(x, up))
                   and (self._stored_matrix(x, w, x.dtype) or self._dense_float32(x, w, x.dtype)))
        values = (self._norm_weight(weight, h) if product and self._norm_fits(h) and self._pointwise(h, x)
                  else False)
        if values is False or h.dtype != x.dtype or h.shape != (*x.shape[:-1], w.shape[0]):
            return super().linear_add_rms_norm(x, w, h, weight, eps, up, act)
        n_out, n_in = w.shape
        step = self.kernels.FUSED_MAX_ROWS
        xs = (x.contiguous() if up is None else x).reshape(-1, n_in)
        rows = xs.shape[0]
        if rows == 0 or (rows > step and not rows_alone()):
            return super().linear_add_rms_norm(x, w, h, weight, eps, up, act)
        raw, qtype = self._weight_bytes(w)
        hs = h.reshape(-1, n_out)

        def piece(first: int, xp: torch.Tensor, up_rows: torch.Tensor | None):
            return self.kernels.quant_matmul_add_rms_norm(xp, raw, qtype, n_out, n_in, hs[first:first + xp.shape[0]],
                                                          values, eps, up=up_rows, act=act)

        pieces = self._in_pieces(xs, None if up is None else up.reshape(-1, n_in), piece)
        if len(pieces) == 1:
            return tuple(t.view(h.shape) for t in pieces[0])
        return tuple(torch.cat(parts).view(h.shape) for parts in zip(*pieces))

    def add_normed(self, h: torch.Tensor, x: torch.Tensor, weight, eps: float, scale=None) -> torch.Tensor:
        values = self._norm_weight(weight, x) if self._norm_fits(x) and self._pointwise(x, h) else False
        s = scale.dense(torch.float32) if isinstance(scale, StoredWeight) else scale
        if (values is False or h.dtype != x.dtype or h.shape != x.shape
                or (s is not None and (s.numel() != 1 or s.dtype != torch.float32 or s.device != x.device))):
            return super().add_normed(h, x, weight, eps, scale)
        return self.kernels.rms_norm(x, values, eps, add_to=h, out_scale=s)

    def gated_rms_norm(self, x: torch.Tensor, weight, gate: torch.Tensor, eps: float,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
        values = self._norm_weight(weight, x) if self._norm_fits(x) and self._pointwise(x, gate) else False
        if values is False or gate.shape != x.shape or out_dtype not in (None,) + KERNEL_DTYPES:
            return super().gated_rms_norm(x, weight, gate, eps, out_dtype)
        return self.kernels.rms_norm(x, values, eps, gate=gate, out_dtype=out_dtype)

    def l2_norm(self, x: torch.Tensor, eps: float, scale: float | None = None) -> torch.Tensor:
        if not self._norm_fits(x):
            return super().l2_norm(x, eps, scale)
        return self.kernels.l2_norm(x, eps, scale=scale)

    def _rope_fits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        return (x.dim() == 3 and cos.dim() == 2 and self._pointwise(x) and cos.device == x.device
                and self._pointwise(cos, sin, dtypes=(torch.float32,)) and x.shape[-1] >= 2 * cos.shape[-1] >= 2)

    def rope_table(self, positions: torch.Tensor, inv_freq: torch.Tensor, divisor: float | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._pointwise(inv_freq, dtypes=(torch.float32,)) and positions.device == inv_freq.device
                and positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64) and inv_freq.dim() == 1):
            return super().rope_table(positions, inv_freq, divisor, scale)
        return self.kernels.rope_table(positions, inv_freq, divisor, scale)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        if not self._rope_fits(x, cos, sin):
            return super().rope(x, cos, sin, style)
        return self.kernels.rope(x, cos, sin, style)

    def normed_rope(self, x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    style: str) -> torch.Tensor:
        values = self._norm_weight(weight, x) if self._rope_fits(x, cos, sin) else False
        if values is None or values is False:  # no norm (the rotation alone), or no kernel for it
            return super().normed_rope(x, weight, eps, cos, sin, style)
        return self.kernels.rope(x, cos, sin, style, norm_weight=values, eps=eps)

    def _qk_weights(self, q, k, q_weight, k_weight, cos, sin):
        """(q's, k's norm weight) as rope_qk reads them (None: no norm), or None where it cannot take q
        and k together (then each goes its own way)."""
        if not (self._rope_fits(q, cos, sin) and self._rope_fits(k, cos, sin) and q.dtype == k.dtype
                and q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1]):
            return None
        weights = self._norm_weight(q_weight, q), self._norm_weight(k_weight, k)
        return None if any(w is False for w in weights) else weights

    def normed_rope_qk(self, q, k, q_weight, k_weight, eps, cos, sin, style):
        weights = self._qk_weights(q, k, q_weight, k_weight, cos, sin)
        if weights is None:
            return super().normed_rope_qk(q, k, q_weight, k_weight, eps, cos, sin, style)
        return self.kernels.rope_qk(q, k, cos, sin, style, *weights, eps=eps)

    def normed_rope_store(self, q, k, v, q_weight, k_weight, eps, cos, sin, style, k_cache, v_cache, cells):
        """One launch: q's and k's norms and rope, k and v into the caches (kernels_triton.rope_qk_store),
        where write_kv's kernel would take k and v."""
        weights = self._qk_weights(q, k, q_weight, k_weight, cos, sin)
        if not (weights is not None and self._pointwise(k_cache, v_cache, v) and k_cache.device == q.device
                and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and cells.device == q.device
                and cells.dtype == torch.int64 and cells.dim() == 1):
            return super().normed_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, style, k_cache, v_cache,
                                             cells)
        return self.kernels.rope_qk_store(q, k, v, cos, sin, style, k_cache, v_cache, cells, *weights, eps=eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not (self._pointwise(gate, up) and gate.dtype == up.dtype and gate.shape == up.shape and gate.dim()):
            return super().silu_mul(gate, up)
        return self.kernels.silu_mul(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not (self._pointwise(gate, up) and gate.dtype == up.dtype and gate.shape == up.shape and gate.dim()):
            return super().gelu_mul(gate, up)
        return self.kernels.gelu_mul(gate, up)

    def gdn_gates(self, b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor):
        """The kernel reads b and alpha in the compute dtype, as the projections left them (a
        [n, groups, r] view included): no cast or copy before it."""
        if not (b.dim() in (2, 3) and b.shape == alpha.shape and self._pointwise(b, alpha)
                and self._pointwise(a, dt_bias, dtypes=(torch.float32,)) and a.device == b.device
                and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (b, alpha))):
            return super().gdn_gates(b, alpha, a, dt_bias)
        return self.kernels.gdn_gates(b, alpha, a, dt_bias)

    # ---- attention ---------------------------------------------------------------------------------
    def attention(self, q, k, v, q_pos, k_pos, scale, gate=None, window=None, sinks=None):
        tensors = (q, k, v) if gate is None else (q, k, v, gate)
        if not (self._pointwise(*tensors) and q.dim() == k.dim() == v.dim() == 3 and k.shape[1] > 0
                and q.shape[1] % k.shape[1] == 0 and 0 < max(q.shape[-1], v.shape[-1])
                <= self.kernels.MAX_ATTENTION_HEAD_DIM and q_pos.device == k_pos.device == q.device
                and (gate is None or gate.shape in (q.shape[:2] + v.shape[-1:], q.shape[:2]))
                and (sinks is None or (sinks.device == q.device and sinks.dtype == torch.float32
                                       and sinks.shape == (q.shape[1],)))):
            return super().attention(q, k, v, q_pos, k_pos, scale, gate, window, sinks)
        return self.kernels.attention(q, k, v, q_pos, k_pos, scale, gate, window or 0,
                                      None if sinks is None else sinks.contiguous())

    def latent_attention(self, q_lat, q_pe, kv, q_pos, k_pos, scale, chosen=None):
        """kernels_triton.attention with V the view of kv's first kv_lora entries, the query in its two
        pieces (q_pe read in its own dtype) and `chosen` as the key mask: one launch, each latent cell
        read once, no concatenation of the query."""
        kvl = q_lat.shape[-1]
        if not (self._pointwise(q_lat, q_pe, kv) and q_lat.dim() == q_pe.dim() == kv.dim() == 3 and kv.shape[1] == 1
                and kv.shape[-1] == kvl + q_pe.shape[-1] and max(kvl, q_pe.shape[-1]) <= self.kernels.MAX_ATTENTION_HEAD_DIM
                and q_pos.device == k_pos.device == q_lat.device and q_pe.stride(-1) == 1 and q_lat.stride(-1) == 1
                and kv.stride(-1) == 1 and (chosen is None or (chosen.device == q_lat.device and chosen.dim() == 2
                                                               and chosen.stride(-1) == 1))):
            return super().latent_attention(q_lat, q_pe, kv, q_pos, k_pos, scale, chosen)
        return self.kernels.attention(q_lat, kv, kv[..., :kvl], q_pos, k_pos, scale, keep=chosen, q_rest=q_pe)

    def index_scores(self, q, weights, keys, scale, weight_scale=1.0):
        """kernels_triton.index_scores for float32 weights (one launch: each row's keys read once per
        block of cells, every head against them; the weights scaled inside)."""
        if not (self._pointwise(q, keys) and self._pointwise(weights, dtypes=(torch.float32,))
                and q.device == weights.device == keys.device and q.dim() == 3 and keys.dim() == 2
                and weights.shape == q.shape[:2] and keys.shape[-1] == q.shape[-1]
                and 0 < q.shape[-1] <= self.kernels.MAX_INDEX_DIM and q.stride(-1) == 1 and keys.stride(-1) == 1):
            return super().index_scores(q, weights, keys, scale, weight_scale)
        return self.kernels.index_scores(q, weights.contiguous(), keys, scale, weight_scale)

    def write_kv(self, k_cache, v_cache, cells, k, v):
        if not (self._pointwise(k_cache, v_cache, k, v) and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
                and cells.device == k.device and cells.dtype == torch.int64 and cells.dim() == 1):
            return super().write_kv(k_cache, v_cache, cells, k, v)
        self.kernels.write_kv(k_cache, v_cache, cells, k, v)

    # ---- Gated DeltaNet, states in ring slots ------------------------------------------------------
    def _recurrent_kernels(self, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether the Triton recurrent kernels take a float32 ring and these inputs."""
        return (self.kernels is not None and ring.device.type in self.device_types and ring.dtype == torch.float32
                and all(t.dtype in KERNEL_DTYPES for t in tensors))

    def _recurrent_pieces(self, n: int, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether the Triton recurrent kernels take these n tokens (in pieces where n > MAX_TOKENS)."""
        return self._recurrent_kernels(ring, *tensors) and (n <= self.kernels.MAX_TOKENS or rows_alone())

    def _chunked(self, n: int, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether n tokens take the chunked kernel (kernels_triton.gdn_chunked, one launch): more than a
        gdn_step launch holds, outside batch-invariant mode or in a prompt's prefix
        (backend.prompt_prefix, evaluated alike by plain and speculative decoding). Other long batches
        in batch-invariant mode — a verification of more than MAX_TOKENS - 1 drafts, its re-evaluation
        after a checkpoint rollback — keep gdn_step's per-token bits, as the decode steps they must
        equal."""
        return (self._recurrent_kernels(ring, *tensors) and n > self.kernels.MAX_TOKENS
                and (not rows_alone() or prompt_prefix()))

    def causal_conv_slots(self, m, ring, weight, src_slot, dst_slots):
        n = m.shape[0]
        if not (self._recurrent_pieces(n, ring, m) and ring.shape[1] >= 1):
            return super().causal_conv_slots(m, ring, weight, src_slot, dst_slots)
        values = weight.dense(torch.float32) if isinstance(weight, StoredWeight) else weight.to(torch.float32)
        return _joined([self.kernels.causal_conv(m[a:b], ring, values, src, dst)
                        for a, b, src, dst in ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)])

    def delta_rule_slots(self, q, k, v, g, beta, ring, src_slot, dst_slots, key_heads: str = gdn.TILED):
        """The kernel reads each value head's key head (`key_heads` layout) and every input in its
        dtype: q, k with the key heads only and v in the compute dtype need no copy first."""
        n = q.shape[0]
        group = v.shape[1] // q.shape[1] if key_heads == gdn.GROUPED else 1  # value heads per key head, in order
        if self._chunked(n, ring, q, k, v, g, beta):
            return self.kernels.gdn_chunked(q, k, v, g, beta, ring, src_slot, dst_slots, group=group)
        if not self._recurrent_pieces(n, ring, q, k, v, g, beta):
            return super().delta_rule_slots(q, k, v, g, beta, ring, src_slot, dst_slots, key_heads)
        return _joined([self.kernels.gdn_step(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], ring, src, dst, group=group)
                        for a, b, src, dst in ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)])


    def delta_rule_from_conv_slots(self, q, k, v, b, alpha, a, dt_bias, eps: float, scale: float, ring,
                                   src_slot, dst_slots, key_heads: str = gdn.TILED, gated_norm=None):
        """One gdn_step launch (per piece of MAX_TOKENS) with q and k's norms and the gates in it, and
        the output norm where `gated_norm` is given and `_folded_norm` takes it; b, alpha [n, nv] or
        Qwen3-Next's [n, nk, r] views read through their strides."""
        n = q.shape[0]
        weights = tuple(dense(w, torch.float32) for w in (a, dt_bias))
        # a long batch the chunked kernel takes: the norms and gates first (their kernels), then it
        if self._chunked(n, ring, q, k, v, b, alpha) or not (
                self._recurrent_pieces(n, ring, q, k, v, b, alpha) and b.dim() in (2, 3) and b.shape == alpha.shape
                and all(w.device == q.device for w in weights)
                and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, b, alpha))):
            return super().delta_rule_from_conv_slots(q, k, v, b, alpha, a, dt_bias, eps, scale, ring, src_slot,
                                                      dst_slots, key_heads, gated_norm)
        group = v.shape[1] // q.shape[1] if key_heads == gdn.GROUPED else 1
        folded = self._folded_norm(v, gated_norm)
        out = _joined([self.kernels.gdn_step(q[start:end], k[start:end], v[start:end], alpha[start:end],
                                             b[start:end], ring, src, dst, group=group, eps=eps, scale=scale,
                                             gate_weights=weights, gated_norm=_rows(folded, start, end))
                       for start, end, src, dst in ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)])
        return self._normed_apart(out, gated_norm, folded)

    def conv_delta_rule_slots(self, m, windows, conv_weight, heads, b, alpha, a, dt_bias, eps: float, scale: float,
                              ring, src_slot, dst_slots, key_heads: str = gdn.TILED, gated_norm=None):
        """The conv folded into gdn_step's launch too (`conv=`), and the output norm where `gated_norm`
        is given and `_folded_norm` takes it: one launch for the mixer between its products, for a
        batch of one launch (MAX_TOKENS: a longer one reads ring_pieces' scratch slot it writes)."""
        n = m.shape[0]
        q, k, v = gdn.qkv_heads(m, heads)
        values = dense(conv_weight, torch.float32)
        weights = tuple(dense(w, torch.float32) for w in (a, dt_bias))
        if not (n <= self.kernels.MAX_TOKENS and self._recurrent_pieces(n, ring, m, b, alpha)
                and windows.dtype == torch.float32 and windows.device == ring.device and windows.shape[1] >= 1
                and m.stride(-1) == 1 and b.dim() in (2, 3) and b.shape == alpha.shape
                and all(w.device == m.device for w in (values,) + weights)
                and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (b, alpha))):
            return super().conv_delta_rule_slots(m, windows, conv_weight, heads, b, alpha, a, dt_bias, eps, scale, ring,
                                                 src_slot, dst_slots, key_heads, gated_norm)
        group = heads[2] // heads[0] if key_heads == gdn.GROUPED else 1
        folded = self._folded_norm(v, gated_norm)
        out = self.kernels.gdn_step(q, k, v, alpha, b, ring, src_slot, dst_slots, group=group, eps=eps, scale=scale,
                                    gate_weights=weights, conv=(windows, values), gated_norm=folded)
        return self._normed_apart(out, gated_norm, folded)

    def _folded_norm(self, v: torch.Tensor, gated_norm):
        """gated_norm = (weight, gate, eps, out_dtype) as gdn_step's `gated_norm=` takes it (the
        weight's float32 values), or None where the norm kernel would not take it: the rule's o is
        then normed by `gated_rms_norm` (`_normed_apart`). v [n, nv, dv] stands for o's shape."""
        if gated_norm is None:
            return None
        weight, gate, eps, out_dtype = gated_norm
        values = self._norm_weight(weight, v) if self._norm_fits(v) and self._pointwise(v, gate) else False
        if (values is False or values is None or gate.shape != v.shape or out_dtype not in (None,) + KERNEL_DTYPES
                or (gate.shape[-1] > 1 and gate.stride(-1) != 1)):
            return None
        return values, gate, eps, out_dtype

    def _normed_apart(self, out: torch.Tensor, gated_norm, folded) -> torch.Tensor:
        """gdn_step's result: y where the norm was folded in, else o (normed here where asked)."""
        return out if gated_norm is None or folded is not None else self.gated_rms_norm(out, *gated_norm)


class PairedExperts:
    """One weight per pair: pair r is multiplied by expert pairs[r] of a stored 3-D expert tensor
    [E, out, in] (what CudaBackend.moe_by_pairs hands experts.ffn in place of one expert's 2-D
    slice). Only CudaBackend.linear takes it, with activations of one row per pair, or of one row per
    P / rows consecutive pairs (x itself, before the first product: [P, out] out either way)."""

    __slots__ = ("experts", "pairs")
    ndim = 2

    def __init__(self, experts: StoredWeight, pairs: torch.Tensor):
        self.experts, self.pairs = experts, pairs

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.experts.shape[1:])

    def pairs_with(self, other: "PairedExperts") -> bool:
        """Whether expert_matmul_pair takes both: the same pairs, expert tensors of one type and layout."""
        a, b = self.experts, other.experts
        return (self.pairs is other.pairs and a.qtype == b.qtype and a.shape == b.shape
                and a.raw.shape == b.raw.shape and a.raw.stride() == b.raw.stride() and a.raw.device == b.raw.device)

    def rows_of(self, x: torch.Tensor, *others: "PairedExperts") -> tuple[torch.Tensor, int]:
        """(x as [rows, in], pairs per row), counting the read experts' bytes (where a counter is attached)."""
        for w in (self, *others):
            if w.experts.counter is not None:
                w.experts.counter.bytes += w.experts.raw[0].numel() * w.pairs.shape[0]
        xs = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, self.shape[1])  # row strides kept
        return xs, (self.pairs.shape[0] // xs.shape[0] if xs.shape[0] else 1)


def _count(w: StoredWeight) -> None:
    """Add a product's read of w's bytes to its counter (where one is attached)."""
    if w.counter is not None:
        w.counter.bytes += w.raw.numel()


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces' rows in order: a single piece as it is (no copy, no launch)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _rows(gated_norm, start: int, end: int):
    """gdn_step's `gated_norm=` for the piece of tokens start..end-1: its gate's rows."""
    if gated_norm is None:
        return None
    weight, gate, eps, out_dtype = gated_norm
    return weight, gate[start:end], eps, out_dtype


def ring_pieces(n: int, step: int, src_slot: torch.Tensor, dst_slots: torch.Tensor):
    """(start, end, source slot, destination slots) of n tokens cut into pieces of at most `step`, for
    a kernel that reads the state before its piece from one slot and writes the states after the
    piece's last len(destinations) tokens: the batch's kept tokens (its last len(dst_slots)) go to
    their own slots; a piece holding none of them leaves its last state in the batch's last
    destination slot, which the next piece reads and the last kept token finally overwrites. The
    slots stay device tensors (slices: no host read)."""
    keep = dst_slots.shape[0]
    first_kept = n - keep
    scratch = dst_slots[keep - 1:]
    source = src_slot
    for a in range(0, n, step):
        b = min(a + step, n)
        if b <= first_kept:
            yield a, b, source, scratch
            source = scratch
        else:
            lo = max(a, first_kept) - first_kept
            yield a, b, source, dst_slots[lo:b - first_kept]
            source = dst_slots[b - 1 - first_kept:b - first_kept]


def _triton_kernels():
    """runtime/kernels_triton where Triton can run its kernels here, else None; on a machine with a
    GPU, why not is said once (the torch reference then runs every operation, far slower)."""
    from specconv.runtime import kernels_triton

    why = kernels_triton.why_unavailable()
    if why is None:
        return kernels_triton
    if torch.cuda.is_available():
        sys.stderr.write(f"warning: the CUDA kernels are off: {why}; the torch reference backend runs instead\n")
    return None
