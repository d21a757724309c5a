"""The reference tables of docs/reference/gguf-layout.md (§1, §2, §3, §4.2, §7.1, §7.2), written out for the tiny
fixture's config, so converted files are checked against the reference and not against the plugin.

Shapes are in ggml order ({ne0, ne1, ...}), as the tables and GGUFReader show them.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q, GGUFValueType as VT

# tests/fixtures/tiny_qwen35.py: text_config_kwargs with its defaults (nk=2, nv=4, 4 layers)
H, V, NH, NKV, HD = 64, 512, 4, 2, 16
NK, NV, DK, DV, K_CONV = 2, 4, 16, 16, 4
F, E, FE, FS = 128, 4, 32, 32
N, K = 4, 1
LAYER_IS_LINEAR = [True, True, True, False]  # 3:1, last trunk layer full attention
ROPE_THETA = 1000.0

OUTTYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
           "auto": Q.F16}  # auto: the first matrix of the (float32) fixture is F32 -> F16 (§2 item 4)
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "auto": 1}  # gguf.LlamaFileType values

W, F32 = "w", "f32"  # "w": follows --outtype; "f32": forced F32


def _attention(b: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        f"blk.{b}.attn_q.weight": ((H, 2 * NH * HD), W),
        f"blk.{b}.attn_k.weight": ((H, NKV * HD), W),
        f"blk.{b}.attn_v.weight": ((H, NKV * HD), W),
        f"blk.{b}.attn_output.weight": ((NH * HD, H), W),
        f"blk.{b}.attn_q_norm.weight": ((HD,), F32),
        f"blk.{b}.attn_k_norm.weight": ((HD,), F32),
    }


def _gated_delta_net(b: int) -> dict[str, tuple[tuple[int, ...], str]]:
    c = 2 * NK * DK + NV * DV
    return {
        f"blk.{b}.attn_qkv.weight": ((H, c), W),
        f"blk.{b}.attn_gate.weight": ((H, NV * DV), W),
        f"blk.{b}.ssm_beta.weight": ((H, NV), W),
        f"blk.{b}.ssm_alpha.weight": ((H, NV), W),
        f"blk.{b}.ssm_a": ((NV,), F32),
        f"blk.{b}.ssm_dt.bias": ((NV,), F32),
        f"blk.{b}.ssm_conv1d.weight": ((K_CONV, c), F32),
        f"blk.{b}.ssm_norm.weight": ((DV,), F32),
        f"blk.{b}.ssm_out.weight": ((NV * DV, H), W),
    }


def _ffn(b: int, moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    if not moe:
        return {f"blk.{b}.ffn_gate.weight": ((H, F), W), f"blk.{b}.ffn_up.weight": ((H, F), W),
                f"blk.{b}.ffn_down.weight": ((F, H), W)}
    return {
        f"blk.{b}.ffn_gate_inp.weight": ((H, E), F32),
        f"blk.{b}.ffn_gate_exps.weight": ((H, FE, E), W),
        f"blk.{b}.ffn_up_exps.weight": ((H, FE, E), W),
        f"blk.{b}.ffn_down_exps.weight": ((FE, H, E), W),
        f"blk.{b}.ffn_gate_shexp.weight": ((H, FS), W),
        f"blk.{b}.ffn_up_shexp.weight": ((H, FS), W),
        f"blk.{b}.ffn_down_shexp.weight": ((FS, H), W),
        f"blk.{b}.ffn_gate_inp_shexp.weight": ((H, 1), F32),
    }


def _block(b: int, linear: bool, moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {f"blk.{b}.attn_norm.weight": ((H,), F32), f"blk.{b}.post_attention_norm.weight": ((H,), F32)}
    out.update(_gated_delta_net(b) if linear else _attention(b))
    out.update(_ffn(b, moe))
    return out


def shared_tensors() -> dict[str, tuple[tuple[int, ...], str]]:
    return {"token_embd.weight": ((H, V), W), "output_norm.weight": ((H,), F32), "output.weight": ((H, V), W)}


def trunk_tensors(moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for b in range(N):
        out.update(_block(b, LAYER_IS_LINEAR[b], moe))
    return out


def mtp_tensors(moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {f"blk.{N}.nextn.eh_proj.weight": ((2 * H, H), W), f"blk.{N}.nextn.enorm.weight": ((H,), F32),
           f"blk.{N}.nextn.hnorm.weight": ((H,), F32), f"blk.{N}.nextn.shared_head_norm.weight": ((H,), F32)}
    out.update(_block(N, linear=False, moe=moe))  # the MTP block: full attention, the model's FFN kind
    return out


def expected_tensors(kind: str, moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """kind: embedded | trunk | sidecar (§4.2)."""
    out = dict(shared_tensors())
    if kind in ("embedded", "trunk"):
        out.update(trunk_tensors(moe))
    if kind in ("embedded", "sidecar"):
        out.update(mtp_tensors(moe))
    return out


def expected_type(rule: str, outtype: str) -> Q:
    return Q.F32 if rule == F32 else OUTTYPE[outtype]


def expected_arch_kv(kind: str, moe: bool) -> dict[str, tuple[object, VT]]:
    """§7.1 / §7.2 KV for the fixture: key (without arch prefix) -> (value, GGUF type)."""
    keep = kind != "trunk"
    u32 = VT.UINT32
    kv = {
        "block_count": (N + K if keep else N, u32),
        "context_length": (4096, u32),
        "embedding_length": (H, u32),
        "attention.head_count": (NH, u32),
        "attention.head_count_kv": (NKV, u32),
        "attention.key_length": (HD, u32),
        "attention.value_length": (HD, u32),
        "attention.layer_norm_rms_epsilon": (1e-6, VT.FLOAT32),
        "rope.freq_base": (ROPE_THETA, VT.FLOAT32),
        "rope.dimension_count": (int(HD * 0.25), u32),
        "rope.dimension_sections": ([1, 1, 0, 0], VT.INT32),  # mrope_section [1,1,0] padded; sums to rot/2
        "ssm.conv_kernel": (K_CONV, u32),
        "ssm.state_size": (DK, u32),
        "ssm.group_count": (NK, u32),
        "ssm.time_step_rank": (NV, u32),
        "ssm.inner_size": (NV * DV, u32),
        "attention.recurrent_layers": (LAYER_IS_LINEAR + ([False] * K if keep else []), VT.BOOL),
        "full_attention_interval": (4, u32),
    }
    if keep:
        kv["nextn_predict_layers"] = (K, u32)
    if moe:
        kv.update({"expert_count": (E, u32), "expert_used_count": (2, u32),
                   "expert_feed_forward_length": (FE, u32), "expert_shared_feed_forward_length": (FS, u32)})
    else:
        kv["feed_forward_length"] = (F, u32)
    return kv


ABSENT_ARCH_KEYS = {  # keys that must not be written
    "trunk": ["nextn_predict_layers"],
}
