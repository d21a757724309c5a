"""`specconv verify`: the acceptance gate for a converted GGUF (exit 0 only if every check passed)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

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
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(min=1), help="Tokens per prompt.")
@click.option("--draft-max", default=3, show_default=True, type=click.IntRange(min=1),
              help="Round trips for draft_max 1..K; statistics at K.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="> 0 adds the distribution check of the acceptance rule.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampling runs (--temperature > 0).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here.")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA if available), cpu, cuda, cuda:N, or several (cuda:0,cuda:1: blocks split by bytes).")
@click.option("--offload", is_flag=True,
              help="Keep the weights in the file's memory map and bring each layer to the device when used "
                   "(a model bigger than the device).")
@click.option("--dtype", default=None,
              help="Compute dtype of the runtime: f32, bf16, f16 or f64 (default: the runtime's for the device). The "
                   "transformers reference of --hf loads in bf16 when this is bf16/f16, else in f32, and the parity "
                   "tolerance follows it (docs/verify.md).")
def command(model_path, mtp_path, draft_path, hf_dir, draft_hf, prompts_file, n_predict, draft_max, temperature,
            seed, json_path, device, offload, dtype, hf_repo, spec):
    """Check MODEL.gguf: structure, parity with transformers (--hf), speculative decoding, statistics."""
    from rich.console import Console

    from specconv.verify import VerifyOptions, run_verify
    from specconv.verify.run import DEFAULT_PROMPTS, read_prompts

    if spec is not None and hf_repo is None:
        raise click.UsageError("--spec picks the drafter fetched with -hf; with MODEL.gguf give --mtp or --draft")
    model_path, mtp_path, draft_path = gguf_input(model_path, hf_repo, spec=spec, mtp=mtp_path, draft=draft_path)
    hf_dir = checkpoint_input(hf_dir) if hf_dir is not None else None
    console = Console(stderr=True)
    opts = VerifyOptions(model=model_path, mtp=mtp_path, draft=draft_path, hf=hf_dir, draft_hf=draft_hf, dtype=dtype,
                         prompts=read_prompts(prompts_file) if prompts_file else list(DEFAULT_PROMPTS),
                         n_predict=n_predict, draft_max=draft_max, temperature=temperature, device=device, seed=seed,
                         offload=offload)
    with console.status("verifying") as status:
        report = run_verify(opts, progress=lambda msg: status.update(msg))
    report.render(console)
    if json_path is not None:
        report.write(json_path)
    sys.exit(0 if report.passed else 1)
