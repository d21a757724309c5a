"""Synthetic Qwen3.5 checkpoints for the plugin tests: a config dict and random HF tensors.

Names and shapes are written out from the HF modules (docs/reference/gguf-layout.md §7.1/§7.2 "HF tensor"
columns), not derived from the plugin, so the plugin is checked against them. No file I/O:
the plugin only ever sees a Checkpoint (config + headers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specconv.archs import Checkpoint, SourceTensor, plugin_class_for

H, V, NH, NKV, HD, FF = 32, 48, 4, 2, 8, 40
E, FE, FS = 4, 12, 16
DK = DV = 8
K_CONV = 4


def text_config(*, moe: bool = False, n_layer: int = 4, nk: int = 2, nv: int = 6, mtp: int | None = 1,
                layer_types: list[str] | None = None) -> dict:
    arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    cfg = dict(
        architectures=[arch], model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        vocab_size=V, hidden_size=H, num_hidden_layers=n_layer, num_attention_heads=NH,
        num_key_value_heads=NKV, head_dim=HD, linear_conv_kernel_dim=K_CONV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_num_key_heads=nk, linear_num_value_heads=nv,
        layer_types=layer_types or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                    for i in range(n_layer)],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        # head_dim 8 * 0.5 = 4 rotary dims -> sections must sum to 2
        rope_parameters=dict(rope_type="default", rope_theta=5e5, partial_rotary_factor=0.5, mrope_section=[1, 1, 0]),
    )
    if mtp is not None:
        cfg["mtp_num_hidden_layers"] = mtp
    if moe:
        cfg.update(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=FE, shared_expert_intermediate_size=FS)
    else:
        cfg["intermediate_size"] = FF
    return cfg


def hf_shapes(cfg: dict, *, n_mtp: int = 1, experts: str = "fused") -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes, save_pretrained naming (model.*, mtp.*)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    C = 2 * nk * DK + nv * DV
    moe = "num_experts" in cfg
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                                       "lm_head.weight": (V, H)}

    def block(p: str, linear: bool) -> None:
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if linear:
            a = p + "linear_attn."
            out.update({a + "in_proj_qkv.weight": (C, H), a + "in_proj_z.weight": (nv * DV, H),
                        a + "in_proj_b.weight": (nv, H), a + "in_proj_a.weight": (nv, H), a + "A_log": (nv,),
                        a + "dt_bias": (nv,), a + "conv1d.weight": (C, 1, K_CONV), a + "norm.weight": (DV,),
                        a + "out_proj.weight": (H, nv * DV)})
        else:
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (2 * NH * HD, H), a + "k_proj.weight": (NKV * HD, H),
                        a + "v_proj.weight": (NKV * HD, H), a + "o_proj.weight": (H, NH * HD),
                        a + "q_norm.weight": (HD,), a + "k_norm.weight": (HD,)})
        m = p + "mlp."
        if not moe:
            out.update({m + "gate_proj.weight": (FF, H), m + "up_proj.weight": (FF, H), m + "down_proj.weight": (H, FF)})
            return
        out.update({m + "gate.weight": (E, H), m + "shared_expert.gate_proj.weight": (FS, H),
                    m + "shared_expert.up_proj.weight": (FS, H), m + "shared_expert.down_proj.weight": (H, FS),
                    m + "shared_expert_gate.weight": (1, H)})
        if experts == "fused":
            out.update({m + "experts.gate_up_proj": (E, 2 * FE, H), m + "experts.down_proj": (E, H, FE)})
        else:
            for e in range(E):
                out.update({f"{m}experts.{e}.gate_proj.weight": (FE, H), f"{m}experts.{e}.up_proj.weight": (FE, H),
                            f"{m}experts.{e}.down_proj.weight": (H, FE)})

    for i, t in enumerate(cfg["layer_types"]):
        block(f"model.layers.{i}.", t == "linear_attention")
    if n_mtp:
        out.update({"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
                    "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)})
        for j in range(n_mtp):
            block(f"mtp.layers.{j}.", False)
    return out


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        t = torch.randn(shapes[name], generator=gen) / (shapes[name][-1] ** 0.5 if len(shapes[name]) > 1 else 4)
        if name.endswith("A_log"):
            t = torch.log(torch.empty(shapes[name]).uniform_(1.0, 8.0, generator=gen))
        out[name] = t
    return out


def fused_to_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """[E,2Fe,H] gate_up (gate rows first) / [E,H,Fe] down -> per-expert matrices, by slicing."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, fe = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :fe].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, fe:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def checkpoint(cfg: dict, tensors: dict[str, torch.Tensor], dtypes: dict[str, str] | None = None) -> Checkpoint:
    """Normalise names exactly as the engine does and build the plugin's view of the checkpoint."""
    cls = plugin_class_for(cfg)
    headers, skipped = {}, {}
    for raw, t in tensors.items():
        name = cls.normalize_name(raw)
        if isinstance(name, tuple):
            skipped[raw] = name[1]
            continue
        headers[name] = SourceTensor(name, tuple(t.shape), (dtypes or {}).get(raw, "F32"))
    return Checkpoint(cfg, headers, skipped)


def plugin(cfg: dict, tensors: dict[str, torch.Tensor], **kw):
    return plugin_class_for(cfg)(checkpoint(cfg, tensors, **kw))


def normalised(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cls = plugin_class_for(cfg)
    out = {}
    for raw, t in tensors.items():
        name = cls.normalize_name(raw)
        if not isinstance(name, tuple):
            out[name] = t
    return out


def convert(p, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run every plan's transform on the (normalised) source tensors, checking the promised shape."""
    src = normalised(p.checkpoint.config, tensors)
    out = {}
    for plan in p.tensor_plan():
        t = torch.from_numpy(np.array(plan.transform([src[s].float().numpy() for s in plan.sources])))
        assert tuple(t.shape) == plan.shape, (plan.name, tuple(t.shape), plan.shape)
        out[plan.name] = t
    return out


def dense(nk=2, nv=6, **kw):
    cfg = text_config(nk=nk, nv=nv, **kw)
    return cfg, random_tensors(hf_shapes(cfg))


def moe(experts="fused", **kw):
    cfg = text_config(moe=True, **kw)
    return cfg, random_tensors(hf_shapes(cfg, experts=experts))


def kv_dict(p, keep_mtp=True):
    return {m.key: (m.value, m.vtype, m.sub_type) for m in p.metadata(keep_mtp)}


def plugin_from_dir(model_dir: Path, header_order: bool = False):
    """A fixture checkpoint directory (single model.safetensors) -> (plugin, normalised tensors).

    header_order: keep the tensors in the order of the file's JSON header (as llama.cpp reads them).
    """
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    raw = load_file(str(path))
    if header_order:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        raw = {name: raw[name] for name in header if name != "__metadata__"}
    return plugin(cfg, raw), normalised(cfg, raw)
