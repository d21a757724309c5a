"""What the one-launch kernels around the products (runtime/kernels_triton: norm, rope, activation)
change in a decode step with the CUDA backend's choices, checked on the CPU:

* launches per step: counted on the `meta` device by benchmarks/cuda_op_count.py (aten operations
  and recorded Triton launches) for the CUDA backend, and for the same backend with the torch
  formulas around the products (the backend before these kernels). Every call of a seam operation
  (rms_norm, l2_norm, rope, gdn_gates, ...) becomes exactly one launch, the rest of the
  step is unchanged: the new count is the old one minus the seam formulas' operations plus one per
  call, per step and per verification batch;
* the forward: the tiny Qwen3.5 through the CUDA backend (Triton's interpreter on the CPU, compiled
  kernels on a GPU) with and without the kernels, float32 logits of a prompt and a verification
  batch; and greedy speculative decoding in bf16 equal to plain decoding with the kernels.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.fixtures.triton_mode import ON_GPU  # noqa: E402 (no GPU: the interpreter)

from benchmarks import cuda_op_count  # noqa: E402
from specconv.runtime import Context, GraphType, backend as backend_module, kernels_triton, load_model  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from tests.fixtures.counted_calls import CountedCalls  # noqa: E402
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402

torch.set_num_threads(1)

# SwiGLU's product is read by the down product's kernel (tests/runtime/test_cuda_glu_product.py)
SEAM = ("rms_norm", "add_rms_norm", "add_normed", "gated_rms_norm", "l2_norm", "rope", "normed_rope", "gdn_gates")
FUSED = ("triton.norm_kernel", "triton.rope_kernel", "triton.gdn_gates_kernel")


class TorchAroundProducts(CudaBackend, CountedCalls):
    """The CUDA backend with the torch formulas around the products (what it computed before the
    one-launch kernels). Counts, per active op counter, the seam calls and the launches inside them."""

    def __init__(self, device_type: str):
        super().__init__(kernels_triton, device_types=(device_type,))
        self.init_counts()
        self.folded = Counter()  # per op counter: add_rms_norm calls after a product (linear_add_rms_norm)

    def linear_add_rms_norm(self, x, w, h, weight, eps, up=None, act=None):
        """The product, then the counted add_rms_norm formula: the norm that the CUDA backend runs in
        the product's launch instead (tests/runtime/test_cuda_norm_tail.py), so no launch of its own."""
        counters = cuda_op_count.active_counters()
        if counters:
            self.folded[id(counters[0].tally)] += 1
        return TorchBackend.linear_add_rms_norm(self, x, w, h, weight, eps, up, act)


def _formula(name: str):
    def method(self, *args):
        return self.counted(lambda: getattr(TorchBackend, name)(self, *args))
    return method


for _name in SEAM:
    setattr(TorchAroundProducts, _name, _formula(_name))


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def q8_file(request, tmp_path_factory):
    return tiny_gguf(tmp_path_factory, moe=request.param, outtype="q8_0")[1]


def test_each_call_around_the_products_becomes_one_launch(q8_file):
    k = 3
    fused = cuda_op_count.count_steps(q8_file, "bf16", k)
    before = TorchAroundProducts("meta")
    unfused = cuda_op_count.count_steps(q8_file, "bf16", k, backend=before)
    print(f"\n[meta, bf16] with the one-launch kernels:\n{cuda_op_count.report(fused, k)}")
    print(f"[meta, bf16] torch formulas around the products:\n{cuda_op_count.report(unfused, k)}")
    for name, new, old in (("step", fused.step, unfused.step), ("verification", fused.verify, unfused.verify)):
        calls, inside, folded = before.calls[id(old)], before.inside[id(old)], before.folded[id(old)]
        launches = sum(new.by_op[op] for op in FUSED)
        print(f"{name}: {old.total} -> {new.total} launches: {calls} seam calls ({folded} in a product's launch), "
              f"{inside} launches of their torch formulas -> {launches}")
        assert calls > 0 and launches == calls - folded  # one launch per call, none for one a product makes
        assert new.total == old.total - inside + launches  # and nothing else changed
        assert not any(new.by_op[op] for op in ("rms_norm", "rsqrt", "softplus"))  # all inside kernels now
        for kind, (_, each) in cuda_op_count.block_summary(new, fused.recurrent).items():
            assert each < cuda_op_count.block_summary(old, unfused.recurrent)[kind][1], kind


def _install(monkeypatch, backend):
    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)


def _prompt_and_verification(model, ids, k):
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=k)
    head = ctx.decode(ids[:-k - 1]).logits
    return torch.cat([head, ctx.decode(ids[-k - 1:]).logits])


def test_the_forward_with_the_kernels_equals_the_torch_formulas(q8_file, monkeypatch):
    """float32, the same CUDA backend products: only the kernels around them differ (a few ulps per
    output), amplified through the tiny random model."""
    device = "cuda" if ON_GPU else "cpu"
    model = load_model(q8_file, device=device, dtype="f32")
    ids = [int(t) for t in prompt_ids(14, seed=12)]
    _install(monkeypatch, CudaBackend(kernels_triton, device_types=(device,)))
    fused = _prompt_and_verification(model, ids, 3)
    _install(monkeypatch, TorchAroundProducts(device))
    unfused = _prompt_and_verification(model, ids, 3)
    diff = float((fused - unfused).abs().max())
    print(f"\n[{device}, f32] logits with the kernels vs with the torch formulas: max |Δlogit| {diff:.2e}")
    assert diff <= 1e-4  # the float32 noise of a few ulps per norm; a wrong kernel moves logits by O(1)


def test_greedy_speculative_decoding_equals_plain_with_the_kernels_in_bf16(q8_file, monkeypatch):
    """The CUDA default dtype: verification batches of k + 1 rows through the kernels give each row
    the bits of a one-token step (batch-invariant kernels), so the synthetic drafter's accepted and
    rejected drafts leave greedy output equal to plain decoding."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    device = "cuda" if ON_GPU else "cpu"
    _install(monkeypatch, CudaBackend(kernels_triton, device_types=(device,)))
    model = load_model(q8_file, device=device, dtype="bf16")
    prompt, k = [int(t) for t in prompt_ids(6, seed=3)], 3
    plain = generate(model, prompt, 10).tokens
    spec = speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=2), prompt, 10,
                                SpecConfig(draft_max=k))
    stats = spec.stats["speculative"]
    print(f"\n[{device}, bf16, kernels] {stats['accepted']} of {stats['drafted']} drafts accepted; "
          f"speculative = plain: {spec.tokens == plain}")
    assert spec.tokens == plain
