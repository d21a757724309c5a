"""`specconv verify`: the acceptance gate for a converted GGUF (exit 0 only if every check passed)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("verify")
@click.argument("model_path", metavar="MODEL.gguf", type=_FILE)
@click.option("--mtp", "mtp_path", type=_FILE, default=None, help="MTP sidecar (mtp-*.gguf) for a trunk-only model.")
@click.option("--draft", "draft_path", type=_FILE, default=None,
              help="A separate draft model GGUF (same vocabulary), or an EAGLE-3 head (converted with --target).")
@click.option("--hf", "hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The checkpoint folder that was converted: parity with transformers.")
@click.option("--prompts", "prompts_file", type=_FILE, default=None,
              help="Prompts, one per line (\\n for a newline inside one). Default: three built-in prompts.")
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(min=1), help="Tokens per prompt.")
@click.option("--draft-max", default=3, show_default=True, type=click.IntRange(min=1),
              help="Round trips for draft_max 1..K; statistics at K.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="> 0 adds the distribution check of the acceptance rule.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
def command(model_path, mtp_path, draft_path, hf_dir, prompts_file, n_predict, draft_max, temperature, seed,
            json_path, device):
    """Check MODEL.gguf: structure, parity with transformers (--hf), speculative decoding, statistics."""
    from rich.console import Console

    from specconv.verify import VerifyOptions, run_verify
    from specconv.verify.run import DEFAULT_PROMPTS, read_prompts

    console = Console(stderr=True)
    opts = VerifyOptions(model=model_path, mtp=mtp_path, draft=draft_path, hf=hf_dir,
                         prompts=read_prompts(prompts_file) if prompts_file else list(DEFAULT_PROMPTS),
                         n_predict=n_predict, draft_max=draft_max, temperature=temperature, device=device, seed=seed)
    with console.status("verifying") as status:
        report = run_verify(opts, progress=lambda msg: status.update(msg))
    report.render(console)
    if json_path is not None:
        report.write(json_path)
    sys.exit(0 if report.passed else 1)
