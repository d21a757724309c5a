"""The family sweep (tests/fixtures/family_runner.py) on the GLM-4.5, GLM-4.7-Flash and DeepSeek-V3
cases of tests/fixtures/family_sweep.py."""

from tests.fixtures.family_runner import FamilyRunner, cases


class TestGlmDeepseekSweep(FamilyRunner):
    CASES = cases("glm4moe-release", "glm4moe-shapes", "glm47flash-release", "deepseek2-shapes")
