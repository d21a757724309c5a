"""The card's "Quality against the source" table, from `specconv compare --json` reports (docs/compare.md).

Each quant entry of a report (`quants[i]`: path, size_bytes, optional sha256, ppl_ratio, kld, same_top_p,
mtp) is matched to the uploaded model file of the same name; its size (and sha256, where the report records
one) must be that file's, or the report is refused: its figures are of other bytes. Entries naming a file
that is not uploaded are left out with a warning (a publisher may compare more quants than it publishes).
Bits per weight are read from the uploaded file itself: tensor bytes × 8 / parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specconv.digest import sha256_file
from specconv.errors import SpecconvError
from specconv.hub.gguf_header import read_header
from specconv.hub.naming import human_size

KLD_P99 = "99.0%"  # the key compare writes llama-perplexity's "99.0%" KLD percentile under


@dataclass
class QualityRow:
    """One uploaded model file's figures from the compare report that measured it."""

    name: str  # the file's repository name
    quant: str
    size: int
    bits_per_weight: float
    entry: dict | None  # the report's quant entry; None: the file is the reports' source
    report: "CompareReport"


@dataclass(eq=False)  # a report is one object: rows point at it, sections are listed once per report
class CompareReport:
    data: dict
    source: str  # where it was read from, for messages


def _require(cond: bool, path, what: str) -> None:
    if not cond:
        raise SpecconvError(f"compare report {path}: {what}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_compare(path: Path) -> CompareReport:
    """A `specconv compare --json` report, its fields the card reads checked for type."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecconvError(f"compare report {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecconvError(f"compare report {path} is not valid JSON ({exc})") from None
    _require(isinstance(data, dict) and isinstance(data.get("quants"), list) and isinstance(data.get("source"), dict)
             and isinstance(data.get("text"), dict), path,
             "not a `specconv compare --json` report (no source, text and quants)")
    _require(isinstance(data["source"].get("path"), str), path, "source.path must be a path")
    _require(data["source"].get("mtp") is None or isinstance(data["source"]["mtp"], dict), path,
             "source.mtp must be an object")
    for i, q in enumerate(data["quants"]):
        where = f"quants[{i}]"
        _require(isinstance(q, dict) and isinstance(q.get("path"), str), path, f"{where}.path must be a path")
        size = q.get("size_bytes")
        _require(isinstance(size, int) and not isinstance(size, bool) and size >= 0, path,
                 f"{where}.size_bytes must be a byte count")
        digest = q.get("sha256")
        _require(digest is None or (isinstance(digest, str) and len(digest) == 64), path,
                 f"{where}.sha256 must be 64 hex digits")
        for key, sub in (("ppl_ratio", "value"), ("same_top_p", "value"), ("kld", "mean")):
            _require(isinstance(q.get(key), dict) and _finite(q[key].get(sub)), path,
                     f"{where}.{key}.{sub} must be a finite number")
        p99 = q["kld"].get(KLD_P99)
        _require(p99 is None or _finite(p99), path, f"{where}.kld.{KLD_P99} must be a finite number")
        _require(q.get("mtp") is None or isinstance(q["mtp"], dict), path, f"{where}.mtp must be an object")
    return CompareReport(data, str(path))


def bits_per_weight(paths: list[Path]) -> float:
    """Tensor bytes × 8 / parameters over every shard of a model file."""
    n_bytes = n_params = 0
    for path in paths:
        for t in read_header(path).tensors:
            n_bytes += t.n_bytes
            n_params += int(np.prod(t.dims, dtype=np.int64))
    return 8.0 * n_bytes / n_params if n_params else 0.0


def _local_size(a) -> int:
    """The bytes compare read: the local file (every shard), not the upload's re-split shards."""
    return sum(p.stat().st_size for p in a.sources)


def _same_bytes(report: CompareReport, entry: dict, a, digests: dict) -> None:
    local, size = a.sources[0], _local_size(a)
    if entry["size_bytes"] != size:
        raise SpecconvError(f"{report.source} measured {Path(entry['path']).name} of {entry['size_bytes']} bytes, but "
                            f"{local} is {size} bytes: the report is of other bytes; run specconv compare again")
    if entry.get("sha256"):
        if local not in digests:
            digests[local] = sha256_file(local).hex()
        if digests[local] != entry["sha256"].lower():
            raise SpecconvError(f"{report.source} measured {Path(entry['path']).name} with sha256 "
                                f"{entry['sha256'][:12]}…, but {local} has sha256 {digests[local][:12]}…: the "
                                "report is of other bytes; run specconv compare again")


def match_compares(reports: list[CompareReport], artifacts: list, warnings: list[str]) -> list[QualityRow]:
    """One row per uploaded model file that a report measured (or that is a report's source), in the
    plan's order. Refused: a report whose file has other bytes than the uploaded one, two reports of one file."""
    models = {a.sources[0].name: a for a in artifacts if not a.role.is_draft}
    found: dict[str, QualityRow] = {}
    digests: dict = {}
    for report in reports:
        for entry in report.data["quants"]:
            a = models.get(Path(entry["path"]).name)
            if a is None:
                warnings.append(f"{report.source}: {Path(entry['path']).name} is not among the model files uploaded; "
                                "its figures are left out of the card")
                continue
            _same_bytes(report, entry, a, digests)
            if a.name in found and found[a.name].entry is not None:
                raise SpecconvError(f"{found[a.name].report.source} and {report.source} both measured "
                                    f"{a.sources[0].name}; give one report per file")
            found[a.name] = QualityRow(a.name, a.quant, a.size, bits_per_weight(a.sources), entry, report)
        src = models.get(Path(report.data["source"]["path"]).name)
        if src is not None and src.name not in found and report.data["source"].get("size_bytes") in (None, _local_size(src)):
            found[src.name] = QualityRow(src.name, src.quant, src.size, bits_per_weight(src.sources), None, report)
    return [found[a.name] for a in artifacts if a.name in found]


def _own_head(entry: dict) -> dict | None:
    return (entry.get("mtp") or {}).get("own_head")


def quality_cells(row: QualityRow, k: int) -> list[str]:
    """Type, size, bits per weight, mean KLD, KLD p99, top-1 agreement, PPL ratio, acceptance at positions
    1..k and the predicted speed-up, formatted as the card prints them; "n/a" where the report has no figure."""
    head = [f"`{row.name}`", row.quant, human_size(row.size), f"{row.bits_per_weight:.2f}"]
    if row.entry is None:  # the reference itself: its own head's acceptance is the one the quants are read against
        cells = ["source"] * 4
        own = row.report.data["source"].get("mtp")
    else:
        q = row.entry
        p99 = q["kld"].get(KLD_P99)
        cells = [f"{q['kld']['mean']:.6f}", f"{p99:.6f}" if p99 is not None else "n/a",
                 f"{100 * q['same_top_p']['value']:.2f} %", f"{q['ppl_ratio']['value']:.4f}"]
        own = _own_head(q)
    rates = (own or {}).get("per_position") or []
    cells += [f"{rates[i]:.3f}" if i < len(rates) and _finite(rates[i]) else "n/a" for i in range(k)]
    speed = ((own or {}).get("speedup") or {}).get("at_draft_max")
    cells.append(f"{speed:.2f}×" if _finite(speed) else "n/a")
    return head + cells


def _source_line(report: CompareReport, rows: list[QualityRow]) -> str:
    """Which files a report measured, against which source (its name in this repository when it is uploaded
    too), on how much text; and the report's own notes."""
    d = report.data
    src, text = d["source"], d["text"]
    kind = src.get("type") or src.get("kind") or "source"
    names = ", ".join(f"`{r.name}`" for r in rows if r.report is report and r.entry is not None)
    source = next((r.name for r in rows if r.report is report and r.entry is None), Path(src["path"]).name)
    line = (f"{names}: measured by `specconv compare` against `{source}` ({kind}) on {text.get('chunks')} chunks "
            f"of {text.get('ctx')} tokens of a {text.get('tokens')}-token text ({text.get('scored')} scored positions)")
    if d.get("draft_max"):
        line += (f"; MTP acceptance teacher-forced with each file's own head, k = {d['draft_max']}, and the "
                 f"speed-up predicted drafting {d['draft_max']}")
    notes = [str(n) for n in d.get("notes") or []]
    return line + "." + "".join(f" Note: {n}." for n in notes)


def quality_section(rows: list[QualityRow]) -> str:
    """The card's table, one row per file, with a line per report naming its source and text."""
    if not rows:
        return ""
    k = max([r.report.data.get("draft_max") or 0 for r in rows] +
            [len((_own_head(r.entry) or {}).get("per_position") or []) for r in rows if r.entry is not None])
    cols = ["File", "Quant type", "Size", "Bits per weight", "Mean KLD", "KLD p99", "Top-1 agreement", "PPL ratio",
            *(f"Acceptance pos {i + 1}" for i in range(k)), "Predicted speed-up"]
    lines = ["## Quality against the source", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(quality_cells(r, k)) + " |" for r in rows]
    lines.append("")
    reports = list(dict.fromkeys(r.report for r in rows if r.entry is not None))
    lines += [_source_line(rep, rows) for rep in reports]
    lines += ["", "Mean KLD and its 99th percentile: the KL divergence of the file's next-token distribution from "
              "the source's, in nats, per scored position. Top-1 agreement: how often both pick the same most likely "
              "token (llama-perplexity's \"Same top p\"). PPL ratio: PPL(file) / PPL(source). Acceptance: the rate at "
              "which the file's MTP head's draft at each position is accepted; the speed-up is the one the measured "
              "costs predict (`specconv compare`'s cost model, that of `specconv verify`). Bits per weight: the "
              "file's tensor bytes × 8 / parameters.", ""]
    return "\n".join(lines)
