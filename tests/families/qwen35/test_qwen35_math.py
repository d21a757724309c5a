"""The qwen35 transforms keep the model function: transformers' own modules on the HF weights vs
the GGUF-convention computation (docs/reference/model-math.md §2.2, §3.1, written here from the reference) on the
converted tensors. A broken re-tiling, a missing -exp, a swapped gate/up half or a wrong +1 shows up
as a large difference; each test also shows that the check is sensitive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.fixtures.qwen35_synth import (DK, DV, H, convert, hf_shapes, plugin, plugin_from_dir, random_tensors,
                                     text_config)
from tests.fixtures.tiny_qwen35 import build_qwen35


def gdn_gguf(x: torch.Tensor, w: dict[str, torch.Tensor], b: int, nk: int, nv: int, eps: float) -> torch.Tensor:
    """Gated DeltaNet in GGUF order: value head n uses key head n mod nk (docs/reference/model-math.md §2.2)."""
    T = x.shape[0]
    m = x @ w[f"blk.{b}.attn_qkv.weight"].T  # [T, C]
    z = (x @ w[f"blk.{b}.attn_gate.weight"].T).view(T, nv, DV)
    beta = torch.sigmoid(x @ w[f"blk.{b}.ssm_beta.weight"].T)
    alpha = x @ w[f"blk.{b}.ssm_alpha.weight"].T
    conv = w[f"blk.{b}.ssm_conv1d.weight"]  # [C, K]
    K = conv.shape[1]
    padded = torch.cat([torch.zeros(K - 1, m.shape[1]), m])
    c = F.silu(torch.stack([(padded[t:t + K].T * conv).sum(-1) for t in range(T)]))
    q, k, v = c.split([nk * DK, nk * DK, nv * DV], dim=-1)
    q = q.view(T, nk, DK)
    k = k.view(T, nk, DK)
    v = v.view(T, nv, DV)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * DK ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = w[f"blk.{b}.ssm_a"] * F.softplus(alpha + w[f"blk.{b}.ssm_dt.bias"])
    o = torch.zeros(T, nv, DV)
    for n in range(nv):
        kh = n % nk
        S = torch.zeros(DK, DV)
        for t in range(T):
            S = torch.exp(g[t, n]) * S
            u = S.T @ k[t, kh]
            S = S + torch.outer(k[t, kh], beta[t, n] * (v[t, n] - u))
            o[t, n] = S.T @ q[t, kh]
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w[f"blk.{b}.ssm_norm.weight"] * F.silu(z)
    return y.reshape(T, nv * DV) @ w[f"blk.{b}.ssm_out.weight"].T


def hf_gdn(cfg: dict, tensors: dict[str, torch.Tensor], layer: int):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    tc = Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    mod = Qwen3_5GatedDeltaNet(tc, layer).eval()
    prefix = f"model.layers.{layer}.linear_attn."
    mod.load_state_dict({n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
    return mod


def _gdn_case(nk: int, nv: int, seed: int):
    cfg = text_config(nk=nk, nv=nv)
    tensors = random_tensors(hf_shapes(cfg), seed=seed)
    out = convert(plugin(cfg, tensors), tensors)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref = hf_gdn(cfg, tensors, 1)(x[None])[0]
    return cfg, tensors, out, x, ref


def test_gated_deltanet_hf_order_equals_gguf_order():
    for nk, nv in ((2, 6), (3, 6), (4, 4)):
        cfg, tensors, out, x, ref = _gdn_case(nk, nv, seed=nk * 10 + nv)
        got = gdn_gguf(x, out, 1, nk, nv, cfg["rms_norm_eps"])
        diff = (got - ref).abs().max().item()
        print(f"GDN nk={nk} nv={nv}: max |HF - GGUF-order| = {diff:.2e} (output scale {ref.abs().max():.2f})")
        assert diff < 1e-4


def test_gated_deltanet_check_is_sensitive_to_missing_retiling():
    nk, nv = 2, 6
    cfg, tensors, out, x, ref = _gdn_case(nk, nv, seed=5)
    a = "model.layers.1.linear_attn."
    # The plain renames and -exp / squeeze, but V heads left in HF grouped order:
    naive = dict(out)
    naive.update({"blk.1.attn_qkv.weight": tensors[a + "in_proj_qkv.weight"],
                  "blk.1.attn_gate.weight": tensors[a + "in_proj_z.weight"],
                  "blk.1.ssm_beta.weight": tensors[a + "in_proj_b.weight"],
                  "blk.1.ssm_alpha.weight": tensors[a + "in_proj_a.weight"],
                  "blk.1.ssm_a": -torch.exp(tensors[a + "A_log"]), "blk.1.ssm_dt.bias": tensors[a + "dt_bias"],
                  "blk.1.ssm_conv1d.weight": tensors[a + "conv1d.weight"][:, 0],
                  "blk.1.ssm_out.weight": tensors[a + "out_proj.weight"]})
    diff = (gdn_gguf(x, naive, 1, nk, nv, cfg["rms_norm_eps"]) - ref).abs().max().item()
    print(f"GDN without re-tiling: max |HF - GGUF-order| = {diff:.2e}")
    assert diff > 1e-2


def moe_gguf(x: torch.Tensor, w: dict[str, torch.Tensor], b: int, top_k: int) -> torch.Tensor:
    """docs/reference/model-math.md §3.1 on the GGUF tensors: softmax router, renormalised top-k, gated shared expert."""
    p = torch.softmax(x @ w[f"blk.{b}.ffn_gate_inp.weight"].T, dim=-1)
    top, idx = torch.topk(p, top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = idx[t, j]
            h = F.silu(w[f"blk.{b}.ffn_gate_exps.weight"][e] @ x[t]) * (w[f"blk.{b}.ffn_up_exps.weight"][e] @ x[t])
            y[t] += top[t, j] * (w[f"blk.{b}.ffn_down_exps.weight"][e] @ h)
    shared = (F.silu(x @ w[f"blk.{b}.ffn_gate_shexp.weight"].T) * (x @ w[f"blk.{b}.ffn_up_shexp.weight"].T)) \
        @ w[f"blk.{b}.ffn_down_shexp.weight"].T
    gate = torch.sigmoid(x @ w[f"blk.{b}.ffn_gate_inp_shexp.weight"].reshape(1, H).T)
    return y + gate * shared


def test_moe_block_hf_equals_gguf():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = text_config(moe=True)
    tensors = random_tensors(hf_shapes(cfg, experts="fused"), seed=3)
    out = convert(plugin(cfg, tensors), tensors)
    tc = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    for b, prefix in ((2, "model.layers.2.mlp."), (4, "mtp.layers.0.mlp.")):
        block = Qwen3_5MoeSparseMoeBlock(tc).eval()
        block.load_state_dict({n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
        with torch.no_grad():
            ref = block(x[None])[0]
        diff = (moe_gguf(x, out, b, cfg["num_experts_per_tok"]) - ref).abs().max().item()
        print(f"MoE block {b}: max |HF - GGUF| = {diff:.2e}")
        assert diff < 1e-5
    swapped = dict(out)
    swapped["blk.2.ffn_gate_exps.weight"], swapped["blk.2.ffn_up_exps.weight"] = \
        out["blk.2.ffn_up_exps.weight"], out["blk.2.ffn_gate_exps.weight"]
    block = Qwen3_5MoeSparseMoeBlock(tc).eval()
    block.load_state_dict({n[len("model.layers.2.mlp."):]: t for n, t in tensors.items()
                           if n.startswith("model.layers.2.mlp.")})
    with torch.no_grad():
        assert (moe_gguf(x, swapped, 2, 2) - block(x[None])[0]).abs().max() > 1e-3  # gate/up order matters


def test_zero_centred_norms_match_hf_rmsnorm():
    """HF Qwen3_5RMSNorm multiplies by (1 + w); the GGUF weight is used plainly (docs/reference/model-math.md §1.1)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    cfg = text_config()
    tensors = random_tensors(hf_shapes(cfg), seed=7)
    out = convert(plugin(cfg, tensors), tensors)
    x = torch.randn(5, H)
    for gguf_name, hf_name in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.4.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
                               ("output_norm.weight", "model.norm.weight")):
        norm = Qwen3_5RMSNorm(H, eps=cfg["rms_norm_eps"])
        norm.weight.data.copy_(tensors[hf_name])
        plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * out[gguf_name]
        with torch.no_grad():
            assert (plain - norm(x)).abs().max() < 1e-5, gguf_name


def test_fixture_checkpoints_release_and_save_pretrained_convert_identically(tmp_path):
    """Real tiny checkpoints (tests/fixtures): VL release layout (nested config, fused experts, towers)
    and save_pretrained layout (flat config, per-expert tensors) of the same weights."""
    for moe in (False, True):
        a, ta = plugin_from_dir(build_qwen35(tmp_path / f"sp{moe}", moe=moe, layout="save_pretrained"))
        b, tb = plugin_from_dir(build_qwen35(tmp_path / f"rel{moe}", moe=moe, layout="release"))
        c, tc = plugin_from_dir(build_qwen35(tmp_path / f"nm{moe}", moe=moe, mtp_in_config=False))
        assert len(b.checkpoint.skipped) == 3 and not a.checkpoint.skipped  # the model.visual.* tensors
        assert a.n_mtp_layers == b.n_mtp_layers == c.n_mtp_layers == 1
        for keep in (True, False):
            assert a.metadata(keep) == b.metadata(keep) == c.metadata(keep)
        out_a, out_b = convert(a, ta), convert(b, tb)
        assert out_a.keys() == out_b.keys() and len(out_a) == (96 if moe else 71)
        assert all(torch.equal(out_a[n], out_b[n]) for n in out_a)
