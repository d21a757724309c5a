"""A conversion plan as plain data (for `--json` and `--dry-run`): files, tensors, types, sizes, KV."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFValueType

from specconv.archs.base import MetaKV

from .engine import ConversionPlan


def shortest_float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (an eps stored as float32 shows as 1e-06,
    not as its double expansion 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def kv_value(entry: MetaKV, max_items: int | None = 16) -> Any:
    """A JSON-friendly value; long arrays (token lists, merges) are summarised unless max_items is None."""
    value = entry.value
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if entry.vtype == GGUFValueType.FLOAT32:
        return shortest_float32(value)
    if entry.vtype == GGUFValueType.ARRAY:
        items = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value]
        if entry.sub_type == GGUFValueType.FLOAT32:
            items = [shortest_float32(v) for v in items]
        if max_items is not None and len(items) > max_items:
            return {"array": entry.sub_type.name if entry.sub_type is not None else "?", "length": len(items),
                    "head": items[:4]}
        return items
    if isinstance(value, str) and max_items is not None and len(value) > 200:
        return value[:200] + f"... ({len(value)} chars)"
    return value


def plan_summary(plan: ConversionPlan, *, tensors: bool = True, full_kv: bool = False) -> dict[str, Any]:
    files = []
    for f in plan.files:
        entry: dict[str, Any] = {
            "kind": f.kind,
            "path": str(f.path),
            "shards": [str(p) for p in f.output.final_paths],
            "shard_bytes": f.output.shard_sizes,
            "n_tensors": len(f.tensors),
            "tensor_bytes": f.output.total_bytes,
            "types": _type_counts(f),
            "metadata": {e.key: kv_value(e, None if full_kv else 16) for e in f.kv},
        }
        if tensors:
            entry["tensors"] = [{"name": t.name, "type": t.ggml_type.name, "shape": list(reversed(t.plan.shape)),
                                 "bytes": t.nbytes, "role": t.plan.role.value, **({"note": t.note} if t.note else {})}
                                for t in f.tensors]
        files.append(entry)
    return {
        "source": str(plan.src),
        "hf_architecture": plan.hf_architecture,
        "arch": plan.arch,
        "mtp_mode": plan.mode.value,
        "outtype": plan.outtype.name,
        "trunk_layers": plan.n_trunk,
        "mtp_layers": plan.n_mtp,
        "skipped_tensors": len(plan.skipped),
        "notices": list(plan.notices),
        "files": files,
    }


def _type_counts(f) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in f.tensors:
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    return counts


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
