"""A *trained* MTP head grafted onto a q8_0 trunk keeps drafting as well as in the original file.

Random tiny heads accept nothing, so they cannot show that a grafted head still works as a drafter.
This test uses the bundled trained model (specconv/data/tiny-qwen35-mtp) when it is present, else a
model trained here by `tools/train_tiny.py --quick`. The checkpoint is converted by `specconv convert`
into an f32 embedded file, a q8_0 trunk-only file and an f32 sidecar; the sidecar is grafted onto the
q8_0 trunk and `specconv verify` measures greedy MTP speculation on both files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specconv.cli import main as cli_main
import specconv
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.slow

BUNDLED = Path(specconv.__file__).resolve().parent / "data" / "tiny-qwen35-mtp"


def trained_checkpoint(tmp: Path) -> Path:
    if (BUNDLED / "config.json").is_file():
        return BUNDLED
    out = tmp / "quick"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--quick", "--no-docs",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return out


def cli(*args) -> int:
    with pytest.raises(SystemExit) as exc:
        cli_main([*map(str, args)])
        raise SystemExit(0)
    return exc.value.code


def verify(path: Path, report: Path) -> dict:
    code = cli("verify", path, "-n", "24", "--draft-max", "3", "--device", "cpu", "--report", report)
    data = json.loads(report.read_text())
    assert code == 0 and data["passed"], [c for c in data["checks"] if not c["passed"]]
    return data["speculative"]


def test_trained_head_grafted_onto_q8_0_trunk_keeps_its_acceptance(tmp_path):
    from tests.fixtures.gguf_files import convert_gguf

    src = trained_checkpoint(tmp_path)
    embedded = convert_gguf(src, tmp_path / "embedded.gguf", outtype="f32", mtp="embed")
    trunk = convert_gguf(src, tmp_path / "trunk-q8_0.gguf", outtype="q8_0", mtp="none")
    side = tmp_path / "mtp-embedded.gguf"
    assert cli("mtp", "extract", embedded, "-o", side) == 0
    graft = tmp_path / "grafted-q8_0.gguf"
    assert cli("mtp", "merge", trunk, side, "-o", graft) == 0

    # Control: the same sidecar with its head's matrices redrawn at random, grafted the same way.
    control_side = tmp_path / "mtp-random.gguf"
    shutil.copyfile(side, control_side)
    _randomise_head(control_side)
    control = tmp_path / "grafted-random-q8_0.gguf"
    assert cli("mtp", "merge", trunk, control_side, "-o", control) == 0

    original = verify(embedded, tmp_path / "original.json")
    grafted = verify(graft, tmp_path / "grafted.json")
    random_head = verify(control, tmp_path / "control.json")
    for label, s in (("f32 embedded", original), ("f32 head on q8_0 trunk", grafted),
                     ("random head on q8_0 trunk", random_head)):
        print(f"{label} ({src.name}): accepted {s['accepted']}/{s['drafted']}, rate {s['acceptance_rate']:.3f}, "
              f"acceptance length {s['acceptance_length']:.2f}, exact {s['exact']}")
    assert grafted["exact"] is True
    assert grafted["acceptance_rate"] >= 0.1 and grafted["acceptance_rate"] >= 3 * random_head["acceptance_rate"]
    assert abs(grafted["acceptance_rate"] - original["acceptance_rate"]) <= 0.1


def _randomise_head(path: Path) -> None:
    """Redraw every 2-D F32 tensor of the MTP block in place (gguf-py's writable memory map)."""
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields[f"{arch}.block_count"].contents() - reader.fields[f"{arch}.nextn_predict_layers"].contents()
    rng = np.random.default_rng(0)
    redrawn = 0
    for t in reader.tensors:
        if t.name.startswith(f"blk.{n}.") and t.tensor_type.name == "F32" and t.data.ndim == 2:
            t.data[...] = rng.standard_normal(t.data.shape).astype(np.float32) / np.sqrt(t.data.shape[1])
            redrawn += 1
    assert redrawn >= 5
    del reader
