"""Rich terminal output of a demo report (the dict built by pipeline.run_demo).

Tables go through specconv.tables, which picks a layout that fits the console's width (a pipe or a
CI log: `COLUMNS` or 80) without cutting or mid-word wrapping a file name."""

from __future__ import annotations

from pathlib import Path


def _f(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render(report: dict, console) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.text import Text

    from specconv.demo.measure import speedup_text
    from specconv.tables import Col, print_table, print_wrapped

    print_wrapped(console, f"[bold]specconv demo[/]: the bundled tiny Qwen3.5 + MTP model "
                           f"({escape(report['model'])}), on {report['device']}")
    what = {"embedded": "trunk + MTP head in one file", "trunk": "trunk only", "sidecar": "MTP head only (mtp- sidecar)"}
    print_table(console, [Col("file", whole=True), Col("size", "right"), Col("what")],
                [[escape(Path(info["path"]).name), _size(info["bytes"]), what.get(kind, kind)]
                 for kind, info in report["files"].items()],
                title=f"converted ({report['outtype']}) in {report['convert_seconds']:.1f} s")

    for label, v in report["verify"].items():
        checks = v["checks"]
        n_ok = sum(c["passed"] for c in checks)
        par = v["parity"].get("max_abs_logit_diff")
        status = "[green]passed[/]" if v["passed"] else "[red]FAILED[/]"
        parity = f", max |Δlogit| vs transformers {par:.1e}" if par is not None else ""
        console.print(f"verify {label}: {status} ({n_ok}/{len(checks)} checks{parity})")
        for c in checks:
            if not c["passed"]:
                console.print(f"  [red]✗[/] {escape(c['name'])}: {escape(c['detail'])}")

    s = report["sample"]
    console.print(f"\n[bold]sample[/] after a held-out prompt ({escape(s['source'])}, {s['prompt_tokens']} tokens), "
                  f"{len(s['plain_tokens'])} greedy tokens:")
    console.print(Panel(Text(s["prompt"][-300:], style="dim"), title="prompt (end)", title_align="left"))
    console.print(Panel(Text(s["plain_text"]), title=f"plain decoding: {s['plain_target_forwards']} target forwards",
                        title_align="left"))
    spec = Text()
    for piece, drafted in zip(s["pieces"], s["accepted_draft"]):
        spec.append(piece, style="black on green" if drafted else "")
    same = "[green]identical to plain[/]" if s["identical"] else "[red]DIFFERENT from plain[/]"
    # Panel titles are cut to the panel's width, so the longer explanation goes on its own line.
    console.print(f"MTP speculative decoding, draft_max {s['draft_max']}: {s['spec_target_forwards']} target forwards; "
                  "green = accepted draft tokens")
    console.print(Panel(spec, title=f"MTP speculative, draft_max {s['draft_max']}", title_align="left"))
    console.print(f"speculative text {same}")

    a = report["acceptance"]
    cols = [Col(c, "right") for c in ("draft_max", "per-position acceptance", "acceptance rate", "acceptance length",
                                       "tokens / target forward", "bound E(α,k)", "target forwards spec / plain",
                                       "seconds spec / plain", "speed-up", "= plain")]
    rows = [[str(r["draft_max"]), " ".join(_f(x) for x in r["per_position"]), _f(r["acceptance_rate"]),
             _f(r["acceptance_length"]), _f(r["tokens_per_target_forward"]), _f(r["bound"]),
             f"{r['target_forwards']} / {r['plain_target_forwards']}",
             f"{r['seconds']:.2f} / {r['plain_seconds']:.2f}", f"{_f(r['speedup'])}x",
             "[green]yes[/]" if r["exact"] else "[red]NO[/]"] for r in a["rows"]]
    print_table(console, cols, rows, title=f"MTP acceptance on {len(a['prompts'])} held-out prompts x {a['n_predict']} "
                                           f"tokens (greedy, snapshot rollback; times: median of {a['repeats']} "
                                           "interleaved repeats)")
    best = max(a["rows"], key=lambda r: r["speedup"] or 0.0)
    print_wrapped(console, f"best draft_max {best['draft_max']}: {escape(speedup_text(best['timing']))} "
                           f"({best['target_forwards']} target forwards instead of {best['plain_target_forwards']}, "
                           f"{_f(best['tokens_per_target_forward'])} tokens per forward; the MTP head's forwards and "
                           "the multi-token verification are part of the measured time).")
    console.print(("[bold green]PASSED[/]" if report["passed"] else "[bold red]FAILED[/]")
                  + f" in {report['seconds']:.1f} s")
