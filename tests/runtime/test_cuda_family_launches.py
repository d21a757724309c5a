"""The fused operations around the products in every family's graph, not only Qwen3.5's
(tests/runtime/test_cuda_fused_step.py): launches per decode step with the CUDA backend's choices,
counted on the `meta` device by benchmarks/cuda_op_count.py, and the forward through the kernels.

* The families route a residual add and the norm after it through ops.add_rms_norm (trunk.py's
  pre-norm blocks: the attention's add with the FFN's norm, the FFN's with the next block's input
  norm or the output norm; the EAGLE-3 and DFlash heads), Gemma 4's sandwich norms with the product
  before them through ops.add_normed(_rms_norm) (the backend's linear_add_normed) and llama.cpp's
  NORM rope through ops.rope_pairs (llama, DeepSeek-V3, GLM-DSA): one launch each on CUDA. Counted
  against the same backend running those calls as separate operations (the residual add, then the
  norm kernel, as the graphs did; rope as the backend's torch formula, which the graphs' own
  formulas were, with one concatenation more in llama's), each such call is one launch where it was
  several, and nothing else in the step changed: every block's count drops, and the step's by
  exactly the separate form's launches minus one per call (one decode step and one verification
  batch of k + 1 tokens).
* No family's decode step launches more than its ceiling (tests/fixtures/launch_ceilings.py: the counts with these
  fusions; step35 also runs its unclamped SwiGLUs through ops.swiglu; Gemma 4, Step-3.5 and MiMo-V2
  their attention through the one-launch kernel with windows, sinks and Step-3.5's head-wise gate,
  Gemma 4 its rope frequencies made once, ops.rope_inv_freq).
* Those attentions are one launch per call, against the torch formulas they were (OWN_ATTENTION).
* Every GLU feed-forward's down product (SwiGLU, GeGLU, Gemma 4's per-layer input gate, routed
  experts') reads act(gate) · up itself (ops.glu_linear, CudaBackend.linear_glu): against the same
  backend running the GLU kernel first, each call launches one kernel less and nothing else changed.
* The forward through the kernels (Triton's interpreter on the CPU, compiled kernels on a GPU) gives
  the float32 logits of the torch reference within float32 noise (the fused calls include rope on
  strided head slices: DeepSeek-V3's q[..., dn:], the latent's rope part).

The CPU's bits are the family snapshot's (tests/families/test_family_snapshot.py): the torch formulas
of the fused operations are the operations the graphs ran before, in the same order.
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
from tests.fixtures.gguf_files import convert_gguf  # noqa: E402
from tests.fixtures.launch_ceilings import STEP_LAUNCHES  # noqa: E402
from tools import family_snapshot  # noqa: E402

torch.set_num_threads(1)

K = 3
# the families whose graphs attend their own cells (ops.attend_cells: sliding windows, sinks), one
# launch per call (test_sliding_window_attention_is_one_launch_per_call)
OWN_ATTENTION = ("gemma4-release", "gemma4-moe-shapes", "chained-step35", "chained-mimo2")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family fixture, outtype) -> (its converted file, its prompt), built on first use."""
    built, sources = {}, {}
    by_name = {f.name: f for f in family_snapshot.families()}

    def get(name: str, outtype: str):
        if name not in sources:
            root = tmp_path_factory.mktemp(name)
            sources[name] = (root, by_name[name].build(root / "build"))
        if (name, outtype) not in built:
            root, source = sources[name]
            path = convert_gguf(source.src, root / f"model.{outtype}.gguf", outtype=outtype)
            built[name, outtype] = (path, list(source.prompt))
        return built[name, outtype]
    return get


class CountedFusions(CudaBackend, CountedCalls):
    """The CUDA backend (its launches recorded on `meta`) that counts, per active op counter, the
    calls of the fused operations and the launches inside them. With `separate`, it runs them as the
    graphs did before: the residual add, then the norm kernel (after a product: the product first,
    whose launch otherwise ends with the add and norm); NORM rope as its torch formula."""

    def __init__(self, separate: bool):
        super().__init__(kernels_triton, device_types=("meta",))
        self.separate = separate
        self.init_counts()

    def add_rms_norm(self, h, delta, weight, eps):
        def separate():
            total = h + delta
            return total, self.rms_norm(total, weight, eps)
        return self.counted(separate if self.separate else lambda: super(CountedFusions, self).add_rms_norm(
            h, delta, weight, eps))

    def linear_add_rms_norm(self, x, w, h, weight, eps, up=None, act=None):
        form = TorchBackend.linear_add_rms_norm if self.separate else CudaBackend.linear_add_rms_norm
        return self.counted(lambda: form(self, x, w, h, weight, eps, up, act))

    def linear_add_normed(self, *args):
        form = TorchBackend.linear_add_normed if self.separate else CudaBackend.linear_add_normed
        return self.counted(lambda: form(self, *args))

    def rope(self, x, cos, sin, style):
        if style != "norm":  # NEOX rope was one launch already (ops.rope_neox_partial)
            return super().rope(x, cos, sin, style)
        form = TorchBackend.rope if self.separate else CudaBackend.rope
        return self.counted(lambda: form(self, x, cos, sin, style))


@pytest.mark.parametrize("name", sorted(STEP_LAUNCHES))
def test_each_fused_call_is_one_launch_and_no_family_count_rises(files, name):
    path, _ = files(name, "q8_0")
    fused_backend, separate_backend = CountedFusions(separate=False), CountedFusions(separate=True)
    fused = cuda_op_count.count_steps(path, "bf16", K, backend=fused_backend)
    separate = cuda_op_count.count_steps(path, "bf16", K, backend=separate_backend)
    print(f"\n[{name}, meta, bf16] fused:\n{cuda_op_count.report(fused, K)}\n"
          f"[{name}] as separate operations:\n{cuda_op_count.report(separate, K)}")
    blocks = len(fused.recurrent)
    for what, new, old in (("step", fused.step, separate.step), ("verification", fused.verify, separate.verify)):
        calls, inside = separate_backend.calls[id(old)], separate_backend.inside[id(old)]
        print(f"{what}: {old.total} -> {new.total} launches: {calls} fused calls, {inside} launches as separate "
              f"operations -> {fused_backend.inside[id(new)]}")
        assert calls >= blocks  # every block fuses at least its residual add with the next norm
        assert fused_backend.calls[id(new)] == calls and fused_backend.inside[id(new)] == calls  # one launch each
        assert new.total == old.total - inside + calls  # and nothing else changed
        for i in range(blocks):
            assert new.by_label[f"block {i}"] < old.by_label[f"block {i}"], (what, i)
    ceiling = STEP_LAUNCHES[name]
    print(f"decode step: {fused.step.total} launches (as separate operations {separate.step.total}, "
          f"ceiling {ceiling})")
    assert fused.step.total <= ceiling


class CountedAttention(CountedFusions):
    """The CUDA backend (launches recorded on `meta`) counting, per active op counter, the calls of
    `attention` and the launches inside them; with `separate`, running them as the torch formulas the
    graphs ran before (TorchBackend's, which are those formulas)."""

    def add_rms_norm(self, h, delta, weight, eps):
        return CudaBackend.add_rms_norm(self, h, delta, weight, eps)

    def linear_add_rms_norm(self, x, w, h, weight, eps, up=None, act=None):
        return CudaBackend.linear_add_rms_norm(self, x, w, h, weight, eps, up, act)

    def linear_add_normed(self, *args):
        return CudaBackend.linear_add_normed(self, *args)

    def rope(self, x, cos, sin, style):
        return CudaBackend.rope(self, x, cos, sin, style)

    def attention(self, *args, **kwargs):
        form = TorchBackend.attention if self.separate else CudaBackend.attention
        return self.counted(lambda: form(self, *args, **kwargs))


@pytest.mark.parametrize("name", OWN_ATTENTION)
def test_sliding_window_attention_is_one_launch_per_call(files, name):
    """Gemma 4, Step-3.5 and MiMo-V2 attend (sliding windows, sinks) through the backend's one-launch
    attention: against the same backend running those calls as the torch formulas, each call is one
    launch where it was several, nothing else in the step changed, and the step and the verification
    batch launch fewer kernels."""
    path, _ = files(name, "q8_0")
    fused_backend, separate_backend = CountedAttention(separate=False), CountedAttention(separate=True)
    fused = cuda_op_count.count_steps(path, "bf16", K, backend=fused_backend)
    separate = cuda_op_count.count_steps(path, "bf16", K, backend=separate_backend)
    for what, new, old in (("step", fused.step, separate.step), ("verification", fused.verify, separate.verify)):
        calls, inside = separate_backend.calls[id(old)], separate_backend.inside[id(old)]
        print(f"\n[{name}, meta, bf16] {what}: {old.total} -> {new.total} launches: {calls} attention "
              f"calls, {inside} launches as torch formulas -> {fused_backend.inside[id(new)]}")
        assert calls > 0 and fused_backend.calls[id(new)] == calls and fused_backend.inside[id(new)] == calls
        assert new.total == old.total - inside + calls < old.total


class CountedGlu(CountedAttention):
    """The CUDA backend (launches recorded on `meta`) counting, per active op counter, the calls of
    `linear_glu` (a GLU's down product) and the launches inside them; with `separate`, running each as
    the GLU kernel and then the product (what the graphs launched before the product read the GLU)."""

    def attention(self, *args, **kwargs):
        return CudaBackend.attention(self, *args, **kwargs)

    def linear_glu(self, gate, up, w, act):
        if self.separate:
            return self.counted(lambda: self.linear(self.glu(gate, up, act), w))
        return self.counted(lambda: CudaBackend.linear_glu(self, gate, up, w, act))

    def linear_add_rms_norm(self, x, w, h, weight, eps, up=None, act=None):
        """A GLU's down product with the add and norm after it (a dense FFN's, ops.Deferred): counted
        like linear_glu, the GLU's launch apart with `separate`."""
        if up is None:
            return CudaBackend.linear_add_rms_norm(self, x, w, h, weight, eps)
        if self.separate:
            return self.counted(lambda: CudaBackend.linear_add_rms_norm(self, self.glu(x, up, act), w, h, weight, eps))
        return self.counted(lambda: CudaBackend.linear_add_rms_norm(self, x, w, h, weight, eps, up, act))

    def linear_add_normed(self, x, w, h, weight, eps, scale=None, then=None, up=None, act=None):
        """A GeGLU's down product with the sandwich norm after it (Gemma 4's): likewise."""
        if up is None:
            return CudaBackend.linear_add_normed(self, x, w, h, weight, eps, scale, then)
        if self.separate:
            return self.counted(lambda: CudaBackend.linear_add_normed(self, self.glu(x, up, act), w, h, weight, eps,
                                                                      scale, then))
        return self.counted(lambda: CudaBackend.linear_add_normed(self, x, w, h, weight, eps, scale, then, up, act))


@pytest.mark.parametrize("name", sorted(STEP_LAUNCHES))
def test_glu_down_products_launch_no_glu_kernel(files, name):
    """Every family's GLU down products (dense, shared and routed experts, Gemma 4's GeGLUs and its
    per-layer input gate) read act(gate) · up inside the product kernel: one launch fewer per call
    than the GLU kernel and the product, nothing else changed, and no GLU kernel left in the step."""
    path, _ = files(name, "q8_0")
    fused_backend, separate_backend = CountedGlu(separate=False), CountedGlu(separate=True)
    fused = cuda_op_count.count_steps(path, "bf16", K, backend=fused_backend)
    separate = cuda_op_count.count_steps(path, "bf16", K, backend=separate_backend)
    for what, new, old in (("step", fused.step, separate.step), ("verification", fused.verify, separate.verify)):
        calls, inside = separate_backend.calls[id(old)], separate_backend.inside[id(old)]
        print(f"\n[{name}, meta, bf16] {what}: {old.total} -> {new.total} launches: {calls} GLU down products, "
              f"{inside} launches as GLU kernel + product -> {fused_backend.inside[id(new)]}")
        assert calls > 0 and fused_backend.calls[id(new)] == calls
        assert old.by_op["triton.glu_kernel"] == calls and not new.by_op["triton.glu_kernel"]
        assert fused_backend.inside[id(new)] == inside - calls and new.total == old.total - calls


def _install(monkeypatch, backend):
    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)


def _prompt_and_verification(model, ids):
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=K)
    head = ctx.decode(ids[:-K - 1]).logits
    return torch.cat([head, ctx.decode(ids[-K - 1:]).logits])


@pytest.mark.parametrize("name", ["llama-release", "deepseek2-shapes", "dsa-glm-dsa", "gemma4-moe-shapes"])
def test_the_forward_through_the_kernels_equals_the_torch_reference(files, name, monkeypatch):
    """float32 files: the products take torch's path on both sides, so only the kernels around them
    differ (a few ulps per output), amplified through the tiny random model."""
    device = "cuda" if ON_GPU else "cpu"
    path, prompt = files(name, "f32")
    model = load_model(path, device=device, dtype="f32")
    ids = prompt[:12]
    _install(monkeypatch, CudaBackend(kernels_triton, device_types=(device,)))
    kernels = _prompt_and_verification(model, ids)
    _install(monkeypatch, TorchBackend())
    reference = _prompt_and_verification(model, ids)
    diff = float((kernels - reference).abs().max())
    print(f"\n[{name}, {device}, f32] logits through the kernels vs the torch reference: max |Δlogit| {diff:.2e} "
          f"(largest |logit| {float(reference.abs().max()):.2f})")
    assert diff <= 1e-4  # the float32 noise of a few ulps per norm and rope; a wrong kernel moves logits by O(1)


@pytest.mark.parametrize("name", ["gemma4-release", "chained-mimo2"])  # windows; windows with sinks
def test_greedy_speculative_decoding_equals_plain_through_the_kernels_in_bf16(files, name, monkeypatch):
    """bf16 through the CUDA backend (its kernels: the windowed attention with sinks, gelu_mul, the
    norms and rope): verification batches of K + 1 rows give each row the bits of a one-token step,
    so a synthetic drafter's accepted and rejected drafts leave greedy output equal to plain decoding
    (with prompts past the sliding windows of the fixtures)."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    device = "cuda" if ON_GPU else "cpu"
    path, prompt = files(name, "q8_0")
    _install(monkeypatch, CudaBackend(kernels_triton, device_types=(device,)))
    rows = Counter()  # the attention kernel's launches by query rows
    real = kernels_triton.attention
    monkeypatch.setattr(kernels_triton, "attention", lambda q, *a, **kw: rows.update([q.shape[0]]) or real(q, *a, **kw))
    model = load_model(path, device=device, dtype="bf16")
    prompt = [t % model.vocab_size for t in prompt[:16]]  # past the fixtures' windows (4 to 8 tokens)
    plain = generate(model, prompt, 10).tokens
    spec = speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=2), prompt, 10,
                                SpecConfig(draft_max=K))
    stats = spec.stats["speculative"]
    print(f"\n[{name}, {device}, bf16, kernels] prompt {len(prompt)} tokens; {stats['accepted']} of "
          f"{stats['drafted']} drafts accepted; attention launches by rows {dict(sorted(rows.items()))}; "
          f"speculative = plain: {spec.tokens == plain}")
    assert rows[1] > 0 and rows[K + 1] > 0  # decode steps and verification batches took the kernel
    assert 0 < stats["accepted"] < stats["drafted"]
    assert spec.tokens == plain
