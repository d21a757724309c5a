"""Q8_0 products with 8-bit activations (runtime/dq_dot_i8.inc through dequant_native.matmul_t): the
stated error bound against the exact product of the dequantized weights and the float32 inputs, the
quantization formula itself (the kernel equals the float64 product of the codes numpy computes by
it), a row's bits independent of the other rows of the call (1 .. 17 rows, pairs of weight rows,
two passes), of threads and of the thread pool, non-finite inputs, the default and the switch back
to float32 activations; on a Qwen3.5-shaped q8_0 file whose matrices take this path: greedy
speculative decoding (synthetic drafter, k = 1 .. 4) gives the tokens of plain decoding, and the
logits against llama.cpp's (which quantizes its activations the same way) and against float32
activations are printed."""

from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from specconv.runtime import dequant_native
from specconv.runtime.dequant import dequantize_rows
from tests.fixtures.native import require_native_dequant
from tests.fixtures.paths import ROOT
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
EPS = float(torch.finfo(torch.float32).eps)
TINY = 2.0 ** -100  # under this max|x| a block is taken as zero (runtime/dq_dot_i8.inc)


def _has_vnni() -> bool:
    flags = open("/proc/cpuinfo").read() if platform.machine() in ("x86_64", "AMD64") else ""
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c"))


@pytest.fixture(autouse=True)
def native(monkeypatch):
    require_native_dequant()
    for name in ("SPECCONV_NO_NATIVE", "SPECCONV_NO_NATIVE_DEQUANT", "SPECCONV_NATIVE_FLOAT_ACTIVATIONS",
                 "SPECCONV_NATIVE_PORTABLE", "SPECCONV_NATIVE_NO_AVX512"):
        monkeypatch.delenv(name, raising=False)
    if not dequant_native.int8_width(QType.Q8_0):
        pytest.skip("no 8-bit-activation kernel on this CPU (AVX-512 VNNI)")


def int8(x: torch.Tensor, raw: torch.Tensor, threads: int = 1) -> torch.Tensor:
    return dequant_native.matmul_t(x, raw, QType.Q8_0, raw.shape[1] // 34 * 32, threads=threads, activations="int8")


def activations(rng: np.random.Generator, rows: int, n_in: int, kind: str) -> torch.Tensor:
    """float32 rows: normal; heavy-tailed (each value scaled by e^N(0,1)); blocks of zeros, one huge
    value per block, blocks under the TINY limit and blocks of subnormals mixed in."""
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    if kind == "heavy":
        x *= np.exp(rng.standard_normal((rows, n_in))).astype(np.float32)
    if kind == "mixed":
        b = x.reshape(rows, -1, 32)
        b[:, 0::5] = 0.0
        b[:, 1::5, 3] = 1e4
        b[:, 2::5] *= np.float32(1e-35)  # max|x| under 2^-100: taken as zero
        b[:, 3::5] *= np.float32(1e-39)  # subnormals
        b[:, 4::5] *= np.float32(1e-25)  # small, over the limit
    return torch.from_numpy(x)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stated bound [rows, n_out] of |int8 product - x @ w.T| (runtime/dq_dot_i8.inc), from x
    and the dequantized weights w alone: per block b, e_b = max_b|x|/254 (1 + 1e-4) (x off its
    code by at most that), or max_b|x| for a block taken as zero, times sum |w| over the block;
    plus the float32 sums of the block terms, (n_in/128 + 6) eps sum |w_i| (|x_i| + e_b)."""
    x64, w64 = x.double(), w.double()
    rows, n_in = x.shape
    amax = x64.abs().reshape(rows, -1, 32).amax(-1)
    e = torch.where(amax < TINY, amax, amax / 254 * (1 + 1e-4))  # [rows, blocks]
    w_abs_blocks = w64.abs().reshape(w.shape[0], -1, 32).sum(-1)  # [n_out, blocks]
    quantization = e @ w_abs_blocks.t()
    x_hat_abs = x64.abs() + e.repeat_interleave(32, dim=1)
    floats = (n_in / 128 + 6) * EPS * (x_hat_abs @ w64.abs().t())
    return quantization + floats


def codes(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The documented quantization in numpy float32: d = max|x|/127, q = rint(x (127/max|x|)),
    |q| <= 127; blocks under TINY zero. (q [rows, blocks, 32], d [rows, blocks])."""
    b = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1)
    tiny = amax < np.float32(TINY)
    safe = np.where(tiny, np.float32(1), amax)
    inverse = np.where(tiny, np.float32(0), np.float32(127) / safe).astype(np.float32)
    q = np.clip(np.rint((b * inverse[..., None]).astype(np.float32)), -127, 127)
    return q, np.where(tiny, np.float32(0), (amax / np.float32(127)).astype(np.float32))


@pytest.mark.parametrize("kind", ["normal", "heavy", "mixed"])
def test_within_the_stated_bound_and_the_formula(kind):
    """Every row count 1 .. 17 (one pass for up to 16, pairs of weight rows from 5 to 9), n_in a
    multiple of 128 or not (a last group of 1, 2 or 3 blocks), ordinary and extreme f16 weight scales."""
    rng = np.random.default_rng(["normal", "heavy", "mixed"].index(kind))
    worst_bound = worst_formula = 0.0
    for n_in, scales, row_counts in [(32, (1e-3, 1.1e-2), (1, 2, 5)), (96, (1e-3, 1.1e-2), (1, 3, 9)),
                                     (160, "extreme", (1, 4, 6)), (1056, (1e-3, 1.1e-2), range(1, 18)),
                                     (4352, (1e-3, 1.1e-2), (1, 4, 16)), (6144, "extreme", (2, 5))]:
        raw = sane_rows(QType.Q8_0, 37, n_in, seed=n_in, scales=scales)
        w = dequantize_rows(raw, QType.Q8_0)
        wq = w.double().numpy().reshape(37, -1, 32)
        for nx in row_counts:
            x = activations(rng, nx, n_in, kind)
            y = int8(x, raw).double()
            exact = x.double() @ w.double().t()
            worst_bound = max(worst_bound, float(((y - exact).abs() / bound(x, w)).max()))
            q, d = codes(x)
            terms = np.einsum("rbi,nbi->nrb", wq, q) * d[:, None, :]  # d_w q_w * q * d_x per block
            scale = (np.einsum("rbi,nbi->nrb", np.abs(wq), np.abs(q)) * d[:, None, :]).sum(-1)
            formula = np.abs(y.numpy() - terms.sum(-1)) / np.maximum(EPS * scale, 1e-300)
            worst_formula = max(worst_formula, float(formula.max()))
    print(f"\n[int8 Q8_0, {kind} activations] worst |Δ| against x @ W.T: {worst_bound:.3f} of the stated bound; "
          f"against the float64 product of numpy's codes: {worst_formula:.2f} eps·Σ|w·q·d|")
    assert worst_bound <= 1.0
    # the same codes and block sums: only float32 rounding of a few dozen block terms is left
    assert worst_formula <= 4.0


def test_a_row_gets_its_bits_alone_in_any_batch_and_split(monkeypatch):
    """Row j alone equals row j of a call of 2 .. 17 rows (one or two passes, weight rows alone or
    paired) and of 1, 2, 3 and 5 threads, on torch's OpenMP pool and on started pthreads."""
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS_PTHREADS", 1)
    rng = np.random.default_rng(5)
    raw = sane_rows(QType.Q8_0, 53, 1184, seed=11)  # 9 groups of 128 and a last one of 1 block
    x = activations(rng, 17, 1184, "heavy")
    alone = torch.cat([int8(x[j:j + 1].clone(), raw) for j in range(17)])
    for nx in range(2, 18):
        for threads in (1, 2, 3, 5):
            assert torch.equal(int8(x[:nx], raw, threads), alone[:nx]), (nx, threads)
    monkeypatch.setenv("SPECCONV_NATIVE_PTHREADS", "1")
    assert dequant_native.thread_pool() == "pthreads"
    assert torch.equal(int8(x[:7], raw, 2), alone[:7])


def test_non_finite_activations_give_non_finite_outputs():
    raw = sane_rows(QType.Q8_0, 9, 256, seed=2)
    x = torch.randn(3, 256)
    clean = int8(x, raw)
    x[0, 77] = float("nan")
    x[2, 200] = float("inf")
    y = int8(x, raw)
    assert bool(y[0].isnan().all()) and not bool(y[2].isfinite().any())
    assert torch.equal(y[1], clean[1])


def test_default_switch_and_refusals(monkeypatch):
    from specconv.runtime import backend_cpu
    from specconv.runtime.stored import StoredWeight

    assert dequant_native.default_activations(QType.Q8_0) == "int8"
    assert dequant_native.default_activations(QType.Q4_K) == "float32"  # no 8-bit kernel for it
    raw = sane_rows(QType.Q8_0, 301, 256, seed=4)  # over WHOLE_MAX_ELEMENTS: a native product
    w = StoredWeight(raw, QType.Q8_0, (301, 256), torch.float32, torch.device("cpu"))
    x = torch.randn(3, 256)
    assert torch.equal(backend_cpu.NativeCpuBackend().linear(x, w), int8(x, raw))
    monkeypatch.setenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", "1")
    assert dequant_native.default_activations(QType.Q8_0) == "float32"
    assert torch.equal(backend_cpu.NativeCpuBackend().linear(x, w),
                       dequant_native.matmul_t(x, raw, QType.Q8_0, 256, activations="float32"))
    monkeypatch.delenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS")
    with pytest.raises(ValueError, match="int8 activations for Q4_K"):
        dequant_native.matmul_t(torch.randn(1, 256), sane_rows(QType.Q4_K, 2, 256, seed=1), QType.Q4_K, 256,
                                activations="int8")
    for variable in ("SPECCONV_NATIVE_PORTABLE", "SPECCONV_NATIVE_NO_AVX512"):
        with monkeypatch.context() as m:
            m.setenv(variable, "1")
            assert dequant_native.int8_width(QType.Q8_0) == 0
            assert dequant_native.default_activations(QType.Q8_0) == "float32"


def test_kernel_where_the_cpu_has_vnni():
    assert dequant_native.int8_width(QType.Q8_0) == (512 if _has_vnni() else 0)


# ---- a model whose matrices take the 8-bit path ------------------------------------------------------

@pytest.fixture(scope="module", params=[0, 8], ids=["dense", "moe"])
def q8_file(request, tmp_path_factory):
    """A 4-block Qwen3.5-shaped q8_0 file (hidden 256, FFN 768, vocabulary 4096; MoE: 8 experts of
    192, 2 per token, and a shared one) from tools/synth_qwen35.py, converted by specconv."""
    sys.path.insert(0, str(ROOT / "tools"))
    from synth_qwen35 import write_checkpoint

    root = tmp_path_factory.mktemp("int8")
    src = write_checkpoint(root / "hf", n_layers=4, hidden_size=256, intermediate_size=768, vocab_size=4096, seed=3,
                           experts=request.param, experts_used=2 if request.param else 0)
    out = root / "m-q8_0.gguf"
    subprocess.run([sys.executable, "-m", "specconv", "convert", str(src), "-o", str(out), "--outtype", "q8_0",
                    "--mtp", "none"], check=True, stdout=subprocess.DEVNULL)
    return out


def test_model_verification_rows_are_the_bits_of_one_row_forwards(q8_file):
    """A float32 forward of 2 .. 5 rows after a prompt gives each row the bits of one-row forwards:
    the 8-bit code of a value depends on its last bits, so everything before a product must be
    computed per row too (small products and the Gated DeltaNet gates one row at a time)."""
    from specconv.runtime import Context, GraphType, load_model

    model = load_model(q8_file, device="cpu")
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(26)]
    for n in (2, 3, 4, 5):
        batch = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=8)
        batch.decode(ids[:20])
        out = batch.decode(ids[20:20 + n], hidden=("post_norm",))
        steps = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=8)
        steps.decode(ids[:20])
        rows = [steps.decode([t], hidden=("post_norm",)) for t in ids[20:20 + n]]
        assert torch.equal(out.logits, torch.cat([r.logits for r in rows])), n
        assert torch.equal(out.hidden["post_norm"], torch.cat([r.hidden["post_norm"] for r in rows])), n


def _steps(model, ctx, tokens):
    return torch.cat([ctx.decode([t], hidden=("post_norm",)).logits for t in tokens])


def test_model_states_after_a_prompt_and_a_rollback_are_the_bits_of_plain_steps(q8_file):
    """What speculative decoding leaves and plain decoding does not see: a 21-token prompt (over the
    native step's 16 tokens) evaluated with snapshot rings of 1, 4 and 9 states or a checkpoint, and
    a verification of 4 tokens with wrong drafts rolled back to each position: the one-token steps
    after them give the bits of plain one-token decoding (the kept state is the native step's, not
    the pending states' closed form, and the prompt's state does not depend on the ring)."""
    from specconv.runtime import Context, GraphType, load_model

    model = load_model(q8_file, device="cpu")
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(32)]
    prompt, then = ids[:21], ids[21:27]
    plain = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=0, rollback="checkpoint")
    plain.decode(prompt)
    reference = _steps(model, plain, then)
    for n_rs in (0, 3, 8):
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=n_rs)
        ctx.decode(prompt)
        assert torch.equal(_steps(model, ctx, then), reference), n_rs
    for kept in range(4):  # then[:kept + 1] accepted, the rest of the batch wrong drafts
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=3)
        ctx.decode(prompt)
        batch = then[:kept + 1] + [(7 * t + 1) % model.vocab_size for t in then[kept + 1:4]]
        out = ctx.decode(batch).logits
        assert torch.equal(out[:kept + 1], reference[:kept + 1])
        assert ctx.seq_rm(0, len(prompt) + kept + 1)
        assert torch.equal(_steps(model, ctx, then[kept + 1:]), reference[kept + 1:]), kept


def test_model_speculative_greedy_equals_plain(q8_file, monkeypatch):
    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import SyntheticDrafter, greedy_reference
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    calls = []
    real = dequant_native.matmul_t

    def counted(x, raw, qtype, n_in, threads=None, activations=None):
        calls.append(dequant_native.default_activations(qtype) if activations is None else activations)
        return real(x, raw, qtype, n_in, threads, activations)

    monkeypatch.setattr(dequant_native, "matmul_t", counted)
    model = load_model(q8_file, device="cpu")
    long_prompt = [(11 + 4099 * i) % model.vocab_size for i in range(24)]  # over the native step's 16 tokens
    for prompt in ([17], [5, 900, 42, 3000, 7, 5, 900, 42], long_prompt):
        reference = greedy_reference(model, prompt, 40)
        for a, k, auto in [(0.5, 1, False), (0.8, 2, False), (0.8, 3, False), (0.6, 4, False), (0.8, 8, True)]:
            res = speculative_generate(model, SyntheticDrafter(reference, model.vocab_size, a, seed=k), prompt, 40,
                                       SpecConfig(draft_max=k, auto=auto))
            assert res.tokens == reference[len(prompt):], (prompt, a, k, auto)
    assert calls and set(calls) == {"int8"}  # every product of this model took the 8-bit path


def test_model_logits_against_llama_cpp_and_float_activations(q8_file, monkeypatch):
    """llama.cpp quantizes its activations to 8-bit blocks too (with f16 scales of its own), so our
    logits with 8-bit activations are nearer its logits than our float32-activation logits are (mean
    |Δ| over every logit of 12 positions; the max and the top-1 agreement printed)."""
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.peers import llama_logits, require_llama_cpp

    require_llama_cpp()
    model = load_model(q8_file, device="cpu")
    ids = [3, 901, 17, 2222, 45, 8, 3999, 120, 64, 7, 77, 1000]

    def ours():
        return Context(model, GraphType.MAIN, n_ctx=64).decode(ids).logits

    int8_logits = ours()
    monkeypatch.setenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", "1")
    float_logits = ours()
    peer = torch.as_tensor(llama_logits(q8_file, ids))
    stats = {name: ((logits - peer).abs().mean().item(), (logits - peer).abs().max().item(),
                    int((logits.argmax(-1) == peer.argmax(-1)).sum()))
             for name, logits in (("int8", int8_logits), ("float32", float_logits))}
    print(f"\n[q8_0 hidden 256, 12 positions, logits up to {peer.abs().max().item():.2f}] vs llama.cpp: "
          + "; ".join(f"{k} activations mean |Δ| {m:.3e}, max {x:.3e}, top-1 {a}/12" for k, (m, x, a) in stats.items()))
    assert stats["int8"][0] < stats["float32"][0]


def test_switches_follow_the_environment(monkeypatch):
    """The extension reads the switches with getenv (each product asks): what os.environ sets, it sees."""
    assert dequant_native.switches() == 0
    for bit, name in dequant_native._SWITCHES.items():
        with monkeypatch.context() as m:
            m.setenv(name, "1")
            assert dequant_native.switches() == bit
            m.setenv(name, "0")
            assert dequant_native.switches() == 0
    monkeypatch.setenv("SPECCONV_NO_NATIVE_GDN", "1")
    monkeypatch.setenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", "1")
    from specconv.runtime import gdn_native
    assert not gdn_native.available() and dequant_native.available()
    assert dequant_native.default_activations(QType.Q8_0) == "float32"
