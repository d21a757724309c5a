"""`specconv compare`: what each quant loses against its source, as llama-perplexity measures it, and
what it does to the MTP head's acceptance (docs/compare.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("compare")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.argument("quants", nargs=-1, required=True, type=_FILE, metavar="QUANT [QUANT ...]")
@click.option("--text", "text_file", type=_FILE, default=None, help="The evaluation text (UTF-8), tokenized as "
              "llama-perplexity tokenizes it (a BOS first when the vocabulary adds one).")
@click.option("--tokens", "tokens_file", type=_FILE, default=None,
              help="The evaluation token ids instead of --text: whitespace- or comma-separated, or a JSON list.")
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(min=4),
              help="Chunk length; the second half of each chunk is scored (llama-perplexity's -c).")
@click.option("--chunks", default=None, type=click.IntRange(min=1), help="Score only the first N chunks.")
@click.option("--resident", type=click.Choice(["one", "both"]), default="one", show_default=True,
              help="one: one model in memory at a time, the source's log-probabilities kept in a compact store "
                   "whose KL-divergence error is bounded and reported; both: the source beside each quant "
                   "(exact, more memory, the source run once per quant).")
@click.option("--mtp", "mtp_files", type=_FILE, multiple=True,
              help="An MTP sidecar of a quant (repeat: named mtp-<QUANT file name>, or one per QUANT in order). "
                   "Default: the quant's embedded head, or mtp-<QUANT file name> next to it.")
@click.option("--source-mtp", type=_FILE, default=None, help="The MTP sidecar of a trunk-only GGUF source.")
@click.option("--draft-max", default=3, show_default=True, type=click.IntRange(min=1),
              help="Draft positions measured per round.")
@click.option("--mtp-stride", default=1, show_default=True, type=click.IntRange(min=1),
              help="Draft at every N-th position only (the MTP rounds cost k + 1 head steps each; N divides that).")
@click.option("--no-mtp", is_flag=True, help="Skip the MTP heads.")
@click.option("--no-costs", is_flag=True,
              help="Skip timing the models (no predicted speed-up; acceptance and tokens per forward still reported).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default=None, help="Compute dtype of the runtime: f32, bf16, f16 or f64 (default: the "
                                            "runtime's for the device).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def command(source, quants, text_file, tokens_file, ctx, chunks, resident, mtp_files, source_mtp, draft_max,
            mtp_stride, no_mtp, no_costs, device, dtype, as_json):
    """Score each QUANT against SOURCE (a GGUF at f32/f16/bf16/q8_0, or the Hugging Face checkpoint folder) over
    the same chunks of text, as llama-perplexity --kl-divergence scores them: PPL of each and
    ln(PPL(Q)/PPL(base)), KL divergence statistics, Δp statistics and Same top p; and, for files with an MTP
    head, its acceptance by draft position beside the source's head on the source and on the quant's trunk,
    with the speed-up it predicts."""
    from rich.console import Console

    from specconv.commands.stage_bar import stage_bar
    from specconv.compare import CompareOptions, run_compare
    from specconv.compare.report import render

    opts = CompareOptions(source=source, quants=list(quants), text=text_file, tokens=tokens_file, ctx=ctx,
                          chunks=chunks, resident=resident, draft_max=draft_max, mtp_stride=mtp_stride,
                          mtp=list(mtp_files),
                          source_mtp=source_mtp, heads=not no_mtp, costs=not no_costs, device=device, dtype=dtype)
    with stage_bar() as progress:
        report = run_compare(opts, progress)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
        return
    render(report, Console())
