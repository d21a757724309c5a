"""CI smoke run of the GGUF fuzzer (tools/fuzz_gguf.py): ten mutated files of every seed
(tools/fuzz_seeds.py: every family the project writes, with its drafter where it has one) through the
runtime pipeline and the tools, each in a forked child under a memory cap and a time limit. Bounded:
under 60 s of CPU, seeds built included. The long run's figures are in docs/robustness.md."""

from __future__ import annotations

import resource
import sys

from tests.fixtures.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))


def test_fuzz_smoke(tmp_path):
    import fuzz_gguf
    from fuzz_seeds import SEEDS

    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    args = fuzz_gguf.build_parser().parse_args(["--seeds", str(tmp_path / "seeds"), "--families", ",".join(SEEDS),
                                                "--cases", str(10 * len(SEEDS)), "--seed", "7", "--tools-every", "4",
                                                "--time-limit", "20", "--mem-mb", "4096"])
    report = fuzz_gguf.run(args)
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))
    print(f"fuzz smoke: {report['totals']} in {report['seconds']} s, {cpu:.1f} s CPU")
    for stage in ("runtime", "tools"):
        t = report["totals"][stage]
        assert t["internal"] == t["hang"] == t["memory"] == 0, report["problems"]
    assert report["totals"]["runtime"]["ok"] > 0 and report["totals"]["runtime"]["clear"] > 0
    runs = report["by_family"]["runtime"]
    assert all(sum(runs[f].get(o, 0) for o in fuzz_gguf.OUTCOMES) >= 10 for f in SEEDS), runs
    assert cpu < 60


def test_mutator_writes_values_beyond_float32_as_infinity():
    """A doubled edge value can leave float32's range (the long run's parent died on struct.error)."""
    import struct

    from gguf import GGUFValueType as V

    from fuzz_mutate import _scalar

    assert struct.unpack("<f", _scalar(V.FLOAT32, 1e39))[0] == float("inf")
    assert struct.unpack("<f", _scalar(V.FLOAT32, -2 * 3.4e38))[0] == float("-inf")
    assert struct.unpack("<d", _scalar(V.FLOAT64, 2 ** 2000))[0] == float("inf")
    assert struct.unpack("<f", _scalar(V.FLOAT32, 2 ** 64))[0] == float(2 ** 64)
