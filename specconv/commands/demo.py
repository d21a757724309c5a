"""`specconv demo`: convert, verify and run the bundled tiny Qwen3.5 + MTP model (exit 0 only if all passed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specconv.commands.options import MAX_DRAFT, cuda_graphs_option, graphs_mode


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the converted files in this folder, created when its parent exists (default: a temporary "
                   "folder, removed afterwards). Files are named as `convert -o DIR/` names them.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(1, 4000),
              help="Tokens generated per prompt.")
@click.option("--draft-max", default=3, show_default=True, type=click.IntRange(1, MAX_DRAFT),
              help="Largest draft length; the acceptance table has draft_max 1..K.")
@click.option("--outtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
              help="Storage type of the converted weight matrices.")
@click.option("--prompts", "n_prompts", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Held-out prompts in the acceptance table.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Timed repeats (the median is reported).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="CPU threads for torch (one keeps the timings of this tiny model steady on a busy machine).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of tables.")
@cuda_graphs_option
def command(out, device, n_predict, draft_max, outtype, n_prompts, repeats, threads, as_json, cuda_graphs):
    """Convert the bundled model (embedded MTP, and trunk + mtp- sidecar), verify both, generate with and
    without MTP, and print the acceptance table with the measured speed-up."""
    import torch
    from rich.console import Console

    from specconv.demo import DemoOptions, run_demo
    from specconv.runtime import step_graphs
    from specconv.demo.render import render

    torch.set_num_threads(threads)
    opts = DemoOptions(out=out, device=device, n_predict=n_predict, draft_max=draft_max, outtype=outtype,
                       prompts=n_prompts, repeats=repeats)
    with step_graphs.cuda_graphs(graphs_mode(cuda_graphs)):
        if as_json:
            report = run_demo(opts)
        else:
            with Console(stderr=True).status("starting", spinner="dots") as status:
                report = run_demo(opts, progress=status.update)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, Console())
    sys.exit(0 if report["passed"] else 1)
