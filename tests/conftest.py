"""Shared test setup: one torch thread (tiny forwards are erratic with two), offline hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = ["tests.fixtures.pytest_plugin"]
