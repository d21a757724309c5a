"""`specconv verify`: the acceptance gate for a converted GGUF (exit 0 only if every check passed)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specconv.commands.outputs import check_output_folder
from specconv.threads import THREADS_HELP

from specconv.commands.options import MAX_DRAFT, NON_NEGATIVE, SEED, cuda_graphs_option, graphs_mode

from specconv.commands.hub_inputs import SIBLING_SPECS, checkpoint_input, gguf_input, hf_repo_option

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("verify")
@click.argument("model_path", metavar="MODEL.gguf", type=_FILE, required=False)
@hf_repo_option()
@click.option("--spec", type=click.Choice(SIBLING_SPECS), default=None,
              help="With -hf: also fetch the model file's mtp-, eagle3- or dflash- file and verify with it (as --mtp "
                   "or --draft; for mtp the model's own head when the repository has no mtp- file).")
@click.option("--mtp", "mtp_path", type=_FILE, default=None, help="MTP sidecar (mtp-*.gguf) for a trunk-only model.")
@click.option("--draft", "draft_path", type=_FILE, default=None,
              help="A separate draft model GGUF (same vocabulary), or an EAGLE-3 head (converted with --target).")
@click.option("--hf", "hf_dir", metavar="DIR|OWNER/NAME[@REVISION]", default=None,
              help="The checkpoint folder that was converted, or its Hub id (fetched as `convert` fetches it): "
                   "parity with transformers. The reference is placed "
                   "by accelerate's device map (GPUs, CPU, then a temporary offload folder on disk), so a "
                   "checkpoint bigger than the memory still runs.")
@click.option("--draft-hf", "draft_hf", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              metavar="HEAD_DIR",
              help="With --draft HEAD.gguf (EAGLE-3) and --hf TARGET_DIR: the head's own checkpoint folder. The head "
                   "is checked against a reference computed from it and fed transformers' hidden states of the "
                   "target, the layers read from its config in each trainer's convention (eagle_config ids are "
                   "layer outputs: hidden_states[i + 1]; top-level ids layer inputs: hidden_states[i]). Fails a "
                   "head whose layers are off, e.g. by one. A DFlash drafter (--draft DFLASH.gguf) is checked the "
                   "same way against its checkpoint (dflash_config.target_layer_ids are layer outputs).")
@click.option("--prompts", "prompts_file", type=_FILE, default=None,
              help="Prompts, one per line (\\n for a newline inside one). Default: three built-in prompts.")
@click.option("-n", "--n-predict", default=None, type=click.IntRange(1, 100_000),
              help="Tokens per prompt (default 12; 32 with --thorough).")
@click.option("--draft-max", default=3, show_default=True, type=click.IntRange(1, MAX_DRAFT),
              help="K: round trips at draft_max K (both rollbacks, every prompt) and below K (the first prompt; "
                   "the n-gram drafter beside a drafter of the model's: K, snapshot rollback); with --thorough "
                   "every k ≤ K on every prompt for every drafter. Statistics and timing at K.")
@click.option("--thorough", is_flag=True,
              help="The full set: round trips at every draft_max 1..K on every prompt, 32 tokens per prompt, and "
                   "llama.cpp's cost ratios on the same file (a child process).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(2, 100),
              help="Plain and speculative decoding are each timed this many times, interleaved: the speed-up is "
                   "claimed only above the spread of these repeats.")
@click.option("--temperature", default=0.0, show_default=True, type=NON_NEGATIVE,
              help="> 0 adds the distribution check of the acceptance rule.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampling runs (--temperature > 0).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of the table.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="FILE", help="Also write the JSON report to FILE (what `specconv upload --report` reads).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA if available), cpu, cuda, cuda:N, or several (cuda:0,cuda:1: blocks split by bytes).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0, 1024), help=THREADS_HELP)
@click.option("--offload", is_flag=True,
              help="Keep the weights in the file's memory map and bring each layer to the device when used "
                   "(a model bigger than the device).")
@click.option("--dtype", default=None,
              help="Compute dtype of the runtime: f32, bf16, f16 or f64 (default: the runtime's for the device). The "
                   "transformers reference of --hf loads in bf16 when this is bf16/f16, else in f32, and the parity "
                   "tolerance follows it (docs/verify.md).")
@cuda_graphs_option
def command(model_path, mtp_path, draft_path, hf_dir, draft_hf, prompts_file, n_predict, draft_max, temperature,
            seed, as_json, report_path, thorough, repeats, device, threads, offload, dtype, hf_repo, spec, cuda_graphs):
    """Check MODEL.gguf: structure, parity with transformers (--hf), speculative decoding, statistics.

    The report goes to stdout (a table, or JSON with --json), progress and diagnostics to stderr; the
    exit status is 0 only when every check passed (1: a check failed, 2: unusable input). By default
    the work is sized for seconds on a small model; each check says what it ran on (its `work`)."""
    import json

    from rich.console import Console

    from specconv.runtime import step_graphs
    from specconv.verify import VerifyOptions, run_verify
    from specconv.verify.run import DEFAULT_PROMPTS, read_prompts

    if spec is not None and hf_repo is None:
        raise click.UsageError("--spec picks the drafter fetched with -hf; with MODEL.gguf give --mtp or --draft")
    model_path, mtp_path, draft_path = gguf_input(model_path, hf_repo, spec=spec, mtp=mtp_path, draft=draft_path)
    hf_dir = checkpoint_input(hf_dir) if hf_dir is not None else None
    if report_path is not None:
        check_output_folder(report_path.parent, mkdir=False, option="--report")
    opts = VerifyOptions(model=model_path, mtp=mtp_path, draft=draft_path, hf=hf_dir, draft_hf=draft_hf, dtype=dtype,
                         prompts=read_prompts(prompts_file) if prompts_file else list(DEFAULT_PROMPTS),
                         n_predict=n_predict, draft_max=draft_max, temperature=temperature, device=device, seed=seed,
                         offload=offload, thorough=thorough, repeats=repeats, threads=threads)
    with StageBars(Console(stderr=True)) as bars, step_graphs.cuda_graphs(graphs_mode(cuda_graphs)):
        report = run_verify(opts, progress=bars)
    if report_path is not None:
        report.write(report_path)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        report.render(Console())  # a pipe gets COLUMNS or 80; tables pick a layout that fits (specconv.tables)
    sys.exit(0 if report.passed else 1)


class StageBars:
    """verify's progress on stderr: a bar per stage (what it is doing, steps done of all, time), kept
    when the stage is done."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("[dim]{task.fields[detail]}"), console=console)
        self.task = None

    def __enter__(self):
        self.bars.start()
        return self

    def __exit__(self, *exc):
        self._finish()
        self.bars.stop()
        return False

    def stage(self, name: str, total: int) -> None:
        self._finish()
        self.task = self.bars.add_task(name, total=max(1, total), detail="")

    def step(self, detail: str = "") -> None:
        if self.task is not None:
            self.bars.update(self.task, advance=1, detail=detail)

    def _finish(self) -> None:
        if self.task is not None:
            self.bars.update(self.task, completed=self.bars.tasks[-1].total, detail="done")
            self.task = None
