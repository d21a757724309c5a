"""DeepSeek Sparse Attention (runtime/graphs/dsa.py: GLM-5, DeepSeek-V3.2) on the CUDA backend:

* the lightning indexer's scores (kernels_triton.index_scores, CudaBackend.index_scores) on the
  releases' widths (index_head_dim 128; 32 heads for GLM-5, 64 for DeepSeek-V3.2, scaled down)
  against TorchBackend.index_scores (the CPU's formula) within a float32 rounding bound, a row alone
  the bits it gets in a batch of 16, the keys read through the cache rows' stride;
* the attention over the chosen keys (TorchBackend.latent_attention with `chosen`, the formula of
  the graph, against the kernel's key mask) within the float32 rounding bound of
  tests/runtime/test_cuda_attention.py;
* the selection stays the torch formula's (`select`: torch.topk for the k-th score, ties earliest
  first), and the decode step and a 4-row verification launch the same kernels, none of them a
  per-row loop (counted on `meta` by benchmarks/cuda_op_count.py, both releases' fixtures);
* greedy speculative decoding through the kernels in bfloat16 equals plain decoding.

Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import backend as backend_module, kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from tests.fixtures.launch_ceilings import STEP_LAUNCHES  # noqa: E402
from tests.runtime.test_cuda_attention import rand, rounding_bound  # noqa: E402
from tests.runtime.test_cuda_mla import HEADS, KV_LORA, ROPE, SCALE, latent_case  # noqa: E402

torch.set_num_threads(1)

INDEX_DIM, INDEX_HEADS = 128, 8  # GLM-5 / DeepSeek-V3.2: 128 wide, 32 / 64 heads
WEIGHT_SCALE = INDEX_HEADS ** -0.5  # the graph's H^(-1/2), applied inside the kernel
EPS = float(torch.finfo(torch.float32).eps)


def indexer_case(n: int, cells: int, seed: int, dtype=torch.float32):
    """(q [n, H, D], weights [n, H] float32 (to be scaled by WEIGHT_SCALE), keys [cells, D] as a slice
    of wider cache rows)."""
    q = rand(n, INDEX_HEADS, INDEX_DIM, seed=seed).to(dtype)
    weights = rand(n, INDEX_HEADS, seed=seed + 1)
    rows = rand(cells, 1, KV_LORA + ROPE + INDEX_DIM, seed=seed + 2).to(dtype)
    return q, weights, rows[:, 0, KV_LORA + ROPE:]


@pytest.mark.parametrize("n, cells", [(1, 37), (4, 200), (16, 64)])
def test_index_scores_within_float32_rounding(cuda_backend, n, cells):
    """One launch against the torch formula: each score Σ_j w_j · ReLU(s_j) within both sides' float32
    rounding (the dot products of D terms, the scale, the sum over the heads); the weights' scale
    applied inside rounds as the formula's product does."""
    q, weights, keys = indexer_case(n, cells, seed=1)
    scale = INDEX_DIM ** -0.5
    got = cuda_backend.index_scores(q.to(DEVICE), weights.to(DEVICE), keys.to(DEVICE), scale, WEIGHT_SCALE)
    ref = TorchBackend().index_scores(q, weights, keys, scale, WEIGHT_SCALE)
    qd, kd, wd = q.double(), keys.double(), (weights * WEIGHT_SCALE).double()
    s = torch.einsum("nhd,td->nht", qd, kd) * scale
    magnitude = torch.einsum("nhd,td->nht", qd.abs(), kd.abs()) * scale
    terms = wd.abs()[..., None] * ((INDEX_DIM + 2) * magnitude + (INDEX_HEADS + 1) * s.clamp(min=0))
    bound = 2 * EPS * terms.sum(1)
    diff = (got.cpu().double() - ref.double()).abs()
    print(f"\n[{WHERE}, f32] index scores n={n}, {cells} cells: max |Δ| {float(diff.max()):.2e}, at most "
          f"{float((diff / bound).max()):.3f} of the bound")
    assert got.shape == (n, cells) and got.dtype == torch.float32
    assert bool((diff <= bound).all())


def test_index_scores_are_batch_invariant(cuda_backend):
    """bfloat16 queries and keys: a row alone gives the bits it gets in a batch of 16."""
    q, weights, keys = (t.to(DEVICE) for t in indexer_case(16, 150, seed=2, dtype=torch.bfloat16))
    batch = cuda_backend.index_scores(q, weights, keys, INDEX_DIM ** -0.5, WEIGHT_SCALE)
    for i in range(16):
        assert torch.equal(cuda_backend.index_scores(q[i:i + 1], weights[i:i + 1], keys, INDEX_DIM ** -0.5,
                                                     WEIGHT_SCALE), batch[i:i + 1]), i


def test_index_scores_bad_input():
    q, weights, keys = (t.to(DEVICE) for t in indexer_case(2, 10, seed=3))
    with pytest.raises(SpecconvError, match="weights must be float32"):
        kt.index_scores(q, weights.double(), keys, 1.0)
    with pytest.raises(SpecconvError, match="keys has shape"):
        kt.index_scores(q, weights, keys[:, :64], 1.0)


def test_attention_over_chosen_keys_within_float32_rounding(cuda_backend):
    """The graph's attention over the indexer's keys: the kernel with the selection as its key mask
    against TorchBackend.latent_attention(..., chosen) (the masked softmax the CPU runs), within the
    derived float32 bound of the attention over the kept cells."""
    n, cells = 4, 60
    q_lat, q_pe, kv, q_pos, k_pos = latent_case(n, cells, 50, seed=4)
    visible = k_pos[None, :] <= q_pos[:, None]
    chosen = visible & (torch.rand(n, cells, generator=torch.Generator().manual_seed(5)) < 0.5)
    chosen[torch.arange(n), torch.argmax(visible.int(), dim=1)] = True  # at least one key per row
    got = cuda_backend.latent_attention(*(t.to(DEVICE) for t in (q_lat, q_pe, kv, q_pos, k_pos)), SCALE,
                                        chosen.to(DEVICE))
    ref = TorchBackend().latent_attention(q_lat, q_pe, kv, q_pos, k_pos, SCALE, chosen)
    # the bound of an attention over the chosen cells only: the others moved out of every row's sight
    hidden = torch.where(chosen, k_pos[None, :], torch.full_like(chosen, 1 << 40, dtype=torch.long))
    bound = torch.stack([rounding_bound(torch.cat([q_lat, q_pe], -1)[r:r + 1], kv, kv[..., :KV_LORA], q_pos[r:r + 1],
                                        hidden[r], SCALE, KV_LORA + ROPE)[0] for r in range(n)])
    diff = (got.cpu().double() - ref.double()).abs()
    print(f"\n[{WHERE}, f32] attention over chosen keys: max |Δ| {float(diff.max()):.2e}, at most "
          f"{float((diff / bound).max()):.2e} of the derived bound")
    assert got.shape == (n, HEADS, KV_LORA) and bool((diff <= bound).all())


# ---- the graph --------------------------------------------------------------------------------------

DSA_FIXTURES = ["dsa-glm-dsa", "dsa-deepseek32"]  # a decode step = a 4-row verification, within its ceiling


@pytest.fixture(scope="module")
def dsa_files(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = cuda_op_count.family_fixture(tmp_path_factory.mktemp(name), name)
        return made[name]
    return get


@pytest.mark.parametrize("name", DSA_FIXTURES)
def test_decode_step_and_verification_launch_the_same_kernels(dsa_files, name):
    """No per-row loop (by_rows) and no dequantized absorption weights: the 4-row verification
    launches what the decode step launches, the indexer scores and the attention one kernel each per
    full layer; the selection keeps torch.topk (its tie rule, `select`). Before: glm-dsa 244 per
    step and 394 per verification, deepseek32 260 and 410."""
    counts = cuda_op_count.count_steps(dsa_files(name), "bf16", 3)
    print(f"\n[{name}, meta, bf16]\n{cuda_op_count.report(counts, 3)}")
    assert counts.step.total == counts.verify.total <= STEP_LAUNCHES[name]
    assert counts.step.by_op == counts.verify.by_op
    blocks = len(counts.recurrent)
    for tally in (counts.step, counts.verify):
        assert tally.by_op["triton.attention_kernel"] == blocks
        assert 0 < tally.by_op["triton.index_scores_kernel"] <= blocks  # the full indexer layers
        assert tally.by_op["triton.dequantize_kernel"] <= 1  # the token's embedding row, outside the blocks
        for op in ("einsum", "bmm"):
            assert tally.by_op[op] == 0, op


def test_greedy_speculative_decoding_equals_plain_through_the_kernels(dsa_files, monkeypatch):
    """bf16 through the CUDA backend's kernels (indexer scores, the attention over the chosen keys, the
    per-head products): greedy speculative output equals plain decoding."""
    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from tests.fixtures.invariance import greedy_check

    device = "cuda" if ON_GPU else "cpu"
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CudaBackend(kt, device_types=(device,)))
    rows = []
    real = kt.index_scores
    monkeypatch.setattr(kt, "index_scores", lambda q, *a: rows.append(q.shape[0]) or real(q, *a))
    model = load_model(dsa_files("dsa-glm-dsa"), device=device, dtype="bf16")
    prompt = [(5 * i + 1) % model.vocab_size for i in range(12)]
    drafted, accepted = greedy_check(  # asserts speculative = plain
        model, [prompt], 8, lambda ids, plain: SyntheticDrafter(ids + plain, model.vocab_size, 0.6, seed=3),
        f"dsa-glm-dsa, {device}, kernels")
    print(f"indexer launches by rows {sorted(set(rows))}")
    assert 1 in rows and 4 in rows
    assert 0 < accepted < drafted
