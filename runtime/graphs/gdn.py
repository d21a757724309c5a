"""Gated DeltaNet kernels (docs/reference/model-math.md §2.2): causal conv, and the gated delta rule in its
recurrent, chunked and batched-with-states forms. The recurrent and batched forms return the state
after each of the last `keep` tokens, so the memory can keep per-position snapshots for rollback
without recomputation; the batched form does it without a per-token Python loop (a speculative
verification batch of k+1 tokens is one set of tensor operations).

Shapes (one sequence): q, k [n, nv, dk] (L2-normed, q scaled), v [n, nv, dv], g (log-decay ≤ 0)
and beta [n, nv], state S [nv, dk, dv]; all in the state dtype (float32, or float64 for a float64
context). `delta_rule` and `Recurrence` also take q, k with the nk key heads of the file and v, g,
beta in the compute dtype: the key head of value head h follows the file's layout (TILED: h mod nk,
Qwen3.5's GGUF files; GROUPED: h // (nv / nk), Qwen3-Next's), and each form expands and casts where
it needs to (`rule_inputs`: the torch and native forms; the CUDA kernel reads key head and dtype
itself, so a decode step launches no copy for either).
"""

from __future__ import annotations

import torch

from specconv.runtime.backend import for_device, rows_alone
from specconv.runtime.graphs.ops import dense, gated_rms_norm, l2_norm

CHUNK = 64  # as HF torch_chunk_gated_delta_rule and llama.cpp's prefill path
MAX_ALONE_ROWS = 16  # batches up to this many tokens compute their gates a token at a time (gates)
# which key head value head h reads, for nv value heads over nk key heads (nk divides nv)
TILED = "tiled"  # h mod nk: GGUF's Qwen3.5 files (the converter tiles the value heads)
GROUPED = "grouped"  # h // (nv / nk): Qwen3-Next's files (each key head's value heads together)
KEY_HEAD_LAYOUTS = (TILED, GROUPED)


def gates(b: torch.Tensor, alpha: torch.Tensor, a, dt_bias):
    """(g, β) [n, heads] of the delta rule, in the accumulation dtype, from the projections b, alpha
    [n, heads] (or [n, groups, heads / groups], views of one projection in head order) in the compute
    dtype and the per-head weights a, dt_bias [heads] (taken in the accumulation dtype): β = σ(b),
    g = a · softplus(alpha + dt_bias) (docs/reference/model-math.md §2.2), by the backend of b's
    device (runtime/backend_torch.py `gdn_gates`: on the CPU a decode or verification batch token by
    token, so a token's gates do not depend on its batch; the CUDA kernel reads b and alpha as
    they are)."""
    wide = torch.float64 if b.dtype == torch.float64 else torch.float32  # ops.acc's rule
    return for_device(b.device).gdn_gates(b, alpha, dense(a, wide), dense(dt_bias, wide))


def rule_from_conv(q, k, b, alpha, a, dt_bias, eps: float, scale: float):
    """(q, k, g, β) of the delta rule from the conv's q, k [n, nk, dk] and the projections b, alpha:
    q, k L2-normed (q then · scale: the reference's two float32 roundings) and the gates (`gates`)."""
    return (l2_norm(q, eps, scale=scale), l2_norm(k, eps)) + tuple(gates(b, alpha, a, dt_bias))


def qkv_heads(c: torch.Tensor, heads: tuple[int, int, int, int]):
    """The q, k [n, nk, dk] and v [n, nv, dv] head views of conv rows c [n, C] = [q | k | v], for
    heads = (nk, dk, nv, dv)."""
    nk, dk, nv, dv = heads
    n = c.shape[0]
    return (c[:, :nk * dk].view(n, nk, dk), c[:, nk * dk:2 * nk * dk].view(n, nk, dk),
            c[:, 2 * nk * dk:].view(n, nv, dv))


def value_heads(x: torch.Tensor, nv: int, key_heads: str) -> torch.Tensor:
    """x [n, nk, d] with one head per value head [n, nv, d] (x itself where nk = nv), in `key_heads`'
    layout (TILED or GROUPED)."""
    nk = x.shape[1]
    if key_heads not in KEY_HEAD_LAYOUTS:
        raise ValueError(f"key head layout must be one of {KEY_HEAD_LAYOUTS}, not {key_heads!r}")
    if nk == 0 or nv % nk:
        raise ValueError(f"{nv} value heads over {nk} key heads")
    if nk == nv:
        return x
    return x.repeat(1, nv // nk, 1) if key_heads == TILED else x.repeat_interleave(nv // nk, dim=1)


def rule_inputs(q, k, v, g, beta, dtype: torch.dtype, key_heads: str):
    """(q, k, v, g, beta) as the torch and native forms take them: in `dtype` (the state's), q and k
    with one head per value head (`value_heads`)."""
    nv = v.shape[1]
    return (value_heads(q.to(dtype), nv, key_heads), value_heads(k.to(dtype), nv, key_heads),
            v.to(dtype), g.to(dtype), beta.to(dtype))


def causal_conv(m: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, keep: int):
    """Depthwise causal conv + SiLU over pre-conv inputs m [n, C] with the previous K-1 inputs
    conv_state [K-1, C] (oldest first); weight [C, K]. The backend of m's device computes it
    (runtime/backend.py: native on the CPU for decode steps and verification).

    Returns (activations [n, C], conv states after each of the last `keep` tokens [keep, K-1, C]).
    """
    keep = min(max(keep, 0), m.shape[0])
    return for_device(m.device).causal_conv(m, conv_state, weight, keep)


def recurrent_delta_rule(q, k, v, g, beta, state, keep: int = 1):
    """Token-by-token: S ← e^g S; δ = β(v − Sᵀk); S ← S + k δᵀ; o = Sᵀq.
    Returns (o [n, nv, dv], states after each of the last `keep` tokens [keep, nv, dk, dv])."""
    n = q.shape[0]
    outs, states = [], []
    s = state
    # products over the key dimension as elementwise products and sums, not as batched matrix
    # products: torch's sums accumulate pairwise (measured on a tiny Qwen3-Next in float32, the
    # logits' p95 distance from the float64 forward is 7e-5 this way, 1.2e-4 through einsum)
    for t in range(n):
        s = s * torch.exp(g[t])[:, None, None]
        u = (s * k[t][:, :, None]).sum(-2)
        delta = beta[t][:, None] * (v[t] - u)
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append((s * q[t][:, :, None]).sum(-2))
        if t >= n - keep:
            states.append(s)
    return torch.stack(outs), torch.stack(states)


def cumulative_log_decay(g: torch.Tensor) -> torch.Tensor:
    """Γ = the cumulative sum of the log-decays g [..., n] over tokens, in float64 whatever g's dtype.

    The chunked form takes every decay from Γ: D_ij = e^{Γ_i − Γ_j} between tokens, e^{Γ_i} from the
    state before the chunk. Over a chunk of 64 prompt tokens Γ grows to hundreds with strong decays,
    so in float32 a difference of two of its values is only as exact as ulp(Γ), and the decays near
    the diagonal, the ones that count, carry that error into every output (the chunked form's
    float32 error was 30x the recurrence's on strongly decaying inputs, enough on a GPU to put a MoE
    model's chunked and recurrent logits 1.45e-3 apart; tests/runtime/test_memory.py). In float64
    each decay is exact to the compute dtype, and all of them come from the same Γ, so the form stays
    the exact function of its (rounded) inputs. Callers cast each exponential back to their dtype.
    (The batched form spans only a batch's last `keep` tokens, a verification batch: a short Γ.)"""
    return g.to(torch.float64).cumsum(-1)


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same function evaluated chunk-wise (WY form), for long inputs. Per chunk of L rows with
    cumulative decay Γ and D_ij = e^{Γ_i − Γ_j} (j ≤ i): (I + T) U = βV, (I + T) W = β e^Γ K with
    T = strict-lower(β_i k_i·k_j D_ij), V_new = U − W S, O = (Q e^Γ) S + (QKᵀ ⊙ D) V_new,
    S ← e^{Γ_L} S + (K ⊙ e^{Γ_L − Γ})ᵀ V_new, Γ from cumulative_log_decay. Returns (o [n, nv, dv],
    final state [nv, dk, dv])."""
    n, nv, dk = k.shape
    outs = []
    s = state
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        qc, kc, vc = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        gc, bc = g[start:end].t(), beta[start:end].t()  # [nv, L]
        length = end - start
        gamma = cumulative_log_decay(gc)
        lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((gamma[:, :, None] - gamma[:, None, :]).masked_fill(~lower, float("-inf"))).to(q.dtype)
        growth = gamma.exp().to(q.dtype)  # e^Γ [nv, L]
        t_mat = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        a_mat = torch.eye(length, dtype=q.dtype, device=q.device).expand(nv, length, length) + t_mat
        u = torch.linalg.solve_triangular(a_mat, bc[:, :, None] * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(a_mat, (bc * growth)[:, :, None] * kc, upper=False, unitriangular=True)
        v_new = u - w @ s  # [nv, L, dv]
        o = (qc * growth[:, :, None]) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ v_new
        outs.append(o.transpose(0, 1))
        last = gamma[:, -1]
        to_end = torch.exp(last[:, None] - gamma).to(q.dtype)  # e^{Γ_L − Γ_j}
        s = growth[:, -1, None, None] * s + (kc * to_end[:, :, None]).transpose(-1, -2) @ v_new
    return torch.cat(outs), s


class PendingStates:
    """The states after each of the last `keep` tokens of a batch, kept as what rebuilds them instead of
    as `keep` state-sized tensors: the state before the batch S (a view of the memory's slot, which the
    memory keeps intact while this is held), k [nv, dk, n], the recurrence's δ [nv, n, dv] and the
    cumulative log-decay Γ [nv, n]. S_t = e^{Γ_t} S + Σ_{j≤t} e^{Γ_t − Γ_j} k_j δ_jᵀ costs one state
    write, so a verification batch writes only its last state and a rollback builds only the state it
    keeps (runtime/memory.py): k+1 verified tokens cost one state write instead of k+1."""

    def __init__(self, state, kt, v_new, gamma, first: int, last: torch.Tensor | None = None):
        """`last`: the state after the batch where it is already computed (the native form writes it
        straight into the memory's slot)."""
        self.state0, self.kt, self.v_new, self.gamma, self.first = state, kt, v_new, gamma, first
        self.keep = gamma.shape[1] - first
        self.last = last

    def state(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The state after token `first + i` of the batch (i < keep), written into `out` if given."""
        if self.last is not None and i == self.keep - 1:
            if out is None or out.data_ptr() == self.last.data_ptr():
                return self.last
            return out.copy_(self.last)
        t = self.first + i
        scale = torch.exp(self.gamma[:, t:t + 1] - self.gamma[:, :t + 1])  # [nv, t+1]
        # e^{Γ_t} S first, then the sum added in place: `out` may be S's own slot (a ring of one state)
        decayed = self.state0 * self.gamma[:, t].exp()[:, None, None] if out is None else \
            torch.mul(self.state0, self.gamma[:, t].exp()[:, None, None], out=out)
        return decayed.baddbmm_(self.kt[:, :, :t + 1] * scale[:, None, :], self.v_new[:, :t + 1])

    def all(self) -> torch.Tensor:
        """Every kept state [keep, nv, dk, dv] (tests and the reference forms' layout)."""
        return torch.stack([self.state(i) for i in range(self.keep)])


def batched_delta_rule(q, k, v, g, beta, state, keep: int = 1, lazy: bool = False):
    """The recurrent form's result for a short batch in one set of tensor operations: the WY form of
    `chunked_delta_rule` over the whole batch (one chunk of n rows), plus the per-token states
    S_t = e^{Γ_t} S + Σ_{j≤t} D_tj k_j v_new_jᵀ, which the chunk form only builds for t = n. The
    state sum is O(n²·dk·dv) per head, so this is for n up to a chunk (verification batches).
    Returns (o [n, nv, dv], states after each of the last `keep` tokens [keep, nv, dk, dv]), or with
    `lazy` a `PendingStates` that builds them on demand."""
    n = q.shape[0]
    qc, kc, vc = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [nv, n, d]
    gamma, bc = g.t().cumsum(-1), beta.t()  # [nv, n]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gamma[:, :, None] - gamma[:, None, :]).masked_fill(~lower, float("-inf")))  # D [nv, n, n]
    t_mat = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    a_mat = torch.eye(n, dtype=q.dtype, device=q.device).expand(q.shape[1], n, n) + t_mat
    u = torch.linalg.solve_triangular(a_mat, bc[:, :, None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a_mat, (bc * gamma.exp())[:, :, None] * kc, upper=False, unitriangular=True)
    # W S and (Q e^Γ) S in one product: the state is read once
    ws_qs = torch.cat([w, qc * gamma.exp()[:, :, None]], dim=1) @ state  # [nv, 2n, dv]
    v_new = u - ws_qs[:, :n]  # δ_t of the recurrence [nv, n, dv]
    o = ws_qs[:, n:] + ((qc @ kc.transpose(-1, -2)) * decay) @ v_new
    pending = PendingStates(state, kc.transpose(-1, -2), v_new, gamma, n - keep)
    return o.transpose(0, 1), (pending if lazy else pending.all())


BATCHED_MAX = CHUNK  # the batched form's n² state sum stays cheap up to one chunk of tokens


def delta_rule(q, k, v, g, beta, state, keep: int, mode: str = "auto", lazy: bool = False,
               out: torch.Tensor | None = None, key_heads: str = TILED):
    """Outputs for every token and the states after each of the last `keep` tokens (with `lazy`, as a
    `PendingStates` where the batched or native form computes them: Batch.recurrent_out takes either).
    `out`: where the state after the last token is wanted (the memory's slot for it); the native
    form writes it there directly, the others leave it to `PendingStates.state`.

    "recurrent": token by token (the reference form). "chunked"/"auto": the backend of q's device
    (runtime/backend.py) — the torch backend runs the chunked form up to the last `keep` tokens,
    whose per-token states the snapshot ring needs, then the batched form for those (exact
    per-token states, no Python loop over tokens: a verification batch of ≤ keep tokens is
    evaluated in one pass); with `lazy`, the CPU's native backend runs a float32 batch of up to
    gdn_native.MAX_TOKENS tokens (decode steps, verification) token by token with each head's
    state in cache. A single token (plain decoding) takes the batched form too: at the sizes of
    real models it is faster than the one-step recurrence (fewer state-sized temporaries) and
    plain and speculative decoding then run the same arithmetic.

    In batch-invariant mode (runtime/backend.py `rows_alone`: a bfloat16 / float16 model) every
    form runs token by token, each token as a batch of one (the states as a tensor), prompts
    included: a token's output and state are the same bits whatever batch it came in.

    q, k may hold the key heads only, v, g, beta the compute dtype (`rule_inputs` makes them the
    forms' inputs, `key_heads` the layout)."""
    q, k, v, g, beta = rule_inputs(q, k, v, g, beta, state.dtype, key_heads)
    n = q.shape[0]
    if mode == "recurrent":
        return recurrent_delta_rule(q, k, v, g, beta, state, keep=keep)
    keep = min(max(keep, 1), n)
    return for_device(q.device).delta_rule(q, k, v, g, beta, state, keep, lazy=lazy, out=out, exact=rows_alone())


class Recurrence:
    """The recurrent part of one Gated DeltaNet layer for one batch (runtime/memory.py `Batch`): the
    causal conv and the delta rule read the state before the batch from the memory's ring and leave
    there the states after its kept tokens (the last `batch.keep`).

    A backend with `slot_states` (runtime/backend.py: the CUDA backend) is given the ring and the
    batch's slot indices (`BatchIndex.src_slot` / `dst_slots`, int64 device tensors) and writes every
    kept state straight into its slot: a rollback then makes a slot current, nothing is rebuilt or
    copied, and a captured graph replays with new slots. Other backends take the state tensors and
    return the states, which `Batch.recurrent_out` stores (the ones a batched form leaves pending
    included). mode "recurrent" (tests) always takes the torch recurrence."""

    def __init__(self, batch, layer: int, mode: str):
        self.batch, self.layer, self.mode = batch, layer, mode
        memory = batch.memory
        self.state_dtype = memory.layout.state_dtype  # float32, or float64 for a reference-grade recurrence
        self.slots = mode != "recurrent" and for_device(memory.ssm[layer].device).slot_states
        self._conv_states = None

    def conv(self, m: torch.Tensor, weight) -> torch.Tensor:
        """Activations [n, C] of the pre-conv inputs m [n, C]; weight [C, K]."""
        b = self.batch
        if self.slots:
            index = b.index(m.device)
            return for_device(m.device).causal_conv_slots(m, b.memory.conv[self.layer][b.seq], weight,
                                                          index.src_slot, index.dst_slots)
        conv_state, _ = b.recurrent_in(self.layer)
        out, self._conv_states = causal_conv(m, conv_state, weight, b.keep)
        return out

    def delta_rule(self, q, k, v, g, beta, key_heads: str = TILED) -> torch.Tensor:
        """o [n, nv, dv] in the state dtype, after `conv`: q, k [n, nk, dk] (key heads in the
        `key_heads` layout), v, g, beta in the compute or the state dtype (as `delta_rule`)."""
        b = self.batch
        if self.slots:
            index = b.index(q.device)
            return for_device(q.device).delta_rule_slots(q, k, v, g, beta, b.memory.ssm[self.layer][b.seq],
                                                         index.src_slot, index.dst_slots, key_heads=key_heads)
        _, ssm_state = b.recurrent_in(self.layer)
        o, states = delta_rule(q, k, v, g, beta, ssm_state, keep=b.keep, mode=self.mode, lazy=True,
                               out=b.state_out(self.layer), key_heads=key_heads)
        b.recurrent_out(self.layer, self._conv_states, states)
        return o

    def delta_rule_from_conv(self, q, k, v, b, alpha, a, dt_bias, eps: float, scale: float,
                             key_heads: str = TILED, gated_norm=None) -> torch.Tensor:
        """o [n, nv, dv] as `delta_rule` from what the conv and the projections leave: q, k
        [n, nk, dk] not yet normed, v, the projections b, alpha and the per-head weights a, dt_bias
        (`rule_from_conv`); with `gated_norm` (`gated_output`) the layer's normed output instead. A
        backend with `slot_states` takes them in one call (the CUDA backend folds the norms, the
        gates and the output norm into the rule's kernel)."""
        if self.slots:
            batch = self.batch
            index = batch.index(q.device)
            return for_device(q.device).delta_rule_from_conv_slots(
                q, k, v, b, alpha, a, dt_bias, eps, scale, batch.memory.ssm[self.layer][batch.seq],
                index.src_slot, index.dst_slots, key_heads=key_heads, gated_norm=gated_norm)
        q, k, g, beta = rule_from_conv(q, k, b, alpha, a, dt_bias, eps, scale)
        return gated_output(self.delta_rule(q, k, v, g, beta, key_heads=key_heads), gated_norm)

    def conv_delta_rule(self, m, conv_weight, heads: tuple[int, int, int, int], b, alpha, a, dt_bias, eps: float,
                        scale: float, key_heads: str = TILED, gated_norm=None) -> torch.Tensor:
        """o [n, nv, dv]: `conv` of the pre-conv rows m [n, C] = [q | k | v], its `qkv_heads` (heads =
        (nk, dk, nv, dv)), then `delta_rule_from_conv` (with `gated_norm`: its normed output). A
        backend with `slot_states` takes it all in one call: the memory's spare slot means the batch
        never writes the slot it reads (the CUDA backend: one kernel, whose programs share the key
        heads' windows)."""
        if self.slots:  # every ring keeps a spare slot (memory.Memory)
            batch, memory = self.batch, self.batch.memory
            index = batch.index(m.device)
            return for_device(m.device).conv_delta_rule_slots(
                m, memory.conv[self.layer][batch.seq], conv_weight, heads, b, alpha, a, dt_bias, eps, scale,
                memory.ssm[self.layer][batch.seq], index.src_slot, index.dst_slots, key_heads=key_heads,
                gated_norm=gated_norm)
        q, k, v = qkv_heads(self.conv(m, conv_weight), heads)
        return self.delta_rule_from_conv(q, k, v, b, alpha, a, dt_bias, eps, scale, key_heads=key_heads,
                                         gated_norm=gated_norm)


def gated_output(o: torch.Tensor, gated_norm) -> torch.Tensor:
    """o, or with gated_norm = (weight, gate, eps, out_dtype) the Gated DeltaNet's output norm
    ops.gated_rms_norm(o, weight, gate, eps, out_dtype): what the mixer hands its output product."""
    return o if gated_norm is None else gated_rms_norm(o, *gated_norm)
