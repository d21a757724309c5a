"""`verify --hf` for heads with several chained MTP blocks (hy_v3; docs/mtp.md §Chained MTP heads).

transformers' generic `MtpModel` does not load these releases' MTP layers (Hy3's `final_layernorm`
and `router.gate` names are not in its key mapping, so they would come up random), so each block j
is transformers' own `MtpLayer` around the family's decoder layer class, loaded with
`load_state_dict(strict=True)` from the release tensors of layer N+j. Every block is judged alone on
llama.cpp's rows (row p = (x_p, h_{p-1}), h_{-1} = 0) fed transformers' trunk hidden states: a
perturbed block other than the first fails its own check.
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


def _hy_v3_name(rel: str) -> str:
    """Release name inside an MTP layer -> MtpLayer state-dict name."""
    if rel.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return rel
    if rel.startswith("final_layernorm."):
        return "post_norm." + rel.split(".", 1)[1]
    rel = rel.replace("mlp.router.gate.", "mlp.gate.").replace("mlp.expert_bias", "mlp.e_score_correction_bias")
    return "mtp_block." + rel.replace("mlp.shared_mlp.", "mlp.shared_experts.")


def _hy_v3_config(config, k: int):
    cfg = copy.deepcopy(config)
    cfg.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"] * k  # the MTP blocks are MoE blocks
    return cfg


FAMILIES = {"hy_v3": (_hy_v3_name, _hy_v3_config)}


def _release_tensors(hf_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    files = (sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else sorted(hf_dir.glob("*.safetensors")))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update({k[len(prefix):]: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
    return out


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> transformers' fused 3-D experts."""
    per = re.compile(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = per.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for base, parts in groups.items():
        n = len(parts.get("gate", {}))
        stack = lambda part: torch.stack([parts[part][e] for e in range(n)])  # noqa: E731
        out[base + "gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        out[base + "down_proj"] = stack("down")
    return out


def load_blocks(main, family: str, hf_dir: Path, k: int) -> list:
    """transformers' MtpLayer for each of the k blocks, with the release's weights (strict)."""
    from transformers.modeling_layers import MtpLayer

    if family not in FAMILIES:
        raise SpecconvError(f"--hf: no chained-MTP reference for {family!r}")
    rename, adjust = FAMILIES[family]
    base = main.get_decoder()
    layer_cls, norm_cls = type(base.layers[-1]), type(base.norm)
    cfg = adjust(main.config, k)
    dtype = next(main.parameters()).dtype
    n = main.config.num_hidden_layers
    blocks = []
    for j in range(k):
        layer = MtpLayer(cfg, layer_cls, norm_cls, n + j, use_post_norm=True)
        raw = _release_tensors(hf_dir, f"model.layers.{n + j}.")
        raw = {r: t for r, t in raw.items() if not r.startswith(("embed_tokens.", "shared_head."))}
        if not raw:
            raise SpecconvError(f"--hf {hf_dir}: no model.layers.{n + j}.* tensors (MTP block {j})")
        layer.load_state_dict(_fuse_experts({rename(r): t for r, t in raw.items()}), strict=True)
        blocks.append(layer.to(dtype).eval())
    return blocks


@torch.no_grad()
def block_logits(main, layer, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """One MTP block on explicit rows, causal, no cache (the shared head of the trunk)."""
    dev = next(layer.parameters()).device
    tok = torch.tensor([tokens], device=dev)
    e = main.get_input_embeddings()(tok).to(dev)
    h = hidden[None].to(dev, e.dtype)
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
    n = len(tokens)
    mask = torch.full((n, n), float("-inf"), device=dev, dtype=x.dtype).triu(1)[None, None]
    pos = torch.tensor([positions], device=dev)
    y = layer.mtp_block(x, attention_mask=mask, position_embeddings=main.get_decoder().rotary_emb(x, pos),
                        position_ids=pos)
    return main.get_output_embeddings()(layer.post_norm(y))[0].float().cpu()


def chained_mtp_check(report, head, main, prompts, hidden, judge, ref: str, errors) -> None:
    """One check per MTP block; report.parity gains `mtp` (the worst block) and `mtp_blocks`."""
    k = head.hparams.n_nextn
    hf_dir = Path(getattr(main.config, "_name_or_path", "") or getattr(main.config, "name_or_path", ""))
    try:
        blocks = load_blocks(main, head.arch, hf_dir, k)
    except Exception as exc:
        report.add("parity: MTP blocks vs transformers", False, f"no MTP reference: {type(exc).__name__}: {exc}")
        return
    worst_all, per_block = 0.0, []
    for j, layer in enumerate(blocks):
        view = block_view(head, j)
        worst, rels = 0.0, []
        for ids, h in zip(prompts, hidden):
            rows = torch.cat([torch.zeros(1, h.shape[1]), h[:-1].float()])
            pos = list(range(len(ids)))
            ours = Context(view, GraphType.MTP, n_ctx=len(ids)).decode(ids, pos, hidden_in=rows.to(head.device))
            m, r = errors(ours.logits.float().cpu(), block_logits(main, layer, ids, rows, pos))
            worst, rels = max(worst, m), rels + [r]
        judge(f"parity: MTP block {j} vs transformers", worst, sum(rels) / len(rels))
        per_block.append(worst)
        worst_all = max(worst_all, worst)
    report.parity.update(mtp=worst_all, mtp_blocks=per_block, reference=ref + " + MtpLayer per block",
                         max_abs_logit_diff=max(report.parity["trunk"], worst_all))
