"""Read a `specconv verify --report FILE` (or `--json`) report for the model card.

The schema (docs/architecture.md): `passed`, `checks` [{name, passed, detail}], `parity`
{max_abs_logit_diff, reference}, `speculative` {exact, drafted, accepted, acceptance_rate,
acceptance_length, per_position, tokens_per_target_forward, bound, speedup, rollback, costs, synthetic},
`model` (the path verify was given) and `files` {model, mtp, draft: {path, size, sha256}} (the verified bytes,
which `specconv/hub/verified.py` matches to the files of an upload). Every section is optional; a present
section must have the right types.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specconv.errors import SpecconvError

_SPEC_NUMBERS = (
    "drafted",
    "accepted",
    "acceptance_rate",
    "acceptance_length",
    "tokens_per_target_forward",
    "bound",
    "speedup",
)


@dataclass
class PositionStat:
    position: int  # 1-based draft position
    rate: float | None
    drafted: int | None = None
    accepted: int | None = None


@dataclass
class VerifyReport:
    passed: bool | None = None
    checks: list[dict] = field(default_factory=list)
    parity: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)
    per_position: list[PositionStat] = field(default_factory=list)
    model: str | None = None  # the model path as given to verify
    files: dict = field(default_factory=dict)  # role -> {path, size, sha256} (any of them may be missing)
    source: str = "the verify report"  # where it was read from, for messages


def _number(value, where: str) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise SpecconvError(f"verify report: {where} must be a finite number, got {value!r}")
    return value


def _position(index: int, item) -> PositionStat:
    where = f"speculative.per_position[{index}]"
    if isinstance(item, dict):
        rate = item.get("acceptance_rate", item.get("rate"))
        drafted = _number(item.get("drafted"), f"{where}.drafted")
        accepted = _number(item.get("accepted"), f"{where}.accepted")
        if rate is None and drafted:
            rate = (accepted or 0) / drafted
        pos = item.get("position", index + 1)
        return PositionStat(int(_number(pos, f"{where}.position")), _number(rate, where), drafted, accepted)
    return PositionStat(index + 1, _number(item, where))


def load_report(path: Path) -> VerifyReport:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecconvError(f"verify report {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecconvError(f"verify report {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SpecconvError(f"verify report {path} must be a JSON object")
    try:
        report = parse_report(data)
    except SpecconvError as exc:
        raise SpecconvError(f"{path}: {exc}") from None
    report.source = str(path)
    return report


def parse_report(data: dict) -> VerifyReport:
    report = VerifyReport()
    passed = data.get("passed")
    if passed is not None and not isinstance(passed, bool):
        raise SpecconvError("verify report: `passed` must be true or false")
    report.passed = passed

    checks = data.get("checks", [])
    if not isinstance(checks, list):
        raise SpecconvError("verify report: `checks` must be a list")
    for i, check in enumerate(checks):
        if not isinstance(check, dict) or not isinstance(check.get("name"), str):
            raise SpecconvError(f"verify report: checks[{i}] must be an object with a string `name`")
        if not isinstance(check.get("passed"), bool):
            raise SpecconvError(f"verify report: checks[{i}].passed must be true or false")
        report.checks.append(
            {"name": check["name"], "passed": check["passed"], "detail": str(check.get("detail", "") or "")}
        )

    parity = data.get("parity") or {}
    if not isinstance(parity, dict):
        raise SpecconvError("verify report: `parity` must be an object")
    report.parity = {
        "max_abs_logit_diff": _number(parity.get("max_abs_logit_diff"), "parity.max_abs_logit_diff"),
        "reference": None if parity.get("reference") is None else str(parity.get("reference")),
    }

    spec = data.get("speculative") or {}
    if not isinstance(spec, dict):
        raise SpecconvError("verify report: `speculative` must be an object")
    report.speculative = {key: _number(spec.get(key), f"speculative.{key}") for key in _SPEC_NUMBERS}
    exact = spec.get("exact")
    if exact is not None and not isinstance(exact, bool):
        raise SpecconvError("verify report: speculative.exact must be true or false")
    report.speculative["exact"] = exact
    rollback = spec.get("rollback")
    report.speculative["rollback"] = None if rollback is None else str(rollback)
    per_position = spec.get("per_position") or []
    if not isinstance(per_position, list):
        raise SpecconvError("verify report: speculative.per_position must be a list")
    report.per_position = [_position(i, item) for i, item in enumerate(per_position)]
    report.speculative["costs"] = _costs(spec.get("costs"))
    report.speculative["synthetic"] = spec.get("synthetic") is True
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise SpecconvError("verify report: `model` must be a path")
    report.model = model
    report.files = _files(data.get("files"))
    return report


def _files(files) -> dict:
    """`files`: per role the verified file's path (string), size (integer) and sha256 (64 hex digits)."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise SpecconvError("verify report: `files` must be an object")
    out = {}
    for role, entry in files.items():
        where = f"files.{role}"
        if not isinstance(entry, dict):
            raise SpecconvError(f"verify report: {where} must be an object")
        path, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
        if not isinstance(path, str) or not path:
            raise SpecconvError(f"verify report: {where}.path must be a path")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise SpecconvError(f"verify report: {where}.size must be a byte count")
        if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                       and all(c in "0123456789abcdef" for c in digest.lower())):
            raise SpecconvError(f"verify report: {where}.sha256 must be 64 hex digits")
        out[str(role)] = {"path": path, "size": size, "sha256": digest.lower() if digest else None}
    return out


def _costs(costs) -> dict | None:
    """`speculative.costs` (specconv/verify/costs.py): per runner the measured t(n)/t(1), the drafter's c and
    c_round, and the predicted speed-up; numbers checked, an `error` kept as text."""
    if costs is None:
        return None
    if not isinstance(costs, dict):
        raise SpecconvError("verify report: speculative.costs must be an object")
    out = {"alpha": _number(costs.get("alpha"), "speculative.costs.alpha"), "drafter": str(costs.get("drafter") or "")}
    for runner in ("specconv", "llama.cpp"):
        c = costs.get(runner)
        if c is None:
            continue
        where = f"speculative.costs.{runner}"
        if not isinstance(c, dict):
            raise SpecconvError(f"verify report: {where} must be an object")
        if c.get("error"):
            out[runner] = {"error": str(c["error"])}
            continue
        ratios = c.get("target_ratios")
        if not isinstance(ratios, list) or not ratios:
            raise SpecconvError(f"verify report: {where}.target_ratios must be a non-empty list")
        pred = c.get("predicted") or {}
        if not isinstance(pred, dict):
            raise SpecconvError(f"verify report: {where}.predicted must be an object")
        out[runner] = {
            "target_ratios": [_number(r, f"{where}.target_ratios[{i}]") for i, r in enumerate(ratios)],
            "threads": _number(c.get("threads"), f"{where}.threads"),
            "c": _number(c.get("c"), f"{where}.c"),
            "c_round": _number(c.get("c_round"), f"{where}.c_round"),
            "best": _number(pred.get("best"), f"{where}.predicted.best"),
            "best_k": _number(pred.get("best_k"), f"{where}.predicted.best_k"),
        }
    return out
