"""Every citation in the code, the tests and the docs points at a file of this repository and at a
section heading that exists there (docs/architecture.md, "Citations").

A citation is a path ending in `.md` (`docs/reference/gguf-layout.md`, `reference/hub.md`,
`docs/archs.md`), optionally followed by sections: `§7.5`, `§6–§7`, `§7.2-7.4`, `§7.1 / §7.2`.
The path resolves against the citing file's folder or the repository root; a section `§N` exists
when the file has a markdown heading numbered `N` (`## 7.`, `### 7.5 ...`). Inside docs/reference/,
a bare `§N` names a section of the same file and is checked too. Links (`http…`), paths that
name another project's file (`owner/repo/...md` after a URL host) and file names in string
literals (`docs / "benchmarks.md"`) are not citations; a chapter name without its path
(`model-math §7.2`) is reported as broken. A path and its sections may be split by a line break.

Run alone: `python3 tests/docs/test_citations.py` lists the broken citations (`--all`: every one).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # stays runnable as a script (no tests package on its path)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".c", ".h", ".jinja", ".yml", ".yaml"}
REFERENCE = ROOT / "docs" / "reference"
REFERENCE_FILES = ("gguf-layout.md", "model-math.md", "speculative.md", "peers.md", "hub.md", "measured-notes.md")

# A path to a markdown file: segments of word characters, dots and dashes, separated by slashes.
_PATH = r"(?<![\"'\w/.-])(?P<path>(?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.md)\b"
# Sections after the path: "§7.5", then more joined by dashes, slashes, commas or "and".
_SEC = r"§\s?\d+(?:\.\d+)*"
_MORE = rf"(?:\s*(?:[-–/,]|and)\s*(?:{_SEC}|\d+(?:\.\d+)+))*"
# Between a path and its sections: a closing backtick, a parenthesis, or a line break (also inside a
# comment: "# ", "// ", "* ").
_GAP = r"`?[ \t]*(?:\n[ \t]*(?:#|//|\*|>)?[ \t]*)?\(?[ \t]*"
CITATION = re.compile(rf"{_PATH}(?P<secs>{_GAP}{_SEC}{_MORE})?")
BARE_SECTION = re.compile(rf"(?<![\w.])(?P<secs>{_SEC}{_MORE})")
# A reference chapter named without its path ("model-math §7.2") is a citation nobody can follow.
SHORT = re.compile(r"(?<![\w/.-])(?:gguf-layout|model-math|speculative|peers|hub|measured-notes)(?!\.md)[ \t]*§")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?(?=\s|$)", re.M)
URL_BEFORE = re.compile(r"(?:https?://|www\.)\S*$|[\w-]+\.(?:com|org|io|co|ai|dev|net)/\S*$")


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return sorted({ROOT / p for p in out if p and Path(p).suffix in TEXT_SUFFIXES and (ROOT / p).is_file()})


def sections_of(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings inside code fences
    return {m.group(1) for m in HEADING.finditer(text)}


def _section_numbers(secs: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)*", secs or "")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def citations(path: Path) -> list[tuple[int, str, str, list[str]]]:
    """(line, text, cited path, sections) for every .md citation in one file."""
    found = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for m in CITATION.finditer(text):
        start = m.start("path")
        if URL_BEFORE.search(text[text.rfind("\n", 0, start) + 1:start]):
            continue
        found.append((_line(text, start), " ".join(m.group(0).split()), m.group("path"),
                      _section_numbers(m.group("secs"))))
    for m in SHORT.finditer(text):
        found.append((_line(text, m.start()), m.group(0).strip(), m.group(0).split("§")[0].strip() + " (no .md path)",
                      []))
    return sorted(found)


def resolve(citing: Path, cited: str) -> Path | None:
    for base in (citing.parent, ROOT):
        p = (base / cited).resolve()
        if p.is_file() and ROOT in p.parents:
            return p
    return None


def broken() -> tuple[list[str], int]:
    problems, total = [], 0
    cache: dict[Path, set[str]] = {}
    for f in _files():
        rel = f.relative_to(ROOT)
        if f == Path(__file__).resolve():
            continue  # its own examples of broken citations
        for lineno, text, cited, secs in citations(f):
            total += 1
            target = resolve(f, cited)
            if target is None:
                problems.append(f"{rel}:{lineno}: {text!r}: no file {cited} in this repository")
                continue
            have = cache.setdefault(target, sections_of(target))
            for s in secs:
                if s not in have:
                    problems.append(f"{rel}:{lineno}: {text!r}: {target.relative_to(ROOT)} has no section §{s}")
        if f.parent == REFERENCE and f.suffix == ".md":
            have = cache.setdefault(f.resolve(), sections_of(f))
            # sections after a path were checked above; blank them out, keeping the line numbers
            text = CITATION.sub(lambda m: "\n" * m.group(0).count("\n"), f.read_text(encoding="utf-8"))
            for m in BARE_SECTION.finditer(text):
                total += 1
                for sec in _section_numbers(m.group("secs")):
                    if sec not in have:
                        problems.append(f"{rel}:{_line(text, m.start())}: {m.group(0)!r}: no section §{sec} in this file")
    return problems, total


def test_every_citation_resolves():
    problems, total = broken()
    print(f"{total} citations checked, {len(problems)} broken")
    assert not problems, "citations whose file or section does not exist:\n" + "\n".join(problems)


def test_reference_docs_have_numbered_sections():
    for name in REFERENCE_FILES:
        secs = sections_of(REFERENCE / name)
        assert {"1"} <= secs, f"docs/reference/{name} has no numbered section 1"


def test_scanner_catches_what_it_should(tmp_path):
    # The checker itself: a missing file, a missing section, a range end and a chapter named without
    # its path are caught; links and file names in string literals are not citations.
    sample = tmp_path / "x.py"
    sample.write_text("# see docs/reference/hub.md §1.3 and docs/reference/hub.md §99\n"
                      "# docs/nope.md, docs/reference/model-math.md §7.2–7.99, speculative.md §6\n"
                      "# https://github.com/o/r/blob/main/README.md §4 is a link; path = docs / \"x.md\"\n"
                      "# (model-math §7.2) and, over a line break, docs/reference/hub.md\n"
                      "# §1.2\n")
    got = sorted((c[2], c[3]) for c in citations(sample))
    assert got == sorted([("docs/reference/hub.md", ["1.3"]), ("docs/reference/hub.md", ["99"]), ("docs/nope.md", []),
                          ("docs/reference/model-math.md", ["7.2", "7.99"]), ("speculative.md", ["6"]),
                          ("model-math (no .md path)", []), ("docs/reference/hub.md", ["1.2"])])
    assert resolve(ROOT / "specconv" / "x.py", "docs/reference/hub.md") is not None
    assert resolve(ROOT / "docs" / "x.md", "reference/hub.md") is not None  # relative to the citing file
    assert resolve(ROOT / "specconv" / "x.py", "speculative.md") is None
    assert "1.3" in sections_of(REFERENCE / "hub.md") and "99" not in sections_of(REFERENCE / "hub.md")
    assert "7.1.1" in sections_of(REFERENCE / "gguf-layout.md")


if __name__ == "__main__":
    if "--all" in sys.argv:
        for f in _files():
            for lineno, text, _, _ in citations(f):
                print(f"{f.relative_to(ROOT)}:{lineno}: {text}")
    problems, total = broken()
    print("\n".join(problems))
    print(f"{total} citations, {len(problems)} broken")
