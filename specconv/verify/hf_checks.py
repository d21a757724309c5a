"""The checks against the Hugging Face checkpoints (`--hf`, `--draft-hf`): trunk and MTP parity with
transformers, and an EAGLE-3 head against the reference computed from its own checkpoint.

The transformers reference is loaded once, with accelerate's device map and a temporary offload
folder (parity.reference_model), in the dtype that follows verify's compute dtype; the EAGLE-3 check
takes the target's hidden states from it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from specconv.errors import SpecconvError
from specconv.runtime import Context, GraphType
from specconv.verify import parity
from specconv.verify.report import Report


def run_hf_checks(report: Report, target, head, eagle_head, hf_dir: Path, draft_hf: Path | None, prompts,
                  max_memory: dict | None = None, dflash=None) -> None:
    models = [m for m in (target, head, eagle_head, dflash) if m is not None]
    kind, tol = parity.criterion(*models)
    dtype = parity.reference_dtype(target.dtype)
    try:
        session = parity.reference_model(hf_dir, target.arch, dtype, max_memory=max_memory)
        main, bad = session.__enter__()
    except SpecconvError as exc:
        report.add("parity: transformers reference loads", False, str(exc))
        return
    except Exception as exc:  # a foreign folder: say so in one line
        report.add("parity: transformers reference loads", False, f"{type(exc).__name__}: {exc}")
        return
    try:
        placed = sorted({str(v) for v in (getattr(main, "hf_device_map", None) or {}).values()})
        report.add("parity: transformers reference loads", not bad,
                   f"{parity.hf_config_summary(hf_dir)} from {hf_dir}, {str(dtype).replace('torch.', '')}"
                   + (f", placed on {', '.join(placed)}" if placed else "") + (f"; load report {bad}" if bad else ""))
        ref = f"transformers {importlib.metadata.version('transformers')} {type(main).__name__}"
        judge = _judge(report, kind, tol)
        trunk, trunk_rel, hidden = parity.trunk_parity(target, main, prompts)
        judge("parity: trunk logits vs transformers", trunk, trunk_rel)
        report.parity = {"max_abs_logit_diff": trunk, "reference": ref, "trunk": trunk, "trunk_rel_rms": trunk_rel,
                         "criterion": kind, "tolerance": tol, "reference_dtype": str(dtype).replace("torch.", "")}
        if head is not None:
            _mtp(report, head, main, prompts, hidden, judge, ref)
        if eagle_head is not None and draft_hf is not None:
            eagle3_head_check(report, target, eagle_head, main, Path(draft_hf), prompts, judge)
        if dflash is not None and draft_hf is not None:  # specconv/verify/dflash_reference.py
            from specconv.verify.dflash_reference import dflash_check

            dflash_check(report, target, dflash, main, Path(draft_hf), prompts, judge)
    finally:
        session.__exit__(None, None, None)


def _judge(report: Report, kind: str, tol: float):
    def judge(name, max_abs, rel, extra=""):
        value = max_abs if kind == "max_abs" else rel
        rule = "max |Δlogit|" if kind == "max_abs" else "relative RMS error (rounded weights or half-precision compute)"
        return report.add(name, value <= tol, f"max |Δlogit| {max_abs:.2e}, relative RMS {rel:.2e}; judged on {rule} "
                                              f"≤ {tol:g}" + extra)

    return judge


def _mtp(report: Report, head, main, prompts, hidden, judge, ref: str) -> None:
    n_mtp = head.hparams.num_nextn_predict_layers
    if head.graph.CHAINED_MTP:  # several chained blocks, each judged (chained_mtp.py)
        from specconv.verify.chained_mtp import chained_mtp_check

        return chained_mtp_check(report, head, main, prompts, hidden, judge, ref, parity._errors)
    try:
        hf_mtp = parity.load_mtp_reference(main, n_mtp)
    except Exception as exc:
        report.add("parity: MTP head vs transformers MtpModel", False, f"no MTP reference: {type(exc).__name__}: {exc}")
        return
    mtp, mtp_rel = parity.mtp_parity(head, hf_mtp, prompts, hidden)
    judge("parity: MTP head vs transformers MtpModel", mtp, mtp_rel)
    report.parity.update(mtp=mtp, mtp_rel_rms=mtp_rel, reference=ref + " + MtpModel",
                         max_abs_logit_diff=max(report.parity["trunk"], mtp))


@torch.no_grad()
def eagle3_head_check(report: Report, target, head, hf_target, head_dir: Path, prompts, judge) -> None:
    """The head's layers and draft logits against `Eagle3Reference` fed by transformers' hidden states."""
    from specconv.verify.eagle3_reference import Eagle3Reference, hidden_state_indices, module_call, target_features

    try:
        ref = Eagle3Reference(head_dir)
    except SpecconvError as exc:
        report.add("parity: EAGLE-3 head vs its checkpoint", False, str(exc))
        return
    num_hidden_layers = target.hparams.num_hidden_layers
    want, how = hidden_state_indices(ref.raw_config, num_hidden_layers)
    ours_layers = [int(j) for j in head.hparams.target_layers]
    hint = ""
    if ours_layers != want:
        shifted = [j + 1 for j in ours_layers] == want or [j - 1 for j in ours_layers] == want
        hint = ("; off by one: converted with the ids in the other convention (docs/eagle3.md)" if shifted
                else "; converted against another target, or with --target-layers")
    report.add("draft: EAGLE-3 target layers match its checkpoint", ours_layers == want,
               f"GGUF: layer inputs {ours_layers}; checkpoint: {how} -> transformers hidden_states {want}" + hint)
    d2t = ref.d2t()
    embed = module_call(hf_target.get_input_embeddings())
    project = module_call(hf_target.get_output_embeddings())
    worst, rels, agree, rows = 0.0, [], 0, 0
    layer_names = tuple(f"layer:{j}" for j in ours_layers)
    try:
        for ids in (p for p in prompts if len(p) > 1):
            n = len(ids)
            g_ref = ref.encode(target_features(hf_target, ids, want))
            ref_logits, _ = ref.decode(ids[1:], g_ref[:-1], list(range(n - 1)), embed, project)
            out = Context(target).decode(ids, hidden=layer_names)
            feats = torch.cat([out.hidden[x] for x in layer_names], -1)
            g = Context(head, GraphType.ENCODER).encode(feats).hidden["g"]
            dec = Context(head, GraphType.MTP, n_ctx=n).decode(ids[1:], positions=list(range(n - 1)), hidden_in=g[:-1])
            ours = dec.logits.float().cpu()
            ours = ours[:, d2t] if d2t is not None else ours[:, :ref_logits.shape[-1]]
            m, r = parity._errors(ours, ref_logits)
            worst, rels = max(worst, m), rels + [r]
            agree += int((ours.argmax(-1) == ref_logits.argmax(-1)).sum())
            rows += n - 1
    except SpecconvError as exc:
        report.add("parity: EAGLE-3 head vs its checkpoint", False, str(exc))
        return
    if not rels:
        report.add("parity: EAGLE-3 head vs its checkpoint", False, "every prompt has a single token: nothing to draft")
        return
    rel = sum(rels) / len(rels)
    judge("parity: EAGLE-3 head vs its checkpoint", worst, rel,
          f"; draft logits over {rows} rows against the head computed from {head_dir} on transformers' hidden "
          f"states {want}; greedy drafts agree at {agree}/{rows} rows")
    report.parity.update(eagle3=worst, eagle3_rel_rms=rel, eagle3_hidden_states=want,
                         eagle3_draft_agreement=agree / rows,
                         max_abs_logit_diff=max(report.parity["max_abs_logit_diff"], worst))
