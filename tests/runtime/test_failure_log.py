"""SPECCONV_FAILURE_LOG (tests/fixtures/pytest_plugin.py): a failing test's id and traceback are
appended to the file as the report comes in, passing ones are not, and nothing is written without it
or in an xdist worker (its controller writes)."""

from types import SimpleNamespace

from tests.fixtures import pytest_plugin


def report(failed: bool, nodeid: str):
    return SimpleNamespace(failed=failed, nodeid=nodeid, when="call", longreprtext=f"trace of {nodeid}")


def test_failures_are_appended_as_reported(tmp_path, monkeypatch):
    log = tmp_path / "failures.log"
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("SPECCONV_ECHO_OUTPUT", raising=False)
    monkeypatch.setenv("SPECCONV_FAILURE_LOG", str(log))
    pytest_plugin.pytest_runtest_logreport(report(True, "a.py::first"))
    pytest_plugin.pytest_runtest_logreport(report(False, "a.py::passes"))
    pytest_plugin.pytest_runtest_logreport(report(True, "a.py::second"))
    text = log.read_text()
    assert text.index("=== a.py::first (call)\ntrace of a.py::first") < text.index("=== a.py::second (call)")
    assert "passes" not in text


def test_nothing_is_written_unasked_or_by_a_worker(tmp_path, monkeypatch):
    log = tmp_path / "failures.log"
    monkeypatch.delenv("SPECCONV_FAILURE_LOG", raising=False)
    monkeypatch.delenv("SPECCONV_ECHO_OUTPUT", raising=False)
    pytest_plugin.pytest_runtest_logreport(report(True, "a.py::first"))
    monkeypatch.setenv("SPECCONV_FAILURE_LOG", str(log))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytest_plugin.pytest_runtest_logreport(report(True, "a.py::first"))
    assert not log.exists()
