"""A per-head q or k RMS norm and the rotary embedding after it in one launch of the rope kernel
(runtime/kernels_triton/rope.py `norm_weight`; the seam's `normed_rope`, ops.normed_rope_neox):

* float32: within a few ulps of the torch formula (rms_norm, then rope), for partial and whole
  rotation, NEOX and NORM pairs, heads read through their strides;
* bfloat16: within the formula's two roundings (the norm, the rotation);
* a row alone gets the bits it gets in a batch of 16;
* through the seam: one launch; without a weight the rotation alone (the families whose q or k has no
  norm); float64 keeps the torch formula;
* q's and k's heads of one layer in one launch (kernels_triton.rope_qk): the bits of two `rope`
  calls, bf16 and float32, with and without norms, partial rotation, different head counts, strided
  views; with the K/V store (rope_qk_store): q's bits returned, k's and v's bits in the caches at
  the batch's cells and nothing else written; a row alone = the same row in a batch of 16;
* through the seam (normed_rope_qk, normed_rope_store): one launch, the torch formulas' order where
  the kernel does not fit (another cache dtype, float64);
* with the store, Gemma 4's weightless V norm in the same launch (v_norm): the reference's norm
  within its rounding, a row alone = in a batch;
* every family whose attention norms and ropes q and k (Qwen3, Qwen3.5, GLM-4.5, Gemma 4, Step-3.5,
  Hy3, llama's NORM rope) makes one launch per layer where the two ropes and the K/V store made
  three (Gemma 4: four, with its V norm; MiMo-V2, which pads its K/V before the store: two ropes,
  one launch), nothing else in its
  step changes, and its float32 forward through the kernels equals the torch reference's logits; a
  bf16 forward has the bits of the separate launches.

Without a GPU the kernel runs in Triton's interpreter (tests/fixtures/triton_mode.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from tests.fixtures.counted_calls import CountedCalls, family_q8_0, fused_against_separate  # noqa: E402

REF = TorchBackend()
EPS = 1e-6
# float32: the norm rounds five times on each side and sums its squares in another order, the
# rotation twice more: two correct evaluations differ by a few ulps of the result's magnitude
# (measured worst printed); a wrong formula or a lost term is off by thousands
ULPS = 16


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def spacing_units(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    """max |y - ref| in float32 ulps of `magnitude` (a rotated value can cancel to near 0, so the
    error is measured against the size of the terms, not of the result)."""
    mag = magnitude.detach().cpu().float().abs()
    spacing = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return float(((y.detach().cpu().float() - ref.detach().cpu().float()).abs() / spacing).max())


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("rotated", [8, 32])
def test_float32_within_a_few_ulps_of_norm_then_rope(style, rotated):
    """Heads of 32 (all or a quarter rotated), q a strided view of an interleaved q|gate projection."""
    x = rand(3, 4, 64, seed=1, scale=2)[..., :32]
    w = rand(32, seed=2, scale=0.5) + 1
    cos, sin = rand(3, rotated // 2, seed=3), rand(3, rotated // 2, seed=4)
    y = kt.rope(x, cos, sin, style, norm_weight=w, eps=EPS)
    ref = REF.normed_rope(x, w, EPS, cos, sin, style)
    # the size of the terms: |normed values| (≥ the rotated pair's largest)
    normed = REF.rms_norm(x, w, EPS)
    scale = normed.abs().amax(-1, keepdim=True).expand_as(normed)
    units = spacing_units(y, ref, scale)
    print(f"\n[{WHERE}] normed rope {style}, {rotated} of 32 rotated: max |Δ| "
          f"{float((y - ref).abs().max()):.2e} ({units:.1f} ulps of the head's largest value)")
    assert y.dtype == torch.float32 and units <= ULPS


def test_bfloat16_within_the_formulas_two_roundings():
    bf = torch.bfloat16
    x, w = rand(5, 3, 64, seed=5, dtype=bf), rand(64, seed=6) + 1
    cos, sin = rand(5, 16, seed=7), rand(5, 16, seed=8)
    y, ref = kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS), REF.normed_rope(x, w, EPS, cos, sin, "neox")
    # each rounding into bfloat16 moves a value v by ≤ 2^-8 |v| (to nearest) or 2^-7 |v| (the
    # interpreter truncates): the normed values (the rotation's inputs, |cos|, |sin| ≤ their
    # magnitude's factor), then the result, on either side
    normed = REF.rms_norm(x, w, EPS).float()
    c, s = cos.abs().max(), sin.abs().max()
    bound = 1.5 * 2.0 ** -7 * (normed.abs().amax(-1, keepdim=True) * (c + s) + ref.float().abs()) + 1e-6
    excess = float(((y.float() - ref.float()).abs() / bound).max())
    print(f"\n[{WHERE}] normed rope bf16: max |Δ| {float((y.float() - ref.float()).abs().max()):.2e}, "
          f"{excess:.2f} of the two roundings' bound")
    assert y.dtype == bf and excess <= 1.0


def test_a_row_alone_gets_the_bits_of_a_batch_of_16():
    x, w = rand(16, 4, 64, seed=9, dtype=torch.bfloat16), rand(64, seed=10)
    cos, sin = rand(16, 16, seed=11), rand(16, 16, seed=12)
    together = kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS)
    for i in (0, 5, 15):
        alone = kt.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], "neox", norm_weight=w, eps=EPS)
        assert torch.equal(alone, together[i:i + 1]), i
    print(f"\n[{WHERE}] rows 0, 5, 15 alone = in a batch of 16, bit for bit")


def test_bad_input_is_a_one_line_error():
    x, cos = rand(2, 1, 8, seed=13), rand(2, 2, seed=14)
    with pytest.raises(SpecconvError, match="rope: norm_weight has shape"):
        kt.rope(x, cos, cos, "neox", norm_weight=rand(7, seed=15))
    with pytest.raises(SpecconvError, match="rope: norm_weight must be float"):
        kt.rope(x, cos, cos, "neox", norm_weight=torch.ones(8, dtype=torch.int32, device=DEVICE))


def test_the_seam_launches_once_rotates_alone_without_a_weight_and_keeps_float64(monkeypatch):
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    x, w = rand(2, 3, 16, seed=16), rand(16, seed=17)
    cos, sin = rand(2, 4, seed=18), rand(2, 4, seed=19)
    y = cuda.normed_rope(x, w, EPS, cos, sin, "neox")
    assert launched == ["rope_kernel"]
    assert torch.equal(y, kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS))
    launched.clear()
    assert torch.equal(cuda.normed_rope(x, None, EPS, cos, sin, "norm"), kt.rope(x, cos, sin, "norm"))
    assert launched == ["rope_kernel", "rope_kernel"]
    assert not torch.equal(y, kt.rope(x, cos, sin, "neox"))  # the norm is not skipped when given
    launched.clear()
    x64 = x.double()
    assert torch.equal(cuda.normed_rope(x64, w, EPS, cos, sin, "neox"), REF.normed_rope(x64, w, EPS, cos, sin, "neox"))
    assert launched == []


def qk_inputs(n: int, dtype, seed: int, q_heads: int = 4, k_heads: int = 2, head_dim: int = 32, rotated: int = 32):
    """q a strided view (the q half of an interleaved q|gate projection), k a view of a contiguous
    [n, k_heads · head_dim] product, v [n, k_heads, head_dim]; cos, sin for `rotated` values."""
    q = rand(n, q_heads, 2 * head_dim, seed=seed, scale=2, dtype=dtype)[..., :head_dim]
    k = rand(n, k_heads * head_dim, seed=seed + 1, scale=2, dtype=dtype).view(n, k_heads, head_dim)
    v = rand(n, k_heads, head_dim, seed=seed + 2, dtype=dtype)
    cos, sin = rand(n, rotated // 2, seed=seed + 3), rand(n, rotated // 2, seed=seed + 4)
    return q, k, v, cos, sin


NORMS = {"both": (True, True), "none": (False, False), "k only": (False, True)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("norms", sorted(NORMS))
@pytest.mark.parametrize("style,rotated", [("neox", 32), ("neox", 8), ("norm", 16)])
def test_q_and_k_in_one_launch_have_the_bits_of_two_rope_calls(dtype, norms, style, rotated):
    q, k, v, cos, sin = qk_inputs(3, dtype, seed=20, rotated=rotated)
    wq, wk = (rand(32, seed=s, scale=0.5) + 1 if on else None for s, on in zip((25, 26), NORMS[norms]))
    yq, yk = kt.rope_qk(q, k, cos, sin, style, wq, wk, eps=EPS)
    rq = kt.rope(q, cos, sin, style, norm_weight=wq, eps=EPS)
    rk = kt.rope(k, cos, sin, style, norm_weight=wk, eps=EPS)
    assert torch.equal(yq, rq) and torch.equal(yk, rk)
    k_cache, v_cache = (torch.full((9, 2, 32), 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    cells = torch.tensor([6, 1, 4], device=DEVICE)
    stored_q = kt.rope_qk_store(q, k, v, cos, sin, style, k_cache, v_cache, cells, wq, wk, eps=EPS)
    assert torch.equal(stored_q, rq)
    assert torch.equal(k_cache[cells], rk) and torch.equal(v_cache[cells], v)
    others = torch.tensor([c for c in range(9) if c not in (6, 1, 4)], device=DEVICE)
    assert bool((k_cache[others] == 7).all()) and bool((v_cache[others] == 7).all())  # nothing else written
    print(f"\n[{WHERE}] {dtype}, norms {norms}, {style} {rotated} of 32: rope_qk and rope_qk_store = two rope "
          f"calls (+ the K/V store), bit for bit")


def test_heads_of_other_sizes_and_counts_and_a_value_width_of_its_own():
    """q of 6 heads, k of 1, heads of 24 (a rest of 8 copied), v heads of 16."""
    q, k, _, cos, sin = qk_inputs(2, torch.bfloat16, seed=30, q_heads=6, k_heads=1, head_dim=24, rotated=16)
    v = rand(2, 1, 16, seed=35, dtype=torch.bfloat16)
    w = rand(24, seed=36)
    k_cache = torch.zeros(4, 1, 24, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros(4, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    cells = torch.tensor([3, 0], device=DEVICE)
    yq = kt.rope_qk_store(q, k, v, cos, sin, "neox", k_cache, v_cache, cells, w, w, eps=EPS)
    assert torch.equal(yq, kt.rope(q, cos, sin, "neox", norm_weight=w, eps=EPS))
    assert torch.equal(k_cache[cells], kt.rope(k, cos, sin, "neox", norm_weight=w, eps=EPS))
    assert torch.equal(v_cache[cells], v)


def test_a_row_alone_gets_the_bits_it_gets_in_a_batch_of_16_with_the_store():
    q, k, v, cos, sin = qk_inputs(16, torch.bfloat16, seed=40, rotated=16)
    wq, wk = rand(32, seed=45), rand(32, seed=46)
    caches = [torch.zeros(16, 2, 32, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    cells = torch.arange(16, device=DEVICE)
    together = kt.rope_qk_store(q, k, v, cos, sin, "neox", *caches, cells, wq, wk, eps=EPS)
    for i in (0, 5, 15):
        alone = [torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
        r = slice(i, i + 1)
        yq = kt.rope_qk_store(q[r], k[r], v[r], cos[r], sin[r], "neox", *alone, cells[:1], wq, wk, eps=EPS)
        assert torch.equal(yq, together[r]) and torch.equal(alone[0], caches[0][r]), i
    print(f"\n[{WHERE}] rope_qk_store: rows 0, 5, 15 alone = in a batch of 16, bit for bit")


def test_bad_q_k_or_cache_input_is_a_one_line_error():
    q, k, v, cos, sin = qk_inputs(2, torch.float32, seed=50)
    caches = [torch.zeros(4, 2, 32, device=DEVICE) for _ in range(2)]
    cells = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(SpecconvError, match="rope_qk: q is torch.float32, k torch.bfloat16"):
        kt.rope_qk(q, k.bfloat16(), cos, sin)
    with pytest.raises(SpecconvError, match=r"rope_qk: expected q \[n, q_heads, head_dim\]"):
        kt.rope_qk(q, k[..., :16], cos, sin)
    with pytest.raises(SpecconvError, match="rope_qk_store: k is torch.float32, its cache torch.bfloat16"):
        kt.rope_qk_store(q, k, v, cos, sin, "neox", caches[0].bfloat16(), caches[1], cells)
    with pytest.raises(SpecconvError, match="rope_qk_store: cells must be a contiguous int64 vector of 2"):
        kt.rope_qk_store(q, k, v, cos, sin, "neox", *caches, cells.int())


def test_the_seam_takes_q_and_k_in_one_launch_and_keeps_the_formulas_elsewhere(monkeypatch):
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    q, k, v, cos, sin = qk_inputs(2, torch.bfloat16, seed=60, rotated=16)
    wq, wk = rand(32, seed=65), rand(32, seed=66)
    yq, yk = cuda.normed_rope_qk(q, k, wq, wk, EPS, cos, sin, "neox")
    assert launched == ["qk_rope_kernel"]
    assert torch.equal(yq, kt.rope(q, cos, sin, "neox", norm_weight=wq, eps=EPS))
    assert torch.equal(yk, kt.rope(k, cos, sin, "neox", norm_weight=wk, eps=EPS))
    caches = [torch.zeros(4, 2, 32, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    cells = torch.tensor([2, 0], device=DEVICE)
    launched.clear()
    assert torch.equal(cuda.normed_rope_store(q, k, v, wq, wk, EPS, cos, sin, "neox", *caches, cells), yq)
    assert launched == ["qk_rope_kernel"] and torch.equal(caches[0][cells], yk) and torch.equal(caches[1][cells], v)
    launched.clear()  # a float32 cache for bf16 K/V: the rope in one launch, the store converts (torch)
    wide = [torch.zeros(4, 2, 32, device=DEVICE) for _ in range(2)]
    assert torch.equal(cuda.normed_rope_store(q, k, v, wq, wk, EPS, cos, sin, "neox", *wide, cells), yq)
    assert launched == ["qk_rope_kernel"] and torch.equal(wide[0][cells], yk.float())
    launched.clear()  # float64: the torch formulas, q then k, then the store
    q64, k64, v64 = q.double(), k.double(), v.double()
    c64 = [torch.zeros(4, 2, 32, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    got = cuda.normed_rope_store(q64, k64, v64, wq, wk, EPS, cos, sin, "neox", *c64, cells)
    assert launched == []
    assert torch.equal(got, REF.normed_rope(q64, wq, EPS, cos, sin, "neox"))
    assert torch.equal(c64[0][cells], REF.normed_rope(k64, wk, EPS, cos, sin, "neox"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_store_norms_v_without_a_weight_in_the_same_launch(dtype, monkeypatch):
    """Gemma 4's V norm (v_norm): v's heads RMS-normed without a weight before the store, in the
    rope launch: float32 within ULPS of the reference's rms_norm(v, None, eps), bfloat16 within its
    one rounding (2^-8 |v| to nearest, 2^-7 truncated under the interpreter, plus float32 noise); q
    and k as without it; a row alone the bits of its row in a batch of 16; through the seam one
    launch, the torch backend's form the norm, then the store."""
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    q, k, v, cos, sin = qk_inputs(16, dtype, seed=70, rotated=16)
    v = v * 3
    wq, wk = rand(32, seed=75), rand(32, seed=76)
    cells = torch.arange(16, device=DEVICE).flip(0).contiguous()
    caches = [torch.zeros(20, 2, 32, dtype=dtype, device=DEVICE) for _ in range(2)]
    plain = [torch.zeros(20, 2, 32, dtype=dtype, device=DEVICE) for _ in range(2)]
    yq = kt.rope_qk_store(q, k, v, cos, sin, "neox", *caches, cells, wq, wk, eps=EPS, v_norm=True)
    assert torch.equal(yq, kt.rope_qk_store(q, k, v, cos, sin, "neox", *plain, cells, wq, wk, eps=EPS))
    assert torch.equal(caches[0], plain[0])
    got, ref = caches[1][cells].float(), REF.rms_norm(v, None, EPS).float()
    exact = REF.rms_norm(v.float(), None, EPS)
    if dtype == torch.float32:
        units = spacing_units(got, ref, ref)
        print(f"\n[{WHERE}] V norm in the store, f32: {units:.1f} ulps of the reference")
        assert units <= ULPS
    else:
        worst = float(((got - exact).abs() / (2.0 ** -7 * exact.abs()).clamp_min(1e-30)).max())
        print(f"\n[{WHERE}] V norm in the store, bf16: {worst:.2f} x 2^-7 |v| from the float32 norm")
        assert worst <= 1.05
    for i in (0, 9):
        alone = [torch.zeros_like(c) for c in caches]
        kt.rope_qk_store(q[i:i + 1], k[i:i + 1], v[i:i + 1], cos[i:i + 1], sin[i:i + 1], "neox", *alone,
                         cells[i:i + 1], wq, wk, eps=EPS, v_norm=True)
        assert torch.equal(alone[1][cells[i]], caches[1][cells[i]]), i
    seam = [torch.zeros_like(c) for c in caches]
    launched.clear()
    assert torch.equal(cuda.normed_rope_store(q, k, v, wq, wk, EPS, cos, sin, "neox", *seam, cells, True), yq)
    assert launched == ["qk_rope_kernel"] and torch.equal(seam[1], caches[1])
    torch_form = [torch.zeros_like(c) for c in caches]
    REF.normed_rope_store(q.cpu(), k.cpu(), v.cpu(), wq.cpu(), wk.cpu(), EPS, cos.cpu(), sin.cpu(), "neox",
                          *torch_form, cells.cpu(), True)
    assert torch.equal(torch_form[1][cells.cpu()], REF.rms_norm(v.cpu(), None, EPS))


class CountedQKRope(CudaBackend, CountedCalls):
    """The CUDA backend (launches recorded on `meta`) counting the calls of normed_rope_qk and
    normed_rope_store and the launches inside them; with `separate`, running them as the graphs did
    before: one normed_rope for q, one for k (a kernel each), then write_kv's kernel."""

    def __init__(self, separate: bool):
        super().__init__(kt, device_types=("meta",))
        self.separate = separate
        self.init_counts()

    def normed_rope_qk(self, q, k, q_weight, k_weight, eps, cos, sin, style):
        form = TorchBackend.normed_rope_qk if self.separate else CudaBackend.normed_rope_qk
        return self.counted(lambda: form(self, q, k, q_weight, k_weight, eps, cos, sin, style))

    def normed_rope_store(self, *args):
        form = TorchBackend.normed_rope_store if self.separate else CudaBackend.normed_rope_store
        return self.counted(lambda: form(self, *args))


# the families whose attention norms (or not: GLM-4.5's optional norms, llama, MiMo-V2) and ropes q
# and k, and the launches each call replaces: q's rope, k's rope and write_kv (normed_rope_store; and
# Gemma 4's V norm), or the two ropes (normed_rope_qk: MiMo-V2 pads its K/V before the store)
QK_FAMILIES = {"qwen3-release": 3, "qwen35-release": 3, "glm4moe-release": 3, "gemma4-release": 4,
               "chained-step35": 3, "chained-hy_v3": 3, "llama-release": 3, "chained-mimo2": 2}


@pytest.mark.parametrize("name", sorted(QK_FAMILIES))
def test_families_norm_rope_and_store_q_k_v_in_one_launch_per_layer(tmp_path, name):
    """Each attention layer: one launch where q's rope, k's rope (and write_kv, and Gemma 4's V norm)
    made three (two; four)."""
    _, counts = fused_against_separate(family_q8_0(tmp_path, name), CountedQKRope)
    replaced = QK_FAMILIES[name]
    for what, calls, inside, new, old in counts:
        print(f"\n[{name}, meta, bf16] {what}: {old.total} -> {new.total} launches; {calls} q/k ropes "
              f"{'with the K/V store ' if replaced >= 3 else ''}({inside} launches as separate operations)")
        assert calls >= 1 and inside == replaced * calls
        if replaced >= 3:
            assert old.by_op["triton.write_kv_kernel"] == calls and not new.by_op["triton.write_kv_kernel"]


def _family_file(tmp_path, name: str, outtype: str):
    """The GGUF of family snapshot fixture `name` in `outtype`, and its prompt."""
    from tests.fixtures.gguf_files import convert_gguf
    from tools import family_snapshot

    source = {f.name: f for f in family_snapshot.families()}[name].build(tmp_path / "build")
    return convert_gguf(source.src, tmp_path / f"model.{outtype}.gguf", outtype=outtype), list(source.prompt)


def _logits(monkeypatch, backend, model, ids, k: int = 3):
    """A prompt's logits and a verification batch's of k + 1 tokens, with `backend` for every device."""
    from specconv.runtime import Context, GraphType, backend as backend_module

    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=k)
    head = ctx.decode(ids[:-k - 1]).logits
    return torch.cat([head, ctx.decode(ids[-k - 1:]).logits])


@pytest.mark.parametrize("name", ["qwen35-release", "glm4moe-release", "gemma4-release", "chained-step35",
                                  "chained-mimo2"])
def test_the_forward_through_the_kernels_equals_the_torch_reference(tmp_path, monkeypatch, name):
    """float32 files: the products take torch's path on both sides, so only the kernels around them
    differ (a few ulps per norm and rope), amplified through the tiny random model."""
    from specconv.runtime import load_model

    path, prompt = _family_file(tmp_path, name, "f32")
    model = load_model(path, device=DEVICE.type, dtype="f32")
    ids = prompt[:12]
    kernels = _logits(monkeypatch, CudaBackend(kt, device_types=(DEVICE.type,)), model, ids)
    reference = _logits(monkeypatch, TorchBackend(), model, ids)
    diff = float((kernels - reference).abs().max())
    print(f"\n[{name}, {WHERE}, f32] logits through the kernels vs the torch reference: max |Δlogit| {diff:.2e} "
          f"(largest |logit| {float(reference.abs().max()):.2f})")
    assert diff <= 1e-4  # the float32 noise of a few ulps per norm and rope; a wrong kernel moves logits by O(1)


class SeparateQKRope(CudaBackend):
    """The CUDA backend running normed_rope_qk and normed_rope_store as the graphs did before: a rope
    kernel for q, one for k, then write_kv's kernel."""

    normed_rope_qk = TorchBackend.normed_rope_qk
    normed_rope_store = TorchBackend.normed_rope_store


def test_a_bf16_forward_has_the_bits_of_the_separate_launches(tmp_path, monkeypatch):
    """Qwen3's q8_0 file in bf16 (its products through the kernels as well): the prompt's and the
    verification batch's logits with the one-launch rope and store equal, bit for bit, those with the
    separate rope and write_kv kernels."""
    from specconv.runtime import load_model

    path, prompt = _family_file(tmp_path, "qwen3-release", "q8_0")
    model = load_model(path, device=DEVICE.type, dtype="bf16")
    ids = prompt[:8]
    launched = record_launches(monkeypatch)
    fused = _logits(monkeypatch, CudaBackend(kt, device_types=(DEVICE.type,)), model, ids)
    assert "qk_rope_kernel" in launched and "write_kv_kernel" not in launched and "rope_kernel" not in launched
    launched.clear()
    separate = _logits(monkeypatch, SeparateQKRope(kt, device_types=(DEVICE.type,)), model, ids)
    assert "qk_rope_kernel" not in launched and "write_kv_kernel" in launched and "rope_kernel" in launched
    print(f"\n[qwen3-release, {WHERE}, bf16] one launch vs separate launches: max |Δlogit| "
          f"{float((fused - separate).abs().max()):.2e}")
    assert torch.equal(fused, separate)
