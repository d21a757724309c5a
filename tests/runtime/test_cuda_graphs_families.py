"""CUDA-graph replay for every family whose graph declares CAPTURABLE (runtime/graphs/contract.py),
beyond the Qwen3.5 / Qwen3-Next cases of tests/runtime/test_cuda_graphs.py, with the same stand-in capture:

* replayed steps and verification rounds with rollbacks at every position give the logits of eager
  decoding bit for bit, in bfloat16 (a forward that baked a host value into the capture would be
  stale at the next replay);
* on the `meta` device, every width's warm-up, capture and replays read nothing on the host.

Each family's fixture is the family snapshot's (tools/family_snapshot.py: the release layout or the
shapes that switch behaviour), converted to f32.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specconv.runtime import Context, GraphType, load_model, step_graphs
from specconv.runtime.graphs import graph_for, supported_archs
from tests.fixtures.capture_standin import K, PROMPT, ROUNDS, rounds as _rounds, steps as _steps
from tests.fixtures.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import family_snapshot as fs  # noqa: E402

torch.set_num_threads(1)
# one fixture per captured graph module (qwen35 and qwen3next: tests/runtime/test_cuda_graphs.py)
FAMILIES = {"qwen3": "qwen3moe-release", "llama": "llama-release", "glm4moe": "glm4moe-release",
            "deepseek2": "deepseek2-shapes", "gemma4": "gemma4-moe-shapes", "dsa": "dsa-deepseek32",
            "hy_v3": "chained-hy_v3", "step35": "chained-step35", "mimo2": "chained-mimo2"}
COVERED_ELSEWHERE = {"qwen35", "qwen3next"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (its f32 file, its prompt), built on first use."""
    built = {}
    by_name = {f.name: f for f in fs.families()}

    def get(graph_name: str):
        if graph_name not in built:
            root = tmp_path_factory.mktemp(graph_name)
            source = by_name[FAMILIES[graph_name]].build(root / "build")
            built[graph_name] = (fs._convert(source.src, root / "model.f32.gguf", "f32", []), list(source.prompt))
        return built[graph_name]
    return get


def test_every_capturable_graph_is_tested():
    """The captured graphs are the target trunks tested here or in tests/runtime/test_cuda_graphs.py; drafter
    heads (EAGLE-3, DFlash, the Gemma 4 assistant) decode eagerly."""
    declared = {graph_for(arch).name: graph_for(arch).CAPTURABLE for arch in supported_archs()}
    assert {name for name, on in declared.items() if on} == set(FAMILIES) | COVERED_ELSEWHERE
    assert not any(declared[name] for name in ("eagle3", "dflash", "gemma4_assistant"))


@pytest.mark.parametrize("graph_name", sorted(FAMILIES))
def test_replays_give_the_logits_of_eager_decoding(files, graphable, graph_name):
    path, prompt = files(graph_name)
    model = load_model(path, device="cpu", dtype="bf16")
    assert model.graph.name == graph_name and model.graph.CAPTURABLE
    ids = prompt + prompt
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    got = torch.cat([graphed.decode(ids[:PROMPT]).logits, _rounds(graphed, ids, PROMPT, ROUNDS)[0]])
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, ROUNDS)[0]])
    print(f"\n[{graph_name} + graphs, bf16] {graphed.graphs.captures} captures, {graphed.graphs.replays} replays; "
          f"max |Δ| against eager {float((got - ref).abs().max()):.1e}")
    assert graphed.graphs.captures >= 2 and graphed.graphs.replays >= 2 * len(ROUNDS) - 4  # each width: a warm-up, then captured and replayed
    assert torch.equal(got, ref)


@pytest.mark.parametrize("graph_name", sorted(FAMILIES))
def test_the_captured_region_reads_nothing_on_the_host(files, graphable, graph_name):
    model = load_model(files(graph_name)[0], device="meta", dtype="bf16")
    ctx = _steps(model)
    widths = sorted(n for n, _ in ctx.graphs.widths)
    print(f"\n[meta, bf16, {graph_name}] widths {widths} captured ({ctx.graphs.captures}) and replayed "
          f"({ctx.graphs.replays}): no host read")
    assert widths == list(range(1, K + 2)) and ctx.graphs.captures == K + 1 and ctx.graphs.replays > K + 1
