"""A Qwen3.5-shaped random bf16 checkpoint of a chosen size, for conversion benchmarks and memory tests.

The layout is a real release's (`Qwen3_5ForConditionalGeneration`: `text_config`,
`model.language_model.*`, an untied `lm_head.weight`, one `mtp.*` layer), with value heads = 2 × key
heads so the converter's V-head re-tiling runs. Names and shapes come from transformers' own
Qwen3.5 text model built on the meta device (nothing allocated), the MTP layer's from the same
decoder layer plus the release's `mtp.fc` / `pre_fc_norm_*` / `norm`. Weights are seeded random
bf16, written shard by shard (≈ 500 MB each) with `model.safetensors.index.json`, so generating a
multi-GB checkpoint needs only one shard of memory. The tokenizer is the bundled model's (2048
tokens); both converters pad the vocabulary to the embedding's rows with `[PAD{i}]` tokens.

A `synth.json` stamp records the parameters: `write_checkpoint` returns at once when the folder
already holds a complete checkpoint made with the same ones.

    python3 tools/synth_qwen35.py OUT_DIR --size-gb 2.2
    python3 tools/synth_qwen35.py OUT_DIR --size-gb 4 --experts 64 --experts-used 4   # Qwen3.5-MoE

With `--experts` the checkpoint is a Qwen3.5-MoE release (`Qwen3_5MoeForConditionalGeneration`,
fused 3-D `mlp.experts.gate_up_proj` / `down_proj`, a gated shared expert).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

BUNDLED = Path(__file__).resolve().parents[1] / "specconv" / "data" / "tiny-qwen35-mtp"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHARD_BYTES = 500_000_000
STAMP = "synth.json"


def text_config(*, hidden_size: int, intermediate_size: int, vocab_size: int, n_layers: int,
                experts: int = 0, experts_used: int = 0) -> dict:
    """A Qwen3.5 text config (Qwen3.5-0.8B-like heads, but 2 value heads per key head); with
    `experts`, a Qwen3.5-MoE one whose experts and shared expert are intermediate_size / 4 wide."""
    head_dim, partial = 256, 0.25
    rot_half = int(head_dim * partial) // 2
    sections = [rot_half - 2 * (rot_half // 3), rot_half // 3, rot_half // 3]  # sums to rot/2, as [11, 11, 10]
    moe = {}
    if experts:
        moe = {"num_experts": experts, "num_experts_per_tok": experts_used or 2,
               "moe_intermediate_size": intermediate_size // 4, "shared_expert_intermediate_size": intermediate_size // 4}
    return {
        **moe,
        "model_type": "qwen3_5_moe_text" if experts else "qwen3_5_text",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "vocab_size": vocab_size,
        "num_hidden_layers": n_layers, "head_dim": head_dim, "num_attention_heads": 8, "num_key_value_heads": 2,
        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": partial,
                            "mrope_section": sections, "mrope_interleaved": True},
        "eos_token_id": 2045, "pad_token_id": 2045,
    }


def tensor_shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """Release names -> shapes: the trunk from transformers on the meta device, plus the MTP layer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    moe = "num_experts" in text
    config_class, model_class = ((Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe
                                 else (Qwen3_5TextConfig, Qwen3_5ForCausalLM))
    config = config_class(**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        model = model_class(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        release = name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]
        shapes[release] = tuple(t.shape)
    h = text["hidden_size"]
    full = next(i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    for name, shape in list(shapes.items()):  # the MTP block is a full-attention decoder layer
        prefix = f"model.language_model.layers.{full}."
        if name.startswith(prefix):
            shapes["mtp.layers.0." + name[len(prefix):]] = shape
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    return shapes


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Values by kind, like a trained model's ranges: norms near 0 ((1+w) norms) or 1, A_log, dt_bias."""
    if name.endswith("A_log"):
        t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    elif name.endswith("dt_bias"):
        t = 0.5 * torch.randn(shape, generator=gen)
    elif len(shape) == 1:
        base = 1.0 if "linear_attn.norm" in name else 0.0
        t = base + 0.1 * torch.randn(shape, generator=gen)
    else:
        t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return t.to(torch.bfloat16)


def _nbytes(shape: tuple[int, ...]) -> int:
    return 2 * math.prod(shape)


def layers_for(target_bytes: int, **shape_kw) -> int:
    """The fewest layers (a multiple of 4: whole linear/full attention groups) reaching target_bytes."""
    fixed = sum(_nbytes(s) for n, s in tensor_shapes(text_config(n_layers=4, **shape_kw)).items()
                if not n.startswith("model.language_model.layers."))
    group = sum(_nbytes(s) for n, s in tensor_shapes(text_config(n_layers=4, **shape_kw)).items()
                if n.startswith("model.language_model.layers."))
    return 4 * max(1, math.ceil((target_bytes - fixed) / group))


def write_checkpoint(out_dir: str | Path, target_bytes: int = 2_200_000_000, *, n_layers: int | None = None,
                     hidden_size: int = 1024, intermediate_size: int = 3584, vocab_size: int = 248320,
                     seed: int = 0, shard_bytes: int = SHARD_BYTES, experts: int = 0, experts_used: int = 0) -> Path:
    """Write (or reuse) the checkpoint in out_dir; n_layers, when given, overrides target_bytes."""
    out = Path(out_dir)
    shape_kw = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, vocab_size=vocab_size)
    if experts:
        shape_kw.update(experts=experts, experts_used=experts_used)
    layers = n_layers or layers_for(target_bytes, **shape_kw)
    params = {"n_layers": layers, "seed": seed, "shard_bytes": shard_bytes, **shape_kw}
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    text = text_config(n_layers=layers, **shape_kw)
    shapes = tensor_shapes(text)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        if groups[-1] and size + _nbytes(shapes[name]) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _nbytes(shapes[name])
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: _random(n, shapes[n], gen) for n in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    index = {"metadata": {"total_size": sum(_nbytes(s) for s in shapes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    moe = bool(experts)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5",
              "text_config": text, "tie_word_embeddings": False, "image_token_id": 2045,
              "video_token_id": 2045, "vision_start_token_id": 2045, "vision_end_token_id": 2045}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (BUNDLED / f).is_file():
            shutil.copy(BUNDLED / f, out / f)
    stamp.write_text(json.dumps(params))  # last: a stamped folder is complete
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size-gb", type=float, default=2.2, help="target size in GB (10^9 bytes)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (overrides --size-gb)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0, help="routed experts per layer (a Qwen3.5-MoE checkpoint)")
    ap.add_argument("--experts-used", type=int, default=0, help="experts per token (default 2)")
    args = ap.parse_args()
    path = write_checkpoint(args.out_dir, int(args.size_gb * 1e9), n_layers=args.layers, seed=args.seed,
                            experts=args.experts, experts_used=args.experts_used)
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(f"{path}: {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
