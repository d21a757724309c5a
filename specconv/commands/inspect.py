"""`specconv inspect`: what a GGUF file holds and which graphs (main, MTP) llama.cpp can build from it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specconv.commands.hub_inputs import gguf_input, hf_repo_option

TARGET_LAYERS_CONVENTION = (
    "layer inputs, as llama.cpp reads eagle3.target_layers: j is the input of target block j (transformers' "
    "hidden_states[j], the output of block j-1; j = L is the final normed output). In SpecForge's "
    "eagle_config ids (layer outputs) these are j-1")


def eagle3_summary(hparams: dict) -> dict:
    """What an EAGLE-3 head reads from its target, and in which convention the file names the layers."""
    return {"target_layers": hparams.get("target_layers"), "target_hidden_size": hparams.get("target_hidden_size"),
            "convention": TARGET_LAYERS_CONVENTION}


@click.command("inspect")
@click.argument("file", type=click.Path(path_type=Path), required=False)
@hf_repo_option()
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON on stdout.")
@click.option("--all-tensors", is_flag=True, help="List every tensor (by default long tables are shortened).")
def command(file, as_json, all_tensors, hf_repo):
    """Show FILE's architecture, the graph types it serves (main, mtp or both, decided as llama.cpp's
    loaders decide), hyper-parameters, tensor table (name, type, ggml shape) and sizes. For an EAGLE-3
    head: the target layers it reads and their convention (layer inputs).

    For split models give the first shard (NAME-00001-of-0000N.gguf); the others are found by name.
    """
    from rich.console import Console
    from rich.markup import escape

    from specconv.tables import METADATA_COLUMNS, TENSOR_COLUMNS, Col, print_table, print_wrapped, value_text

    from specconv.convert.gguf_summary import summarize
    from specconv.convert.plan_report import human_bytes

    file = gguf_input(file, hf_repo, what="FILE")[0]
    info = summarize(file)
    if info["arch"] == "eagle3":
        info["eagle3"] = eagle3_summary(info["hparams"])
    if as_json:
        click.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    console = Console()  # a pipe gets COLUMNS or 80; tables pick a layout that fits (specconv.tables)
    shards = f" ({len(info['shards'])} shards)" if len(info["shards"]) > 1 else ""
    print_wrapped(console, f"[bold]{escape(Path(info['path']).name)}[/]{shards}: arch [bold]{info['arch']}[/], "
                           f"{info['kind']} (serves: {', '.join(info['serves']) or 'nothing'}), "
                           f"block_count {info['block_count']}, nextn_predict_layers {info['nextn_predict_layers']}")
    if "eagle3" in info:
        e3 = info["eagle3"]
        console.print(f"EAGLE-3 head: reads target layers [bold]{e3['target_layers']}[/] of a target of width "
                      f"{e3['target_hidden_size']}: {escape(e3['convention'])}")
    for problem in info["problems"]:
        console.print(f"[red]problem:[/] {problem}")
    console.print(f"{info['n_tensors']} tensors, {human_bytes(info['tensor_bytes'])} of tensor data, "
                  f"{human_bytes(info['file_bytes'])} on disk: "
                  + ", ".join(f"{v['tensors']} {t}" for t, v in sorted(info["by_type"].items())))
    console.print("types by group: " + "; ".join(
        f"{group} " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        for group, counts in info["by_group"].items()))
    kv = []
    for section in ("general", "hparams", "tokenizer"):
        for key, value in info[section].items():
            name = f"{info['arch']}.{key}" if section == "hparams" else key
            kv.append([escape(name), escape(value_text(value))])
    print_table(console, METADATA_COLUMNS, kv, title="metadata")
    rows = info["tensors"]
    shown = rows if all_tensors or len(rows) <= 80 else rows[:40] + rows[-20:]
    cols = TENSOR_COLUMNS + ([Col("shard", "right")] if shards else [])
    cells = []
    for i, t in enumerate(shown):
        if not all_tensors and len(rows) > 80 and i == 40:
            cells.append([f"... {len(rows) - 60} more (--all-tensors)"] + [""] * (len(cols) - 1))
        cells.append([escape(t["name"]), t["type"], escape(str(t["shape"])), human_bytes(t["bytes"]),
                      *([str(t["shard"])] if shards else [])])
    print_table(console, cols, cells, title="tensors")
