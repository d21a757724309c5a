"""The verify report: a list of named checks plus the parity and speculative sections.

JSON keys (docs/verify.md, "Report"): `passed`, `checks` [{name, passed, detail}], `parity`
{max_abs_logit_diff, reference, ...}, `speculative` {exact, drafted, accepted, acceptance_rate,
acceptance_length, per_position, tokens_per_target_forward, bound, speedup, rollback, ...}.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specconv.digest import sha256_file


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Report:
    model: str
    checks: list[Check] = field(default_factory=list)
    parity: dict = field(default_factory=lambda: {"max_abs_logit_diff": None, "reference": None})
    speculative: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # role -> file_identity(): which bytes were verified (specconv upload)

    def add(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return _clean({"passed": self.passed, "model": self.model, "checks": [asdict(c) for c in self.checks],
                       "parity": self.parity, "speculative": self.speculative, "settings": self.settings,
                       "files": self.files})

    def write(self, path) -> None:
        """Written to a temporary name and renamed, so a reader never sees half a report."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def render(self, console) -> None:
        from rich.markup import escape

        from specconv.tables import Col, print_table

        print_table(console, [Col("check"), Col("result"), Col("detail")],
                    [[escape(c.name), "[green]pass[/]" if c.passed else "[red]FAIL[/]", escape(c.detail)]
                     for c in self.checks], title=escape(f"specconv verify {Path(self.model).name}"))
        s = self.speculative
        if s.get("drafter"):
            per = ", ".join(f"{x:.2f}" for x in s.get("per_position") or [])
            console.print(
                f"speculative ({s['drafter']}, draft_max {s.get('draft_max')}, {s.get('rollback')}): "
                f"exact={s.get('exact')}  accepted {s.get('accepted')}/{s.get('drafted')}  "
                f"rate {_fmt(s.get('acceptance_rate'))}  AL {_fmt(s.get('acceptance_length'))}  "
                f"per-position [{per}]  tokens/forward {_fmt(s.get('tokens_per_target_forward'))}  "
                f"bound {_fmt(s.get('bound'))}  speed-up {_fmt(s.get('speedup'))}")
            for line in cost_lines(s.get("costs")):
                console.print(escape(line))
        if self.parity.get("reference"):
            console.print(f"parity vs {self.parity['reference']}: max |Δlogit| = {_fmt(self.parity['max_abs_logit_diff'], 'e')}")
        console.print("[bold green]PASSED[/]" if self.passed else "[bold red]FAILED[/]")


def file_identity(path) -> dict:
    """Absolute path, size and sha256 of a verified file: `specconv upload` matches a report to the file it
    publishes by these and refuses a report of other bytes (docs/upload.md, "A quant ladder")."""
    path = Path(path).resolve()
    return {"path": str(path), "size": path.stat().st_size, "sha256": sha256_file(path).hex()}


def cost_lines(costs: dict | None) -> list[str]:
    """One line per runner: the measured cost ratios and the speed-up they predict (specconv/verify/costs.py)."""
    lines = []
    for runner in ("specconv", "llama.cpp"):
        c = (costs or {}).get(runner)
        if not c:
            continue
        if c.get("error"):
            lines.append(f"costs ({runner}): not measured: {c['error']}")
            continue
        ratios = " ".join(f"{r:.2f}" for r in c["target_ratios"])
        p = c.get("predicted") or {}
        best = (f"predicted speed-up {p['best']:.2f}x at k={p['best_k']}" if p.get("best") is not None
                else "no predicted speed-up (drafter cost not measured for this runner)")
        lines.append(f"costs ({runner}, {c.get('threads')} threads): t(n)/t(1) for n=1..{len(c['target_ratios'])} "
                     f"[{ratios}]  c {_fmt(c.get('c'))}  c_round {_fmt(c.get('c_round'))}  {best}")
    return lines


def _fmt(x, style: str = "f") -> str:
    if x is None:
        return "n/a"
    return f"{x:.2e}" if style == "e" else f"{x:.3f}"


def _clean(obj):
    """JSON-safe: NaN/inf become None (strict JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj
