"""A DFlash drafter computed from its Hugging Face checkpoint (`verify --draft D.gguf --hf TARGET
--draft-hf DFLASH_DIR`), fed by transformers' target: the check that a converted drafter reads the
right target layers and computes what its checkpoint computes (docs/dflash.md).

The reference follows the published architecture (not the runtime's graph): context rows
g = hidden_norm(fc · [hidden_states[id + 1] for id in dflash_config.target_layer_ids]); the block
[id_last, mask, ...] embedded with the target's embedding; per layer q/k/v of the block rows after
input_layernorm and k/v of the context rows without it, q/k RMS-normed per head, rotate-half rope at
the rows' positions, attention of every block row to every context and block row, o_proj, residual,
post-attention norm, SwiGLU, residual; final norm and the target's output head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specconv.archs.config_reader import MAX_LAYERS, ConfigReader
from specconv.errors import SpecconvError
from specconv.runtime import Context
from specconv.verify import parity
from specconv.verify.report import Report

CHECK = "parity: DFlash drafter vs its checkpoint"


class DFlashReference:
    def __init__(self, draft_dir: Path, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file

        draft_dir = Path(draft_dir)
        try:
            self.cfg = json.loads((draft_dir / "config.json").read_text(encoding="utf-8"))
            files = sorted(draft_dir.glob("*.safetensors"))
            if not files:
                raise SpecconvError(f"--draft-hf {draft_dir}: no safetensors")
            self.t = {}
            for f in files:
                self.t.update({k.removeprefix("model."): v.to(dtype) for k, v in load_file(str(f)).items()})
        except (OSError, ValueError) as exc:
            raise SpecconvError(f"--draft-hf {draft_dir}: {exc}") from None
        cfg = ConfigReader(self.cfg, file=f"--draft-hf {draft_dir}/config.json")
        self.layer_ids = cfg.section("dflash_config").integers(
            "target_layer_ids", default=cfg.integers("target_layer_ids", default=[]))
        if not self.layer_ids:
            raise SpecconvError(f"--draft-hf {draft_dir}: the config has no dflash_config.target_layer_ids")
        self.eps = cfg.number("rms_norm_eps", default=1e-6)
        self.theta = cfg.with_rope().number("rope_theta", default=10000.0)
        self.nh, self.nkv = cfg.integer("num_attention_heads", min=1), cfg.integer("num_key_value_heads", min=1)
        self.hd = cfg.integer("head_dim", default=None, min=1) or cfg.integer("hidden_size", min=1) // self.nh
        self.n_layers = cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)

    def need(self, name: str) -> torch.Tensor:
        if name not in self.t:
            raise SpecconvError(f"--draft-hf: the checkpoint lacks {name}")
        return self.t[name]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64, device=x.device).float() / self.hd))
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = (torch.cat([a, a], -1)[:, None, :].to(x.dtype) for a in (ang.cos(), ang.sin()))
        half = self.hd // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    @torch.no_grad()
    def block_logits(self, features: torch.Tensor, block_tokens, embed, project) -> torch.Tensor:
        """Logits of the block at positions m.., over the m context feature rows at positions 0..m-1."""
        t, nh, nkv, hd = self.t, self.nh, self.nkv, self.hd
        dtype = self.need("fc.weight").dtype
        g = self._rms(features.to(t["fc.weight"].device, dtype) @ t["fc.weight"].T, self.need("hidden_norm.weight"))
        x = embed(torch.as_tensor(list(block_tokens), device=g.device)).to(g.device, dtype)
        m, b = g.shape[0], x.shape[0]
        qpos, kpos = torch.arange(m, m + b, device=g.device), torch.arange(m + b, device=g.device)
        for i in range(self.n_layers):
            p = f"layers.{i}."
            a = self._rms(x, self.need(p + "input_layernorm.weight"))
            q = self._rms((a @ self.need(p + "self_attn.q_proj.weight").T).view(b, nh, hd), t[p + "self_attn.q_norm.weight"])
            kv_in = torch.cat([g, a])
            k = self._rms((kv_in @ t[p + "self_attn.k_proj.weight"].T).view(m + b, nkv, hd), t[p + "self_attn.k_norm.weight"])
            v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(m + b, nkv, hd)
            q, k = self._rope(q, qpos), self._rope(k, kpos)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            probs = torch.softmax(torch.einsum("bhd,thd->hbt", q, k) * hd ** -0.5, dim=-1)
            x = x + torch.einsum("hbt,thd->bhd", probs, v).reshape(b, nh * hd) @ t[p + "self_attn.o_proj.weight"].T
            f = self._rms(x, t[p + "post_attention_layernorm.weight"])
            f = torch.nn.functional.silu(f @ t[p + "mlp.gate_proj.weight"].T) * (f @ t[p + "mlp.up_proj.weight"].T)
            x = x + f @ t[p + "mlp.down_proj.weight"].T
        return project(self._rms(x, self.need("norm.weight")).float()).float()


@torch.no_grad()
def dflash_check(report: Report, target, drafter_model, hf_target, draft_dir: Path, prompts, judge) -> None:
    """The drafter's target layers and block logits against `DFlashReference` on transformers' features."""
    from specconv.runtime.drafters.dflash import DFlashDrafter
    from specconv.verify.eagle3_reference import module_call, target_features

    try:
        ref = DFlashReference(draft_dir)
    except SpecconvError as exc:
        report.add(CHECK, False, str(exc))
        return
    want = [i + 1 for i in ref.layer_ids]  # hidden_states[id + 1] = the input of block id + 1
    ours_layers = [int(j) for j in drafter_model.hparams.target_layers]
    hint = ("; off by one: converted with the ids taken as layer inputs" if [j + 1 for j in ours_layers] == want
            else "; converted against another target, or with --target-layers" if ours_layers != want else "")
    report.add("draft: DFlash target layers match its checkpoint", ours_layers == want,
               f"GGUF: layer inputs {ours_layers}; checkpoint: target_layer_ids {ref.layer_ids} (layer outputs) "
               f"-> transformers hidden_states {want}" + hint)
    embed, project = module_call(hf_target.get_input_embeddings()), module_call(hf_target.get_output_embeddings())
    n_block = drafter_model.hparams.block_size
    worst, rels, agree, rows = 0.0, [], 0, 0
    try:
        for ids in (p for p in prompts if len(p) > 1):
            prefix, id_last = list(ids[:-1]), int(ids[-1])
            block = [id_last] + [drafter_model.hparams.mask_token_id] * (n_block - 1)
            ref_logits = ref.block_logits(target_features(hf_target, prefix, want), block, embed, project)[1:]
            drafter = DFlashDrafter(drafter_model, target, len(ids) + n_block, n_block - 1)
            out = Context(target, n_ctx=len(ids)).decode(prefix, hidden=drafter.target_hidden)
            drafter.start(prefix, torch.cat([out.hidden[x] for x in drafter.target_hidden], -1))
            ours = drafter.block_logits(id_last).float().cpu()[1:]
            m, r = parity._errors(ours, ref_logits)
            worst, rels = max(worst, m), rels + [r]
            agree += int((ours.argmax(-1) == ref_logits.argmax(-1)).sum())
            rows += ours.shape[0]
    except SpecconvError as exc:
        report.add(CHECK, False, str(exc))
        return
    if not rels:
        report.add(CHECK, False, "every prompt has a single token: no context to draft from")
        return
    rel = sum(rels) / len(rels)
    judge(CHECK, worst, rel, f"; block logits over {rows} rows against the drafter computed from {draft_dir} on "
                             f"transformers' hidden states {want}; greedy drafts agree at {agree}/{rows} rows")
    report.parity.update(dflash=worst, dflash_rel_rms=rel, dflash_hidden_states=want, dflash_draft_agreement=agree / rows,
                         max_abs_logit_diff=max(report.parity["max_abs_logit_diff"], worst))
