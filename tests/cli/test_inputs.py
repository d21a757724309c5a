"""Every numeric option of every command is checked before anything is loaded (a usage error naming the
option, exit 2), and Ctrl-C at any time ends with `Aborted.` and exit 130, without a traceback.

The option checks run on a file that is not a model: a refused value must stop the command before it
reads its input. The SIGINT cases run the real entry point in a child process and deliver the signal
from inside it at a chosen moment: while the command's modules are being imported (start-up), and
in the middle of a run (while the model loads)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specconv.cli import main as cli_main
from tests.fixtures.paths import ROOT

NOT_A_MODEL = Path(__file__)  # exists; never read when an option is refused

BAD = [
    ("generate", "--temperature", "-1"), ("generate", "--temperature", "nan"), ("generate", "--temperature", "inf"),
    ("generate", "-n", "-1"), ("generate", "--seed", "-1"), ("generate", "--acceptance", "1.5"),
    ("generate", "--acceptance", "nan"), ("generate", "--p-min", "-0.1"), ("generate", "--draft-max", "-1"),
    ("generate", "--draft-max", "65"), ("generate", "--draft-max", "many"), ("generate", "--draft-min", "-2"),
    ("generate", "--repeats", "0"),
    ("verify", "--temperature", "-0.5"), ("verify", "--temperature", "nan"), ("verify", "-n", "0"),
    ("verify", "--draft-max", "0"), ("verify", "--draft-max", "65"), ("verify", "--seed", "-3"),
    ("verify", "--repeats", "1"), ("verify", "-n", "-4"),
    ("demo", "-n", "0"), ("demo", "--draft-max", "0"), ("demo", "--prompts", "0"), ("demo", "--repeats", "0"),
    ("demo", "--threads", "0"), ("demo", "--threads", "5000"), ("demo", "-n", "4001"), ("demo", "--draft-max", "65"),
    ("convert", "--threads", "-1"), ("quantize", "--threads", "-1"),
    ("upload", "--retries", "0"), ("upload", "--retry-delay", "-1"), ("upload", "--retry-delay", "nan"),
]


def args_for(command: str, option: str, value: str) -> list[str]:
    model = str(NOT_A_MODEL)
    return {"generate": ["generate", model, "-p", "x"], "verify": ["verify", model], "demo": ["demo"],
            "convert": ["convert", str(ROOT), "-o", "x.gguf"], "quantize": ["quantize", model, "x.gguf", "Q4_K_M"],
            "upload": ["upload", str(ROOT / "docs"), "--repo", "me/x", "--dry-run"]}[command] + [option, value]


@pytest.mark.parametrize("command,option,value", BAD, ids=[" ".join(b) for b in BAD])
def test_numeric_options_are_checked_first(capsys, command, option, value):
    with pytest.raises(SystemExit) as exc:
        cli_main(args_for(command, option, value))
    err = capsys.readouterr().err
    print(f"{command} {option} {value}: exit {exc.value.code}: {err.strip().splitlines()[-1]}")
    assert exc.value.code == 2 and f"Invalid value for '{option}'" in err and "Traceback" not in err


def test_draft_min_above_draft_max(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", str(NOT_A_MODEL), "-p", "x", "--spec", "ngram", "--draft-max", "2", "--draft-min", "3"])
    assert exc.value.code == 2 and "--draft-min 3 is above --draft-max 2" in capsys.readouterr().err


def test_prompt_and_n_beyond_the_context_length(capsys):
    from tests.fixtures import speculative_models

    model = speculative_models.gguf("embedded")
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", str(model), "--tokens", "5,17", "-n", "100000000", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "exceed the model's context length" in err, err


# --- Ctrl-C -----------------------------------------------------------------------------------------

# The child runs specconv's entry point as the console script does, with SIGINT sent to itself at one
# moment: STARTUP while the click group is imported, RUN when the model starts loading.
CHILD = """
import os, signal, sys, importlib.abc
when = sys.argv.pop(1)
def interrupt():
    os.kill(os.getpid(), signal.SIGINT)
if when == "startup":
    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "specconv.commands.app":
                interrupt()
            return None
    sys.meta_path.insert(0, Hook())
else:
    import specconv.runtime.model as model_module
    real = model_module.Model.__init__
    def loading(self, *a, **k):
        interrupt()
        return real(self, *a, **k)
    model_module.Model.__init__ = loading
from specconv.cli import main

sys.exit(main())
"""


@pytest.mark.parametrize("when", ["startup", "run"])
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_ctrl_c_at_any_time(when, command):
    from tests.fixtures import speculative_models

    model = speculative_models.gguf("embedded")
    argv = [command, str(model), "--device", "cpu"] + (["-p", "def f(x):", "-n", "8"] if command == "generate" else [])
    proc = subprocess.run([sys.executable, "-c", CHILD, when, *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    print(f"{command}, SIGINT at {when}: exit {proc.returncode}, stderr {proc.stderr.strip()!r}")
    assert proc.returncode == 130 and proc.stderr.strip().splitlines()[-1] == "Aborted."
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr


def test_ctrl_c_in_process_restores_the_callers_handler(capsys, monkeypatch):
    """main(argv) called in-process (tests, scripts) gives back the SIGINT handler it found."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit):
        cli_main(["inspect", str(NOT_A_MODEL)])
    assert signal.getsignal(signal.SIGINT) is before
