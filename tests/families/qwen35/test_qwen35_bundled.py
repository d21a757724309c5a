"""The tiny Qwen3.5 + MTP checkpoint shipped in specconv/data, and the script that trains it.

Evidence gathered here with transformers' own classes (the independent reference):
* the checkpoint loads in `Qwen3_5ForCausalLM` and `MtpModel` with every weight used and none missing;
* it is at most 25 MB;
* its MTP head predicts x_{t+2} on held-out stdlib files far above chance and above a constant
  predictor, while an untrained head on the same trained trunk does not reach the bound;
* tools/train_tiny.py --quick trains end to end and lowers both losses below those of an untrained model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specconv
from tests.fixtures.paths import ROOT

BUNDLED = Path(specconv.__file__).resolve().parent / "data" / "tiny-qwen35-mtp"
MAX_BYTES = 25 * 1000 * 1000
# The 15 tensors of a dense Qwen3.5 MTP layer under the release names (docs/reference/peers.md §2.3).
RELEASE_MTP = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
               "mtp.norm.weight"} | {
    f"mtp.layers.0.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
# MtpModel name -> release name prefixes (transformers' conversion mapping, docs/reference/peers.md §2.2).
HF_TO_RELEASE = (("layers.0.eh_proj.", "mtp.fc."), ("layers.0.enorm.", "mtp.pre_fc_norm_embedding."),
                 ("layers.0.hnorm.", "mtp.pre_fc_norm_hidden."), ("layers.0.post_norm.", "mtp.norm."),
                 ("layers.0.mtp_block.", "mtp.layers.0."))


def load(model_dir: Path):
    """(main, mtp) through transformers; fails on any missing or mismatched trunk weight."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.modeling_layers import MtpModel

    main, info = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), output_loading_info=True, dtype=torch.float32)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys", "error_msgs") and v}
    assert not bad, f"incomplete trunk load: {bad}"
    main.config.num_mtp_layers = 1  # Qwen configs don't carry the count transformers reads (docs/reference/peers.md §2.2)
    main.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel.from_pretrained(main)  # raises on any missing MTP weight
    return main.eval(), mtp.eval()


def window_ids(model_dir: Path, files: list[str], length: int, per_file: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in files:
        ids = tok((lib / name).read_text(encoding="utf-8", errors="replace"))["input_ids"]
        starts = range(0, len(ids) - length + 1, length)
        # Evenly spread through the file: its first window is mostly a licence/docstring header.
        for k in range(min(per_file, len(starts))):
            start = starts[k * len(starts) // min(per_file, len(starts))]
            rows.append(ids[start:start + length])
    assert rows, f"no held-out text found in {lib}"
    return torch.tensor(rows)


@torch.no_grad()
def mtp_predictions(main, mtp, ids: torch.Tensor, zero_row: bool):
    """(trunk logits [B,T,V], MTP logits [B,T-1,V]); MTP row t = (x_{t+1}, h_t) predicts x_{t+2}.

    The last MTP row predicts x_{T}, past the window: score against text with [:, :-1].

    zero_row prepends llama.cpp's (x_0, zero hidden) row at position 0 (docs/reference/model-math.md §7.2).
    """
    out = main(input_ids=ids, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1]  # post-final-norm
    batch, length = ids.shape
    tokens, rows, pos = ids[:, 1:], hidden[:, :-1], torch.arange(1, length)
    if zero_row:
        tokens = torch.cat([ids[:, :1], tokens], 1)
        rows = torch.cat([torch.zeros_like(rows[:, :1]), rows], 1)
        pos = torch.arange(0, length)
    hs = mtp.forward_layer(0, rows, position_ids=pos.expand(batch, -1), mtp_cache=None, input_ids=tokens)
    logits = mtp._project_to_logits(hs)
    return out.logits, (logits[:, 1:] if zero_row else logits)


def test_bundled_checkpoint_size_and_layout():
    files = {f.name: f.stat().st_size for f in BUNDLED.iterdir() if f.is_file()}
    total = sum(files.values())
    print(f"bundled checkpoint: {total / 1e6:.2f} MB in {len(files)} files")
    assert total <= MAX_BYTES
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout.json"):
        assert name in files, name
    cfg = json.loads((BUNDLED / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["mtp_use_dedicated_embeddings"] is False
    types = cfg["layer_types"]
    assert len(types) >= 4 and types[-1] == "full_attention" and "linear_attention" in types
    held = json.loads((BUNDLED / "heldout.json").read_text())
    assert held["heldout_files"] and not set(held["heldout_files"]) & set(held["training_files"])


def test_bundled_checkpoint_loads_with_every_weight():
    from safetensors import safe_open

    main, mtp = load(BUNDLED)
    with safe_open(str(BUNDLED / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert {k for k in stored if k.startswith("mtp.")} == RELEASE_MTP

    trunk = {k: v for k, v in main.state_dict().items() if not (k == "lm_head.weight" and main.config.tie_word_embeddings)}
    head = {}
    for name, value in mtp.state_dict().items():
        if name.startswith(("embed_tokens.", "shared_head.")):
            continue  # shared with the trunk
        hf, rel = next((hf, rel) for hf, rel in HF_TO_RELEASE if name.startswith(hf))
        head[rel + name[len(hf):]] = value
    # Every stored tensor is used, every model weight is stored, and the values are the stored ones.
    assert set(trunk) | set(head) == set(stored)
    for name, value in {**trunk, **head}.items():
        assert torch.equal(value, stored[name].float()), name
    print(f"{len(trunk)} trunk + {len(head)} MTP tensors, all loaded ({stored['mtp.fc.weight'].dtype})")


def test_bundled_mtp_head_is_trained():
    """MTP top-1 on x_{t+2} over held-out files: far above chance, above the best constant guess,
    and above the same bound measured for an untrained head on the same trunk (which must fail it)."""
    from transformers.modeling_layers import MtpModel

    held = json.loads((BUNDLED / "heldout.json").read_text())["heldout_files"]
    lib = Path(sysconfig.get_paths()["stdlib"])
    # The three largest held-out files present here: enough text for a stable figure.
    present = sorted((n for n in held if (lib / n).is_file()), key=lambda n: -(lib / n).stat().st_size)[:3]
    main, mtp = load(BUNDLED)
    ids = window_ids(BUNDLED, present, length=128, per_file=4)
    target = ids[:, 2:]
    vocab = main.config.vocab_size
    constant = torch.bincount(target.flatten(), minlength=vocab).max().item() / target.numel()
    bound = max(100.0 / vocab, 3.0 * constant, 0.15)

    torch.manual_seed(0)
    untrained = MtpModel(main, 1).eval()  # fresh head, shared (trained) embedding and output
    results = {}
    for label, head in (("trained", mtp), ("untrained", untrained)):
        for zero_row in (False, True):
            logits, m_logits = mtp_predictions(main, head, ids, zero_row)
            acc = (m_logits[:, :-1].argmax(-1) == target).float().mean().item()
            # The trunk's own guess for x_{t+2} is its argmax at position t+1.
            agree = (m_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item()
            loss = F.cross_entropy(m_logits[:, :-1].flatten(0, 1), target.flatten()).item()
            results[(label, zero_row)] = acc
            print(f"{label:9s} head, {'llama.cpp' if zero_row else 'transformers'} rows: MTP top-1 {acc:.3f} "
                  f"(chance {1 / vocab:.4f}, constant guess {constant:.3f}, bound {bound:.3f}), "
                  f"== trunk argmax {agree:.3f}, loss {loss:.3f} (ln V = {math.log(vocab):.2f}); files {present}")
            if label == "trained":
                assert acc > bound
                assert agree >= 0.4  # teacher-forced stand-in for greedy acceptance at draft_max 1
            else:
                assert acc < bound  # the bound would fail for an untrained head


def test_train_tiny_quick_mode_lowers_losses(tmp_path):
    """The training script runs end to end and both losses end well below an untrained model's."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.modeling_layers import MtpModel

    out = tmp_path / "quick"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--quick", "--no-docs",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1

    main, mtp = load(out)
    training = json.loads((out / "heldout.json").read_text())["training_files"][:2]
    ids = window_ids(out, training, length=64, per_file=4)

    def losses(m, h):
        logits, m_logits = mtp_predictions(m, h, ids, zero_row=False)
        return (F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item(),
                F.cross_entropy(m_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten()).item())

    torch.manual_seed(0)
    fresh = Qwen3_5ForCausalLM(main.config).eval()
    fresh_losses = losses(fresh, MtpModel(fresh, 1).eval())
    trained_losses = losses(main, mtp)
    print(f"quick run on training text: main {fresh_losses[0]:.3f} -> {trained_losses[0]:.3f}, "
          f"MTP {fresh_losses[1]:.3f} -> {trained_losses[1]:.3f}")
    assert trained_losses[0] < fresh_losses[0] - 0.5
    assert trained_losses[1] < fresh_losses[1] - 0.5
