"""The conversion section of docs/benchmarks.md (and docs/convert_benchmark.json) from a result dict.

The section sits between its own marker comments, so the benchmark rewrites only its part of the
file; other sections (speculative decoding, ...) stay as they are.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

BEGIN = "<!-- BEGIN convert: written by benchmarks/convert.py; edits inside are overwritten -->"
END = "<!-- END convert -->"
CONTENDERS = ("ours", "llama.cpp", "floor")
LABELS = {"ours": "specconv convert", "llama.cpp": "llama.cpp convert_hf_to_gguf.py", "floor": "disk floor"}


def _cell(stats: dict | None) -> tuple[str, str]:
    if not stats:
        return "–", "–"
    return (f"{stats['wall_s']:.1f} s ({stats['wall_min']:.1f}–{stats['wall_max']:.1f})",
            f"{stats['rss_bytes'] / 1e9:.2f} GB")


def table(res: dict) -> str:
    lines = ["| output | command | wall time, median (min–max) | peak RSS, median |", "|---|---|---|---|"]
    for outtype, row in res["rows"].items():
        for name in CONTENDERS:
            if name in row:
                wall, rss = _cell(row[name])
                lines.append(f"| {outtype} | {LABELS[name]} | {wall} | {rss} |")
    lines += ["", "| output | speed-up vs llama.cpp | peak RSS vs llama.cpp | time vs disk floor | "
                  "tensor data identical to llama.cpp's |", "|---|---|---|---|---|"]
    for outtype, row in res["rows"].items():
        r, t = row.get("ratios", {}), row.get("tensors")
        same = (f"{t['identical']} of {t['same_type']} (same order: {'yes' if t['same_order'] else 'no'})"
                if t else "–")
        lines.append(f"| {outtype} | {_ratio(r.get('speedup_vs_llama'))} | {_ratio(r.get('rss_vs_llama'))} | "
                     f"{_ratio(r.get('time_vs_floor'))} | {same} |")
    return "\n".join(lines)


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def markdown(res: dict) -> str:
    m, c = res["machine"], res["checkpoint"]
    return "\n".join([
        "## Conversion throughput and memory",
        "",
        f"`python3 benchmarks/convert.py` ({res['date']}; {m['cores']} cores, {m['memory_gb']} GB RAM, Python "
        f"{m['python']}, torch {m['torch']}). Checkpoint: Qwen3.5-shaped, random bf16 "
        f"(tools/synth_qwen35.py), {c['bytes'] / 1e9:.2f} GB in {c['shards']} shards: {c['layers']} layers + "
        f"{c['mtp_layers']} MTP layer, hidden {c['hidden']}, vocabulary {c['vocab']}, untied output. "
        f"Each command ran {res['repeats']}× per output type, interleaved, each run after `sync` with the "
        "previous output deleted and the checkpoint in the page cache. Wall time and peak RSS of the whole "
        "process tree come from the OS (tools/peak_rss.py). The disk floor reads every shard and writes as many "
        "bytes as specconv's file (plain Python, one 2 MB buffer, no compute). specconv ran with "
        f"`--threads {res['threads']}` (0: one per core plus 2), llama.cpp's converter is the one in the "
        "llama-cpp-python 0.3.36 source distribution. Every command includes its interpreter start-up "
        "(llama.cpp's converter imports torch: about 2 s here; specconv's converter does not).",
        "",
        table(res),
        "",
    ])


def write(res: dict, docs: Path) -> None:
    _atomic(docs / "convert_benchmark.json", json.dumps(res, indent=2) + "\n")
    path = docs / "benchmarks.md"
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = f"{BEGIN}\n{markdown(res)}{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    _atomic(path, text)


def _atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
