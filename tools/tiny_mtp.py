"""MTP rows, losses and held-out measurements shared by the trainer and its tests.

MTP row convention (docs/reference/model-math.md §7.2). For a window x_0..x_{T-1} with post-final-norm trunk
hidden states h_0..h_{T-1}:

* transformers rows: row t = (x_{t+1}, h_t) at position t+1, t = 0..T-2; it predicts x_{t+2}.
* llama.cpp rows: the same rows preceded by (x_0, zero hidden) at position 0. That extra row
  only sits in the MTP layer's attention context; its own prediction (x_1) is not scored.

Both conventions are trained (alternating steps) so the head serves either runtime.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# MtpModel state-dict prefix -> Qwen release name prefix (docs/reference/peers.md §2.8).
_RELEASE_PREFIXES = (
    ("layers.0.eh_proj.", "mtp.fc."),
    ("layers.0.enorm.", "mtp.pre_fc_norm_embedding."),
    ("layers.0.hnorm.", "mtp.pre_fc_norm_hidden."),
    ("layers.0.post_norm.", "mtp.norm."),
    ("layers.0.mtp_block.", "mtp.layers.0."),
)


def release_name(name: str) -> str | None:
    """MtpModel tensor name -> Qwen release name; None for the embedding/head shared with the trunk."""
    if name.startswith(("embed_tokens.", "shared_head.")):
        return None
    for ours, release in _RELEASE_PREFIXES:
        if name.startswith(ours):
            return release + name[len(ours):]
    raise ValueError(f"unexpected MtpModel tensor {name}")


def enable_mtp_attributes(config) -> None:
    """Qwen configs don't declare the MTP count in the form transformers reads (docs/reference/peers.md §2.2)."""
    config.num_mtp_layers = 1
    config.mtp_layer_types = ["full_attention"]


def mtp_logits(mtp, ids: torch.Tensor, hidden: torch.Tensor, zero_row: bool) -> torch.Tensor:
    """MTP logits [B, T-1, V] for a window ids [B, T]; row t predicts x_{t+2}."""
    batch, length = ids.shape
    tokens, rows = ids[:, 1:], hidden[:, :-1]
    positions = torch.arange(1, length, device=ids.device)
    if zero_row:
        tokens = torch.cat([ids[:, :1], tokens], dim=1)
        rows = torch.cat([torch.zeros_like(hidden[:, :1]), rows], dim=1)
        positions = torch.arange(0, length, device=ids.device)
    out = mtp.forward_layer(0, rows, position_ids=positions.expand(batch, -1), mtp_cache=None, input_ids=tokens)
    logits = mtp._project_to_logits(out)
    return logits[:, 1:] if zero_row else logits


def trunk(main, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T, V], post-final-norm hidden [B, T, H]) of the trunk."""
    out = main(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.logits, out.hidden_states[-1]


def losses(main, mtp, window: torch.Tensor, zero_row: bool, detach_hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(main next-token loss, MTP loss on x_{t+2}) for windows [B, T+1]."""
    ids = window[:, :-1]
    logits, hidden = trunk(main, ids)
    main_loss = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
    if detach_hidden:
        hidden = hidden.detach()
    m_logits = mtp_logits(mtp, ids, hidden, zero_row)
    mtp_loss = F.cross_entropy(m_logits.flatten(0, 1).float(), window[:, 2:].flatten())
    return main_loss, mtp_loss


@torch.no_grad()
def heldout_metrics(main, mtp, windows: torch.Tensor, zero_row: bool, batch: int = 8) -> dict:
    """Teacher-forced measurements on windows [N, T+1] of held-out text.

    mtp_acc: MTP argmax == x_{t+2}. mtp_agree: MTP argmax == the trunk's own argmax for x_{t+2}
    (the trunk at position t+1), which is what greedy acceptance counts when the context is real text.
    """
    sums = dict(main_nll=0.0, mtp_nll=0.0, main_hit=0, mtp_hit=0, agree=0, n_main=0, n_mtp=0)
    for start in range(0, windows.shape[0], batch):
        w = windows[start:start + batch]
        ids = w[:, :-1]
        logits, hidden = trunk(main, ids)
        m_logits = mtp_logits(mtp, ids, hidden, zero_row)
        sums["main_nll"] += F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum").item()
        sums["mtp_nll"] += F.cross_entropy(m_logits.flatten(0, 1).float(), w[:, 2:].flatten(), reduction="sum").item()
        main_arg = logits.argmax(-1)
        mtp_arg = m_logits.argmax(-1)
        sums["main_hit"] += (main_arg == w[:, 1:]).sum().item()
        sums["mtp_hit"] += (mtp_arg == w[:, 2:]).sum().item()
        sums["agree"] += (mtp_arg == main_arg[:, 1:]).sum().item()
        sums["n_main"] += w[:, 1:].numel()
        sums["n_mtp"] += w[:, 2:].numel()
    return {
        "main_loss": sums["main_nll"] / sums["n_main"],
        "mtp_loss": sums["mtp_nll"] / sums["n_mtp"],
        "main_top1": sums["main_hit"] / sums["n_main"],
        "mtp_top1": sums["mtp_hit"] / sums["n_mtp"],
        "mtp_agree_main": sums["agree"] / sums["n_mtp"],
        "positions": sums["n_mtp"],
    }


@torch.no_grad()
def greedy_continuations(main, prompts: list[torch.Tensor], n_new: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + n_new greedy tokens of the trunk [1, P+n_new], P) per prompt; full forwards, no cache."""
    out = []
    for prompt in prompts:
        seq = prompt.reshape(1, -1)
        for _ in range(n_new):
            logits, _ = trunk(main, seq)
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
        out.append((seq, prompt.numel()))
    return out


@torch.no_grad()
def greedy_acceptance(main, mtp, continuations, zero_row: bool) -> dict:
    """Acceptance at draft_max 1 of greedy speculative decoding, measured on the trunk's own output.

    On a greedy continuation the token after every committed position is the trunk's argmax, so
    the MTP draft for x_{t+2} made from row (x_{t+1}, h_t) is accepted exactly when it equals
    x_{t+2}. Counted over the drafts whose row token x_{t+1} and target x_{t+2} are both generated.
    """
    hits = total = 0
    for seq, n_prompt in continuations:
        _, hidden = trunk(main, seq)
        drafts = mtp_logits(mtp, seq, hidden, zero_row).argmax(-1)[0]  # drafts[t] predicts x_{t+2}
        first = n_prompt - 1  # row (x_P, h_{P-1}): x_P is the first generated token
        target = seq[0, first + 2:]
        hits += (drafts[first:first + target.numel()] == target).sum().item()
        total += target.numel()
    return {"acceptance": hits / total if total else math.nan, "drafts": total}
