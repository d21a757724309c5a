"""The family sweep (tests/fixtures/family_runner.py) on the Llama target with its EAGLE-3 head cases
of tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestEagle3Sweep(FamilyRunner):
    CASES = cases("llama-release", "llama-shapes")
