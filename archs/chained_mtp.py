"""What the chained-MTP plugins share (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

Their checkpoints hold k MTP blocks after the N trunk layers, each with `eh_proj / enorm / hnorm`
and a full decoder block, written as GGUF blocks N..N+k-1. `ChainedMtpPlugin` walks those N + k
blocks once, in the tensor order llama.cpp's converter writes (nextn inputs and head norm, attn_norm,
attention, ffn_norm, dense or routed FFN); a family supplies its own attention, MoE, MTP head and
naming through the hooks below; `check_stated_count` checks the MTP count config.json states.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar


from . import names
from . import transforms as tf
from .base import ArchPlugin, Role, TensorPlan
from .errors import SpecconvError
from .plan_tools import RolePlan, add_output_head, add_swiglu, embedding_rows


def check_stated_count(plugin: ArchPlugin, stated: Any, k: int, where: str, missing: str | None = None) -> None:
    """A count config.json states must be the one the checkpoint holds (`where` names its tensors).
    A checkpoint with none converts without MTP (`missing`: the reason, when given): save_pretrained
    drops MTP weights, so a stated count alone does not mean they were ever there."""
    if stated is not None and k and stated != k:
        raise SpecconvError(f"config.json says num_nextn_predict_layers={stated}, but the checkpoint holds "
                            f"{k} MTP layer(s) ({where})")
    if missing and stated and not k:
        plugin.missing_mtp = (f"config.json says num_nextn_predict_layers={stated}, but the checkpoint holds no "
                              f"{missing} tensors")


class ChainedMtpPlugin(ArchPlugin):
    """Sets in __init__: n, k, hidden, vocab, ffn, tied, moe_layers (block ids with a router)."""

    norm_transform: ClassVar[Callable] = staticmethod(tf.identity)  # step35: Gemma-style 1 + w
    n: int
    k: int
    hidden: int
    vocab: int
    ffn: int
    tied: bool
    moe_layers: set[int]

    @property
    def n_trunk_layers(self) -> int:
        return self.n

    @property
    def n_mtp_layers(self) -> int:
        return self.k

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        H, V = self.hidden, self.vocab
        plan.add(names.TOKEN_EMBD, [plan.source("model.embed_tokens.weight", (V, H))], (V, H), Role.SHARED)
        for i in range(self.n + self.k):
            role = Role.TRUNK if i < self.n else Role.MTP
            p = self._prefix(i)
            if role == Role.MTP:
                plan.add(names.nextn(i, names.NEXTN_EH_PROJ), [plan.source(p + "eh_proj.weight", (H, 2 * H))],
                         (H, 2 * H), role)  # embedding half first, as in vLLM and llama.cpp
                self._norm(plan, names.nextn(i, names.NEXTN_ENORM), p + "enorm.weight", role)
                self._norm(plan, names.nextn(i, names.NEXTN_HNORM), p + "hnorm.weight", role)
                self._mtp_head(plan, i, p, role)
            self._norm(plan, names.blk(i, "attn_norm"), p + "input_layernorm.weight", role)
            self._attention(plan, i, p + "self_attn.", role)
            self._norm(plan, names.blk(i, "ffn_norm"), p + self._ffn_norm_source(i) + ".weight", role)
            if i in self.moe_layers:
                self._moe(plan, i, p, role)
            else:
                add_swiglu(plan, i, p + "mlp.", self.ffn, H, role)
        self._norm(plan, names.OUTPUT_NORM, "model.norm.weight", Role.SHARED)
        add_output_head(plan, self.tied, V, H)
        return plan.finish(self.gguf_arch)

    def _norm(self, plan: RolePlan, gguf_name: str, hf: str, role: Role, width: int | None = None) -> None:
        w = self.hidden if width is None else width
        plan.add(gguf_name, [plan.source(hf, (w,))], (w,), role, self.norm_transform, True)

    def _prefix(self, i: int) -> str:
        """The checkpoint prefix of GGUF block i (MTP blocks follow the trunk's numbering by default)."""
        return f"model.layers.{i}."

    def _ffn_norm_source(self, i: int) -> str:
        return "post_attention_layernorm"

    def _mtp_head(self, plan: RolePlan, i: int, p: str, role: Role) -> None:
        """An MTP block's own tensors after eh_proj / enorm / hnorm (its output norm, head copies)."""
        raise NotImplementedError

    def _attention(self, plan: RolePlan, i: int, a: str, role: Role) -> None:
        raise NotImplementedError

    def _moe(self, plan: RolePlan, i: int, p: str, role: Role) -> None:
        """Router, selection bias, experts (and shared expert) of block i, `p` its layer prefix."""
        raise NotImplementedError
