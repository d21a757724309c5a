"""The tensor groups of an auto mix and the options measured for each (convert/auto_mix.py).

A group is a set of tensors that takes one option together: attention (softmax and linear attention:
every `blk.*` tensor no other group claims), FFN, experts, shared expert, output, embedding, and the
MTP block (every tensor of the plugin's MTP role). The rules are data, first match wins; only the
tensors llama.cpp's quantize quantizes (convert/quant_rules.py `quantizable`) belong to a group, the
others keep their lossless type. An embedding tied to the output is the output (the tool gives it the
output's rule too).

An option is a type for every tensor of the group: each of UNIFORM_TYPES (with the tool's fallback
for rows its block does not divide, so two types may give the same assignment and count once), and
the types the recipe itself gives the group's tensors (its more-bits layers included), so the recipe
is one of the mixes the allocation can choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from gguf import GGMLQuantizationType

from specconv.archs.base import Role

from .quant_rules import fitted_type, quantizable

Q = GGMLQuantizationType

UNIFORM_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0)
MTP_GROUP = "mtp"
TIED_OUTPUT = "token_embd.weight"  # the output matrix when the file has no output.weight


@dataclass(frozen=True)
class GroupRule:
    group: str
    role: Role | None = None  # every tensor of this plugin role
    names: tuple[str, ...] = ()  # exact GGUF names
    parts: tuple[str, ...] = ()  # substrings of the GGUF name
    rest: bool = False  # every tensor

    def matches(self, name: str, role: Role) -> bool:
        return self.rest or role == self.role or name in self.names or any(p in name for p in self.parts)


GROUP_RULES = (
    GroupRule(MTP_GROUP, role=Role.MTP),
    GroupRule("output", names=("output.weight",)),
    GroupRule("embedding", names=("token_embd.weight", "per_layer_token_embd.weight")),
    GroupRule("experts", parts=("_exps.",)),
    GroupRule("shared_expert", parts=("_shexp.",)),
    GroupRule("ffn", parts=("ffn_",)),
    GroupRule("attention", parts=("blk.",)),
    GroupRule("other", rest=True),  # anything else the tool quantizes
)
GROUP_ORDER = tuple(r.group for r in GROUP_RULES)


@dataclass(frozen=True)
class GroupTensor:
    name: str
    shape: tuple[int, ...]  # torch order
    copies: int  # files holding it (the embedding and output are in both files of --mtp separate)


def group_of(name: str, role: Role, tied: bool) -> str:
    if tied and name == TIED_OUTPUT and role != Role.MTP:
        return "output"
    return next(rule.group for rule in GROUP_RULES if rule.matches(name, role))


def tensor_groups(plan) -> dict[str, list[GroupTensor]]:
    """group -> its tensors (write order), for a ConversionPlan's quantizable tensors."""
    names = {t.name for t in plan.tensors}
    tied = "output.weight" not in names
    copies = {}
    for f in plan.files:
        for t in f.tensors:
            copies[t.name] = copies.get(t.name, 0) + 1
    groups: dict[str, list[GroupTensor]] = {}
    for t in plan.tensors:
        shape = tuple(int(d) for d in t.plan.shape)
        if t.name not in copies or not quantizable(t.name, shape):
            continue
        groups.setdefault(group_of(t.name, t.plan.role, tied), []).append(GroupTensor(t.name, shape, copies[t.name]))
    return {g: groups[g] for g in GROUP_ORDER if g in groups}


@dataclass(frozen=True)
class GroupOption:
    label: str  # "Q5_K", or "Q4_K_M rules"
    types: tuple[tuple[str, GGMLQuantizationType], ...]  # (tensor name, type) for the group's tensors

    @property
    def assignment(self) -> dict[str, GGMLQuantizationType]:
        return dict(self.types)

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, t in self.types:
            out[t.name] = out.get(t.name, 0) + 1
        return out


def group_options(tensors: Sequence[GroupTensor], recipe_label: str | None,
                  recipe_types: Mapping[str, GGMLQuantizationType] | None) -> list[GroupOption]:
    """The options of one group, smallest first: each uniform type, then the recipe's own types, each
    assignment once (a recipe equal to a uniform type keeps the uniform type's label)."""
    options: list[GroupOption] = []
    seen = set()
    candidates = [(t.name, {g.name: fitted_type(t, g.shape[-1]) for g in tensors}) for t in UNIFORM_TYPES]
    if recipe_types is not None:
        candidates.append((f"{recipe_label} rules", {g.name: recipe_types[g.name] for g in tensors}))
    for label, assignment in candidates:
        key = tuple(sorted(assignment.items()))
        if key in seen:
            continue
        seen.add(key)
        options.append(GroupOption(label, tuple((g.name, assignment[g.name]) for g in tensors)))
    return options


def option_bytes(tensors: Sequence[GroupTensor], option: GroupOption, alignment: int) -> int:
    """The bytes the group's tensors take in the files at this option (each tensor's data padded to the
    files' alignment, once per file that holds it)."""
    from .outtype import nbytes

    types = option.assignment
    return sum(g.copies * _padded(nbytes(g.shape, types[g.name]), alignment) for g in tensors)


def _padded(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
