"""The MoE routers with a selection bias, expert groups and scales in one launch
(runtime/kernels_triton/routing.py `grouped_topk`, CudaBackend.route_grouped), and the un-gated
shared expert's add in one (`add_shared`).

* the kernel against the torch formula (TorchBackend.route_grouped: σ or softmax scores, the biased
  choice, each group scored by its two best, the best groups kept, a stable sort for the top k,
  weights renormalised, per-expert scaled and scaled) at the routing shapes of real releases: the
  same chosen experts slot by slot, weights within a stated float32 ulp bound (printed);
* ties, made exact (logits and bias from a few values, so both sides compute equal choices for
  equal inputs and well separated ones otherwise): the chosen experts and kept groups are the
  reference's, the lowest index first, and the reference's rule is that one (checked by a loop);
* batch invariance: a row alone has the bits of the same row in a batch of 16;
* the backend takes the kernel where it fits and the torch formula elsewhere (float64, a group
  split the kernel does not take), and the one-line errors of bad input;
* add_shared: the bits of the torch formula (one float32 add, one rounding), float32 and bf16 (bf16 in
  the interpreter, which truncates: one of the float32 sum's two bf16 neighbours); moe_combine with
  the shared experts' output and the compute dtype (CudaBackend.moe_out: no launch of their own): the
  torch formula's bits the same way, a row alone == the row in a batch;
* launches of one decode step and one verification batch (counted on the `meta` device by
  benchmarks/cuda_op_count.py) of every family whose graph routes through route_grouped /
  route_softmax_topk (Qwen3-MoE, GLM-4.5, DeepSeek-V3, the DSA and chained-MTP families, Gemma 4's
  MoE): each router is one launch, the MoE output's rounding and shared add launch nothing of their
  own, nothing else changes, and each family's step is at most its ceiling;
* the forward of those families through the kernels: the torch reference's float32 logits within
  float32 noise (printed), and in bf16 greedy speculative output equal to plain decoding (GLM-4.5).
Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, ON_GPU  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs import names  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt, load_model  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from tests.fixtures.counted_calls import CountedCalls  # noqa: E402
from tests.fixtures.gguf_files import convert_gguf  # noqa: E402
from tests.fixtures.launch_ceilings import STEP_LAUNCHES  # noqa: E402
from tests.fixtures.tiny_qwen3 import build_qwen3  # noqa: E402
from tests.runtime.test_cuda_family_launches import _install, _prompt_and_verification  # noqa: E402
from tests.runtime.test_cuda_moe_launches import reference_combine  # noqa: E402
from tools import family_snapshot  # noqa: E402

torch.set_num_threads(1)
SIGMOID, SOFTMAX = names.EXPERT_GATING_SIGMOID, names.EXPERT_GATING_SOFTMAX
MAX_ULPS = 8  # σ / exp, a softmax sum and the renormalisation's sum in another order, a division

# release -> routing (config.json): experts, k, gating, groups, groups kept, renormalised, scale,
# a selection bias, a per-expert scale
RELEASES = {
    "DeepSeek-V3": (256, 8, SIGMOID, 8, 4, True, 2.5, True, False),
    "DeepSeek-V2": (160, 6, SOFTMAX, 8, 3, False, 16.0, False, False),
    "GLM-4.5": (160, 8, SIGMOID, 1, 1, True, 2.5, True, False),
    "GLM-4.5-Air": (128, 8, SIGMOID, 1, 1, True, 1.0, True, False),
    "Kimi-K2": (384, 8, SIGMOID, 1, 1, True, 2.827, True, False),
    "Qwen3-MoE no renormalisation": (128, 8, SOFTMAX, 1, 1, False, 1.0, False, False),
    "Gemma 4 MoE": (128, 8, SOFTMAX, 1, 1, True, 1.0, False, True),
    "1000 experts, 10 groups": (1000, 4, SIGMOID, 10, 2, True, 1.0, True, True),
    "one group of 8 kept": (64, 6, SIGMOID, 8, 1, True, 1.0, True, False),
    "one group of 2 kept": (8, 3, SIGMOID, 2, 1, True, 2.5, True, False),
}


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in float32 ulps of want."""
    want = want.abs()
    spacing = torch.nextafter(want, torch.full_like(want, float("inf"))) - want
    return float(((got.abs() - want).abs() / spacing).max())


def routing_inputs(n: int, n_experts: int, seed: int, bias: bool, expert_scale: bool):
    """Random logits at a router's scale, a bias of DeepSeek-V3's order (tenths), per-expert scales."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, n_experts, generator=gen) * 2.0
    b = torch.rand(n_experts, generator=gen) * 0.2 if bias else None
    s = torch.rand(n_experts, generator=gen) + 0.5 if expert_scale else None
    return logits, b, s


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def run_both(logits, k, gating, bias, groups, groups_used, renormalise, scale, expert_scale):
    got = kt.grouped_topk(*on_device(logits), k, gating == SIGMOID, *on_device(bias), groups=groups,
                          groups_used=groups_used, renormalise=renormalise, scale=scale,
                          expert_scale=on_device(expert_scale)[0])
    want = TorchBackend().route_grouped(logits, k, gating, bias, groups, groups_used, renormalise, scale, expert_scale)
    return [t.cpu() for t in got], want


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_kernel_matches_the_torch_formula_at_release_shapes(release):
    n_experts, k, gating, groups, used, renormalise, scale, bias, expert_scale = RELEASES[release]
    logits, b, s = routing_inputs(16, n_experts, seed=n_experts + k, bias=bias, expert_scale=expert_scale)
    (weights, chosen), (ref_w, ref_c) = run_both(logits, k, gating, b, groups, used, renormalise, scale, s)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64 and chosen.shape == (16, k)
    assert torch.equal(chosen, ref_c)  # slot by slot: the same experts in the same order
    err = ulps(weights, ref_w)
    print(f"\n[grouped_topk {DEVICE.type}, {release}: {n_experts} experts, k={k}, groups {used}/{groups}] "
          f"chosen equal; max weight error {err:.1f} ulps (bound {MAX_ULPS}), "
          f"max |Δw| {float((weights - ref_w).abs().max()):.3g}")
    assert err <= MAX_ULPS
    if groups > 1:  # every chosen expert lies in one of the `used` kept groups
        assert all(len(set((row // (n_experts // groups)).tolist())) <= used for row in chosen)


def stable_rule(logits, k, gating, bias, groups, used):
    """The reference's selection written out as a loop: choice = score + bias; groups ranked by the sum
    of their two largest choices (lowest group first among equal sums), the `used` best kept; then k
    times the largest remaining choice, the lowest index among equal ones."""
    scores = torch.sigmoid(logits) if gating == SIGMOID else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    out = []
    for row in choice.tolist():
        size = len(row) // groups
        eligible = set(range(len(row)))
        if groups > 1:
            sums = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
            kept = sorted(range(groups), key=lambda g: (-sums[g], g))[:used]
            eligible = {e for e in eligible if e // size in kept}
        ranked = sorted(range(len(row)), key=lambda e: (e not in eligible, -row[e], e))
        out.append(ranked[:k])
    return torch.tensor(out)


@pytest.mark.parametrize("gating,groups,used,k", [(SIGMOID, 8, 4, 8), (SIGMOID, 1, 1, 6), (SOFTMAX, 4, 2, 5),
                                                  (SIGMOID, 4, 3, 12), (SIGMOID, 8, 1, 4)])
def test_exact_ties_give_the_reference_experts_lowest_index_first(gating, groups, used, k):
    gen = torch.Generator().manual_seed(groups * 10 + k)
    n_experts = 64
    # logits from five values, bias from two: choices tie exactly within a class, classes lie far apart
    logits = torch.randint(-2, 3, (24, n_experts), generator=gen).float()
    bias = torch.randint(0, 2, (n_experts,), generator=gen).float() * 0.5
    (weights, chosen), (ref_w, ref_c) = run_both(logits, k, gating, bias, groups, used, True, 1.0, None)
    rule = stable_rule(logits, k, gating, bias, groups, used)
    assert torch.equal(ref_c, rule)  # the torch formula's rule is the stated one
    assert torch.equal(chosen, ref_c)
    # all choices equal: groups and experts by index alone, the lowest experts of the lowest groups
    _, level = kt.grouped_topk(torch.zeros(2, n_experts, device=DEVICE), k, gating == SIGMOID, groups=groups,
                               groups_used=used)
    assert level.cpu().tolist() == [list(range(k))] * 2
    err = ulps(weights, ref_w)
    print(f"\n[grouped_topk ties {DEVICE.type}, groups {used}/{groups}, k={k}] chosen equal; "
          f"max weight error {err:.1f} ulps")
    assert err <= MAX_ULPS


def test_more_experts_wanted_than_the_kept_groups_hold_is_refused():
    logits = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(SpecconvError, match="groups"):
        kt.grouped_topk(logits, 9, True, groups=4, groups_used=2)  # 2 groups of 4 experts hold 8
    with pytest.raises(SpecconvError, match="groups"):
        kt.grouped_topk(logits, 2, True, groups=5, groups_used=2)  # 16 experts into 5 groups


def test_a_row_alone_has_the_bits_of_the_row_in_a_batch_of_16():
    logits, bias, scale = (t.to(DEVICE) for t in routing_inputs(16, 256, seed=3, bias=True, expert_scale=True))
    for sigmoid, groups, used in ((True, 8, 4), (False, 1, 1)):
        batch_w, batch_c = kt.grouped_topk(logits, 8, sigmoid, bias, groups=groups, groups_used=used, scale=2.5,
                                           expert_scale=scale)
        for r in (0, 7, 15):
            w, c = kt.grouped_topk(logits[r:r + 1].clone(), 8, sigmoid, bias, groups=groups, groups_used=used,
                                   scale=2.5, expert_scale=scale)
            assert torch.equal(w, batch_w[r:r + 1]) and torch.equal(c, batch_c[r:r + 1])


def test_the_backend_takes_the_kernel_where_it_fits(monkeypatch):
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    taken = []
    real = kt.grouped_topk
    monkeypatch.setattr(kt, "grouped_topk", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    logits, bias, _ = on_device(*routing_inputs(2, 32, seed=1, bias=True, expert_scale=False))
    w, c = backend.route_grouped(logits, 4, SIGMOID, bias, 4, 2, True, 2.5)
    ref_w, ref_c = TorchBackend().route_grouped(logits.cpu(), 4, SIGMOID, bias.cpu(), 4, 2, True, 2.5)
    assert taken == [1] and torch.equal(c.cpu(), ref_c)
    w, _ = backend.route_grouped(logits.double(), 4, SIGMOID, bias, 4, 2, True, 2.5)  # float64: the torch formula
    assert taken == [1] and w.dtype == torch.float64
    # groups of one expert: the kernel does not take them (the torch formula's topk(2) refuses them)
    with pytest.raises(RuntimeError):
        backend.route_grouped(logits, 4, SIGMOID, bias, 32, 8, True, 1.0)
    assert taken == [1]
    # the settings of a family without groups (n_group None) and without a scale
    _, c = backend.route_grouped(logits, 4, SOFTMAX, None, None, None, False, 1.0)
    assert taken == [1, 1] and torch.equal(c.cpu(), TorchBackend().route_grouped(logits.cpu(), 4, SOFTMAX, None, None,
                                                                                  None, False, 1.0)[1])


def test_bad_input_one_line_errors():
    with pytest.raises(SpecconvError, match="float32 logits"):
        kt.grouped_topk(torch.zeros(4, device=DEVICE), 1, True)
    with pytest.raises(SpecconvError, match="float32 logits"):
        kt.grouped_topk(torch.zeros(2, 4, dtype=torch.bfloat16, device=DEVICE), 1, True)
    with pytest.raises(SpecconvError, match="0 < k"):
        kt.grouped_topk(torch.zeros(2, 4, device=DEVICE), 5, True)
    with pytest.raises(SpecconvError, match="bias has shape"):
        kt.grouped_topk(torch.zeros(2, 4, device=DEVICE), 1, True, torch.zeros(5, device=DEVICE))
    with pytest.raises(SpecconvError, match="expert_scale must be float32"):
        kt.grouped_topk(torch.zeros(2, 4, device=DEVICE), 1, True, expert_scale=torch.zeros(4, dtype=torch.float64,
                                                                                             device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,width", [(1, 64), (4, 1500), (16, 256)])
def test_add_shared_has_the_bits_of_the_torch_formula(n, width, dtype):
    gen = torch.Generator().manual_seed(n * width)
    routed = torch.randn(n, width, generator=gen)
    shared = torch.randn(n, width, generator=gen).to(dtype)
    got = kt.add_shared(*on_device(routed, shared)).cpu()
    want = TorchBackend().add_shared(routed, shared)
    assert got.dtype == dtype
    if dtype == torch.float32 or ON_GPU:
        assert torch.equal(got, want)
    else:  # the interpreter truncates into bfloat16 where a GPU rounds to nearest: one of the two neighbours
        total = routed + shared.float()
        truncated = (total.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
        above = (truncated.view(torch.int16) + 1).view(torch.bfloat16)  # next away from zero
        assert bool(((got == truncated) | (got == above)).all()) and bool(((want == truncated) | (want == above)).all())
    alone = kt.add_shared(*on_device(routed[-1:].clone(), shared[-1:].clone())).cpu()
    assert torch.equal(alone, got[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,width", [(1, 8, 64), (4, 3, 1500), (16, 2, 256)])
def test_combine_with_the_shared_experts_rounds_once_as_the_torch_formula(n, k, width, dtype):
    """moe_combine(..., shared, out_dtype): the routed sum (the bits of the by-index reference), plus
    float32(shared), rounded once into the compute dtype: TorchBackend.moe_out's add_shared."""
    gen = torch.Generator().manual_seed(n * k + width)
    y = torch.randn(n * k, width, generator=gen).to(dtype)
    weights = torch.rand(n, k, generator=gen)
    chosen = torch.stack([torch.randperm(32, generator=gen)[:k] for _ in range(n)])
    shared = torch.randn(n, width, generator=gen).to(dtype)
    total = reference_combine(y, weights, chosen) + shared.float()
    for with_shared in (shared, None):
        got = kt.moe_combine(*on_device(y, weights, chosen, with_shared), out_dtype=dtype).cpu()
        want_f32 = total if with_shared is not None else reference_combine(y, weights, chosen)
        assert got.dtype == dtype
        if dtype == torch.float32 or ON_GPU:
            assert torch.equal(got, want_f32.to(dtype))
        else:  # the interpreter truncates into bfloat16: one of the float32 result's two neighbours
            truncated = (want_f32.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
            above = (truncated.view(torch.int16) + 1).view(torch.bfloat16)
            assert bool(((got == truncated) | (got == above)).all())
        alone = kt.moe_combine(*on_device(y[-k:].clone(), weights[-1:].clone(), chosen[-1:].clone(),
                                          None if with_shared is None else with_shared[-1:].clone()),
                               out_dtype=dtype).cpu()
        assert torch.equal(alone, got[-1:])
    assert torch.equal(TorchBackend().add_shared(reference_combine(y, weights, chosen), shared), total.to(dtype))


# ---- launches -------------------------------------------------------------------------------------

K = 3
QWEN3MOE_UNNORMALISED = "qwen3moe-unnormalised"
# the families with routers: their steps within the ceilings of tests/fixtures/launch_ceilings.py
ROUTED = ["qwen3moe-release", "glm4moe-release", "deepseek2-shapes", "dsa-glm-dsa", "dsa-deepseek32", "chained-hy_v3",
          "chained-step35", "chained-mimo2", "gemma4-moe-shapes"]


class CountedRouting(CudaBackend, CountedCalls):
    """The CUDA backend (launches recorded on `meta`) counting the routers' and the MoE outputs'
    (`moe_out`) calls and the launches inside each; with `separate`, running them as their torch
    formulas (the MoE output: the routed sum by the kernels, then its rounding or shared add apart)."""

    def __init__(self, separate: bool):
        super().__init__(kt, device_types=("meta",))
        self.form = TorchBackend if separate else CudaBackend
        self.init_counts()
        self.labels: dict[int, list[str]] = {}  # tally id -> the label of each counted call, in order

    def _counted(self, label: str, run):
        made = {key: len(ops) for key, ops in self.ops.items()}
        out = self.counted(run, label)
        for key, ops in self.ops.items():
            if len(ops) > made.get(key, 0):
                self.labels.setdefault(key, []).append(label)
        return out

    def launches(self, tally, label: str) -> Counter:
        """Launches by operation inside the calls `label` of one counted step."""
        return sum((ops for ops, lab in zip(self.ops.get(id(tally), []), self.labels.get(id(tally), []))
                    if lab == label), Counter())

    def route_grouped(self, *args, **kwargs):
        return self._counted("route", lambda: self.form.route_grouped(self, *args, **kwargs))

    def route_softmax_topk(self, logits, k):
        return self._counted("route", lambda: self.form.route_softmax_topk(self, logits, k))

    def moe_out(self, *args, **kwargs):
        return self._counted("out", lambda: self.form.moe_out(self, *args, **kwargs))

    def add_shared(self, routed, shared):  # inside moe_out only
        return self.form.add_shared(self, routed, shared)


@pytest.fixture(scope="module")
def family_file(tmp_path_factory):
    """(family fixture or QWEN3MOE_UNNORMALISED, outtype) -> (its converted file, its prompt)."""
    by_name = {f.name: f for f in family_snapshot.families()}

    def get(name: str, outtype: str = "q8_0"):
        root = tmp_path_factory.mktemp(name)
        if name == QWEN3MOE_UNNORMALISED:  # the softmax router without renormalisation: route_grouped
            src = build_qwen3(root / "hf", moe=True, norm_topk_prob=False, experts=(8, 3))
            prompt = list(range(3, 40, 3))
        else:
            source = by_name[name].build(root / "build")
            src, prompt = source.src, list(source.prompt)
        return convert_gguf(src, root / f"model.{outtype}.gguf", outtype=outtype), prompt
    return get


@pytest.mark.parametrize("name", ROUTED)
def test_each_router_is_one_launch_and_the_step_within_its_ceiling(family_file, name):
    path, _ = family_file(name)
    fused_backend, separate_backend = CountedRouting(separate=False), CountedRouting(separate=True)
    fused = cuda_op_count.count_steps(path, "bf16", K, backend=fused_backend)
    separate = cuda_op_count.count_steps(path, "bf16", K, backend=separate_backend)
    print(f"\n[{name}, meta, bf16]\n{cuda_op_count.report(fused, K)}")
    for what, new, old in (("step", fused.step, separate.step), ("verification", fused.verify, separate.verify)):
        routers, outs = fused_backend.calls[id(new), "route"], fused_backend.calls[id(new), "out"]
        assert routers >= 1 and outs == routers
        assert (separate_backend.calls[id(old), "route"], separate_backend.calls[id(old), "out"]) == (routers, outs)
        route_new, route_old = fused_backend.launches(new, "route"), separate_backend.launches(old, "route")
        out_new, out_old = fused_backend.launches(new, "out"), separate_backend.launches(old, "out")
        print(f"{what}: {old.total} launches with the torch formulas -> {new.total}; {routers} routers: "
              f"{dict(route_old)} -> {dict(route_new)}; {outs} MoE outputs: "
              f"{dict(out_old - out_new)} more launches as torch formulas")
        assert sum(route_new.values()) == routers  # one launch each
        assert set(route_new) <= {"triton.grouped_topk_kernel", "triton.softmax_topk_kernel"}
        # the MoE outputs: the rounding (and shared add) inside the combine launch, the rest unchanged
        assert out_new["_to_copy"] == out_new["add"] == 0 and out_new <= out_old
        assert set(out_old - out_new) <= {"_to_copy", "add"} and sum((out_old - out_new).values()) >= outs
        assert new.total == old.total - sum(route_old.values()) - sum(out_old.values()) + routers + sum(
            out_new.values())  # and nothing else changed
    print(f"decode step: {separate.step.total} launches with the torch formulas -> {fused.step.total} "
          f"(ceiling {STEP_LAUNCHES[name]})")
    assert fused.step.total <= STEP_LAUNCHES[name]


@pytest.mark.parametrize("name", ["qwen3moe-release", QWEN3MOE_UNNORMALISED, "glm4moe-release", "chained-hy_v3",
                                  "chained-step35", "chained-mimo2"])
def test_the_forward_through_the_router_kernels_equals_the_torch_reference(family_file, name, monkeypatch):
    """float32 files, a prompt then a verification batch: the routers and shared adds through their
    kernels (and the other kernels around the products) give the torch reference's logits within
    float32 noise; a different chosen expert moves them by O(1)."""
    device = "cuda" if ON_GPU else "cpu"
    path, prompt = family_file(name, "f32")
    model = load_model(path, device=device, dtype="f32")
    taken = Counter()
    for kernel in ("grouped_topk", "softmax_topk", "add_shared"):
        real = getattr(kt, kernel)
        monkeypatch.setattr(kt, kernel,
                            lambda *a, _real=real, _name=kernel, **kw: taken.update([_name]) or _real(*a, **kw))
    _install(monkeypatch, CudaBackend(kt, device_types=(device,)))
    kernels = _prompt_and_verification(model, prompt[:12])
    _install(monkeypatch, TorchBackend())
    reference = _prompt_and_verification(model, prompt[:12])
    diff = float((kernels - reference).abs().max())
    print(f"\n[{name}, {device}, f32] logits through the router kernels {dict(taken)} vs the torch reference: "
          f"max |Δlogit| {diff:.2e} (largest |logit| {float(reference.abs().max()):.2f})")
    assert taken["grouped_topk"] + taken["softmax_topk"] > 0
    assert diff <= 1e-4


def test_greedy_speculative_decoding_equals_plain_through_the_router_kernels_in_bf16(family_file, monkeypatch):
    """bf16 GLM-4.5 through the CUDA backend: the router and shared-add kernels in decode steps and in
    verification batches of K + 1 rows give each row the bits of a one-token step, so greedy
    speculative output equals plain decoding."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    device = "cuda" if ON_GPU else "cpu"
    path, prompt = family_file("glm4moe-release")
    _install(monkeypatch, CudaBackend(kt, device_types=(device,)))
    rows = Counter()  # the router kernel's launches by rows
    real = kt.grouped_topk
    monkeypatch.setattr(kt, "grouped_topk", lambda logits, *a, **kw: rows.update([logits.shape[0]]) or real(logits, *a,
                                                                                                           **kw))
    model = load_model(path, device=device, dtype="bf16")
    prompt = [t % model.vocab_size for t in prompt[:8]]
    plain = generate(model, prompt, 10).tokens
    spec = speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=2), prompt, 10,
                                SpecConfig(draft_max=K))
    stats = spec.stats["speculative"]
    print(f"\n[glm4moe-release, {device}, bf16, kernels] {stats['accepted']} of {stats['drafted']} drafts accepted; "
          f"router launches by rows {dict(sorted(rows.items()))}; speculative = plain: {spec.tokens == plain}")
    assert rows[1] > 0 and rows[K + 1] > 0  # decode steps and verification batches took the kernel
    assert 0 < stats["accepted"] < stats["drafted"]
    assert spec.tokens == plain
