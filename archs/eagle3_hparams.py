"""An EAGLE-3 head's hyperparameters (docs/eagle3.md): `Eagle3HParams`, LLaMA's (archs/llama.py) plus
what the head reads of its target, built from the head's and the target's config.json by the plugin
(archs/eagle3.py, `from_config`) and from GGUF metadata by the graph (runtime/graphs/eagle3.py,
`from_kv`); and where a head's config names the target layers it reads, in which convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import names
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .hparams import HParamsReader
from .llama import LlamaHParams, llama_layer_config

# Where a head's config names its target layers, and whether that key names layer inputs (0) or
# layer outputs (+1 to make them inputs). Checked in this order; the first present wins.
LAYER_ID_KEYS = (
    (("eagle_config", "eagle_aux_hidden_state_layer_ids"), 1, "SpecForge / SGLang: layer outputs"),
    (("eagle_aux_hidden_state_layer_ids",), 0, "EAGLE / vLLM / speculators: layer inputs"),
    (("aux_hidden_states_layer_ids",), 1, "AngelSlim: layer outputs"),
)


def config_layer_ids(config: ConfigReader, path: tuple[str, ...]) -> list[int] | None:
    """The integer ids at `path` (keys into nested objects), or None when absent or empty."""
    node = config
    for key in path[:-1]:
        node = node.section(key)
    return node.integers(path[-1], default=None) or None


def resolve_target_layers(config: Mapping[str, Any], num_hidden_layers: int,
                          override: Sequence[int] | None = None) -> tuple[list[int], str, list[str]]:
    """(layer inputs for `eagle3.target_layers`, where they came from, notices) for a head's config.

    `config` is the head's config.json as saved (speculators' `transformer_layer_config` is not
    merged: the ids sit at its top level or in `eagle_config`). `override`: `--target-layers`."""
    config = ConfigReader(config)
    notices: list[str] = []
    if override is not None:
        layers, source = [int(i) for i in override], "--target-layers (layer inputs)"
    else:
        found = [(".".join(path), ids, shift, who) for path, shift, who in LAYER_ID_KEYS
                 if (ids := config_layer_ids(config, path)) is not None]
        if found:
            key, ids, shift, who = found[0]
            layers = [i + shift for i in ids]
            source = f"{key} {ids} ({who})" + (" + 1" if shift else "")
            for other_key, other_ids, other_shift, _ in found[1:]:
                if [i + other_shift for i in other_ids] != layers:
                    notices.append(f"{other_key} {other_ids} disagrees with {key} {ids}; using {key} "
                                   f"(layer inputs {layers}); give --target-layers if the head was trained otherwise")
        else:
            layers, source = [2, num_hidden_layers // 2, num_hidden_layers - 3], "default [2, L//2, L-3] (layer inputs)"
    if len(layers) != 3:
        raise SpecconvError(f"an EAGLE-3 head reads 3 target layers, {source} gives {layers}")
    bad = [j for j in layers if not 0 <= j <= num_hidden_layers]
    if bad:
        raise SpecconvError(f"target layer {bad[0]} (from {source}) is outside 0..{num_hidden_layers}: the target has {num_hidden_layers} "
                            f"layers (layer input {num_hidden_layers} is its final normed output)")
    return layers, source, notices


def angelslim_default_notice(num_hidden_layers: int) -> str:
    """AngelSlim trains a head without ids on ITS default, [1, (L+1)//2-1, L-3] as layer outputs (docs/eagle3.md);
    the config cannot tell an AngelSlim head from others named Eagle3LlamaForCausalLM, so this is only said."""
    inputs = [2, (num_hidden_layers + 1) // 2, num_hidden_layers - 2]
    return (f"no layer ids in config.json: if AngelSlim trained this head, it read layer inputs {inputs} (its default), "
            f"not [2, {num_hidden_layers // 2}, {num_hidden_layers - 3}]: give --target-layers {','.join(map(str, inputs))}")


DRAFT_VOCAB_FROM_FILE = "Vd"  # a file's draft vocabulary: no key states it, d2t's length binds it


@dataclass(kw_only=True)
class Eagle3HParams(LlamaHParams):
    """An EAGLE-3 head's hyperparameters: its one LLaMA layer (on [embedding ; fused features], 2·hidden
    wide), what it reads of its target, and transformers' / the EAGLE authors' config names. The
    vocabulary is the target's (token_embd and, without d2t, output span it)."""

    arch: str = names.EAGLE3
    target_layers: tuple[int, ...] = ()  # target layer INPUTS (llama.cpp's convention)
    target_hidden_size: int = 0
    draft_vocab_size: int = 0  # rows of the head's own output (d2t's length); config.json only
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    @property
    def attention_input_width(self) -> int:
        return 2 * self.hidden_size

    @property
    def vocab_dim(self) -> int:
        return self.vocab_size  # the file states it (eagle3.vocab_size): the target's, which token_embd spans

    @property
    def draft_vocab_dim(self) -> int | str:
        return DRAFT_VOCAB_FROM_FILE if self.from_file else self.draft_vocab_size

    @classmethod
    def from_config(cls, config: Mapping[str, Any], target_config: Mapping[str, Any],
                    target_layers: Sequence[int] | None = None) -> "Eagle3HParams":
        """From the head's config.json (speculators' `transformer_layer_config` merged in) and its target's;
        `target_layers`: --target-layers (layer inputs), else the config's ids (resolve_target_layers)."""
        cfg = ConfigReader(config).merged("transformer_layer_config")
        target = ConfigReader(target_config, file="the target's config.json").text_model()
        heads, n_kv, hd = cfg.attention_heads()
        hidden_size, ffn = cfg.integer("hidden_size", min=1), cfg.integer("intermediate_size", min=1)
        vocab, target_layer_count = target.integer("vocab_size", min=1), target.integer("num_hidden_layers", min=1,
                                                                                         max=MAX_LAYERS)
        for key in ("fc_norm", "norm_output"):  # EAGLE-3.1 options (per-feature norms before fc, ...): not in the GGUF
            if cfg.flag(key, default=False):
                raise SpecconvError(f"config.json: {key}=true (an EAGLE-3.1 head) is not supported: llama.cpp's eagle3 "
                                    f"graph has no such norm")
        n_layers = cfg.integer("num_hidden_layers", default=1)
        if n_layers != 1:
            raise SpecconvError(f"an EAGLE-3 head has one decoder layer, config.json says {n_layers}")
        own_vocab = cfg.integer("vocab_size", default=None)
        if own_vocab is not None and own_vocab != vocab:
            raise SpecconvError(f"the EAGLE-3 head was trained for a vocabulary of {own_vocab} tokens, but the target "
                                f"has {vocab}: wrong --target")
        draft_vocab = cfg.integer("draft_vocab_size", default=None, min=1) or vocab
        target_hidden = target.integer("hidden_size", min=1)
        own = cfg.integer("target_hidden_size", default=None)
        if own is not None and own != target_hidden:
            raise SpecconvError(f"the EAGLE-3 head expects target hidden size {own}, but the target has "
                                f"{target_hidden}: wrong --target")
        layers, _, _ = resolve_target_layers(config, target_layer_count, target_layers)
        return cls(**{**llama_layer_config(cfg), "vocab_size": vocab, "states_head_dim": True},  # key_length always written
                   num_hidden_layers=1, hidden_size=hidden_size, intermediate_size=ffn, num_attention_heads=heads,
                   num_key_value_heads=n_kv, head_dim=hd, rotary_dim=hd, target_layers=tuple(layers),
                   target_hidden_size=target_hidden, draft_vocab_size=draft_vocab,
                   norm_before_residual=cfg.flag("norm_before_residual", default=False),
                   norm_before_fc=cfg.flag("norm_before_fc", default=False))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Eagle3HParams":
        base = LlamaHParams.from_kv(kv)
        key = HParamsReader(kv).key
        layers = key("target_layers", None, list)
        if layers is None or len(layers) != 3:
            raise SpecconvError(f"an eagle3 file needs {names.target_layers_key(base.arch)} with exactly 3 entries")
        ht = key("target_hidden_size", type=int)
        if base.num_hidden_layers != 1:
            raise SpecconvError(f"an eagle3 head has one decoder layer, this file declares {base.num_hidden_layers}")
        return cls(**vars(base), target_layers=tuple(int(x) for x in layers), target_hidden_size=int(ht),
                   norm_before_residual=key("norm_before_residual", False, bool),
                   norm_before_fc=key("norm_before_fc", False, bool))
