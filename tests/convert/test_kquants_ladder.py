"""`--outtype q8_0,q6_k,q4_k_m`: one run writes one file per type (the ladder a publisher uploads).

The K-quant files must be the single runs' files byte for byte (and so llama.cpp's quantize output:
tests/convert/test_kquants_files.py); the q8_0 file the single run's tensors and KV (in the quantize
tool's tensor order, which every file of a ladder with a K-quant shares). Each checkpoint tensor is
viewed once per distinct output type it gets (an F32 norm once for all files), and an interrupted
ladder leaves no file at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.kquant_files import write_qwen35


pytestmark = pytest.mark.slow
LADDER = ["q8_0", "q6_k", "q4_k_m"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_qwen35(tmp_path_factory.mktemp("ladder") / "moe", moe=True, n_layers=4)


def _tensors(path: Path) -> dict:
    return {t.name: (t.tensor_type, t.data.tobytes()) for t in GGUFReader(path).tensors}


def _kv(path: Path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("mtp", ["embed", "separate"])
def test_ladder_files_equal_single_runs(src, tmp_path, mtp):
    convert_gguf(src, tmp_path / "ladder" / "model.gguf", outtype=",".join(t.upper() for t in LADDER), mtp=mtp)
    prefixes = ["", "mtp-"] if mtp == "separate" else [""]
    for t in LADDER:
        single = tmp_path / t
        convert_gguf(src, single / "model.gguf", outtype=t, mtp=mtp)
        for pre in prefixes:
            ours = tmp_path / "ladder" / f"{pre}model-{t.upper()}.gguf"
            theirs = single / f"{pre}model.gguf"
            if t.startswith("q") and "_k" in t:
                assert ours.read_bytes() == theirs.read_bytes(), ours.name
            else:
                assert _tensors(ours) == _tensors(theirs) and _kv(ours) == _kv(theirs), ours.name
    assert sorted(p.name for p in (tmp_path / "ladder").iterdir()) == sorted(
        f"{pre}model-{t.upper()}.gguf" for t in LADDER for pre in prefixes)


def test_each_source_is_viewed_once_per_distinct_type(src, tmp_path):
    from specconv.archs.base import MtpMode
    from specconv.convert.engine import ConvertRequest, plan_conversion, run_conversion

    plan = plan_conversion(ConvertRequest(src, str(tmp_path / "m.gguf"), ",".join(LADDER), MtpMode.EMBED))
    try:
        run_conversion(plan)
        viewed, reads = dict(plan.reader.viewed), dict(plan.reader.reads)
        types = {}
        for p in plan.plans:
            for t in p.tensors:
                for s in t.plan.sources:
                    types.setdefault((s, t.name), set()).add(t.ggml_type)
    finally:
        plan.close()
    expected: dict[str, int] = {}
    for (source, _), kinds in types.items():
        expected[source] = expected.get(source, 0) + len(kinds)
    for source, n in expected.items():
        name = plan.raw_of[source]
        # viewed in place once per distinct type, or (value-changing transforms) copied once and reused
        assert (viewed.get(name, 0), reads.get(name, 0)) in ((n, 0), (0, 1)), (source, n, viewed.get(name), reads.get(name))
    norm = next(s for s in expected if s.endswith("input_layernorm.weight"))
    assert expected[norm] == 1  # F32 in all three files: encoded once


def test_interrupted_ladder_leaves_no_file(src, tmp_path):
    from specconv.archs.base import MtpMode
    from specconv.convert.engine import ConvertRequest, plan_conversion, run_conversion

    out = tmp_path / "out"
    plan = plan_conversion(ConvertRequest(src, str(out / "m.gguf"), ",".join(LADDER), MtpMode.SEPARATE))
    seen = []

    def stop(name: str, n: int) -> None:
        seen.append(name)
        if len(seen) > 40:
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            run_conversion(plan, on_tensor=stop, threads=2)
    finally:
        plan.close()
    assert not out.exists() or not any(out.iterdir())


def test_dry_run_lists_every_file(src, tmp_path):
    import json

    from click.testing import CliRunner

    from specconv import cli as cli_module

    result = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path) + "/", "--outtype",
                                                 "q8_0,Q4_K_M", "--mtp", "separate", "--dry-run", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    names = sorted(Path(f["path"]).name for f in plan["files"])
    assert len(names) == 4 and sum(n.endswith("-Q8_0.gguf") for n in names) == 2
    assert sum(n.endswith("-Q4_K_M.gguf") for n in names) == 2 and plan["outtype"] == "Q8_0,Q4_K_M"
    bad = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path / "x.gguf"), "--outtype",
                                              "q8_0,q9_k"])
    assert bad.exit_code != 0 and "q9_k" in bad.output
    imatrix = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path / "x.gguf"), "--outtype",
                                                  "Q2_K_S"])
    assert imatrix.exit_code != 0 and "importance matrix" in imatrix.output
