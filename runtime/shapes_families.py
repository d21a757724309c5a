"""Expected tensor shapes and consistency checks of the families added after runtime/shapes.py's first
set: hy_v3, step35, mimo2 (blocks that are dense or routed by which tensors the file holds) and the
DFlash / DFlash2 drafters.

Shapes are in ggml order (ne0 first). A string dimension is a size the file chooses and every tensor
naming it must agree (runtime/shapes.py): these graphs read widths such as the dense or expert FFN
width from the tensors, not from KV, so they are bound per block ("F3", "Fe3", "X3"). The value
checks (`CHECK_VALUES`) require what a graph indexes without a name check of its own: a block is
either a whole dense FFN or a whole routed one, and the routing's top-k and groups fit its experts.
"""

from __future__ import annotations

from specconv.archs.errors import SpecconvError

Shapes = dict[str, tuple]


def _base():
    """runtime/shapes.py, which imports this module at its end to register it (so not imported at the top)."""
    from specconv.runtime import shapes

    return shapes


def _ffn(p: str, E: int, i: int, X, bias: str, shared: bool) -> Shapes:
    """Both the dense and the routed tensors of block i (the file holds one set; `_check_ffn` decides)."""
    out = {p + "ffn_gate.weight": (E, f"F{i}"), p + "ffn_up.weight": (E, f"F{i}"), p + "ffn_down.weight": (f"F{i}", E),
           p + "ffn_gate_inp.weight": (E, X), p + "ffn_gate_exps.weight": (E, f"Fe{i}", X),
           p + "ffn_up_exps.weight": (E, f"Fe{i}", X), p + "ffn_down_exps.weight": (f"Fe{i}", E, X), p + bias: (X,)}
    if shared:
        out.update({p + "ffn_gate_shexp.weight": (E, f"Fs{i}"), p + "ffn_up_shexp.weight": (E, f"Fs{i}"),
                    p + "ffn_down_shexp.weight": (f"Fs{i}", E)})
    return out


def _blocks(hp):
    return range(hp.n_layer + hp.n_nextn)


def _head(hp) -> Shapes:
    out = _base()._common(hp, hp.n_embd)
    for n in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        out.update(_base()._nextn(hp.n_embd, n))
    return out


def hy_v3(hp) -> Shapes:
    E, nh, nkv, hd = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    out = _head(hp)
    for i in _blocks(hp):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,), p + "attn_q.weight": (E, nh * hd),
                    p + "attn_k.weight": (E, nkv * hd), p + "attn_v.weight": (E, nkv * hd),
                    p + "attn_output.weight": (nh * hd, E), p + "attn_q_norm.weight": (hd,),
                    p + "attn_k_norm.weight": (hd,)})
        out.update(_ffn(p, E, i, hp.n_expert or f"X{i}", "exp_probs_b", shared=True))
    return out


def step35(hp) -> Shapes:
    E, hd = hp.n_embd, hp.head_dim
    out = _head(hp)
    for i in _blocks(hp):
        p, nh, nkv = f"blk.{i}.", hp.n_heads[i], hp.n_kvs[i]
        out.update({p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,), p + "attn_q.weight": (E, nh * hd),
                    p + "attn_k.weight": (E, nkv * hd), p + "attn_v.weight": (E, nkv * hd),
                    p + "attn_output.weight": (nh * hd, E), p + "attn_q_norm.weight": (hd,),
                    p + "attn_k_norm.weight": (hd,), p + "attn_gate.weight": (E, nh)})
        out.update(_ffn(p, E, i, f"X{i}", "exp_probs_b.bias", shared=True))
    return out


def mimo2(hp) -> Shapes:
    E, nh, dk, dv = hp.n_embd, hp.n_head, hp.head_dim, hp.v_head_dim
    out = _head(hp)
    for i in _blocks(hp):
        p, nkv = f"blk.{i}.", hp.n_kvs[i]
        out.update({p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,), p + "attn_q.weight": (E, nh * dk),
                    p + "attn_k.weight": (E, nkv * dk), p + "attn_v.weight": (E, nkv * dv),
                    p + "attn_qkv.weight": (E, nh * dk + nkv * (dk + dv)), p + "attn_output.weight": (nh * dv, E),
                    p + "attn_sinks.weight": (nh,), p + "layer_output_norm.weight": (E,)})
        out.update(_ffn(p, E, i, f"X{i}", "exp_probs_b.bias", shared=False))
    return out


def dflash(hp) -> Shapes:
    """The drafter's own tensors; token_embd / output (own or the target's) span the vocabulary V."""
    E, nh, nkv, hd, F = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff
    out = {"fc.weight": (hp.n_embd_in, E), "enc.output_norm.weight": (E,), "output_norm.weight": (E,),
           "token_embd.weight": (E, "V"), "output.weight": (E, "V")}
    if hp.v2:
        K, G, R = hp.conv_kernel, hp.conv_group, hp.selector_rank
        out.update({"selector_predecessor.weight": (R, "V"), "selector_successor.weight": (R, "V"),
                    "selector_hidden.weight": (E, R)})
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,), p + "attn_q.weight": (E, nh * hd),
                    p + "attn_k.weight": (E, nkv * hd), p + "attn_v.weight": (E, nkv * hd),
                    p + "attn_output.weight": (nh * hd, E), p + "attn_q_norm.weight": (hd,),
                    p + "attn_k_norm.weight": (hd,), p + "ffn_gate.weight": (E, F), p + "ffn_up.weight": (E, F),
                    p + "ffn_down.weight": (F, E)})
        if hp.v2:
            for side in ("attn", "ffn"):
                out.update({p + f"{side}_conv_base": (E, K, 2), p + f"{side}_conv_proj.weight": (E, 2 * K * (E // G))})
    return out


# ---- consistency of hparams and of which tensors a block holds ----------------------------------

def _even_within(what: str, n_rot: int, head: int) -> None:
    if n_rot < 0 or n_rot % 2 or n_rot > head:
        raise SpecconvError(f"{what} {n_rot} must be even and at most the head size {head}")


def _routing(hp, X: int, where: str) -> None:
    used, groups, groups_used = hp.n_expert_used, getattr(hp, "n_group", 1), getattr(hp, "n_group_used", 1)
    if not 1 <= used <= X:
        raise SpecconvError(f"{hp.arch}.expert_used_count {used} must be within 1..{X} (the experts of {where})")
    if groups > 1 and (X % groups or X // groups < 2 or not 1 <= groups_used <= groups
                       or used > groups_used * (X // groups)):
        raise SpecconvError(f"{hp.arch}: {groups} expert groups ({groups_used} used) of the {X} experts of {where} "
                            f"cannot give {used} experts (groups must divide them, 2 or more each)")


def _check_ffn(file, hp, needed, bias: str, shared: bool) -> None:
    """Each block the graph runs holds a whole dense FFN or a whole routed one (with shared expert)."""
    have = set(needed)
    for i in _blocks(hp):
        p = f"blk.{i}."
        if p + "attn_norm.weight" not in have:
            continue  # a block this graph type does not run
        if p + "ffn_gate_inp.weight" in have:
            want = [p + n for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", bias)]
            if shared:
                want += [p + f"ffn_{n}_shexp.weight" for n in ("gate", "up", "down")]
            missing = [n for n in want if n not in have]
            if missing:
                raise SpecconvError(f"missing tensor {missing[0]} (block {i} has a router, ffn_gate_inp)")
            _routing(hp, int(file.tensors[p + "ffn_gate_inp.weight"].shape[-1]), f"block {i}")
        else:
            missing = [p + f"ffn_{n}.weight" for n in ("gate", "up", "down") if p + f"ffn_{n}.weight" not in have]
            if missing:
                raise SpecconvError(f"missing tensor {missing[0]} (block {i} has no router, so a dense FFN)")


def _hy_v3_hparams(hp) -> None:
    _even_within(f"{hp.arch}.attention.key_length (all of it is roped)", hp.head_dim, hp.head_dim)


def _step35_hparams(hp) -> None:
    _even_within(f"half of {hp.arch}.rope.dimension_count (the full-attention blocks' rope)", hp.n_rot_full,
                 hp.head_dim)
    _even_within(f"{hp.arch}.rope.dimension_count_swa", hp.n_rot_swa, hp.head_dim)


def _mimo2_hparams(hp) -> None:
    _even_within(f"{hp.arch}.rope.dimension_count", hp.rotary_dim, hp.head_dim)


def _dflash_hparams(hp) -> None:
    _even_within(f"{hp.arch}.rope.dimension_count", hp.n_rot, hp.head_dim)


def _hy_v3_values(file, hp, needed) -> None:
    _check_ffn(file, hp, needed, "exp_probs_b", shared=True)


def _step35_values(file, hp, needed) -> None:
    _check_ffn(file, hp, needed, "exp_probs_b.bias", shared=True)


def _mimo2_values(file, hp, needed) -> None:
    have = set(needed)
    for i in _blocks(hp):
        p = f"blk.{i}."
        split = [p + f"attn_{x}.weight" for x in "qkv"]
        if p + "attn_norm.weight" in have and p + "attn_qkv.weight" not in have and not all(n in have for n in split):
            raise SpecconvError(f"missing tensor {p}attn_qkv.weight (or {p}attn_q/k/v.weight)")
    _check_ffn(file, hp, needed, "exp_probs_b.bias", shared=False)


def _dflash_values(file, hp, needed) -> None:
    if hp.v2:
        rows = int(file.tensors["selector_successor.weight"].shape[-1]) if "selector_successor.weight" in file.tensors \
            else 0
        if rows and hp.selector_top_k > rows:
            raise SpecconvError(f"{hp.arch}.selector_top_k {hp.selector_top_k} exceeds the {rows} tokens of "
                                f"selector_successor.weight")


# before any tensor is looked at (shapes.check_arch_hparams)
ARCH_HPARAMS = {"hy_v3": _hy_v3_hparams, "step35": _step35_hparams, "mimo2": _mimo2_hparams, "dflash": _dflash_hparams}
CHECK_VALUES = {"hy_v3": _hy_v3_values, "step35": _step35_values, "mimo2": _mimo2_values, "dflash": _dflash_values}
EXPECTED = {"hy_v3": hy_v3, "step35": step35, "mimo2": mimo2, "dflash": dflash}
