"""Plan-building pieces the plugins share: a collector that checks every source tensor against the
config, the final "every checkpoint tensor was used" check, and the table hooks several families
answer alike (the output head, the routed experts, a draft head's own embedding).

One implementation, so that the plugins reject a checkpoint for the same reasons with the same
messages.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType

from . import names
from . import transforms as tf
from .base import Checkpoint, Role, SourceTensor, TensorPlan, plans_in_checkpoint_order
from .config_reader import ConfigReader
from .errors import SpecconvError
from .tensor_table import Hook

F32 = GGMLQuantizationType.F32
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})

Transform = Callable[[list[np.ndarray]], np.ndarray]


def text_model_name(raw_name: str, towers: tuple[str, ...], towers_reason: str) -> str | tuple[None, str]:
    """The language model's name for a checkpoint tensor (`language_model.` dropped), or (None, why)
    for what a text GGUF leaves out: rotary buffers and the vision/audio towers listed in `towers`."""
    if raw_name.endswith("rotary_emb.inv_freq"):
        return (None, "rotary inv_freq buffer (recomputed from the config)")
    if raw_name.startswith(towers):
        return (None, towers_reason)
    return re.sub(r"(^|\.)language_model\.", r"\1", raw_name)


class CheckedPlan:
    """Collects TensorPlans while checking every source against the config (presence, shape, dtype)."""

    def __init__(self, tensors: Mapping[str, SourceTensor]):
        self.tensors = dict(tensors)
        self.used: set[str] = set()
        self.plans: list[TensorPlan] = []

    def has(self, name: str) -> bool:
        return name in self.tensors

    def source(self, name: str, shape: Sequence[int] | Sequence[Sequence[int]], dtypes=FLOAT_DTYPES) -> str:
        """Check one HF tensor; `shape` may be a list of accepted shapes."""
        info = self.tensors.get(name)
        if info is None:
            raise SpecconvError(f"checkpoint lacks tensor {name}")
        accepted = [tuple(s) for s in shape] if shape and isinstance(shape[0], (list, tuple)) else [tuple(shape)]
        if tuple(info.shape) not in accepted:
            want = " or ".join(str(list(s)) for s in accepted)
            raise SpecconvError(f"tensor {name} has shape {list(info.shape)}, but config.json implies {want}")
        if info.dtype not in dtypes:
            raise SpecconvError(f"tensor {name} has dtype {info.dtype}; expected one of {', '.join(sorted(dtypes))} "
                                f"(dequantize FP8/int checkpoints first)")
        self.used.add(name)
        return name

    def finish(self, arch: str) -> list[TensorPlan]:
        """The plans in checkpoint order, after checking that no checkpoint tensor was left unmapped."""
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise SpecconvError(f"unexpected tensor(s) for {arch}: {', '.join(unused[:3])}{more}")
        return plans_in_checkpoint_order(self.plans, self.tensors)


class RolePlan(CheckedPlan):
    """A CheckedPlan whose outputs carry a role (trunk, MTP, shared) and an optional F32 pin."""

    def add(self, gguf_name: str, sources: Sequence[str], shape: Sequence[int], role: Role,
            transform: Transform = tf.identity, f32: bool = False) -> None:
        self.plans.append(TensorPlan(gguf_name, tuple(sources), tuple(shape), role, transform,
                                     F32 if f32 else None))


_TRUNK_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def trunk_indexed_mtp_count(checkpoint: Checkpoint, num_hidden_layers: int) -> int:
    """k = the layers `model.layers.{N..}` present, which must run contiguously from N."""
    seen = set()
    for name in checkpoint.tensors:
        m = _TRUNK_LAYER.match(name)
        if m and int(m.group(1)) >= num_hidden_layers:
            seen.add(int(m.group(1)) - num_hidden_layers)
    k = max(seen) + 1 if seen else 0
    if seen and sorted(seen) != list(range(k)):
        raise SpecconvError(f"checkpoint holds MTP layers {sorted(i + num_hidden_layers for i in seen)}, not a contiguous run "
                            f"from layer {num_hidden_layers}")
    return k


def add_output_head(plan: RolePlan, tied: bool, V: int, H: int) -> None:
    """`output.weight` from `lm_head.weight`, unless the config ties it to the embedding."""
    if tied:
        plan.used.add("lm_head.weight")  # a tied head saved anyway is the embedding again
        return
    if not plan.has("lm_head.weight"):
        raise SpecconvError("checkpoint lacks tensor lm_head.weight (config.json says tie_word_embeddings=false)")
    plan.add(names.OUTPUT, [plan.source("lm_head.weight", (V, H))], (V, H), Role.SHARED)


def output_head(plan: RolePlan, s: Any, bid: None, p: str, role: Role) -> None:
    """The `output_head` table hook: `lm_head.weight`, unless the sizes' `tie_word_embeddings` ties it."""
    add_output_head(plan, s.tie_word_embeddings, s.vocab_dim, s.hidden_size)


def own_embedding(plan: RolePlan, s: Any, bid: None, p: str, role: Role) -> None:
    """The `embedding` table hook of a draft head: its own `embed_tokens.weight` when the checkpoint has
    one, else none (the runtime takes the target's)."""
    if plan.has("embed_tokens.weight"):
        shape = (s.vocab_size, s.hidden_size)
        plan.add(names.TOKEN_EMBD, [plan.source("embed_tokens.weight", shape)], shape, role)


def plan_experts(plan: RolePlan, bid: int, ex: str, E: int, Fe: int, H: int, role: Role,
                 where: str, count_field: str) -> None:
    """Routed experts -> ffn_{gate,up,down}_exps [E, ...]: per-expert tensors (`ex<e>.*_proj.weight`)
    are stacked; the fused 3-D layout of transformers (`gate_up_proj [E, 2Fe, H]`, gate rows first,
    `down_proj [E, H, Fe]`) is sliced. `where` names the layer in errors, `count_field` the config
    field that gives E."""
    fused = [n for n in (ex + "gate_up_proj", ex + "gate_up_proj.weight") if plan.has(n)]
    down_fused = [n for n in (ex + "down_proj", ex + "down_proj.weight") if plan.has(n)]
    per_expert = re.compile(re.escape(ex) + r"(\d+)\.(gate|up|down)_proj\.weight$")
    found: dict[str, set[int]] = {"gate": set(), "up": set(), "down": set()}
    for name in plan.tensors:
        hit = per_expert.match(name)
        if hit:
            found[hit.group(2)].add(int(hit.group(1)))
    has_split = any(found.values())
    gate_n, up_n, down_n = (names.blk(bid, f"ffn_{x}_exps") for x in ("gate", "up", "down"))
    if (fused or down_fused) and has_split:
        raise SpecconvError(f"{where}: both fused and per-expert expert tensors are present")
    if fused or down_fused:
        if not (fused and down_fused):
            raise SpecconvError(f"{where}: fused experts lack {ex + ('gate_up_proj' if not fused else 'down_proj')}")
        src = plan.source(fused[0], (E, 2 * Fe, H))
        plan.add(gate_n, [src], (E, Fe, H), role, partial(tf.slice_axis, dim=1, start=0, stop=Fe))
        plan.add(up_n, [src], (E, Fe, H), role, partial(tf.slice_axis, dim=1, start=Fe, stop=2 * Fe))
        plan.add(down_n, [plan.source(down_fused[0], (E, H, Fe))], (E, H, Fe), role)
        return
    if not has_split:
        raise SpecconvError(f"{where}: no expert tensors (neither {ex}gate_up_proj nor {ex}<e>.*_proj.weight)")
    incomplete = sorted(e for e in range(E) if any(e not in ids for ids in found.values()))
    extra = sorted({e for ids in found.values() for e in ids if e >= E})
    if incomplete or extra:
        parts = [f"experts {incomplete} missing"] if incomplete else []
        parts += [f"expert ids {extra} >= {count_field} {E}"] if extra else []
        raise SpecconvError(f"{where}: {'; '.join(parts)} (every expert needs gate_proj, up_proj and down_proj)")
    for gguf_name, part, shape in ((gate_n, "gate", (Fe, H)), (up_n, "up", (Fe, H)), (down_n, "down", (H, Fe))):
        srcs = [plan.source(f"{ex}{e}.{part}_proj.weight", shape) for e in range(E)]
        plan.add(gguf_name, srcs, (E, *shape), role, tf.stack)


def routed_experts(count_field: str) -> Hook:
    """The `experts` table hook of a family whose blocks keep their routed experts under
    `mlp.experts.` (E is the sizes' num_experts, `count_field` in config.json)."""
    def hook(plan: RolePlan, s: Any, bid: int, p: str, role: Role) -> None:
        ex = p + "mlp.experts."
        plan_experts(plan, bid, ex, s.num_experts, s.moe_intermediate_size, s.hidden_size, role,
                     where=f"layer {bid} ({ex.rstrip('.')})", count_field=count_field)
    return hook


_PRE_BY_MODEL_TYPE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}  # a target no plugin knows


def target_tokenizer_pre(target_config: Mapping[str, Any]) -> str:
    """`tokenizer.ggml.pre` of a draft head converted against its target (EAGLE-3, DFlash): the target
    plugin's, or by the target's model_type when no plugin converts it."""
    from . import plugin_class_for  # the registry imports the plugins, which import this module

    try:
        return plugin_class_for(target_config).tokenizer_pre
    except SpecconvError:
        target = ConfigReader(target_config, file="the target's config.json")
        model_type = target.text_model().string("model_type", default=None) or target.string("model_type", default=None)
        return _PRE_BY_MODEL_TYPE.get(model_type, "default")
