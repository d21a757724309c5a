"""The auto mix's report on a terminal (`convert --outtype auto:...`; `--json` prints the report's dict
as `auto_mix`). Every figure printed is read from that dict (convert/auto_mix.py `_report`)."""

from __future__ import annotations

from contextlib import contextmanager


def _kib(n: int) -> str:
    from .plan_report import human_bytes

    return human_bytes(n)


def _types(counts: dict) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def mix_lines(rep: dict) -> tuple[list[list[str]], list[str]]:
    """(table rows: group, option, tensor types, size, ΔKLD; the lines under the table)."""
    rows = [[g["group"], g["chosen"], _types(g["types"]), _kib(g["bytes"]), f"{g['delta_kld']:.3g}"]
            for g in rep["groups"]]
    lines = []
    head = rep.get("mtp")
    if head is not None:
        rows.append([head["group"], head["chosen"], _types(head["types"]), _kib(head["bytes"]), "(acceptance)"])
        if head["per_position"] is not None:
            lines.append(f"MTP block {head['chosen']}: acceptance at draft position 1 "
                         f"{head['reference_per_position'][0]:.3f} (reference head) -> {head['per_position'][0]:.3f}; "
                         f"{head['rule']}")
    k = rep["kld"]
    lines.append(f"size {rep['file_bytes']} bytes of a budget of {rep['budget_bytes']} ({rep['spec']}; the "
                 f"{rep['recipe']} file: {rep['recipe_file_bytes']})")
    lines.append(f"mean KLD on the calibration text: predicted {k['predicted']:.4g} (the groups' sum), measured "
                 f"{k['measured']:.4g} ± {k['measured_error']:.2g}; {rep['recipe']} measured {k['recipe_measured']:.4g}")
    if rep["kept_recipe"]:
        lines.append(f"the allocated mix measured {k['allocation_measured']:.4g}, more than {rep['recipe']}: "
                     f"{rep['recipe']}'s types were kept")
    c = rep["calibration"]
    lines.append(f"calibration: {c['text']}, {c['chunks']} chunk(s) of {c['ctx']} tokens, {c['scored_positions']} "
                 "positions scored")
    return rows, lines


def print_mix(console, rep: dict) -> None:
    from rich.markup import escape

    from specconv.tables import Col, print_table, print_wrapped

    rows, lines = mix_lines(rep)
    print_table(console, [Col("group", whole=True), Col("option"), Col("types"), Col("size", "right", whole=True),
                          Col("ΔKLD", "right", whole=True)],
                [[escape(c) for c in row] for row in rows], title="auto mix")
    for line in lines:
        print_wrapped(console, escape(line))


@contextmanager
def measuring(quiet: bool):
    """A progress bar on stderr for the measurements; yields the `progress(description, advance, total)`
    callback plan_auto_mix takes."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=quiet) as bar:
        task = bar.add_task("auto mix", total=None)

        def tick(description=None, advance=0, total=None):
            bar.update(task, advance=advance, **({"description": description} if description else {}),
                       **({"total": total} if total is not None else {}))
        yield tick
