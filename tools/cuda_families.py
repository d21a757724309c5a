"""Every family fixture on a GPU: the runtime's CUDA path against the pinned float64 CPU logits, and
greedy speculative decoding against plain decoding in the default CUDA dtype.

For each family of tools/family_snapshot.py (the same fixed fixtures, built and converted to f32 on
the CPU, a process per family), on the CUDA device:
* the trunk's logits of the f32 file computed in float32 against the snapshot's float64 CPU logits
  of the same file (tests/fixtures/family_snapshot/<family>.npz, `f32/trunk`): max |Δ| over max |logit|;
* in the default CUDA dtype (bfloat16), greedy decoding with the family's own drafter and with a
  drafter of set acceptance (rounds that roll back), each against plain greedy decoding: identical or not.

    python3 tools/cuda_families.py --json $OUT/cuda_families.json [FAMILY ...]

Any exception is recorded per family (its last line), not raised: the table says which families run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

TOKENS = 12


def one(name: str, device: str) -> dict:
    import numpy as np
    import torch

    import family_snapshot as fs
    from specconv.runtime import load_model
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate

    out = {"family": name}
    try:
        family = {f.name: f for f in fs.families()}[name]
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            source = family.build(root / "build")
            target_path = fs._convert(source.src, root / "model.f32.gguf", "f32", [])
            draft_path = (fs._convert(source.draft_src, root / "draft.f32.gguf", "f32", source.draft_args)
                          if source.draft_src is not None else None)
            prompt = source.prompt
            with torch.inference_mode():
                f32 = load_model(target_path, device=device, dtype="f32")
                got = fs.trunk_logits(f32, prompt)["trunk"]
                want = fs.load(name)[1]["f32/trunk"]
                out["f32_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
                del f32
                model = load_model(target_path, device=device)
                out["dtype"] = str(model.dtype).replace("torch.", "")
                n_ctx = len(prompt) + TOKENS + 2 * fs.DRAFT_MAX + 8
                plain = generate(model, prompt, TOKENS).tokens
                drafter = build_drafter(source.drafter, model, n_ctx, fs.DRAFT_MAX, draft_path=draft_path)
                own = speculative_generate(model, drafter, prompt, TOKENS, SpecConfig(draft_max=fs.DRAFT_MAX))
                out["own_drafter"] = source.drafter
                out["own_identical"] = own.tokens == plain
                synthetic = build_drafter("synthetic", model, 0, fs.DRAFT_MAX, reference=prompt + plain,
                                          acceptance=0.6)
                syn = speculative_generate(model, synthetic, prompt, TOKENS, SpecConfig(draft_max=fs.DRAFT_MAX))
                out["synthetic_identical"] = syn.tokens == plain
                out["synthetic_acceptance"] = syn.stats["speculative"]["acceptance_rate"]
    except Exception as e:  # recorded: the table says which families run on this device
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        out["where"] = traceback.format_exc().strip().splitlines()[-3].strip()[:300]
    return out


def main(argv=None) -> list[dict]:
    import family_snapshot as fs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("families", nargs="*")
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    names = args.families or [f.name for f in fs.families()]
    results = []
    import multiprocessing

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for r in pool.map(one, names, [args.device] * len(names)):
            results.append(r)
            status = r.get("error") or (f"f32 rel {r['f32_rel']:.1e} | {r['dtype']} own {r['own_drafter']} "
                                        f"identical {r['own_identical']} | synthetic identical "
                                        f"{r['synthetic_identical']} (A {r['synthetic_acceptance']:.2f})")
            print(f"{r['family']:28} {status}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    bad = [r["family"] for r in results if "error" in r or not (r["own_identical"] and r["synthetic_identical"])]
    print(f"{len(results) - len(bad)} of {len(results)} families ran with speculative = plain; not: {bad}")
    return results


if __name__ == "__main__":
    main()
