"""Small shared types of the runtime API."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class GraphType(enum.Enum):
    MAIN = "main"  # the trunk: logits and hidden states for every row
    MTP = "mtp"  # the nextn head: (token, target hidden) rows -> logits and its normed hidden
    ENCODER = "encoder"  # EAGLE-3's feature encoder: target feature rows -> g rows (Context.encode)


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # float32 [n_rows, n_vocab]
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n, n_embd]
    positions: torch.Tensor | None = None  # the positions evaluated
