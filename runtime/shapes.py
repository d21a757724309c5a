"""The shape each graph expects of each tensor, from its hparams (ggml order, ne0 first, as GGUF
stores it and llama.cpp's `create_tensor` checks it), and the per-family consistency checks.

A dimension given as a string is a size the file chooses (the vocabulary "V", the EAGLE-3 draft
vocabulary "Vd", Gemma's per-layer vocabulary "Vp"): the first tensor that has it binds it and
every other must agree. Trailing dimensions count: the graphs index by them (a shape may list the
alternatives a graph accepts).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from specconv.archs.errors import SpecconvError

Shapes = dict[str, tuple]
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _common(hp, E: int) -> Shapes:
    return {"token_embd.weight": (E, "V"), "output.weight": (E, "V"), "output_norm.weight": (E,)}


def _nextn(E: int, n: int) -> Shapes:
    p = f"blk.{n}.nextn."
    return {p + "eh_proj.weight": (2 * E, E), p + "enorm.weight": (E,), p + "hnorm.weight": (E,),
            p + "shared_head_norm.weight": (E,), p + "embed_tokens.weight": (E, "V"),
            p + "shared_head_head.weight": (E, "V")}


def _dense_ffn(p: str, E: int, F: int) -> Shapes:
    return {p + "ffn_gate.weight": (E, F), p + "ffn_up.weight": (E, F), p + "ffn_down.weight": (F, E)}


def _experts(p: str, E: int, Fe: int, X: int) -> Shapes:
    return {p + "ffn_gate_inp.weight": (E, X), p + "ffn_gate_exps.weight": (E, Fe, X),
            p + "ffn_up_exps.weight": (E, Fe, X), p + "ffn_down_exps.weight": (Fe, E, X)}


def _gqa(p: str, E_in: int, E: int, nh: int, nkv: int, hd: int, q_mult: int = 1) -> Shapes:
    return {p + "attn_q.weight": (E_in, q_mult * nh * hd), p + "attn_k.weight": (E_in, nkv * hd),
            p + "attn_v.weight": (E_in, nkv * hd), p + "attn_output.weight": (nh * hd, E)}


def gemma4(hp) -> Shapes:
    E, out = hp.n_embd, _common(hp, hp.n_embd)
    N, P, nh = hp.n_layer, hp.n_per_layer, hp.n_head
    full = [hp.head_dim[i] for i in range(len(hp.is_swa)) if not hp.is_swa[i]]
    if full:
        out["rope_freqs.weight"] = (full[0] // 2,)
    if P:
        out.update({"per_layer_token_embd.weight": (N * P, "Vp"), "per_layer_model_proj.weight": (E, N * P),
                    "per_layer_proj_norm.weight": (P,)})
    for i in range(hp.n_blocks):
        p, hd, nkv, F = f"blk.{i}.", hp.head_dim[i], hp.n_head_kv[i], hp.n_ff[i]
        out.update(_gqa(p, E, E, nh, nkv, hd))
        out.update(_dense_ffn(p, E, F))
        out.update({p + n: (E,) for n in ("attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
                                          "post_ffw_norm.weight", "post_norm.weight", "pre_ffw_norm_2.weight",
                                          "post_ffw_norm_1.weight", "post_ffw_norm_2.weight")})
        out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,), p + "layer_output_scale.weight": (1,),
                    p + "inp_gate.weight": (E, P), p + "proj.weight": (P, E)})
        if hp.n_expert:
            X, Fe = hp.n_expert, hp.n_ff_exp
            out.update(_experts(p, E, Fe, X))
            out.update({p + "ffn_gate_up_exps.weight": (E, 2 * Fe, X), p + "ffn_gate_inp.scale": (E,),
                        p + "ffn_down_exps.scale": (X,)})
    if hp.arch == "gemma4-assistant":
        Eo = hp.n_embd_out
        out.update({"nextn.pre_projection.weight": (2 * Eo, E), "nextn.post_projection.weight": (E, Eo)})
    return out


# The families not yet on a tensor table; the others' graphs declare `expected_shapes`, derived from
# their table (archs/tensor_table.py).
EXPECTED: dict[str, Callable[[Any], Shapes]] = {
    "gemma4": gemma4, "gemma4-assistant": gemma4,
}


def expected_shapes(hp, graph) -> Shapes:
    """From the graph's tensor table when it declares one (runtime/graphs/contract.py), else EXPECTED."""
    return graph.expected_shapes(hp) if graph.expected_shapes is not None else EXPECTED[hp.arch](hp)


# ---- per-family consistency --------------------------------------------------------------------

def check_arch_hparams(hp, kv: Mapping[str, Any]) -> None:
    a = hp.arch
    block_count = hp.n_layer + getattr(hp, "n_nextn", 0)
    for key in ("attention.recurrent_layers", "attention.sliding_window_pattern"):
        v = kv.get(f"{a}.{key}")
        if isinstance(v, list) and len(v) != block_count:
            raise SpecconvError(f"{a}.{key} has {len(v)} entries for block_count {block_count}")
    if a in ("gemma4", "gemma4-assistant"):
        if hp.n_rot_swa % 2 or any(hp.n_rot_swa > d for d, s in zip(hp.head_dim, hp.is_swa) if s):
            raise SpecconvError(f"{a}.rope.dimension_count_swa {hp.n_rot_swa} must be even and at most the "
                                f"sliding head size")
        if any(d % 2 for d in hp.head_dim):
            raise SpecconvError(f"{a}: head sizes {sorted(set(hp.head_dim))} must be even (rope)")
        if hp.n_layer and hp.n_shared > hp.n_layer:
            raise SpecconvError(f"{a}.attention.shared_kv_layers {hp.n_shared} exceeds the {hp.n_layer} layers")
        if hp.n_expert and not hp.n_ff_exp:
            raise SpecconvError(f"{a}.expert_feed_forward_length is missing")
    if a in _families.ARCH_HPARAMS:
        _families.ARCH_HPARAMS[a](hp)


def _gemma4_values(file, hp, needed) -> None:
    """Per-layer embeddings cover every token id (llama.cpp keeps their own, longer vocabulary), and an
    MoE layer has its gate and up experts, fused or split (both optional by name)."""
    ple, embd = file.tensors.get("per_layer_token_embd.weight"), file.tensors.get("token_embd.weight")
    if "per_layer_token_embd.weight" in needed and ple is not None and embd is not None \
            and ple.shape[-1] < embd.shape[-1]:
        raise SpecconvError(f"tensor per_layer_token_embd.weight has {ple.shape[-1]} rows, fewer than the "
                            f"{embd.shape[-1]} tokens of token_embd.weight")
    for i in range(hp.n_layer if hp.n_expert else 0):
        p = f"blk.{i}."
        if p + "ffn_gate_up_exps.weight" not in needed and not (
                p + "ffn_gate_exps.weight" in needed and p + "ffn_up_exps.weight" in needed):
            raise SpecconvError(f"missing tensor {p}ffn_gate_up_exps.weight (or {p}ffn_gate_exps.weight and "
                                f"{p}ffn_up_exps.weight)")


CHECK_VALUES = {"gemma4": _gemma4_values}


# the families added later (hy_v3, step35, mimo2, glm-dsa / deepseek32, dflash); imported last, as it
# builds on the helpers above
from specconv.runtime import shapes_families as _families  # noqa: E402

EXPECTED.update(_families.EXPECTED)
CHECK_VALUES.update(_families.CHECK_VALUES)
