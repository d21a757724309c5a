"""The family sweep (tests/fixtures/family_runner.py) on the Qwen3-Next cases of
tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestQwen3NextSweep(FamilyRunner):
    CASES = cases("qwen3next-release", "qwen3next-shapes")
