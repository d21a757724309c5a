"""SPECCONV_ECHO_OUTPUT (tests/fixtures/pytest_plugin.py): what a test prints reaches the terminal of a
pytest-xdist run, whose workers' `-s` output is lost; without it a captured print stays hidden."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEASURED = "max |Δlogit| 1.25e-03 (echo check)"


def run_pytest(tmp_path: Path, echo: bool) -> str:
    (tmp_path / "test_prints.py").write_text(f"def test_prints():\n    print({MEASURED!r})\n", encoding="utf-8")
    # not this run's pytest-xdist variables: the inner run would take itself for a worker
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "SPECCONV_ECHO_OUTPUT"}
    env.update(PYTHONPATH=str(REPO), SPECCONV_TRITON_GUARD="0")
    if echo:
        env["SPECCONV_ECHO_OUTPUT"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "tests.fixtures.pytest_plugin",
                        "-p", "no:cacheprovider", "-o", "addopts=", "test_prints.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_a_workers_print_reaches_the_terminal(tmp_path):
    assert MEASURED in run_pytest(tmp_path, echo=True)


def test_a_captured_print_stays_hidden_unasked(tmp_path):
    assert MEASURED not in run_pytest(tmp_path, echo=False)
