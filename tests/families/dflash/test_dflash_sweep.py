"""The family sweep (tests/fixtures/family_runner.py) on the DFlash and DFlash2 cases of
tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestDflashSweep(FamilyRunner):
    CASES = cases("dflash-release", "dflash2-shapes")
