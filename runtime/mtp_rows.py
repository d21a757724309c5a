"""Which (token, hidden, position) rows the MTP head sees for a committed sequence (docs/reference/model-math.md §7.2).

* "llama.cpp" (the default, to match the peer): row p = (x_p, h_{p-1}) at position p for
  p = 0..T-1, with h_{-1} = 0 (llama.cpp's `pending_h` starts at zeros). Row p predicts x_{p+1}.
* "transformers" (`MtpModel`): row t = (x_{t+1}, h_t) at position t+1 for t = 0..T-1, where
  x_T is the token that follows the sequence (the target's prediction); no row at position 0.

h are the target's post-final-norm hidden states (`hidden["post_norm"]` of a MAIN decode).
These are one block's rows; chained heads run each block on the previous block's outputs
(runtime/drafters/mtp_chain.py, docs/reference/model-math.md §12).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError

CONVENTIONS = ("llama.cpp", "transformers")


def mtp_rows(tokens, hidden: torch.Tensor, convention: str = "llama.cpp", next_token: int | None = None,
             start: int = 0, pending_h: torch.Tensor | None = None):
    """Rows for tokens x_start.. with target hidden rows h_start.. ; returns (tokens, hidden_in, positions).

    `pending_h`: for llama.cpp rows of a later batch (start > 0), the target hidden state of the
    position before `start` (zeros when start == 0).
    """
    if convention not in CONVENTIONS:
        raise SpecconvError(f"MTP row convention must be one of {CONVENTIONS}, not {convention!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=hidden.device).reshape(-1)
    n = tokens.shape[0]
    if hidden.shape[0] != n:
        raise SpecconvError(f"mtp_rows: {n} tokens but {hidden.shape[0]} hidden rows")
    if convention == "llama.cpp":
        first = torch.zeros_like(hidden[:1]) if pending_h is None else pending_h.reshape(1, -1).to(hidden)
        rows = torch.cat([first, hidden[:-1]], dim=0)
        return tokens, rows, torch.arange(start, start + n, device=hidden.device)
    if next_token is None:
        raise SpecconvError("transformers MTP rows need next_token (the token after the sequence)")
    shifted = torch.cat([tokens[1:], torch.tensor([int(next_token)], device=hidden.device)])
    return shifted, hidden, torch.arange(start + 1, start + n + 1, device=hidden.device)
