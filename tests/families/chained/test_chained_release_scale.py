"""The chained-MTP plugins on release-size checkpoints given as tensor headers only (names and shapes
from transformers' own modules on the meta device, the release's names, per-expert or stacked
experts as the releases store them): Hy3-preview, Step-3.5-Flash and MiMo-V2-Flash dimensions
(transformers' config defaults, which are those releases'). Nothing is allocated; the plans and the
metadata must come out with the release's counts and sizes.
"""

from __future__ import annotations

import pytest
import torch

from specconv.archs.base import Checkpoint, SourceTensor
from specconv.archs.hy_v3 import HyV3
from specconv.archs.mimo2 import MiMo2
from specconv.archs.step35 import Step35
from tests.fixtures import tiny_chained as tiny

torch.set_num_threads(1)


def _headers(fam, cfg_json: dict, k: int) -> dict[str, tuple]:
    from transformers.modeling_layers import MtpLayer

    _, layer_cls, norm_cls = fam.classes()
    n = cfg_json["num_hidden_layers"]
    with torch.device("meta"):
        main = fam.make_main(fam.hf_config(cfg_json))
        state = dict(main.state_dict())
        for j in range(k):
            layer = MtpLayer(fam.hf_config(cfg_json, k), layer_cls, norm_cls, n + j, use_post_norm=True)
            for name, t in layer.state_dict().items():
                rel = name[len("mtp_block."):] if name.startswith("mtp_block.") else (
                    fam.post_norm_release + name[len("post_norm"):] if name.startswith("post_norm.") else name)
                state[tiny.mtp_prefix(fam, n, j) + rel] = t
            for extra in fam.mtp_extras:
                state[f"{tiny.mtp_prefix(fam, n, j)}{extra}.weight"] = state["lm_head.weight"]
    return {name: tuple(t.shape) for name, t in fam.to_release(state).items()}


def _plugin(cls, fam, cfg_json, k):
    tensors = {}
    for raw, shape in _headers(fam, cfg_json, k).items():
        name = cls.normalize_name(raw)
        tensors[name] = SourceTensor(name, shape, "BF16")
    return cls(Checkpoint(cfg_json, tensors))


@pytest.mark.slow
def test_hy3_preview_dimensions():
    from transformers import HYV3Config

    cfg = HYV3Config().to_dict()  # 80 layers, 192 experts (top 8), head_dim 128, 64 / 8 heads
    cfg.update(architectures=["HYV3ForCausalLM"], num_nextn_predict_layers=1)
    p = _plugin(HyV3, tiny.HyV3, cfg, 1)
    plans = {t.name: t for t in p.tensor_plan()}
    kv = {m.key: m.value for m in p.metadata(True)}
    assert kv["hy_v3.block_count"] == 81 and kv["hy_v3.nextn_predict_layers"] == 1
    assert kv["hy_v3.expert_count"] == 192 and kv["hy_v3.expert_shared_feed_forward_length"] == 1536
    assert plans["blk.80.ffn_gate_exps.weight"].shape == (192, 1536, 4096)
    assert plans["blk.80.nextn.eh_proj.weight"].shape == (4096, 8192)
    assert "blk.0.ffn_gate.weight" in plans and "blk.1.ffn_gate_inp.weight" in plans
    print(f"Hy3-preview headers: {len(plans)} tensors")


@pytest.mark.slow
def test_step35_flash_dimensions():
    from transformers import Step3p7TextConfig

    cfg = Step3p7TextConfig(num_nextn_predict_layers=3).to_dict()  # transformers' own field names
    for field in ("layer_types", "mlp_layer_types"):  # per-layer lists over N + k, as the release lists them
        cfg[field] = list(cfg[field]) + list(cfg.pop("mtp_" + field))
    cfg["architectures"] = ["Step3p5ForCausalLM"]
    p = _plugin(Step35, tiny.Step35, cfg, 3)
    plans = {t.name: t for t in p.tensor_plan()}
    kv = {m.key: m.value for m in p.metadata(True)}
    assert kv["step35.block_count"] == 48 and kv["step35.nextn_predict_layers"] == 3
    assert kv["step35.expert_count"] == 288 and len(kv["step35.attention.head_count"]) == 48
    assert plans["blk.47.nextn.shared_head_head.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    print(f"Step-3.5-Flash headers: {len(plans)} tensors")


@pytest.mark.slow
def test_mimo_v2_flash_dimensions():
    cfg = tiny.MiMo2.config_json(3)
    pattern = [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)]  # the release's hybrid_layer_pattern
    cfg.update(num_hidden_layers=48, hidden_size=4096, intermediate_size=16384, vocab_size=152576,
               num_attention_heads=64, num_key_value_heads=4, swa_num_attention_heads=64, swa_num_key_value_heads=8,
               head_dim=192, v_head_dim=128, swa_head_dim=192, swa_v_head_dim=128, hybrid_layer_pattern=pattern,
               moe_layer_freq=[0] + [1] * 47, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
               n_group=1, topk_group=1, sliding_window=128, sliding_window_size=128, rope_theta=5e6,
               swa_rope_theta=1e4)
    p = _plugin(MiMo2, tiny.MiMo2, cfg, 3)
    plans = {t.name: t for t in p.tensor_plan()}
    kv = {m.key: m.value for m in p.metadata(True)}
    assert kv["mimo2.block_count"] == 51 and kv["mimo2.nextn_predict_layers"] == 3
    assert kv["mimo2.rope.dimension_count"] == 64 and kv["mimo2.attention.sliding_window"] == 129
    assert plans["blk.48.attn_qkv.weight"].shape == (64 * 192 + 8 * 192 + 8 * 128, 4096)
    assert plans["blk.1.ffn_gate_exps.weight"].shape == (256, 2048, 4096)
    print(f"MiMo-V2-Flash headers: {len(plans)} tensors")
