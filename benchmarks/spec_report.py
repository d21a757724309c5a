"""The speculative-decoding section of docs/benchmarks.md and its plot, from a spec_decode result dict.

The section sits between two marker comments, so the benchmark rewrites only its own part of the
file and other sections (conversion throughput, ...) are left as they are.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

BEGIN = "<!-- BEGIN spec_decode: written by benchmarks/spec_decode.py; edits inside are overwritten -->"
END = "<!-- END spec_decode -->"


def _f(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pp(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "–"


def markdown(res: dict, png_name: str) -> str:
    s = res["settings"]
    ours = [r for r in res["ours"]["rows"] if r["rollback"] == "snapshot"]
    ckpt = {r["draft_max"]: r for r in res["ours"]["rows"] if r["rollback"] == "checkpoint"}
    llama = {r["draft_max"]: r for r in res.get("llamacpp", {}).get("rows", [])}
    lines = [
        "## Speculative decoding with the bundled MTP head",
        "",
        f"`python3 benchmarks/spec_decode.py` ({res['date']}, {res['machine']}; {res['seconds']:.0f} s in all). "
        f"Model: the bundled tiny Qwen3.5 + MTP checkpoint (`specconv/data/tiny-qwen35-mtp`), converted by "
        f"`specconv convert --outtype {s['outtype']}` (one file, MTP embedded). Text: {len(res['ours']['prompts'])} "
        f"prompts of {s['prompt_tokens']} tokens from the stdlib files held out of training (`heldout.json`: "
        f"{', '.join(sorted({p.split('@')[0] for p in res['ours']['prompts']}))}), {s['n_predict']} greedy tokens each. "
        f"specconv runtime on {res['device']} with {s['threads']} thread(s); llama.cpp (llama-cpp-python "
        f"{res.get('llamacpp', {}).get('version', 'n/a')}) on CPU with {s['threads']} thread(s).",
        "",
        "Definitions (docs/reference/speculative.md §6–§7): *per-position* is the cumulative share of drafting rounds whose "
        "i-th draft was accepted (Σ = AL − 1); *AL* = 1 + accepted / drafting rounds; *tokens/forward* = "
        "generated tokens / target forwards (plain decoding: 1); *bound* = (1 − α^(k+1)) / (1 − α) with α solved "
        "from the measured acceptance. Speed-up = median over "
        f"{s['repeats']} interleaved repeats of the plain time / the speculative time, both measured in the same "
        "process on the same prompts (drafting and catch-up forwards of the MTP head included).",
        "",
        "| draft_max | per-position (ours) | acceptance rate | AL | tokens / target forward | bound | target forwards spec / plain | speed-up (snapshot) | speed-up (checkpoint) | re-evaluated tokens (checkpoint) | = plain | llama.cpp per-position | llama.cpp rate | llama.cpp tokens / forward | llama.cpp = ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ours:
        k = r["draft_max"]
        c, l = ckpt.get(k, {}), llama.get(k, {})
        lines.append(
            f"| {k} | {_pp(r['per_position'])} | {_f(r['acceptance_rate'])} | {_f(r['acceptance_length'])} | "
            f"{_f(r['tokens_per_target_forward'])} | {_f(r['bound'])} | {r['target_forwards']} / "
            f"{r['plain_target_forwards']} | {_f(r['speedup'])}× | {_f(c.get('speedup'))}× | "
            f"{c.get('reevaluated_tokens', '–')} in {c.get('redecode_forwards', '–')} extra forwards | "
            f"{'yes' if r['exact'] else '**no**'} | {_pp(l.get('per_position'))} | {_f(l.get('acceptance_rate'))} | "
            f"{_f(l.get('tokens_per_target_forward'))} | {_same(l)} |")
    best = max(ours, key=lambda r: r["speedup"] or 0)
    lines += ["", f"![acceptance by position and speed-up by draft_max]({png_name})", "", "Measured:"]
    lines.append(
        f"* Acceptance at draft_max 1: **{_f(ours[0]['acceptance_rate'])}** "
        f"({ours[0]['accepted']}/{ours[0]['drafted']} drafts)."
        + (f" MTP top-1 accuracy for x_(t+2) on held-out windows (tools/train_tiny.py): "
           f"{_f(res['training']['mtp_top1'], 3)} (trunk next-token top-1 {_f(res['training']['main_top1'], 3)})."
           if res.get("training") else ""))
    lines.append(
        f"* Best wall-clock speed-up: **{_f(best['speedup'])}×** at draft_max {best['draft_max']} "
        f"({best['target_forwards']} target forwards instead of {best['plain_target_forwards']}, "
        f"{_f(best['tokens_per_target_forward'])} tokens per target forward; plain "
        f"{best['plain_seconds']:.2f} s, speculative {best['seconds']:.2f} s for all prompts).")
    lines.append(f"* Greedy speculative output equal to plain output: "
                 f"{'every prompt, every draft_max, both rollbacks' if res['ours']['all_exact'] else '**NOT everywhere** (see the = plain column)'}.")
    if res.get("costs"):
        c = res["costs"]
        tm = {int(n): v for n, v in c["target_ms"].items()}
        lines.append(
            "* Why the wall-clock gain is smaller than tokens per forward: one target decode takes "
            + ", ".join(f"{v:.1f} ms for {n} token{'s' if n > 1 else ''}" for n, v in sorted(tm.items()))
            + f", and one MTP-head step {c['mtp_ms']:.1f} ms (c = {c['c']:.2f} of a one-token target forward; "
            "a round adds one MTP catch-up decode to its draft steps). A round at draft_max k therefore costs the "
            "target decode of k+1 tokens plus k+1 MTP decodes, against AL single-token target forwards for plain "
            "decoding; on this CPU runtime and a model this small that leaves little of the forward savings in "
            "wall time. The speed-up is reported as measured.")
    if ckpt:
        lines.append("* Checkpoint rollback against snapshot: the checkpoint mode restores the state saved before "
                     "the verification and evaluates the kept tokens again after a partial acceptance; those "
                     "re-evaluations are the extra forwards in the table, counted as forwards and never as accepted.")
    if llama:
        lines.append(f"* llama.cpp's draft-mtp loop on the same GGUF and prompts ({res['llamacpp']['note']}): "
                     f"{res['llamacpp']['summary']}.")
    elif res.get("llamacpp", {}).get("skipped"):
        lines.append(f"* llama.cpp comparison skipped: {res['llamacpp']['skipped']}.")
    return "\n".join(lines) + "\n"


def _same(l: dict) -> str:
    if not l:
        return "–"
    return "yes" if l["same_tokens_as_ours"] and l["same_counts_as_ours"] else (
        "tokens yes, counts differ" if l["same_tokens_as_ours"] else "**no**")


def write_section(path: Path, section: str) -> None:
    """Replace (or append) the marked section of `path`, written atomically."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section.rstrip()}\n{END}\n"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + rest.split(END, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot(res: dict, png: Path) -> None:
    """Left: cumulative acceptance by draft position for each draft_max (ours solid, llama.cpp dashed).
    Right: wall-clock speed-up and tokens per target forward by draft_max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in res["ours"]["rows"] if r["rollback"] == "snapshot"]
    ckpt = [r for r in res["ours"]["rows"] if r["rollback"] == "checkpoint"]
    llama = res.get("llamacpp", {}).get("rows", [])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in ours:
        xs = range(1, len(r["per_position"]) + 1)
        line, = left.plot(xs, r["per_position"], marker="o", label=f"draft_max {r['draft_max']}")
        for l in llama:
            if l["draft_max"] == r["draft_max"]:
                left.plot(xs, l["per_position"], linestyle="--", marker="x", color=line.get_color())
    left.set_xlabel("draft position i")
    left.set_ylabel("share of rounds with draft i accepted")
    left.set_ylim(0, 1.02)
    left.set_xticks(range(1, max(r["draft_max"] for r in ours) + 1))
    left.set_title("acceptance by position (solid: specconv, dashed: llama.cpp)")
    left.legend(fontsize=8)
    ks = [r["draft_max"] for r in ours]
    right.plot(ks, [r["speedup"] for r in ours], marker="o", label="wall-clock speed-up, snapshot")
    if ckpt:
        right.plot([r["draft_max"] for r in ckpt], [r["speedup"] for r in ckpt], marker="s",
                   label="wall-clock speed-up, checkpoint")
    right.plot(ks, [r["tokens_per_target_forward"] for r in ours], marker="^", linestyle=":",
               label="tokens per target forward")
    right.plot(ks, [r["bound"] for r in ours], linestyle="--", color="grey", label="bound E(α, k)")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("draft_max")
    right.set_xticks(ks)
    right.set_title("speed-up against plain decoding (same run)")
    right.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png)
    tmp = png.with_name(f".{png.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
