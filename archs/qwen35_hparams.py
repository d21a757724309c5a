"""Qwen3.5 / 3.6 (dense and MoE) hyperparameters: one dataclass, read from config.json by the plugin
(archs/qwen35.py, `from_config`) and from GGUF metadata by the graph (runtime/graphs/qwen35.py,
`from_kv`); the family's tensor table reads it as its sizes. Qwen3-Next reads the same fields with
its own rules (archs/qwen3next.py).

Configs come in two shapes: text-only (`Qwen3_5ForCausalLM`, fields at top level) and the VL
releases (`Qwen3_5ForConditionalGeneration`, fields under `text_config`). Rope fields may sit at the
top of the text config (Hub) or inside `rope_parameters` / `rope_scaling` (transformers v5). Both
give the same result here. Defaults are transformers' own class defaults, so a field missing from
config.json means what it means to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import names
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .rope_scaling import RopeScaling, rope_scaling_of
from .tensor_table import AttentionWidths

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(kw_only=True)
class Qwen35HParams(FamilyHParams, AttentionWidths):
    """transformers' Qwen3_5(Moe)TextConfig names. num_nextn_predict_layers is the MTP block count:
    config.json's `mtp_num_hidden_layers` until the plugin counts the checkpoint's blocks."""

    layer_types: tuple[str, ...]  # per trunk block: LINEAR (Gated DeltaNet) or FULL attention
    linear_num_key_heads: int  # ssm.group_count
    linear_num_value_heads: int  # ssm.time_step_rank
    linear_key_head_dim: int  # ssm.state_size
    linear_value_head_dim: int  # ssm.inner_size / linear_num_value_heads
    linear_conv_kernel_dim: int  # ssm.conv_kernel
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # rope.dimension_sections: padded to 4, summing to rotary_dim / 2
    rope_scaling: RopeScaling | None = None
    full_attention_interval: int  # the value written: the layers' period (Qwen3-Next: as configured)
    intermediate_size: int = 0  # dense MLP width (feed_forward_length); 0 where none is written
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def recurrent(self) -> tuple[bool, ...]:
        """Per trunk block: Gated DeltaNet (True) or full attention."""
        return tuple(t == LINEAR for t in self.layer_types)

    @property
    def value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_qk_channels(self) -> int:
        """Width of the Gated DeltaNet's q | k channels."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        return self.linear_qk_channels + self.linear_value_width

    # ---- config.json --------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any], arch: str) -> Qwen35HParams:
        """`arch` is the GGUF architecture: qwen35 is dense, the others MoE."""
        moe = arch != names.QWEN35
        cfg = ConfigReader(config)
        tc = cfg.text_model()
        num_hidden_layers = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        hidden = tc.integer("hidden_size", min=1)
        num_attention_heads = tc.integer("num_attention_heads", min=1)
        head_dim = tc.integer("head_dim", default=hidden // num_attention_heads, min=1)
        nk = tc.integer("linear_num_key_heads", default=16, min=1)
        nv = tc.integer("linear_num_value_heads", default=32, min=1)
        dk = tc.integer("linear_key_head_dim", default=128, min=1)
        dv = tc.integer("linear_value_head_dim", default=128, min=1)
        if dk != dv:
            raise SpecconvError(f"config.json: linear_key_head_dim ({dk}) != linear_value_head_dim ({dv}); "
                                f"llama.cpp's qwen35 loader uses one ssm.state_size for both")
        if nv % nk:
            raise SpecconvError(f"config.json: linear_num_value_heads ({nv}) is not a multiple of "
                                f"linear_num_key_heads ({nk})")

        # llama.cpp's qwen35 graphs have no attention biases and hard-code SiLU.
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's qwen35 has no "
                                "attention biases)")
        act = tc.string("hidden_act", default="silu")
        if act != "silu":
            raise SpecconvError(f"config.json: hidden_act {act!r} is not supported (qwen35 uses silu)")

        factor = tc.with_rope().number("partial_rotary_factor", default=0.25)
        if not 0 < factor <= 1:
            raise SpecconvError(f"config.json: partial_rotary_factor {factor} is not in (0, 1]")
        rotary_dim = int(head_dim * factor)
        types = layer_types_of(tc, num_hidden_layers)
        configured_interval = tc.integer("full_attention_interval", default=None)

        # The wrapper's own flag governs tying in transformers (model.config is the outer config).
        tie = cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False))
        mtp = tc.integer("mtp_num_hidden_layers", default=cfg.integer("mtp_num_hidden_layers", default=0))
        if tc.flag("mtp_use_dedicated_embeddings", default=False):
            raise SpecconvError("config.json: mtp_use_dedicated_embeddings=true is not supported "
                                "(llama.cpp's qwen35 MTP head uses the trunk embedding)")

        experts: dict[str, int] = {}
        if moe:
            experts = dict(num_experts=tc.integer("num_experts", min=1),
                           num_experts_per_tok=tc.integer("num_experts_per_tok", min=1),
                           moe_intermediate_size=tc.integer("moe_intermediate_size", min=1),
                           shared_expert_intermediate_size=tc.integer("shared_expert_intermediate_size", min=1))
            if experts["num_experts_per_tok"] > experts["num_experts"]:
                raise SpecconvError(f"config.json: num_experts_per_tok ({experts['num_experts_per_tok']}) exceeds "
                                    f"num_experts ({experts['num_experts']})")

        return cls(
            arch=arch, num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=mtp, hidden_size=hidden,
            vocab_size=tc.integer("vocab_size", min=1), num_attention_heads=num_attention_heads,
            num_key_value_heads=tc.integer("num_key_value_heads", default=num_attention_heads, min=1),
            head_dim=head_dim, intermediate_size=0 if moe else tc.integer("intermediate_size", min=1),
            layer_types=types, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
            linear_value_head_dim=dv, linear_conv_kernel_dim=tc.integer("linear_conv_kernel_dim", default=4, min=1),
            max_position_embeddings=tc.integer("max_position_embeddings", default=32768, min=1),
            rms_norm_eps=tc.number("rms_norm_eps", default=1e-6) or 1e-6,
            rope_theta=tc.with_rope().number("rope_theta", default=10000.0),
            rotary_dim=rotary_dim, mrope_section=_rope_sections(tc, rotary_dim),
            rope_scaling=rope_scaling_of(tc, "Qwen3.5", unscaled=("default", "mrope")),
            full_attention_interval=attention_interval(types, configured_interval),
            tie_word_embeddings=tie, **experts,
        )

    # ---- GGUF metadata ------------------------------------------------------------------------

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> Qwen35HParams:
        """The hyperparameters of a file (runtime/validate.py has checked its keys' types and ranges)."""
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        n, nextn = r.block_counts()
        key_len, val_len = key("attention.key_length", type=int), key("attention.value_length", type=int)
        if key_len != val_len:
            raise SpecconvError(f"attention.key_length {key_len} != value_length {val_len}")
        interval = key("full_attention_interval", 4, int)
        rec = key("attention.recurrent_layers", None, list)
        recurrent = ([bool(x) for x in rec[:n]] if rec is not None
                     else [(i + 1) % interval != 0 for i in range(n)])
        rotary_dim = key("rope.dimension_count", key_len, int)
        nk, nv = key("ssm.group_count", type=int), key("ssm.time_step_rank", type=int)
        dk, inner = key("ssm.state_size", type=int), key("ssm.inner_size", type=int)
        hp = cls(
            arch=arch, num_hidden_layers=n, num_nextn_predict_layers=nextn,
            hidden_size=key("embedding_length", type=int),
            vocab_size=r.vocab_size(),
            num_attention_heads=key("attention.head_count", type=int),
            num_key_value_heads=_scalar(key("attention.head_count_kv")), head_dim=key_len, rotary_dim=rotary_dim,
            rope_theta=key("rope.freq_base", 10000.0, float),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
            layer_types=tuple(LINEAR if x else FULL for x in recurrent), full_attention_interval=interval,
            linear_conv_kernel_dim=key("ssm.conv_kernel", type=int), linear_key_head_dim=dk,
            linear_num_key_heads=nk, linear_num_value_heads=nv, linear_value_head_dim=inner // nv,
            intermediate_size=_scalar(key("feed_forward_length", 0)),
            num_experts=key("expert_count", 0, int), num_experts_per_tok=key("expert_used_count", 0, int),
            moe_intermediate_size=key("expert_feed_forward_length", 0, int),
            shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0, int),
            max_position_embeddings=key("context_length", 0, int),
            mrope_section=tuple(key("rope.dimension_sections", [rotary_dim // 2, 0, 0, 0], list)),
            rope_scaling=_rope_scaling_of_kv(r), from_file=True,
        )
        if inner % nv or nv % nk:
            raise SpecconvError(f"inconsistent SSM sizes: inner {inner}, heads {nv}, groups {nk}")
        if arch == names.QWEN35MOE and not hp.num_experts:
            raise SpecconvError("qwen35moe file without expert_count")
        if hp.is_moe and not (hp.moe_intermediate_size and hp.shared_expert_intermediate_size):
            raise SpecconvError(f"{arch}: expert_feed_forward_length and expert_shared_feed_forward_length are needed")
        if not hp.is_moe and not hp.intermediate_size:
            raise SpecconvError(f"{arch}.feed_forward_length is missing or 0")
        return hp


def layer_types_of(tc: ConfigReader, num_hidden_layers: int) -> tuple[str, ...]:
    """`layer_types`, or what transformers derives from `full_attention_interval` (default 4)."""
    types = tc.strings("layer_types", default=None)
    if types is None:
        interval = tc.integer("full_attention_interval", default=4, min=1)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_hidden_layers))
    types = tuple(types)
    if len(types) != num_hidden_layers:
        raise tc.error("layer_types", f"has {len(types)} entries, num_hidden_layers is {num_hidden_layers}")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad:
        raise tc.error("layer_types", f"holds unknown layer type(s) {', '.join(bad)} "
                                      f"(Qwen3.5 knows '{LINEAR}' and '{FULL}')")
    return types


def attention_interval(types: tuple[str, ...], configured: int | None) -> int:
    """The `full_attention_interval` to write: a period p with full(i) == ((i+1) % p == 0) for all i.

    transformers v5 does not save `full_attention_interval`, so the config value (or the default 4)
    can be stale; llama.cpp falls back to it when `recurrent_layers` is missing. Prefer the configured
    value when it matches the layers, else the smallest period that does. When `layer_types` has no
    period at all the key cannot be right; `recurrent_layers` (always written) is what counts then.
    """
    def fits(p: int) -> bool:
        return all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types))

    preferred = configured if configured else 4
    if fits(preferred):
        return preferred
    for p in range(1, len(types) + 2):
        if fits(p):
            return p
    return preferred


def _rope_sections(tc: ConfigReader, rope_dim: int) -> tuple[int, int, int, int]:
    """`mrope_section` padded to 4, or [rot/2, 0, 0, 0]; must add up to rot/2 (llama.cpp asserts)."""
    if rope_dim % 2:
        raise SpecconvError(f"rotary dimension {rope_dim} (head_dim * partial_rotary_factor) is odd")
    section = tc.with_rope().integers("mrope_section", default=None)
    if section is None:
        return (rope_dim // 2, 0, 0, 0)
    if len(section) > 4:
        raise SpecconvError(f"config.json: mrope_section {section} has more than 4 entries")
    padded = tuple(section + [0] * (4 - len(section)))
    if sum(padded) != rope_dim // 2:
        raise SpecconvError(f"config.json: mrope_section {section} sums to {sum(padded)}, but the rotary "
                            f"dimension {rope_dim} needs sections summing to {rope_dim // 2}")
    return padded  # type: ignore[return-value]


def _scalar(v):
    """head_count_kv / feed_forward_length may be per-layer lists; the qwen35 graph needs one value."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise SpecconvError(f"per-layer values {v} are not supported by the qwen35 graph")
        return v[0]
    return v


def _rope_scaling_of_kv(r: HParamsReader) -> RopeScaling | None:
    """rope.scaling.* as archs/metadata.py writes them (None: unscaled)."""
    kind = r.key("rope.scaling.type", None, str)
    if kind in (None, "none"):
        return None
    def opt(name: str) -> float | None:
        return r.key(f"rope.scaling.{name}", None, float)

    if kind != "yarn":
        return RopeScaling(kind, opt("factor"))
    return RopeScaling(kind, opt("factor"), r.key("rope.scaling.original_context_length", None, int),
                       opt("yarn_ext_factor"), opt("yarn_attn_factor"), opt("yarn_beta_fast"), opt("yarn_beta_slow"))
