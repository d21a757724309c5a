"""`specconv mtp extract|merge`: move an MTP head between GGUF files (see docs/mtp.md)."""

from __future__ import annotations

from pathlib import Path

import click

from specconv.commands.outputs import MKDIR_HELP, check_output_folder


def parse_size(text: str | None) -> int:
    """--split-max-size as `specconv convert` reads it (decimal K/M/G); None means no splitting."""
    from specconv.commands.convert import parse_size as convert_parse_size

    return convert_parse_size(text) if text else 0


def _run(plan, out, split_max_size, overwrite, inputs):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from rich.markup import escape

    from specconv.convert.mtp_graft import describe, write_plan
    from specconv.tables import print_wrapped

    console = Console(stderr=True)
    for line in describe(plan):  # file names wrap whole, at spaces or after a `/` (specconv.tables)
        print_wrapped(console, escape(line))
    for w in plan.warnings:
        print_wrapped(console, f"[yellow]warning:[/] {escape(w)}")
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("writing", total=plan.total_bytes)
        paths = write_plan(plan, out, split_max_size=split_max_size, overwrite=overwrite, inputs=inputs,
                           on_tensor=lambda t: progress.update(task, advance=t.nbytes, description=t.name[:40]))
        progress.update(task, description="done")
    for p in paths:
        click.echo(str(p))


@click.group(name="mtp")
def command():
    """Extract an MTP head into a sidecar, or graft one into an MTP-less GGUF."""


@command.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", default=None, type=click.Path(dir_okay=False),
              help="Sidecar to write. Default: mtp-<MODEL>.gguf next to MODEL (llama.cpp tools look for "
                   "the mtp- prefix).")
@click.option("--outtype", default=None, help="Re-type every tensor (f32, f16, bf16, q8_0, q4_0, ...); "
              "norms and 1-D tensors stay F32. Default: bytes copied unchanged.")
@click.option("--type-override", "overrides", multiple=True, metavar="PATTERN=TYPE",
              help="Storage type for tensors whose name matches the regex PATTERN (repeatable, last match wins).")
@click.option("--split-max-size", default=None, help="Split the output into shards of at most this size (e.g. 2G).")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.option("--mkdir", is_flag=True, help=MKDIR_HELP)
def extract(model, out, outtype, overrides, split_max_size, force, mkdir):
    """Write the MTP head of MODEL (a GGUF with an embedded head) as an MTP-only sidecar."""
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.convert.mtp_graft import TypeOverride, default_sidecar_path, parse_type, plan_extract

    if out is not None:
        check_output_folder(Path(out).parent, mkdir=mkdir, option="-o")
    src = open_gguf(model)
    if out is None:
        out = str(default_sidecar_path(src.path))
    plan = plan_extract(src, parse_type(outtype) if outtype else None, [TypeOverride.parse(o) for o in overrides])
    _run(plan, out, parse_size(split_max_size), force, [src])


@command.command()
@click.argument("trunk", type=click.Path(dir_okay=False))
@click.argument("mtp", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False))
@click.option("--type-override", "overrides", multiple=True, metavar="PATTERN=TYPE",
              help="Storage type for grafted tensors whose name matches the regex PATTERN (repeatable, last match "
                   "wins); trunk tensors are never re-typed. Norms and 1-D tensors stay F32.")
@click.option("--split-max-size", default=None, help="Split the output into shards of at most this size (e.g. 2G).")
@click.option("--force", is_flag=True, help="Graft even when the files do not look like they belong together, "
              "and overwrite an existing output.")
@click.option("--mkdir", is_flag=True, help=MKDIR_HELP)
def merge(trunk, mtp, out, overrides, split_max_size, force, mkdir):
    """Graft the MTP blocks of MTP (a sidecar or an embedded GGUF) into TRUNK (a trunk-only GGUF)."""
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.convert.mtp_graft import TypeOverride, plan_merge

    check_output_folder(Path(out).parent, mkdir=mkdir, option="-o")
    trunk_file, mtp_file = open_gguf(trunk), open_gguf(mtp)
    plan = plan_merge(trunk_file, mtp_file, [TypeOverride.parse(o) for o in overrides], force=force)
    _run(plan, out, parse_size(split_max_size), force, [trunk_file, mtp_file])
