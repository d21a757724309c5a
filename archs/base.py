"""The architecture plugin contract.

A plugin describes one architecture family: which Hugging Face `architectures` it accepts, the GGUF
arch string, the metadata to write and, for every GGUF tensor, which HF tensors feed it and how they
are transformed. It is pure description: it never opens a file. The conversion engine reads the
sources lazily, calls `TensorPlan.transform`, picks the storage type and routes each tensor to the
trunk file, the MTP sidecar or both, according to `TensorPlan.role`.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from . import transforms
from .errors import SpecconvError
from .hparams import FamilyHParams

if TYPE_CHECKING:
    from .tensor_table import Hook, TensorTable


class Role(enum.Enum):
    """Where a tensor goes."""

    TRUNK = "trunk"  # the main model only
    MTP = "mtp"  # an MTP / nextn block: embedded file and sidecar
    SHARED = "shared"  # token_embd / output_norm / output: trunk file and sidecar


class MtpMode(enum.Enum):
    EMBED = "embed"  # one file with the trunk and the MTP blocks
    NONE = "none"  # trunk only
    ONLY = "only"  # the mtp- sidecar only
    SEPARATE = "separate"  # trunk-only file and sidecar in one run


@dataclass(frozen=True)
class SourceTensor:
    """What the checkpoint header says about one HF tensor (after name normalisation)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: "F32", "BF16", "F16", ...


@dataclass
class TensorPlan:
    """One GGUF output tensor."""

    name: str  # GGUF name, e.g. "blk.3.attn_qkv.weight"
    sources: tuple[str, ...]  # normalised HF names read to produce it
    shape: tuple[int, ...]  # torch order (reverse of the ggml order GGUF shows)
    role: Role
    # Receives the source tensors (in `sources` order; float32 unless marked layout-only, see
    # transforms.py) and returns the output tensor.
    transform: Callable[[list[np.ndarray]], np.ndarray] = field(default=transforms.identity, repr=False)
    # A storage type forced by the architecture, overriding the engine's generic rules.
    force_type: GGMLQuantizationType | None = None


@dataclass(frozen=True)
class MetaKV:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None  # element type of arrays


@dataclass(frozen=True)
class Block:
    """One block as the converter walks it: GGUF index, HF name prefix, and where it goes."""

    bid: int
    prefix: str
    role: Role


@dataclass
class Checkpoint:
    """The plugin's whole view of a checkpoint: its config and its tensor headers."""

    config: Mapping[str, Any]
    tensors: Mapping[str, SourceTensor]  # normalised name -> header
    skipped: Mapping[str, str] = field(default_factory=dict)  # raw name -> reason (towers, ...)
    # Draft heads (EAGLE-3) are converted against their target (`--target`): its config.json and folder
    # (tokenizer). Plugins that use it set the class attribute `uses_target = True`.
    target_config: Mapping[str, Any] | None = None
    target_dir: str | None = None
    # The checkpoint folder, for plugins whose shapes depend on the tokenizer (Gemma trims the
    # embedding to the tokenizer's real size); plugins read only small metadata files from it.
    source_dir: str | None = None
    # `--target-layers` of a draft head (layer inputs, as llama.cpp's `eagle3.target_layers`), or None.
    target_layers: tuple[int, ...] | None = None


class ArchPlugin(abc.ABC):
    """One architecture family as the converter (convert/engine.py) sees it: every hook it calls.

    Subclasses set the identity class attributes, their `table`, and `hp` in `__init__`, and
    implement the abstract members; the rest have defaults, written for a model whose trunk blocks
    are `model.layers.{i}` followed by its MTP blocks, with the vocabulary of its token embedding. A
    family that differs overrides the hook that differs. `register` (archs/__init__.py) refuses a
    class that leaves an abstract member out.
    """

    # --- identity (class attributes) ----------------------------------------------------------
    hf_architectures: ClassVar[tuple[str, ...]] = ()  # the HF `architectures` strings it converts
    gguf_arch: ClassVar[str] = ""  # the GGUF `general.architecture` it writes (a graph's Graph.archs runs it)
    family: ClassVar[str] = ""  # plugin family name shown to users, e.g. "qwen35"
    # The transformers class `specconv verify --hf` loads as the reference, by the config.json
    # `architectures` string converted (a release layout may need a class of its own); a string left
    # out, or an empty mapping, means no transformers reference (specconv/verify/parity.py).
    hf_reference: ClassVar[dict[str, str]] = {}
    # A draft head converted against its target (`--target`: EAGLE-3, DFlash): the engine fills
    # Checkpoint.target_config / target_dir / target_layers and refuses those options elsewhere.
    uses_target: ClassVar[bool] = False
    # The whole file is a drafter (the Gemma 4 assistant): no trunk / MTP split, no notice about one.
    standalone_drafter: ClassVar[bool] = False
    # llama.cpp's loader of `gguf_arch` runs a file that declares nextn layers but lacks their tensors
    # as a trunk-only model, where other loaders refuse it (what `inspect` reports: convert/gguf_summary.py)
    llama_cpp_skips_absent_nextn: ClassVar[bool] = False
    # The release keeps MTP block j as `model.layers.{N+j}` (DeepSeek-V3, GLM), where transformers'
    # MtpModel reads it and the CausalLM class ignores it (specconv/verify/parity.py load_mtp_reference)
    mtp_as_trunk_layers: ClassVar[bool] = False

    # --- what the plugin describes the checkpoint with -----------------------------------------
    table: ClassVar[TensorTable]  # the family's tensors (archs/tensor_table.py)
    hp: FamilyHParams  # the family's hyperparameters, set in __init__ from config.json

    # --- what a conversion reports (set by the plugin while it reads the checkpoint) ----------
    # Set when the config declares MTP layers whose weights are absent: only a trunk-only
    # conversion may proceed, so the head is never dropped silently.
    missing_mtp: str | None = None
    notices: Sequence[str] = ()  # lines shown to the user (where a head's target layers came from, ...)

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint

    @classmethod
    def refine(cls, config: Mapping[str, Any]) -> type[ArchPlugin]:
        """The plugin class that converts `config`: this one, or a more specific one it hands over to."""
        return cls

    # --- naming -----------------------------------------------------------------------------
    @classmethod
    def normalize_name(cls, raw_name: str) -> str | None | tuple[None, str]:
        """Map a raw checkpoint name to the plugin's canonical HF name.

        Returns the canonical name, or `(None, reason)` to skip the tensor with a notice.
        """
        return raw_name

    # --- structure --------------------------------------------------------------------------
    @property
    def n_trunk_layers(self) -> int:
        """Trunk blocks written (`block_count` of a trunk-only file)."""
        return self.hp.num_hidden_layers

    @property
    def n_mtp_layers(self) -> int:
        """MTP / nextn layers present in the checkpoint (0 when none)."""
        return self.hp.num_nextn_predict_layers

    def sizes(self) -> FamilyHParams:
        """The hparams the table's shapes are checked and written with."""
        return self.hp

    def block_prefix(self, bid: int) -> str:
        """The checkpoint prefix of GGUF block `bid` (MTP blocks follow the trunk's numbering)."""
        return f"model.layers.{bid}."

    def blocks(self) -> list[Block]:
        """The trunk blocks, then the MTP blocks, as the table plans them."""
        n = self.n_trunk_layers
        return [Block(i, self.block_prefix(i), Role.TRUNK if i < n else Role.MTP)
                for i in range(n + self.n_mtp_layers)]

    def hooks(self) -> dict[str, Hook]:
        """The plugin hooks the table names (`TensorSpec.hook`): what the table cannot say."""
        return {}

    def ignored_sources(self) -> Sequence[str]:
        """Checkpoint tensors that map to nothing in the file (transformers ignores them on load); a
        name the checkpoint lacks is no error."""
        return ()

    def tensor_plan(self) -> list[TensorPlan]:
        """Every GGUF tensor the checkpoint yields, trunk and MTP, in file order."""
        from .plan_tools import RolePlan  # plan_tools builds on this module

        plan = RolePlan(self.checkpoint.tensors)
        self.table.plan(plan, self.sizes(), self.blocks(), self.hooks())
        plan.used.update(name for name in self.ignored_sources() if plan.has(name))
        return plan.finish(self.gguf_arch)

    @abc.abstractmethod
    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """Architecture KV pairs (not `general.*`, not tokenizer).

        keep_mtp=True: block_count = N + k and nextn_predict_layers = k (embedded file and sidecar).
        keep_mtp=False: block_count = N and no nextn key (trunk-only file).
        """

    # --- tokenizer --------------------------------------------------------------------------
    tokenizer_model: ClassVar[str] = "gpt2"  # tokenizer.ggml.model
    tokenizer_pre: ClassVar[str] = "default"  # tokenizer.ggml.pre (a draft head takes its target's)
    # Special-token ids an architecture fixes by token text (kind -> added token), applied as
    # llama.cpp's converter applies them: only where the tokenizer's own config left the kind unset.
    special_tokens: ClassVar[dict[str, str]] = {}
    tokenizer_dir: str | None = None  # the folder whose tokenizer is written; None: the checkpoint's

    def vocab_size(self) -> int:
        """Rows of the token embedding (the GGUF vocabulary is padded to this)."""
        return embedding_rows(self.checkpoint)


def embedding_rows(checkpoint: Checkpoint) -> int:
    """The vocabulary size as the checkpoint's token embedding has it."""
    info = checkpoint.tensors.get("model.embed_tokens.weight")
    if info is None:
        raise SpecconvError("checkpoint lacks tensor model.embed_tokens.weight")
    return int(info.shape[0])


def plans_in_checkpoint_order(plans: list[TensorPlan], tensors: Mapping[str, SourceTensor]) -> list[TensorPlan]:
    """Each output at the position of its last source in the checkpoint's order (stable).

    llama.cpp's converter walks the checkpoint in that order and emits an output as soon as its
    last input arrives (stacked experts after the layer's last expert), so with `tensors` in file
    order the GGUF tensor order is the upstream one.
    """
    index = {name: i for i, name in enumerate(tensors)}
    return sorted(plans, key=lambda p: max(index[s] for s in p.sources))
