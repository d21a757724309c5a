"""Whole K-quant files: `specconv convert --outtype q4_k_m` (one pass) against llama.cpp's quantize
tool run on our lossless (f32, or bf16) file of the same checkpoint.

llama.cpp's quantize is `llama_model_quantize` of llama-cpp-python 0.3.36 with its default
parameters (no importance matrix). The checkpoints are Qwen3.5 dense and MoE (8 experts, GQA 4,
one MTP layer) at shapes whose rows hold 256-element blocks, with FFN-down rows of 352 (a K-quant
block does not fit: the tool's fallbacks), and rows that are all zero, constant, or one outlier; and
the nextn families glm4moe, deepseek2 (tiny: rows of 64, so fallbacks everywhere, and at hidden
256) and glm4moelite, Gemma 4 (altup / laurel / per-layer tensors the tool never quantizes) and its
assistant drafter. The claim tested is the strongest one: the files are equal byte for byte (tensor types, block
bytes, tensor order, shapes, KV and its order). On a mismatch the test lists the tensors that differ.
"""

from __future__ import annotations

import ctypes
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from specconv.convert.quant_rules import KQUANT_FILE_TYPES
from tests.fixtures.gguf_files import convert_gguf

pytestmark = [pytest.mark.peer, pytest.mark.slow]

ALL_TYPES = [t for t in KQUANT_FILE_TYPES if t != "q2_k_s"]  # Q2_K_S needs an imatrix: test_convert_kquants_imatrix.py
BUNDLED = Path(__file__).resolve().parents[1] / "specconv" / "data" / "tiny-qwen35-mtp"


# ------------------------------------------------------------------ checkpoints


def qwen35_text_config(moe: bool, n_layers: int) -> dict:
    head_dim, partial = 64, 0.25
    rot_half = int(head_dim * partial) // 2
    cfg = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": 256, "intermediate_size": 352, "vocab_size": 2048, "num_hidden_layers": n_layers,
        "head_dim": head_dim, "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": partial,
                            "mrope_section": [rot_half - 2 * (rot_half // 3), rot_half // 3, rot_half // 3],
                            "mrope_interleaved": True},
        "eos_token_id": 2045, "pad_token_id": 2045,
    }
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                   shared_expert_intermediate_size=256)
    return cfg


def _shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """Release names and shapes from transformers' own model (meta device), plus the MTP layer."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    moe = "num_experts" in text
    config_cls, model_cls = (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else (Qwen3_5TextConfig,
                                                                                         Qwen3_5ForCausalLM)
    with torch.device("meta"):
        model = model_cls(config_cls(**{k: v for k, v in text.items() if k != "model_type"}))
    shapes = {n if n == "lm_head.weight" else "model.language_model." + n[len("model."):]: tuple(t.shape)
              for n, t in model.state_dict().items()}
    full = text["layer_types"].index("full_attention")
    prefix = f"model.language_model.layers.{full}."
    shapes.update({"mtp.layers.0." + n[len(prefix):]: s for n, s in list(shapes.items()) if n.startswith(prefix)})
    h = text["hidden_size"]
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    return shapes


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if len(shape) == 1:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    x = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    if rows.shape[1] < 256 or rows.shape[0] < 3:  # conv kernels, the shared-expert gate [1, H]
        return x
    rows[0] = 0.0  # all-zero blocks
    rows[1] = 0.02  # constant blocks
    rows[2, 5] = 3.0  # a single outlier
    return x


def write_qwen35(folder: Path, *, moe: bool, n_layers: int, dtype: str = "float32", seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    text = qwen35_text_config(moe, n_layers)
    rng = np.random.default_rng(seed)
    tensors = {n: torch.from_numpy(_values(n, s, rng)).to(getattr(torch, dtype))
               for n, s in sorted(_shapes(text).items())}
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text, "tie_word_embeddings": False,
              "image_token_id": 2045, "video_token_id": 2045, "vision_start_token_id": 2045,
              "vision_end_token_id": 2045}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (BUNDLED / f).is_file():
            shutil.copy(BUNDLED / f, folder / f)
    return folder


# ------------------------------------------------------------------ llama.cpp's quantize and the comparison


@pytest.fixture(scope="module")
def quantize():
    from tests.fixtures.peers import require_llama_cpp

    llama_cpp = require_llama_cpp()

    def run(src: Path, dst: Path, file_type: str) -> Path:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + file_type.upper())
        params.nthread = 2
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
        return dst

    return run


def assert_same_file(ours: Path, theirs: Path) -> None:
    a, b = ours.read_bytes(), theirs.read_bytes()
    if a == b:
        return
    from gguf import GGUFReader

    ra, rb = GGUFReader(ours), GGUFReader(theirs)
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    diffs = [f"{n}: ours {ta[n].tensor_type.name if n in ta else '-'}, llama.cpp "
             f"{tb[n].tensor_type.name if n in tb else '-'}" for n in sorted(set(ta) | set(tb))
             if n not in ta or n not in tb or ta[n].tensor_type != tb[n].tensor_type
             or ta[n].data.tobytes() != tb[n].data.tobytes()]
    kv = [k for k in set(ra.fields) | set(rb.fields) if k not in ra.fields or k not in rb.fields
          or [bytes(p) for p in ra.fields[k].parts] != [bytes(p) for p in rb.fields[k].parts]]
    pytest.fail(f"{ours.name} differs from llama.cpp's quantize ({len(a)} vs {len(b)} bytes); tensors: {diffs[:8]}; "
                f"KV: {kv}; tensor order equal: {[t.name for t in ra.tensors] == [t.name for t in rb.tensors]}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquant-models")
    cache: dict = {}

    def get(name: str) -> Path:
        if name not in cache:
            if name.startswith("qwen35"):
                cache[name] = write_qwen35(root / name, moe="moe" in name, n_layers=4 if "moe" in name else 8,
                                           dtype="bfloat16" if name.endswith("bf16") else "float32")
            elif name.startswith("gemma4"):
                from tests.fixtures.tiny_gemma4 import tiny_assistant, tiny_gemma4

                cache[name] = tiny_assistant() if name.endswith("assistant") else tiny_gemma4()
            else:
                from tests.fixtures.tiny_glm_deepseek import build_tiny

                family, _, size = name.partition("-")
                over = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256) if size else {}
                cache[name] = build_tiny(root / name, family, **over)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    """(model, outtype, mtp mode) -> {kind: path}; kinds "model" and, with --mtp separate, "sidecar"."""
    root = tmp_path_factory.mktemp("kquant-files")
    cache: dict = {}

    def get(model: str, outtype: str, mtp: str = "embed") -> dict[str, Path]:
        key = (model, outtype, mtp)
        if key not in cache:
            folder = root / "-".join(key)
            folder.mkdir()
            convert_gguf(models(model), folder / "model.gguf", outtype=outtype, mtp=mtp)
            cache[key] = {"model": folder / "model.gguf"}
            if mtp == "separate":
                cache[key]["sidecar"] = folder / "mtp-model.gguf"
        return cache[key]

    return get


def _check(converted, quantize, tmp_path, model: str, file_type: str, mtp: str = "embed", lossless: str = "f32"):
    base = converted(model, lossless, mtp)
    ours = converted(model, file_type, mtp)
    for kind, path in ours.items():
        assert_same_file(path, quantize(base[kind], tmp_path / f"llama-{kind}.gguf", file_type))


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("file_type", ALL_TYPES)
@pytest.mark.parametrize("model", ["qwen35", "qwen35moe"])
def test_every_file_type_equals_llama_quantize(converted, quantize, tmp_path, model, file_type):
    _check(converted, quantize, tmp_path, model, file_type)


@pytest.mark.parametrize("file_type", ["q4_k_m", "q6_k"])
@pytest.mark.parametrize("model", ["qwen35", "qwen35moe"])
def test_trunk_and_mtp_sidecar_equal_llama_quantize(converted, quantize, tmp_path, model, file_type):
    """--mtp separate: each file equals the tool's output for our f32 file of the same kind; the
    sidecar is quantized with its own counters, as the tool sees it."""
    _check(converted, quantize, tmp_path, model, file_type, mtp="separate")


@pytest.mark.parametrize("file_type", ["q4_k_m", "q5_k_m", "q6_k"])
@pytest.mark.parametrize("model", ["glm4moe", "deepseek2", "glm4moe-256", "deepseek2-256", "glm4moelite", "gemma4",
                                   "gemma4-assistant"])
def test_nextn_families_equal_llama_quantize(converted, quantize, tmp_path, model, file_type):
    _check(converted, quantize, tmp_path, model, file_type)


def test_bf16_checkpoint_equals_llama_quantize_of_the_bf16_file(converted, quantize, tmp_path):
    """From a bf16 checkpoint the lossless file is bf16 (unquantized tensors stay BF16 in both)."""
    _check(converted, quantize, tmp_path, "qwen35-bf16", "q4_k_m", lossless="bf16")


def test_file_type_kv_and_mtp_types(converted):
    from gguf import GGUFReader

    reader = GGUFReader(converted("qwen35moe", "Q4_K_M")["model"])  # upper case accepted
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("general.")}
    assert fields["general.file_type"] == 15 and fields["general.quantization_version"] == 2
    assert list(reader.fields)[-2:] == ["general.quantization_version", "general.file_type"]
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # what the MTP head gets (docs/convert.md): the trunk's rules, as the last layer; 8 experts -> Q8_0 attn_v
    assert types["blk.4.nextn.eh_proj.weight"] == "Q4_K"
    assert types["blk.4.attn_v.weight"] == "Q8_0" and types["output.weight"] == "Q6_K"
    assert types["blk.4.ffn_gate_inp.weight"] == "F32"


def test_llama_cpp_runs_ours_like_its_own(converted, quantize, tmp_path):
    from tests.fixtures import peers

    ours = converted("qwen35", "q4_k_m")["model"]
    theirs = quantize(converted("qwen35", "f32")["model"], tmp_path / "theirs.gguf", "q4_k_m")
    ids = [5, 17, 42, 99, 3, 250, 7, 77]
    assert peers.llama_greedy(ours, ids, 8) == peers.llama_greedy(theirs, ids, 8)
    assert peers.llama_mtp_context_ok(ours)


@pytest.mark.parametrize("mtp", ["embed", "separate"])
def test_mtp_outtype_keeps_the_head_at_another_type(models, converted, quantize, tmp_path, mtp):
    """--mtp-outtype q8_0: the MTP block's matrices are the q8_0 conversion's, every other tensor is
    the tool's K-quant (its counters still see the MTP block); llama.cpp builds the MTP context."""
    from gguf import GGUFReader

    from tests.fixtures import peers

    src = models("qwen35moe")
    out = convert_gguf(src, tmp_path / "model.gguf", outtype="q4_k_m", mtp=mtp, extra_args=["--mtp-outtype", "q8_0"])
    files = {"model": out} if mtp == "embed" else {"model": out, "sidecar": tmp_path / "mtp-model.gguf"}
    for kind, path in files.items():
        ours = {t.name: t for t in GGUFReader(path).tensors}
        tool = {t.name: t for t in GGUFReader(quantize(converted("qwen35moe", "f32", mtp)[kind],
                                                        tmp_path / f"tool-{kind}.gguf", "q4_k_m")).tensors}
        q8 = {t.name: t for t in GGUFReader(converted("qwen35moe", "q8_0", mtp)[kind]).tensors}
        assert list(ours) == list(tool)
        for name, t in ours.items():
            mtp_matrix = name.startswith("blk.4.") and tool[name].tensor_type.name != "F32"
            expected = q8[name] if mtp_matrix else tool[name]
            assert t.tensor_type == expected.tensor_type, name
            assert t.data.tobytes() == expected.data.tobytes(), name
        if kind == "sidecar" or mtp == "embed":  # the trunk-only file has no MTP block
            assert sum(name.startswith("blk.4.") and t.tensor_type.name == "Q8_0" for name, t in ours.items()) >= 8
    assert peers.llama_mtp_context_ok(out, files.get("sidecar"))
    from specconv.convert.gguf_summary import summarize  # `specconv inspect`: the types of each group

    groups = summarize(files.get("sidecar", out))["by_group"]
    assert groups["mtp"].get("Q8_0", 0) >= 8 and "Q4_K" not in groups["mtp"]


def test_numpy_fallback_writes_the_same_file(models, converted, tmp_path):
    """Without the native encoders (SPECCONV_NO_NATIVE=1, in a fresh process: the choice is made at
    import) the converter writes the same file through convert/kquants.py."""
    import os
    import subprocess
    import sys

    out = tmp_path / "numpy.gguf"
    subprocess.run([sys.executable, "-m", "specconv", "convert", str(models("qwen35moe")), "-o", str(out),
                    "--outtype", "q5_k_m", "--json"], env={**os.environ, "SPECCONV_NO_NATIVE": "1"}, check=True,
                   capture_output=True)
    assert out.read_bytes() == converted("qwen35moe", "q5_k_m")["model"].read_bytes()


def test_threads_do_not_change_the_bytes(models, tmp_path):
    src = models("qwen35moe")
    one = convert_gguf(src, tmp_path / "one.gguf", outtype="q3_k_m", extra_args=["--threads", "1"])
    four = convert_gguf(src, tmp_path / "four.gguf", outtype="q3_k_m", extra_args=["--threads", "4"])
    assert one.read_bytes() == four.read_bytes()


def test_dry_run_plan_and_names(models, tmp_path, converted):
    from click.testing import CliRunner
    from gguf import GGUFReader

    from specconv import cli as cli_module

    src = models("qwen35")
    result = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path) + "/", "--outtype", "q5_k_s",
                                                 "--dry-run", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["outtype"] == "Q5_K_S" and plan["files"][0]["path"].endswith("-Q5_K_S.gguf")
    written = {t.name: t.tensor_type.name for t in GGUFReader(converted("qwen35", "q5_k_s")["model"]).tensors}
    assert {t["name"]: t["type"] for t in plan["files"][0]["tensors"]} == written
