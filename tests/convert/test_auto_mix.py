"""`convert --outtype auto:RECIPE | auto:SIZE` (convert/auto_mix.py, docs/convert.md "Auto mix").

On tiny random Qwen3.5 checkpoints whose matrices hold K-quant blocks (hidden 256; dense with an
importance matrix, and MoE), each with an MTP layer: the mix written for auto:q4_k_m is no larger than
the Q4_K_M file (the budget), and its mean KL divergence from the F32 file, measured by `specconv
compare` on held-out text, is below the Q4_K_M file's. The report's KLD figures are `compare`'s for the
written files on the calibration text (the mix's and the recipe's), its sizes add up to the file's,
its choice is the knapsack optimum of its own option table, and its lines are built from its JSON.
The MTP block's choice on the bundled (trained) model follows the acceptance rule, with acceptances
that `compare` measures on a file holding only that head quantized. The allocation equals a brute
force on random tables; bad specs are one-line errors.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specconv.cli import main as cli_main
from specconv.compare import CompareOptions, run_compare
from specconv.convert.auto_mix import AutoSpec, calibration_text, parse_auto
from specconv.convert.mix_alloc import Option, allocate, brute_force
from specconv.convert.mix_report import mix_lines
from specconv.errors import SpecconvError
from tests.fixtures.gguf_files import convert_gguf

CTX = 64
CHUNKS = 3
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
            moe_intermediate_size=256, shared_expert_intermediate_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [4, 2, 2], "mrope_interleaved": True})
HELDOUT = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"  # text the mix was not measured on


def _convert(src: Path, out: Path, outtype: str, *extra: str) -> dict:
    from specconv import cli as cli_module

    args = ["convert", str(src), "-o", str(out), "--outtype", outtype, "--json", *extra]
    result = CliRunner().invoke(cli_module.cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _imatrix(f32: Path, path: Path, seed: int) -> Path:
    """Random importance sums (over six decades) for every quantizable matrix of the file."""
    from gguf import GGUFReader

    from specconv.convert.imatrix import write_gguf
    from specconv.convert.quant_rules import quantizable

    rng = np.random.default_rng(seed)
    sums, counts = {}, {}
    for t in GGUFReader(str(f32)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if quantizable(t.name, shape):
            n_mat = shape[0] if len(shape) >= 3 else 1
            sums[t.name] = 10.0 ** rng.uniform(-3, 3, (n_mat, shape[-1]))
            counts[t.name] = np.full(n_mat, 7.0)
    write_gguf(path, sums, counts, ["random"], chunk_count=1)
    return path


@pytest.fixture(scope="module", params=["dense", "moe"])
def mixed(request, tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    moe = request.param == "moe"
    root = tmp_path_factory.mktemp(f"auto-mix-{request.param}")
    src = build_qwen35(root / "hf", moe=moe, seed=5 if moe else 4, text_over=WIDE)
    f32 = convert_gguf(src, root / "f32.gguf", outtype="f32")
    extra = [] if moe else ["--imatrix", str(_imatrix(f32, root / "imatrix.gguf", 1))]
    q4 = convert_gguf(src, root / "q4_k_m.gguf", outtype="q4_k_m", extra_args=extra)
    out = _convert(src, root / "auto.gguf", "auto:q4_k_m", "--ctx", str(CTX), "--chunks", str(CHUNKS), *extra)
    return {"src": src, "f32": f32, "q4_k_m": q4, "auto": root / "auto.gguf", "json": out, "rep": out["auto_mix"],
            "kind": request.param, "root": root}


def _kld(source: Path, quants: list[Path], text: Path, chunks: int | None) -> list[dict]:
    rep = run_compare(CompareOptions(source=source, quants=quants, text=text, ctx=CTX, chunks=chunks, heads=False,
                                     costs=False, device="cpu"))
    return rep["quants"]


def test_budget_is_the_recipe_files_size(mixed):
    rep = mixed["rep"]
    size, q4 = mixed["auto"].stat().st_size, mixed["q4_k_m"].stat().st_size
    print(f"{mixed['kind']}: auto {size} bytes, Q4_K_M {q4} bytes")
    assert rep["budget_bytes"] == q4 == rep["recipe_file_bytes"]
    assert size == rep["file_bytes"] <= q4


def test_report_klds_are_compares_figures_for_the_written_files(mixed):
    """The measured KLD of the mix and of the recipe (weights swapped in the loaded reference) equal
    `compare`'s figures for the written files over the same calibration chunks."""
    rep = mixed["rep"]
    mix, recipe = _kld(mixed["f32"], [mixed["auto"], mixed["q4_k_m"]], calibration_text(), CHUNKS)
    print(f"{mixed['kind']}: mix {rep['kld']['measured']:.6g} (compare {mix['kld']['mean']:.6g}), "
          f"Q4_K_M {rep['kld']['recipe_measured']:.6g} (compare {recipe['kld']['mean']:.6g})")
    assert mix["positions"] == recipe["positions"] == rep["calibration"]["scored_positions"]
    assert math.isclose(rep["kld"]["measured"], mix["kld"]["mean"], rel_tol=1e-9)
    assert math.isclose(rep["kld"]["recipe_measured"], recipe["kld"]["mean"], rel_tol=1e-9)
    assert math.isclose(rep["kld"]["same_top"], mix["same_top_p"]["value"], rel_tol=1e-12)


def test_mix_beats_the_recipe_at_its_size_on_held_out_text(mixed):
    if not HELDOUT.is_file():
        pytest.skip(f"{HELDOUT} is not on this interpreter")
    rep = mixed["rep"]
    assert not rep["kept_recipe"] and rep["kld"]["measured"] < rep["kld"]["recipe_measured"]
    mix, recipe = _kld(mixed["f32"], [mixed["auto"], mixed["q4_k_m"]], HELDOUT, 6)
    ratio = mix["kld"]["mean"] / recipe["kld"]["mean"]
    print(f"{mixed['kind']}: held-out mean KLD auto {mix['kld']['mean']:.4g} ± {mix['kld']['error']:.2g}, "
          f"Q4_K_M {recipe['kld']['mean']:.4g} ± {recipe['kld']['error']:.2g} (ratio {ratio:.3f}); same top "
          f"{mix['same_top_p']['value']:.3f} vs {recipe['same_top_p']['value']:.3f}")
    assert mix["kld"]["mean"] < recipe["kld"]["mean"]


def test_report_is_reproducible_from_its_json(mixed):
    from gguf import GGUFReader

    rep = mixed["rep"]
    groups, head = rep["groups"], rep["mtp"]
    for g in groups:  # the chosen row is the option table's
        row = next(o for o in g["options"] if o["option"] == g["chosen"])
        assert (row["bytes"], row["delta_kld"]) == (g["bytes"], g["delta_kld"])
    assert math.isclose(rep["kld"]["predicted"], sum(g["delta_kld"] for g in groups), rel_tol=1e-12)
    used = rep["fixed_bytes"] + sum(g["bytes"] for g in groups) + (head["bytes"] if head else 0)
    assert used == rep["file_bytes"]
    # the choice is the optimum of the table under what the budget leaves
    room = rep["budget_bytes"] - rep["fixed_bytes"] - (head["bytes"] if head else 0)
    table = [[Option(o["bytes"], o["delta_kld"]) for o in g["options"]] for g in groups]
    picks = brute_force(table, room)
    assert [g["options"][i]["option"] for g, i in zip(groups, picks)] == [g["chosen"] for g in groups]
    # the file holds the types the report names
    counts: dict[str, int] = {}
    for t in GGUFReader(str(mixed["auto"])).tensors:
        if t.tensor_type.name != "F32":
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    want: dict[str, int] = {}
    for g in groups + ([head] if head else []):
        for name, n in g["types"].items():
            want[name] = want.get(name, 0) + n
    assert counts == want
    rows, lines = mix_lines(rep)  # the printed figures come from the JSON
    assert [r[0] for r in rows] == [g["group"] for g in groups] + (["mtp"] if head else [])
    assert f"measured {rep['kld']['measured']:.4g}" in " ".join(lines)
    printed = _printed(rep, 80)
    assert all(len(line) <= 80 for line in printed.splitlines()), printed
    assert all(g["chosen"] in printed for g in groups)


def _printed(rep: dict, width: int) -> str:
    import io

    from rich.console import Console

    from specconv.convert.mix_report import print_mix

    out = io.StringIO()
    print_mix(Console(file=out, width=width, color_system=None), rep)
    return out.getvalue()


def test_size_budget_takes_the_largest_recipe_that_fits(mixed, tmp_path):
    """auto:SIZE just above the Q4_K_M file: Q4_K_M is the recipe, the plan fits the size."""
    if mixed["kind"] != "moe":
        pytest.skip("one model is enough")
    from specconv.archs.base import MtpMode
    from specconv.convert.auto_mix import recipe_and_budget, planned_bytes
    from specconv.convert.engine import ConvertRequest

    q4 = mixed["q4_k_m"].stat().st_size
    req = ConvertRequest(src=mixed["src"], out=str(tmp_path / "x.gguf"), mtp=MtpMode.EMBED)
    for budget, want in ((q4, "q4_k_m"), (q4 + 1, "q4_k_m"), (q4 - 1, "q4_k_s"), (1, "q2_k")):
        recipe, plan, got = recipe_and_budget(req, parse_auto(f"auto:{budget}B"))
        try:
            assert (recipe, got) == (want, budget)
            assert want == "q2_k" or planned_bytes(plan) <= budget
        finally:
            plan.close()
    out = _convert(mixed["src"], tmp_path / "s.gguf", f"auto:{q4 - 20000}B", "--ctx", str(CTX), "--chunks", "1",
                   "--dry-run")
    rep = out["auto_mix"]
    assert rep["recipe"] == "Q4_K_S" and rep["file_bytes"] <= q4 - 20000 and not out.get("written")
    assert not (tmp_path / "s.gguf").exists()


def test_separate_files_and_a_fixed_mtp_type(mixed, tmp_path):
    """--mtp separate --mtp-outtype q8_0: the budget is both Q4_K_M files together (the embedding and output
    counted in each), the MTP block is the Q8_0 one (not measured), and the two files fit it."""
    if mixed["kind"] != "moe":
        pytest.skip("one model is enough")
    from gguf import GGUFReader

    opts = ("--mtp", "separate", "--mtp-outtype", "q8_0")
    (tmp_path / "plain").mkdir()
    convert_gguf(mixed["src"], tmp_path / "plain" / "m.gguf", outtype="q4_k_m", mtp="separate",
                 extra_args=["--mtp-outtype", "q8_0"])
    budget = sum(f.stat().st_size for f in (tmp_path / "plain").iterdir())
    rep = _convert(mixed["src"], tmp_path / "m.gguf", "auto:q4_k_m", "--ctx", str(CTX), "--chunks", "1",
                   *opts)["auto_mix"]
    files = [tmp_path / "m.gguf", tmp_path / "mtp-m.gguf"]
    size = sum(f.stat().st_size for f in files)
    print(f"separate: {size} of {budget} bytes; {[(g['group'], g['chosen']) for g in rep['groups']]}")
    assert rep["budget_bytes"] == budget and rep["mtp"] is None and size == rep["file_bytes"] <= budget
    assert rep["fixed_bytes"] + sum(g["bytes"] for g in rep["groups"]) == size
    trunk, head = ({t.name: t.tensor_type.name for t in GGUFReader(str(f)).tensors} for f in files)
    assert {n: t for n, t in head.items() if n.startswith("blk.") and t != "F32"} and \
        all(t in ("F32", "Q8_0") for n, t in head.items() if n.startswith("blk."))
    assert all(trunk[n] == head[n] for n in ("token_embd.weight", "output.weight"))


# ------------------------------------------------------------------------------------------ the MTP block


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    from specconv.demo.bundled import bundled_model_dir

    root = tmp_path_factory.mktemp("auto-mix-bundled")
    src = bundled_model_dir()
    f32 = convert_gguf(src, root / "f32.gguf", outtype="f32")
    out = _convert(src, root / "auto.gguf", "auto:q4_k_m", "--ctx", "128", "--chunks", "3")
    return {"src": src, "f32": f32, "rep": out["auto_mix"], "root": root}


def test_mtp_block_follows_the_acceptance_rule(bundled):
    from specconv.convert.auto_mix import MTP_TOLERANCE

    rep = bundled["rep"]
    head = rep["mtp"]
    ref = head["reference_per_position"][0]
    print(f"bundled: mean KLD mix {rep['kld']['measured']:.4g} (predicted {rep['kld']['predicted']:.4g}), Q4_K_M "
          f"{rep['kld']['recipe_measured']:.4g}; {rep['file_bytes']} of {rep['budget_bytes']} bytes")
    assert not rep["kept_recipe"] and rep["file_bytes"] <= rep["budget_bytes"]
    print("reference head at position 1:", ref, "; options:",
          [(o["option"], o["bytes"], o["per_position"][0]) for o in head["options"]], "-> chosen", head["chosen"])
    assert ref > 0.3  # a trained head: the rule is tested on acceptances that mean something
    by_size = sorted(head["options"], key=lambda o: o["bytes"])
    good = [o for o in by_size if ref - o["per_position"][0] <= MTP_TOLERANCE]
    assert good and head["chosen"] == good[0]["option"] and head["per_position"] == good[0]["per_position"]
    assert any(ref - o["per_position"][0] > MTP_TOLERANCE for o in by_size[:by_size.index(good[0])]) or \
        good[0] is by_size[0]


def test_mtp_acceptances_are_compares_on_a_file_with_that_head(bundled, tmp_path):
    """A file whose trunk is the F32 reference and whose MTP block has the chosen types: `compare`
    gives its own head the report's acceptance by position, and the source head the reference's."""
    from gguf import GGMLQuantizationType

    from specconv.convert.engine import ConvertRequest, plan_conversion, run_conversion
    from specconv.convert.mix_groups import group_options, tensor_groups

    rep = bundled["rep"]
    head = rep["mtp"]
    plan = plan_conversion(ConvertRequest(src=bundled["src"], out=str(tmp_path / "p.gguf"), outtype="q4_k_m"))
    try:
        groups = tensor_groups(plan)
        recipe_types = {t.name: t.ggml_type for t in plan.tensors}
    finally:
        plan.close()
    options = group_options(groups["mtp"], "Q4_K_M", recipe_types)
    chosen = next(o for o in options if o.label == head["chosen"]).assignment
    trunk_f32 = {t.name: GGMLQuantizationType.F32 for name, ts in groups.items() if name != "mtp" for t in ts}
    req = ConvertRequest(src=bundled["src"], out=str(tmp_path / "head.gguf"), outtype="q4_k_m",
                         type_overrides=trunk_f32 | chosen)
    plan = plan_conversion(req)
    try:
        run_conversion(plan)
    finally:
        plan.close()
    out = run_compare(CompareOptions(source=bundled["f32"], quants=[tmp_path / "head.gguf"], text=calibration_text(),
                                     ctx=128, chunks=3, draft_max=3, mtp_stride=head["stride"], costs=False,
                                     device="cpu"))
    q = out["quants"][0]
    print("compare: source head", out["source"]["mtp"]["per_position"], "; this head",
          q["mtp"]["own_head"]["per_position"], "; KLD of the F32 trunk", q["kld"]["mean"])
    assert q["kld"]["mean"] < 1e-6  # the trunk is the reference's
    assert out["source"]["mtp"]["per_position"] == head["reference_per_position"]
    assert q["mtp"]["own_head"]["per_position"] == head["per_position"]


# ------------------------------------------------------------------------------------------ the allocation


def test_allocation_equals_brute_force_on_random_tables():
    rng = np.random.default_rng(20)
    checked = infeasible = 0
    for _ in range(300):
        n_groups = int(rng.integers(1, 6))
        table = []
        for _ in range(n_groups):
            n = int(rng.integers(1, 6))
            sizes = np.sort(rng.integers(1, 50, n))
            costs = np.sort(rng.exponential(1.0, n))[::-1]  # mostly: more bytes, less divergence
            if rng.random() < 0.3:
                rng.shuffle(costs)  # and tables where it is not so
            if rng.random() < 0.2:
                costs = np.round(costs, 1)  # ties
            table.append([Option(int(b), float(c)) for b, c in zip(sizes, costs)])
        budget = int(rng.integers(0, 50 * n_groups))
        want, got = brute_force(table, budget), allocate(table, budget)
        assert got == want, (table, budget)
        checked += 1
        infeasible += want is None
    print(f"{checked} tables, {infeasible} without a fitting mix")
    assert 0 < infeasible < checked


def test_allocation_spends_bytes_where_they_buy_the_most():
    """Two groups, one sensitive: the budget goes to it."""
    cheap = [Option(10, 1.0), Option(20, 0.9)]
    sensitive = [Option(10, 5.0), Option(20, 0.5)]
    assert allocate([cheap, sensitive], 30) == (0, 1)
    assert allocate([cheap, sensitive], 40) == (1, 1)
    assert allocate([cheap, sensitive], 19) is None


# ------------------------------------------------------------------------------------------ bad specs


@pytest.mark.parametrize("spec", ["auto:", "auto:foo", "auto:-1GB", "auto:0GB", "auto:5.2XB", "auto:q4_k_m,q8_0"])
def test_bad_specs_are_one_line_errors(capsys, tmp_path, spec):
    with pytest.raises(SystemExit) as exc:
        cli_main(["convert", str(tmp_path), "-o", str(tmp_path / "x.gguf"), "--outtype", spec])
    err = capsys.readouterr().err.strip().splitlines()
    print(f"{spec}: {err}")
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: --outtype ")


def test_calibration_options_need_an_auto_outtype(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli_main(["convert", str(tmp_path), "-o", str(tmp_path / "x.gguf"), "--outtype", "q4_k_m", "--ctx", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "auto:" in err[0]


def test_specs_parse():
    assert parse_auto("auto:Q4_K_M") == AutoSpec("auto:Q4_K_M", recipe="q4_k_m")
    assert parse_auto("auto:5.2GB").budget == 5_200_000_000
    assert parse_auto("auto:800M").budget == 800_000_000
    assert parse_auto("auto:2GiB").budget == 2 * 1024 ** 3
    assert parse_auto("auto:123456").budget == 123456
    with pytest.raises(SpecconvError):
        parse_auto("auto:q8_0")
