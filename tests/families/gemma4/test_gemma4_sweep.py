"""The family sweep (tests/fixtures/family_runner.py) on the Gemma 4 (with its assistant) cases of
tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestGemma4Sweep(FamilyRunner):
    CASES = cases("gemma4-release", "gemma4-shapes", "gemma4-moe-shapes")
