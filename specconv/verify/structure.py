"""File checks: tensors and metadata per arch, MTP presence vs `nextn_predict_layers`, vocabulary sizes,
and whether a sidecar belongs to its trunk.

The expected tensor set comes from the runtime graph of the file's arch (the same lists the
runtime loads by), so a check here and a load there agree on what a complete file is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import numpy as np

from specconv.runtime.model import Model
from specconv.runtime.types import GraphType
from specconv.verify.report import Report

_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
# Shared tensors dequantized and compared when the two files store them in different types: the
# relative L2 error of q4_0 is ~0.1, two unrelated random matrices differ by ~1.4.
SHARED_REL_TOL = 0.25


def expected_tensors(model: Model) -> set[str]:
    g, hp = model.graph, model.hparams
    names = set(g.OPTIONAL)
    if GraphType.MAIN in model.serves:
        names |= set(g.main_tensors(hp))
        names |= set(g.optional_main_tensors(hp))  # e.g. glm4moe attention biases
    if GraphType.MTP in model.serves:
        names |= set(g.mtp_tensors(hp)) | set(g.optional_mtp_tensors(hp))
    if GraphType.ENCODER in model.serves:  # EAGLE-3 fc (and its optional input norm)
        names |= set(g.encoder_tensors(hp))
    return names


def check_file(report: Report, model: Model, label: str) -> None:
    f, hp = model.file, model.hparams
    names = set(f.tensors)
    unexpected = sorted(names - expected_tensors(model))
    report.add(f"{label}: tensors", not unexpected,
               f"{len(names)} tensors, arch {model.arch}, serves {sorted(g.value for g in model.serves)}"
               + (f"; not part of the {model.arch} graph: {', '.join(unexpected[:5])}" if unexpected else ""))
    nextn_blocks = sorted({int(m.group(1)) for n in names if (m := _NEXTN.match(n))})
    declared = list(range(hp.num_hidden_layers, hp.num_hidden_layers + hp.num_nextn_predict_layers))
    if model.kind == "assistant":  # Gemma 4 assistant: every block is a draft layer reading the target's K/V
        ok = hp.num_hidden_layers == 0 and hp.num_nextn_predict_layers > 0
        detail = f"nextn_predict_layers={hp.num_nextn_predict_layers} = block_count: every layer drafts (no trunk, no nextn blocks)"
    elif not nextn_blocks:
        ok = True
        detail = (f"declares {hp.num_nextn_predict_layers} MTP layer(s), holds none (a trunk-only file: give the head with --mtp)"
                  if hp.num_nextn_predict_layers else "no MTP layers declared or present")
    else:
        ok = nextn_blocks == declared
        detail = f"nextn_predict_layers={hp.num_nextn_predict_layers} (blocks {declared}), nextn tensors in blocks {nextn_blocks}"
    report.add(f"{label}: MTP layers vs nextn_predict_layers", ok, detail)
    sizes = {"token_embd rows": model.vocab_size}
    if "output.weight" in model.weights and "d2t" not in model.weights:  # with d2t: a draft vocabulary
        sizes["output rows"] = int(model.weights["output.weight"].shape[0])
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None:
        sizes["tokenizer tokens"] = len(tokens)
    declared_vocab = f.get(f"{model.arch}.vocab_size")
    if declared_vocab is not None:
        sizes[f"{model.arch}.vocab_size"] = int(declared_vocab)
    report.add(f"{label}: vocabulary sizes", len(set(sizes.values())) == 1,
               ", ".join(f"{k} {v}" for k, v in sizes.items()))


def tokenizer_fingerprint(model: Model) -> str | None:
    f = model.file
    parts = [f.get(k) for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                "tokenizer.ggml.token_type")]
    if parts[1] is None:
        return None
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p if not isinstance(p, np.ndarray) else p.tolist()).encode())
    return h.hexdigest()[:16]


_NOT_COMPARED = {"num_nextn_predict_layers", "extra", "recurrent", "context_length"}


def check_pair(report: Report, target: Model, head: Model, label: str) -> None:
    """A sidecar (or draft of the same family) belongs to the trunk: arch, trunk hparams, tokenizer, shared tensors."""
    problems = []
    if head.arch != target.arch:
        problems.append(f"arch {head.arch} ≠ {target.arch}")
    else:
        for fld in dataclasses.fields(target.hparams):
            if fld.name in _NOT_COMPARED:
                continue
            a, b = getattr(target.hparams, fld.name), getattr(head.hparams, fld.name)
            if a != b:
                problems.append(f"{fld.name} {b} ≠ {a}")
    report.add(f"{label}: same arch and hyper-parameters", not problems,
               "; ".join(problems) if problems else f"{target.arch}, {target.hparams.num_hidden_layers} trunk blocks, "
                                                     f"width {target.hidden_size}")
    fa, fb = tokenizer_fingerprint(target), tokenizer_fingerprint(head)
    same_vocab = target.vocab_size == head.vocab_size and (fa is None or fb is None or fa == fb)
    report.add(f"{label}: same vocabulary", same_vocab,
               f"{head.vocab_size} vs {target.vocab_size} tokens, tokenizer fingerprint {fb} vs {fa}")
    shared = [n for n in ("token_embd.weight", "output.weight", "output_norm.weight")
              if n in target.file.tensors and n in head.file.tensors]
    diffs = {n: _tensor_difference(target, head, n) for n in shared}
    bad = {n: d for n, d in diffs.items() if d > SHARED_REL_TOL}
    report.add(f"{label}: shared tensors match the trunk's", bool(shared) and not bad,
               ", ".join(f"{n} rel. diff {d:.2e}" for n, d in diffs.items()) or "no shared tensors to compare")


def _tensor_difference(a: Model, b: Model, name: str) -> float:
    """0 for identical bytes; else the relative L2 difference of the dequantized tensors."""
    ta, tb = a.file.tensors[name], b.file.tensors[name]
    if ta.tensor_type == tb.tensor_type and np.array_equal(np.asarray(ta.data), np.asarray(tb.data)):
        return 0.0
    x, y = a.file.load(name), b.file.load(name)
    if x.shape != y.shape:
        return float("inf")
    x, y = x.double(), y.double()
    return float((x - y).norm() / x.norm().clamp_min(1e-30))
