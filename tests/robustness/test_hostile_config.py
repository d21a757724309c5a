"""config.json values of the wrong JSON type end `convert` in one line naming the key, never a traceback.

Every plugin reads config.json through one typed reader (archs/config_reader.py); gguf-py's readers
of config.json (general metadata, special token ids, Gemma's tokenizer through transformers) get
their fields checked before them. The checkpoint fuzzer (tools/fuzz_config.py) sets every key of the
config of every seed checkpoint (tools/fuzz_seeds.py: every family the project converts, the
targets of draft heads included) to each wrong type, and adds the optional keys readers take when
present; a random run mutates values as well.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import fuzz_config  # noqa: E402

from specconv.archs.config_reader import ConfigReader  # noqa: E402
from specconv.errors import SpecconvError  # noqa: E402


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return tmp_path_factory.mktemp("config-seeds")


def test_every_key_of_every_family_to_each_wrong_type(seeds, tmp_path):
    records = fuzz_config.every_type(seeds, tmp_path)
    by = {}
    for r in records:
        by.setdefault(r["checkpoint"], []).append(r)
    for name, rs in sorted(by.items()):
        print(f"{name}: {len(rs)} cases, {sum(r['outcome'] == 'clear' for r in rs)} refused in one line, "
              f"{sum(r['outcome'] == 'ok' for r in rs)} converted (keys no reader takes)")
    internal = [r for r in records if r["outcome"] == "internal"]
    assert not internal, internal[:5]
    unnamed = [r for r in records if r["outcome"] == "clear" and not fuzz_config.names_key(r["message"], r["key"])]
    assert not unnamed, unnamed[:5]
    # the fields every family needs are read, so each wrong type of them is refused
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    for r in records:
        if r["key"].split(".")[-1] in needed and not r["checkpoint"].endswith("(target config)"):
            assert r["outcome"] == "clear", r
    families = {r["checkpoint"] for r in records}
    assert len(families) >= 20 and all(any(r["outcome"] == "clear" for r in by[f]) for f in families)


def test_random_type_and_value_mutations(seeds):
    args = fuzz_config.build_parser().parse_args(["--seeds", str(seeds), "--cases", "600", "--seed", "3"])
    report = fuzz_config.run(args)
    print(f"checkpoint fuzz: {report['totals']} in {report['seconds']} s")
    assert not report["problems"], report["problems"][:5]
    assert report["totals"].get("clear", 0) > 0 and report["totals"].get("ok", 0) > 0


@pytest.mark.parametrize("edit,key", [
    (lambda c: c["text_config"]["rope_parameters"].update(rope_theta=[10000.0]), "text_config.rope_parameters.rope_theta"),
    (lambda c: c["text_config"].update(layer_types=4.0), "text_config.layer_types"),
    (lambda c: c["text_config"].update(num_attention_heads="4"), "text_config.num_attention_heads"),
    (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings"),
])
def test_convert_cli_says_which_key(tmp_path, capsys, edit, key):
    """A list where a number belongs, a number where a list belongs: exit 2 and one line naming the key."""
    from tests.fixtures.tiny_qwen35 import build_qwen35
    from tests.fixtures.cli import assert_refused

    src = build_qwen35(tmp_path / "hf", layout="release")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(capsys, src, tmp_path / "out", expect=["config.json", key])


def test_reader_types_and_paths():
    cfg = ConfigReader({"a": 4, "f": 2.0, "b": True, "s": "x", "l": [1, 2], "n": None,
                        "text_config": {"h": 8, "rope_parameters": {"rope_theta": 5.5}}})
    assert cfg.integer("a") == 4 and cfg.integer("f") == 2 and cfg.number("a") == 4.0 and cfg.flag("b") is True
    assert cfg.integers("l") == [1, 2] and cfg.integer("n", default=7) == 7 and cfg.integer("zz", "a") == 4
    tc = cfg.text_model()
    assert tc.with_rope().number("rope_theta") == 5.5 and tc.integer("h", min=1, max=8) == 8
    for call, message in ((lambda: cfg.integer("b"), "config.json: b must be an integer, got True"),
                          (lambda: cfg.integer("s"), "config.json: s must be an integer, got 'x'"),
                          (lambda: cfg.integer("l"), "config.json: l must be an integer, got [1, 2]"),
                          (lambda: cfg.flag("a"), "config.json: a must be true or false, got 4"),
                          (lambda: cfg.number("s"), "config.json: s must be a finite number, got 'x'"),
                          (lambda: cfg.integers("a"), "config.json: a must be a list, got 4"),
                          (lambda: ConfigReader({"l": [1, "2"]}).integers("l"), "config.json: l[1] must be an integer, got '2'"),
                          (lambda: tc.with_rope().integer("rope_theta"),
                           "config.json: text_config.rope_parameters.rope_theta must be an integer, got 5.5"),
                          (lambda: tc.integer("q"), "config.json lacks text_config.q"),
                          (lambda: cfg.integer("a", max=3), "config.json: a must be an integer in [0, 3], got 4"),
                          (lambda: ConfigReader({"text_config": [1]}).text_model(),
                           "config.json: text_config must be a JSON object, got [1]")):
        with pytest.raises(SpecconvError) as exc:
            call()
        assert str(exc.value) == message
    # a family default answers for a key the file leaves out, not for an explicit null (transformers' reading)
    d = ConfigReader({"q": None}).with_defaults({"q": 5, "r": 6})
    assert d.integer("q", default=None) is None and d.integer("r") == 6
    assert ConfigReader({"x": 1}).with_values({"x": 2}).integer("x") == 2
    merged = ConfigReader({"x": 1, "inner": {"x": 3}}).merged("inner")
    assert merged.integer("x") == 3


def test_attention_heads_reads_transformers_defaults_and_refuses_kv_heads_that_do_not_divide():
    assert ConfigReader({"num_attention_heads": 8, "hidden_size": 64}).attention_heads() == (8, 8, 8)
    assert ConfigReader({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 24,
                         "hidden_size": 64}).attention_heads() == (8, 2, 24)
    tc = ConfigReader({"text_config": {"num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 48}})
    with pytest.raises(SpecconvError) as exc:
        tc.text_model().attention_heads()
    assert str(exc.value) == ("config.json: text_config.num_attention_heads (6) is not a multiple of "
                              "num_key_value_heads (4)")
    with pytest.raises(SpecconvError, match="^config.json lacks hidden_size$"):  # needed only without head_dim
        ConfigReader({"num_attention_heads": 8}).attention_heads()
