"""The checkpoint fuzzer: config.json values of the wrong JSON type, or odd values, through `convert`.

A checkpoint's config.json is read by the plugin (archs/config_reader.py), by gguf-py's metadata and
special-token readers and by the engine. Each case changes one value of one seed checkpoint's
config.json (tools/fuzz_seeds.py: the checkpoints behind every seed, targets of draft heads
included) and plans the conversion (`convert`'s own planning: the plugin, its tensor plan and
metadata, the tokenizer keys, the general keys; nothing is written). Mutations:

* **type** (`wrong_types`): the value replaced by one of another JSON type — a number where a list
  or a string belongs, a list where a number belongs, a string where a flag belongs, an object for
  any of them, a non-integral number where an integer belongs; an object (`text_config`,
  `rope_parameters`, ...) replaced by a number or a list;
* **value** (`odd_values`): an integer set to 0, -1, 2^31 or doubled; a number to 0, -1 or 1e30; a
  list emptied or cut short; a string to one nobody knows; a key removed.

Outcomes: **ok** (the plan was made), **clear** (a one-line SpecconvError), **internal** (any other
exception, or a message with a newline). A clear error for a type mutation must name the key.

    python tools/fuzz_config.py --seeds DIR [--cases N --seed S]   # random cases
    python tools/fuzz_config.py --seeds DIR --every-type            # every key of every checkpoint, every wrong type
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
KeyPath = tuple[str, ...]  # a key path into config.json


def key_paths(config: dict, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key of every object in the config, objects included (a list is a value)."""
    for key, value in config.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from key_paths(value, prefix + (key,))


# Keys some reader takes when a config.json has them (gguf-py's metadata and special tokens, the plugins'
# optional fields): each case set also adds them, absent before, with values of every type.
EXTRA_KEYS = ("_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "tie_word_embeddings",
              "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "layer_types",
              "num_nextn_predict_layers", "mtp_num_hidden_layers", "max_position_embeddings", "rms_norm_eps")


def get(config: dict, path: KeyPath) -> Any:
    for key in path:
        config = config[key]
    return config


def replaced(config: dict, path: KeyPath, value: Any = None, remove: bool = False) -> dict:
    out = copy.deepcopy(config)
    node = out
    for key in path[:-1]:
        node = node[key]
    if remove:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def wrong_types(value: Any) -> list[Any]:
    """Values of other JSON types than `value`'s (null: any of them)."""
    if isinstance(value, bool):
        return [1, "true", [value]]
    if isinstance(value, int):
        return [value + 0.5, str(value), [value], True]
    if isinstance(value, float):
        return [str(value), [value], False]
    if isinstance(value, str):
        return [3, [value], {"value": value}]
    if isinstance(value, list):
        first = value[0] if value else 0
        return [first if not isinstance(first, (list, dict)) else 3, "x", {"0": first}]
    if isinstance(value, dict):
        return [4, [value], "x"]
    return [1.5, "x", [1], {}]


def odd_values(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [0, -1, 2**31, 2 * value]
    if isinstance(value, float):
        return [0.0, -1.0, 1e30]
    if isinstance(value, str):
        return ["", "unknown_value"]
    if isinstance(value, list):
        return [[], value[: len(value) // 2]]
    return []


def mutate(config: dict, rng: random.Random) -> tuple[dict, str, str, KeyPath]:
    """(mutated config, kind, description, key path) of one random mutation."""
    path = rng.choice(list(key_paths(config)))
    value = get(config, path)
    where = ".".join(path)
    kind = rng.choice(("type", "type", "value"))
    if kind == "value":
        choices = odd_values(value)
        if not choices or rng.random() < 0.15:
            return replaced(config, path, remove=True), "value", f"{where} removed", path
        new = rng.choice(choices)
        return replaced(config, path, new), "value", f"{where} = {json.dumps(new)[:60]}", path
    new = rng.choice(wrong_types(value))
    return replaced(config, path, new), "type", f"{where}: {json.dumps(value)[:40]} -> {json.dumps(new)[:40]}", path


class Case:
    """A writable copy of one checkpoint folder whose config.json each run replaces (the other files
    linked), converted with `args`; with `head`, the folder is the target of that draft head."""

    def __init__(self, src: Path, args: tuple[str, ...], work: Path, head: Path | None = None):
        self.src, self.args, self.head = Path(src), args, head
        self.dir = work / self.src.name
        self.dir.mkdir(parents=True)
        for f in self.src.iterdir():
            if f.name != "config.json":
                (self.dir / f.name).symlink_to(f.resolve())
        self.config = json.loads((self.src / "config.json").read_text(encoding="utf-8"))

    def plan(self, config: dict) -> tuple[str, str]:
        """(outcome, message) of planning the conversion with `config` as this folder's config.json."""
        from specconv.archs.base import MtpMode
        from specconv.convert.engine import ConvertRequest, plan_conversion
        from specconv.errors import SpecconvError

        (self.dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
        args = list(self.args)
        mtp = MtpMode(args[args.index("--mtp") + 1]) if "--mtp" in args else MtpMode.EMBED
        given = Path(args[args.index("--target") + 1]) if "--target" in args else None
        src, tgt = (self.head, self.dir) if self.head is not None else (self.dir, given)
        req = ConvertRequest(src=src, out=str(self.dir.parent / "out.gguf"), outtype="f32", mtp=mtp, target=tgt)
        try:
            plan_conversion(req).reader.close()
        except SpecconvError as exc:
            message = str(exc)
            return ("internal" if "\n" in message else "clear"), message
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            return "internal", f"{type(exc).__name__}: {exc}"
        return "ok", ""


def cases(seeds: Path, work: Path) -> list[tuple[str, Case]]:
    """(name, case) for each checkpoint behind the seeds: a draft head's own config, and its target's
    config as the head's conversion reads it."""
    sys.path.insert(0, str(ROOT / "tools"))
    from fuzz_seeds import checkpoints

    out, seen = [], set()
    for file, (src, args) in checkpoints(seeds).items():
        if (src, args) in seen:
            continue
        seen.add((src, args))
        out.append((file, Case(src, args, work / f"{len(out)}")))
        if "--target" in args:
            target = Path(args[args.index("--target") + 1])
            out.append((f"{file} (target config)", Case(target, args, work / f"{len(out)}", head=src)))
    return out


def type_mutations(config: dict) -> Iterator[tuple[KeyPath, Any, dict]]:
    """(key path, value, mutated config): every key set to each wrong type of its value, and each of
    EXTRA_KEYS the config lacks (at the top and in `text_config`) added with values of every type."""
    for path in key_paths(config):
        for value in wrong_types(get(config, path)):
            yield path, value, replaced(config, path, value)
    nests = [()] + ([("text_config",)] if isinstance(config.get("text_config"), dict) else [])
    for nest in nests:
        for key in EXTRA_KEYS:
            if key not in get(config, nest):
                for value in wrong_types(None):
                    yield nest + (key,), value, replaced(config, nest + (key,), value)


def every_type(seeds: Path, work: Path) -> list[dict]:
    """`type_mutations` of every checkpoint's config: one record per case."""
    records = []
    for name, case in cases(seeds, work):
        for path, value, config in type_mutations(case.config):
            outcome, message = case.plan(config)
            records.append({"checkpoint": name, "key": ".".join(path), "value": value, "outcome": outcome,
                            "message": message})
    return records


def names_key(message: str, path: str) -> bool:
    return path.split(".")[-1] in message


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fuzz-config-"))
    start = time.time()
    try:
        if args.every_type:
            records = every_type(Path(args.seeds), work)
        else:
            rng, records = random.Random(args.seed), []
            all_cases = cases(Path(args.seeds), work)
            for _ in range(args.cases):
                name, case = rng.choice(all_cases)
                config, kind, what, path = mutate(case.config, rng)
                outcome, message = case.plan(config)
                records.append({"checkpoint": name, "kind": kind, "key": ".".join(path), "mutation": what,
                                "outcome": outcome, "message": message})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    totals = Counter(r["outcome"] for r in records)
    unnamed = [r for r in records if r["outcome"] == "clear" and r.get("kind", "type") == "type"
               and not names_key(r["message"], r["key"])]
    problems = [r for r in records if r["outcome"] == "internal"] + unnamed
    return {"cases": len(records), "totals": dict(totals), "unnamed": len(unnamed), "problems": problems,
            "seconds": round(time.time() - start, 1)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", required=True, help="seed folder (tools/fuzz_seeds.py builds what it lacks)")
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every-type", action="store_true", help="every key, every wrong type, of every checkpoint")
    return p


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    report = run(build_parser().parse_args())
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}, indent=1))
    for r in report["problems"][:50]:
        print(json.dumps(r)[:300])
    sys.exit(1 if report["problems"] else 0)
