"""Every family's converted bytes and runtime logits, pinned so a refactor can prove it changed nothing.

For each family fixture — the family sweep's cases (tests/fixtures/family_sweep.py: every converter
family in its release layout and its behaviour-switching shapes, with its drafter: MTP, EAGLE-3,
DFlash / DFlash2, the Gemma 4 assistant, n-gram) plus the families the sweep leaves to their own
tests (DSA: glm-dsa and deepseek32; chained MTP: hy_v3, step35, mimo2) and fixtures for the
registry's remaining architecture names (Step-3.7's wrapper, the Qwen3 EAGLE-3 heads,
`Eagle3DraftModel`, Gemma 4's text-only layout; tests/families/test_family_snapshot.py checks that every
name the converter accepts is covered) — this tool

* converts the checkpoint (and its drafter's) with `specconv convert` to each of OUTTYPES, and
  records each file's sha256 and, for the report, its metadata and tensor table (name, type, shape,
  sha256 of the bytes) in `tests/fixtures/family_snapshot/<family>.json`;
* loads every file of the family in the runtime with the torch reference backend in float64
  (SPECCONV_NO_NATIVE=1: the native CPU kernels' sums depend on the instruction set, the torch
  float64 ones only in the last bits) and records on the family's prompt the trunk's logits of
  the last TRUNK_ROWS positions (in one batch, and one token at a time after a prefill), the logits
  its drafter's head computes for one draft of DRAFT_MAX tokens after that prompt, and, on the f32
  file, the rounds of two greedy speculative runs (the family's drafter; a drafter of set
  acceptance, so that rounds roll back) in `<family>.npz` (np.savez_compressed, read with
  allow_pickle=False).

A snapshot needs FIXED inputs: every fixture comes from its builder with the fixed seeds the sweep
and the family tests give it (the builders redraw every tensor from `torch.Generator(seed)`), the
prompts are drawn from fixed numpy seeds, and nothing here draws at random. The tokenizers are
trained on Python's standard library text, so the snapshot belongs to the pinned environment
(Python, torch, transformers, tokenizers): regenerate it when that changes (docs/testing.md).

    python3 tools/family_snapshot.py [FAMILY ...]          # compare, print what differs per family
    python3 tools/family_snapshot.py --write [FAMILY ...]  # regenerate (an intended change of output)

This pins the current output against refactors; it proves nothing about correctness, which the
parity tests against transformers and llama.cpp do (docs/testing.md, "Family snapshot").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "fixtures" / "family_snapshot"
OUTTYPES = ("f32", "bf16", "q8_0", "q4_k_m")
DRAFT_MAX = 3
# float64 logits of tiny models are O(1); summation order (BLAS blocking, vector width) moves them by a
# few ulps (~1e-15 relative) per operation over a few hundred operations, far under this bound, while
# any change of a weight, a metadata value read back or an operation moves them by >= ~1e-7 (one
# float32 rounding of one weight; the snapshot test measures its own perturbations)
RTOL = 1e-9
# the trunk's logits kept: the last rows, which every earlier position reaches through attention and the
# recurrent state (windows and chunks included), so they pin the whole forward at a fraction of the size
TRUNK_ROWS = 2
RUNTIME_DTYPE = "f64"
SPEC_TOKENS = 8  # greedy speculative decoding after the prompt: rounds of drafts, acceptance, rollback
SYNTHETIC_ACCEPTANCE = 0.6


@dataclass
class Family:
    """One fixture: `build(root)` writes the checkpoint(s) and says how to convert and run them."""
    name: str
    build: Callable[[Path], "Source"]


@dataclass
class Source:
    src: Path                    # the target checkpoint
    drafter: str                 # build_drafter's kind: "mtp" | "draft" | "eagle3" | "dflash" | "ngram"
    prompt: list[int]
    draft_src: Path | None = None
    draft_args: list[str] = field(default_factory=list)  # the drafter's extra convert arguments


def _sweep_family(case) -> Family:
    def build(root: Path) -> Source:
        built = case.build(root)
        draft_args = ["--target", str(built.src)] if built.drafter in ("eagle3", "dflash") else []
        return Source(built.src, built.drafter, list(built.prompt), built.draft_src, draft_args)
    return Family(case.name, build)


def _dsa_family(family: str) -> Family:
    def build(root: Path) -> Source:
        from tests.fixtures import family_sweep, tiny_dsa

        return Source(tiny_dsa.build_tiny(root / "hf", family), "mtp", list(family_sweep.PROMPT))
    return Family(f"dsa-{family}", build)


def _chained_family(family: str) -> Family:
    def build(root: Path) -> Source:
        from tests.fixtures import family_sweep, tiny_chained

        return Source(tiny_chained.build_tiny(root / "hf", family), "mtp", list(family_sweep.PROMPT))
    return Family(f"chained-{family}", build)


def _step37_family() -> Family:
    def build(root: Path) -> Source:
        from tests.fixtures import family_sweep, tiny_chained
        from tests.fixtures.tiny_chained import step37_release

        src = step37_release(tiny_chained.build_tiny(root / "hf35", "step35"), root / "hf")
        return Source(src, "mtp", list(family_sweep.PROMPT))
    return Family("chained-step37", build)


def _eagle3_qwen3_family(layout: str, ids: list[int]) -> Family:
    def build(root: Path) -> Source:
        from tests.fixtures import family_sweep
        from tests.fixtures.tiny_eagle3_qwen3 import build_head
        from tests.fixtures.tiny_qwen3 import build_qwen3

        src = build_qwen3(root / "hf", n_layers=8, hidden=64, heads=4, kv_heads=2, head_dim=32, tie=True)
        head = build_head(root / "head", src, layout=layout, ids=ids)
        return Source(src, "eagle3", list(family_sweep.PROMPT), head, ["--target", str(src)])
    return Family(f"eagle3-qwen3-{layout}", build)


def _eagle3_draft_model_family() -> Family:
    """The speculators layout under its other architecture name (`Eagle3DraftModel`)."""
    def build(root: Path) -> Source:
        from tests.fixtures import family_sweep
        from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target

        src = build_llama_target(root / "hf", seed=2)
        head = build_eagle3_head(root / "head", src, layout="speculators", layer_ids=[0, 2, 4], seed=3)
        cfg = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps(dict(cfg, architectures=["Eagle3DraftModel"]), indent=2))
        return Source(src, "eagle3", list(family_sweep.PROMPT), head, ["--target", str(src)])
    return Family("eagle3-draftmodel", build)


def _gemma4_causal_family() -> Family:
    from tests.fixtures import family_sweep

    return _sweep_family(family_sweep.Case("gemma4-causal", "gemma4 + assistant", "release", "Gemma4ForCausalLM",
                                           family_sweep.gemma4("hub", "causal", 8), lambda b: []))


def families() -> list[Family]:
    """The sweep's cases, the families it leaves to their own tests, and the registry's other
    architecture names (Step-3.7's wrapper, the Qwen3 EAGLE-3 heads, `Eagle3DraftModel`, Gemma 4's
    text-only layout)."""
    from tests.fixtures import family_sweep, tiny_chained, tiny_dsa

    return ([_sweep_family(c) for c in family_sweep.CASES] + [_dsa_family(f) for f in tiny_dsa.FAMILIES]
            + [_chained_family(f) for f in tiny_chained.FAMILIES] + [_step37_family()]
            + [_eagle3_qwen3_family("specforge", [0, 2, 6]), _eagle3_qwen3_family("angelslim", [0, 4, 6])]
            + [_eagle3_draft_model_family(), _gemma4_causal_family()])


# ------------------------------------------------------------------ recording

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _value_text(value) -> str:
    """A metadata value as stable text (long arrays, e.g. the vocabulary, by their sha256)."""
    text = json.dumps(value.tolist() if isinstance(value, np.ndarray) else value,
                      default=lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
    return text if len(text) <= 200 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def file_record(path: Path) -> dict:
    """The file's sha256, and its metadata and tensor table in order (what the report names)."""
    from specconv.runtime.gguf_reader import open_gguf

    f = open_gguf(path)
    kv = [[m.key, m.vtype.name, _value_text(m.value)] for m in f.kv.values()]
    tensors = [[t.name, t.ggml_type.name, list(t.shape), hashlib.sha256(t.raw().tobytes()).hexdigest()[:16]] for t in f]
    return {"sha256": sha256(path), "kv": kv, "tensors": tensors}


@contextmanager
def torch_reference():
    """The runtime's torch operations only (the native kernels switched off), float64 by the caller."""
    saved = os.environ.get("SPECCONV_NO_NATIVE")
    os.environ["SPECCONV_NO_NATIVE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SPECCONV_NO_NATIVE"]
        else:
            os.environ["SPECCONV_NO_NATIVE"] = saved


@contextmanager
def decode_logits(rows: list):
    """Every logits tensor a runtime Context computes while active, appended to `rows`."""
    from specconv.runtime.context import Context

    decode = Context.decode

    def recorded(self, *args, **kwargs):
        out = decode(self, *args, **kwargs)
        if out.logits is not None:
            rows.append(out.logits.detach().cpu().double().numpy())
        return out

    Context.decode = recorded
    try:
        yield rows
    finally:
        Context.decode = decode


def trunk_logits(target, prompt: list[int]) -> dict[str, np.ndarray]:
    """The last TRUNK_ROWS rows of the prompt in one batch ("trunk"), and the same rows decoded one
    token at a time after a prefill of the rest ("trunk_steps": the cache and recurrent-state path)."""
    import torch

    from specconv.runtime import Context, GraphType

    ctx = Context(target, GraphType.MAIN, n_ctx=len(prompt) + 8)
    batch = ctx.decode(prompt).logits[-TRUNK_ROWS:]
    ctx.clear()
    ctx.decode(prompt[:-TRUNK_ROWS], logits=None)
    steps = [ctx.decode([t]).logits for t in prompt[-TRUNK_ROWS:]]
    return {"trunk": batch.cpu().double().numpy(), "trunk_steps": torch.cat(steps).cpu().double().numpy()}


def draft_logits(target, make_drafter: Callable, prompt: list[int]) -> dict[str, np.ndarray]:
    """The logits the drafter's head computes for one draft of DRAFT_MAX tokens after `prompt`
    (started on the prompt minus its last token, llama.cpp's split), and the tokens it drafts."""
    from specconv.runtime import Context, GraphType
    from specconv.runtime.drafters.dflash import DFlashDrafter
    from specconv.runtime.spec_link import drafter_rows, hidden_request

    drafter = make_drafter()
    want = hidden_request(drafter)
    ctx = Context(target, GraphType.MAIN, n_ctx=len(prompt) + 2 * DRAFT_MAX + 8)
    hidden = ctx.decode(prompt[:-1], hidden=want, logits=None).hidden
    drafter.attach(ctx)  # a drafter that reads its target's K/V (Gemma 4 assistant) takes the context
    drafter.start(prompt[:-1], drafter_rows(hidden, want))
    rows: list[np.ndarray] = []
    if isinstance(drafter, DFlashDrafter):  # its block is one graph call, not a Context decode
        rows.append(drafter.block_logits(prompt[-1]).cpu().double().numpy())
    with decode_logits(rows):
        tokens = drafter.draft(prompt[-1], DRAFT_MAX).tokens
    return {"draft": np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows]),
            "draft_tokens": np.asarray(tokens, dtype=np.int64)}


def speculative_rounds(target, drafter, prompt: list[int], rollback: str) -> dict[str, np.ndarray]:
    """Greedy speculative decoding of SPEC_TOKENS tokens: the tokens, and per round the drafted ids
    (-1 where fewer) and the accepted count, as `generate --json` reports them."""
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    res = speculative_generate(target, drafter, prompt, SPEC_TOKENS, SpecConfig(draft_max=DRAFT_MAX, rollback=rollback))
    rounds = res.stats["rounds"]
    drafted = [(r["drafted"] or []) + [-1] * (DRAFT_MAX - len(r["drafted"] or [])) for r in rounds]
    return {"tokens": np.asarray(res.tokens, dtype=np.int64),
            "drafted": np.asarray(drafted, dtype=np.int64).reshape(-1, DRAFT_MAX),
            "accepted": np.asarray([r["accepted"] for r in rounds], dtype=np.int64)}


def run_logits(target_path: Path, draft_path: Path | None, drafter_kind: str, prompt: list[int],
               speculative: bool) -> dict[str, np.ndarray]:
    """The runtime on one file (and its drafter's): trunk_logits, draft_logits (families with a
    drafter of their own) and, with `speculative`, speculative_rounds (the loop does not depend on
    the file's types: one file's rounds pin it), float64 unless RUNTIME_DTYPE says otherwise."""
    import torch

    from specconv.runtime import load_model
    from specconv.runtime.speculative import build_drafter

    with torch_reference(), torch.inference_mode():
        target = load_model(target_path, device="cpu", dtype=RUNTIME_DTYPE)

        def make_drafter():
            return build_drafter(drafter_kind, target, len(prompt) + SPEC_TOKENS + 2 * DRAFT_MAX + 8, DRAFT_MAX,
                                 draft_path=draft_path)

        out = trunk_logits(target, prompt)
        if drafter_kind != "ngram":
            out.update(draft_logits(target, make_drafter, prompt))
        if not speculative:
            return out
        # the family's drafter (random heads: mostly rejections), then a drafter of set acceptance on
        # the greedy continuation (partial acceptance every few rounds: the other rollback mode)
        spec = speculative_rounds(target, make_drafter(), prompt, "snapshot")
        synthetic = build_drafter("synthetic", target, 0, DRAFT_MAX, reference=prompt + list(spec["tokens"]),
                                  acceptance=SYNTHETIC_ACCEPTANCE)
        for name, rows in (("spec", spec), ("synthetic", speculative_rounds(target, synthetic, prompt, "checkpoint"))):
            out.update({f"{name}_{k}": v for k, v in rows.items()})
    return out


def _convert(src: Path, out: Path, outtype: str, extra: list[str]) -> Path:
    from tests.fixtures.gguf_files import convert_gguf

    return convert_gguf(src, out, outtype=outtype, extra_args=extra)


def snapshot(family: Family, root: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the family's file records by file name, its logits by "<file>/<what>") built under root."""
    source = family.build(root / "build")
    files, logits = {}, {}
    for t in OUTTYPES:
        target = _convert(source.src, root / f"model.{t}.gguf", t, [])
        draft = _convert(source.draft_src, root / f"draft.{t}.gguf", t, source.draft_args) \
            if source.draft_src is not None else None
        for path in filter(None, (target, draft)):
            files[path.name] = file_record(path)
        for what, arr in run_logits(target, draft, source.drafter, source.prompt, t == OUTTYPES[0]).items():
            logits[f"{t}/{what}"] = arr
    files["_prompt"] = source.prompt
    files["_architectures"] = sorted({a for d in filter(None, (source.src, source.draft_src))
                                      for a in json.loads((d / "config.json").read_text())["architectures"]})
    return files, logits


def paths(name: str) -> tuple[Path, Path]:
    return DATA / f"{name}.json", DATA / f"{name}.npz"


def _json_lines(files: dict) -> str:
    """The records as JSON with one line per metadata key and per tensor (readable diffs, a third the size)."""
    def rows(items):
        return "[\n" + ",\n".join("   " + json.dumps(r) for r in items) + "]"

    parts = []
    for key in sorted(files):
        rec = files[key]
        if isinstance(rec, dict):
            body = ",\n".join(f'  "{k}": ' + (rows(v) if isinstance(v, list) else json.dumps(v))
                               for k, v in sorted(rec.items()))
            parts.append(f" {json.dumps(key)}: {{\n{body}}}")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(rec)}")
    return "{\n" + ",\n".join(parts) + "}\n"


def write(name: str, files: dict, logits: dict[str, np.ndarray]) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    js, npz = paths(name)
    js.write_text(_json_lines(files))
    with open(npz, "wb") as f:  # a file object: np.savez_compressed would append ".npz" to a str path
        np.savez_compressed(f, **logits)


def load(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    js, npz = paths(name)
    with np.load(npz, allow_pickle=False) as z:
        return json.loads(js.read_text()), {k: z[k] for k in z.files}


# ------------------------------------------------------------------ comparison

def _table_diff(file: str, want: dict, got: dict) -> list[str]:
    """What differs between two records of one file, named: metadata keys, tensors, then bytes."""
    out = []
    wkv, gkv = {k[0]: k[1:] for k in want["kv"]}, {k[0]: k[1:] for k in got["kv"]}
    for key in sorted(wkv.keys() | gkv.keys()):
        if wkv.get(key) != gkv.get(key):
            out.append(f"{file}: metadata {key}: {wkv.get(key)} -> {gkv.get(key)}")
    if [k[0] for k in want["kv"]] != [k[0] for k in got["kv"]] and not out:
        out.append(f"{file}: metadata keys in another order")
    wt, gt = {t[0]: t[1:] for t in want["tensors"]}, {t[0]: t[1:] for t in got["tensors"]}
    for name in [t[0] for t in want["tensors"]] + [t[0] for t in got["tensors"] if t[0] not in wt]:
        a, b = wt.get(name), gt.get(name)
        if a != b:
            what = ("missing" if b is None else "new" if a is None else
                    "bytes" if a[:2] == b[:2] else f"{a[0]} {a[1]} -> {b[0]} {b[1]}")
            out.append(f"{file}: tensor {name}: {what}")
    if [t[0] for t in want["tensors"]] != [t[0] for t in got["tensors"]] and wt.keys() == gt.keys():
        out.append(f"{file}: tensors in another order")
    if not out:
        out.append(f"{file}: bytes differ (layout: alignment or padding)")
    return out


def compare(want: tuple[dict, dict], got: tuple[dict, dict]) -> tuple[list[str], dict[str, float]]:
    """(what differs, in words; the largest relative |Δlogit| per logits array)."""
    (wfiles, wlogits), (gfiles, glogits) = want, got
    diffs = []
    for key in ("_prompt", "_architectures"):
        if wfiles.get(key) != gfiles.get(key):
            diffs.append(f"{key[1:]}: {wfiles.get(key)} -> {gfiles.get(key)}")
    for file in sorted((set(wfiles) | set(gfiles)) - {"_prompt", "_architectures"}):
        if file not in gfiles or file not in wfiles:
            diffs.append(f"{file}: {'missing' if file not in gfiles else 'new'}")
        elif wfiles[file]["sha256"] != gfiles[file]["sha256"]:
            diffs += _table_diff(file, wfiles[file], gfiles[file])
    deltas = {}
    for key in sorted(set(wlogits) | set(glogits)):
        a, b = wlogits.get(key), glogits.get(key)
        if a is None or b is None or a.shape != b.shape or a.dtype.kind != b.dtype.kind:
            what = "missing" if b is None else "new" if a is None else f"shape {a.shape} -> {b.shape}"
            diffs.append(f"runtime {key}: {what}")
            continue
        if a.dtype.kind in "iu":
            if not np.array_equal(a, b):
                diffs.append(f"runtime {key}: {a.tolist()} -> {b.tolist()}")
            continue
        finite = np.isfinite(a)  # EAGLE-3: -inf outside its draft vocabulary
        if not np.array_equal(finite, np.isfinite(b)) or not np.array_equal(a[~finite], b[~finite], equal_nan=True):
            diffs.append(f"runtime {key}: non-finite entries changed")
            continue
        a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
        scale = max(float(np.abs(a).max()), 1e-300)
        deltas[key] = float(np.abs(a - b).max()) / scale
        if deltas[key] > RTOL:
            diffs.append(f"runtime {key}: max |Δlogit| {np.abs(a - b).max():.3e} "
                         f"(relative {deltas[key]:.2e} > {RTOL:g})")
    return diffs, deltas


def check(family: Family, root: Path) -> tuple[list[str], dict[str, float]]:
    return compare(load(family.name), snapshot(family, root))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="families (default: all)")
    parser.add_argument("--write", action="store_true", help="regenerate the snapshot (an intended change of output)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    chosen = [f for f in families() if not args.names or f.name in args.names]
    unknown = set(args.names) - {f.name for f in chosen}
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {[f.name for f in families()]}")
    failed = 0
    for family in chosen:
        with tempfile.TemporaryDirectory(prefix=f"snapshot-{family.name}-") as tmp:
            if args.write:
                write(family.name, *snapshot(family, Path(tmp)))
                print(f"[{family.name}] written")
                continue
            diffs, deltas = check(family, Path(tmp))
        worst = max(deltas.values(), default=0.0)
        print(f"[{family.name}] {'differs' if diffs else 'identical'}; max relative |Δlogit| {worst:.2e}")
        for line in diffs:
            print(f"    {line}")
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
