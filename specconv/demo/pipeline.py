"""`specconv demo`: the whole job on the bundled model, end to end, in-process.

1. convert the bundled checkpoint twice: one file with the MTP head embedded, and a trunk-only file
   plus its `mtp-` sidecar (the converter's `--mtp embed` and `--mtp separate`);
2. verify both with the verify machinery (structure, parity with transformers, greedy round trips,
   statistics algebra);
3. generate a sample after a held-out prompt with plain greedy decoding and with MTP speculation,
   recording which tokens were accepted drafts;
4. measure acceptance and wall-clock speed-up for draft_max 1..K on held-out prompts (measure.py).
The report is a plain dict (the `--json` output); `passed` is true only when every verify check
passed and every speculative output equals the plain output.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specconv.commands.outputs import check_output_folder
from specconv.demo.bundled import bundled_model_dir, heldout_prompts
from specconv.errors import SpecconvError

OUTTYPES = ("f32", "f16")


@dataclass
class DemoOptions:
    out: Path | None = None  # None: a temporary directory, removed afterwards
    device: str = "auto"
    n_predict: int = 32
    draft_max: int = 3
    outtype: str = "f32"
    prompts: int = 4  # held-out prompts for the acceptance table
    prompt_tokens: int = 48
    repeats: int = 3
    verify_n: int = 24  # tokens per verify prompt


def convert_bundled(src: Path, out_dir: Path, outtype: str) -> dict[str, Path]:
    """{"embedded": file, "trunk": file, "sidecar": mtp- file}, written by the project's converter into
    `out_dir` under the names `convert -o DIR/` gives (`<Name>-<Size>-<TYPE>.gguf`, `mtp-` + the trunk's):
    the embedded file's size label counts the MTP block, the trunk's does not, so the names differ."""
    from specconv.archs.base import MtpMode
    from specconv.convert.engine import ConvertRequest, plan_conversion, run_conversion

    plans = [plan_conversion(ConvertRequest(src=src, out=f"{out_dir}/", outtype=outtype, mtp=mode))
             for mode in (MtpMode.EMBED, MtpMode.SEPARATE)]
    written = {}
    try:
        names = [f.path for plan in plans for f in plan.files]
        if len(set(names)) != len(names):
            raise SpecconvError(f"the embedded and trunk-only conversions would both be named {names[0].name}")
        for plan in plans:
            for f, path in zip(plan.files, run_conversion(plan, overwrite=True)):  # a rerun into --out replaces
                written[f.kind] = path
    finally:
        for plan in plans:
            plan.close()
    return written


def verify_files(files: dict[str, Path], hf_dir: Path, opts: DemoOptions, progress) -> dict:
    """The verify reports of the embedded file and of the trunk + sidecar pair (JSON dicts)."""
    from specconv.verify import VerifyOptions, run_verify
    from specconv.verify.run import StatusProgress

    reports = {}
    for label, model, mtp in (("embedded", files["embedded"], None), ("sidecar", files["trunk"], files["sidecar"])):
        progress(f"verifying the {label} conversion")
        vopts = VerifyOptions(model=model, mtp=mtp, hf=hf_dir, n_predict=opts.verify_n, draft_max=opts.draft_max,
                              device=opts.device)
        reports[label] = run_verify(vopts, progress=StatusProgress(progress, prefix=f"verify {label}: ")).to_json()
    return reports


def token_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds (decoded cumulatively, so multi-byte characters split across tokens stay whole)."""
    pieces, before = [], ""
    for i in range(len(tokens)):
        text = tokenizer.decode(tokens[:i + 1])
        pieces.append(text[len(before):] if text.startswith(before) else text)
        before = text
    return pieces


def sample(target, head, prompt_ids: list[int], n_predict: int, draft_max: int) -> dict:
    """Plain and speculative greedy continuations of one prompt; `drafted` marks accepted draft tokens."""
    from specconv.runtime.drafters import MtpDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    plain = generate(target, prompt_ids, n_predict)
    marks: list[bool] = []

    def on_round(ctx, rnd):
        marks.extend([True] * rnd.accepted + [False])

    n_ctx = len(prompt_ids) + n_predict + draft_max + 2
    spec = speculative_generate(target, MtpDrafter(head, n_ctx, target), prompt_ids, n_predict,
                                SpecConfig(draft_max=draft_max), n_ctx=n_ctx, on_round=on_round)
    tok = target.tokenizer
    return {"prompt": tok.decode(prompt_ids), "prompt_ids": list(prompt_ids), "prompt_tokens": len(prompt_ids), "draft_max": draft_max,
            "plain_text": plain.text, "spec_text": spec.text, "identical": spec.tokens == plain.tokens,
            "plain_tokens": plain.tokens, "spec_tokens": spec.tokens,
            "pieces": token_pieces(tok, spec.tokens), "accepted_draft": marks[:len(spec.tokens)],
            "plain_target_forwards": plain.target_forwards,
            "spec_target_forwards": spec.stats["speculative"]["target_forwards"]}


def run_demo(opts: DemoOptions, progress: Callable[[str], None] = lambda msg: None) -> dict:
    if opts.outtype not in OUTTYPES:
        raise SpecconvError(f"--outtype must be one of {', '.join(OUTTYPES)}")
    if opts.draft_max < 1 or opts.n_predict < 1:
        raise SpecconvError("--draft-max and -n must be ≥ 1")
    src = bundled_model_dir()
    t0 = time.perf_counter()
    with ExitStack() as stack:
        if opts.out is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specconv-demo-")))
        else:
            out_dir = Path(opts.out)
            check_output_folder(out_dir, mkdir=False, option="--out", named_folder=True)
            out_dir.mkdir(exist_ok=True)
        progress("converting the bundled model")
        files = convert_bundled(src, out_dir, opts.outtype)
        t_convert = time.perf_counter() - t0
        reports = verify_files(files, src, opts, progress)
        report = _generate_and_measure(files, src, opts, progress)
        report.update(
            model=str(src), out=str(opts.out) if opts.out else None, outtype=opts.outtype,
            files={k: {"path": str(p), "bytes": p.stat().st_size} for k, p in files.items()},
            verify={k: {"passed": r["passed"], "checks": r["checks"], "parity": r["parity"],
                        "speculative": r["speculative"]} for k, r in reports.items()},
            convert_seconds=t_convert)
    report["verify_passed"] = all(r["passed"] for r in reports.values())
    report["exact"] = report["sample"]["identical"] and all(r["exact"] for r in report["acceptance"]["rows"])
    report["passed"] = report["verify_passed"] and report["exact"]
    report["seconds"] = time.perf_counter() - t0
    return report


def _generate_and_measure(files: dict[str, Path], src: Path, opts: DemoOptions, progress) -> dict:
    from specconv.demo.measure import measure
    from specconv.runtime import load_model
    from specconv.runtime.drafters import MtpDrafter

    target = load_model(files["embedded"], device=opts.device)
    prompts = heldout_prompts(target.tokenizer, src, opts.prompts, opts.prompt_tokens)
    progress("generating a sample")
    first = sample(target, target, list(prompts[0].ids), opts.n_predict, opts.draft_max)
    first["source"] = prompts[0].source
    progress("measuring acceptance and speed-up")
    m = measure(target, lambda n_ctx: MtpDrafter(target, n_ctx, target), [list(p.ids) for p in prompts],
                opts.n_predict, [(k, "snapshot") for k in range(1, opts.draft_max + 1)], repeats=opts.repeats,
                labels=[p.source for p in prompts], progress=progress)
    return {"device": str(target.device), "sample": first, "acceptance": m.to_json()}
