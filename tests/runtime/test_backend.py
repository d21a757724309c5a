"""The backend seam (runtime/backend.py): one backend per device kind, each computing what the torch
reference computes.

* which backend a device gets, once;
* routed experts by index (no host read) = routed experts grouped by expert (the per-expert loop);
* a model's forward on the torch backend = on the native CPU backend (float32 summation noise), for
  a dense and a MoE Qwen3.5 file;
* the CUDA backend's Triton products (runtime/kernels_triton: compiled on a GPU, else in Triton's CPU
  interpreter) = the torch reference, and a row's result the same whatever the number of rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specconv.runtime import Context, GraphType, backend as backend_module, dequant_native, load_model
from specconv.runtime.backend import Experts, for_device
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.graphs.ops import swiglu
from tests.fixtures.experts import routing as _routing, stored_experts as _stored_experts
from tests.fixtures.paths import ROOT
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf

torch.set_num_threads(1)


def test_each_device_kind_gets_one_backend():
    cpu = for_device("cpu")
    assert cpu is for_device(torch.device("cpu")) is for_device("cpu")
    assert cpu.name == ("cpu-native" if dequant_native._module() is not None else "torch")
    assert for_device("meta").name == "torch"


@pytest.mark.parametrize("n", [1, 3, 9])
def test_experts_by_index_equal_experts_grouped_by_expert(n):
    """The sync-free form (each row's experts taken by index) against the per-expert loop, stored
    Q8_0 experts, float32: the same products summed in the same order."""
    experts = Experts(_stored_experts(6, 32, 64, 1), _stored_experts(6, 32, 64, 2), _stored_experts(6, 64, 32, 3),
                      swiglu)
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    weights, chosen = _routing(n, 6, 3, seed=n)
    ref = TorchBackend()
    by_index, by_expert = ref.moe_by_index(x, weights, chosen, experts), ref.moe_by_expert(x, weights, chosen, experts)
    diff = float((by_index - by_expert).abs().max())
    print(f"\n[moe n={n}] by index vs by expert: max|Δ| {diff:.2e}")
    assert by_index.shape == (n, 64) and diff <= 1e-6 * float(by_expert.abs().max())


def _logits(model, ids, k):
    """A prompt, then one verification batch of k+1 tokens (every row's logits)."""
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + k + 2, n_rs_seq=k)
    ctx.decode(ids[:-k - 1])
    return ctx.decode(ids[-k - 1:]).logits


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_forward_on_the_torch_backend_equals_the_native_backend(tmp_path_factory, monkeypatch, moe):
    if dequant_native._module() is None:
        pytest.skip("native extension not built: the CPU runs the torch backend already")
    model = load_model(tiny_gguf(tmp_path_factory, moe=moe, outtype="q8_0")[1], device="cpu", dtype="f32")
    ids = [int(t) for t in prompt_ids(24, seed=5)]
    native = _logits(model, ids, 3)
    monkeypatch.setattr(backend_module, "_backend", lambda kind: TorchBackend())
    reference = _logits(model, ids, 3)
    diff = float((native - reference).abs().max())
    print(f"\n[{'moe' if moe else 'dense'} q8_0] native CPU backend vs torch backend, 20 + 4 tokens: max|Δlogit| {diff:.2e}")
    assert diff <= 1e-3  # float32 sums in other orders, amplified by the tiny random Gated DeltaNet layers


_KERNELS_CHECK = textwrap.dedent("""
    import sys

    import torch
    from gguf import GGMLQuantizationType as QType
    from specconv.runtime import kernels_triton
    from specconv.runtime.backend import batch_invariant
    from specconv.runtime.backend_cuda import CudaBackend
    from specconv.runtime.backend_torch import TorchBackend
    from specconv.runtime.stored import StoredWeight
    from tests.fixtures.quant_rows import sane_rows

    device = torch.device(sys.argv[1])  # cuda: the compiled kernels; cpu: Triton's interpreter
    torch.manual_seed(0)
    cuda, ref = CudaBackend(kernels_triton, device_types=(device.type,)), TorchBackend()
    worst = 0.0
    for qtype in (QType.Q8_0, QType.Q4_K, QType.BF16):
        raw = sane_rows(qtype, 40, 256, seed=3).to(device)
        w = StoredWeight(raw, qtype, (40, 256), torch.bfloat16, device)
        assert torch.equal(cuda.dequantize_rows(raw, qtype, torch.float32), ref.dequantize_rows(raw, qtype, torch.float32))
        x = torch.randn(19, 256).to(device)
        values = ref.dequantize_rows(raw, qtype, torch.float32)
        for rows in (5, 19):  # one pass over the packed weights; a prompt's dequantized tiles
            y, expected = cuda.linear(x[:rows], w), x[:rows] @ values.t()
            # float32 sums in another order: within 4 eps of the sum of |products| (the kernels' own bound)
            bound = 4 * torch.finfo(torch.float32).eps * (x[:rows].abs() @ values.abs().t())
            worst = max(worst, float(((y - expected).abs() / bound).max()))
        xb = x.to(torch.bfloat16)
        with batch_invariant(True):  # a prompt of 19 rows: each row as in a one-row step
            rows = cuda.linear(xb, w)
        for i in (0, 7, 18):
            assert torch.equal(rows[i:i + 1], cuda.linear(xb[i:i + 1], w)), (qtype, i)
    assert worst <= 1, worst
    print(f"triton backend on {device} vs torch backend: max |Δ| / (4 eps Σ|x·w|) {worst:.2f}")
""")


def test_the_cuda_backend_runs_the_triton_kernels_like_the_reference():
    """runtime/kernels_triton through CudaBackend where the kernels run: compiled on the GPU where
    there is one (TRITON_INTERPRET unset), else in Triton's interpreter on the CPU (a fresh process:
    TRITON_INTERPRET is read when the kernels are first compiled)."""
    pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if on_gpu:
        del env["TRITON_INTERPRET"]
    root = str(ROOT)
    run = subprocess.run([sys.executable, "-c", _KERNELS_CHECK, "cuda" if on_gpu else "cpu"], cwd=root,
                         capture_output=True, text=True, env=env, timeout=900)
    print(run.stdout + run.stderr[-3000:])
    assert run.returncode == 0


def _decode_steps(model, k=3):
    """A prompt, a decode step, a verification batch of k+1 tokens, a rollback, a step; the MTP head."""
    ctx = Context(model, GraphType.MAIN, n_ctx=32, n_rs_seq=k)
    ctx.decode(list(range(5, 13)))  # a short prompt (up to 16 rows: experts by index)
    one = ctx.decode([3])
    verify = ctx.decode(list(range(20, 21 + k)))
    assert ctx.seq_rm(0, ctx.n_past() - 2)
    ctx.decode([9])
    head = Context(model, GraphType.MTP, n_ctx=32)
    draft = head.decode([1, 2, 3], hidden_in=verify.hidden["post_norm"][:3])
    return one, verify, draft


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_decode_and_verification_read_nothing_back_from_the_device(tmp_path_factory, moe, dtype):
    """Decode steps and verification batches on the `meta` device, whose tensors hold no values: any
    read of a value on the host (.item(), int(t), .tolist(), .cpu(), a shape taken from values such
    as nonzero or unique) raises there. That is what a GPU forward must not do (each is a sync), and
    what graph capture forbids."""
    model = load_model(tiny_gguf(tmp_path_factory, moe=moe, outtype="q8_0")[1], device="meta", dtype=dtype)
    assert model.backend.name == "torch"
    one, verify, draft = _decode_steps(model)
    assert one.logits.device.type == "meta" and verify.logits.shape == (4, model.vocab_size)
    assert draft.logits.shape == (3, model.vocab_size)
    print(f"\n[meta, {dtype}, {'moe' if moe else 'dense'}] prompt, step, verification of 4, rollback, MTP head: "
          f"no host read")


def test_a_host_read_in_the_forward_fails_the_meta_check(tmp_path_factory, monkeypatch):
    from specconv.runtime.graphs import qwen35

    model = load_model(tiny_gguf(tmp_path_factory, outtype="q8_0")[1], device="meta")
    real = qwen35.linear_group

    def reads_a_value(x, weights):
        if float(x.abs().max()) > 1e9:  # a data-dependent decision on the host
            raise AssertionError
        return real(x, weights)

    monkeypatch.setattr(qwen35, "linear_group", reads_a_value)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        _decode_steps(model)


def test_a_static_kv_backend_attends_over_whole_fixed_size_buffers(tmp_path_factory, monkeypatch):
    """`static_kv` (the CUDA backend's choice, for graph capture): every attention of a prompt, a
    decode step and a verification sees the layer's whole buffer [n_ctx, ...], written in place,
    and computes what attention over the written cells computes (float32, torch backend both)."""
    from specconv.runtime.graphs import ops

    model = load_model(tiny_gguf(tmp_path_factory, outtype="q8_0")[1], device="cpu", dtype="f32")
    ids = [int(t) for t in prompt_ids(24, seed=6)]

    class StaticKV(TorchBackend):
        static_kv = True

    monkeypatch.setattr(backend_module, "_backend", lambda kind: TorchBackend())
    sliced = _logits(model, ids, 3)
    monkeypatch.setattr(backend_module, "_backend", lambda kind: StaticKV())
    shapes, real = [], ops.causal_attention
    monkeypatch.setattr(ops, "causal_attention", lambda q, k, *a: shapes.append(tuple(k.shape)) or real(q, k, *a))
    whole = _logits(model, ids, 3)
    diff = float((whole - sliced).abs().max())
    print(f"\n[static K/V] attention shapes seen {sorted(set(shapes))}; whole buffers vs written cells: "
          f"max |Δlogit| {diff:.2e}")
    assert len(set(shapes)) == 1 and shapes[0][0] == len(ids) + 3 + 2  # the context's n_ctx, every time
    assert diff <= 1e-5
