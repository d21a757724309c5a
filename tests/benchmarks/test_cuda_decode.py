"""benchmarks/cuda_decode.py end to end on a tiny Qwen3.5 file on the CPU (the GPU run is the same code
with `--device cuda`): every figure of its table present and consistent, and the synthetic drafter's
tokens equal to plain decoding's.

Evidence: t(n) has one positive time per batch size, the steady-state rates (2n tokens less n) are
positive; the synthetic run drafted (acceptance > 0) and
produced the plain tokens; the MTP head's rounds (a --mtp only sidecar) drafted and produced them too; the profiler saw the step (CPU-only: no device kernels, no CUDA syncs, no graph replayed);
the dense chain covered every 2-D matrix but the token embedding; the JSON file holds the same rows.
"""

from __future__ import annotations

import json

from benchmarks import cuda_decode

from tests.fixtures.gguf_files import convert_gguf


def test_cpu_run_reports_every_figure(qwen35_dir, tmp_path, capsys):
    path = convert_gguf(qwen35_dir(), tmp_path / "tiny.gguf", outtype="q8_0", mtp="none")
    head = convert_gguf(qwen35_dir(), tmp_path / "tiny-mtp.gguf", outtype="q8_0", mtp="only")
    out = tmp_path / "cuda_decode.json"
    [row] = cuda_decode.main(["--model", str(path), "--device", "cpu", "--batch-max", "3", "--repeats", "1",
                              "-n", "12", "--mtp-head", str(head), "--json", str(out)])
    print(capsys.readouterr().out)
    assert len(row["t_s"]) == 3 and all(t > 0 for t in row["t_s"])
    assert row["plain_tokens_per_s"] > 0 and row["plain_steady_tokens_per_s"] > 0
    assert row["synthetic"]["tokens_identical"] is True  # the n- and 2n-token runs both
    assert row["synthetic"]["steady_speedup"] > 0 and row["synthetic"]["first_call_speedup"] > 0
    assert 0 < row["synthetic"]["acceptance"] <= 1
    profile = dict(row["profile"])
    top = profile.pop("top")
    assert profile.pop("sync_sites") == {}  # no host<->device copies or syncs on the CPU
    rounds = row["round_profile"]
    assert rounds["rounds"] > 0 and rounds["syncs"] == 0 and rounds["sync_sites"] == {}
    mtp = row["mtp_round_profile"]
    assert mtp["rounds"] > 0 and mtp["syncs"] == 0 and mtp["drafted"] > 0 and mtp["tokens_identical"] is True
    assert mtp["host_syncs_per_round"] == 0
    assert profile == {"kernels": 0, "syncs": 0, "graph_replays": 0}  # CUDA graphs: CUDA only
    assert 0 < len(top) <= 15 and all(t["count"] > 0 and t["cpu_us"] >= 0 for t in top)
    assert row["floor_s"] is None and row["dense_chain"]["graph_s"] is None
    from specconv.runtime import load_model

    model = load_model(path, device="cpu")
    two_d = [n for n, w in model.weights.items() if w.ndim == 2 and not n.startswith("token_embd") and min(w.shape) > 1]
    assert row["dense_chain"]["matrices"] == len(two_d) > 0
    assert json.loads(out.read_text())["results"] == [json.loads(json.dumps(row))]


def test_the_steady_rate_leaves_out_rounds_the_budget_narrows():
    """64 tokens, k = 3: rounds of 3 tokens every 10 ms until 63 made, then the last token's round,
    narrowed to one row by the budget, which captured that width's graph (100 ms). The rate is the
    full-width rounds' alone (300 tokens/s)."""
    stamps = [(0.01 * (i + 1), 3 * (i + 1)) for i in range(21)] + [(0.31, 64)]
    assert abs(cuda_decode._second_half_rate(stamps, full_width_until=64 - 4) - 300.0) < 1e-6
    assert cuda_decode._second_half_rate(stamps) < 160.0  # with the narrowed round: about half


def test_a_sync_is_placed_at_the_project_frame_of_its_enclosing_operator():
    """The profiler gives a CUDA runtime call (cudaMemcpyAsync) no stack: the site is the innermost
    project frame of the operators around it, named with the operator that made the call; a call
    under no project frame is counted apart; kernels and other host calls are not counted."""
    from types import SimpleNamespace as Event

    step = Event(name="decode", stack=["/x/runtime/context.py(88): decode", "/x/benchmarks/cuda_decode.py(9): run"],
                 cpu_parent=None)
    copy = Event(name="aten::copy_", stack=[], cpu_parent=step)
    read = Event(name="aten::_local_scalar_dense", stack=[], cpu_parent=Event(name="aten::item", stack=[],
                                                                                cpu_parent=step))
    events = [Event(name="cudaMemcpyAsync", stack=[], cpu_parent=copy),
              Event(name="cudaMemcpyAsync", stack=[], cpu_parent=copy),
              Event(name="cudaStreamSynchronize", stack=[], cpu_parent=read),
              Event(name="cudaMemcpyAsync", stack=[], cpu_parent=Event(name="aten::copy_", stack=[], cpu_parent=None)),
              Event(name="cudaLaunchKernel", stack=[], cpu_parent=copy)]
    assert cuda_decode.sync_sites(events) == {"/x/runtime/context.py(88): decode [aten::copy_]": 2,
                                             "/x/runtime/context.py(88): decode [aten::_local_scalar_dense]": 1,
                                             "(no project frame) [aten::copy_]": 1}
