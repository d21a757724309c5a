"""Weights kept in their GGUF types (runtime/stored.py, runtime/weights.py) compute what the
dequantize-everything path computes, in every family the runtime runs:

* stored vs dense, offloaded vs resident, several CPU "slots" vs one device: identical logits in
  float32 (trunk and MTP head), for f32 and q8_0 files;
* the pieces: embedding rows, one expert of a stored 3-D tensor, experts taken by an index
  tensor, the chunked product (torch and native backends); a stored weight handed to any other
  torch function is an error naming it;
* a MoE decode step dequantizes only the experts its token is routed to (the read counter equals
  the bytes of exactly those slices);
* a tensor type the runtime cannot dequantize is a one-line error naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from specconv.archs.errors import SpecconvError
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime import backend_cpu, stored as stored_module
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.stored import StoredWeight
from tests.fixtures.runtime_common import tiny_gguf

torch.set_num_threads(1)
IDS = [int(x) for x in np.random.default_rng(11).integers(0, 500, 24)]


def _qwen35(tmp, outtype, moe=False):
    src, path = tiny_gguf(tmp, moe=moe, outtype=outtype)
    return path


def _glm_deepseek(family):
    def make(tmp, outtype):
        from tests.fixtures import tiny_glm_deepseek as tiny
        from tests.fixtures.gguf_files import convert_gguf

        root = tmp.mktemp(f"stored-{family}")
        src = tiny.build_tiny(root / "hf", family)
        return convert_gguf(src, root / f"{family}-{outtype}.gguf", outtype=outtype)
    return make


def _gemma4(tmp, outtype):
    from tests.fixtures import tiny_gemma4 as g
    from tests.fixtures.gguf_files import convert_gguf

    return convert_gguf(g.tiny_gemma4("v5", "causal"), tmp.mktemp("stored-g4") / f"g4-{outtype}.gguf", outtype=outtype)


def _llama(tmp, outtype):
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_eagle3 import build_llama_target

    root = tmp.mktemp("stored-llama")
    return convert_gguf(build_llama_target(root / "hf"), root / f"llama-{outtype}.gguf", outtype=outtype)


FAMILIES = {
    "qwen35": lambda tmp, t: _qwen35(tmp, t),
    "qwen35moe": lambda tmp, t: _qwen35(tmp, t, moe=True),
    "glm4moe": _glm_deepseek("glm4moe"),
    "deepseek2": _glm_deepseek("deepseek2"),
    "gemma4": _gemma4,
    "llama": _llama,
}
_files: dict = {}


def family_file(tmp_path_factory, family: str, outtype: str):
    key = (family, outtype)
    if key not in _files:
        _files[key] = FAMILIES[family](tmp_path_factory, outtype)
    return _files[key]


def run(model, ids=IDS):
    """(trunk logits, post-norm hidden, and the MTP head's logits when the file has one)."""
    ids = [i % (model.vocab_size - 8) for i in ids]
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 1)
    out = ctx.decode(ids)
    hidden = out.hidden["post_norm"]
    mtp = None
    if GraphType.MTP in model.serves:
        head = Context(model, GraphType.MTP, n_ctx=len(ids) + 1)
        mtp = head.decode(ids[1:], hidden_in=hidden[:-1]).logits
    return out.logits, hidden, mtp


def assert_same(a, b, label):
    for x, y, part in zip(a, b, ("logits", "hidden", "mtp logits")):
        if x is None:
            assert y is None
            continue
        diff = float((x - y).abs().max())
        print(f"\n[{label}] {part}: max|Δ| {diff:.3e}")
        assert torch.equal(x, y), f"{label}: {part} differ by {diff}"


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stored_weights_compute_what_dense_weights_compute(tmp_path_factory, family, outtype):
    path = family_file(tmp_path_factory, family, outtype)
    stored = load_model(path, device="cpu", dtype="f32")
    dense = load_model(path, device="cpu", dtype="f32", weights="dense")
    kinds = {type(w).__name__ for w in stored.weights.values()}
    assert "StoredWeight" in kinds and "StoredWeight" not in {type(w).__name__ for w in dense.weights.values()}
    assert_same(run(stored), run(dense), f"{family} {outtype} stored vs dense")


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "llama", "deepseek2"])
def test_offload_and_several_slots_compute_what_one_device_computes(tmp_path_factory, family):
    path = family_file(tmp_path_factory, family, "q8_0")
    resident = run(load_model(path, device="cpu"))
    assert_same(run(load_model(path, device="cpu", offload=True)), resident, f"{family} offload")
    for slots in ("cpu,cpu", "cpu,cpu,cpu"):
        placed = load_model(path, device=slots)
        starts = placed.weights.placement.starts
        assert len(starts) == slots.count(",") + 1 and starts == sorted(starts) and starts[0] == 0
        assert_same(run(placed), resident, f"{family} over {slots}")


def test_blocks_are_cut_over_devices_by_their_bytes():
    from specconv.runtime.placement import Placement

    cpu = torch.device("cpu")
    p = Placement.plan([cpu, cpu], [10, 10, 10, 10, 40])
    assert p.starts == [0, 4]  # 40 | 40
    p = Placement.plan([cpu, cpu, cpu], [1] * 9)
    assert p.starts == [0, 3, 6]
    p = Placement.plan([cpu, cpu, cpu], [5])  # fewer blocks than devices: the rest hold the head only
    assert p.starts == [0, 1, 1]
    assert Placement.plan([cpu, cpu], [100, 1, 1]).starts == [0, 1]


def test_a_graph_that_runs_on_one_device_refuses_several(tmp_path_factory):
    path = family_file(tmp_path_factory, "gemma4", "f32")
    with pytest.raises(SpecconvError, match="runs on one device"):
        load_model(path, device="cpu,cpu")


def _q8_weight(rows, cols, lead=(), seed=0):
    from gguf.quants import quantize

    values = np.random.default_rng(seed).standard_normal((*lead, rows, cols)).astype(np.float32)
    packed = quantize(values, GGMLQuantizationType.Q8_0)
    raw = torch.from_numpy(np.ascontiguousarray(packed))
    w = StoredWeight(raw, GGMLQuantizationType.Q8_0, (*lead, rows, cols), torch.float32, torch.device("cpu"))
    return w, w.dense()


def test_embedding_rows_and_expert_slices_equal_the_dense_tensor():
    w, full = _q8_weight(40, 64)
    idx = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(w[idx], full[idx])
    assert torch.equal(w[5], full[5])
    assert torch.equal(w.to(torch.float64), full.double())
    experts, full3 = _q8_weight(16, 64, lead=(5,), seed=1)
    assert isinstance(experts[2], StoredWeight) and experts[2].shape == (16, 64)
    assert torch.equal(experts[2].dense(), full3[2])
    with pytest.raises(IndexError):
        experts[5]
    taken = experts.take(torch.tensor([4, 0, 4]))  # by an index tensor, still packed
    assert isinstance(taken, StoredWeight) and taken.shape == (3, 16, 64)
    assert torch.equal(taken.dense(), full3[[4, 0, 4]])


def test_a_float_weight_in_its_own_dtype_keeps_one_view_of_its_bytes():
    """Each product by a small float weight would otherwise reinterpret its bytes again: the view is
    built once and is the stored bytes (no copy); other dtypes and quantized types are computed each
    time, and the read counter counts every use."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    values = rng.standard_normal((24, 40)).astype(np.float32)
    raw = torch.from_numpy(values.copy()).view(torch.uint8)
    counter = stored_module.ReadCounter()
    w = StoredWeight(raw, GGMLQuantizationType.F32, (24, 40), torch.float32, torch.device("cpu"), counter)
    first, second = w.dense(), w.dense(torch.float32)
    assert second is first and first.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert torch.equal(first, torch.from_numpy(values)) and counter.bytes == 2 * raw.numel()
    half = w.dense(torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, torch.from_numpy(values).half())
    assert w.dense() is first
    raw[0, :4] = torch.tensor([0.5], dtype=torch.float32).view(torch.uint8)  # the bytes change: so does the view
    assert w.dense()[0, 0] == 0.5
    q8, _ = _q8_weight(8, 32)
    assert q8.dense() is not q8.dense()


def test_a_stored_weight_given_to_a_torch_function_is_an_error_naming_it():
    """No silent whole-tensor dequantization: products go through ops.linear / ops.moe, values
    through .to() / dense()."""
    w, _ = _q8_weight(40, 64)
    x = torch.randn(3, 64)
    with pytest.raises(SpecconvError, match=r"torch\.nn\.functional\.linear was given a StoredWeight"):
        torch.nn.functional.linear(x, w)
    with pytest.raises(SpecconvError, match=r"torch\.matmul was given a StoredWeight"):
        torch.matmul(x, w)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_chunked_product_equals_the_whole_product(monkeypatch, native):
    w, full = _q8_weight(300, 96, seed=2)
    x = torch.randn(5, 96)
    whole = x @ full.t()
    monkeypatch.setattr(backend_cpu, "WHOLE_MAX_ELEMENTS", 0)  # every product takes a chunked path
    # float32 activations: the 8-bit-activation product has its own bound (tests/runtime/test_int8_product.py)
    monkeypatch.setenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", "1")
    monkeypatch.setattr(stored_module, "CHUNK_ELEMENTS", 96 * 7)  # 7 rows a piece, the last one short
    backend = backend_cpu.NativeCpuBackend() if native else TorchBackend()
    pieces = list(w.row_chunks())
    assert len(pieces) == 43 and pieces[-1][1].shape[0] == 300 - 42 * 7
    for rows in (x[:1], x[:2], x):  # the fused kernel (up to FUSED_MAX_ROWS rows) or the chunked product
        chunked = backend.linear(rows, w)
        print(f"\n[chunked product, {rows.shape[0]} rows, {'native' if native else 'torch'}] max|Δ| vs whole "
              f"{float((chunked - whole[:rows.shape[0]]).abs().max()):.3e}")
        torch.testing.assert_close(chunked, whole[:rows.shape[0]], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["device", "torch"])
def test_a_moe_decode_step_reads_only_the_routed_experts(tmp_path_factory, monkeypatch, backend):
    """On the CPU's backend (experts grouped by expert) and on the torch reference (each row's
    experts taken by index, without host reads, as on CUDA)."""
    from specconv.runtime import backend as backend_module

    if backend == "torch":
        monkeypatch.setattr(backend_module, "_backend", lambda kind: TorchBackend())
    path = family_file(tmp_path_factory, "qwen35moe", "q8_0")
    model = load_model(path, device="cpu")
    hp = model.hparams
    ctx = Context(model, GraphType.MAIN, n_ctx=8)
    ctx.decode(IDS[:3])
    chosen = {}  # layer -> experts the last token was routed to
    from specconv.runtime.graphs import ops

    real = ops.moe_softmax_topk_gated_shared

    def spy(x, logits, n_used, *rest):  # the router's logits: the experts the block routes to
        probs = torch.softmax(logits.float(), dim=-1)
        chosen[len(chosen)] = set(torch.topk(probs, n_used, dim=-1).indices.flatten().tolist())
        return real(x, logits, n_used, *rest)

    import specconv.runtime.graphs.qwen35 as graph
    monkeypatch.setattr(graph, "moe_softmax_topk_gated_shared", spy)
    model.weights.counter.reset()
    ctx.decode([IDS[3]], hidden=())
    read = model.weights.counter.reset()
    expected = 0
    for name, w in model.weights.items():
        if not isinstance(w, StoredWeight):
            continue
        block = int(name.split(".")[1]) if name.startswith("blk.") else None
        if block is not None and block >= hp.num_hidden_layers:
            continue  # the MTP block is not part of the trunk's forward
        if name == "token_embd.weight":
            expected += w.raw[0].numel()  # one row
            if "output.weight" not in model.weights:
                expected += w.stored_bytes  # and the whole matrix as the tied head
        elif "_exps." in name:
            expected += len(chosen[block]) * w.raw[0].numel()
        else:
            expected += w.stored_bytes
    all_experts = sum(w.stored_bytes for n, w in model.weights.items() if "_exps." in n)
    print(f"\n[moe, {backend} backend] one token read {read} stored bytes; all experts hold {all_experts}; "
          f"experts used per layer {[len(c) for c in chosen.values()]} of {hp.num_experts}")
    assert len(chosen) == hp.num_hidden_layers and all(len(c) == hp.num_experts_per_tok for c in chosen.values())
    assert read == expected


def test_an_unsupported_tensor_type_is_named(tmp_path):
    from specconv.runtime.dequant import SUPPORTED
    from specconv.runtime.weights import load_tensor

    missing = [t for t in GGMLQuantizationType if t not in SUPPORTED and t.name.startswith("IQ")]
    assert missing, "every IQ type supported: pick another unsupported type for this test"

    class FakeTensor:
        tensor_type = missing[0]
        data = np.zeros(0, np.uint8)

        class stored:
            torch_shape = (4, 256)

    class FakeFile:
        tensors = {"blk.0.attn_q.weight": FakeTensor()}
        paths = [tmp_path / "x.gguf"]

    with pytest.raises(SpecconvError, match=missing[0].name):
        load_tensor(FakeFile(), "blk.0.attn_q.weight", torch.device("cpu"), torch.float32, "stored", False, None)


@pytest.mark.parametrize("extra", [["--offload"], ["--device", "cpu,cpu"]], ids=["offload", "two-slots"])
def test_verify_and_generate_run_offloaded_and_over_slots(tmp_path_factory, tmp_path, extra):
    import json

    from click.testing import CliRunner

    from specconv import cli as cli_module

    path = family_file(tmp_path_factory, "qwen35", "q8_0")
    runner = CliRunner()
    report = tmp_path / "report.json"
    result = runner.invoke(cli_module.cli, ["verify", str(path), "-n", "6", "--report", str(report), *extra])
    assert result.exit_code == 0 and json.loads(report.read_text())["passed"], result.output
    plain = runner.invoke(cli_module.cli, ["generate", str(path), "--tokens", "5,6,7", "-n", "5", "--json",
                                           "--device", "cpu"])
    placed = runner.invoke(cli_module.cli, ["generate", str(path), "--tokens", "5,6,7", "-n", "5", "--json",
                                            *(extra if "--device" in extra else ["--device", "cpu", *extra])])
    a, b = json.loads(plain.output), json.loads(placed.output)
    assert a["tokens"] == b["tokens"] and b["load_seconds"] >= 0 and b["decode_tokens_per_second"] > 0
    assert len(b["placement"]) == (2 if "--device" in extra else 1) and b["offload"] == ("--offload" in extra)
