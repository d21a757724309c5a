"""`specconv compare`: a source model and its quants over the same text, scored as llama-perplexity
scores them (PPL, KL divergence, Δp, Same top p), with MTP acceptance by draft position (docs/compare.md)."""

from specconv.compare.run import CompareOptions, run_compare

__all__ = ["CompareOptions", "run_compare"]
