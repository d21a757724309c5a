"""An EAGLE-3 head computed from its Hugging Face checkpoint, fed by transformers' target (`--draft-hf`).

Independent of the converter and the runtime: the head's tensors are read from its safetensors under
their HF names (q/k in rotate-half order, `d2t` as offsets), its rope comes from transformers'
`LlamaRotaryEmbedding` built from the head's config, and the three target features are taken from
the transformers target's `hidden_states`, with the layer ids read from the head's config in each
trainer's convention (docs/eagle3.md):
* `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge, read by SGLang) and
  `aux_hidden_states_layer_ids` (AngelSlim) name layer OUTPUTS: id i is `hidden_states[i + 1]`;
* a top-level `eagle_aux_hidden_state_layer_ids` (EAGLE authors, vLLM, speculators) names layer
  INPUTS: id i is `hidden_states[i]`;
* none: `[2, L//2, L-3]`, layer inputs.
Rows are those of the runtime and llama.cpp: the decoder row at position t takes (x_{t+1}, g_t).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specconv.archs.config_reader import ConfigReader
from specconv.archs.eagle3_hparams import config_layer_ids
from specconv.errors import SpecconvError
from specconv.verify.parity import input_device, module_device

# (config path, hidden_states offset): the first key present decides
_ID_KEYS = ((("eagle_config", "eagle_aux_hidden_state_layer_ids"), 1, "layer outputs"),
            (("eagle_aux_hidden_state_layer_ids",), 0, "layer inputs"),
            (("aux_hidden_states_layer_ids",), 1, "layer outputs"))
_LAYER = ("midlayer.", "layers.0.")  # the decoder layer's names in the two layouts
CPU = torch.device("cpu")  # where the reference computes (its tensors are read there)


def hidden_state_indices(config: dict, num_hidden_layers: int) -> tuple[list[int], str]:
    """(indices into transformers' `hidden_states` of the target, how the config named them)."""
    for path, offset, what in _ID_KEYS:
        ids = config_layer_ids(ConfigReader(config, file="the head's config.json"), path)
        if ids:
            return [i + offset for i in ids], f"{'.'.join(path)} {ids} ({what})"
    return [2, num_hidden_layers // 2, num_hidden_layers - 3], "no ids in config.json, default [2, L//2, L-3] (layer inputs)"


class Eagle3Reference:
    """The head of `head_dir` in `dtype` on the CPU, computed from its HF tensors."""

    def __init__(self, head_dir: Path, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file

        head_dir = Path(head_dir)
        cfg_path = head_dir / "config.json"
        if not cfg_path.is_file():
            raise SpecconvError(f"--draft-hf {head_dir}: no config.json")
        self.raw_config = json.loads(cfg_path.read_text(encoding="utf-8"))
        nested = self.raw_config.get("transformer_layer_config")
        self.cfg = {**self.raw_config, **nested} if isinstance(nested, dict) else dict(self.raw_config)
        files = sorted(head_dir.glob("*.safetensors"))
        if not files:
            raise SpecconvError(f"--draft-hf {head_dir}: no *.safetensors")
        self.t: dict[str, torch.Tensor] = {}
        for f in files:
            for name, v in load_file(str(f)).items():
                name = name[len("model."):] if name.startswith("model.") else name
                for prefix in _LAYER:
                    if name.startswith(prefix):
                        name = "L." + name[len(prefix):]
                self.t[name] = v.to(dtype) if v.is_floating_point() else v
        self.dtype = dtype
        c = ConfigReader(self.raw_config, file=f"--draft-hf {head_dir}/config.json").merged("transformer_layer_config")
        self.eps = c.number("rms_norm_eps", default=1e-6)
        self.num_attention_heads = c.integer("num_attention_heads", min=1)
        self.n_kv = c.integer("num_key_value_heads", default=None, min=1) or self.num_attention_heads
        self.hd = c.integer("head_dim", default=None, min=1) or c.integer("hidden_size", min=1) // self.num_attention_heads
        self.norm_before_fc = c.flag("norm_before_fc", default=False)
        self.norm_before_residual = c.flag("norm_before_residual", default=False)
        # the rest of what the rope below reads (transformers' LlamaConfig)
        c.section("rope_scaling"), c.section("rope_parameters"), c.with_rope().number("rope_theta", default=None)
        c.integer("max_position_embeddings", default=None)
        self.rotary = self._rotary()

    def _rotary(self):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                "rope_parameters", "max_position_embeddings")
        return LlamaRotaryEmbedding(LlamaConfig(**{k: self.cfg[k] for k in keys if self.cfg.get(k) is not None}))

    def need(self, name: str) -> torch.Tensor:
        if name not in self.t:
            raise SpecconvError(f"--draft-hf: the head's checkpoint has no {name.replace('L.', 'midlayer.')}")
        return self.t[name]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def d2t(self) -> torch.Tensor | None:
        """Absolute target ids of the draft vocabulary (the checkpoint stores offsets), or None."""
        d = self.t.get("d2t")
        return None if d is None else d.long() + torch.arange(d.numel(), device=d.device)

    @torch.no_grad()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        f = features.to(self.dtype)
        if self.norm_before_fc:
            f = self._rms(f, self.need("input_norm.weight"))
        return f @ self.need("fc.weight").T

    @torch.no_grad()
    def decode(self, tokens, g: torch.Tensor, positions, target_embed, target_project) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass over rows (tokens[t], g[t]) at positions[t] -> (draft-vocabulary logits, pre-norm out).

        `target_embed(ids)` / `target_project(x)`: the target's embedding rows and output head, used when
        the head has none of its own (transformers' modules, called through any offloading hooks)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        tokens, pos = torch.as_tensor(tokens, device=CPU), torch.as_tensor(positions, device=CPU)
        own = self.t.get("embed_tokens.weight")
        rows = own[tokens] if own is not None else target_embed(tokens)
        g = g.to(self.dtype)
        n, nh, nkv, hd = tokens.shape[0], self.num_attention_heads, self.n_kv, self.hd
        e = self._rms(rows.to(self.dtype), self.need("L.input_layernorm.weight"))
        gn = self._rms(g, self.need("L.hidden_norm.weight"))
        c = torch.cat([e, gn], -1)
        q = (c @ self.need("L.self_attn.q_proj.weight").T).view(1, n, nh, hd).transpose(1, 2)
        k = (c @ self.need("L.self_attn.k_proj.weight").T).view(1, n, nkv, hd).transpose(1, 2)
        v = (c @ self.need("L.self_attn.v_proj.weight").T).view(1, n, nkv, hd).transpose(1, 2)
        cos, sin = self.rotary(v, pos[None])
        q, k = apply_rotary_pos_emb(q, k, cos.to(self.dtype), sin.to(self.dtype))
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~(pos[None, :] <= pos[:, None]), float("-inf"))
        o = (torch.softmax(scores.float(), -1).to(self.dtype) @ v).transpose(1, 2).reshape(n, nh * hd)
        r = (gn if self.norm_before_residual else g) + o @ self.need("L.self_attn.o_proj.weight").T
        x = self._rms(r, self.need("L.post_attention_layernorm.weight"))
        mlp = torch.nn.functional.silu(x @ self.need("L.mlp.gate_proj.weight").T) * (x @ self.need("L.mlp.up_proj.weight").T)
        out = r + mlp @ self.need("L.mlp.down_proj.weight").T
        normed = self._rms(out, self.need("norm.weight"))
        head = self.t.get("lm_head.weight")
        return (normed @ head.T if head is not None else target_project(normed).to(self.dtype)), out


def module_call(module):
    """`module(x)` for inputs and outputs on the CPU, whatever device (or offload hook) holds the module and
    whatever its dtype."""
    def call(x: torch.Tensor) -> torch.Tensor:
        dtype = next(module.parameters()).dtype if x.is_floating_point() else x.dtype
        with torch.no_grad():
            return module(x.to(module_device(module), dtype)).float().cpu()

    return call


@torch.no_grad()
def target_features(hf_target, ids, indices: list[int]) -> torch.Tensor:
    """[n, 3·Ht]: transformers' `hidden_states[k]` of the target for each k, concatenated (on the CPU)."""
    out = hf_target(torch.tensor([list(ids)], device=input_device(hf_target)), output_hidden_states=True,
                    use_cache=False)
    n_states = len(out.hidden_states)
    bad = [k for k in indices if not 0 <= k < n_states]
    if bad:
        raise SpecconvError(f"the head's config names target hidden state {bad[0]}, the target has "
                            f"{n_states} (0..{n_states - 1}): not this head's target")
    return torch.cat([out.hidden_states[k][0].float().cpu() for k in indices], -1)
