"""The demo of the main job on the bundled model (`specconv demo`) and the measurement helpers it
shares with benchmarks/spec_decode.py."""

from specconv.demo.bundled import bundled_model_dir, heldout_prompts
from specconv.demo.pipeline import DemoOptions, run_demo

__all__ = ["DemoOptions", "bundled_model_dir", "heldout_prompts", "run_demo"]
