"""Family snapshot (tools/family_snapshot.py): every family fixture converted to f32, bf16, q8_0 and
q4_k_m gives the same file bytes, and the runtime (torch reference backend, float64) the same trunk
and drafter logits, as the snapshot stored in tests/fixtures/family_snapshot/. It pins the current
output so refactors of archs/, convert/ and runtime/ can show they changed nothing; correctness is
the parity tests' job (docs/testing.md, "Family snapshot").

Logits are compared within 1e-9 relative (of the array's largest |logit|): float64 sums in another
order (BLAS blocking, vector width of the CPU) move tiny models' logits by ~1e-14 relative — the
batched and the one-token-at-a-time forwards, which sum in different orders, are that close on
every family (measured in each case below) — while the smallest real change, one float32 rounding
in the computation, moves them by ~5e-7 (test_snapshot_sees_a_float32_computation measures it).
Bytes are compared exactly.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specconv.archs import plugin_class_for, supported_architectures
from tools import family_snapshot as fs

FAMILIES = {f.name: f for f in fs.families()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_snapshot(name, tmp_path):
    diffs, deltas = fs.check(FAMILIES[name], tmp_path)
    _, stored = fs.load(name)
    order = max(fs.compare(({}, {"t": stored[f"{t}/trunk"]}), ({}, {"t": stored[f"{t}/trunk_steps"]}))[1]["t"]
                for t in fs.OUTTYPES)
    print(f"\n[{name}] {len(fs.load(name)[0]) - 2} files, {len(deltas)} logits arrays; max relative |Δlogit| "
          f"{max(deltas.values(), default=0.0):.2e} (bound {fs.RTOL:g}); batched vs one by one (another summation "
          f"order) {order:.1e}" + "".join(f"\n    {d}" for d in diffs))
    assert not diffs
    assert order < fs.RTOL / 1000  # reordered float64 sums sit far under the bound


def test_snapshot_covers_the_registry():
    """Every architecture name the converter accepts is some family's checkpoint (or drafter) here,
    and every family has its stored snapshot (the per-family test checks the names are still those)."""
    stored = {name: fs.load(name)[0]["_architectures"] for name in FAMILIES}
    missing = sorted(set(supported_architectures()) - {a for archs in stored.values() for a in archs})
    print(f"\n{len(FAMILIES)} families cover {len(supported_architectures())} architecture names; missing {missing}")
    assert not missing
    assert sorted(p.stem for p in fs.DATA.glob("*.json")) == sorted(FAMILIES)  # no stale snapshot left


def test_snapshot_is_small():
    size = sum(p.stat().st_size for p in fs.DATA.iterdir())
    print(f"\nsnapshot: {size / 1e6:.2f} MB in {len(list(fs.DATA.iterdir()))} files")
    assert size < 6e6


# ------------------------------------------------------------------ the snapshot fails when one thing changes

CHEAP = "qwen3-release"  # a small family to perturb


def _perturbed(build_edit) -> fs.Family:
    family = FAMILIES[CHEAP]

    def build(root):
        source = family.build(root)
        build_edit(source)
        return source
    return fs.Family(CHEAP, build)


def test_snapshot_sees_a_metadata_value_written_differently(tmp_path, monkeypatch):
    """The plugin writes one key (the context length) one higher: that key is named in every file,
    and nothing else. The logits do not read it: they stay within the float64 reordering noise of
    another CPU (~1e-15; the smallest real change is ~5e-7), not exactly equal, since the snapshot
    was stored on another machine."""
    plugin = plugin_class_for({"architectures": fs.load(CHEAP)[0]["_architectures"]})
    metadata = plugin.metadata

    def one_more(self, keep_mtp):
        return [dataclasses.replace(m, value=m.value + 1) if m.key.endswith(".context_length") else m
                for m in metadata(self, keep_mtp)]

    monkeypatch.setattr(plugin, "metadata", one_more)
    diffs, deltas = fs.check(FAMILIES[CHEAP], tmp_path)
    print("\n" + "\n".join(diffs) + f"\nmax relative |Δlogit| {max(deltas.values()):.1e}")
    assert len(diffs) == len(fs.OUTTYPES) and all("metadata" in d and ".context_length" in d for d in diffs)
    assert max(deltas.values()) < fs.RTOL / 1000


def test_snapshot_sees_one_weight_changed(tmp_path):
    """One element of one checkpoint matrix set to twice its row's largest magnitude: that tensor's
    bytes in every file (the quantized ones too) and every file's logits differ, nothing else."""
    def edit(source):
        path = next(source.src.glob("*.safetensors"))
        tensors = load_file(str(path))
        name = next(n for n in sorted(tensors) if n.endswith("self_attn.o_proj.weight"))
        tensors[name][0, 0] = -2 * tensors[name][0].abs().max()  # a new block maximum: every type stores it
        save_file(tensors, str(path), metadata={"format": "pt"})
        edit.name = name

    diffs, deltas = fs.check(_perturbed(edit), tmp_path)
    print("\n" + "\n".join(diffs))
    layer = edit.name.split(".")[2]
    assert all(any(f"{t}.gguf: tensor blk.{layer}.attn_output.weight" in d for d in diffs) for t in fs.OUTTYPES)
    assert all(not d.startswith("model.") or f"blk.{layer}.attn_output.weight" in d for d in diffs)
    assert all(any(d.startswith(f"runtime {t}/trunk") for d in diffs) for t in fs.OUTTYPES)


def test_snapshot_sees_a_float32_computation(tmp_path, monkeypatch):
    """The same files computed in float32 (one rounding per operation instead of float64's): the bytes
    agree and every logits array differs beyond the bound, by the measured amount printed."""
    monkeypatch.setattr(fs, "RUNTIME_DTYPE", "f32")
    diffs, deltas = fs.check(FAMILIES[CHEAP], tmp_path)
    print(f"\nfloat32 instead of float64: relative |Δlogit| {min(deltas.values()):.1e} .. {max(deltas.values()):.1e}")
    assert diffs and all(d.startswith("runtime ") for d in diffs)
    assert min(deltas.values()) > 100 * fs.RTOL


def _records():
    return copy.deepcopy(fs.load(CHEAP))


@pytest.mark.parametrize("change", ["name", "order", "type", "key", "value", "logit", "nan", "file"])
def test_compare_names_each_kind_of_change(change):
    """compare() on the stored records with one thing edited: it fails and says what changed."""
    want, got = _records(), _records()
    files, logits = got
    f = files["model.q8_0.gguf"]
    if change == "name":
        f["tensors"][3][0] += ".renamed"
    elif change == "order":
        f["tensors"][2], f["tensors"][3] = f["tensors"][3], f["tensors"][2]
    elif change == "type":
        f["tensors"][3][1] = "F16"
    elif change == "key":
        f["kv"].append(["general.extra", "STRING", "\"x\""])
    elif change == "value":
        f["kv"][5][2] += "0"
    elif change == "logit":
        logits["q8_0/trunk"] = logits["q8_0/trunk"] * (1 + 1e-8)
    elif change == "nan":
        logits["f32/trunk_steps"] = logits["f32/trunk_steps"].copy()
        logits["f32/trunk_steps"][0, 0] = np.nan
    elif change == "file":
        del files["model.bf16.gguf"]
    if change not in ("logit", "nan", "file"):
        f["sha256"] = "0" * 64
    diffs, _ = fs.compare(want, got)
    print(f"\n{change}: {diffs}")
    expected = {"name": "renamed", "order": "another order", "type": "F16", "key": "general.extra",
                "value": f["kv"][5][0], "logit": "runtime q8_0/trunk", "nan": "runtime f32/trunk_steps: non-finite", "file": "model.bf16.gguf: missing"}[change]
    assert diffs and any(expected in d for d in diffs)
    assert fs.compare(_records(), _records())[0] == []


def test_stored_logits_load_without_pickle():
    _, logits = fs.load(CHEAP)
    assert logits and all(isinstance(a, np.ndarray) and a.dtype != object for a in logits.values())
    assert logits["f32/trunk"].dtype == np.float64 and torch.get_num_threads() == 1
