"""The upload plan without any network: roles, quant tags, names, re-split shards and the card."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

from specconv.errors import SpecconvError
from specconv.hub.naming import Role
from specconv.hub.plan import build_plan
from specconv.hub.split import plan_split, write_split
from specconv.hub.staging import stage
from tests.fixtures.hub.cards import front_matter, table_rows
from tests.fixtures.hub.ggufs import tensor_bytes, write_tiny_gguf

REPORT = {
    "passed": True,
    "checks": [
        {"name": "parity vs transformers", "passed": True, "detail": "max |d| 3.1e-05 | 4 prompts"},
        {"name": "greedy output identical", "passed": True, "detail": "48 tokens"},
    ],
    "parity": {"max_abs_logit_diff": 3.1e-05, "reference": "transformers 5.23.0"},
    "speculative": {
        "exact": True,
        "drafted": 120,
        "accepted": 77,
        "acceptance_rate": 0.6417,
        "acceptance_length": 2.283,
        "per_position": [0.85, 0.62, 0.45],
        "tokens_per_target_forward": 2.283,
        "bound": 2.9,
        "speedup": 1.74,
        "rollback": "snapshot",
    },
}


@pytest.fixture
def outputs(tmp_path):
    """A converter-like output folder: trunk-only + mtp sidecar, plus unrelated files."""
    folder = tmp_path / "out"
    folder.mkdir()
    write_tiny_gguf(folder / "model.gguf", "trunk", seed=1)
    write_tiny_gguf(folder / "model-mtp.gguf", "sidecar", seed=2)
    (folder / "notes.txt").write_text("not for upload")
    (folder / ".hidden.gguf").write_bytes(b"GGUF")
    return folder


def test_roles_quant_and_names_from_the_gguf_metadata(outputs):
    plan = build_plan(outputs, repo_id="me/Tiny-GGUF")
    by_role = {a.role: a for a in plan.artifacts}
    assert set(by_role) == {Role.TRUNK, Role.SIDECAR}
    assert by_role[Role.TRUNK].paths == ["Tiny-Qwen3.5-0.1M-Q8_0.gguf"]
    assert by_role[Role.SIDECAR].paths == ["mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf"]
    assert all(a.quant == "Q8_0" for a in plan.artifacts)
    assert [f.path_in_repo for f in plan.files][-1] == "README.md"
    assert sorted(plan.ignored) == ["notes.txt"]  # hidden entries are skipped silently
    assert plan.base_model == "Qwen/Qwen3.5-0.8B"  # from general.base_model.0.repo_url
    assert plan.license == "apache-2.0"
    # the sizes in the plan are the files' sizes
    assert by_role[Role.TRUNK].files[0].size == (outputs / "model.gguf").stat().st_size


def test_embedded_mtp_is_detected_and_quant_falls_back_to_tensor_types(tmp_path):
    write_tiny_gguf(tmp_path / "e.gguf", "embedded", file_type=None, name="Emb", basename=None, size_label=None)
    write_tiny_gguf(tmp_path / "f.gguf", "trunk", file_type=None, name="Plain F32", basename=None, size_label=None)
    # rewrite f.gguf with only F32 tensors to check the other branch of the fallback
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    w = gguf.GGUFWriter(tmp_path / "g.gguf", "qwen35")
    w.add_name("Plain")
    w.add_tensor("blk.0.attn_norm.weight", reader.tensors[1].data.astype("float32"))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    del reader
    os.remove(tmp_path / "f.gguf")
    plan = build_plan(tmp_path, repo_id="me/x")
    names = {a.name: (a.role, a.quant) for a in plan.artifacts}
    assert names == {"Emb-Q8_0.gguf": (Role.EMBEDDED, "Q8_0"), "Plain-F32.gguf": (Role.TRUNK, "F32")}


def test_split_when_over_the_limit_loads_back_byte_identical(tmp_path):
    (tmp_path / "in").mkdir()
    src = write_tiny_gguf(tmp_path / "in" / "m.gguf", "embedded")
    limit = 40_000
    plan = build_plan(tmp_path / "in", repo_id="me/x", max_file_size=limit)
    (art,) = plan.artifacts
    n = len(art.files)
    assert n >= 3
    assert art.paths == [f"Tiny-Qwen3.5-0.1M-Q8_0/Tiny-Qwen3.5-0.1M-Q8_0-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    stage(plan)
    shard_files = [f.staged for f in art.files]
    sizes = [p.stat().st_size for p in shard_files]
    print("shard sizes", sizes, "limit", limit, "source", src.stat().st_size)
    assert sizes == [f.size for f in art.files]  # the plan's sizes are exact
    assert max(sizes) <= limit
    assert tensor_bytes(shard_files) == tensor_bytes([src])  # every tensor, type, shape and byte

    source_kv = gguf.GGUFReader(src).fields
    for i, path in enumerate(shard_files):
        fields = gguf.GGUFReader(path).fields
        assert fields["split.no"].contents() == i and fields["split.no"].types == [gguf.GGUFValueType.UINT16]
        assert fields["split.count"].contents() == n and fields["split.count"].types == [gguf.GGUFValueType.UINT16]
        assert fields["split.tensors.count"].contents() == len(tensor_bytes([src]))
        assert fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        own = {k for k in fields if not k.startswith("GGUF.") and not k.startswith("split.")}
        if i == 0:  # shard 1 carries every KV pair, with the same types and values
            assert own == {k for k in source_kv if not k.startswith("GGUF.")}
            for k in own:
                assert fields[k].types == source_kv[k].types, k
                assert fields[k].contents() == source_kv[k].contents(), k
        else:
            assert own == set(), f"shard {i + 1} must hold only split keys, has {own}"


def test_resplit_shards_keep_their_role_and_small_sidecars_stay_whole(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", "trunk", seed=3)
    write_tiny_gguf(tmp_path / "s.gguf", "sidecar", seed=4, hidden=32)
    trunk_size = (tmp_path / "t.gguf").stat().st_size
    side_size = (tmp_path / "s.gguf").stat().st_size
    assert side_size < trunk_size
    plan = build_plan(tmp_path, repo_id="me/x", max_file_size=(side_size + trunk_size) // 2)
    side = next(a for a in plan.artifacts if a.role is Role.SIDECAR)
    trunk = next(a for a in plan.artifacts if a.role is Role.TRUNK)
    assert len(side.files) == 1 and side.layout is None and side.files[0].source == tmp_path / "s.gguf"
    assert len(trunk.files) == 2 and all("/" in p for p in trunk.paths)
    stage(plan)
    from specconv.hub.gguf_info import read_model

    again = read_model([f.staged for f in trunk.files])
    assert again.role is Role.TRUNK and again.quant == "Q8_0"


def test_existing_shard_sets_are_uploaded_as_is_under_the_new_name(tmp_path):
    src = write_tiny_gguf(tmp_path / "x.gguf", "embedded")
    layout = plan_split([src], 60_000)
    outs = [tmp_path / "sub" / f"whatever-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)]
    write_split(layout, outs)
    src.unlink()
    plan = build_plan(tmp_path, repo_id="me/x")
    (art,) = plan.artifacts
    assert art.layout is None
    assert [f.source for f in art.files] == outs
    assert art.paths[0] == f"Tiny-Qwen3.5-0.1M-Q8_0/Tiny-Qwen3.5-0.1M-Q8_0-00001-of-{layout.count:05d}.gguf"
    assert art.role is Role.EMBEDDED  # blk.0.attn_norm.weight and nextn are looked up across shards

    outs[-1].unlink()
    with pytest.raises(SpecconvError, match="incomplete shard set"):
        build_plan(tmp_path, repo_id="me/x")


def test_unsafe_or_ambiguous_folders_are_refused(tmp_path):
    outside = tmp_path / "elsewhere.gguf"
    write_tiny_gguf(outside, "trunk")
    folder = tmp_path / "out"
    folder.mkdir()
    write_tiny_gguf(folder / "a.gguf", "trunk")
    (folder / "link.gguf").symlink_to(outside)
    with pytest.raises(SpecconvError, match="outside"):
        build_plan(folder, repo_id="me/x")
    (folder / "link.gguf").unlink()

    write_tiny_gguf(folder / "b.gguf", "trunk", seed=9)
    with pytest.raises(SpecconvError, match="both be uploaded as"):
        build_plan(folder, repo_id="me/x")
    (folder / "b.gguf").unlink()
    write_tiny_gguf(folder / "b.gguf", "embedded", seed=9)
    with pytest.raises(SpecconvError, match="separate repositories"):
        build_plan(folder, repo_id="me/x")
    # --name sets the model part of every file name
    (folder / "b.gguf").unlink()
    plan = build_plan(folder, repo_id="me/x", name="My Model v2")
    assert plan.artifacts[0].name == "My-Model-v2-Q8_0.gguf"

    with pytest.raises(SpecconvError, match="USER/NAME"):
        build_plan(folder, repo_id="just-a-name")
    with pytest.raises(SpecconvError, match="no .gguf"):
        build_plan(_empty(tmp_path), repo_id="me/x")
    (folder / "c.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(SpecconvError, match="not a readable GGUF"):
        build_plan(folder, repo_id="me/x")


def _empty(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    return empty


def test_card_front_matter_table_commands_and_verify_results(outputs):
    (outputs / "verify.json").write_text(json.dumps(REPORT))
    plan = build_plan(outputs, repo_id="me/Tiny-GGUF", report=outputs / "verify.json")
    text = plan.readme.content.decode()
    meta = front_matter(text)
    assert meta["base_model"] == "Qwen/Qwen3.5-0.8B"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "gguf"
    assert meta["license"] == "apache-2.0"
    assert meta["quantized_by"] == "specconv"
    assert {"gguf", "mtp", "speculative-decoding"} <= set(meta["tags"])

    rows = table_rows(text, "| File |")
    sizes = {a.name: a.size for a in plan.artifacts}
    assert [r[0] for r in rows] == ["`Tiny-Qwen3.5-0.1M-Q8_0.gguf`", "`mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf`"]
    assert [r[1] for r in rows] == ["Q8_0", "Q8_0"]
    assert [r[4] for r in rows] == ["trunk only", "MTP sidecar"]
    assert rows[0][2] == f"{sizes['Tiny-Qwen3.5-0.1M-Q8_0.gguf'] / 1000:.2f} kB"

    assert (
        "llama-server -m Tiny-Qwen3.5-0.1M-Q8_0.gguf -md mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf "
        "--spec-type draft-mtp --spec-draft-n-max 3" in text
    )
    assert "llama-server -hf me/Tiny-GGUF:Q8_0 --spec-type draft-mtp" in text

    assert "max |Δlogit| = 3.100e-05 against transformers 5.23.0" in text
    positions = table_rows(text, "| Position |")
    assert [(r[0], r[1]) for r in positions] == [("1", "0.850"), ("2", "0.620"), ("3", "0.450")]
    spec = dict((r[0], r[1]) for r in table_rows(text, "| Measure |"))
    assert spec["Speed-up"] == "1.740×"
    assert spec["Acceptance rate"] == "0.642"
    assert spec["Output identical to plain greedy decoding"] == "yes"
    checks = table_rows(text, "| Check |")
    assert checks[0][0] == "parity vs transformers" and checks[0][2] == "max \\|d\\| 3.1e-05 \\| 4 prompts"


def test_card_for_an_embedded_model_and_explicit_metadata(tmp_path):
    write_tiny_gguf(tmp_path / "e.gguf", "embedded", base_model_repo=None, license=None)
    plan = build_plan(tmp_path, repo_id="team/E", base_model="Org/Base-7B", license="mit", quantized_by="alice")
    text = plan.readme.content.decode()
    meta = front_matter(text)
    assert (meta["base_model"], meta["license"], meta["quantized_by"]) == ("Org/Base-7B", "mit", "alice")
    assert "llama-server -m Tiny-Qwen3.5-0.1M-Q8_0.gguf --spec-type draft-mtp --spec-draft-n-max 3" in text
    assert "-md " not in text
    assert "## Verification" not in text

    plan = build_plan(tmp_path, repo_id="team/E")
    assert "base_model" not in front_matter(plan.readme.content.decode())
    assert any("base model unknown" in w for w in plan.warnings)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("[1, 2]", "JSON object"),
        ("{not json", "not valid JSON"),
        ('{"passed": "yes"}', "passed"),
        ('{"parity": {"max_abs_logit_diff": "small"}}', "finite number"),
        ('{"speculative": {"per_position": [0.5, "x"]}}', "per_position"),
        ('{"checks": [{"name": "a"}]}', "checks"),
    ],
)
def test_bad_verify_reports_are_one_line_errors(tmp_path, bad, message):
    write_tiny_gguf(tmp_path / "e.gguf", "embedded")
    (tmp_path / "r.json").write_text(bad)
    with pytest.raises(SpecconvError, match=message) as info:
        build_plan(tmp_path, repo_id="me/x", report=tmp_path / "r.json")
    assert "\n" not in str(info.value)


def test_staging_is_reused_when_complete_and_redone_when_stale(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "embedded")
    plan = build_plan(tmp_path, repo_id="me/x", max_file_size=40_000)
    written = []
    stage(plan, on_artifact=written.append)
    stage(plan, on_artifact=written.append)
    assert len(written) == 1  # the second call found complete shards
    plan.artifacts[0].files[-1].staged.write_bytes(b"truncated")
    stage(plan, on_artifact=written.append)
    assert len(written) == 2
    assert plan.artifacts[0].files[-1].staged.stat().st_size == plan.artifacts[0].files[-1].size


def test_per_position_counts_become_rates(tmp_path):
    write_tiny_gguf(tmp_path / "e.gguf", "embedded")
    report = {"speculative": {"per_position": [{"drafted": 40, "accepted": 30}, {"drafted": 30, "accepted": 12}]}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    text = build_plan(tmp_path, repo_id="me/x", report=tmp_path / "r.json").readme.content.decode()
    rows = table_rows(text, "| Position |")
    assert rows == [["1", "0.750", "30 / 40"], ["2", "0.400", "12 / 30"]]


def test_draft_heads_of_other_kinds_are_named_and_documented(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", "trunk")
    write_tiny_gguf(tmp_path / "e3.gguf", "sidecar", arch="eagle3", seed=3)
    write_tiny_gguf(tmp_path / "ga.gguf", "sidecar", arch="gemma4-assistant", seed=4, name="Tiny Qwen3.5 assistant",
                    basename="Tiny-Qwen3.5-assistant")
    plan = build_plan(tmp_path, repo_id="me/x")
    names = {a.role: a.name for a in plan.artifacts}
    assert names[Role.EAGLE3] == "eagle3-Tiny-Qwen3.5-0.1M-Q8_0.gguf"
    assert names[Role.ASSISTANT] == "mtp-Tiny-Qwen3.5-0.1M-assistant-Q8_0.gguf"
    text = plan.readme.content.decode()
    assert "-md eagle3-Tiny-Qwen3.5-0.1M-Q8_0.gguf --spec-type draft-eagle3" in text
    # the assistant is never auto-detected: the card always passes --spec-type draft-mtp with it
    assert "-md mtp-Tiny-Qwen3.5-0.1M-assistant-Q8_0.gguf --spec-type draft-mtp" in text


def test_a_tensor_larger_than_the_limit_is_a_clear_error(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", "trunk")
    with pytest.raises(SpecconvError, match=r"tensor \S+ \(\d+ bytes\) does not fit"):
        build_plan(tmp_path, repo_id="me/x", max_file_size=5_000)


def test_shards_named_out_of_order_are_refused(tmp_path):
    src = write_tiny_gguf(tmp_path / "x.gguf", "trunk")
    layout = plan_split([src], 40_000)
    assert layout.count >= 2
    names = [tmp_path / f"m-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)]
    write_split(layout, names[::-1])  # shard 1's content under the last name, and so on
    src.unlink()
    with pytest.raises(SpecconvError, match="split.no does not match"):
        build_plan(tmp_path, repo_id="me/x")


def test_header_scan_agrees_with_gguf_reader(tmp_path):
    import time

    from specconv.hub.gguf_header import read_header

    paths = [
        write_tiny_gguf(tmp_path / "e.gguf", "embedded"),
        write_tiny_gguf(tmp_path / "s.gguf", "sidecar", seed=1),
    ]
    layout = plan_split([paths[0]], 40_000)
    shards = [tmp_path / f"x-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)]
    write_split(layout, shards)
    for path in paths + shards:
        header, reader = read_header(path), gguf.GGUFReader(path)
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(header.kv) == list(fields)
        for key, entry in header.kv.items():
            f = fields[key]
            assert entry.vtype == f.types[0], key
            assert entry.nbytes == sum(int(p.nbytes) for p in f.parts), key
            if f.types[0] != gguf.GGUFValueType.ARRAY:
                assert entry.value == f.contents(), key
        assert header.data_offset == reader.data_offset and header.alignment == reader.alignment
        assert [(t.name, t.dims, t.tensor_type, t.offset, t.n_bytes) for t in header.tensors] == [
            (t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors
        ]

    # a tokenizer of release size is skipped, not decoded
    big = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(big, "qwen35")
    w.add_token_list([f"token{i}" for i in range(150_000)])
    w.add_token_merges([f"a{i} b{i}" for i in range(150_000)])
    w.add_token_types([1] * 150_000)
    w.add_file_type(7)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    start = time.perf_counter()
    header = read_header(big)
    elapsed = time.perf_counter() - start
    print(f"header scan of a 150k-token tokenizer: {elapsed:.2f} s")
    assert header.kv["general.file_type"].value == 7 and [t.name for t in header.tensors] == ["output_norm.weight"]
    assert header.kv["tokenizer.ggml.tokens"].value is None


def test_sidecar_shards_written_by_specconv_mtp_extract(tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    if "mtp" not in cli_module.COMMANDS:
        pytest.skip("`specconv mtp` is not registered")
    emb = write_tiny_gguf(tmp_path / "emb.gguf", "embedded")
    out = tmp_path / "out"
    out.mkdir()
    args = ["mtp", "extract", str(emb), "-o", str(out / "mtp-x.gguf"), "--split-max-size", "30K"]
    result = CliRunner().invoke(cli_module.cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = build_plan(out, repo_id="me/x")
    (art,) = plan.artifacts
    assert art.role is Role.SIDECAR and art.layout is None
    assert art.paths == ["mtp-Tiny-Qwen3.5-0.1M-Q8_0-00001-of-00002.gguf", "mtp-Tiny-Qwen3.5-0.1M-Q8_0-00002-of-00002.gguf"]
    assert any("is split" in w for w in plan.warnings)
    assert "-md mtp-Tiny-Qwen3.5-0.1M-Q8_0-00001-of-00002.gguf --spec-type draft-mtp" in plan.readme.content.decode()
