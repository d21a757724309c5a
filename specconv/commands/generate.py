"""`specconv generate`: decode text from a GGUF model with the reference runtime."""

from __future__ import annotations

import json

import click

from specconv.errors import SpecconvError


def parse_tokens(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SpecconvError(f"--tokens must be comma-separated integers, not {text!r}") from None
    if not ids:
        raise SpecconvError("--tokens is empty")
    return ids


def prompt_ids(model, prompt: str | None, tokens: str | None) -> list[int]:
    if (prompt is None) == (tokens is None):
        raise SpecconvError("give exactly one of -p/--prompt TEXT or --tokens 1,2,3")
    if tokens is not None:
        ids = parse_tokens(tokens)
        bad = [t for t in ids if not 0 <= t < model.n_vocab]
        if bad:
            raise SpecconvError(f"--tokens: id {bad[0]} is outside the vocabulary [0, {model.n_vocab})")
        return ids
    return model.tokenizer.encode(prompt)


@click.command("generate")
@click.argument("model_path", metavar="MODEL.gguf", type=click.Path(exists=True, dir_okay=False))
@click.option("-p", "--prompt", default=None, help="Prompt text (tokenized with the GGUF's tokenizer).")
@click.option("--tokens", default=None, help="Prompt as comma-separated token ids instead of text.")
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(min=0), help="Tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed (temperature > 0).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default=None, help="Compute dtype: f32 (default), f16, bf16, f64.")
@click.option("--stop-at-eos", is_flag=True, help="Stop at the end-of-generation token.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (tokens, text, seconds, ...).")
def command(model_path, prompt, tokens, n_predict, temperature, seed, device, dtype, stop_at_eos, as_json):
    """Generate N tokens after a prompt (plain decoding)."""
    from specconv.runtime import load_model
    from specconv.runtime.generate import generate

    model = load_model(model_path, device=device, dtype=dtype)
    ids = prompt_ids(model, prompt, tokens)
    result = generate(model, ids, n_predict, temperature=temperature, seed=seed, stop_at_eos=stop_at_eos)
    if as_json:
        payload = result.to_json()
        payload.update(device=str(model.device), model=str(model_path), temperature=temperature, seed=seed)
        click.echo(json.dumps(payload))
        return
    click.echo(result.text)
    rate = len(result.tokens) / result.seconds if result.seconds > 0 else float("inf")
    click.echo(f"[{len(result.tokens)} tokens in {result.seconds:.2f} s, {rate:.1f} tok/s on {model.device}]", err=True)
