"""Streaming one planned tensor: sources -> runs of output values -> encoded chunks -> every file holding it.

Memory is what this module is about. A tensor's output values are described as *runs*: tensors
whose flat concatenation is the output. For an unchanged tensor the run is a view over the
checkpoint's memory map (no copy); for a stack of experts the runs are the experts' own views; a
layout-only transform (re-tiling, slicing, ...) runs once in the stored dtype; only value-changing
transforms (small tensors such as norms) see float32 copies; a slice of a fused tensor streams as
the contiguous blocks it is made of. Runs are cut into chunks of CHUNK elements; a worker reads a
chunk of a view from the file into a pool buffer (a positioned read: the mapped pages are never
touched), encodes it and writes it at its place in every output file (a positioned write), so a chunk
is in memory only while one worker handles it. The pages a copying transform did touch are released
when its source is done. So the resident memory of a conversion is bounded by two buffers per worker
plus the largest tensor a transform has to reorder, whatever the size of the model (docs/convert.md,
"Throughput and memory").
"""

from __future__ import annotations

from collections import Counter, deque
from itertools import accumulate
from typing import Callable, Sequence

import numpy as np

from specconv.archs import transforms as tf
from specconv.archs.base import TensorPlan
from specconv.archs.errors import SpecconvError

from .checkpoint import FLOAT_DTYPES, CheckpointReader
from .kernels import PIECE, encode_run, encoded_size, passthrough
from .outtype import INTEGER_TYPES, encode_integer
from .pipeline import OrderedPool
from .quant_rules import IQ4_TYPES
from .writer import GgufOutput, Place

CHUNK = 4 * PIECE  # elements per encoding job: 1M, i.e. at most 4 MB of output per chunk in flight
MIN_RUN = 4096  # a view made of smaller blocks is copied rather than streamed block by block


class Sources:
    """The checkpoint tensors a conversion reads, each released once its last consumer is done."""

    def __init__(self, reader: CheckpointReader, raw_of: dict[str, str], needed: Sequence[TensorPlan]):
        self.reader, self.raw_of = reader, raw_of
        self.uses = Counter(s for p in needed for s in p.sources)
        self._float32: dict[str, np.ndarray] = {}  # copies kept for a later value transform

    def stored(self, name: str) -> str:
        return self.reader.tensors[self.raw_of[name]].dtype

    def view(self, name: str) -> np.ndarray:
        return self.reader.view(self.raw_of[name])

    def float32(self, name: str) -> np.ndarray:
        if name not in self._float32:
            self._float32[name] = self.reader.read_tensor(self.raw_of[name])
        return self._float32[name]

    def prefetch(self, plan: TensorPlan) -> None:
        for s in plan.sources:
            self.reader.prefetch(self.raw_of[s])

    def release_all(self, plan: TensorPlan) -> None:
        """The pages of every source (a copying transform has read them all already)."""
        for s in plan.sources:
            self.reader.release(self.raw_of[s])

    def done(self, plan: TensorPlan) -> None:
        for s in plan.sources:
            self.uses[s] -= 1
            if self.uses[s] <= 0:
                self._float32.pop(s, None)
                self.reader.release(self.raw_of[s])


def output_runs(plan: TensorPlan, sources: Sources) -> list[np.ndarray]:
    """Tensors whose flat concatenation is the output's values (torch order), in a float dtype."""
    layout = tf.is_layout_only(plan.transform) and all(sources.stored(s) in FLOAT_DTYPES for s in plan.sources)
    if layout:
        inputs = [sources.view(s) for s in plan.sources]
    else:
        inputs = [sources.float32(s) for s in plan.sources]
    if tf.is_concatenation(plan.transform):
        runs = inputs
        shape = (len(runs), *runs[0].shape) if runs and all(r.shape == runs[0].shape for r in runs) else None
    else:
        result = np.asarray(plan.transform(inputs))
        runs, shape = contiguous_runs(result), tuple(result.shape)
    if shape is None or tuple(shape) != tuple(plan.shape):
        raise SpecconvError(f"internal: {plan.name} came out as {list(shape) if shape else '?'}, "
                            f"planned {list(plan.shape)}")
    if layout and not any(np.may_share_memory(r, i) for r in runs for i in inputs):
        sources.release_all(plan)  # a copy was made: the mapped source pages are no longer needed
    return runs


def contiguous_runs(t: np.ndarray) -> list[np.ndarray]:
    """A view as the contiguous blocks it is made of, in order (e.g. the gate half of every expert of a
    fused [E, 2F, H] tensor: E blocks); a view that is not blocks of rows (a transpose) is copied."""
    if t.flags.c_contiguous:
        return [t]
    if t.ndim >= 2 and t[0].size >= MIN_RUN and t[0].flags.c_contiguous:
        return [row for i in range(t.shape[0]) for row in contiguous_runs(t[i])]
    return [np.ascontiguousarray(t)]


class Buffers:
    """Buffers for chunks read and encoded, reused: a fresh multi-MB allocation is page faults, and
    page-table changes stall every thread of the process. At most two per worker are in use (the
    chunk it read and its encoding), both given back once the chunk is written."""

    def __init__(self):
        self._free: deque[np.ndarray] = deque()

    def take(self, nbytes: int) -> np.ndarray:
        try:
            buf = self._free.pop()
        except IndexError:
            buf = np.empty(0, dtype=np.uint8)
        if buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]

    def give(self, data: np.ndarray) -> None:
        self._free.append(data.base if isinstance(data.base, np.ndarray) else data)


def stream_tensor(plan: TensorPlan, ggml_type, nbytes: int, sources: Sources, outputs: Sequence[GgufOutput],
                  pool: OrderedPool, buffers: Buffers, on_bytes: Callable[[str, int], None] | None = None,
                  weights: np.ndarray | None = None) -> None:
    """Queue the encoding and writing of one tensor into every output that holds it.

    Each chunk is read, encoded and written at its place in every file by the worker that took it;
    this thread only checks, in order, that every tensor received exactly its bytes."""
    name = plan.name
    places = [(o, o.place(name)) for o in outputs]

    def written(n: int) -> None:
        for o in outputs:
            o.written(n)
        if on_bytes is not None:
            on_bytes(name, n * len(outputs))

    def finish() -> None:
        for o in outputs:
            o.end()
        sources.done(plan)

    pool.after(lambda: [o.begin(name, nbytes) for o in outputs])
    if ggml_type in INTEGER_TYPES:  # exact integers (e.g. EAGLE-3 d2t): small, made here, never via float
        values = np.asarray(plan.transform([sources.reader.read_tensor(sources.raw_of[s]) for s in plan.sources]))
        if tuple(values.shape) != tuple(plan.shape):
            raise SpecconvError(f"internal: {name} came out as {list(values.shape)}, planned {list(plan.shape)}")
        data = encode_integer(values, ggml_type)
        pool.submit(lambda: _write(places, 0, data), written)
    elif weights is not None or ggml_type in IQ4_TYPES:  # --imatrix (or IQ4): whole rows (convert/imatrix.py)
        _stream_weighted(plan, ggml_type, nbytes, sources, places, pool, buffers, written, weights)
    else:
        chunks = [flat[start:start + CHUNK] for run in output_runs(plan, sources)
                  for flat in [run.reshape(-1)] for start in range(0, flat.size, CHUNK)]
        offsets = list(accumulate((encoded_size(c.size, ggml_type) for c in chunks), initial=0))
        if offsets[-1] != nbytes:
            raise SpecconvError(f"internal: {name} encodes to {offsets[-1]} bytes, planned {nbytes}")
        for chunk, offset in zip(chunks, offsets):
            pool.submit(_encoder(sources.reader, chunk, ggml_type, buffers, places, offset), written)
    pool.after(finish)


def _stream_weighted(plan: TensorPlan, ggml_type, nbytes: int, sources: Sources, places, pool: OrderedPool,
                     buffers: Buffers, written, weights: np.ndarray | None) -> None:
    """Chunks of whole rows encoded with importance weights (or IQ4 without); a 3-D tensor's rows use
    their expert's slice. A mapped chunk is read into a pool buffer first, as `_encoder` does."""
    from .imatrix import encode_weighted_run

    row = int(plan.shape[-1])
    rows_per_group = int(plan.shape[-2])
    step = max(row, CHUNK // row * row)
    element = offset = 0
    for run in output_runs(plan, sources):
        flat = run.reshape(-1)
        if flat.size % row:
            raise SpecconvError(f"internal: {plan.name} streams a run of {flat.size} values, not whole rows of {row}")
        for start in range(0, flat.size, step):
            chunk = flat[start:start + step]

            def job(chunk=chunk, offset=offset, first=(element + start) // row) -> int:
                reader = sources.reader
                staged = buffers.take(chunk.nbytes) if reader.is_mapped(chunk) else None
                if staged is not None:
                    reader.read_into(chunk, staged)
                values = np.ascontiguousarray(chunk) if staged is None else staged.view(chunk.dtype)
                n = _write(places, offset, encode_weighted_run(values, ggml_type, weights, row, rows_per_group, first))
                if staged is not None:
                    buffers.give(staged)
                return n
            pool.submit(job, written)
            offset += encoded_size(chunk.size, ggml_type)
        element += flat.size
    if offset != nbytes:
        raise SpecconvError(f"internal: {plan.name} encodes to {offset} bytes, planned {nbytes}")


def _write(places: Sequence[tuple[GgufOutput, Place]], offset: int, data: np.ndarray) -> int:
    for output, place in places:
        output.write_at(place, offset, data)
    return data.nbytes


def _encoder(reader: CheckpointReader, chunk: np.ndarray, ggml_type, buffers: Buffers,
             places: Sequence[tuple[GgufOutput, Place]], offset: int) -> Callable[[], int]:
    """The job for one chunk: read it, encode it, write it at `offset` in its tensor in every file;
    returns the number of bytes written per file.

    A chunk lying in the checkpoint's memory map is first read into a pool buffer with a positioned
    read (a plain copy from the page cache, like `cp`: no page faults, no mapped pages to release);
    when encoding keeps its bytes (BF16 from BF16, F32 from F32) that buffer is what gets written.
    """
    def job() -> int:
        staged = buffers.take(chunk.nbytes) if reader.is_mapped(chunk) else None
        if staged is not None:
            reader.read_into(chunk, staged)
        values = chunk if staged is None else staged.view(chunk.dtype)
        encoded = None
        data = passthrough(values, ggml_type)
        if data is None:
            data = encoded = encode_run(values, ggml_type, buffers.take(encoded_size(chunk.size, ggml_type)))
        n = _write(places, offset, data)
        for used in (staged, encoded):
            if used is not None:
                buffers.give(used)
        return n
    return job
