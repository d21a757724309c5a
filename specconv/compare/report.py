"""Terminal output of a compare report (the dict built by specconv/compare/run.py).

Tables go through specconv.tables, which picks a layout that fits the console's width. The figures are
llama-perplexity's, named as it prints them; docs/compare.md §6 says how to read each.
"""

from __future__ import annotations

from pathlib import Path

from specconv.compare.stats import DELTA_P_PERCENTILES, KLD_PERCENTILES


def _pm(v: dict, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    return f"{v['value'] * scale:{fmt}} ± {v['error'] * scale:{fmt}}{unit}"


def _label(entry: dict) -> str:
    return entry.get("type") or Path(entry["path"]).name


def render(report: dict, console) -> None:
    from rich.markup import escape

    from specconv.tables import Col, print_table, print_wrapped

    src, text, quants = report["source"], report["text"], report["quants"]
    kind = src["type"] or src["kind"]
    stored = (f"the source's log-probabilities stored ({report['store']['bytes'] / 1e6:.1f} MB)"
              if report["store"] else "the source run beside each quant (exact KL divergence)")
    print_wrapped(console, f"[bold]source[/] {escape(Path(src['path']).name)} ({escape(kind)}): "
                           f"PPL {_pm(src['ppl'], '.4f')}; {text['chunks']} chunks of {text['ctx']} tokens "
                           f"(of {text['tokens']}), {text['scored']} scored positions; {stored}")
    labels = [escape(_label(q)) for q in quants]
    print_table(console, [Col("file", whole=True), Col("type"), Col("size", "right"), Col("BPW", "right"),
                          Col("MTP head")],
                [[escape(Path(q["path"]).name), escape(q["type"] or ""), f"{q['size_bytes'] / 1e6:.1f} MB", _bpw(q),
                  _head(q)] for q in quants], title="files")
    print_table(console, [Col(""), Col("PPL", "right"), Col("PPL(Q)/PPL(base)", "right"), Col("mean KLD", "right"),
                          Col("same top p", "right")],
                [[label, f"{q['ppl']['value']:.4f}", _pm(q["ppl_ratio"], ".4f"),
                  _pm({"value": q["kld"]["mean"], "error": q["kld"]["error"]}, ".6f"),
                  _pm(q["same_top_p"], ".2f", 100, " %")] for label, q in zip(labels, quants)],
                title="quality against the source")
    rows = [["mean"] + [_pm({"value": q["kld"]["mean"], "error": q["kld"]["error"]}, ".6f") for q in quants]]
    for name in ["max", *(n for n, _ in KLD_PERCENTILES), "min"]:
        rows.append([name] + [f"{q['kld'][name]:.6f}" for q in quants])
    if report["store"]:
        rows.append(["store bound"] + [f"{q['kld']['store_bound']['mean']:.1e}" for q in quants])
    print_table(console, [Col("KLD")] + [Col(lb, "right") for lb in labels], rows, title="KL divergence")
    rows = [["mean"] + [f"{100 * q['delta_p']['mean']:.3f} ± {100 * q['delta_p']['error']:.3f} %" for q in quants]]
    for name in ["max", *(n for n, _ in DELTA_P_PERCENTILES), "min"]:
        rows.append([name] + [f"{100 * q['delta_p'][name]:.3f} %" for q in quants])
    rows.append(["RMS"] + [f"{100 * q['delta_p']['rms']:.3f} ± {100 * q['delta_p']['rms_error']:.3f} %"
                           for q in quants])
    print_table(console, [Col("Δp")] + [Col(lb, "right") for lb in labels], rows,
                title="probability of the correct token, quant − source")
    _render_heads(report, console)
    for note in report["notes"]:
        print_wrapped(console, f"[yellow]note:[/] {escape(note)}")


def _head(q: dict) -> str:
    from rich.markup import escape

    if not q.get("head"):
        return "none"
    return "embedded" if q["head"] == q["path"] else escape(Path(q["head"]).name)


def _bpw(q: dict) -> str:
    return f"{q['bits_per_weight']:.2f}" if q.get("bits_per_weight") else ""


def _render_heads(report: dict, console) -> None:
    from rich.markup import escape

    from specconv.tables import Col, print_table, print_wrapped

    k = report["draft_max"]
    runs = []
    if report["source"]["mtp"]:
        runs.append(("source head on source", report["source"]["mtp"]))
    for q in report["quants"]:
        m = q["mtp"]
        if not m:
            continue
        name = escape(_label(q))
        if m["own_head"]:
            runs.append((f"{name} head on {name}", m["own_head"]))
        if m["source_head_on_this_trunk"]:
            runs.append((f"source head on {name}", m["source_head_on_this_trunk"]))
    if not runs:
        return
    cols = [Col("head on trunk")] + [Col(f"pos {i + 1}", "right") for i in range(k)] + [
        Col("tokens/forward", "right"), Col("speed-up", "right")]
    rows = []
    for name, s in runs:
        speed = s["speedup"]["at_draft_max"] if s["speedup"] else None
        rows.append([name] + [f"{a:.3f}" for a in s["per_position"]] + [
            f"{s['expected_tokens']:.3f}" if s["expected_tokens"] is not None else "",
            f"{speed:.2f}x" if speed is not None else ""])
    print_table(console, cols, rows, title=f"MTP acceptance by draft position (teacher-forced, k = {k})")
    for q in report["quants"]:
        if q["mtp"] and q["mtp"]["summary"]:
            print_wrapped(console, escape(q["mtp"]["summary"]))
