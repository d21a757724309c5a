"""`specconv verify`: checks on a converted GGUF (structure, parity, speculative round trips) -> report."""

from specconv.verify.report import Check, Report
from specconv.verify.run import VerifyOptions, run_verify

__all__ = ["Check", "Report", "VerifyOptions", "run_verify"]
