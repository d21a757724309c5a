"""`specconv generate`: decode text from a GGUF model with the reference runtime."""

from __future__ import annotations

import json
import statistics
import time

import click

from specconv.commands.hub_inputs import SPEC_HELP, gguf_input, hf_repo_option
from specconv.commands.options import (
    DRAFT_COUNT, MAX_DRAFT, NON_NEGATIVE, PROBABILITY, SEED, DraftMaxType, cuda_graphs_option, graphs_mode,
)
from specconv.errors import SpecconvError
from specconv.threads import THREADS_HELP, set_threads


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
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise SpecconvError(f"--tokens: id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
        return ids
    return model.tokenizer.encode(prompt)


DRAFT_MAX = DraftMaxType()  # 0..MAX_DRAFT or auto


@click.command("generate")
@click.argument("model_path", metavar="MODEL.gguf", type=click.Path(exists=True, dir_okay=False), required=False)
@hf_repo_option(SPEC_HELP)
@click.option("-p", "--prompt", default=None, help="Prompt text (tokenized with the GGUF's tokenizer).")
@click.option("--tokens", default=None, help="Prompt as comma-separated token ids instead of text.")
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(min=0), help="Tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, type=NON_NEGATIVE, help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Sampling seed (temperature > 0).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA if available), cpu, cuda, cuda:N, or several devices (cuda:0,cuda:1): the blocks "
                   "are split over them by their bytes.")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0, 1024), help=THREADS_HELP)
@click.option("--dtype", default=None,
              help="Compute dtype: f32, f16, bf16, f64. Default f32 on the CPU, bf16 on CUDA (half the "
                   "activation and dequantization memory, full tensor-core rate).")
@click.option("--offload", is_flag=True,
              help="Keep the weights in the file's memory map and bring each layer's bytes to the device when "
                   "used: runs a model bigger than the device's memory, slower.")
@click.option("--weights", "weights_mode", type=click.Choice(["stored", "dense"]), default="stored", show_default=True,
              help="stored: weights stay in their GGUF types (memory about the file size) and are dequantized "
                   "per use; dense: everything dequantized at load (the reference path, memory about "
                   "parameters x dtype size).")
@click.option("--stop-at-eos", is_flag=True, help="Stop at the end-of-generation token.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (tokens, text, seconds, ...).")
@click.option("--spec", type=click.Choice(["mtp", "draft", "eagle3", "dflash", "ngram", "synthetic", "none"]),
              default="none", show_default=True,
              help="Speculative decoding with this drafter. synthetic: a drafter for measurement that proposes the "
                   "target's own greedy continuation (a plain run made first, not timed) with each token replaced, "
                   "independently, with probability 1 - --acceptance; it costs nothing to draft, so the run shows "
                   "the target's cost of verification and rollback. Its results are labelled synthetic.")
@click.option("--acceptance", default=None, type=PROBABILITY,
              help="For --spec synthetic: the probability A that each drafted token is kept (greedy acceptance A).")
@click.option("--draft-max", default="3", show_default=True, type=DRAFT_MAX,
              help="Draft tokens per round, or auto: chosen per round (0 to 8) from the acceptance measured so far "
                   "and the measured costs of the target's forward by batch size and of the drafter, dropping to "
                   "plain decoding while drafts do not pay and probing again later; each round's choice is in the "
                   "--json rounds (k, mode).")
@click.option("--draft-min", default=0, show_default=True, type=DRAFT_COUNT,
              help="Shorter drafts are discarded.")
@click.option("--p-min", default=0.0, show_default=True, type=PROBABILITY,
              help="Stop drafting below this top-10 probability.")
@click.option("--mtp", "mtp_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="MTP sidecar for --spec mtp (default: the model's own head).")
@click.option("--draft", "draft_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Draft model GGUF for --spec draft, the EAGLE-3 head for --spec eagle3, or the DFlash drafter for "
                   "--spec dflash (--draft-max is capped at its block size - 1).")
@click.option("--rollback", type=click.Choice(["snapshot", "checkpoint"]), default="snapshot", show_default=True)
@click.option("--no-baseline", is_flag=True, help="With --spec: skip the plain runs that measure the speed-up.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100),
              help="With --spec: plain and speculative decoding are each timed this many times, interleaved (the "
                   "first speculative run is the output). The speed-up is the ratio of the medians, claimed as a "
                   "gain only when every speculative repeat was faster than every plain one (else \"no measurable "
                   "gain\"); the times are in the --json speculative.timing.")
@cuda_graphs_option
def command(model_path, prompt, tokens, n_predict, temperature, seed, device, threads, dtype, offload, weights_mode, stop_at_eos,
            as_json, spec, acceptance, draft_max, draft_min, p_min, mtp_path, draft_path, rollback, no_baseline, repeats,
            hf_repo, cuda_graphs):
    """Generate N tokens after a prompt (plain or speculative decoding).

    With --json the object carries load_seconds, prompt and decode tokens/s and the stored weight
    bytes the run read (weight_bytes_read: with --spec, of the timed speculative run, the drafter's
    weights included)."""
    from specconv.runtime import load_model, step_graphs
    from specconv.runtime.generate import generate

    if (acceptance is None) == (spec == "synthetic"):
        raise SpecconvError("--acceptance A goes with --spec synthetic, and --spec synthetic needs it")
    if draft_max != "auto" and draft_min > draft_max:
        raise click.BadParameter(f"--draft-min {draft_min} is above --draft-max {draft_max}: nothing would be drafted",
                                 param_hint="'--draft-min'")
    model_path, mtp_path, draft_path = gguf_input(model_path, hf_repo, spec=spec, mtp=mtp_path, draft=draft_path)
    started = time.perf_counter()
    model = load_model(model_path, device=device, dtype=dtype, weights=weights_mode, offload=offload)
    load_seconds = time.perf_counter() - started
    threads = set_threads(model, threads)
    ids = prompt_ids(model, prompt, tokens)
    check_context(model, len(ids), n_predict)
    with step_graphs.cuda_graphs(graphs_mode(cuda_graphs)):
        if spec == "none":
            result = generate(model, ids, n_predict, temperature=temperature, seed=seed, stop_at_eos=stop_at_eos)
        else:
            result = _speculative(model, ids, n_predict, spec, temperature, seed, stop_at_eos, draft_max, draft_min,
                                  p_min, mtp_path, draft_path, rollback, 0 if no_baseline else repeats, acceptance)
    if as_json:
        payload = result.to_json()
        if spec != "none":  # the rates as for plain decoding, at the top level
            payload.update({k: result.stats["speculative"][k] for k in RATES})
        payload.update(device=str(model.device), model=str(model_path), temperature=temperature, seed=seed,
                       load_seconds=load_seconds, threads=threads, dtype=str(model.dtype).removeprefix("torch."),
                       weights=weights_mode, offload=offload,
                       placement=model.weights.placement.describe())
        click.echo(json.dumps(payload))
        return
    click.echo(result.text)
    rate = len(result.tokens) / result.seconds if result.seconds > 0 else float("inf")
    click.echo(f"[{len(result.tokens)} tokens in {result.seconds:.2f} s, {rate:.1f} tok/s on {model.device}]", err=True)
    s = result.stats.get("speculative")
    if s:
        from specconv.demo.measure import speedup_text

        speedup = f", {speedup_text(s['timing'])}" if s.get("timing") else ""
        label = (f"synthetic drafter, set acceptance {s['set_acceptance']:.2f} (a measurement, not a head)"
                 if s.get("synthetic") else s["drafter"])
        click.echo(f"[{label}: accepted {s['accepted']}/{s['drafted']} drafts, "
                   f"{s['tokens_per_target_forward']:.2f} tokens per target forward{speedup}]", err=True)
        if s.get("auto"):
            ks = [r.get("k", 0) for r in result.stats["rounds"]]
            plain = sum(1 for r in result.stats["rounds"] if r.get("mode") == "plain")
            click.echo(f"[draft-max auto: k per round {min(ks)}..{max(ks)}, mean {sum(ks) / max(1, len(ks)):.2f}; "
                       f"{plain} of {len(ks)} rounds plain]", err=True)
        if len(s.get("per_block") or []) > 1:  # chained MTP blocks: draft position i is block i's
            click.echo("[by MTP block: " + ", ".join(f"block {b['block']} {b['accepted']}/{b['drafted']}"
                                                     for b in s["per_block"]) + "]", err=True)


RATES = ("prompt_seconds", "prompt_tokens_per_second", "decode_tokens_per_second")


def check_context(model, n_prompt: int, n_predict: int) -> None:
    """The prompt and the tokens to generate must fit the model's context length (when its file states one)."""
    limit = model.file.get(f"{model.arch}.context_length")
    if limit and n_prompt + n_predict > int(limit):
        raise SpecconvError(f"the prompt ({n_prompt} tokens) and -n {n_predict} exceed the model's context length "
                            f"{int(limit)}")


def _speculative(model, ids, n_predict, spec, temperature, seed, stop_at_eos, draft_max, draft_min, p_min, mtp_path,
                 draft_path, rollback, repeats, acceptance=None):
    """--spec: the speculative loop; its JSON adds `speculative` with verify's key names, its prompt and
    decode rates and weight_bytes_read, and `speculative.timing` (the repeats of both runs, the verdict
    of specconv/demo/measure.py)."""
    from specconv.runtime.drafters.synthetic import greedy_reference
    from specconv.runtime.generate import generate
    from specconv.runtime.spec_auto import AUTO_K_MAX, cached_target_costs
    from specconv.demo.measure import speedup_verdict
    from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate

    if mtp_path and spec != "mtp" or draft_path and spec not in ("draft", "eagle3", "dflash"):
        raise SpecconvError("--mtp goes with --spec mtp, --draft with --spec draft, eagle3 or dflash")
    auto = draft_max == "auto"
    k_max = AUTO_K_MAX if auto else draft_max
    n_ctx = len(ids) + n_predict + k_max + 2
    reference = greedy_reference(model, ids, n_predict) if spec == "synthetic" else None  # made first, not timed
    drafter = build_drafter(spec, model, n_ctx, k_max, mtp_path=mtp_path, draft_path=draft_path, reference=reference,
                            acceptance=acceptance, seed=seed)
    cfg = SpecConfig(draft_max=k_max, draft_min=draft_min, p_min=p_min, temperature=temperature, seed=seed,
                     rollback=rollback, stop_at_eos=stop_at_eos, auto=auto)
    if auto:  # the target's forward cost by batch size, measured once before the timed runs
        cached_target_costs(model, k_max + 1)
    if repeats:  # first calls pay one-time costs (allocator, kernels): keep them out of both timings
        speculative_generate(model, drafter, ids[:1], 2, cfg)
        generate(model, ids[:1], 2)
    counters = read_counters(model, drafter)
    for c in counters:
        c.reset()
    result = speculative_generate(model, drafter, ids, n_predict, cfg, n_ctx=n_ctx)
    result.weight_bytes_read = sum(c.reset() for c in counters)
    s = result.stats["speculative"]
    decode = result.seconds - s["prompt_seconds"]  # the first round evaluates the prompt's last token
    s.update(prompt_tokens_per_second=(len(ids) - 1) / s["prompt_seconds"] if s["prompt_seconds"] > 0 else None,
             decode_tokens_per_second=len(result.tokens) / decode if decode > 0 else None)
    s["speedup"] = None
    if repeats:
        spec_s, plain_s = [result.seconds], []
        for rep in range(repeats):  # interleaved, the order alternating, so a drift in load hits both alike
            runs = ["plain", "spec"] if rep % 2 else ["spec", "plain"]
            for kind in runs:
                if kind == "plain":
                    plain_s.append(generate(model, ids, len(result.tokens), temperature=temperature, seed=seed).seconds)
                elif rep:
                    spec_s.append(speculative_generate(model, drafter, ids, n_predict, cfg, n_ctx=n_ctx).seconds)
        s["timing"] = speedup_verdict(plain_s, spec_s, drafted=s["drafted"])
        s.update(speedup=s["timing"]["speedup"], plain_seconds=statistics.median(plain_s))
    return result


def read_counters(model, drafter) -> list:
    """The weight-read counters of the target and of the model a drafter runs (MTP sidecar, EAGLE-3 head,
    DFlash drafter, draft model), each once."""
    from specconv.runtime.drafters import DraftModelDrafter, Eagle3Drafter, Gemma4AssistantDrafter, MtpDrafter
    from specconv.runtime.drafters.dflash import DFlashDrafter

    own = {MtpDrafter: "head", Eagle3Drafter: "head", DFlashDrafter: "head", DraftModelDrafter: "model",
           Gemma4AssistantDrafter: "assistant"}  # where each drafter keeps its model
    models = [model] + [vars(drafter)[attr] for cls, attr in own.items() if isinstance(drafter, cls)]
    counters = []
    for m in models:
        if all(c is not m.weights.counter for c in counters):
            counters.append(m.weights.counter)
    return counters
