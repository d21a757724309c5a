"""Qwen3-Next graphs (GGUF arch `qwen3next`), docs/reference/model-math.md §2, §3.1, §7; llama.cpp's
https://github.com/ggml-org/llama.cpp/blob/0c1e57098bba43ac29e6e3b677cdceebdd22334f/src/models/qwen3next.cpp

Everything but the Gated DeltaNet input side is Qwen3.5-MoE's and is imported from the qwen35 graph
(gated full attention with partial NEOX rope, softmax top-k MoE with a sigmoid-gated shared expert,
the MTP block, memory layouts), so the recurrent state keeps the same per-token snapshot ring and
rollback. The Gated DeltaNet differs in two places:

* `ssm_ba` [2nv, H] is one projection whose rows are grouped per key head g: [b_g (r) | a_g (r)],
  r = nv / nk, so beta and the decay of value head g·r + j come from rows 2rg + j and 2rg + r + j;
* value heads are in grouped order (no re-tiling in the file), so value head h reads key head h // r
  (llama.cpp repeats q/k "interleaved"; Qwen3.5's files are tiled instead, head h reading h mod nk).
"""

from __future__ import annotations

import torch

from specconv.archs.qwen3next import QWEN3NEXT_TABLE, Qwen3NextHParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import gdn, trunk
from specconv.runtime.graphs import qwen35 as q35
from specconv.runtime.graphs.ops import Deferred, linear
from specconv.runtime.memory import Batch

# the family's table (archs/qwen3next.py), whose shapes read the hparams (Qwen3NextHParams)
TABLE = QWEN3NEXT_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


def gated_deltanet(w, hp: Qwen3NextHParams, i: int, a: torch.Tensor, batch: Batch, mode: str) -> Deferred:
    n = a.shape[0]
    nk, nv = hp.linear_num_key_heads, hp.linear_num_value_heads
    dk, dv = hp.linear_key_head_dim, hp.linear_value_head_dim
    r = hp.value_heads_per_key_head
    m = linear(a, w[f"blk.{i}.attn_qkv.weight"])  # [n, C] = [q | k | v]
    z = linear(a, w[f"blk.{i}.attn_gate.weight"]).view(n, nv, dv)
    ba = linear(a, w[f"blk.{i}.ssm_ba.weight"]).view(n, nk, 2 * r)
    b, alpha = ba[..., :r], ba[..., r:]  # [n, nk, r]: value heads in order (gdn.gates reads the views)
    rec = gdn.Recurrence(batch, i, mode)  # states in and out of the memory's ring
    # the conv, q, k L2-normed (q · dk^-1/2) and the gates before the rule, the gated output norm after
    # it (one kernel on CUDA); value head h reads key head h // r
    y = rec.conv_delta_rule(m, w[f"blk.{i}.ssm_conv1d.weight"], (nk, dk, nv, dv), b, alpha, w[f"blk.{i}.ssm_a"],
                            w[f"blk.{i}.ssm_dt.bias"], hp.rms_norm_eps, dk ** -0.5, key_heads=gdn.GROUPED,
                            gated_norm=(w[f"blk.{i}.ssm_norm.weight"], z, hp.rms_norm_eps, a.dtype))
    return Deferred(y.reshape(n, nv * dv), w[f"blk.{i}.ssm_out.weight"])  # made with the add and norm after it


# qwen35's blocks with this module's Gated DeltaNet mixer; the MTP block (at n_layer) is full attention,
# so the MTP forward is qwen35's too
GRAPH = trunk.graph(
    "qwen3next", Qwen3NextHParams, _tensors, q35.main_layout, q35.mtp_layout,
    trunk.Trunk(q35.rope, q35.block_with(gated_deltanet), mtp_block=trunk.nextn_block),
    archs=("qwen3next",),  # the GGUF arches this graph runs (graph_for finds it by them)
)
