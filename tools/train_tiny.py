"""Train the tiny Qwen3.5 + MTP model bundled with specconv, on Python's standard-library sources.

    python tools/train_tiny.py --out specconv/data/tiny-qwen35-mtp        # the bundled model
    python tools/train_tiny.py --out /tmp/quick --quick                   # seconds; for tests

What it does, deterministically on CPU (fixed seeds, fixed thread count):
1. splits the stdlib's top-level *.py files into training and held-out files (tools/tiny_corpus.py);
2. trains a Qwen-style byte-level BPE on the training files only;
3. trains transformers' `Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention, last layer full
   attention) jointly with transformers' `MtpModel(main, 1)`; loss = main + mtp_weight * MTP, the MTP
   loss being on x_{t+2} from rows (x_{t+1}, h_t) (tools/tiny_mtp.py);
4. measures on held-out text: losses, top-1 accuracies, MTP/trunk agreement and greedy acceptance;
5. writes a `save_pretrained` checkpoint with the MTP tensors injected under the Qwen release names
   (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*`), the tokenizer, heldout.json and
   training.json, into a temporary directory renamed to --out when complete; and, unless --no-docs,
   rewrites the generated section of docs/training.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402
import tiny_mtp  # noqa: E402
from tiny_report import write_docs_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_BYTES = 25 * 1000 * 1000

FULL = dict(vocab=2048, hidden=192, intermediate=512, layers=4, heads=4, kv_heads=2, head_dim=64,
            lin_k_heads=2, lin_v_heads=4, lin_head_dim=64, ctx=256, batch=8, steps=650, lr=3e-3,
            warmup=40, mtp_weight=0.3, eval_windows=48, accept_prompts=6, accept_new=48)
QUICK = dict(vocab=512, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16,
             lin_k_heads=2, lin_v_heads=4, lin_head_dim=16, ctx=64, batch=4, steps=40, lr=1e-2,
             warmup=4, mtp_weight=0.3, eval_windows=4, accept_prompts=1, accept_new=8)
QUICK_FILES = 6  # training files used in quick mode (the first ones by name)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, few files (for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--detach-hidden", action="store_true",
                   help="stop the MTP loss gradient at the trunk's hidden state (default: joint training)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/training.md")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "training.md")
    for key, value in FULL.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=None)
    args = p.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return args, settings


def layer_types(n: int) -> list[str]:
    """3:1 linear/full as in the releases; the last trunk layer is always full attention
    (MtpModel takes its norm class from it, docs/reference/peers.md §2.2)."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    types[-1] = "full_attention"
    return types


def model_config(s: dict, tok) -> "object":
    from transformers import Qwen3_5TextConfig

    rot = int(s["head_dim"] * 0.25)
    half = rot // 2  # mrope sections must sum to rot/2; text-only input makes all three equal
    section = [half - 2 * (half // 3), half // 3, half // 3]
    eos = tok.token_to_id(tiny_corpus.EOS_TOKEN)
    return Qwen3_5TextConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], linear_conv_kernel_dim=4, linear_key_head_dim=s["lin_head_dim"],
        linear_value_head_dim=s["lin_head_dim"], linear_num_key_heads=s["lin_k_heads"],
        linear_num_value_heads=s["lin_v_heads"], layer_types=layer_types(s["layers"]),
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True},
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
    )


def build_models(config, seed: int):
    from transformers import Qwen3_5ForCausalLM
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    main = Qwen3_5ForCausalLM(config)
    tiny_mtp.enable_mtp_attributes(main.config)
    embed_before = main.get_input_embeddings().weight.detach().clone()
    mtp = MtpModel(main, 1)
    with torch.no_grad():
        # MtpModel's generic init must not change the shared embedding, and its (1+w) RMSNorms
        # start at 0 (scale 1) like the trunk's.
        main.get_input_embeddings().weight.copy_(embed_before)
        for module in mtp.layers.modules():
            if type(module).__name__ == "Qwen3_5RMSNorm":
                module.weight.zero_()
    return main, mtp


def trainable(main, mtp) -> list[torch.nn.Parameter]:
    seen, params = set(), []
    for p in list(main.parameters()) + list(mtp.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def lr_at(step: int, s: dict) -> float:
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    progress = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    return s["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows_from(streams: list[list[int]], length: int, limit: int) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens, file by file, at most `limit` of them."""
    out = []
    for ids in streams:
        for start in range(0, len(ids) - length + 1, length):
            out.append(ids[start:start + length])
            if len(out) == limit:
                return torch.tensor(out)
    return torch.tensor(out)


def train(main, mtp, stream: torch.Tensor, s: dict, seed: int, detach: bool, log) -> dict:
    params = trainable(main, mtp)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s["lr"], betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed + 1)
    span = s["ctx"] + 1
    history, t0 = [], time.time()
    main.train()
    mtp.train()
    for step in range(s["steps"]):
        starts = torch.randint(0, stream.numel() - span, (s["batch"],), generator=gen)
        window = torch.stack([stream[i:i + span] for i in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        # Alternate the two MTP row conventions so the head serves both runtimes (tools/tiny_mtp.py).
        main_loss, mtp_loss = tiny_mtp.losses(main, mtp, window, zero_row=step % 2 == 1, detach_hidden=detach)
        loss = main_loss + s["mtp_weight"] * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append((main_loss.item(), mtp_loss.item()))
        if step % max(1, s["steps"] // 20) == 0 or step == s["steps"] - 1:
            log(f"step {step:5d}  main {history[-1][0]:.3f}  mtp {history[-1][1]:.3f}  "
                f"lr {lr_at(step, s):.2e}  {time.time() - t0:7.1f}s")
    main.eval()
    mtp.eval()
    tail = history[-max(1, len(history) // 20):]
    return {
        "wall_s": time.time() - t0,
        "first_losses": {"main": history[0][0], "mtp": history[0][1]},
        "final_losses": {"main": sum(h[0] for h in tail) / len(tail), "mtp": sum(h[1] for h in tail) / len(tail)},
        "loss_curve": [[i, round(h[0], 4), round(h[1], 4)] for i, h in enumerate(history)
                       if i % max(1, len(history) // 50) == 0],
    }


def save_checkpoint(main, mtp, tok, out_dir: Path) -> dict:
    """save_pretrained + injected `mtp.*` under the release names; f32 if it fits, else bf16."""
    from safetensors.torch import load_file, save_file

    n_params = sum(p.numel() for p in trainable(main, mtp))
    dtype = torch.float32 if 4 * n_params <= MAX_BYTES - 500_000 else torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="train-tiny-sp-") as tmp:
        saved = copy.deepcopy(main).to(dtype)
        for key in ("num_mtp_layers", "mtp_layer_types"):  # runtime-only attributes, not in releases
            if hasattr(saved.config, key):
                delattr(saved.config, key)
        saved.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
        for extra in ("generation_config.json",):
            if (Path(tmp) / extra).exists():
                shutil.copy2(Path(tmp) / extra, out_dir / extra)
    for name, t in mtp.state_dict().items():
        release = tiny_mtp.release_name(name)
        if release is not None:
            tensors[release] = t.detach().to(dtype).contiguous()
    save_file(dict(sorted(tensors.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.pop("num_mtp_layers", None)
    config.pop("mtp_layer_types", None)
    config.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tiny_corpus.save_hf_tokenizer(tok, out_dir)
    return {"dtype": str(dtype).replace("torch.", ""), "parameters": n_params,
            "tensors": len(tensors), "mtp_tensors": sum(k.startswith("mtp.") for k in tensors)}


def measure(main, mtp, held_streams, s: dict) -> dict:
    windows = windows_from(held_streams, s["ctx"] + 1, s["eval_windows"])
    prompts = [torch.tensor(ids[:s["ctx"] // 2]) for ids in held_streams[:s["accept_prompts"]]]
    continuations = tiny_mtp.greedy_continuations(main, prompts, s["accept_new"])
    result = {}
    for label, zero_row in (("llamacpp_rows", True), ("transformers_rows", False)):
        m = tiny_mtp.heldout_metrics(main, mtp, windows, zero_row)
        m.update({"greedy_" + k: v for k, v in
                  tiny_mtp.greedy_acceptance(main, mtp, continuations, zero_row).items()})
        result[label] = m
    return result


def main_entry(argv=None) -> dict:
    args, s = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    log = lambda *a: print(*a, flush=True)  # noqa: E731  (progress visible when redirected)

    t_start = time.time()
    train_files, held_files = tiny_corpus.split_files()
    if args.quick:
        train_files = train_files[:QUICK_FILES]
    tok = tiny_corpus.build_tokenizer(train_files, s["vocab"])
    train_streams = tiny_corpus.encode_files(tok, train_files)
    held_streams = tiny_corpus.encode_files(tok, held_files[:2] if args.quick else held_files)
    stream = torch.tensor([i for ids in train_streams for i in ids])
    log(f"{len(train_files)} training files ({stream.numel()} tokens), {len(held_files)} held out; "
        f"vocab {s['vocab']}")

    main, mtp = build_models(model_config(s, tok), args.seed)
    stats = train(main, mtp, stream, s, args.seed, args.detach_hidden, log)
    metrics = measure(main, mtp, held_streams, s)
    for label, m in metrics.items():
        log(f"held-out ({label}): main top-1 {m['main_top1']:.3f}, MTP top-1 {m['mtp_top1']:.3f}, "
            f"MTP==trunk argmax {m['mtp_agree_main']:.3f}, greedy acceptance {m['greedy_acceptance']:.3f}")

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint ships as package data
    try:
        saved = save_checkpoint(main, mtp, tok, tmp)
        heldout = {"stdlib": f"Python {platform.python_version()} lib/python{sys.version_info[0]}."
                             f"{sys.version_info[1]}/*.py",
                   "rule": f"sha256(file name)[0] < {tiny_corpus.HELDOUT_BYTE_LIMIT}",
                   "heldout_files": [p.name for p in held_files],
                   "training_files": [p.name for p in train_files]}
        (tmp / "heldout.json").write_text(json.dumps(heldout, indent=1) + "\n")
        size = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
        report = {"command": "python tools/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "settings": s, "seed": args.seed, "threads": args.threads, "quick": args.quick,
                  "mtp_hidden": "detached" if args.detach_hidden else "joint (MTP loss reaches the trunk)",
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                  "python": platform.python_version(), "train_tokens": stream.numel(),
                  "train_files": len(train_files), "heldout_files": len(held_files),
                  "train": stats, "heldout": metrics, "checkpoint": dict(saved, bytes=size),
                  "total_wall_s": time.time() - t_start}
        (tmp / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        if size > MAX_BYTES:
            raise SystemExit(f"checkpoint is {size} bytes, over the {MAX_BYTES} limit")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes owner-only files; this is package data
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not args.no_docs and not args.quick:
        write_docs_section(args.docs, report, out)
    log(f"wrote {out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s")
    return report


if __name__ == "__main__":
    main_entry()
