"""Tables that fit the width they are printed in: a terminal, a pipe, a CI log.

rich fits a table that is too wide by folding cells mid-word and cutting what does not fit, so a
file name piped into an 80-column log came out as `Qwen3.5-9B-Q8_0-000` / `01-of-00003.gguf`. Here
the layout is chosen before rich sees the table:

1. every column at its natural width fits: a normal table;
2. every column at its narrowest word-wrapped width fits (a "whole" column — file and tensor
   names — never narrower than its longest cell): a table with widths chosen here, so text only
   wraps at spaces; when the box's rules and padding are what does not fit, the same table
   without a box;
3. otherwise a stacked list: one block per row, the key cell (the file name) on its own line and
   `header: value` lines below, long values wrapped at spaces under their header.

Nothing is cut in any layout. In the stacked layout a path longer than a line is broken after a
`/`, so each file name still stands whole on its line; a single name longer than the whole width
is printed whole on its own line rather than broken. The width is the console's:
a terminal's, else `COLUMNS`, else 80 (rich's rule for consoles that are not a terminal).
"""

from __future__ import annotations

from dataclasses import dataclass

# Columns a table spends besides its text: the default box (edges, a rule between columns, padding
# 1) 3 per column + 1; without a box and without edge padding, 2 per column − 2.
_BOXED = (3, 1)
_BARE = (2, -2)
_INDENT = "  "


@dataclass(frozen=True)
class Col:
    header: str
    justify: str = "left"
    whole: bool = False  # file and tensor names: never wrapped, never cut


def _lines(text) -> list[str]:
    return text.plain.split("\n") or [""]


def _natural(texts) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for t in texts for line in _lines(t)), default=0)


def _longest_word(texts) -> int:
    from rich.cells import cell_len

    return max((cell_len(w) for t in texts for w in t.plain.split()), default=0)


def layout(width: int, cols: list[Col], cells: list[list], frame: tuple[int, int] = _BOXED) -> list[int] | None:
    """Column widths (text only) for a table that fits `width` without cutting a word, or None."""
    columns = [[row[i] for row in cells] for i in range(len(cols))]
    from rich.text import Text

    heads = [Text(c.header) for c in cols]
    natural = [max(_natural(col), _natural([h])) for col, h in zip(columns, heads)]
    minimum = [nat if c.whole else max(_longest_word(col), _longest_word([h]), 1)
               for c, col, h, nat in zip(cols, columns, heads, natural)]
    per_column, extra = frame
    budget = width - per_column * len(cols) - extra
    if sum(natural) <= budget:
        return natural
    if sum(minimum) > budget:
        return None
    # Share the room left after the minimum in proportion to what each column still wants.
    spare = budget - sum(minimum)
    want = [n - m for n, m in zip(natural, minimum)]
    total = sum(want) or 1
    widths = [m + (spare * w) // total for m, w in zip(minimum, want)]
    for i in sorted(range(len(cols)), key=lambda i: -want[i]):
        if sum(widths) >= budget:
            break
        if widths[i] < natural[i]:
            widths[i] += 1
    return widths


def print_table(console, cols: list[Col], rows: list[list[str]], *, title: str | None = None, key: int = 0) -> str:
    """Print `rows` (cells in rich markup) under `cols`; returns the layout used: "table", "plain
    table" (no box, when only that fits) or "stacked"."""
    from rich.table import Column, Table
    from rich.text import Text

    cells = [[Text.from_markup(c) if isinstance(c, str) else c for c in row] for row in rows]
    for kind, frame in (("table", _BOXED), ("plain table", _BARE)):
        widths = layout(console.width, cols, cells, frame)
        if widths is None:
            continue
        columns = [Column(c.header, justify=c.justify, width=w, no_wrap=c.whole, overflow="fold")
                   for c, w in zip(cols, widths)]
        if frame is _BOXED:
            table = Table(*columns, title=title, title_justify="left")
        else:  # no box: two spaces between columns, headers underlined
            table = Table(*columns, title=title, title_justify="left", box=None, pad_edge=False,
                          header_style="bold underline")
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return kind
    if title:
        console.print(Text.from_markup(title, style="italic"))
    for row in cells:
        _print_block(console, cols, row, key)
    return "stacked"


def _word_breaks(plain: str, width: int) -> list[int]:
    """Offsets where a line of `plain` breaks so that lines fit `width`, only before a word."""
    import re

    from rich.cells import cell_len

    offsets, start = [], 0
    for m in re.finditer(r"\S+", plain):
        if m.start() > start and cell_len(plain[start:m.end()]) > width:
            offsets.append(m.start())
            start = m.start()
    return offsets


def _fit(console, text, width: int) -> list:
    """`text` as lines of at most `width` cells, broken at spaces, then (for a path longer than a
    line) after a `/`; never inside a name. A single name longer than `width` stays whole."""
    width = max(1, width)
    out = []
    for paragraph in text.split("\n", allow_blank=True):
        for line in paragraph.divide(_word_breaks(paragraph.plain, width)):
            line.rstrip()
            while line.cell_len > width and "/" in line.plain[:-1]:
                cuts = [i + 1 for i, ch in enumerate(line.plain[:-1]) if ch == "/"]
                fitting = [c for c in cuts if c <= width]
                head, line = line.divide([fitting[-1] if fitting else cuts[0]])
                out.append(head)
            out.append(line)
    return out


def print_wrapped(console, markup: str) -> None:
    """A paragraph (rich markup) wrapped at spaces — and after a `/` in a path longer than a line —
    instead of rich's default of folding a long word (a file name) mid-word."""
    from rich.text import Text

    for line in _fit(console, Text.from_markup(markup), console.width):
        console.print(line, soft_wrap=True, overflow="ignore")


def _print_block(console, cols: list[Col], row: list, key: int) -> None:
    from rich.text import Text

    width = console.width
    head = row[key].copy() if cols[key].whole else Text(f"{cols[key].header}: ") + row[key]
    head.stylize("bold")
    for line in _fit(console, head, width):
        console.print(line, soft_wrap=True, overflow="ignore")
    for i, (col, cell) in enumerate(zip(cols, row)):
        if i == key or not cell.plain.strip():
            continue
        label = Text(f"{_INDENT}{col.header}: ", style="dim")
        one_line = label + cell
        if "\n" not in cell.plain and one_line.cell_len <= width:
            console.print(one_line, soft_wrap=True, overflow="ignore")
            continue
        console.print(label.rstrip() or label, soft_wrap=True)
        indent = _INDENT * 2
        for line in _fit(console, cell, width - len(indent)):
            console.print(Text(indent) + line, soft_wrap=True, overflow="ignore")


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
ELIDE_AT = 160  # characters of a metadata value shown in a table (the --json output has it whole)


def value_text(value, limit: int = ELIDE_AT) -> str:
    """A metadata value as one table cell: strings as they are, other values as JSON; newlines and tabs
    shown escaped (a chat template stays on its own row) and a long value cut at `limit` characters
    with the count of what was left out."""
    import json

    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = "".join(_ESCAPES.get(ch, ch) for ch in text)
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text)} characters)"
    return text


def footnotes(notes: list[str]) -> tuple[list[str], list[str]]:
    """Long notes repeated on many rows, as short marks: (a mark per row, "" where none; the legend
    lines "[1] note" in order of first use). A table then keeps one line per row at any width."""
    keys: dict[str, str] = {}
    marks = []
    for note in notes:
        if note and note not in keys:
            keys[note] = f"[{len(keys) + 1}]"
        marks.append(keys.get(note, ""))
    return marks, [f"{mark} {note}" for note, mark in keys.items()]


# Shared by `convert --dry-run` and `inspect`: tensor and KV names are never wrapped.
TENSOR_COLUMNS = [Col("tensor", whole=True), Col("type"), Col("shape (ggml)", whole=True), Col("size", "right", whole=True)]
METADATA_COLUMNS = [Col("key", whole=True), Col("value")]
