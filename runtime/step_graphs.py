"""Decode steps and verification batches replayed as CUDA graphs (docs/runtime.md, "CUDA graphs").

A one-row decode step of a 1 B model launches thousands of small kernels; on a GPU their launch cost,
not the weights' bytes, sets the step's time (issue [21]). A `Context` whose model qualifies
(`enabled_for`) keeps one captured forward per width n = 1 .. min(ring, MAX_WIDTH) — the decode step
and the verification of k drafts, k + 1 ≤ n_rs_seq + 1; for an MTP head's context its draft step
and the catch-up of the j + 1 committed rows — and replays it every round:

* static inputs: one int64 device buffer per width holding the token ids, positions, K/V cell of each
  token, the ring slot of the recurrent state before the batch and the slots of the states after it
  (`memory.BatchIndex`, every field 128 bytes into the buffer: the kernels' pointer alignment);
* an MTP context's hidden rows (`hidden_in`): a static [n, input width] buffer per width, written by
  a device-to-device copy; token ids already on the device (a draft step's argmax,
  `Context.decode(ids_on_device=True)`) are copied into the token slot the same way, after the host copy;
* the captured region is `forward_main` (MTP: `forward_mtp`) on a `Batch.replayable` batch, whose
  addresses are those tensors only (a forward that reads a host integer of the batch raises), and on
  the memory's fixed-size buffers (the backend's `static_kv` and `slot_states`): every shape is the
  width's;
* outside it, on the host: `Memory.begin` (cell offsets, slots, the context-full check), the values
  copied into the static buffer (one pinned host-to-device copy), the replay, `Memory.commit`; the
  logits and hidden rows (MAIN: post_norm / pre_norm; MTP: nextn / pre_norm) are copied out of the
  static outputs before the next replay overwrites them.

Per width: the first call runs the forward eagerly on the static buffers (Triton compiles its
kernels, cuBLAS sets up), the second captures it (`torch.cuda.CUDAGraph`, one capture stream and one
memory pool for all of a context's graphs) and replays it, later calls replay. A capture that fails
leaves the context decoding eagerly, with a one-line warning. The forward's stored-weight bytes,
which the Python code counts as it runs, are counted once per replay from the eager call.

`--cuda-graphs / --no-cuda-graphs` (generate, verify, demo) set the mode (`cuda_graphs`): "auto" (on
for CUDA), "on" (wherever the backend qualifies: how tests run the plumbing on the CPU, with a
stand-in for the capture), "off".
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import INVARIANT_DTYPES, batch_invariant, for_device
from specconv.runtime.memory import Batch, BatchIndex
from specconv.runtime.types import DecodeOutput, GraphType

MODES = ("auto", "on", "off")
MAX_WIDTH = 16  # the recurrent kernels' one-launch limit (kernels_triton.MAX_TOKENS)
HIDDEN = ("post_norm", "pre_norm")  # hidden states a captured MAIN forward returns
GRAPH_TYPES = (GraphType.MAIN, GraphType.MTP)  # an MTP forward returns hidden "nextn" and "pre_norm"
ALIGN = 16  # int64 values: each static index starts on a 128-byte boundary
GRAPH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_mode: ContextVar[str] = ContextVar("specconv_cuda_graphs", default="auto")


@contextmanager
def cuda_graphs(mode: str):
    """Contexts created inside use CUDA graphs as `mode` says ("auto", "on", "off")."""
    if mode not in MODES:
        raise SpecconvError(f"CUDA graphs mode must be one of {MODES}, not {mode!r}")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def current_mode() -> str:
    """The mode contexts created now take ("auto", "on", "off": `cuda_graphs`)."""
    return _mode.get()


def mode_replays_on(mode: str, device: torch.device) -> bool:
    """Whether `mode` lets contexts on `device` replay graphs ("on" anywhere, "auto" on CUDA)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def enabled_for(ctx) -> bool:
    """Whether a new context replays its decode steps and verifications as graphs: a MAIN or MTP
    context of a graph declared CAPTURABLE (runtime/graphs/contract.py) with a memory of its own (not
    a drafter reading its target's K/V: `kv_from`), on one device with resident weights, computing in
    float32 / bfloat16 / float16 with float32 recurrent states, whose backend attends over fixed-size
    K/V buffers and writes recurrent states into ring slots; on CUDA unless the mode is "on" or "off"."""
    mode = current_mode()
    model = ctx.model
    if mode == "off" or ctx.graph_type not in GRAPH_TYPES or ctx.kv_from is not None:
        return False
    backend = for_device(model.device)
    fits = (model.graph.CAPTURABLE and backend.static_kv and backend.slot_states
            and not model.weights.placement.multi and not model.offload and ctx.gdn_mode != "recurrent"
            and model.dtype in GRAPH_DTYPES and ctx.memory.layout.state_dtype == torch.float32)
    return fits and mode_replays_on(mode, model.device)


class CudaCapture:
    """torch.cuda.CUDAGraph capture on one side stream, into one memory pool shared by a context's
    graphs (never replayed at the same time). `run` is an eager call on that stream (the warm-up)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, fn):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def capture(self, fn):
        """(graph, outputs): fn's kernels recorded, not run; graph.replay() runs them into outputs."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = fn()
        return graph, outputs


CAPTURE = CudaCapture  # what captures (a stand-in in the CPU tests)


class _Width:
    """The static buffers and the captured forward of one width on one sequence."""

    def __init__(self, model, memory, graph_type: GraphType, gdn_mode: str, n: int, seq: int):
        self.model, self.memory, self.gdn_mode, self.n, self.seq = model, memory, gdn_mode, n, seq
        self.graph_type = graph_type
        self.keep = min(n, memory.ring)
        span = -(-n // ALIGN) * ALIGN
        self.length = 3 * span + ALIGN + self.keep
        self.buffer = torch.zeros(self.length, dtype=torch.long, device=model.device)
        b = self.buffer
        self.tokens = b[:n]
        self.index = BatchIndex(positions=b[span:span + n], cells=b[2 * span:2 * span + n],
                                src_slot=b[3 * span:3 * span + 1], dst_slots=b[3 * span + ALIGN:3 * span + ALIGN + self.keep])
        self.offsets = (0, span, 2 * span, 3 * span, 3 * span + ALIGN)
        # MTP: the target's hidden rows, one per token (written by a device-to-device copy)
        self.hidden = (torch.zeros(n, model.hparams.input_width, dtype=model.dtype, device=model.device)
                       if graph_type == GraphType.MTP else None)
        self.graph = None
        self.outputs = None
        self.warm = False
        self.bytes_read = 0  # stored-weight bytes one forward reads (counted in Python: once, eagerly)

    def fill(self, tokens: Sequence[int] | torch.Tensor, batch: Batch, hidden_in: torch.Tensor | None):
        """This call's values into the static buffers: one host-to-device copy (pinned on CUDA) of the
        addresses and host token ids; token ids already on the device (a draft step's argmax) and MTP
        hidden rows by device-to-device copies after it, on the same stream."""
        values = [0] * self.length
        t, p, c, s, d = self.offsets
        n = self.n
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            values[t:t + n] = tokens
        values[p:p + n] = batch.host_positions
        values[c:c + n] = range(batch.start, batch.start + n)
        values[s] = batch.src_slot
        values[d:d + self.keep] = batch.slots
        host = torch.tensor(values, dtype=torch.long)
        if self.buffer.device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
        self.buffer.copy_(host, non_blocking=True)  # as device.upload, into the static buffer
        if on_device:
            self.tokens.copy_(tokens)
        if self.hidden is not None:
            self.hidden.copy_(hidden_in)

    def forward(self):
        """The captured region: reads the static buffers and the memory's device buffers, nothing else."""
        model = self.model
        batch = Batch.replayable(self.memory, self.seq, self.index)  # fresh: no tensor cached from a last run
        with torch.inference_mode(), batch_invariant(model.dtype in INVARIANT_DTYPES):
            if self.hidden is not None:  # MTP: (logits, nextn, pre_norm)
                return model.graph.forward_mtp(model.weights, model.hparams, self.tokens, self.hidden, batch)
            logits, post, pre, _ = model.graph.forward_main(model.weights, model.hparams, self.tokens, batch, set(),
                                                            self.gdn_mode, None)
        return logits, post, pre


class StepGraphs:
    """A context's captured forwards, one per (width, sequence); see the module doc. It keeps the
    context's model and memory, not the context (no reference cycle: a context's graphs, pool and
    buffers go when the context does)."""

    def __init__(self, ctx):
        self.model, self.memory, self.gdn_mode, self.graph_type = ctx.model, ctx.memory, ctx.gdn_mode, ctx.graph_type
        self.max_width = min(ctx.memory.ring, MAX_WIDTH)
        self.widths: dict[tuple[int, int], _Width] = {}
        self.capturer = None
        self.failed = False
        self.captures = self.replays = 0

    def takes(self, n: int, hidden: Sequence[str], layers: Sequence[int]) -> bool:
        """Whether this call replays a graph (the backend asked again: tests swap it per call). An MTP
        call returns its own two hidden states whatever `hidden` names."""
        backend = for_device(self.model.device)
        named = self.graph_type == GraphType.MTP or all(h in HIDDEN for h in hidden)
        return (not self.failed and 1 <= n <= self.max_width and not layers and named
                and backend.static_kv and backend.slot_states)

    def _give_up(self, what: str, exc: Exception):
        self.failed = True
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.stderr.write(f"warning: CUDA graph {what} failed ({reason}); decoding without graphs\n")

    def decode(self, tokens: Sequence[int] | torch.Tensor, batch: Batch, hidden: Sequence[str], logits: str | None,
               hidden_in: torch.Tensor | None = None) -> DecodeOutput:
        """The forward of a batch begun by Memory.begin (not yet committed), by its width's graph: token
        ids on the host or on the device (a draft step's argmax); an MTP context's hidden rows."""
        n = len(tokens)
        width = self.widths.get((n, batch.seq))
        if width is None:
            width = self.widths[(n, batch.seq)] = _Width(self.model, self.memory, self.graph_type, self.gdn_mode, n,
                                                         batch.seq)
        width.fill(tokens, batch, hidden_in)
        counter = self.model.weights.counter
        if self.capturer is None and not self.failed:
            try:
                self.capturer = CAPTURE(self.model.device)
            except Exception as exc:  # no CUDA runtime to capture with
                self._give_up("setup", exc)
        if width.graph is not None:
            width.graph.replay()
            counter.bytes += width.bytes_read
            self.replays += 1
            outputs = width.outputs
        elif self.failed:
            outputs = width.forward()
        elif not width.warm:
            before = counter.bytes
            outputs = self.capturer.run(width.forward)  # the warm-up is this call's forward
            width.bytes_read, width.warm = counter.bytes - before, True
        else:
            before = counter.bytes
            try:
                width.graph, width.outputs = self.capturer.capture(width.forward)
            except Exception as exc:  # a capture records kernels without running them: run them now
                width.graph = None
                self._give_up("capture", exc)
                counter.bytes = before
                outputs = width.forward()
            else:
                counter.bytes = before + width.bytes_read
                self.captures += 1
                width.graph.replay()
                outputs = width.outputs
        all_logits, second, pre = outputs
        rows = {"all": slice(0, n), "last": slice(n - 1, n), None: slice(0, 0)}[logits]
        if self.graph_type == GraphType.MTP:  # (logits, nextn, pre_norm), both hidden states returned
            hidden = names = ("nextn", "pre_norm")
        else:
            names = ("post_norm", "pre_norm")
        named = dict(zip(names, (second, pre)))
        # copies: the static outputs are overwritten by the next replay
        return DecodeOutput(logits=all_logits[rows].clone(), hidden={h: named[h].clone() for h in hidden})
