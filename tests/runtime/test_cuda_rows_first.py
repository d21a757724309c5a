"""Q8_0 matrices kept with each row's values first (runtime/rows_first.py `Q8_0_ROWS`), the CUDA
backend's storage type for them:

* the layout: each row's block parts gathered, values first (checked against the file's byte
  offsets), and back to the file's bytes exactly, whatever the leading dimensions;
* the torch reference, the Triton dequantizer, the CUDA backend and a StoredWeight's values and rows
  give gguf.quants' values of the file's bytes;
* which weights the CUDA backend keeps so (2-D Q8_0, rows a multiple of 256 wide) and which not
  (other shapes and types, and the torch reference: always the file's type);
* float32 rows (the per-lane form): within float32 rounding of the float64 product, each row the
  bits it has in a batch of 16 (16-bit rows take the tensor-core form:
  tests/runtime/test_cuda_dot_products.py);
* a model loaded where the CUDA backend runs keeps its eligible Q8_0 matrices as Q8_0_ROWS, in as
  many bytes as the file's, and decodes greedily alike with and without speculation in bfloat16.

Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # first: the interpreter without a GPU
from specconv.runtime import kernels_triton as kt, rows_first
from specconv.runtime.backend_cuda import CudaBackend
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.dequant import dequantize_rows as torch_dequantize, row_bytes
from specconv.runtime.rows_first import Q8_0_ROWS
from specconv.runtime.stored import StoredWeight
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
N_OUT, N_IN = 72, 512  # two 64-row tiles, the second partial; products cut into pieces here


def matrix(file_type: QType, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(file bytes [n_out, row bytes], their float32 values by gguf.quants)."""
    packed = sane_rows(file_type, n_out, n_in, seed=seed)
    return packed, torch.from_numpy(dequantize(packed.numpy(), file_type).copy()).reshape(n_out, n_in)


def test_the_layout_holds_the_file_bytes_rearranged():
    kind = Q8_0_ROWS
    packed, values = matrix(kind.file_type, 5, 512, seed=11)
    rows = rows_first.to_rows_layout(packed, kind)
    assert rows.shape == packed.shape and rows.dtype == torch.uint8
    blocks = packed.view(5, 16, 34)  # every block's 32 values, then the 16 scales
    assert torch.equal(rows[:, :512], blocks[:, :, 2:].reshape(5, 512))
    assert torch.equal(rows[:, 512:], blocks[:, :, :2].reshape(5, 32))
    assert torch.equal(rows_first.to_ggml_layout(rows, kind), packed)
    experts = sane_rows(kind.file_type, 6, 256, seed=12).view(2, 3, -1)  # any leading dimensions
    assert torch.equal(rows_first.to_ggml_layout(rows_first.to_rows_layout(experts, kind), kind), experts)
    assert torch.equal(torch_dequantize(rows, kind), values)
    assert row_bytes(kind, 512) == row_bytes(kind.file_type, 512)


@pytest.mark.parametrize("chunk_rows", [0.5, 1, 2.5, 7, 100])
def test_a_device_rearranges_the_rows_in_place_a_chunk_at_a_time(chunk_rows):
    """Off the CPU the file's bytes go to the device as they are and are rewritten there, a chunk of
    whole rows at a time (less than a row: one row), with the bits of to_rows_layout."""
    kind = Q8_0_ROWS
    packed, _ = matrix(kind.file_type, 7, 512, seed=13)
    work = packed.clone()
    out = rows_first.rearrange_in_place(work, kind, chunk_bytes=int(chunk_rows * packed.shape[1]))
    assert out.data_ptr() == work.data_ptr()
    assert torch.equal(out, rows_first.to_rows_layout(packed, kind))
    with pytest.raises(ValueError, match="contiguous"):
        rows_first.rearrange_in_place(packed.t(), kind)
    on_meta = rows_first.moved_as_rows(packed, kind, torch.device("meta"), chunk_bytes=packed.shape[1])
    assert on_meta.is_meta and on_meta.shape == packed.shape and on_meta.dtype == torch.uint8
    assert torch.equal(rows_first.moved_as_rows(packed, kind, torch.device("cpu")), out)


@pytest.mark.parametrize("qtype, shape, kept", [
    (QType.Q8_0, (2048, 6144), Q8_0_ROWS), (QType.Q8_0, (10, 256), Q8_0_ROWS), (QType.Q8_0, (10, 1280), Q8_0_ROWS),
    (QType.Q8_0, (10, 288), None), (QType.Q8_0, (4, 64, 512), None), (QType.Q6_K, (64, 512), None),
    (QType.Q4_K, (64, 512), None), (QType.BF16, (64, 512), None)])
def test_which_weights_the_cuda_backend_keeps_rows_first(qtype, shape, kept):
    backend = CudaBackend(kernels=kt, device_types=("cuda", "cpu"))
    assert backend.stored_type(qtype, shape) is (qtype if kept is None else kept)
    assert TorchBackend().stored_type(qtype, shape) == qtype  # the reference keeps the file's type


def test_the_kernels_and_a_stored_weight_give_the_file_values():
    kind = Q8_0_ROWS
    packed, values = matrix(kind.file_type, N_OUT, N_IN, seed=21)
    rows = rows_first.to_rows_layout(packed, kind).to(DEVICE)
    assert torch.equal(kt.dequantize_rows(rows, kind, N_OUT, N_IN, torch.float32).cpu(), values)
    backend = CudaBackend(kernels=kt, device_types=("cuda", "cpu"))
    assert torch.equal(backend.dequantize_rows(rows, kind, torch.float32).cpu(), values)
    w = StoredWeight(rows, kind, (N_OUT, N_IN), torch.float32, DEVICE)
    assert torch.equal(w.dense().cpu(), values)
    index = torch.tensor([3, 0, 71, 3])
    assert torch.equal(w.rows(index).cpu(), values[index])


def test_float32_rows_each_with_its_own_bits():
    packed, values = matrix(QType.Q8_0, N_OUT, N_IN, seed=31)
    w = rows_first.to_rows_layout(packed, Q8_0_ROWS).to(DEVICE)
    x = torch.randn(16, N_IN, generator=torch.Generator().manual_seed(3))
    batch = kt.quant_matmul(x.to(DEVICE), w, Q8_0_ROWS, N_OUT, N_IN)
    want = x.double() @ values.double().t()
    err = (batch.double().cpu() - want).abs().max().item()
    print(f"{WHERE} Q8_0_ROWS, float32 rows: max |Δ| {err:.3g} against float64")
    assert err <= 1e-5 * want.abs().max().item()
    for rows in (1, 3):
        assert torch.equal(kt.quant_matmul(x[:rows].to(DEVICE), w, Q8_0_ROWS, N_OUT, N_IN), batch[:rows])


def test_a_model_keeps_its_matrices_rows_first_and_decodes_greedily_alike(qwen35_dir, tmp_path, monkeypatch):
    """A model loaded where the CUDA backend runs (a GPU; the CPU under the interpreter here) keeps its
    eligible Q8_0 matrices as Q8_0_ROWS in the file's bytes, and in bfloat16 (their products on
    tensor cores) greedy speculative decoding equals plain decoding."""
    from specconv.runtime import backend as backend_module
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.model import load_model
    from specconv.runtime.speculative import SpecConfig, speculative_generate
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.runtime_common import prompt_ids

    device = "cuda" if ON_GPU else "cpu"
    backend = CudaBackend(kernels=kt, device_types=(device,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)
    # FFN rows 256 wide (its down product's input): matrices kept rows first beside others
    path = convert_gguf(qwen35_dir(text_over={"intermediate_size": 256}), tmp_path / "tiny.gguf", outtype="q8_0",
                        mtp="none")
    model = load_model(path, device=device, dtype="bf16")
    stored = [w for w in model.weights.values() if isinstance(w, StoredWeight)]
    kept = [w for w in stored if w.qtype is Q8_0_ROWS]
    assert kept and all(rows_first.kept_as(QType.Q8_0, tuple(w.shape)) for w in kept)
    assert not any(w.qtype == QType.Q8_0 and rows_first.kept_as(w.qtype, tuple(w.shape)) for w in stored)
    assert all(w.raw.numel() == row_bytes(QType.Q8_0, w.shape[-1]) * w.shape[0] for w in kept)
    prompt = [int(t) for t in prompt_ids(6, seed=3)]
    plain = generate(model, prompt, 8).tokens
    spec = speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=2), prompt, 8,
                                SpecConfig(draft_max=3))
    stats = spec.stats["speculative"]
    print(f"[{WHERE}] {len(kept)} matrices kept as Q8_0_ROWS; {stats['accepted']} of {stats['drafted']} drafts "
          f"accepted; speculative = plain: {spec.tokens == plain}")
    assert stats["drafted"] > 0 and spec.tokens == plain
