"""The verify report: a list of named checks plus the parity and speculative sections.

JSON keys (docs/verify.md, "Report"): `passed`, `checks` [{name, passed, detail, work}], `parity`
{max_abs_logit_diff, reference, ...}, `speculative` {exact, drafted, accepted, acceptance_rate,
acceptance_length, per_position, tokens_per_target_forward, bound, speedup, timing, rollback, ...}.
Every figure of the text report (`render`) is a value of the JSON report, or computed from its values
by the formula next to it in docs/verify.md.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specconv.digest import sha256_file
from specconv.errors import SpecconvError


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""
    work: str = ""  # what the check ran on: prompts, tokens, runs, draws ("" for checks of the files)


@dataclass
class Report:
    model: str
    checks: list[Check] = field(default_factory=list)
    parity: dict = field(default_factory=lambda: {"max_abs_logit_diff": None, "reference": None})
    speculative: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # role -> file_identity(): which bytes were verified (specconv upload)
    _work: str = field(default="", repr=False)

    def add(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail, self._work))
        return bool(passed)

    @contextmanager
    def work(self, text: str):
        """Checks added inside the block record `text` as the work they ran on."""
        before, self._work = self._work, text
        try:
            yield
        finally:
            self._work = before

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return _clean({"passed": self.passed, "model": self.model, "checks": [asdict(c) for c in self.checks],
                       "parity": self.parity, "speculative": self.speculative, "settings": self.settings,
                       "files": self.files})

    def write(self, path) -> None:
        """Written to a temporary name and renamed, so a reader never sees half a report; mode 0644 less the
        umask, like every other output (mkstemp's own files are 0600)."""
        path = Path(path)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        except OSError as exc:
            raise SpecconvError(f"cannot write the report {path}: {exc.strerror or exc}") from None
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o644 & ~umask)
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise SpecconvError(f"cannot write the report {path}: {exc.strerror or exc}") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def render(self, console) -> None:
        from rich.markup import escape

        from specconv.tables import Col, print_table, print_wrapped

        print_table(console, [Col("check"), Col("result"), Col("detail"), Col("work")],
                    [[escape(c.name), "[green]pass[/]" if c.passed else "[red]FAIL[/]", escape(c.detail), escape(c.work)]
                     for c in self.checks], title=escape(f"specconv verify {Path(self.model).name}"))
        for line in summary_lines(self.to_json()):
            print_wrapped(console, escape(line))
        console.print("[bold green]PASSED[/]" if self.passed else "[bold red]FAILED[/]")


def summary_lines(data: dict) -> list[str]:
    """The lines under the table, from the JSON report alone (so every figure in them can be found in it)."""
    from specconv.demo.measure import speedup_text

    lines = []
    s = data.get("speculative") or {}
    if s.get("drafter") and "drafted" in s:
        per = ", ".join(f"{x:.2f}" for x in s.get("per_position") or [])
        lines.append(f"speculative ({s['drafter']}, draft_max {s.get('draft_max')}, {s.get('rollback')}, "
                     f"{s.get('prompts')} prompts x {s.get('n_predict')} tokens): exact={s.get('exact')}  accepted "
                     f"{s.get('accepted')}/{s.get('drafted')}  rate {_fmt(s.get('acceptance_rate'))}  AL "
                     f"{_fmt(s.get('acceptance_length'))}  per-position [{per}]  tokens/forward "
                     f"{_fmt(s.get('tokens_per_target_forward'))}  bound {_fmt(s.get('bound'))}")
    if s.get("timing"):
        t = s["timing"]
        lines.append(f"timing ({t['repeats']} interleaved repeats of {t['prompts']} prompts x {t['n_predict']} tokens; "
                     f"median plain {_fmt(s['plain_seconds'])} s, speculative {_fmt(s['seconds'])} s): "
                     f"{speedup_text(t)}")
    lines += cost_lines(s.get("costs"))
    parity = data.get("parity") or {}
    if parity.get("reference"):
        lines.append(f"parity vs {parity['reference']}: max |Δlogit| = {_fmt(parity['max_abs_logit_diff'], 'e')}")
    return lines


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
