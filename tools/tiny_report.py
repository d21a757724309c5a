"""Write the measured section of docs/training.md from a train_tiny.py run (between markers)."""

from __future__ import annotations

import os
from pathlib import Path

BEGIN = "<!-- train_tiny: generated section, rewritten by tools/train_tiny.py -->"
END = "<!-- train_tiny: end of generated section -->"


def _section(report: dict, out_dir: Path) -> str:
    s = report["settings"]
    tr = report["train"]
    ck = report["checkpoint"]
    lines = [
        BEGIN,
        "## Last full run (generated)",
        "",
        f"Command: `{report['command']}`  ",
        f"Python {report['python']}, torch {report['torch']}, transformers {report['transformers']}, "
        f"{report['threads']} thread(s), seed {report['seed']}.",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in s.items()]
    lines += [
        f"| MTP hidden input | {report['mtp_hidden']} |",
        "",
        f"Corpus: {report['train_files']} training files ({report['train_tokens']:,} tokens), "
        f"{report['heldout_files']} held-out files (listed in `{out_dir.name}/heldout.json`).",
        f"Training wall time: {tr['wall_s']:.0f} s ({tr['wall_s'] / s['steps']:.2f} s/step; "
        f"{s['steps'] * s['batch'] * s['ctx']:,} tokens seen); whole script {report['total_wall_s']:.0f} s.",
        "",
        "| training loss | first step | last 5% of steps |",
        "|---|---|---|",
        f"| main (next token) | {tr['first_losses']['main']:.3f} | {tr['final_losses']['main']:.3f} |",
        f"| MTP (token t+2) | {tr['first_losses']['mtp']:.3f} | {tr['final_losses']['mtp']:.3f} |",
        "",
        f"Checkpoint: {ck['parameters']:,} parameters, {ck['dtype']}, {ck['tensors']} tensors "
        f"({ck['mtp_tensors']} `mtp.*`), {ck['bytes'] / 1e6:.2f} MB on disk.",
        "",
        "Held-out measurements (teacher-forced on real text unless noted; chance is "
        f"1/{s['vocab']} = {1 / s['vocab']:.4f}):",
        "",
        "| MTP rows | main loss | MTP loss | main top-1 | MTP top-1 (x_{t+2}) | MTP == trunk argmax | "
        "greedy acceptance, draft_max 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, m in report["heldout"].items():
        lines.append(
            f"| {label.replace('_', ' ')} | {m['main_loss']:.3f} | {m['mtp_loss']:.3f} | {m['main_top1']:.3f} | "
            f"{m['mtp_top1']:.3f} | {m['mtp_agree_main']:.3f} | {m['greedy_acceptance']:.3f} "
            f"({m['greedy_drafts']} drafts) |"
        )
    lines += [
        "",
        f"Teacher-forced figures use {report['heldout']['llamacpp_rows']['positions']:,} positions; greedy "
        f"acceptance continues {s['accept_prompts']} held-out prompts of {s['ctx'] // 2} tokens by "
        f"{s['accept_new']} greedy tokens and counts MTP drafts that equal the trunk's next token.",
        END,
    ]
    return "\n".join(lines) + "\n"


def write_docs_section(docs: Path, report: dict, out_dir: Path) -> None:
    """Replace the generated section of `docs` (or append it); written to a temp name, then renamed."""
    text = docs.read_text() if docs.exists() else "# Training the bundled tiny model\n\n"
    section = _section(report, out_dir)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = docs.with_name(docs.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, docs)
