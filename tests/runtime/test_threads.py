"""`--threads 0` (specconv/threads.py): torch's thread count from the model's typical matrix (the runtime's
minimum share per thread) and the cores other processes leave idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specconv import threads
from specconv.runtime.dequant_native import MIN_THREAD_ELEMENTS


def model_of(*shapes):
    tensors = {f"t{i}": SimpleNamespace(shape=s) for i, s in enumerate(shapes)}
    return SimpleNamespace(file=SimpleNamespace(tensors=tensors))


@pytest.fixture
def eight_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_DEFAULT", [8])
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shapes,busy,expected", [
    ([(192, 512)] * 20 + [(192, 2048)] * 2, 0, 1),  # the bundled model: every matrix below one thread's share
    ([(2048, 2048)] * 40 + [(128,)] * 40, 0, 8),  # 4.2 M values per matrix: more than 8 shares (1-D ignored)
    ([(2048, 2048)] * 40, 5, 3),  # five cores busy elsewhere
    ([(2048, 2048)] * 40, 20, 1),
    # ten matrices of one share, two of ten: most values sit in the big ones (the size-weighted median)
    ([(1024, MIN_THREAD_ELEMENTS // 1024)] * 10 + [(1024, 10 * MIN_THREAD_ELEMENTS // 1024)] * 2, 0, 8),
    ([(1024, 3 * MIN_THREAD_ELEMENTS // 1024)] * 4, 0, 3),
])
def test_auto_threads(eight_cores, monkeypatch, shapes, busy, expected):
    monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    assert threads.set_threads(model_of(*shapes)) == expected == torch.get_num_threads()


def test_a_requested_count_is_used_as_given(eight_cores, monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 7)
    assert threads.set_threads(model_of((192, 512)), 3) == 3 == torch.get_num_threads()
