"""The family sweep (tests/fixtures/family_runner.py) on the Qwen3.5 and Qwen3.5-MoE cases of
tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestQwen35Sweep(FamilyRunner):
    CASES = cases("qwen35-release", "qwen35-shapes", "qwen35moe-release", "qwen35moe-shapes")
