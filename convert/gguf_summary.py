"""What a GGUF file is, for `specconv inspect`: arch, graph types it serves, hparams, tensors, sizes.

The serving classification follows the pinned llama.cpp loaders (docs/reference/gguf-layout.md §4.3):
* MTP-only (all MTP-capable arches): nextn_predict_layers > 0 and `blk.0.attn_norm.weight` absent;
* trunk-only: no nextn key (or 0); for glm4moe / deepseek2 also nextn > 0 with
  `blk.{n_layer}.nextn.eh_proj.weight` absent (those loaders then skip the MTP tensors);
* otherwise both the main graph and the MTP graph.
A Qwen file that declares nextn layers but lacks their tensors does not load in llama.cpp (qwen35,
qwen35moe and qwen3next have no trunk-only detection); that is reported as a problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specconv.archs import names, plugin_classes_writing

from specconv.runtime.gguf_reader import GgufFile, open_gguf
from .plan_report import kv_value


def serves(f: GgufFile) -> tuple[list[str], list[str]]:
    """(graph types the file serves: "main" and/or "mtp", problems that keep llama.cpp from loading it)."""
    nextn = f.nextn_layers()
    problems: list[str] = []
    if f.arch == names.EAGLE3:  # a draft head: llama.cpp runs its ENCODER graph and its decoder next to a target
        return ["encoder", "decoder"], problems
    if _standalone_drafter(f.arch):  # every block drafts, reading the target's K/V (docs/reference/gguf-layout.md §7.7)
        if nextn != f.block_count():
            problems.append(f"a gemma4-assistant file needs nextn_predict_layers = block_count ({f.block_count()}), "
                            f"it declares {nextn}")
        for name in ("nextn.pre_projection.weight", "nextn.post_projection.weight"):
            if name not in f.tensors:
                problems.append(f"a gemma4-assistant file needs {name}")
        return ["mtp"], problems
    if nextn <= 0:
        return ["main"], problems
    total = f.block_count()
    if nextn > total:
        return [], [f"nextn_predict_layers={nextn} exceeds block_count={total}"]
    num_hidden_layers = total - nextn
    if "blk.0.attn_norm.weight" not in f.tensors:
        missing = [f"blk.{i}.nextn.eh_proj.weight" for i in range(num_hidden_layers, total) if f"blk.{i}.nextn.eh_proj.weight"
                   not in f.tensors]
        if missing:
            problems.append(f"MTP-only file without {missing[0]}")
        return ["mtp"], problems
    head = f"blk.{num_hidden_layers}.nextn.eh_proj.weight"
    if head not in f.tensors:
        if any(p.llama_cpp_skips_absent_nextn for p in plugin_classes_writing(f.arch)):
            return ["main"], problems
        problems.append(f"declares {nextn} MTP layer(s) but {head} is missing; llama.cpp's {f.arch} loader "
                        "refuses such a file (write it trunk-only: no nextn key, block_count = N)")
        return ["main"], problems
    return ["main", "mtp"], problems


def _standalone_drafter(arch: str) -> bool:
    """A file that is all draft blocks reading a target's K/V (ArchPlugin.standalone_drafter)."""
    return any(p.standalone_drafter for p in plugin_classes_writing(arch))


def summarize(path: str | Path) -> dict[str, Any]:
    f = open_gguf(path)
    graph_types, problems = serves(f)
    arch = f.arch
    prefix = arch + "."
    hparams = {k[len(prefix):]: kv_value(v) for k, v in f.kv.items() if k.startswith(prefix)}
    general = {k: kv_value(v) for k, v in f.kv.items() if k.startswith("general.")}
    tokenizer = {k: kv_value(v, 4) for k, v in f.kv.items() if k.startswith("tokenizer.")}
    tensors = [{"name": t.name, "type": t.ggml_type.name, "shape": list(t.shape), "bytes": t.n_bytes,
                "shard": t.shard + 1} for t in f]
    by_type: dict[str, dict[str, int]] = {}
    for t in f:
        entry = by_type.setdefault(t.ggml_type.name, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.n_bytes
    nextn = f.nextn_layers()
    by_group = _types_by_group(f, f.block_count() - nextn if nextn else f.block_count())
    return {
        "path": str(f.path),
        "shards": [str(p) for p in f.paths],
        "file_bytes": sum(p.stat().st_size for p in f.paths),
        "arch": arch,
        "serves": graph_types,
        "kind": {("main",): "trunk-only", ("mtp",): "mtp-only", ("main", "mtp"): "embedded",
                 ("encoder", "decoder"): "EAGLE-3 draft head"}.get(tuple(graph_types), "unusable")
        if not _standalone_drafter(arch) else "Gemma 4 assistant drafter (reads its target's K/V)",
        "block_count": f.block_count(),
        "nextn_predict_layers": nextn,
        "problems": problems,
        "general": general,
        "hparams": hparams,
        "tokenizer": tokenizer,
        "n_tensors": len(tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "by_type": by_type,
        "by_group": by_group,
        "tensors": tensors,
    }


def _types_by_group(f: GgufFile, first_mtp: int) -> dict[str, dict[str, int]]:
    """Tensor types counted per group: the trunk's blocks, the MTP / nextn blocks (from layer
    block_count - nextn_predict_layers on) and the rest (embeddings, output): a K-quant file's mix."""
    groups: dict[str, dict[str, int]] = {}
    for t in f:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        group = "other" if layer is None or not layer.isdigit() else ("mtp" if int(layer) >= first_mtp else "trunk")
        counts = groups.setdefault(group, {})
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    return groups
