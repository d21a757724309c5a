"""One hparams dataclass for DFlash / DFlash2 drafters (archs/dflash_hparams.py `DFlashHParams`): the
graph's, read from a converted file (`from_kv`), equals the plugin's, read from the drafter's and
its target's config.json (`from_config`), on every field: the sweep's fixtures, the drafters of the
other targets (M-RoPE Qwen3.5, LLaMA), and a config that sets every optional key the file carries."""

from __future__ import annotations

import json

import pytest

from specconv.archs.dflash_hparams import DFlashHParams
from specconv.runtime.gguf_file import GGUFModelFile
from tests.fixtures import tiny_dflash as tiny
from tests.fixtures.family_runner import built, cases
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hparams_compare import differences

# every optional key (on a DFlash2 drafter, with its logit scale and soft-capping): partial rope, and in
# dflash_config causality (is_causal removed from the top), value and embedding scales, a window on every
# layer (use_swa)
PARTIAL_ROTARY = 0.5
DFLASH_CONFIG = {"causal": True, "attention_value_scale": 0.75, "use_swa": True, "swa_window_size": 5,
                 "input_embedding_scale": 1.5}


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _check(name, draft_src, target_src, gguf) -> DFlashHParams:
    from_kv = DFlashHParams.from_kv(GGUFModelFile(gguf).kv)
    from_config = DFlashHParams.from_config(_config(draft_src), _config(target_src))
    diffs, n = differences(from_kv, from_config, {})
    print(f"\n[{name}] {n} fields equal from the file and from config.json" + "".join(f"\n    {d}" for d in diffs))
    assert not diffs
    return from_config


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hparams")


@pytest.mark.parametrize("case", cases("dflash-release", "dflash2-shapes"), ids=lambda c: c.name)
def test_sweep_drafter_hparams_from_file_equal_config(case, root):
    b = built(case, root)
    hp = _check(case.name, b.draft_src, b.src, b.draft)
    assert hp.v2 == (case.name == "dflash2-shapes") and (hp.sliding_window > 0) == hp.v2


@pytest.mark.parametrize("kind", ["qwen35", "llama"])
def test_other_targets_drafter_hparams_from_file_equal_config(kind, root):
    t_dir, _, d_dir, d_gguf = tiny.built(root, kind)
    hp = _check(f"dflash for {kind}", d_dir, t_dir, d_gguf)
    assert hp.target_mrope == (kind == "qwen35")


def test_every_optional_key_hparams_from_file_equal_config(root, tmp_path):
    t_dir, _, _, _ = tiny.built(root, "qwen3")
    d_dir = tiny.build_dflash(tmp_path / "d", t_dir, layer_ids=[0, 2, 4], mask_token_id=tiny.MASK, v2=True,
                              block_size_in="dflash_config")
    cfg = {k: v for k, v in _config(d_dir).items() if k != "is_causal"}
    cfg["partial_rotary_factor"] = PARTIAL_ROTARY
    cfg["dflash_config"].update(DFLASH_CONFIG)
    (d_dir / "config.json").write_text(json.dumps(cfg))
    gguf = convert_gguf(d_dir, tmp_path / "d.gguf", extra_args=["--target", str(t_dir)])
    hp = _check("every optional key", d_dir, t_dir, gguf)
    assert (hp.rotary_dim, hp.causal, hp.sliding_window) == (int(hp.head_dim * PARTIAL_ROTARY), True, 5)
    assert hp.sliding_window_pattern == [True] * hp.num_hidden_layers
    assert None not in (hp.attention_value_scale, hp.input_embedding_scale, hp.output_multiplier,
                        hp.final_logit_softcapping)
