"""`specconv imatrix` against a direct computation: transformers' own forward of the same chunks, the
input of every nn.Linear of the blocks (and of the router, the routed experts and, with
--process-output, the head) summed squared in the test and mapped to GGUF names — Qwen3.5 dense,
Qwen3.5-MoE (re-randomised tiny checkpoints) and the bundled model. In float64 (the reference with
the file's float32 roundings, specconv/verify/parity.py) the sums agree to float64 rounding; in
float32 to the two implementations' float32 rounding. Counts are equal exactly. Then the file: what
the command writes is what the reader reads, and `quantize --imatrix` with it gives llama.cpp's bytes
(llama_model_quantize given the same weights). llama-imatrix itself: tests/convert/test_imatrix_llama.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv import cli as cli_module
from specconv.convert import imatrix as im
from specconv.imatrix import ImatrixOptions, collect
from specconv.imatrix.collector import ImatrixCollector
from tests.fixtures.imatrix_inputs import checkpoints, text  # noqa: F401 (fixtures)
from tests.fixtures.kquant_files import converted, models  # noqa: F401 (fixtures)
from tests.fixtures.gguf_files import convert_gguf

F64_REL = 1e-12  # measured 4e-15 .. 2e-14: float64 rounding
# float32: ours against transformers in float64 may be F32_OWN_NOISE x transformers' own float32 error
# (its float32 sums against its float64 ones, the same chunks), and never under F32_FLOOR. The
# reference's float32 error is the yardstick: random Gated DeltaNet layers amplify rounding, and
# transformers' chunked form takes its decays as float32 differences of a cumulative sum, which
# ours takes in float64 (runtime/graphs/gdn.py cumulative_log_decay).
F32_OWN_NOISE = 2.0
F32_FLOOR = 1e-5

# transformers module (under model.layers.N.) -> GGUF tensor of block N
_PARTS = {"linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
          "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.out_proj": "ssm_out",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


@torch.no_grad()
def transformers_sums(model, chunks: list[list[int]], process_output: bool):
    """{GGUF name: float64 [experts, row]}, {GGUF name: int64 [experts]} from hooks on transformers'
    modules over the chunks (one forward each), input columns in the GGUF file's order."""
    sums, counts = {}, {}

    def add(name, x, e=0, n_mat=1):
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        if name not in sums:
            sums[name] = torch.zeros(n_mat, x.shape[1], dtype=torch.float64)
            counts[name] = np.zeros(n_mat, np.int64)
        sums[name][e] += (x * x).sum(0)
        counts[name][e] += x.shape[0]

    def experts_hook(i):
        def hook(mod, args):  # (hidden_states [T, H], top_k_index [T, k], top_k_weights)
            x, index = args[0], args[1]
            for e in range(mod.num_experts):
                tokens = (index == e).any(-1).nonzero()[:, 0]
                if tokens.numel():
                    gate, up = torch.nn.functional.linear(x[tokens], mod.gate_up_proj[e]).chunk(2, dim=-1)
                    for part, rows in (("gate", x[tokens]), ("up", x[tokens]), ("down", mod.act_fn(gate) * up)):
                        add(f"blk.{i}.ffn_{part}_exps.weight", rows, e, mod.num_experts)
        return hook

    handles = []
    for module_name, module in model.named_modules():
        if process_output and module_name == "lm_head":
            handles.append(module.register_forward_pre_hook(lambda m, a: add("output.weight", a[0])))
        found = re.match(r"^model\.layers\.(\d+)\.(.+)$", module_name)
        if found is None:
            continue
        i, part = found.groups()
        if part == "mlp.experts":
            handles.append(module.register_forward_pre_hook(experts_hook(i)))
        elif part in _PARTS:
            name = f"blk.{i}.{_PARTS[part]}.weight"
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: add(name, a[0])))
    try:
        for ids in chunks:
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    cfg = model.config
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    out = {}
    for name, s in sums.items():
        s = s.numpy()
        if name.endswith("ssm_out.weight"):  # value heads: grouped in transformers, tiled in GGUF
            s = s.reshape(s.shape[0], nk, nv // nk, dv).transpose(0, 2, 1, 3).reshape(s.shape[0], -1)
        out[name] = s
    return out, counts


def worst_relative(ours: dict, ref: dict) -> tuple[float, str]:
    """max over tensors and columns of |ours − ref| / ref (the sums are positive)."""
    worst = max((float(np.max(np.abs(ours[n] - ref[n]) / ref[n])), n) for n in ref)
    return worst


@pytest.mark.parametrize("name,dtype,process_output", [
    ("dense", "f64", False), ("moe", "f64", False), ("bundled", "f64", False), ("dense", "f64", True),
    ("dense", "f32", False), ("moe", "f32", False), ("bundled", "f32", False)])
def test_sums_equal_transformers_inputs(checkpoints, text, tmp_path, name, dtype, process_output):
    from specconv.verify.parity import reference_model, reference_precision

    folder, gguf = checkpoints(name)
    ctx, n_chunks = (128, 6) if name == "bundled" else (64, 3)
    res = collect(ImatrixOptions(model=gguf, output=tmp_path / "x.gguf", text=text, ctx=ctx, chunks=n_chunks,
                                 process_output=process_output, device="cpu", dtype=dtype))
    chunks = [res.chunks.ids(i) for i in range(res.chunks.n_chunks)]
    assert res.chunks.n_chunks == n_chunks and all(len(c) == ctx for c in chunks)
    arch = "qwen35moe" if name == "moe" else "qwen35"

    def reference(precision):
        with reference_model(folder, arch, precision) as (model, bad):
            assert not bad
            with reference_precision(model):
                return transformers_sums(model, chunks, process_output)

    ref, ref_counts = reference(torch.float64)
    assert sorted(res.sums) == sorted(ref)
    assert ("output.weight" in ref) == process_output
    for n in ref:
        assert res.sums[n].shape == ref[n].shape, n
        assert np.array_equal(res.counts[n], ref_counts[n]), (n, res.counts[n], ref_counts[n])
        if ref[n].shape[0] == 1:
            assert res.counts[n][0] == ctx * n_chunks  # every position of every chunk
    worst, where = worst_relative(res.sums, ref)
    experts = sum(ref_counts[n].size > 1 for n in ref)
    print(f"{name} {dtype}: {len(ref)} matrices ({experts} routed-expert tensors), max |Δ|/sum {worst:.2e} ({where}) "
          "against transformers in float64")
    if dtype == "f64":
        assert worst < F64_REL
    else:
        own, own_where = worst_relative(reference(torch.float32)[0], ref)
        bound = max(F32_FLOOR, F32_OWN_NOISE * own)
        print(f"  transformers' own float32 sums against its float64 ones: {own:.2e} ({own_where}); bound {bound:.2e}")
        assert worst < bound
    assert res.chunk_count == n_chunks and res.unnamed == 0


def test_observing_leaves_the_forward_unchanged(checkpoints, text):
    """The collector watching (the observed MoE path, one expert at a time) gives the logits of the
    forward without it; after the block no observer is left behind."""
    from specconv.runtime import Context, GraphType, load_model
    from specconv.runtime.backend import activation_observer, observing

    model = load_model(checkpoints("moe")[1], device="cpu", dtype="f64")
    ids = model.tokenizer.encode(text.read_text()[:400])[:40]

    def logits(observer):
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=0)
        with observing(observer):
            return ctx.decode(ids, hidden=()).logits

    plain = logits(None)
    collector = ImatrixCollector(model.weights)
    watched = logits(collector)
    assert activation_observer() is None
    diff = float((plain - watched).abs().max())
    print(f"observed vs plain forward: max |Δlogit| {diff:.1e}")
    assert diff < 1e-12 and collector.sums


def test_experts_never_routed_to_keep_zero_counts(tmp_path):
    """ops.moe under the collector: an expert no row is routed to keeps a zero count and zero sums, and
    the written file gives it weights 1 (as llama.cpp's quantize does); routed rows are counted per
    (token, expert) pair, the down projection's input being the expert's own activation."""
    from specconv.runtime.backend import Experts, observing
    from specconv.runtime.graphs.ops import moe, swiglu

    g = torch.Generator().manual_seed(0)
    E, H, F = 4, 8, 6
    gate, up = torch.randn(E, F, H, generator=g), torch.randn(E, F, H, generator=g)
    down = torch.randn(E, H, F, generator=g)
    x = torch.randn(5, H, generator=g)
    chosen = torch.tensor([[0, 2], [2, 0], [0, 3], [3, 2], [0, 2]])  # expert 1 never
    weights = torch.full((5, 2), 0.5)
    names = {"blk.0.ffn_gate_exps.weight": gate, "blk.0.ffn_up_exps.weight": up, "blk.0.ffn_down_exps.weight": down}
    collector = ImatrixCollector(names)
    with observing(collector):
        out = moe(x, weights, chosen, Experts(gate, up, down, swiglu))
    expected = torch.zeros(5, H)
    for r in range(5):
        for s in range(2):
            e = int(chosen[r, s])
            expected[r] += 0.5 * (down[e] @ (torch.nn.functional.silu(gate[e] @ x[r]) * (up[e] @ x[r])))
    assert torch.allclose(out, expected, atol=1e-5)
    sums, counts = collector.arrays()
    assert counts["blk.0.ffn_gate_exps.weight"].tolist() == [4, 0, 4, 2]
    e2 = chosen.eq(2).any(-1)
    assert np.allclose(sums["blk.0.ffn_up_exps.weight"][2], (x[e2].double() ** 2).sum(0).numpy())
    h = torch.nn.functional.silu(x[e2] @ gate[2].T) * (x[e2] @ up[2].T)
    assert np.allclose(sums["blk.0.ffn_down_exps.weight"][2], (h.double() ** 2).sum(0).numpy(), rtol=1e-6)
    assert not sums["blk.0.ffn_down_exps.weight"][1].any()
    im.write_gguf(tmp_path / "m.gguf", sums, counts, ["t.txt"], 0, 512)
    w = im.load(tmp_path / "m.gguf").weights["blk.0.ffn_down_exps.weight"].reshape(E, F)
    assert (w[1] == 1).all() and np.allclose(w[2], sums["blk.0.ffn_down_exps.weight"][2] / 4)


def test_a_weight_reshaped_for_its_product_keeps_its_name():
    """A 1-D weight multiplied as [1, H] (the shared-expert gate of llama.cpp's converter) is recorded
    under its own name; a tensor computed from a weight has none and is only counted."""
    from specconv.runtime.backend import observing
    from specconv.runtime.graphs.ops import linear

    w1, head = torch.randn(8), torch.randn(3, 8)
    collector = ImatrixCollector({"blk.0.ffn_gate_inp_shexp.weight": w1, "output.weight": head})
    x = torch.randn(4, 8)
    with observing(collector):
        linear(x, w1.reshape(1, -1))
        linear(x, w1.reshape(1, -1) * 2)
        linear(x, head)  # output.weight: not recorded without process_output
    assert list(collector.sums) == ["blk.0.ffn_gate_inp_shexp.weight"] and collector.unnamed == 1


def test_command_writes_what_the_reader_reads(checkpoints, text, tmp_path):
    """The CLI end to end on the bundled model, both formats: llama-imatrix's keys, the dataset as
    given, chunks, and weights sums / counts (the legacy file within its float32 rounding)."""
    gguf = checkpoints("bundled")[1]
    runner = CliRunner()
    out = tmp_path / "ours.gguf"
    args = ["imatrix", str(gguf), "--text", str(text), "--ctx", "64", "--chunks", "4", "-o", str(out)]
    r = runner.invoke(cli_module.cli, args + ["--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["chunk_count"] == 4 and report["chunk_size"] == 64 and report["entries"] == 31
    assert report["text"]["evaluated_tokens"] == 256 and report["text"]["dataset"] == str(text)
    loaded = im.load(out)
    assert loaded.datasets == [str(text)] and loaded.chunk_count == 4 and len(loaded.weights) == 31
    res = collect(ImatrixOptions(model=gguf, output=out, text=text, ctx=64, chunks=4, device="cpu"))
    for name, w in loaded.weights.items():
        assert np.array_equal(w, (res.sums[name].astype(np.float32) / np.float32(res.counts[name][0])).reshape(-1))
    r = runner.invoke(cli_module.cli, args)
    assert r.exit_code != 0 and "already exists" in str(r.exception)
    dat = tmp_path / "ours.dat"
    r = runner.invoke(cli_module.cli, args[:-1] + [str(dat), "--output-format", "dat"])
    assert r.exit_code == 0 and "31 matrices" in r.output, r.output
    legacy = im.load(dat)
    assert legacy.datasets == [str(text)] and legacy.chunk_count == 4
    assert max(float(np.max(np.abs(legacy.weights[n] - w) / w)) for n, w in loaded.weights.items()) < 1e-6


def test_bad_input_is_one_line(checkpoints, text, tmp_path, capsys):
    gguf = checkpoints("bundled")[1]
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    cases = [(["--text", str(short), "-o", str(tmp_path / "a.gguf")], "needs at least 512"),
             (["--text", str(text), "-o", str(tmp_path / "no" / "a.gguf")], "does not exist"),
             (["-o", str(tmp_path / "b.gguf")], "--text FILE or --tokens FILE")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as ended:
            cli_module.main(["imatrix", str(gguf), *extra])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_quantize_with_our_imatrix_equals_llama_quantize_given_its_weights(models, converted, text,  # noqa: F811
                                                                         tmp_path):
    """Round trip: our imatrix of the Qwen3.5-MoE file at rows of 256 → `specconv quantize --imatrix` and
    `convert --imatrix` write what llama.cpp's llama_model_quantize writes given the weights our reader
    takes from that file (with its quantize.imatrix.* KV), and not the unweighted file."""
    from tests.fixtures.kquant_files import assert_same_file, quantize_in_process

    f32 = converted("qwen35moe", "f32")["model"]
    ours = tmp_path / "imatrix.gguf"
    runner = CliRunner()
    r = runner.invoke(cli_module.cli, ["imatrix", str(f32), "--text", str(text), "--ctx", "64", "--chunks", "4", "-o",
                                       str(ours)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli_module.cli, ["quantize", str(f32), str(tmp_path / "q.gguf"), "Q4_K_M", "--imatrix",
                                       str(ours)])
    assert r.exit_code == 0, r.output
    theirs = quantize_in_process(f32, tmp_path / "llama.gguf", "q4_k_m", im.load(str(ours)))
    assert_same_file(tmp_path / "q.gguf", theirs)
    convert_gguf(models("qwen35moe"), tmp_path / "c.gguf", outtype="q4_k_m", extra_args=["--imatrix", str(ours)])
    assert_same_file(tmp_path / "c.gguf", theirs)
    assert (tmp_path / "q.gguf").read_bytes() != converted("qwen35moe", "q4_k_m")["model"].read_bytes()
