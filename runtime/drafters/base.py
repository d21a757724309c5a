"""The drafter contract: every hook the speculative loop (runtime/speculative.py) calls, with its default.

A drafter proposes a chain of tokens after the target's last chosen token `id_last`. The loop tells
it what the target committed, so it can keep its own memory consistent with the target's.

Hooks every drafter implements:
* `start(prefix, hidden)`: the target evaluated and committed `prefix` at positions 0..len-1
  (the prompt minus its last token, llama.cpp's split); `hidden` are the target's rows of those
  positions named by `target_hidden` (only when `needs_hidden`), or None.
* `draft(id_last, n_max, p_min, temperature, generator) -> Draft`: up to `n_max` tokens for the
  positions after `id_last`. `Draft.probs` is exactly the distribution each token was sampled
  from (Leviathan rejection sampling uses it); None means the drafter is deterministic (greedy,
  n-gram) and the loop verifies with the sample-and-compare rule, which is exact for it.
* `accept(n_accepted, batch, hidden)`: the target evaluated `batch = [id_last, d_1..d_n]` at
  positions n_past.. and kept `batch[:n_accepted + 1]`; `hidden` are its rows of the batch (when
  `needs_hidden`). Afterwards the drafter's memory must hold exactly the committed positions.

What a drafter needs from its target, declared (defaults: nothing):
* `needs_hidden` / `target_hidden`: the target's hidden states of every evaluated row, by name
  (runtime/context.py: "post_norm", "pre_norm", "layer:J"), concatenated in that order.
* `reads_target_kv`: it attends to the target context's K/V instead of keeping memory of its own
  (the Gemma 4 assistant); `attach(target_ctx)` hands it that context before `start`.

Optional hooks with defaults: `attach` (nothing to do), `report(stats)` (what the drafter adds to the
run's statistics: none), `synthetic` (a measurement drafter, never credited as a head's result).

A subclass missing `name`, `start`, `draft` or `accept`, or declaring `reads_target_kv` without an
`attach`, is refused when the class is defined (`__init_subclass__`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from specconv.runtime.context import Context
    from specconv.runtime.spec_stats import SpecStats

REQUIRED_HOOKS = ("start", "draft", "accept")


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, n_vocab]: q_i, the distribution d_{i+1} was drawn from

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Draft":
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


class Drafter:
    """Base of every drafter: the hooks the loop calls and the capabilities it reads, with defaults."""

    name: str = ""  # the drafter's label in reports; every subclass sets it
    needs_hidden: bool = False  # the loop asks the target for the `target_hidden` rows of every batch
    target_hidden: tuple[str, ...] = ("post_norm",)  # which rows, concatenated in this order
    reads_target_kv: bool = False  # attends to the target context's K/V: `attach` receives it
    synthetic: bool = False  # a measurement drafter (reports label it; `specconv verify` never builds it)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.name, str) or not cls.name:
            raise TypeError(f"drafter {cls.__qualname__} declares no name (a non-empty str class attribute)")
        missing = [hook for hook in REQUIRED_HOOKS if not _implements(cls, hook)]
        if missing:
            raise TypeError(f"drafter {cls.__qualname__} does not implement {', '.join(missing)} "
                            "(runtime/drafters/base.py)")
        if cls.reads_target_kv and not _implements(cls, "attach"):
            raise TypeError(f"drafter {cls.__qualname__} reads its target's K/V but has no attach(target_ctx)")
        if not isinstance(cls.target_hidden, tuple) or not all(isinstance(x, str) for x in cls.target_hidden):
            raise TypeError(f"drafter {cls.__qualname__}: target_hidden must be a tuple of hidden-state names")

    def attach(self, target_ctx: "Context") -> None:
        """The target context of the run, before `start` (used by drafters that read its K/V)."""

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        raise NotImplementedError

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    def report(self, stats: "SpecStats") -> dict:
        """Entries this drafter adds to the run's statistics (result.stats["speculative"])."""
        return {}


def _implements(cls: type, hook: str) -> bool:
    """Whether `cls` or a base below `Drafter` defines `hook` (the base's own is only a placeholder)."""
    return any(hook in vars(klass) for klass in cls.__mro__[:cls.__mro__.index(Drafter)])


def register(registry: dict[str, type[Drafter]], cls: type) -> type[Drafter]:
    """Add a drafter class to `registry` under its name; anything not built on `Drafter` is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(f"{cls!r} is not a Drafter subclass (runtime/drafters/base.py)")
    if registry.get(cls.name, cls) is not cls:
        raise TypeError(f"two drafters are named {cls.name!r}: {registry[cls.name].__qualname__} and "
                        f"{cls.__qualname__}")
    registry[cls.name] = cls
    return cls
