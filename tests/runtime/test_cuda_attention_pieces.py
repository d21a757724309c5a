"""The attention kernel's grid (runtime/kernels_triton/attention.py): one program per (query row,
piece of the cells, KV head and tile of the query heads sharing it), the pieces combined in piece
order by the program that finishes last.

* the grid, counted on `meta` for a device of 132 multiprocessors (benchmarks/cuda_op_count.py's
  launch observers): rows × pieces × KV heads × head tiles, never rows × query heads, so each K/V
  cell is read once per (row, KV head) (per head tile of 16 for multi-head latent attention); the
  pieces a whole number of blocks covering the buffer, their count the same at every width;
* the kernel Triton compiles is the same specialization at widths 1, 4 and 16 (one piece and
  several; three layers' features), and each compiles for sm_90 (tools/triton_aot.py) with
  narrowing to nearest even and no reassociation;
* the piece rule (`cell_pieces`): whole blocks, at least MIN_PIECE_CELLS cells each, no more than
  the device's multiprocessors hold at one program each;
* with several pieces (the rule's parameters scaled down, so that the interpreter sees many at
  small cell counts, and at its own values): float32 within the rounding bound of
  tests/runtime/test_cuda_attention.py (`rounding_bound`) against the torch formulas, with gates,
  windows, sinks, unwritten and scattered cells, pieces with no visible cell, a partial last piece;
  multi-head latent attention (V in K, the query in two pieces, a key mask, two head tiles) against
  the masked float64 softmax; Qwen3.5-27B's layer over 2048 cells in the rule's own 8 pieces;
* batch invariance bit for bit: a row alone = the same row in a batch of 16 and of 4 (a
  verification of 3 drafts), at 1 piece, several, and a partial last one, with each feature;
* the counters are zero again after each launch; a prompt too long for one launch's partial sums
  takes several launches, with the bits of one.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/fixtures/triton_mode.py); with one,
compiled on CUDA (the simulated multiprocessor count replaces the device's).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.kernels_triton import _common  # noqa: E402
from specconv.runtime.memory import UNWRITTEN  # noqa: E402
from tests.runtime.test_cuda_attention import case, check_float32, on_device, rand  # noqa: E402

attention_module = importlib.import_module("specconv.runtime.kernels_triton.attention")
H100_SMS = 132


@pytest.fixture
def small_pieces(monkeypatch):
    """A device of H100_SMS multiprocessors and pieces of at least `cells` cells: many pieces at the
    interpreter's small cell counts. Returns the setter."""
    def use(cells: int, sms: int = H100_SMS):
        monkeypatch.setattr(_common, "multiprocessors", lambda device: sms)
        monkeypatch.setattr(attention_module, "MIN_PIECE_CELLS", cells)
    return use


def pieces_of(heads: int, kv_heads: int, head_dim: int, cells: int) -> tuple[int, int]:
    """(pieces, cells per piece) the kernel takes for this layer and buffer on the current device."""
    group = heads // kv_heads
    tiles = -(-group // attention_module.head_tile(group))
    return attention_module.cell_pieces(cells, attention_module.block_cells(head_dim), kv_heads * tiles, DEVICE)


# ---- the grid and the piece rule ----------------------------------------------------------------------

def launches_on_meta(monkeypatch, call) -> list[tuple[tuple, dict]]:
    """(grid, constexprs) of every attention_kernel launch `call` makes on `meta` (a 132-SM device)."""
    seen = []

    def observe(module, kernel, grid, args, kwargs):
        if kernel == "attention_kernel":
            seen.append((tuple(grid), {k: v for k, v in kwargs.items() if k.isupper()}))
    monkeypatch.setattr(cuda_op_count, "launch_observers", [observe])
    with cuda_op_count.meta_launches(H100_SMS):
        call()
    return seen


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


META_LAYERS = {  # (heads, kv_heads, dk, dv, call(n, cells)) of layers whose kernel specializations differ
    "qwen35-27b": (24, 4, 256, 256, lambda n, cells: kt.attention(
        meta(n, 24, 256), meta(cells, 4, 256), meta(cells, 4, 256), meta(n, dtype=torch.long),
        meta(cells, dtype=torch.long), 0.0625, gate=meta(n, 24, 256))),
    "mha-window-sinks": (4, 4, 128, 128, lambda n, cells: kt.attention(
        meta(n, 4, 128), meta(cells, 4, 128), meta(cells, 4, 128), meta(n, dtype=torch.long),
        meta(cells, dtype=torch.long), 0.09, gate=meta(n, 4), window=16, sinks=meta(4, dtype=torch.float32))),
    "mla-128-keep": (128, 1, 576, 512, lambda n, cells: (lambda kv: kt.attention(
        meta(n, 128, 512), kv, kv[..., :512], meta(n, dtype=torch.long), meta(cells, dtype=torch.long), 0.07,
        keep=meta(n, cells, dtype=torch.bool), q_rest=meta(n, 128, 64)))(meta(cells, 1, 576))),
}


def test_the_split_kernel_compiles_for_sm90_to_one_specialization_at_every_width(monkeypatch):
    """The specializations Triton's JIT would compile for three layers (Qwen3.5-27B's, a head-gated
    MHA with a window and sinks, DeepSeek-V3's latent attention with a key mask) at 64 cells (one
    piece) and 8192 (several), on `meta`: the same at widths 1, 4 and 16 (one compiled kernel for a
    row alone and a batch), and each compiles for sm_90 (tools/triton_aot.py: Triton's bundled ptxas)
    with narrowing to nearest even and no reassociation."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    if not hasattr(triton_jit, "create_function_from_signature"):
        pytest.skip("this Triton's JIT has no binder to record specializations with")
    from benchmarks.triton_launches import specialize
    from tools import triton_aot

    by_width: dict = {}

    def observe(module, kernel, grid, args, kwargs):
        if kernel == "attention_kernel":
            by_width.setdefault(key, []).append(specialize(module, kernel, args, kwargs))
    monkeypatch.setattr(cuda_op_count, "launch_observers", [observe])
    with cuda_op_count.meta_launches(H100_SMS):
        for layer, (*_, call) in META_LAYERS.items():
            for cells in (64, 8192):
                for n in (1, 4, 16):
                    key = (layer, cells, n)
                    call(n, cells)
    specs = set()
    for layer in META_LAYERS:
        for cells in (64, 8192):
            widths = {tuple(by_width[layer, cells, n]) for n in (1, 4, 16)}
            assert len(widths) == 1, (layer, cells)
            specs |= set(widths.pop())
    assert {dict(s.constexprs)["SPLIT"] for s in specs} == {False, True}
    results = triton_aot.compile_all([s.to_json() for s in specs], archs=(90,), jobs=1, sass=False)
    failed = triton_aot.failures(results)
    assert not failed, "\n".join(failed)
    problems, found = triton_aot.rounding_problems({triton_launches_spec(r): r for r in results})
    print(f"\n{len(specs)} attention specializations compiled for sm_90 "
          f"({sum(r.seconds for r in results):.0f} s); conversions {dict(found)}")
    assert not problems, "\n".join(problems)


def triton_launches_spec(result):
    from benchmarks.triton_launches import Specialization

    return Specialization.from_json(result.spec)


@pytest.mark.parametrize("cells", [64, 8192, 32768])
@pytest.mark.parametrize("layer, tile, tiles", [("qwen35-27b", 8, 1), ("mla-128-keep", 16, 8)],
                         ids=["qwen35-27b", "mla-128"])
def test_the_grid_is_rows_by_pieces_by_kv_heads_not_rows_by_heads(monkeypatch, layer, tile, tiles, cells):
    """Qwen3.5-27B's attention (24 query heads on 4 KV heads, 256 wide: one tile of 8) and
    DeepSeek-V3's latent attention (128 heads on one 576-wide latent cell: 8 tiles of 16): at widths
    1, 4 and 16 the grid is (rows, pieces, KV heads · head tiles), so each K cell is loaded once per
    (row, KV head, head tile); the pieces are whole blocks covering the buffer, the same at every
    width."""
    monkeypatch.setattr(_common, "multiprocessors", lambda device: H100_SMS)  # for cell_pieces here too
    heads, kv_heads, _, _, call = META_LAYERS[layer]
    grids = {}
    for n in (1, 4, 16):
        (grid, const), = launches_on_meta(monkeypatch, lambda: call(n, cells))
        assert const["HEAD_TILE"] == tile and grid[0] == n and grid[2] == kv_heads * tiles
        pieces, piece_cells = attention_module.cell_pieces(cells, const["BLOCK_T"], grid[2], torch.device("meta"))
        assert grid[1] == pieces and const["SPLIT"] == (pieces > 1) and piece_cells % const["BLOCK_T"] == 0
        assert (pieces - 1) * piece_cells < cells <= pieces * piece_cells
        grids[n] = grid
        print(f"\n[meta, {H100_SMS} SMs] {layer}, {cells} cells, n={n}: grid {grid} (HEAD_TILE {tile}, "
              f"{piece_cells} cells a piece): each cell read by n · {grid[2]} programs, not n · {heads}")
    assert len({grid[1:] for grid in grids.values()}) == 1  # pieces and tiles: the width's no part


def test_the_piece_rule(monkeypatch):
    """Whole blocks, the last piece the rest; each at least MIN_PIECE_CELLS (one piece below twice
    that); no more pieces than fill the multiprocessors at the row's programs."""
    monkeypatch.setattr(_common, "multiprocessors", lambda device: H100_SMS)
    device = torch.device("meta")  # cell_pieces reads only the multiprocessor count
    for cells in (0, 1, 255, 511, 512, 700, 4096, 8192, 32768, 131072):
        for block, programs in ((32, 4), (16, 8), (64, 1), (64, 200)):
            pieces, piece_cells = attention_module.cell_pieces(cells, block, programs, device)
            assert piece_cells % block == 0 and (pieces - 1) * piece_cells < max(cells, 1) <= pieces * piece_cells
            assert pieces == 1 or (piece_cells >= attention_module.MIN_PIECE_CELLS
                                   and pieces <= _common.multiprocessors(device) // programs)
    assert attention_module.cell_pieces(32768, 32, 4, torch.device("meta"))[0] > 1


# ---- several pieces: accuracy -------------------------------------------------------------------------

@pytest.mark.parametrize("cells, written, min_cells", [(150, 120, 32), (300, 40, 32), (700, 700, 256)],
                         ids=["3-pieces", "empty-pieces", "rule-sized-partial-last"])
def test_float32_within_the_rounding_bound_in_pieces(small_pieces, cells, written, min_cells):
    """Several pieces, the sink in piece 0 only, pieces of unwritten cells (no visible cell: an exact
    nothing in the combine), a partial last block and piece: within the bound of one piece."""
    small_pieces(min_cells)
    q, k, v, q_pos, k_pos = case(5, 8, 2, 64, cells=cells, written=written, seed=cells, scattered=written == cells)
    pieces, piece_cells = pieces_of(8, 2, 64, cells)
    assert pieces > 1
    label = f"{pieces} pieces of {piece_cells} cells, {written}/{cells} written"
    check_float32(q, k, v, q_pos, k_pos, 0.125, label)
    check_float32(q, k, v, q_pos, k_pos, 0.125, label + ", gate", gate=rand(5, 8, 64, seed=cells + 1))
    check_float32(q, k, v, q_pos, k_pos, 0.125, label + ", window 40, sinks, head gate", gate=rand(5, 8, seed=3),
                  window=40, sinks=rand(8, seed=4) + 2)


def test_float32_one_row_without_a_visible_cell_but_its_sink(small_pieces):
    """Window 1 on a row whose own cell lies in the last piece: every other piece sees nothing, and
    the sink's logit in piece 0 still counts once."""
    small_pieces(32)
    q, k, v, q_pos, k_pos = case(3, 4, 2, 64, cells=200, written=200, seed=12)
    pieces = pieces_of(4, 2, 64, 200)[0]
    assert pieces > 2
    check_float32(q, k, v, q_pos, k_pos, 0.125, f"window 1, sinks, {pieces} pieces", window=1, sinks=rand(4, seed=13))


def test_latent_attention_in_pieces_and_head_tiles(small_pieces):
    """V in K (576-wide latent cells, the query in two pieces), 20 heads in two tiles of 16 (the second
    padded), a key mask, several pieces: against the masked softmax in float64."""
    small_pieces(32)
    n, heads, cells, lat = 3, 20, 100, 512
    q = rand(n, heads, lat + 64, seed=40)
    kv = rand(cells, 1, lat + 64, seed=41)
    q_pos, k_pos = torch.arange(cells - n, cells), torch.arange(cells)
    keep = torch.rand(n, cells, generator=torch.Generator().manual_seed(42)) < 0.5
    kv_d = kv.to(DEVICE)
    got = kt.attention(q[..., :lat].contiguous().to(DEVICE), kv_d, kv_d[..., :lat], q_pos.to(DEVICE), k_pos.to(DEVICE),
                       0.07, keep=keep.to(DEVICE), q_rest=q[..., lat:].contiguous().to(DEVICE))
    visible = (k_pos[None, :] <= q_pos[:, None]) & keep
    s = torch.einsum("nhd,td->nht", q.double(), kv[:, 0].double()) * 0.07
    exact = torch.einsum("nht,td->nhd", torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), -1),
                         kv[:, 0, :lat].double())
    diff = float((got.cpu().double() - exact).abs().max())
    print(f"\n[{WHERE}, f32] latent, 20 heads, {pieces_of(heads, 1, lat + 64, cells)[0]} pieces: "
          f"max |Δ| {diff:.2e} against float64")
    assert diff <= 1e-4 * float(kv.abs().max())


# ---- several pieces: batch invariance -----------------------------------------------------------------

FEATURES = {
    "plain": {},
    "gate-window-sinks": dict(gate="value", window=30, sinks=True),
    "head-gate-keep": dict(gate="head", keep=True),
    "latent-keep": dict(latent=True, keep=True),
}


def invariance_case(features: dict, cells: int, dtype):
    """(q, k, v, q_pos, k_pos, kwargs) of 16 rows on the device, with `features`."""
    n = 16
    if features.get("latent"):
        q = rand(n, 20, 576, seed=50)
        kv = rand(cells, 1, 576, seed=51).to(dtype)
        k_pos = torch.arange(cells)
        q_pos = torch.arange(cells - n, cells)
        q, kv = q.to(dtype).to(DEVICE), kv.to(DEVICE)
        kwargs = dict(q_rest=q[..., 512:].contiguous())
        q, k, v = q[..., :512].contiguous(), kv, kv[..., :512]
    else:
        q, k, v, q_pos, k_pos = case(n, 8, 2, 128, cells=cells, written=cells - 10, seed=cells, scattered=True)
        q, k, v = (t.to(dtype).to(DEVICE) for t in (q, k, v))
        kwargs = {}
        if features.get("gate") == "value":
            kwargs["gate"] = rand(n, 8, 128, seed=52).to(dtype).to(DEVICE)
        if features.get("gate") == "head":
            kwargs["gate"] = rand(n, 8, seed=52).to(dtype).to(DEVICE)
        if features.get("window"):
            kwargs["window"] = features["window"]
        if features.get("sinks"):
            kwargs["sinks"] = rand(8, seed=53).to(DEVICE)
    if features.get("keep"):
        kwargs["keep"] = (torch.rand(n, cells, generator=torch.Generator().manual_seed(54)) < 0.6).to(DEVICE)
    return q, k, v, q_pos.to(DEVICE), k_pos.to(DEVICE), kwargs


def rows(kwargs: dict, a: int, b: int) -> dict:
    """kwargs with the per-row tensors (gate, keep, q_rest) cut to rows a..b-1 (copies: alone in memory)."""
    return {key: (value[a:b].clone() if key in ("gate", "keep", "q_rest") else value) for key, value in kwargs.items()}


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("cells, min_cells", [(60, 32), (160, 32), (200, 64)],
                         ids=["1-piece", "several-pieces", "partial-last-piece"])
def test_a_row_alone_gives_its_bits_in_a_batch_in_pieces(small_pieces, features, cells, min_cells):
    """bfloat16: rows 0, 3, 9 and 15 alone and in a batch of 4 (a verification of 3 drafts) give the
    bits they get in the batch of 16, at 1 piece, several, and a partial last piece (in blocks)."""
    small_pieces(min_cells)
    q, k, v, q_pos, k_pos, kwargs = invariance_case(FEATURES[features], cells, torch.bfloat16)
    batch = kt.attention(q, k, v, q_pos, k_pos, 0.09, **kwargs)
    four = kt.attention(q[:4].clone(), k, v, q_pos[:4].clone(), k_pos, 0.09, **rows(kwargs, 0, 4))
    assert torch.equal(four, batch[:4])
    for i in (0, 3, 9, 15):
        alone = kt.attention(q[i:i + 1].clone(), k, v, q_pos[i:i + 1].clone(), k_pos, 0.09, **rows(kwargs, i, i + 1))
        assert torch.equal(alone, batch[i:i + 1]), f"row {i}"
    heads, dk = (20, 576) if FEATURES[features].get("latent") else (8, 128)
    pieces, piece_cells = pieces_of(heads, k.shape[1], dk, cells)
    print(f"\n[{WHERE}, bf16, {features}] {pieces} piece(s) of {piece_cells} cells over {cells}: rows alone "
          f"and a batch of 4 = the batch of 16")
    assert (pieces > 1) == (cells > 60)


# ---- the counters and long prompts --------------------------------------------------------------------

def test_counters_are_zero_after_each_launch_and_repeats_give_the_same_bits(small_pieces):
    small_pieces(32)
    q, k, v, q_pos, k_pos = on_device(*case(6, 8, 2, 64, cells=200, written=150, seed=60))
    first = kt.attention(q, k, v, q_pos, k_pos, 0.125)
    counters = attention_module.piece_counters(first.device, 1)  # the buffer the launches used
    assert int(counters.count_nonzero()) == 0
    assert torch.equal(kt.attention(q, k, v, q_pos, k_pos, 0.125), first)
    assert int(counters.count_nonzero()) == 0


def test_a_prompt_beyond_one_launchs_partial_sums_takes_several_with_the_same_bits(small_pieces, monkeypatch):
    """WORKSPACE_VALUES caps the partial sums of one launch: 16 rows in launches of 3 give the bits of
    one launch of 16 (each row's program is the same)."""
    small_pieces(32)
    q, k, v, q_pos, k_pos = on_device(*case(16, 8, 2, 64, cells=160, written=160, seed=70))
    whole = kt.attention(q, k, v, q_pos, k_pos, 0.125)
    pieces = pieces_of(8, 2, 64, 160)[0]
    monkeypatch.setattr(attention_module, "WORKSPACE_VALUES", 3 * 8 * pieces * 64)
    launches = record_launches(monkeypatch)
    assert torch.equal(kt.attention(q, k, v, q_pos, k_pos, 0.125), whole)
    assert launches == ["attention_kernel"] * 6 and attention_module.rows_per_launch(8, pieces, 64) == 3
    print(f"\n[{WHERE}] 16 rows, {pieces} pieces, in launches of 3 rows: the bits of one launch")


def test_unwritten_cells_in_pieces_are_never_read_into_the_sums(small_pieces):
    """Junk (±1e4) in the unwritten cells of whole pieces: the output stays finite and within the bound."""
    small_pieces(32)
    q, k, v, q_pos, k_pos = case(4, 4, 4, 64, cells=256, written=50, seed=80, scattered=True)
    assert bool((k_pos == UNWRITTEN).any())
    got = check_float32(q, k, v, q_pos, k_pos, 0.125, "50 of 256 cells written, scattered, in pieces")
    assert bool(torch.isfinite(got).all())


def test_a_qwen35_27b_layer_at_2k_cells_in_the_rules_own_pieces(small_pieces):
    """Qwen3.5-27B's attention shape (24 query heads on 4 KV heads, 256 wide, the output gate) over
    2048 cells at the rule's own MIN_PIECE_CELLS on a 132-SM device (8 pieces of 256 cells): float32
    within the derived bound; bf16 rows alone and a batch of 4 = rows of the batch, launch after
    launch (on a GPU the pieces race for the last place: the bits must not care)."""
    small_pieces(attention_module.MIN_PIECE_CELLS)
    q, k, v, q_pos, k_pos = case(4, 24, 4, 256, cells=2048, written=2000, seed=90, scattered=True)
    gate = rand(4, 24, 256, seed=91)
    pieces, piece_cells = pieces_of(24, 4, 256, 2048)
    assert (pieces, piece_cells) == (8, 256)
    check_float32(q, k, v, q_pos, k_pos, 256 ** -0.5, f"24 / 4 heads, 2000 of 2048 cells, {pieces} pieces", gate=gate)
    q, k, v, gate = (t.bfloat16().to(DEVICE) for t in (q, k, v, gate))
    q_pos, k_pos = q_pos.to(DEVICE), k_pos.to(DEVICE)
    batch = kt.attention(q, k, v, q_pos, k_pos, 256 ** -0.5, gate=gate)
    for _ in range(2):
        assert torch.equal(kt.attention(q, k, v, q_pos, k_pos, 256 ** -0.5, gate=gate), batch)
    for i in range(4):
        alone = kt.attention(q[i:i + 1].clone(), k, v, q_pos[i:i + 1].clone(), k_pos, 256 ** -0.5,
                             gate=gate[i:i + 1].clone())
        assert torch.equal(alone, batch[i:i + 1]), i
