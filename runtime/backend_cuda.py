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
* routed experts and their routers: runtime/backend_cuda_experts.py; Gated DeltaNet's states in
  ring slots: runtime/backend_cuda_recurrent.py (CudaBackend is both).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from specconv.runtime import dequant, rows_first
from specconv.runtime.backend import rows_alone
from specconv.runtime.backend_cuda_base import KERNEL_DTYPES, count_read, joined_rows
from specconv.runtime.backend_cuda_experts import CudaExperts, PairedExperts
from specconv.runtime.backend_cuda_recurrent import CudaRecurrence
from specconv.runtime.backend_torch import GATHER_MAX_ROWS
from specconv.runtime.stored import StoredWeight


class CudaBackend(CudaExperts, CudaRecurrence):
    name = "cuda"
    static_kv = True
    slot_states = True

    def __init__(self, kernels=None, device_types: tuple[str, ...] = ("cuda",)):
        super().__init__(kernels, device_types)
        self._head_indices: dict = {}  # (heads, device) -> linear_per_head's pair -> head index

    def stored_type(self, qtype, shape: tuple[int, ...]):
        """A Q8_0 matrix whose rows the kernels read 16 bytes at a time once rearranged is kept as Q8_0_ROWS
        (runtime/rows_first.py) where the kernels run."""
        kept = rows_first.kept_as(qtype, shape) if self.kernels is not None else None
        return qtype if kept is None else kept

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

    def linear_wide_group(self, x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
        """Float32 weights the product kernel takes (linear_wide's) by the same rows, up to
        FUSED_MAX_ROWS of them: one grouped launch (kernels_triton.grouped_matmul, each output the
        bits of its own product: a MoE block's router and shared-expert gate); else linear_wide each."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if (len(ws) > 1 and 0 < rows <= self.kernels.FUSED_MAX_ROWS
                and all(w.shape[1] == x.shape[-1] and (self._stored_matrix(x, w, torch.float32)
                                                       or self._dense_float32(x, w, torch.float32)) for w in ws)):
            packed = [self._weight_bytes(w) for w in ws]
            if all(qtype == QType.F32 for _, qtype in packed):
                return self.kernels.grouped_matmul(x.contiguous(), [raw for raw, _ in packed], QType.F32,
                                                   [w.shape[0] for w in ws], x.shape[-1])
        return super().linear_wide_group(x, ws)

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
            count_read(w)
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
                count_read(ws[i])
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
        return joined_rows(pieces).view(n, heads, w.shape[1])

    def _head_index(self, heads: int, device: torch.device) -> torch.Tensor:
        """[GATHER_MAX_ROWS · heads] int32: pair r's head r % heads, made on the device once (its first
        call is an eager forward: a CUDA graph's warm-up precedes its capture) and sliced per batch."""
        key = (heads, device)
        if key not in self._head_indices:
            self._head_indices[key] = torch.arange(GATHER_MAX_ROWS * heads, dtype=torch.int32, device=device) % heads
        return self._head_indices[key]

    # ---- around the products: one kernel each ------------------------------------------------------
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
        values = self._norm_weight(weight, h)
        if values is not False and values is not None:
            out = self._tailed_product(x, w, h, up, lambda xp, raw, qtype, n_out, n_in, hp, up_rows: (
                self.kernels.quant_matmul_add_rms_norm(xp, raw, qtype, n_out, n_in, hp, values, eps, up=up_rows,
                                                       act=act)))
            if out is not None:
                return out
        return super().linear_add_rms_norm(x, w, h, weight, eps, up, act)

    def linear_add_normed(self, x: torch.Tensor, w, h: torch.Tensor, weight, eps: float, scale=None, then=None,
                          up: torch.Tensor | None = None, act: str | None = None):
        """linear_add_rms_norm's choices for a sandwich norm's output joining the stream
        (kernels_triton.quant_matmul_add_normed: the product's launch ends with the norm, the add, the
        scale and the norm by `then`); otherwise the product, then add_normed and rms_norm."""
        values, after = self._norm_weight(weight, h), self._norm_weight(then, h)
        s = scale.dense(torch.float32) if isinstance(scale, StoredWeight) else scale
        if (values is not False and values is not None and after is not False
                and (s is None or (s.numel() == 1 and s.dtype == torch.float32 and s.device == h.device))):
            out = self._tailed_product(x, w, h, up, lambda xp, raw, qtype, n_out, n_in, hp, up_rows: (
                self.kernels.quant_matmul_add_normed(xp, raw, qtype, n_out, n_in, hp, values, eps, scale=s,
                                                     then=after, up=up_rows, act=act)))
            if out is not None:
                return out
        return super().linear_add_normed(x, w, h, weight, eps, scale, then, up, act)

    def _tailed_product(self, x: torch.Tensor, w, h: torch.Tensor, up: torch.Tensor | None, run):
        """A product with a norm tail, run(x rows, bytes, type, n_out, n_in, h rows, up rows) -> outputs
        shaped like h's rows (None for one not made), where the product kernel takes x @ wᵀ (with `up`,
        its GLU input) in h's dtype and shape, up to FUSED_MAX_ROWS rows, in batch-invariant mode in
        pieces of that many rows (each row as in a decode step); None where it does not apply."""
        if (isinstance(w, PairedExperts) or (up is not None and not self._glu_input(x, up))
                or not (self._stored_matrix(x, w, x.dtype) or self._dense_float32(x, w, x.dtype))
                or not self._norm_fits(h) or not self._pointwise(h, x)
                or h.dtype != x.dtype or h.shape != (*x.shape[:-1], w.shape[0])):
            return None
        n_out, n_in = w.shape
        xs = (x.contiguous() if up is None else x).reshape(-1, n_in)
        rows = xs.shape[0]
        if rows == 0 or (rows > self.kernels.FUSED_MAX_ROWS and not rows_alone()):
            return None
        raw, qtype = self._weight_bytes(w)
        hs = h.reshape(-1, n_out)
        pieces = self._in_pieces(xs, None if up is None else up.reshape(-1, n_in), lambda first, xp, up_rows: (
            run(xp, raw, qtype, n_out, n_in, hs[first:first + xp.shape[0]], up_rows)))
        return tuple(None if parts[0] is None else joined_rows(list(parts)).view(h.shape) for parts in zip(*pieces))

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

    def normed_rope_store(self, q, k, v, q_weight, k_weight, eps, cos, sin, style, k_cache, v_cache, cells,
                          v_norm: bool = False):
        """One launch: q's and k's norms and rope, v's norm, k and v into the caches
        (kernels_triton.rope_qk_store), where write_kv's kernel would take k and v."""
        weights = self._qk_weights(q, k, q_weight, k_weight, cos, sin)
        if not (weights is not None and self._pointwise(k_cache, v_cache, v) and k_cache.device == q.device
                and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and cells.device == q.device
                and cells.dtype == torch.int64 and cells.dim() == 1):
            return super().normed_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, style, k_cache, v_cache,
                                             cells, v_norm)
        return self.kernels.rope_qk_store(q, k, v, cos, sin, style, k_cache, v_cache, cells, *weights, eps=eps,
                                          v_norm=v_norm)

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
