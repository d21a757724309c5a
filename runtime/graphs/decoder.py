"""The decoder skeleton the graphs share (docs/reference/model-math.md §7.1): token embedding, the trunk's blocks,
output norm and head, and the two ends of a nextn (MTP) block. Each graph supplies its own block
and rope; everything around them is written once here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from specconv.runtime.graphs.ops import Deferred, acc, acc_dtype, add_rms_norm, linear, made, rms_norm
from specconv.runtime.placement import move, on_layer_device, running_on


class Residual(NamedTuple):
    """The residual stream h + delta with its last add left to the norm that reads it next (the next
    block's input norm, the output norm): ops.add_rms_norm adds and normalises in one launch on CUDA.
    delta may be a product not made yet (ops.Deferred: an FFN's down product), which that launch
    then makes too."""
    h: torch.Tensor
    delta: torch.Tensor | Deferred


# block(i, h, rope) -> h after block i; a block may take and return its stream as a Residual
Block = Callable[[int, "torch.Tensor | Residual", object], "torch.Tensor | Residual"]


def settled(h: torch.Tensor | Residual) -> torch.Tensor:
    """The residual stream as one tensor (its pending add done)."""
    return h.h + made(h.delta) if isinstance(h, Residual) else h


def normed(h: torch.Tensor | Residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stream as one tensor, rms_norm of it): a pending add (and a deferred product) and the norm
    in one ops.add_rms_norm."""
    if isinstance(h, Residual):
        return add_rms_norm(h.h, h.delta, weight, eps)
    return h, rms_norm(h, weight, eps)


def output_head(w) -> torch.Tensor:
    """`output.weight`, or the token embedding for a tied head."""
    return w["output.weight"] if "output.weight" in w else w["token_embd.weight"]


def forward_trunk(w, num_hidden_layers: int, eps: float, tokens: torch.Tensor, want_layers: set[int],
                  want_logits: torch.Tensor | None, make_rope: Callable[[torch.dtype], object], block: Block):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm}).

    `make_rope(dtype)` builds the rope tables in the activations' accumulation dtype.
    """
    placement = w.placement  # runtime/weights.py Weights
    multi = placement.multi
    h = w["token_embd.weight"][tokens]
    main = h.device
    rope = make_rope(acc_dtype(h.dtype))
    layer_inputs = {}
    for i in range(num_hidden_layers):
        if i in want_layers:
            h = settled(h)
            layer_inputs[i] = h.to(main)
        if multi:  # activations and rope tables follow the blocks over the devices (runtime/placement.py)
            dev = placement.layer_device(i)
            h, rope = move(settled(h), dev), move(rope, dev)
            with running_on(dev):
                h = block(i, h, rope)
        else:
            h = block(i, h, rope)
    if multi:
        h = move(settled(h), placement.devices[-1])  # the output norm and head sit on the last device
    h, post = normed(h, w["output_norm.weight"], eps)
    if num_hidden_layers in want_layers:
        layer_inputs[num_hidden_layers] = post.to(main)
    rows = post if want_logits is None else post[want_logits.to(post.device)]
    return acc(linear(rows, output_head(w))).to(main), post.to(main), h.to(main), layer_inputs


def nextn_input(w, num_hidden_layers: int, eps: float, tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
    """eh_proj · [enorm(E[x]) ; hnorm(h)], embedding first (the nextn block sits at index n_layer)."""
    p = f"blk.{num_hidden_layers}.nextn."
    embd = w.get(p + "embed_tokens.weight", w["token_embd.weight"])
    e = rms_norm(embd[tokens], w[p + "enorm.weight"], eps)
    hn = rms_norm(hidden_in.to(e.dtype), w[p + "hnorm.weight"], eps)
    return linear(torch.cat([e, hn], dim=-1), w[p + "eh_proj.weight"])


def nextn_output(w, num_hidden_layers: int, eps: float, y: torch.Tensor | Residual):
    """(logits, z, y): z = shared_head_norm(y) (or output_norm), logits from shared_head_head (or
    output), y as one tensor."""
    p = f"blk.{num_hidden_layers}.nextn."
    y, z = normed(y, w.get(p + "shared_head_norm.weight", w["output_norm.weight"]), eps)
    return acc(linear(z, w.get(p + "shared_head_head.weight", output_head(w)))), z, y


def forward_nextn(w, num_hidden_layers: int, eps: float, tokens: torch.Tensor, hidden_in: torch.Tensor,
                  make_rope: Callable[[torch.dtype], object], block: Block):
    """One MTP row per token: u = eh_proj·[enorm(E[x]) ; hnorm(h)], the block at index n_layer,
    z = shared_head_norm(y); returns (logits, z = normed output fed back when chaining, y = pre-norm output)."""
    def run(tokens, hidden_in):
        h = nextn_input(w, num_hidden_layers, eps, tokens, hidden_in)
        y = block(num_hidden_layers, h, make_rope(acc_dtype(h.dtype)))
        return nextn_output(w, num_hidden_layers, eps, y)

    return on_layer_device(w, num_hidden_layers, run, tokens, hidden_in)  # the MTP block sits on the last device
