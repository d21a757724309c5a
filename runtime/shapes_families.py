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


def _dflash_hparams(hp) -> None:
    _even_within(f"{hp.arch}.rope.dimension_count", hp.n_rot, hp.head_dim)


def _dflash_values(file, hp, needed) -> None:
    if hp.v2:
        rows = int(file.tensors["selector_successor.weight"].shape[-1]) if "selector_successor.weight" in file.tensors \
            else 0
        if rows and hp.selector_top_k > rows:
            raise SpecconvError(f"{hp.arch}.selector_top_k {hp.selector_top_k} exceeds the {rows} tokens of "
                                f"selector_successor.weight")


# before any tensor is looked at (shapes.check_arch_hparams)
ARCH_HPARAMS = {"dflash": _dflash_hparams}
CHECK_VALUES = {"dflash": _dflash_values}
EXPECTED = {"dflash": dflash}
