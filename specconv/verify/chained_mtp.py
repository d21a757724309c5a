"""`verify --hf` for heads with several chained MTP blocks (hy_v3, step35, mimo2; docs/mtp.md §Chained MTP heads).

transformers' generic `MtpModel` does not load these releases' MTP layers (Hy3's `final_layernorm`
and `router.gate`, Step-3.5's `transformer.shared_head` and stacked `moe.*` names are not in its key
mapping, so they would come up random), so each block j is transformers' own `MtpLayer` around the
family's decoder layer class, loaded with `load_state_dict(strict=True)` from the release tensors of
layer N+j. Every block is judged alone on llama.cpp's rows (row p = (x_p, h_{p-1}), h_{-1} = 0) fed
transformers' trunk hidden states (post-norm, or pre-norm where the graph's TARGET_HIDDEN says so):
a perturbed block other than the first fails its own check.

transformers 5.23 has no Step3p5 CausalLM class: `step35_reference` is its `Step3p7TextModel`, built
from the release config.json, plus an LM head; its MiMoV2FlashConfig ignores the release's layer
pattern and rope fields: `mimo2_reference` builds the config from them. Both are loaded from the
release tensors and any missing or unexpected key is reported (`REFERENCES`, used by
parity.load_reference).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch

from specconv.errors import SpecconvError
from specconv.runtime import Context, GraphType
from specconv.runtime.drafters.mtp import block_view
from specconv.verify.parity import input_device, module_device, reference_precision, round_as_stored_


def _hy_v3_name(rel: str) -> str:
    """Release name inside an MTP layer -> MtpLayer state-dict name."""
    if rel.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return rel
    if rel.startswith("final_layernorm."):
        return "post_norm." + rel.split(".", 1)[1]
    rel = rel.replace("mlp.router.gate.", "mlp.gate.").replace("mlp.expert_bias", "mlp.e_score_correction_bias")
    return "mtp_block." + rel.replace("mlp.shared_mlp.", "mlp.shared_experts.")


def _hy_v3_config(config, k: int, hf_dir: Path):
    cfg = copy.deepcopy(config)
    cfg.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"] * k  # the MTP blocks are MoE blocks
    return cfg


def _step35_trunk_name(rel: str) -> str:
    rel = rel.replace("moe.gate.weight", "mlp.gate.weight").replace("moe.router_bias", "mlp.gate.e_score_correction_bias")
    return rel.replace("share_expert.", "mlp.shared_experts.")


def _step35_name(rel: str) -> str | None:
    if rel.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return rel
    if rel.startswith("transformer.shared_head.norm."):
        return "post_norm." + rel.rsplit(".", 1)[1]
    if rel.startswith(("transformer.shared_head.output.", "embed_tokens.")):
        return None  # copies of the LM head / embedding: the trunk's are used
    return "mtp_block." + _step35_trunk_name(rel)


def _step35_text_config(hf_dir: Path, all_layers: bool):
    from transformers import Step3p7TextConfig

    raw = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    raw = raw.get("text_config", raw)
    d = {a: b for a, b in raw.items() if a not in ("architectures", "model_type", "transformers_version")}
    if all_layers:  # one config over all N + k layers: MtpLayer(config, N + j) reads block j's entries
        d["num_hidden_layers"] = raw["num_hidden_layers"] + int(raw.get("num_nextn_predict_layers", 0))
        d["num_nextn_predict_layers"] = 0
    cfg = Step3p7TextConfig(**d)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # grouped_mm (the default experts kernel) has no float64
    return cfg


def _step35_config(config, k: int, hf_dir: Path):
    return _step35_text_config(hf_dir, all_layers=True)


def _mimo2_name(rel: str) -> str | None:
    if rel.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return rel
    if rel.startswith("final_layernorm."):
        return "post_norm." + rel.rsplit(".", 1)[1]
    rel = rel.replace("pre_mlp_layernorm.", "post_attention_layernorm.")
    return "mtp_block." + rel.replace("self_attn.attention_sink_bias", "self_attn.sinks")


def _mimo2_text_config(hf_dir: Path, k: int = 0):
    """transformers' MiMoV2FlashConfig with the release's own fields: transformers 5.23 ignores
    `hybrid_layer_pattern`, `rope_theta` / `swa_rope_theta`, `partial_rotary_factor` and
    `layernorm_epsilon` and applies its defaults instead. k > 0: over N + k layers, the MTP blocks
    being sliding-window blocks with a dense MLP (vLLM's MiMoV2MTPLayer)."""
    from transformers import MiMoV2FlashConfig

    raw = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    n = raw["num_hidden_layers"]
    pattern = raw.get("hybrid_layer_pattern") or [int(t == "sliding_attention") for t in raw["layer_types"]]
    freq = raw.get("moe_layer_freq") or [int(i > 0) for i in range(n)]
    rope = lambda theta: {"rope_type": "default", "rope_theta": float(theta),  # noqa: E731
                          "partial_rotary_factor": float(raw.get("partial_rotary_factor", 1.0))}
    window = raw.get("sliding_window_size")
    cfg = MiMoV2FlashConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=n + k, num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"], v_head_dim=raw["v_head_dim"],
        layer_types=["sliding_attention" if x else "full_attention" for x in pattern[:n]] + ["sliding_attention"] * k,
        mlp_layer_types=["sparse" if x else "dense" for x in freq[:n]] + ["dense"] * k,
        rope_parameters={"full_attention": rope(raw.get("rope_theta", 10000.0)),
                         "sliding_attention": rope(raw.get("swa_rope_theta", raw.get("rope_theta", 10000.0)))},
        sliding_window=int(window) + 1 if window is not None else raw["sliding_window"],
        attention_value_scale=raw.get("attention_value_scale"), n_routed_experts=raw["n_routed_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"], moe_intermediate_size=raw["moe_intermediate_size"],
        n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1,
        norm_topk_prob=raw.get("norm_topk_prob", True), routed_scaling_factor=raw.get("routed_scaling_factor") or 1.0,
        rms_norm_eps=raw.get("layernorm_epsilon", raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=raw.get("tie_word_embeddings", False))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # grouped_mm (the default experts kernel) has no float64
    return cfg


def _mimo2_config(config, k: int, hf_dir: Path):
    return _mimo2_text_config(hf_dir, k)


def mimo2_reference(hf_dir: Path, dtype: torch.dtype = torch.float32):
    """(model, load problems): transformers' MiMoV2FlashForCausalLM with the release's config fields."""
    from transformers import MiMoV2FlashForCausalLM

    model = MiMoV2FlashForCausalLM(_mimo2_text_config(hf_dir))
    state = {name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks"): t
             for name, t in _release_tensors(hf_dir, "", "mimo2").items() if not name.startswith("model.mtp.")}
    bad = model.load_state_dict(_fuse_experts(state), strict=False)
    problems = {k: v for k, v in (("missing_keys", bad.missing_keys), ("unexpected_keys", bad.unexpected_keys)) if v}
    model.config._name_or_path = str(hf_dir)
    return model.to(dtype).eval(), problems


FAMILIES = {"hy_v3": (_hy_v3_name, _hy_v3_config), "step35": (_step35_name, _step35_config),
            "mimo2": (_mimo2_name, _mimo2_config)}
# where block j's tensors sit in the release
PREFIX = {"mimo2": lambda n, j: f"model.mtp.layers.{j}."}


class _Step35Causal(torch.nn.Module):
    """Step3p7TextModel + LM head, answering like a transformers CausalLM (logits, hidden_states)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import Step3p7TextModel

        self.model, self.config = Step3p7TextModel(cfg), cfg
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def get_decoder(self):
        return self.model

    def forward(self, input_ids, output_hidden_states=False, use_cache=False, **kwargs):
        from types import SimpleNamespace

        post = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(post), hidden_states=(post,))


def step35_reference(hf_dir: Path, dtype: torch.dtype = torch.float32):
    """(model, load problems): transformers' Step-3.5 text model and LM head from the release files."""
    cfg = _step35_text_config(hf_dir, all_layers=False)
    model = _Step35Causal(cfg)
    n = cfg.num_hidden_layers
    state = {}
    for name, t in _release_tensors(hf_dir, "", "step35").items():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= n:
            continue
        state[_step35_trunk_name(name)] = t
    bad = model.load_state_dict(_fuse_experts(state), strict=False)
    problems = {k: v for k, v in (("missing_keys", bad.missing_keys), ("unexpected_keys", bad.unexpected_keys)) if v}
    model.config._name_or_path = str(hf_dir)
    return model.to(dtype).eval(), problems


REFERENCES = {"step35": step35_reference, "mimo2": mimo2_reference}


def _release_tensors(hf_dir: Path, prefix: str, family: str) -> dict[str, torch.Tensor]:
    """The language model's tensors under `prefix` (which is dropped), named as the family's plugin
    names them: a VL release's `model.language_model.*` read as `model.*` (Step-3.7), towers and the
    tensors a text GGUF leaves out skipped."""
    from safetensors import safe_open

    from specconv.archs import plugin_class_for_family

    normalize = plugin_class_for_family(family).normalize_name
    index = hf_dir / "model.safetensors.index.json"
    files = (sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else sorted(hf_dir.glob("*.safetensors")))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for raw in st.keys():
                name = normalize(raw)
                if isinstance(name, str) and name.startswith(prefix):
                    out[name[len(prefix):]] = st.get_tensor(raw)
    return out


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` or stacked `moe.{gate,up,down}_proj.weight`
    -> transformers' fused 3-D experts `mlp.experts.gate_up_proj` / `down_proj`."""
    per = re.compile(r"^(.*)mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
    stacked = re.compile(r"^(.*)moe\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[str, torch.Tensor | dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m, s = per.match(name), stacked.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        elif s:
            groups.setdefault(s.group(1), {})[s.group(2)] = t
        else:
            out[name] = t
    for base, parts in groups.items():
        stack = {p: torch.stack([v[e] for e in range(len(v))]) if isinstance(v, dict) else v for p, v in parts.items()}
        out[base + "mlp.experts.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        out[base + "mlp.experts.down_proj"] = stack["down"]
    return out


def load_blocks(main, family: str, hf_dir: Path, k: int) -> list:
    """transformers' MtpLayer for each of the k blocks, with the release's weights (strict)."""
    from transformers.modeling_layers import MtpLayer

    if family not in FAMILIES:
        raise SpecconvError(f"--hf: no chained-MTP reference for {family!r}")
    rename, adjust = FAMILIES[family]
    base = main.get_decoder()
    layer_cls, norm_cls = type(base.layers[-1]), type(base.norm)
    cfg = adjust(main.config, k, hf_dir)
    dtype = next(main.parameters()).dtype
    n = main.config.num_hidden_layers
    blocks = []
    for j in range(k):
        layer = MtpLayer(cfg, layer_cls, norm_cls, n + j, use_post_norm=True)
        raw = _release_tensors(hf_dir, PREFIX.get(family, lambda n, j: f"model.layers.{n + j}.")(n, j), family)
        raw = {r: t for r, t in raw.items() if not r.startswith(("embed_tokens.", "shared_head."))}
        if not raw:
            raise SpecconvError(f"--hf {hf_dir}: no model.layers.{n + j}.* tensors (MTP block {j})")
        named = {rename(r): t for r, t in raw.items()}
        layer.load_state_dict(_fuse_experts({a: b for a, b in named.items() if a is not None}), strict=True)
        layer = layer.to(input_device(main), dtype).eval()  # where the trunk's embedding is
        if dtype == torch.float64:
            round_as_stored_(layer)
        blocks.append(layer)
    return blocks


@torch.no_grad()
def block_logits(main, layer, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """One MTP block on explicit rows, causal (within its sliding window, if any), no cache, through
    the trunk's LM head."""
    dev = module_device(layer)
    e = main.get_input_embeddings()(torch.tensor([tokens], device=input_device(main))).to(dev)
    h = hidden[None].to(dev, e.dtype)
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
    p = torch.tensor(positions, device=dev)
    ok = p[None, :] <= p[:, None]
    kind = getattr(layer.mtp_block, "attention_type", None) or getattr(layer.mtp_block.self_attn, "layer_type", None)
    if kind == "sliding_attention":
        ok &= (p[:, None] - p[None, :]) < layer.config.sliding_window
    mask = torch.zeros(ok.shape, device=dev, dtype=x.dtype).masked_fill(~ok, float("-inf"))[None, None]
    pos = p[None]
    rotary = main.get_decoder().rotary_emb
    at = module_device(rotary)
    rope = rotary(x.to(at), pos.to(at), kind) if kind is not None else rotary(x.to(at), pos.to(at))
    y = layer.mtp_block(x, attention_mask=mask, position_embeddings=tuple(r.to(dev) for r in rope), position_ids=pos)
    head = main.get_output_embeddings()
    return head(layer.post_norm(y).to(module_device(head)))[0].cpu()


@torch.no_grad()
def _pre_norm_rows(main, prompts) -> list[torch.Tensor]:
    """The trunk's hidden rows before its final norm (the input of that norm)."""
    rows = []

    def keep(module, args, out):  # returns None, so the norm's output is left alone
        rows.append(args[0][0].cpu())

    hook = main.get_decoder().norm.register_forward_hook(keep)
    try:
        for ids in prompts:
            main(torch.tensor([ids], device=input_device(main)), use_cache=False)
    finally:
        hook.remove()
    return rows


def chained_mtp_check(report, head, main, prompts, hidden, judge, ref: str, errors) -> None:
    """One check per MTP block; report.parity gains `mtp` (the worst block) and `mtp_blocks`."""
    k = head.hparams.num_nextn_predict_layers
    hf_dir = Path(getattr(main.config, "_name_or_path", "") or getattr(main.config, "name_or_path", ""))
    try:
        blocks = load_blocks(main, head.arch, hf_dir, k)
    except Exception as exc:
        report.add("parity: MTP blocks vs transformers", False, f"no MTP reference: {type(exc).__name__}: {exc}")
        return
    if head.graph.TARGET_HIDDEN == "pre_norm":  # step35 reads the pre-norm rows
        hidden = _pre_norm_rows(main, prompts)
    worst_all, per_block = 0.0, []
    for j, layer in enumerate(blocks):
        view = block_view(head, j)
        worst, rels = 0.0, []
        for ids, h in zip(prompts, hidden):
            rows = torch.cat([torch.zeros(1, h.shape[1], dtype=h.dtype, device=h.device), h[:-1]])
            pos = list(range(len(ids)))
            ours = Context(view, GraphType.MTP, n_ctx=len(ids)).decode(ids, pos, hidden_in=rows.to(head.device))
            with reference_precision(layer):
                ref_logits = block_logits(main, layer, ids, rows, pos)
            m, r = errors(ours.logits.cpu(), ref_logits)
            worst, rels = max(worst, m), rels + [r]
        judge(f"parity: MTP block {j} vs transformers", worst, sum(rels) / len(rels))
        per_block.append(worst)
        worst_all = max(worst_all, worst)
    report.parity.update(mtp=worst_all, mtp_blocks=per_block, reference=ref + " + MtpLayer per block",
                         max_abs_logit_diff=max(report.parity["trunk"], worst_all))
