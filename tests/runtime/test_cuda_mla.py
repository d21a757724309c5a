"""Multi-head latent attention (DeepSeek-V3's absorbed MLA, runtime/graphs/deepseek2.py) on the CUDA
backend, on the widths of the releases (kv_lora 512 + rope 64 = 576-wide latent cells, dn 128,
dv 128: DeepSeek-V3, Kimi K2, GLM-5), the head count scaled down:

* the per-head absorption products (`linear_per_head`, CudaBackend: kernels_triton.expert_matmul
  with each (row, head) pair's head as its expert) against float64 products of the dequantized
  weights, each pair the bits of a one-row product by its head's matrix, a row alone the bits it gets
  in a batch of 16, x read in place (the strided q[..., :dn]);
* the latent attention (kernels_triton.attention with V a view of the latent cells' first kv_lora
  entries, the query in two pieces): float32 within the rounding bound of
  tests/runtime/test_cuda_attention.py against TorchBackend.latent_attention (the formula the CPU
  runs), bfloat16 batch-invariant bit for bit, with a key mask (DeepSeek Sparse Attention's chosen
  keys) against the masked softmax formula;
* the graph: V is a view of the latent cache (stored once), the decode step and a 4-row verification
  launch the same kernels (no dequantize, einsum or per-row loop: counted on `meta` by
  benchmarks/cuda_op_count.py), and greedy speculative decoding through the kernels in bfloat16
  equals plain decoding.

Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import backend as backend_module, kernels_triton as kt  # noqa: E402
from specconv.runtime.backend import batch_invariant  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.kernels_triton.attention import values_in_keys  # noqa: E402
from specconv.runtime.dequant import dequantize_rows  # noqa: E402
from specconv.runtime.memory import UNWRITTEN  # noqa: E402
from specconv.runtime.stored import StoredWeight  # noqa: E402
from tests.fixtures.quant_rows import sane_rows  # noqa: E402
from tests.fixtures.launch_ceilings import STEP_LAUNCHES  # noqa: E402
from tests.runtime.test_cuda_attention import rand, rounding_bound  # noqa: E402

torch.set_num_threads(1)

KV_LORA, ROPE, NOPE, DV = 512, 64, 128, 128  # DeepSeek-V3 / Kimi K2 / GLM-5 (GLM-5: dn 192, dv 256)
HEADS = 4  # the releases' 128 (64 for GLM-5), scaled down
SCALE = (NOPE + ROPE) ** -0.5
EPS = float(torch.finfo(torch.float32).eps)


def stored_per_head(qtype: QType, n_out: int, n_in: int, seed: int) -> StoredWeight:
    raw = sane_rows(qtype, HEADS * n_out, n_in, seed=seed)
    raw = raw.reshape(HEADS, n_out, raw.shape[-1]).to(DEVICE)
    return StoredWeight(raw, qtype, (HEADS, n_out, n_in), torch.float32, DEVICE)


# ---- the per-head absorption products ---------------------------------------------------------------

@pytest.mark.parametrize("qtype, n_out, n_in", [(QType.Q8_0, KV_LORA, NOPE), (QType.F16, KV_LORA, NOPE),
                                                (QType.Q8_0, DV, KV_LORA), (QType.BF16, DV, KV_LORA)],
                         ids=["k_b-q8_0", "k_b-f16", "v_b-q8_0", "v_b-bf16"])
def test_per_head_products_by_index(cuda_backend, qtype, n_out, n_in):
    """q_lat[:, h] = q_nope[:, h] @ k_b[h]ᵀ (and o @ v_b[h]ᵀ) in one launch: within float32 summation
    noise of the float64 product, each (row, head) the bits of a one-row quant_matmul by its head's
    matrix, x read through its strides (q[..., :dn] of the projected query)."""
    w = stored_per_head(qtype, n_out, n_in, seed=1)
    n = 3
    q = rand(n, HEADS, n_in + ROPE, seed=2).to(DEVICE)
    x = q[..., :n_in]  # strided: the query's no-rope part, read in place
    y = cuda_backend.linear_per_head(x, w)
    assert y.shape == (n, HEADS, n_out) and y.dtype == x.dtype
    values = dequantize_rows(w.raw.cpu(), qtype, torch.float64)
    xd = x.cpu().double()
    exact = torch.einsum("nhi,hoi->nho", xd, values)
    scale = torch.einsum("nhi,hoi->nho", xd.abs(), values.abs())
    worst = float(((y.cpu().double() - exact).abs() / (EPS * scale)).max())
    print(f"\n[{WHERE}, linear_per_head {qtype.name} {n_out}x{n_in}] max |Δ| = {worst:.2f} eps·Σ|x·w| against float64")
    assert worst <= 4
    for r in range(n):
        for h in range(HEADS):
            alone = kt.quant_matmul(x[r, h:h + 1].contiguous(), w.raw[h], qtype, n_out, n_in)
            assert torch.equal(y[r, h:h + 1], alone), (r, h)
    reference = TorchBackend().linear_per_head(x.cpu(), StoredWeight(w.raw.cpu(), qtype, w.shape, torch.float32, "cpu"))
    diff = float((y.cpu() - reference).abs().max())
    print(f"[{WHERE}] against TorchBackend.linear_per_head (the CPU's formula): max |Δ| {diff:.2e}")
    assert diff <= 4 * EPS * float(scale.max())


def test_per_head_products_are_batch_invariant_and_take_long_batches_in_pieces(cuda_backend, monkeypatch):
    """bfloat16: a row alone gives the bits it gets in a batch of 16, and in batch-invariant mode a
    batch of 21 rows (pieces of 16) the bits of its rows alone."""
    w = stored_per_head(QType.Q8_0, KV_LORA, NOPE, seed=3)
    x = rand(21, HEADS, NOPE, seed=4).to(DEVICE, torch.bfloat16)
    batch = cuda_backend.linear_per_head(x[:16], w)
    alone = torch.cat([cuda_backend.linear_per_head(x[i:i + 1], w) for i in range(21)])
    assert torch.equal(batch, alone[:16])
    with batch_invariant(True):
        assert torch.equal(cuda_backend.linear_per_head(x, w), alone)
    launches = []
    real = kt.expert_matmul
    monkeypatch.setattr(kt, "expert_matmul", lambda *a: launches.append(1) or real(*a))
    with batch_invariant(True):
        cuda_backend.linear_per_head(x, w)
    assert len(launches) == 2  # 16 + 5 rows


# ---- the latent attention ---------------------------------------------------------------------------

def latent_case(n: int, cells: int, written: int, seed: int, dtype=torch.float32, scattered: bool = True):
    """(q_lat, q_pe, latent cells [cells, 1, 576], q_pos, k_pos): `written` cells at positions
    0..written-1 spread over the buffer, the others UNWRITTEN and holding large junk."""
    q = rand(n, HEADS, KV_LORA + ROPE, seed=seed)
    kv = rand(cells, 1, KV_LORA + ROPE, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    slots = torch.randperm(cells, generator=g)[:written] if scattered else torch.arange(written)
    k_pos = torch.full((cells,), UNWRITTEN, dtype=torch.long)
    k_pos[slots] = torch.arange(written)
    junk = torch.ones(cells, dtype=torch.bool)
    junk[slots] = False
    kv[junk] = 1e4
    q_pos = torch.arange(written - n, written)
    q, kv = q.to(dtype), kv.to(dtype)
    return q[..., :KV_LORA].contiguous(), q[..., KV_LORA:].contiguous(), kv, q_pos, k_pos


@pytest.mark.parametrize("n, cells, written", [(1, 40, 40), (4, 70, 33), (16, 50, 50)])
def test_latent_attention_within_float32_rounding(cuda_backend, n, cells, written):
    """One launch (V the latent's first 512 entries, the query in two pieces) against
    TorchBackend.latent_attention (the joined query over the latent as K and V, the CPU's formula):
    within the derived float32 rounding bound; the query joined in one tensor gives the same bits."""
    q_lat, q_pe, kv, q_pos, k_pos = latent_case(n, cells, written, seed=5)
    got = cuda_backend.latent_attention(*(t.to(DEVICE) for t in (q_lat, q_pe, kv, q_pos, k_pos)), SCALE)
    ref = TorchBackend().latent_attention(q_lat, q_pe, kv, q_pos, k_pos, SCALE)
    q = torch.cat([q_lat, q_pe], -1)
    bound = rounding_bound(q, kv, kv[..., :KV_LORA], q_pos, k_pos, SCALE, KV_LORA + ROPE)
    diff = (got.cpu().double() - ref.double()).abs()
    print(f"\n[{WHERE}, f32] latent attention n={n}, {written}/{cells} cells: max |Δ| {float(diff.max()):.2e}, "
          f"at most {float((diff / bound).max()):.2e} of the derived bound")
    assert got.shape == (n, HEADS, KV_LORA) and bool((diff <= bound).all())
    kv_d = kv.to(DEVICE)
    joined = kt.attention(q.to(DEVICE), kv_d, kv_d[..., :KV_LORA], q_pos.to(DEVICE), k_pos.to(DEVICE), SCALE)
    assert torch.equal(joined, got)


def test_latent_attention_is_batch_invariant_in_bf16(cuda_backend):
    """bfloat16: each row alone gives the bits it gets in a batch of 16 (one program per row, piece and
    head tile, the cells in fixed blocks and pieces)."""
    q_lat, q_pe, kv, q_pos, k_pos = (t.to(DEVICE) for t in latent_case(16, 48, 40, seed=6, dtype=torch.bfloat16))
    batch = cuda_backend.latent_attention(q_lat, q_pe, kv, q_pos, k_pos, SCALE)
    for i in range(16):
        alone = cuda_backend.latent_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv, q_pos[i:i + 1], k_pos, SCALE)
        assert torch.equal(alone, batch[i:i + 1]), i
    ref = TorchBackend().latent_attention(*(t.cpu() for t in (q_lat, q_pe, kv, q_pos, k_pos)), SCALE)
    diff = float((batch.cpu().float() - ref.float()).abs().max())
    print(f"\n[{WHERE}, bf16] latent attention: batch of 16 = rows alone; against the torch formula max |Δ| {diff:.2e}")
    assert diff <= 2 * 2.0 ** -7 * float(ref.float().abs().max())  # each side's rounding into bfloat16


def test_latent_attention_with_chosen_keys(cuda_backend):
    """A key mask `keep` [n, cells] (DeepSeek Sparse Attention's chosen keys): the softmax over the
    visible cells it keeps, against the masked formula in float64."""
    n, cells = 3, 45
    q_lat, q_pe, kv, q_pos, k_pos = latent_case(n, cells, cells, seed=7, scattered=False)
    keep = torch.rand(n, cells, generator=torch.Generator().manual_seed(8)) < 0.4
    kv_on = kv.to(DEVICE)  # one tensor: V is the view of its first entries
    got = kt.attention(q_lat.to(DEVICE), kv_on, kv_on[..., :KV_LORA], q_pos.to(DEVICE),
                       k_pos.to(DEVICE), SCALE, keep=keep.to(DEVICE), q_rest=q_pe.to(DEVICE))
    q = torch.cat([q_lat, q_pe], -1).double()
    lat = kv[:, 0].double()
    visible = (k_pos[None, :] <= q_pos[:, None]) & keep
    s = torch.einsum("nhd,td->nht", q, lat) * SCALE
    exact = torch.einsum("nht,td->nhd", torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), -1),
                         lat[:, :KV_LORA])
    diff = float((got.cpu().double() - exact).abs().max())
    print(f"\n[{WHERE}, f32] latent attention over chosen keys: max |Δ| {diff:.2e} against float64")
    assert diff <= 1e-4 * float(lat.abs().max())


def test_a_wide_head_without_values_in_keys_is_refused():
    """576-wide keys take the kernel only with V a view of their first entries: a V of its own that
    wide (or a split query without V in K) is a one-line error."""
    q_lat, q_pe, kv, q_pos, k_pos = (t.to(DEVICE) for t in latent_case(1, 20, 20, seed=9))
    q = torch.cat([q_lat, q_pe], -1)
    with pytest.raises(SpecconvError, match="head dimensions 576"):
        kt.attention(q, kv, kv.clone(), q_pos, k_pos, SCALE)
    with pytest.raises(SpecconvError, match="q_rest"):
        kt.attention(q_lat, kv[..., :KV_LORA], kv[..., :KV_LORA].clone(), q_pos, k_pos, SCALE, q_rest=q_pe)


def test_values_in_keys_under_inference_mode():
    """V as K's first entries is found by storage, not view tracking: views of a cache made under
    torch.inference_mode record no base (a context made there), and the latent path takes the kernel
    with the same bits as outside it; a V of its own with the same layout is not V in K."""
    q_lat, q_pe, kv, q_pos, k_pos = (t.to(DEVICE) for t in latent_case(2, 24, 24, seed=11))
    outside = kt.attention(q_lat, kv, kv[..., :KV_LORA], q_pos, k_pos, SCALE, q_rest=q_pe)
    with torch.inference_mode():
        cache = kv.clone()  # an inference tensor: its views have no _base
        k = cache[:24]
        assert k._base is None
        assert values_in_keys(k, k[..., :KV_LORA])
        assert not values_in_keys(k, torch.empty_like(k)[..., :KV_LORA])
        inside = kt.attention(q_lat, k, k[..., :KV_LORA], q_pos, k_pos, SCALE, q_rest=q_pe)
    assert torch.equal(inside, outside)


# ---- the graph --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek2_file(tmp_path_factory):
    return cuda_op_count.family_fixture(tmp_path_factory.mktemp("deepseek2"), "deepseek2-shapes")


def test_the_latent_is_stored_once(deepseek2_file):
    """The deepseek2 layouts keep each latent row once: a layer's V cells are views of its K cells'
    first kv_lora entries."""
    from specconv.runtime import Context, GraphType, load_model

    model = load_model(deepseek2_file, device="cpu", dtype="f32")
    ctx = Context(model, GraphType.MAIN, n_ctx=8)
    memory = ctx.memory
    kvl = model.hparams.kv_lora_rank
    for layer, k in memory.k.items():
        v = memory.v[layer]
        assert v.shape == k.shape[:-1] + (kvl,) and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()


def test_decode_step_and_verification_launch_the_same_kernels(deepseek2_file):
    """The step and the 4-row verification launch the same kernels (no per-row loop), none of them an
    einsum or a concatenation, no dequantization but the embedding row's; each within the family's
    ceiling (tests/fixtures/launch_ceilings.py)
    (170 per step and 212 per verification with the dequantized absorption weights, their per-row
    einsums and the latent written twice)."""
    counts = cuda_op_count.count_steps(deepseek2_file, "bf16", 3)
    print(f"\n[deepseek2-shapes, meta, bf16]\n{cuda_op_count.report(counts, 3)}")
    assert counts.step.total == counts.verify.total <= STEP_LAUNCHES["deepseek2-shapes"]
    assert counts.step.by_op == counts.verify.by_op
    for tally in (counts.step, counts.verify):
        assert tally.by_op["triton.dequantize_kernel"] <= 1  # the token's embedding row, outside the blocks
        for op in ("einsum", "cat", "bmm"):
            assert tally.by_op[op] == 0, op


def test_greedy_speculative_decoding_equals_plain_through_the_kernels(deepseek2_file, monkeypatch):
    """bf16 through the CUDA backend's kernels (the per-head products, the latent attention): a
    synthetic drafter's accepted and rejected drafts leave greedy output equal to plain decoding."""
    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from tests.fixtures.invariance import greedy_check

    device = "cuda" if ON_GPU else "cpu"
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CudaBackend(kt, device_types=(device,)))
    rows = []
    real = kt.attention
    monkeypatch.setattr(kt, "attention", lambda q, *a, **kw: rows.append(q.shape[0]) or real(q, *a, **kw))
    model = load_model(deepseek2_file, device=device, dtype="bf16")
    prompt = [(7 * i + 3) % model.vocab_size for i in range(10)]
    drafted, accepted = greedy_check(  # asserts speculative = plain
        model, [prompt], 8, lambda ids, plain: SyntheticDrafter(ids + plain, model.vocab_size, 0.6, seed=2),
        f"deepseek2-shapes, {device}, kernels")
    print(f"latent attention launches by rows {sorted(set(rows))}")
    assert 1 in rows and 4 in rows
    assert 0 < accepted < drafted
