"""Which `specconv verify` report belongs to which file of an upload, and `--verify` runs.

A quant ladder (`convert --outtype q8_0,q6_k,q4_k_m`) is published with one card whose file table shows the
verify figures of each file. A report names the bytes it verified (`files.model` {path, size, sha256},
written by specconv/verify/report.py; older reports only `model`, a path). Each report is matched to a model
file of the upload by that path (as recorded, relative to the report's folder, or by file name when the
files were moved), then its size and sha256 must be the file's: a report of other bytes is refused, so a
figure on the card is always one measured on the file next to it. A model without a report is shown as
"not verified". `--verify` runs verify on each such model (with its `mtp-` sidecar), caching the report in
the staging folder keyed by the files' path, size and mtime, so a rerun of an interrupted upload neither
verifies again nor changes the card.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specconv.errors import SpecconvError
from specconv.hub.naming import Role
from specconv.hub.report import VerifyReport, load_report, parse_report
from specconv.digest import sha256_file

VERIFY_CACHE = "verify"  # under the staging folder; kept after an upload (staging.remove_shards)



def _find(recorded: str, artifacts: list, report_dir: Path | None):
    """The artifact whose first file is `recorded`: the same file, else the only one of that name."""
    path = Path(recorded)
    candidates = [path] if path.is_absolute() else [p for p in (report_dir and report_dir / path, Path.cwd() / path) if p]
    for c in candidates:
        try:
            resolved = c.resolve()
        except (OSError, ValueError):  # a hostile report: a NUL in the path, a link loop
            continue
        for a in artifacts:
            if a.sources[0].resolve() == resolved:
                return a
    named = [a for a in artifacts if a.sources[0].name == path.name]
    return named[0] if len(named) == 1 else None


def _check_same_bytes(report: VerifyReport, recorded: dict, a, digests: dict) -> None:
    """Refuse a report whose recorded size or sha256 is not the file's."""
    local = a.sources[0]
    size = local.stat().st_size
    if recorded.get("size") is not None and recorded["size"] != size:
        raise SpecconvError(f"{report.source} verified {Path(recorded['path']).name} of {recorded['size']} bytes, but "
                            f"{local} is {size} bytes: the report is of other bytes; run specconv verify on this "
                            "file again")
    if recorded.get("sha256"):
        if local not in digests:
            digests[local] = sha256_file(local).hex()
        if digests[local] != recorded["sha256"]:
            raise SpecconvError(f"{report.source} verified {Path(recorded['path']).name} with sha256 "
                                f"{recorded['sha256'][:12]}…, but {local} has sha256 {digests[local][:12]}…: the "
                                "report is of other bytes; run specconv verify on this file again")


def match_reports(reports: list[VerifyReport], artifacts: list, warnings: list[str]) -> dict[str, bytes]:
    """Set `artifact.report` (models) and `artifact.verified_with` (sidecars) from the reports; refuse a
    report that matches no model file, another file's bytes, or a file that already has one. Returns the
    sha256 digests computed on the way (file path -> digest), for the upload to reuse."""
    models = [a for a in artifacts if not a.role.is_draft]
    sidecars = [a for a in artifacts if a.role.is_draft]
    digests: dict[Path, str] = {}
    for report in reports:
        recorded = report.files.get("model") or ({"path": report.model} if report.model else None)
        report_dir = Path(report.source).parent if report.source != "the verify report" else None
        if recorded is None:
            if len(models) != 1 or len(reports) != 1:
                raise SpecconvError(f"{report.source} does not say which file it verified (no `model` or `files`): "
                                    "with several model files, give reports written by `specconv verify --report FILE`")
            target = models[0]
        else:
            target = _find(recorded["path"], models, report_dir)
            if target is None:
                names = ", ".join(a.sources[0].name for a in models) or "none"
                raise SpecconvError(f"{report.source} verified {recorded['path']}, which is not among the model files "
                                    f"to upload ({names})")
            _check_same_bytes(report, recorded, target, digests)
            if not report.files.get("model"):
                warnings.append(f"{report.source} records no size or sha256 of {target.sources[0].name} (an older "
                                "specconv verify): matched by path only")
        if target.report is not None:
            raise SpecconvError(f"{target.report.source} and {report.source} both verify {target.sources[0].name}; "
                                "give one report per file")
        target.report = report
        for role in ("mtp", "draft"):  # the sidecar or draft head it ran with: the same bytes as uploaded
            recorded = report.files.get(role)
            if not recorded:
                continue
            draft = _find(recorded["path"], sidecars, report_dir)
            if draft is None:
                warnings.append(f"{report.source} verified {target.sources[0].name} with "
                                f"{Path(recorded['path']).name}, which is not part of this upload")
            else:
                _check_same_bytes(report, recorded, draft, digests)
                draft.verified_with = target.name
    return {p: bytes.fromhex(d) for p, d in digests.items()}


def paired_sidecar(model, artifacts: list):
    """The `mtp-` sidecar published with `model` (same base and quant), if any."""
    found = [a for a in artifacts if a.role is Role.SIDECAR and a.base == model.base and a.quant == model.quant]
    return found[0] if found else None


def _identity(model, sidecar, hf: Path | None, n_predict: int) -> list:
    files = [*model.sources, *(sidecar.sources if sidecar else [])]
    return [[[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
            str(Path(hf).resolve()) if hf else None, n_predict]


def run_verify_missing(artifacts: list, staging: Path, *, hf: Path | None = None, n_predict: int | None = None,
                       device: str = "auto", progress=lambda msg: None) -> list[VerifyReport]:
    """`specconv verify` on every model file that has no report yet (with its sidecar, and `--hf` parity when
    given); reports cached under staging/verify/. Returns the reports (already-matched models skipped)."""
    from specconv.verify import VerifyOptions, run_verify
    from specconv.verify.run import StatusProgress

    out = []
    for a in artifacts:
        if a.role.is_draft or a.report is not None:
            continue
        sidecar = paired_sidecar(a, artifacts)
        identity = _identity(a, sidecar, hf, n_predict)
        cache = staging / VERIFY_CACHE / f"{a.name}.json"
        try:
            data = json.loads(cache.read_text())
            if data.get("identity") == identity:
                report = parse_report(data["report"])
                report.source = str(cache)
                out.append(report)
                progress(f"verified {a.name} before (cached report)")
                continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        progress(f"verifying {a.name}" + (f" with {sidecar.name}" if sidecar else ""))
        opts = VerifyOptions(model=a.sources[0], mtp=sidecar.sources[0] if sidecar else None, hf=hf,
                             n_predict=n_predict, device=device)
        data = run_verify(opts, progress=StatusProgress(progress, prefix=f"verifying {a.name}: ")).to_json()
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": identity, "report": data}))
        os.replace(tmp, cache)
        report = parse_report(data)
        report.source = str(cache)
        out.append(report)
    return out


def load_reports(items) -> list[VerifyReport]:
    return [item if isinstance(item, VerifyReport) else load_report(Path(item)) for item in items]
