"""`specconv verify`'s output: the report on stdout (a table, or JSON with the --json switch), progress
on stderr, `--report FILE` written atomically with mode 0644, every figure of the text report
reproducible from the JSON report, the default work and --thorough, and the bundled model verified
in seconds.

Evidence:
* stdout holds the report and nothing else; stderr the stage bars (no check, no table);
* `--json` prints the same report as `--report` writes (file mode 0644 under umask 022, no
  temporary left);
* every number of the lines under the table is recomputed here from the JSON alone with the
  formulas of docs/verify.md (acceptance rate, AL, bound E(alpha, K), medians of the timed repeats,
  speed-up, its range and verdict, cost ratios and the predicted speed-up), and every check's name,
  detail and work appear in the table;
* the default round trips are K with both rollbacks on every prompt and k < K on the first prompt
  (the n-gram drafter beside the MTP head: K with snapshot rollback on every prompt), 12 tokens;
  --thorough runs every k on every prompt, 32 tokens, and llama.cpp's cost ratios;
* the bundled model with --hf verifies in at most 10 s of CPU time on the development VM (what its
  wall time is on an idle machine: the run is single-threaded by --threads 0's rule), held as a
  ratio to the bare imports of torch and the transformers reference measured in the same run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys

import pytest

from specconv.cli import main as cli_main
from specconv.verify.run import QUICK_N, THOROUGH_N
from tests.fixtures import speculative_models
from tests.fixtures.paths import ROOT

FAST = ["-n", "6", "--draft-max", "2", "--device", "cpu"]


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(scope="module")
def text_and_report(tmp_path_factory):
    """The text report of a trunk + sidecar run (stdout, stderr) and its --report file."""
    folder = tmp_path_factory.mktemp("report")
    report = folder / "r.json"
    args = ["verify", speculative_models.gguf("trunk"), "--mtp", speculative_models.gguf("sidecar"), *FAST,
            "--report", report]
    old = os.umask(0o022)
    try:
        proc = subprocess.run([sys.executable, "-m", "specconv", *map(str, args)], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    finally:
        os.umask(old)
    return proc, report, folder


def test_report_on_stdout_progress_on_stderr(text_and_report):
    proc, report, folder = text_and_report
    print(proc.stdout, "\n--- stderr ---\n", proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "specconv verify" in proc.stdout and "PASSED" in proc.stdout and "greedy exact: mtp" in proc.stdout
    for stage in ("loading and checking the files", "timing plain and speculative decoding", "greedy round trips",
                  "cost ratios"):
        assert stage in proc.stderr
    assert "greedy exact" not in proc.stderr and "PASSED" not in proc.stderr
    assert (report.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in folder.iterdir()) == ["r.json"]  # no temporary left


def test_json_switch_prints_the_report(text_and_report, capsys, tmp_path):
    _, report, _ = text_and_report
    code, out, err = run(capsys, "verify", speculative_models.gguf("trunk"), "--mtp", speculative_models.gguf("sidecar"),
                         *FAST, "--json", "--report", tmp_path / "again.json")
    printed = json.loads(out)  # stdout is the JSON report alone
    written = json.loads((tmp_path / "again.json").read_text())
    assert code == 0 and printed == written
    first = json.loads(report.read_text())
    assert [c["name"] for c in printed["checks"]] == [c["name"] for c in first["checks"]]
    assert not (tmp_path / "-").exists()


def _numbers(text: str) -> list[str]:
    return re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]\d+)?", text)


def test_every_figure_reproducible_from_the_json(text_and_report):
    proc, report, _ = text_and_report
    data = json.loads(report.read_text())
    s, t = data["speculative"], data["speculative"]["timing"]
    words = set(re.split(r"[\s│┃┏┓┗┛┡┩━─┳┻╇╈┼┤├┬┴└┘┌┐╭╮╰╯]+", proc.stdout))
    for c in data["checks"]:  # each cell's words (a cell wraps over lines)
        for part in (c["name"], c["detail"], c["work"]):
            assert set(part.split()) <= words, part
    # recomputed from the JSON with docs/verify.md's formulas, independently of the code that printed them
    k = s["draft_max"]
    alpha = s["alpha"]
    bound = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha is not None and alpha < 1 else k + 1
    median_plain, median_spec = statistics.median(t["plain_seconds"]), statistics.median(t["spec_seconds"])
    low, high = min(t["plain_seconds"]) / max(t["spec_seconds"]), max(t["plain_seconds"]) / min(t["spec_seconds"])
    verdict = "gain" if low > 1 else "slower" if high < 1 else "none"
    assert t["verdict"] == (verdict if s["drafted"] else "none")
    expected = {f"{x:.3f}" for x in (s["accepted"] / s["drafted"], 1 + s["accepted"] / s["drafts"], bound,
                                     s["tokens_per_target_forward"], median_plain, median_spec)}
    expected |= {f"{x:.2f}" for x in [*s["per_position"], median_plain / median_spec, low, high]}
    expected |= {str(x) for x in (s["accepted"], s["drafted"], k, t["repeats"], t["prompts"], t["n_predict"])}
    for runner, c in s["costs"].items():
        if not isinstance(c, dict):
            continue
        ratios = [x / c["target_seconds"][0] for x in c["target_seconds"]]
        expected |= {f"{r:.2f}" for r in ratios} | {f"{c['c']:.3f}", f"{c['c_round']:.3f}", str(c["threads"]),
                                                     str(len(ratios))}
        by_k = {kk: ((1 - alpha ** (kk + 1)) / (1 - alpha)) / (ratios[kk] + kk * c["c"] + c["c_round"])
                for kk in range(1, min(k, len(ratios) - 1) + 1)}
        best = max(by_k, key=by_k.get)
        expected |= {f"{by_k[best]:.2f}", str(best)}
    summary = proc.stdout[proc.stdout.index("speculative ("):proc.stdout.index("PASSED")]
    print(summary)
    assert {"gain": "speed-up ", "slower": "slower than plain", "none": "no measurable gain"}[t["verdict"]] in summary
    unexplained = [x for x in _numbers(summary) if x not in expected]
    assert not unexplained, f"figures not found from the JSON: {unexplained}"


def test_default_work_and_thorough(capsys, tmp_path):
    model = speculative_models.gguf("embedded")
    code, out, _ = run(capsys, "verify", model, "--device", "cpu", "--json")
    quick = json.loads(out)
    checks = {c["name"]: c for c in quick["checks"]}
    print({n: c["work"] for n, c in checks.items()})
    assert code == 0 and quick["settings"]["n_predict"] == QUICK_N == 12 and quick["settings"]["thorough"] is False
    assert checks["greedy exact: mtp"]["work"] == "3 prompts x 12 tokens, 8 runs"  # K=3: 2 x 3 at K, k=1,2 once
    assert checks["greedy exact: ngram"]["work"] == "3 prompts x 12 tokens, 3 runs"  # beside the MTP head: K, snapshot
    assert checks["greedy exact: ngram"]["detail"].endswith("draft_max 3 (snapshot rollback) on every prompt")
    assert "llama.cpp" not in quick["speculative"]["costs"]
    capsys.readouterr()
    with contextlib.suppress(SystemExit):
        cli_main(["verify", "--help"])
    assert f"(default {QUICK_N}; {THOROUGH_N} with --thorough)" in " ".join(capsys.readouterr().out.split())
    code, out, _ = run(capsys, "verify", model, "--device", "cpu", "--json", "--thorough", "-n", "4", "--draft-max", "2")
    full = json.loads(out)
    checks = {c["name"]: c for c in full["checks"]}
    assert code == 0 and full["settings"]["thorough"] is True
    assert checks["greedy exact: ngram"]["work"] == "3 prompts x 4 tokens, 9 runs"  # 3 x (k=1, k=2 x 2 rollbacks)
    assert "every prompt" in checks["greedy exact: ngram"]["detail"].rsplit(",", 1)[-1]
    assert "llama.cpp" in full["speculative"]["costs"]
    code, out, _ = run(capsys, "verify", model, "--device", "cpu", "--json", "--thorough", "--draft-max", "1")
    assert json.loads(out)["settings"]["n_predict"] == 32


# The goal: the bundled model verifies with --hf in at most 10 s of CPU time on the 2-core development
# VM (docs/verify.md, "How much work"), where the bare imports below took 4.6-5.5 s over the session
# that set this ratio (torch 2.13, transformers 5.23; the VM's speed drifts by about 10 %): 5.3 s, the
# slower reading, so the stricter ratio. Held as a ratio to those imports measured in the same run
# (each side the best of three runs: interference from other processes only adds), so that the goal
# means the same on a faster or slower machine, or one busy with other tests.
VERIFY_GOAL_RATIO = 10.0 / 5.3


def _child_cpu(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """CPU seconds (user + system) of one child process, and its result."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


@pytest.mark.skipif(not (ROOT / "specconv" / "data" / "tiny-qwen35-mtp").exists(), reason="bundled model absent")
def test_bundled_model_verifies_in_seconds(tmp_path):
    from tests.fixtures.gguf_files import convert_gguf

    src = ROOT / "specconv" / "data" / "tiny-qwen35-mtp"
    model = convert_gguf(src, tmp_path / "tiny.gguf", outtype="f32", mtp="embed")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    # what any comparison with transformers pays before it computes anything: the interpreter, torch
    # and the reference's class
    cls = json.loads((src / "config.json").read_text())["architectures"][0]
    imports = [sys.executable, "-c", f"import torch, transformers; transformers.{cls}"]
    verify = [sys.executable, "-m", "specconv", "verify", str(model), "--hf", str(src), "--json", "--device", "cpu"]
    baseline = min(_child_cpu(imports, env)[0] for _ in range(3))  # best of three: interference only adds
    runs = [_child_cpu(verify, env) for _ in range(3)]
    for _, proc in runs:
        assert proc.returncode == 0 and json.loads(proc.stdout)["passed"], proc.stderr
    cpu = min(c for c, _ in runs)
    report = json.loads(runs[0][1].stdout)
    print(f"bundled model, verify --hf: {cpu:.1f} s of CPU (best of three), the bare imports {baseline:.1f} s: "
          f"{cpu / baseline:.2f}x (goal ≤ {VERIFY_GOAL_RATIO:.2f}x, load {os.getloadavg()[0]:.1f}); "
          f"threads {report['settings']['threads']}; parity {report['parity']['max_abs_logit_diff']:.2e}; "
          f"{report['speculative']['timing']['verdict']}")
    assert report["settings"]["threads"] == 1
    assert cpu <= VERIFY_GOAL_RATIO * baseline
