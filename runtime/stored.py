"""A weight kept in its GGUF storage type and dequantized when a graph uses it.

`StoredWeight` holds a tensor's stored bytes as a uint8 tensor [..., row_bytes] — a view of the
memory-mapped file on the CPU, or a copy on the compute device — and turns them into values of the
compute dtype only for the rows an operation needs:

* `linear(x, W)` (runtime/graphs/ops.py) dequantizes W a chunk of rows at a time and multiplies
  each chunk as it comes, so a 2 GB output head never exists in float32 at once and each weight is
  dequantized once per forward, however many tokens the batch holds;
* `W[token_ids]` dequantizes only the embedding rows asked for;
* `W[e]` is expert e of a 3-D expert tensor, still packed: a MoE forward touches only the experts
  its tokens are routed to;
* `W.to(dtype)`, `dense(W)` and any torch function given W (through `__torch_function__`) get the
  whole tensor dequantized, for the small or irregular uses.

Where the bytes live and where the values are computed are separate: with offloading the bytes
stay in the memory map and each use brings the rows it needs to the compute device.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

import threading

from specconv.runtime import dequant_native
from specconv.runtime.dequant import dequantize_rows
from specconv.runtime.placement import active_device

# Values dequantized per piece of a chunked product (4 MB in float32): big enough that the
# matrix product stays efficient, small enough to stay in cache and bound the temporaries.
CHUNK_ELEMENTS = 1 << 20
# A matrix of at most this many values is dequantized whole and multiplied in one product (what a
# dense weight computes, bit for bit); larger ones (a MoE expert's slice included) take the chunked
# or native paths below.
WHOLE_MAX_ELEMENTS = 1 << 16

# The CPU products of larger matrices whose type the native dequantizer covers (float32
# activations; benchmarks/dequant_native.py, docs/runtime.md "Native dequantization"):
# * up to FUSED_MAX_ROWS rows of activations (decode, the check of k drafts, short prompts) and a
#   type in FUSED_TYPES with a vector kernel on this CPU (dequant_native.has_fused_kernel: AVX-512
#   or AVX2): the fused native kernel, which decodes each weight block once in registers and
#   multiplies it with every row (up to 9 per pass over the weights; the float32 matrix is never
#   written). Its sums are its own (FMA, vector lanes), so it equals the BLAS product within
#   float32 summation noise. 16: measured faster than the chunked path below up to 16 rows
#   (3584 x 1024 Q8_0 / Q4_K / Q6_K, one thread), level with it at 24;
# * otherwise: pieces of NATIVE_CHUNK_ELEMENTS values dequantized natively into one float32 buffer
#   per thread, reused, which stays in the L2 cache while the BLAS product reads it.
FUSED_MAX_ROWS = 16
FUSED_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                         GGMLQuantizationType.Q6_K, GGMLQuantizationType.BF16, GGMLQuantizationType.F16})
NATIVE_CHUNK_ELEMENTS = 1 << 18
_buffers = threading.local()


class ReadCounter:
    """Bytes of stored weights read by dequantization (what a forward pulls from the file)."""

    def __init__(self):
        self.bytes = 0

    def reset(self) -> int:
        seen, self.bytes = self.bytes, 0
        return seen


class StoredWeight:
    """One GGUF tensor in its stored type; `shape` is the torch-order shape of its values."""

    __slots__ = ("raw", "qtype", "shape", "dtype", "device", "counter")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, counter: ReadCounter | None = None):
        self.raw = raw  # uint8 [*shape[:-1], row_bytes], on `device` or on the CPU (offloaded)
        self.qtype = qtype
        self.shape = torch.Size(shape)
        self.dtype = dtype  # the values' dtype when used
        self.device = torch.device(device)  # where the values are computed
        self.counter = counter

    # ---- tensor-like surface --------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def stored_bytes(self) -> int:
        return self.raw.numel()

    def __repr__(self):
        return (f"StoredWeight({self.qtype.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, stored on {self.raw.device})")

    # ---- values ---------------------------------------------------------------------------------
    def _values(self, raw: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if self.counter is not None:
            self.counter.bytes += raw.numel()
        device = active_device() or self.device  # a block running on another device (placement.py)
        if raw.device != device:  # offloaded: bring only these bytes to the compute device
            raw = raw.to(device, non_blocking=True)
        return dequantize_rows(raw, self.qtype, dtype or self.dtype)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All values, dequantized into `dtype` (default: the weight's compute dtype)."""
        return self._values(self.raw, dtype).reshape(self.shape)

    def to(self, *args, **kwargs) -> torch.Tensor:
        """As torch.Tensor.to: the values, dequantized, in the dtype / on the device asked for."""
        dtype = kwargs.pop("dtype", None)
        device = kwargs.pop("device", None)
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = a
            elif isinstance(a, torch.Tensor):
                dtype, device = a.dtype, a.device
        values = self.dense(dtype)
        return values if device is None else values.to(device, **kwargs)

    def float(self) -> torch.Tensor:
        return self.dense(torch.float32)

    def double(self) -> torch.Tensor:
        return self.dense(torch.float64)

    def cpu(self) -> torch.Tensor:
        return self.dense().cpu()

    def numpy(self):
        return self.cpu().numpy()

    def t(self) -> torch.Tensor:
        return self.dense().t()

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `index` of a 2-D weight (embedding lookup), dequantizing only those rows."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = self.raw[index.to(self.raw.device)]
        return self._values(picked, dtype).reshape(*index.shape, self.shape[-1])

    def __getitem__(self, key):
        if isinstance(key, int) and self.ndim >= 3:  # one expert of a 3-D expert tensor, still packed
            if not -self.shape[0] <= key < self.shape[0]:
                raise IndexError(f"expert {key} out of range for {tuple(self.shape)}")
            return StoredWeight(self.raw[key], self.qtype, tuple(self.shape[1:]), self.dtype, self.device,
                                self.counter)
        if self.ndim == 2 and (isinstance(key, (list, torch.Tensor)) or isinstance(key, int)):
            return self.rows(torch.as_tensor(key))
        return self.dense()[key]

    def row_chunks(self, dtype: torch.dtype | None = None, elements: int = CHUNK_ELEMENTS):
        """(start, values [rows, in]) pieces of a 2-D weight, each dequantized when reached."""
        n_out, n_in = self.shape
        step = max(1, elements // max(1, n_in))
        for start in range(0, n_out, step):
            yield start, self._values(self.raw[start:start + step], dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Any torch function given a stored weight sees its dequantized values.
        def unpack(a):
            if isinstance(a, StoredWeight):
                return a.dense()
            if isinstance(a, (list, tuple)):
                return type(a)(unpack(x) for x in a)
            return a

        return func(*unpack(args), **{k: unpack(v) for k, v in (kwargs or {}).items()})


def matmul_t(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    """x @ wᵀ for a stored [out, in] matrix, dequantized a chunk of rows at a time."""
    if w.ndim != 2:
        raise ValueError(f"linear needs a 2-D weight, got {tuple(w.shape)}")
    n_out = w.shape[0]
    if w.numel() <= WHOLE_MAX_ELEMENTS:
        return x @ w.dense(x.dtype).t()
    native = _native_on_cpu(x, w)
    rows = x.numel() // w.shape[1] if w.shape[1] else 0
    if native and rows <= FUSED_MAX_ROWS:
        return _native_matmul_t(x, w)
    if w.numel() <= CHUNK_ELEMENTS:  # several rows of a mid-size matrix (an expert): one product
        return x @ w.dense(x.dtype).t()
    if native:
        return _native_matmul_t(x, w)
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    for start, values in w.row_chunks(x.dtype):
        out[..., start:start + values.shape[0]] = x @ values.t()
    return out


def _native_on_cpu(x: torch.Tensor, w: StoredWeight) -> bool:
    """Whether this product runs on the CPU from stored bytes there, in a type the native
    dequantizer covers, with float32 activations."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and w.raw.device.type == "cpu"
            and (active_device() or w.device).type == "cpu" and dequant_native.covers(w.qtype))


def _chunk_buffer(n: int) -> torch.Tensor:
    """This thread's float32 buffer for dequantized pieces, at least n values (grown, never shrunk)."""
    buffer = getattr(_buffers, "values", None)
    if buffer is None or buffer.numel() < n:
        buffer = _buffers.values = torch.empty(n, dtype=torch.float32)
    return buffer


def _native_matmul_t(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    n_out, n_in = w.shape
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    if w.counter is not None:
        w.counter.bytes += raw.numel()
    rows = x.numel() // n_in if n_in else 0
    if rows <= FUSED_MAX_ROWS and w.qtype in FUSED_TYPES and dequant_native.has_fused_kernel(w.qtype):
        fused = dequant_native.matmul_t(x, raw, w.qtype, n_in)
        if fused is not None:
            return fused
    xs = x.reshape(-1, n_in)
    out = torch.empty(xs.shape[0], n_out, dtype=torch.float32)
    step = max(1, NATIVE_CHUNK_ELEMENTS // max(1, n_in))
    buffer = _chunk_buffer(step * n_in)
    decode = dequant_native.chunk_decoder(w.qtype, raw, buffer)  # the checks done once, not per piece
    for start in range(0, n_out, step):
        rows = min(step, n_out - start)
        values = decode(start, rows).view(rows, n_in)
        torch.mm(xs, values.t(), out=out[:, start:start + rows])  # straight into its columns
    return out.reshape(*x.shape[:-1], n_out)
