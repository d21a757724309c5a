"""`specconv imatrix`: llama.cpp's importance matrix from the runtime's own activations (docs/imatrix.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specconv.commands.outputs import MKDIR_HELP, check_output_folder
from specconv.errors import SpecconvError

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("imatrix")
@click.argument("model", type=_FILE)
@click.option("--text", "text_file", type=_FILE, default=None,
              help="The calibration text (UTF-8), tokenized as llama-imatrix tokenizes it (a BOS first when the "
                   "vocabulary adds one). Its path is recorded as the dataset.")
@click.option("--tokens", "tokens_file", type=_FILE, default=None,
              help="Token ids instead of --text: whitespace- or comma-separated, or a JSON list.")
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(min=4),
              help="Chunk length (llama-imatrix's -c): each chunk is evaluated from an empty memory; the file's "
                   "imatrix.chunk_size.")
@click.option("--chunks", default=None, type=click.IntRange(min=1), help="Use only the first N chunks.")
@click.option("--process-output", is_flag=True, help="Also record output.weight (llama-imatrix's --process-output; "
                                                     "a tied head multiplies by token_embd, never recorded).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("imatrix.gguf"), show_default=True, help="The file to write.")
@click.option("--output-format", type=click.Choice(["gguf", "dat"]), default="gguf", show_default=True,
              help="gguf: llama-imatrix's GGUF layout (sums and counts); dat: its legacy format.")
@click.option("--force", is_flag=True, help="Overwrite the output if it exists.")
@click.option("--mkdir", is_flag=True, help=MKDIR_HELP)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default=None, help="Compute dtype of the runtime: f32, bf16, f16 or f64 (default: the "
                                            "runtime's for the device).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def command(model, text_file, tokens_file, ctx, chunks, process_output, output, output_format, force, mkdir, device,
            dtype, as_json):
    """Compute llama.cpp's importance matrix of MODEL (a GGUF file) over a calibration text with specconv's
    runtime: per weight matrix of the blocks, the sum over every token of every chunk of the squares of the
    values it multiplies, one sum per input column (per expert for routed experts, counted by the tokens
    routed to each), written in llama-imatrix's format, for `convert --imatrix`, `quantize --imatrix` and
    llama.cpp's llama-quantize."""
    from rich.console import Console

    from specconv.commands.stage_bar import stage_bar
    from specconv.imatrix import ImatrixOptions, run_imatrix

    check_output_folder(output.parent, mkdir=mkdir, option="-o")
    if output.exists() and not force:
        raise SpecconvError(f"{output} already exists (use --force to overwrite)")
    if mkdir:
        output.parent.mkdir(parents=True, exist_ok=True)
    opts = ImatrixOptions(model=model, output=output, text=text_file, tokens=tokens_file, ctx=ctx, chunks=chunks,
                          process_output=process_output, output_format=output_format, device=device, dtype=dtype)
    with stage_bar() as progress:
        report = run_imatrix(opts, progress)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
        return
    from rich.markup import escape

    from specconv.tables import print_wrapped

    t = report["text"]
    experts = sum(1 for e in report["tensors"] if e["experts"] > 1)
    out = Console()
    print_wrapped(out, escape(f"wrote {report['output']['path']} ({report['output']['format']}): {report['entries']} "
                              f"matrices" + (f" ({experts} of them routed experts)" if experts else "")
                              + f", {t['chunks']} chunks of {t['ctx']} tokens ({t['evaluated_tokens']} of the "
                              f"text's {t['tokens']})"))
    for note in report["notes"]:
        print_wrapped(out, escape(f"note: {note}"))
