"""A GLU's down product in one launch: the one-pass product kernel reading act(gate) · up as its input
rows (runtime/kernels_triton/matmul.py `quant_matmul(..., up=, act=)`, `expert_matmul` likewise;
_quant_jit._input), and the backend seam that takes it (CudaBackend.linear_glu, ops.glu_linear):

* bit for bit the values of the GLU kernel followed by the product (kernels_triton.glu, then
  quant_matmul of its output), SiLU and gelu_tanh, for Q8_0, Q4_K, Q5_K, Q6_K, BF16, F16 and F32
  weights, float32 / bfloat16 / float16 rows, 1 to 16 rows, matrices cut along their inner dimension
  (split_plan) included; and within the product's summation noise of the exact (float64) product of
  the torch reference's GLU values (TorchBackend.silu_mul / gelu_mul) by the dequantized weight;
* batch invariance: a row alone gives the bits it gets in a batch of 16;
* the halves of one fused gate/up product read in place through their row strides; routed experts
  by index (PAIRS mode, a shared activation row per `fanout` pairs); prompts (17+ rows) through the
  GLU kernel then the dense product, and in batch-invariant mode in 16-row pieces with each row's
  decode-step bits;
* the seam: ops.swiglu and Gemma 4's GeGLUs launch no GLU kernel on the CUDA backend (one product
  launch for the down product), the CPU backends keep glu then linear bit for bit; the activation
  observer still sees the product's input rows;
* bad input: one-line errors.

Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, WHERE  # first: the interpreter without a GPU
from tests.runtime.test_cuda_fused_kernels import ULPS
from tests.runtime.test_triton_kernels import (FUSED_BOUND, N_IN, OUTPUT_ULP, TYPES, exact_product, noise,
                                               weights)  # skips where Triton is missing
from specconv.archs.errors import SpecconvError
from specconv.runtime import backend as backend_module, kernels_triton as kt
from specconv.runtime.backend import batch_invariant, observing
from specconv.runtime.backend_cuda import CudaBackend
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.dequant import dequantize_rows as torch_dequantize
from specconv.runtime.kernels_triton import matmul as qm
from specconv.runtime.stored import StoredWeight
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
REF = TorchBackend()
ACTS = ("silu", "gelu_tanh")
ALL_TYPES = [*TYPES, QType.F32]
N_IN_ALL = {**N_IN, QType.F32: 100}
N_OUT = 37  # three tiles of 16 rows: cut along the inner dimension under the interpreter's 2 "SMs"


def packed_weight(qtype: QType, n_out: int, seed: int) -> torch.Tensor:
    """Packed [n_out, row bytes]: test_triton_kernels' encoded + random rows, or float32 values' bytes."""
    if qtype == QType.F32:
        values = torch.randn(n_out, N_IN_ALL[qtype], generator=torch.Generator().manual_seed(seed))
        return values.view(torch.uint8)
    assert n_out == N_OUT
    return weights(qtype, seed)


def gate_up(rows: int, n_in: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(rows, n_in, generator=g)).to(dtype)
    return gate.to(DEVICE), torch.randn(rows, n_in, generator=g).to(dtype).to(DEVICE)


def glu_then_product(gate, up, packed, qtype, n_out, act):
    return kt.quant_matmul(kt.glu(gate, up, act), packed, qtype, n_out, gate.shape[-1])


def glu_product(gate, up, packed, qtype, n_out, act):
    return kt.quant_matmul(gate, packed, qtype, n_out, gate.shape[-1], up=up, act=act)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_the_glu_product_is_the_glu_then_the_product(qtype, act):
    """1, 5 and 16 rows in bfloat16, 3 in float32 and float16: the bits of glu then quant_matmul; a
    row alone the bits it has in the batch of 16; float32 within the summation noise of the exact
    product of the reference's GLU values."""
    n_in, n_out = N_IN_ALL[qtype], N_OUT
    packed = packed_weight(qtype, n_out, seed=3).to(DEVICE)
    splits = qm.split_plan(qtype, n_out, -(-n_in // qm.GEOMETRY[qtype][0]), DEVICE)[0]
    cases = [(torch.bfloat16, 1), (torch.bfloat16, 5), (torch.bfloat16, 16), (torch.float32, 3), (torch.float16, 3)]
    for dtype, rows in cases:
        gate, up = gate_up(rows, n_in, dtype, seed=rows)
        fused = glu_product(gate, up, packed, qtype, n_out, act)
        assert fused.dtype == qm.result_dtype(qtype, dtype)
        assert torch.equal(fused, glu_then_product(gate, up, packed, qtype, n_out, act)), (dtype, rows)
        if rows == 16:
            for i in (0, 7, 15):
                alone = glu_product(gate[i:i + 1], up[i:i + 1], packed, qtype, n_out, act)
                assert torch.equal(alone, fused[i:i + 1]), i
        if dtype == torch.float32:
            values = REF.glu(gate.cpu(), up.cpu(), act)
            exact, scale = exact_product(values, torch_dequantize(packed.cpu(), qtype))
            # the kernel's GLU values are within ULPS of the reference's where it is accurate
            # (test_cuda_fused_kernels, test_cuda_gelu_mul), which adds at most ULPS eps·Σ|x·w|
            worst = noise(fused.cpu(), exact, scale)
            print(f"\n[{WHERE}] {qtype.name} {act}: {worst:.2f} eps·Σ|x·w| from the exact product of the "
                  f"reference's GLU values, max |Δ| {float((fused.cpu().double() - exact).abs().max()):.2e}; "
                  f"{splits} piece(s) along the inner dimension; glu then product = fused bit for bit")
            assert worst <= FUSED_BOUND + ULPS


@pytest.mark.parametrize("act", ACTS)
def test_every_row_count_and_the_16bit_result(act):
    """Q8_0 and bfloat16: every row count 1..16 is the bits of glu then the product, and within one
    bfloat16 rounding (plus summation noise) of the exact product of the glu kernel's values."""
    qtype, n_in = QType.Q8_0, N_IN[QType.Q8_0]
    packed = packed_weight(qtype, N_OUT, seed=5).to(DEVICE)
    w = torch_dequantize(packed.cpu(), qtype)
    gate, up = gate_up(16, n_in, torch.bfloat16, seed=6)
    for rows in range(1, 17):
        fused = glu_product(gate[:rows], up[:rows], packed, qtype, N_OUT, act)
        assert torch.equal(fused, glu_then_product(gate[:rows], up[:rows], packed, qtype, N_OUT, act)), rows
    exact, scale = exact_product(kt.glu(gate, up, act).cpu().float(), w)
    diff = (fused.cpu().double() - exact).abs()
    allowed = OUTPUT_ULP[torch.bfloat16] * exact.abs() + FUSED_BOUND * torch.finfo(torch.float32).eps * scale
    print(f"\n[{WHERE}] Q8_0 {act}, bf16, 1..16 rows: bit for bit; 16 rows max |Δ| from exact "
          f"{float(diff.max()):.2e} ({float((diff / allowed).max()):.2f} of the bound)")
    assert bool((diff <= allowed).all())


@pytest.mark.parametrize("act", ACTS)
def test_halves_of_one_buffer_experts_and_prompts(act):
    """Gate and up as the halves of one [n, 2F] product (row stride 2F); routed experts by index with
    two pairs per activation row; 20 rows (a prompt) and 20 rows in batch-invariant mode."""
    qtype, n_in = QType.Q4_K, N_IN[QType.Q4_K]
    packed = packed_weight(qtype, N_OUT, seed=7).to(DEVICE)
    both = torch.cat(gate_up(4, n_in, torch.bfloat16, seed=8), dim=1)
    gate, up = both[:, :n_in], both[:, n_in:]
    want = glu_then_product(gate.contiguous(), up.contiguous(), packed, qtype, N_OUT, act)
    assert torch.equal(glu_product(gate, up, packed, qtype, N_OUT, act), want)

    experts = torch.stack([packed, packed_weight(qtype, N_OUT, seed=9).to(DEVICE)])  # [E, n_out, row bytes]
    chosen = torch.tensor([1, 0, 0, 1, 1, 1, 0, 0], device=DEVICE)
    g, u = gate_up(4, n_in, torch.bfloat16, seed=10)
    fused = kt.expert_matmul(g, experts, qtype, N_OUT, n_in, chosen, fanout=2, up=u, act=act)
    assert torch.equal(fused, kt.expert_matmul(kt.glu(g, u, act), experts, qtype, N_OUT, n_in, chosen, fanout=2))

    gate, up = gate_up(20, n_in, torch.bfloat16, seed=11)
    assert torch.equal(glu_product(gate, up, packed, qtype, N_OUT, act),
                       kt.quant_matmul(kt.glu(gate, up, act), packed, qtype, N_OUT, n_in))
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    w = StoredWeight(packed, qtype, (N_OUT, n_in), torch.bfloat16, DEVICE)
    with batch_invariant(True):
        pieces = cuda.linear_glu(gate, up, w, act)
    for i in (0, 16, 19):
        assert torch.equal(pieces[i:i + 1], glu_product(gate[i:i + 1], up[i:i + 1], packed, qtype, N_OUT, act)), i
    print(f"\n[{WHERE}] {act}: halves of one buffer, experts by index (fanout 2) and 20-row prompts: "
          f"the bits of glu then the product; batch-invariant pieces: each row its decode-step bits")


class RecordingKernels:
    """kernels_triton, recording which product and GLU wrappers run."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        kernel = getattr(kt, name)
        if name not in ("quant_matmul", "expert_matmul", "glu", "silu_mul", "gelu_mul"):
            return kernel

        def recorded(*args, **kwargs):
            self.calls.append(name + ("+glu" if kwargs.get("up") is not None else ""))
            return kernel(*args, **kwargs)
        return recorded


def stored(qtype: QType, n_out: int, n_in: int, seed: int) -> StoredWeight:
    return StoredWeight(sane_rows(qtype, n_out, n_in, seed=seed).to(DEVICE), qtype, (n_out, n_in), torch.bfloat16,
                        DEVICE)


def test_swiglu_and_geglu_through_the_cuda_backend(monkeypatch):
    """ops.swiglu and Gemma 4's GeGLU (dense, fused gate/up halves, the per-layer input gate) run their
    down product as one quant_matmul reading the GLU, no GLU launch; the result is the bits of the
    same backend's glu then linear, and close to the torch reference's; float64 keeps the torch
    formula (TorchBackend.linear_glu: glu then linear, its bits)."""
    from specconv.runtime.graphs import gemma4, ops

    kernels = RecordingKernels()
    cuda = CudaBackend(kernels, device_types=(DEVICE.type,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: cuda)
    n_in, ff = 256, 256
    gate_w, up_w, down_w = stored(QType.Q8_0, ff, n_in, 1), stored(QType.Q8_0, ff, n_in, 2), stored(QType.Q4_K, 37, ff, 3)
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    for name, run, act in (("swiglu", ops.swiglu, "silu"), ("geglu", gemma4.geglu, "gelu_tanh")):
        kernels.calls.clear()
        y = run(x, gate_w, up_w, down_w)
        assert kernels.calls == ["quant_matmul+glu"], (name, kernels.calls)
        g, u = cuda.linear_group(x, (gate_w, up_w))
        assert torch.equal(y, cuda.linear(cuda.glu(g, u, act), down_w)), name
        dense = [w.dense(torch.bfloat16).cpu() for w in (gate_w, up_w, down_w)]
        ref = REF.linear(REF.glu(REF.linear(x.cpu(), dense[0]), REF.linear(x.cpu(), dense[1]), act), dense[2])
        delta = float((y.cpu().float() - ref.float()).abs().max())
        print(f"\n[{WHERE}] {name} through the CUDA backend, bf16: one product launch for down · GLU; "
              f"max |Δ| from the torch reference {delta:.2e} (|ref| max {float(ref.abs().max()):.2e})")
        assert delta <= 0.05 * float(ref.abs().max())
    gate_up_w = stored(QType.Q8_0, 2 * ff, n_in, 5)  # one expert's gate and up rows as one matrix
    kernels.calls.clear()
    y = gemma4.geglu_fused(x, gate_up_w, None, down_w)
    assert kernels.calls == ["quant_matmul", "quant_matmul+glu"], kernels.calls
    both = cuda.linear(x, gate_up_w)
    assert torch.equal(y, cuda.linear(cuda.glu(both[:, :ff].contiguous(), both[:, ff:].contiguous(), "gelu_tanh"),
                                      down_w))
    wide = x.double()
    kernels.calls.clear()
    dense = [w.dense(torch.float64) for w in (gate_w, up_w, down_w)]
    got = ops.swiglu(wide, *dense)
    assert not any(c.endswith("+glu") or c in ("glu", "silu_mul") for c in kernels.calls)
    assert torch.equal(got, REF.linear(REF.silu_mul(REF.linear(wide, dense[0]), REF.linear(wide, dense[1])), dense[2]))


def test_the_cpu_backends_and_the_observer_keep_glu_then_linear(monkeypatch):
    """TorchBackend.linear_glu is silu_mul / gelu_mul then linear (the CPU forward's bits, what the
    family snapshot checks end to end); under an activation observer ops.glu_linear hands the
    observer the GLU's values as the product's input rows."""
    from specconv.runtime.graphs import ops

    cpu = backend_module.for_device("cpu")  # the CPU's backend (native where built)
    g = torch.Generator().manual_seed(12)
    gate, up, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(9, 64, generator=g)
    for act, formula in (("silu", REF.silu_mul), ("gelu_tanh", REF.gelu_mul)):
        for backend in (REF, cpu):
            assert torch.equal(backend.linear_glu(gate, up, w, act), backend.linear(formula(gate, up), w))
        seen = []

        class Observer:
            def product(self, x, weight):
                seen.append((x, weight))

        with observing(Observer()):
            y = ops.glu_linear(gate, up, w, act)
        assert len(seen) == 1 and seen[0][1] is w and torch.equal(seen[0][0], formula(gate, up))
        assert torch.equal(y, cpu.linear(formula(gate, up), w))


def test_bad_input_one_line_errors():
    packed = packed_weight(QType.Q8_0, N_OUT, seed=13).to(DEVICE)
    n_in = N_IN[QType.Q8_0]
    gate, up = gate_up(2, n_in, torch.bfloat16, seed=14)
    with pytest.raises(SpecconvError, match="quant_matmul: a GLU input needs both up and act"):
        kt.quant_matmul(gate, packed, QType.Q8_0, N_OUT, n_in, up=up)
    with pytest.raises(SpecconvError, match="quant_matmul: activation 'relu' is not one of silu, gelu_tanh"):
        kt.quant_matmul(gate, packed, QType.Q8_0, N_OUT, n_in, up=up, act="relu")
    with pytest.raises(SpecconvError, match="quant_matmul: gate and up must have one dtype"):
        kt.quant_matmul(gate, packed, QType.Q8_0, N_OUT, n_in, up=up.float(), act="silu")
    with pytest.raises(SpecconvError, match=r"quant_matmul: up has shape \(1, 352\)"):
        kt.quant_matmul(gate, packed, QType.Q8_0, N_OUT, n_in, up=up[:1], act="silu")
    with pytest.raises(ValueError, match="GLU activation must be 'silu' or 'gelu_tanh'"):
        REF.glu(gate, up, "relu")
