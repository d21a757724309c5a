"""benchmarks/rows_first.py: its variants rearrange the same rows the runtime does, and its table
reports each of them (its timings are the benchmark's, not asserted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from benchmarks import rows_first as bench
from specconv.runtime import rows_first

torch.set_num_threads(1)


def test_its_matrix_is_q8_0_and_both_forms_rearrange_it_alike():
    seed = int(torch.randint(1 << 30, ()))
    raw = bench.random_q8_0(5, 512, torch.device("cpu"), seed=seed)
    values = dequantize(raw.numpy(), QType.Q8_0)
    assert values.shape == (5, 512) and np.isfinite(values).all() and (np.abs(values) > 0).any()
    want = rows_first.to_rows_layout(raw, rows_first.Q8_0_ROWS)
    assert not torch.equal(want, raw)
    got = rows_first.rearrange_in_place(raw.clone(), rows_first.Q8_0_ROWS, chunk_bytes=1)
    assert torch.equal(got, want)
    assert torch.equal(rows_first.to_ggml_layout(got, rows_first.Q8_0_ROWS), raw)


def test_the_table_has_every_variant_against_the_copy(capsys):
    seconds = bench.main(["--shape", "64x512", "--repeats", "2"])
    out = capsys.readouterr().out
    print(out)
    assert set(seconds) == set(bench.VARIANTS) and all(s > 0 for s in seconds.values())
    for variant in bench.VARIANTS:
        assert any(line.startswith(variant + " ") for line in out.splitlines()), variant
    copy_line = next(line for line in out.splitlines() if line.startswith("copy "))
    assert copy_line.split()[-1] == "1.00"


def test_a_width_that_is_not_kept_rows_first_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shape", "8x96"])
    assert "multiple of 256" in capsys.readouterr().err
