"""Re-split shards on local disk before upload, with a manifest so that work is never repeated.

Shards go to `DIR/.specconv-upload/<path in repo>`. A manifest per artifact records the sources
(path, size, mtime), the size limit, and each shard's path, size and sha256. It lets a rerun
  * reuse complete shards instead of writing them again, and
  * after a successful upload (shards deleted, manifest kept), see from the remote tree alone that
    an artifact is already on the Hub, without re-splitting a multi-GB file to hash it.
The digests are not wasted work: the upload passes them on, so huggingface_hub does not hash again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specconv.hub.plan import Artifact, UploadPlan
from specconv.hub.split import write_split
from specconv.hub.verified import VERIFY_CACHE
from specconv.digest import sha256_file

MANIFESTS = ".manifests"


def _manifest_path(plan: UploadPlan, a: Artifact) -> Path:
    return plan.staging_dir / MANIFESTS / f"{a.name}.json"


def _identity(plan: UploadPlan, a: Artifact) -> dict:
    return {
        "sources": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in a.sources],
        "max_file_size": plan.max_file_size,
        "files": [[f.path_in_repo, f.size] for f in a.files],
    }


def recorded_digests(plan: UploadPlan, a: Artifact) -> list[bytes] | None:
    """The shard digests of a previous split of exactly these sources, or None."""
    try:
        data = json.loads(_manifest_path(plan, a).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or {k: data.get(k) for k in ("sources", "max_file_size", "files")} != _identity(plan, a):
        return None
    digests = data.get("sha256")
    if not isinstance(digests, list) or len(digests) != len(a.files):
        return None
    try:
        return [bytes.fromhex(d) for d in digests]
    except (TypeError, ValueError):
        return None


def stage(plan: UploadPlan, on_artifact=None, skip: set[str] = frozenset()) -> None:
    """Make every re-split artifact (except those named in `skip`) exist on disk, digests known."""
    for a in plan.artifacts:
        if a.layout is None or a.name in skip:
            continue
        digests = recorded_digests(plan, a)
        if digests is not None and all(f.staged.is_file() and f.staged.stat().st_size == f.size for f in a.files):
            for f, d in zip(a.files, digests):
                f.sha256 = d
            continue
        if on_artifact is not None:
            on_artifact(a)
        write_split(a.layout, [f.staged for f in a.files])
        for f in a.files:
            f.sha256 = sha256_file(f.staged)
        manifest = _manifest_path(plan, a)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps({**_identity(plan, a), "sha256": [f.sha256.hex() for f in a.files]}))
        os.replace(tmp, manifest)


def remove_shards(plan: UploadPlan) -> None:
    """Delete staged shards after a successful upload; keep the small manifests and `--verify`'s reports
    (specconv/hub/verified.py) for reruns."""
    if not plan.staging_dir.is_dir():
        return
    for entry in plan.staging_dir.iterdir():
        if entry.name in (MANIFESTS, VERIFY_CACHE):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
