"""`specconv upload DIR|FILE.gguf... --repo USER/NAME`: publish GGUF outputs (a quant ladder included), sidecars
and one model card on the Hub."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.markup import escape

from specconv.commands.hub_inputs import hf_repo_option, upload_inputs
from specconv.commands.options import FiniteFloatRange
from specconv.hub.naming import human_size, parse_size
from specconv.tables import Col, print_table, print_wrapped


PLAN_COLUMNS = [Col("Repository path", whole=True), Col("Size", "right"), Col("Quant"), Col("Role"), Col("From"),
                Col("Verified")]


def verified_cell(a, first: bool) -> str:
    """What the card will say about this file's verification, and from which report."""
    if not first:
        return ""
    if a.report is not None:
        result = {True: "passed", False: "FAILED", None: "no result"}[a.report.passed]
        return f"{result} ({Path(a.report.source).name})"
    if a.verified_with:
        return f"with {a.verified_with}"
    return "not verified"


def plan_rows(plan) -> list[list[str]]:
    """One row per file of the plan (shards separately), then the generated model card."""
    rows = []
    for a in plan.artifacts:
        for i, f in enumerate(a.files):
            if a.layout is not None:
                origin = f"split {i + 1}/{len(a.files)} of " + ", ".join(p.name for p in a.sources)
            else:
                origin = str(f.source.relative_to(plan.folder))
            rows.append([escape(f.path_in_repo), human_size(f.size), a.quant, a.role.value, escape(origin),
                         escape(verified_cell(a, i == 0))])
    rows.append(["README.md", human_size(plan.readme.size), "", "model card", "generated", ""])
    return rows


def print_plan(console: Console, plan) -> str:
    """The plan as a table, or as a list where a table would not fit the console (a pipe: 80 columns)."""
    title = f"Upload plan for {plan.repo_id}" + (f"@{plan.revision}" if plan.revision else "")
    return print_table(console, PLAN_COLUMNS, plan_rows(plan), title=escape(title))


class RichEvents:
    """Draws the upload as one rich progress bar over all bytes of the plan."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", table_column=None),
            BarColumn(),
            DownloadColumn(binary_units=False),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = None

    def stage(self, name: str) -> None:
        if self.task is None:
            self.console.print(f"[dim]{name}…[/dim]")

    def start(self, total_bytes: int, n_files: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task(f"{n_files} files", total=total_bytes)

    def file_start(self, pf, action: str) -> None:
        self.progress.update(self.task, description=f"{action} {pf.path_in_repo}")

    def file_done(self, pf, action: str) -> None:
        self.progress.update(self.task, advance=pf.size, description=f"{action} {pf.path_in_repo}")
        if action == "skipped":
            self.progress.console.print(f"[dim]skipped {pf.path_in_repo} (already on the Hub)[/dim]")

    def retry(self, what: str, attempt: int, delay: float, error: str) -> None:
        self.progress.console.print(f"[yellow]retrying {what} in {delay:.1f}s (attempt {attempt} failed: {error})[/yellow]")

    def stop(self) -> None:
        if self.task is not None:
            self.progress.stop()


@click.command(name="upload")
@click.argument("inputs", nargs=-1, required=False, metavar="DIR | FILE.gguf...",
                type=click.Path(exists=True, path_type=Path))
@hf_repo_option(" Here: publish that file (and its mtp- file) from the Hub instead of local files.")
@click.option("--local-dir", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="With -hf: the folder the files are downloaded into (default: one in huggingface_hub's assets "
                   "cache).")
@click.option("--repo", "repo_id", required=True, help="Target repository, USER/NAME.")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", help="Branch to commit to (created if missing), or refs/pr/N to resume a PR.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main.")
@click.option("--dry-run", is_flag=True, help="Print the plan; send nothing, write nothing.")
@click.option("--max-file-size", default="50G", show_default=True, help="Split files above this size (decimal units).")
@click.option("--report", "--verify-report", "report_paths", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A `specconv verify --report FILE` report for the card; repeat it, one per model file of a ladder. Each "
                   "is matched to the file it verified (the path, size and sha256 it records) and refused if that "
                   "file is not uploaded or its bytes differ.")
@click.option("--compare", "compare_paths", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A `specconv compare --json` report for the card's \"Quality against the source\" table (KLD, "
                   "top-1 agreement, PPL ratio, MTP acceptance by position, predicted speed-up); repeatable. Each "
                   "quant it measured is matched to the uploaded file of that name, and refused if its size (or "
                   "sha256) differs.")
@click.option("--verify", "run_verify", is_flag=True,
              help="Run `specconv verify` on each model file that has no --report (with its mtp- sidecar) before "
                   "uploading; the reports are kept in DIR/.specconv-upload/verify/ and reused by a rerun. Not run "
                   "by --dry-run.")
@click.option("--hf", "hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="With --verify: the checkpoint folder that was converted (parity against transformers).")
@click.option("--base-model", help="Source model id for the card (default: from the GGUF metadata).")
@click.option("--name", help="Model name used in file names (default: from the GGUF metadata).")
@click.option("--license", "license_", help="License id for the card (default: general.license).")
@click.option("--quantized-by", default="specconv", show_default=True)
@click.option("--retries", default=6, show_default=True, type=click.IntRange(1, 100),
              help="Attempts per request on network errors and 5xx.")
@click.option("--retry-delay", default=2.0, show_default=True, type=FiniteFloatRange(0.0, 3600.0),
              help="First back-off delay in seconds (doubles).")
@click.option("--keep-staging", is_flag=True, help="Keep re-split shards after a successful upload.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (dry run) or the result as JSON.")
def command(inputs, repo_id, private, revision, create_pr, dry_run, max_file_size, report_paths, compare_paths,
            run_verify, hf_dir,
            base_model, name, license_, quantized_by, retries, retry_delay, keep_staging, as_json, hf_repo,
            local_dir):
    """Upload GGUF files with one model card: every .gguf in the folder DIR, or the FILE.gguf given (each
    with the other shards of its set and its mtp- sidecar). A quant ladder (`convert --outtype
    q8_0,q6_k,q4_k_m`) goes to one repository; the card's table shows each file's type, tensor types,
    size and the verify figures of its own report (--report per file, or --verify)."""
    from specconv.errors import SpecconvError
    from specconv.hub.plan import build_plan

    if hf_dir is not None and not run_verify:
        raise SpecconvError("--hf is for --verify (parity of each file against the checkpoint)")
    console = Console(stderr=True)
    inputs = upload_inputs(inputs, hf_repo, local_dir)  # -hf: fetched from the Hub first
    source = inputs[0] if len(inputs) == 1 and inputs[0].is_dir() else list(inputs)

    def make_plan(reports):
        return build_plan(source, repo_id=repo_id, max_file_size=parse_size(max_file_size), reports=reports,
                          base_model=base_model, name=name, license=license_, quantized_by=quantized_by,
                          revision=revision, compares=compare_paths)

    plan = make_plan(list(report_paths))
    if run_verify and dry_run:
        todo = [a.name for a in plan.artifacts if not a.role.is_draft and a.report is None]
        if todo:
            plan.warnings.append(f"--verify runs before a real upload, not in a dry run: the card shown says "
                                 f"\"not verified\" for {', '.join(todo)}")
    elif run_verify:
        from specconv.hub.verified import run_verify_missing

        with console.status("verifying") as status:
            extra = run_verify_missing(plan.artifacts, plan.staging_dir, hf=hf_dir, progress=status.update)
        plan = make_plan([*report_paths, *extra])
        for a in plan.artifacts:
            if a.report is not None and a.report.passed is False:
                plan.warnings.append(f"verify FAILED on {a.name} ({a.report.source}); the card says so")
    if dry_run:
        if as_json:
            data = plan.to_dict()
            data["readme"] = plan.readme.content.decode()
            click.echo(json.dumps(data, indent=2))
        else:
            print_plan(console, plan)
        for warning in plan.warnings:
            print_wrapped(console, f"[yellow]warning:[/yellow] {escape(warning)}")
        if plan.ignored:
            print_wrapped(console, f"[dim]not uploaded: {escape(', '.join(plan.ignored))}[/dim]")
        console.print("[dim]dry run: nothing was sent or written[/dim]")
        return

    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    from specconv.hub.client import RetryPolicy, upload_plan

    if not as_json:
        print_plan(console, plan)
    for warning in plan.warnings:
        print_wrapped(console, f"[yellow]warning:[/yellow] {escape(warning)}")
    events = RichEvents(console)
    disable_progress_bars()  # one bar: ours
    try:
        result = upload_plan(
            plan,
            private=private,
            revision=revision,
            create_pr=create_pr,
            retry=RetryPolicy(attempts=max(1, retries), base_delay=retry_delay),
            events=events,
            keep_staging=keep_staging,
        )
    finally:
        events.stop()
        enable_progress_bars()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        where = result.pr_url or f"{result.url} ({result.revision})"
        console.print(
            f"[green]done:[/green] {len(result.uploaded)} uploaded, {len(result.skipped)} already there → {where}"
        )
