"""`specconv upload DIR --repo USER/NAME`: publish GGUF outputs, sidecars and a model card on the Hub."""

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

from specconv.hub.naming import human_size, parse_size
from specconv.tables import Col, print_table, print_wrapped


PLAN_COLUMNS = [Col("Repository path", whole=True), Col("Size", "right"), Col("Quant"), Col("Role"), Col("From")]


def plan_rows(plan) -> list[list[str]]:
    """One row per file of the plan (shards separately), then the generated model card."""
    rows = []
    for a in plan.artifacts:
        for i, f in enumerate(a.files):
            if a.layout is not None:
                origin = f"split {i + 1}/{len(a.files)} of " + ", ".join(p.name for p in a.sources)
            else:
                origin = str(f.source.relative_to(plan.folder))
            rows.append([escape(f.path_in_repo), human_size(f.size), a.quant, a.role.value, escape(origin)])
    rows.append(["README.md", human_size(plan.readme.size), "", "model card", "generated"])
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
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repo", "repo_id", required=True, help="Target repository, USER/NAME.")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", help="Branch to commit to (created if missing), or refs/pr/N to resume a PR.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main.")
@click.option("--dry-run", is_flag=True, help="Print the plan; send nothing, write nothing.")
@click.option("--max-file-size", default="50G", show_default=True, help="Split files above this size (decimal units).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="specconv verify --json report for the card.")
@click.option("--base-model", help="Source model id for the card (default: from the GGUF metadata).")
@click.option("--name", help="Model name used in file names (default: from the GGUF metadata).")
@click.option("--license", "license_", help="License id for the card (default: general.license).")
@click.option("--quantized-by", default="specconv", show_default=True)
@click.option("--retries", default=6, show_default=True, help="Attempts per request on network errors and 5xx.")
@click.option("--retry-delay", default=2.0, show_default=True, help="First back-off delay in seconds (doubles).")
@click.option("--keep-staging", is_flag=True, help="Keep re-split shards after a successful upload.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (dry run) or the result as JSON.")
def command(folder, repo_id, private, revision, create_pr, dry_run, max_file_size, report_path, base_model, name,
            license_, quantized_by, retries, retry_delay, keep_staging, as_json):
    """Upload the GGUF files in FOLDER (models, mtp- sidecars, shards) with a model card."""
    from specconv.hub.plan import build_plan

    console = Console(stderr=True)
    plan = build_plan(
        folder,
        repo_id=repo_id,
        max_file_size=parse_size(max_file_size),
        report=report_path,
        base_model=base_model,
        name=name,
        license=license_,
        quantized_by=quantized_by,
        revision=revision,
    )
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
