"""A model's decoding contexts kept for its next generation call, where they replay CUDA graphs.

A context whose steps replay as CUDA graphs (step_graphs.py) pays for each batch width once: its
first forward runs eagerly, its second captures the graph (tens of milliseconds per width on an
H200 for a 1 B model). A speculative run meets up to k + 1 widths, so a new context per call made
short runs (`verify`'s repeats, `demo`, a server's requests) pay that again and again, and their
measured speed-up mostly measured captures. `pooled` hands generate() and speculative_generate()
a context from the model's pool, cleared, with its graphs already captured, and takes it back
after the call:

* the key is the graph type, the snapshot ring (n_rs_seq), the rollback mode, the graph mode and
  the K/V buffer's cells, n_ctx rounded up to a power of two of at least MIN_CELLS (so that
  calls of nearby lengths share one context; a few masked cells more cost next to nothing);
* a call that gives its `span` (prompt + tokens to generate) gets cells for the span plus
  SPAN_SLACK, so a plain and a speculative call over the same span (n_ctx span + 1 and
  span + k + 2) get buffers of the same size: the attention kernel cuts a buffer into pieces by
  its size (kernels_triton/attention.py `cell_pieces`), and another cut would sum a row's
  attention in another order, and the greedy tokens compared could differ in a near tie. This
  holds on a GPU with graphs off too;
* a context is taken out of the pool while a call uses it: a second call with the same key at
  the same time gets a context of its own, and the last one given back is kept (one per key);
* only contexts that replay graphs are kept (on the CPU nothing changes: a new context per call,
  of exactly the cells asked for). `release(model)` drops a model's pool and its K/V buffers.

A reused context holds the previous call's values in its buffers, behind positions marked
unwritten and ring slots marked empty, as `Context.clear` leaves them: nothing reads them
(tests/runtime/test_context_pool.py: a reused context gives the bits of a new one).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from specconv.runtime import step_graphs
from specconv.runtime.context import Context
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType

MIN_CELLS = 256
SPAN_SLACK = 66  # positions a speculative call asks beyond its span at the longest CLI draft (64 + 2)


def pooled_cells(n_ctx: int, span: int | None = None) -> int:
    """The K/V cells of a pooled context asked for n_ctx (and for a call over `span` positions): a
    power of two, at least MIN_CELLS, n_ctx and span + SPAN_SLACK."""
    need = n_ctx if span is None else max(n_ctx, span + SPAN_SLACK)
    return max(MIN_CELLS, 1 << max(0, need - 1).bit_length())


@contextmanager
def pooled(model: Model, graph_type: GraphType, n_ctx: int, n_rs_seq: int, rollback: str = "snapshot",
           span: int | None = None) -> Iterator[Context]:
    """A cleared context of at least n_ctx cells for the length of the `with` block."""
    mode = step_graphs.current_mode()
    cells = pooled_cells(n_ctx, span)
    if not step_graphs.mode_replays_on(mode, model.device):  # on a GPU still the span's cells (kernel pieces)
        exact = model.device.type == "cpu"
        yield Context(model, graph_type, n_ctx=n_ctx if exact else cells, n_rs_seq=n_rs_seq, rollback=rollback)
        return
    key = (graph_type, cells, n_rs_seq, rollback, mode)
    pool = _pool(model)
    ctx = pool.pop(key, None)
    if ctx is None:
        ctx = Context(model, graph_type, n_ctx=key[1], n_rs_seq=n_rs_seq, rollback=rollback)
    try:
        yield ctx
    finally:
        if ctx.graphs is not None:  # a context that does not replay gains nothing from being kept
            ctx.clear()
            ctx.n_evaluated = ctx.n_decode_calls = 0
            pool[key] = ctx


def release(model: Model) -> None:
    """Drop the model's pooled contexts (their K/V buffers and captured graphs)."""
    model.__dict__.pop("_context_pool", None)


def _pool(model: Model) -> dict:
    # on the model itself: the pool lives and dies with it (a model deleted frees its contexts)
    return model.__dict__.setdefault("_context_pool", {})

