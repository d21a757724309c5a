"""The family sweep (tests/fixtures/family_runner.py) on the Qwen3 and Qwen3-MoE cases of
tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestQwen3Sweep(FamilyRunner):
    CASES = cases("qwen3-release", "qwen3-shapes", "qwen3moe-release", "qwen3moe-shapes")
