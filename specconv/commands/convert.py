"""`specconv convert`: a Hugging Face checkpoint folder -> GGUF file(s), with the MTP head where you want it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

from specconv.commands.outputs import MKDIR_HELP, check_output_folder
from specconv.errors import SpecconvError

MTP_HELP = (
    "Where the MTP (multi-token prediction) head goes. "
    "embed: one file with the trunk and the MTP block(s) (default). "
    "none: the trunk only (block_count = N, no nextn key). "
    "only: just the mtp- sidecar (token_embd, output_norm, output and the MTP blocks, with the model's "
    "full metadata and tokenizer), for use with a trunk-only file. "
    "separate: the trunk-only file and its mtp- sidecar in one run.")
OUTTYPE_HELP = (
    "Storage type of the weight matrices: f32, f16, bf16, q8_0, q4_0, or auto (bf16 for a bf16 checkpoint, "
    "else f16). Norms, 1-D tensors, routers, conv kernels and biases are always F32; q8_0/q4_0 fall back to "
    "F16 for tensors whose rows are not a multiple of 32. "
    "K-quants (q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, q2_k_s with --imatrix) and "
    "iq4_nl, iq4_xs (any case) write in one "
    "pass what llama.cpp's quantize tool makes of our lossless file (f32, or bf16/f16 from such a checkpoint): "
    "its type for every tensor (more bits for attention-V and FFN-down layers, output and embedding rules, "
    "MoE, GQA and row-length fallbacks; MTP/nextn layers counted as the last layers) and its bytes, tensor "
    "order and KV; with --imatrix, its weighted bytes as with llama-quantize --imatrix (q2_k_s needs one). "
    "Several types separated by commas (e.g. q8_0,q6_k,q4_k_m) write one file per type in one run, "
    "named from -o with the type inserted (NAME-Q8_0.gguf ...). "
    "auto:RECIPE (e.g. auto:q4_k_m) or auto:SIZE (e.g. auto:5.2GB): a mix chosen by measurement, each tensor "
    "group's type (attention, FFN, experts, shared expert, output, embedding) the one of least measured KL "
    "divergence on calibration text (--text) within that recipe's file size or that size, the MTP block's by "
    "its measured acceptance; the report says what was chosen and why.")

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
            "q5_k_s", "q5_k_m", "q6_k", "q2_k_s", "iq4_nl", "iq4_xs", "auto")
KQUANT_OUTTYPES = OUTTYPES[5:17]  # llama.cpp quantize file types (convert/quant_rules.py)


def _outtypes(value: str) -> str:
    """One type, or several separated by commas (a ladder written in one run); any case. Types that
    need an importance matrix are checked against --imatrix in the command."""
    from specconv.commands.quantize import check_file_type
    from specconv.convert.auto_mix import is_auto, parse_auto

    if is_auto(value):  # a mix chosen by measurement (convert/auto_mix.py)
        if "," in value:
            raise SpecconvError(f"--outtype {value}: an auto mix is a file of its own, not part of a ladder")
        parse_auto(value)
        return value.strip().lower()
    types = [t.strip().lower() for t in value.split(",")]
    for t in types:
        check_file_type(t, True, "'--outtype'")  # IQ / TQ types: not supported yet
    bad = [t for t in types if t not in OUTTYPES]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not one of {', '.join(OUTTYPES)}", param_hint="'--outtype'")
    return ",".join(types)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'500M' -> 500_000_000 (decimal units, as llama.cpp's converter and gguf-split read them)."""
    m = _SIZE.match(text or "")
    if not m:
        raise SpecconvError(f"--split-max-size {text!r}: expected a size such as 500M or 2G")
    value = float(m.group(1)) * {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}[m.group(2).upper()]
    if value < 1:
        raise SpecconvError(f"--split-max-size {text!r} must be positive")
    return int(value)


def parse_layers(text: str) -> tuple[int, ...]:
    """'2,5,7' -> (2, 5, 7): three non-negative layer ids."""
    try:
        ids = tuple(int(t) for t in text.replace(" ", "").split(","))
    except ValueError:
        raise SpecconvError(f"--target-layers {text!r}: expected three comma-separated layer ids such as 2,5,7") from None
    if len(ids) != 3 or min(ids) < 0:
        raise SpecconvError(f"--target-layers {text!r}: expected three non-negative layer ids such as 2,5,7")
    return ids


@click.command("convert")
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--local-dir", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="With a Hub id as SRC: download into DIR instead of the huggingface_hub cache.")
@click.option("-o", "--output", "out", required=True, metavar="OUT",
              help="Output file (DIR/NAME.gguf; a sidecar written next to it is DIR/mtp-NAME.gguf) or a folder "
                   "(DIR/: names follow llama.cpp's convention, <Name>-<Size>-<TYPE>.gguf and mtp- + the same name, "
                   "which `upload` keeps).")
@click.option("--outtype", metavar="TYPE[,TYPE...]", callback=lambda ctx, param, value: _outtypes(value),
              default="auto", show_default=True, help=OUTTYPE_HELP)
@click.option("--mtp-outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_0"], case_sensitive=False),
              default=None, help="With a K-quant --outtype: store the MTP / nextn block's matrices at this type "
                                 "instead (e.g. q8_0), the trunk keeping llama.cpp's K-quant types.")
@click.option("--imatrix", "imatrix_file", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
              metavar="FILE", help="With a K-quant --outtype: llama.cpp's importance matrix (llama-imatrix's GGUF or "
                                   "legacy .dat file); each quantized tensor with an entry is encoded with its weights "
                                   "as llama-quantize --imatrix does (same bytes; experts use their own slice), and "
                                   "the file records quantize.imatrix.* keys. Required for q2_k_s. Matrices kept at "
                                   "--mtp-outtype and non-K-quant files of a ladder are written without it.")
@click.option("--mtp", "mtp_mode", type=click.Choice(["embed", "none", "only", "separate"]), default="embed",
              show_default=True, help=MTP_HELP)
@click.option("--split-max-size", metavar="SIZE", default=None,
              help="Split each output into shards of at most SIZE (e.g. 500M, 2G), named NAME-00001-of-0000N.gguf; "
                   "give llama.cpp the first shard.")
@click.option("--target", "target", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              metavar="TARGET_DIR",
              help="For an EAGLE-3 draft head: the target model's folder (config.json and tokenizer). The GGUF gets "
                   "the target's tokenizer, hidden size and default target layers.")
@click.option("--target-layers", "target_layers", metavar="A,B,C", default=None,
              help="For an EAGLE-3 head: the three target layers it reads, as layer INPUTS (llama.cpp's "
                   "eagle3.target_layers convention: j is the input of target block j, transformers' "
                   "hidden_states[j]; the target's layer count L stands for its final normed output). Overrides "
                   "the config: by default eagle_config.eagle_aux_hidden_state_layer_ids (SpecForge) and "
                   "aux_hidden_states_layer_ids (AngelSlim), which name layer outputs, are written + 1, a top-level eagle_aux_hidden_state_layer_ids (vLLM, speculators: layer inputs) "
                   "as is, else [2, L//2, L-3]. Give it when a head's config lacks its ids or holds output ids at "
                   "the top level (e.g. SpecForge ids [1,4,6] become --target-layers 2,5,7).")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, tensors, types, shapes, sizes, metadata); "
                                              "write nothing.")
@click.option("--force", is_flag=True, help="Overwrite output files that already exist.")
@click.option("--mkdir", is_flag=True, help=MKDIR_HELP + " Without it the folder of -o must exist (-o DIR/ may "
                                            "name a new folder inside an existing one).")
@click.option("--threads", type=click.IntRange(0, 1024), default=0, show_default=True,
              help="Threads that read, encode and write tensor chunks (0: one per available core plus 2, which "
                   "work while others wait on the disk; 1: no worker threads). "
                   "The output is the same bytes whatever the number.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (or the --dry-run plan) as JSON on stdout.")
@click.option("--text", "calibration", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help="With --outtype auto:...: the calibration text the mix is measured on (default: the text shipped "
                   "with specconv).")
@click.option("--ctx", "calibration_ctx", type=click.IntRange(min=4), default=None, metavar="N",
              help="With --outtype auto:...: tokens per calibration chunk (default 512; the second half of each is "
                   "scored, as llama-perplexity scores).")
@click.option("--chunks", "calibration_chunks", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --outtype auto:...: measure on the first N chunks of the text only.")
def command(src, local_dir, out, outtype, mtp_outtype, imatrix_file, mtp_mode, split_max_size, target, target_layers,
            dry_run, force, mkdir, threads, as_json, calibration, calibration_ctx, calibration_chunks):
    """Convert SRC to GGUF: a checkpoint folder (config.json, safetensors, tokenizer), or a Hub id
    OWNER/NAME[@REVISION], whose config, tokenizer and safetensors files are downloaded first (a local
    folder of that name keeps priority).

    Files are written under temporary names and renamed only when complete; on any error or Ctrl-C
    nothing is left behind. Existing outputs are refused unless --force is given.
    """
    from specconv.archs.base import MtpMode
    from specconv.convert.engine import ConvertRequest, plan_conversion
    from specconv.convert.plan_report import plan_summary

    from specconv.commands.quantize import check_file_type
    from specconv.convert.naming import is_directory_target

    folder_target = is_directory_target(out)
    check_output_folder(Path(out) if folder_target else Path(out).parent, mkdir=mkdir, option="-o",
                        named_folder=folder_target)
    types = outtype.split(",")
    for t in types:
        check_file_type(t, imatrix_file is not None, "'--outtype'")  # q2_k_s without --imatrix
    auto = outtype.startswith("auto:")
    if not auto and (calibration, calibration_ctx, calibration_chunks) != (None, None, None):
        raise SpecconvError("--text, --ctx and --chunks are for --outtype auto:RECIPE or auto:SIZE (a measured mix)")
    if imatrix_file is not None and not auto and not any(t in KQUANT_OUTTYPES for t in types):
        raise click.BadParameter("--imatrix weighs K-quant and IQ4 files (q2_k ... q6_k, iq4_nl, iq4_xs); --outtype "
                                 "names none",
                                 param_hint="'--imatrix'")
    imatrix = None
    if imatrix_file is not None:
        from specconv.convert.imatrix import load as load_imatrix

        imatrix = load_imatrix(imatrix_file)
    from specconv.commands.hub_inputs import checkpoint_input

    src = checkpoint_input(src, local_dir)  # a Hub id: fetched into the cache first
    req = ConvertRequest(src=Path(src), out=out, outtype=outtype.lower(), mtp=MtpMode(mtp_mode),
                         split_max_size=parse_size(split_max_size) if split_max_size is not None else 0, target=target,
                         target_layers=parse_layers(target_layers) if target_layers is not None else None,
                         mtp_outtype=mtp_outtype.lower() if mtp_outtype else None, imatrix=imatrix)
    mix = None
    if auto:  # each tensor group's type measured on the calibration text (convert/auto_mix.py)
        from specconv.convert.auto_mix import DEFAULT_CTX, parse_auto, plan_auto_mix
        from specconv.convert.mix_report import measuring

        with measuring(quiet=as_json) as tick:
            plan, mix = plan_auto_mix(req, parse_auto(outtype), calibration, calibration_ctx or DEFAULT_CTX,
                                      calibration_chunks, threads, progress=tick)
    else:
        plan = plan_conversion(req)
    try:
        summary = plan_summary(plan, tensors=dry_run)
        if mix is not None:
            summary["auto_mix"] = mix
        if dry_run:
            _emit(summary, as_json, dry_run=True)
            return
        existing = [p for f in plan.files for p in f.output.existing()]
        if existing and not force:
            raise SpecconvError(f"{existing[0]} already exists (use --force to overwrite)")
        written = _run_with_progress(plan, force, threads, quiet=as_json)
        summary["written"] = [str(p) for p in written]
        _emit(summary, as_json, dry_run=False)
    finally:
        plan.close()


def _run_with_progress(plan, force: bool, threads: int, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from specconv.convert.engine import run_conversion

    total = sum(f.output.total_bytes for f in plan.files)
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=quiet) as progress:
        task = progress.add_task("converting", total=total)

        def on_tensor(name: str, n: int) -> None:
            progress.update(task, advance=n, description=f"converting {name}")

        return run_conversion(plan, overwrite=force, on_tensor=on_tensor, threads=threads)


def _emit(summary: dict, as_json: bool, dry_run: bool) -> None:
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, **summary}, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape

    from specconv.convert.plan_report import human_bytes
    from specconv.tables import METADATA_COLUMNS, TENSOR_COLUMNS, Col, footnotes, print_table, print_wrapped, value_text

    console = Console()  # a pipe gets COLUMNS or 80; tables pick a layout that fits (specconv.tables)
    err = Console(stderr=True)
    for notice in summary["notices"]:
        print_wrapped(err, f"[yellow]note:[/] {escape(notice)}")
    if "auto_mix" in summary:
        from specconv.convert.mix_report import print_mix

        print_mix(console, summary["auto_mix"])
    print_wrapped(console, f"{summary['hf_architecture']} -> [bold]{summary['arch']}[/]: {summary['trunk_layers']} "
                           f"trunk layer(s), {summary['mtp_layers']} MTP layer(s); --mtp {summary['mtp_mode']}, "
                           f"--outtype {summary['outtype'].lower()}")
    for f in summary["files"]:
        types = ", ".join(f"{n} {t}" for t, n in sorted(f["types"].items()))
        verb = "would write" if dry_run else "wrote"
        print_wrapped(console, f"{verb} [bold]{f['kind']}[/] {escape(', '.join(f['shards']))}: {f['n_tensors']} tensors "
                               f"({types}), {human_bytes(f['tensor_bytes'])} of tensor data")
        if not dry_run:
            continue
        marks, legend = footnotes([t.get("note", "") for t in f["tensors"]])
        print_table(console, TENSOR_COLUMNS + [Col("note")],
                    [[escape(t["name"]), t["type"], escape(str(t["shape"])), human_bytes(t["bytes"]), escape(mark)]
                     for t, mark in zip(f["tensors"], marks)],
                    title=escape(f"{Path(f['path']).name}: tensors"))
        for line in legend:  # a note shared by many tensors, once under the table
            print_wrapped(console, escape(line))
        print_table(console, METADATA_COLUMNS,
                    [[escape(key), escape(value_text(value))] for key, value in f["metadata"].items()],
                    title=escape(f"{Path(f['path']).name}: metadata"))
    sys.stdout.flush()
