"""A weight kept in its GGUF storage type and dequantized when a graph uses it.

`StoredWeight` holds a tensor's stored bytes as a uint8 tensor [..., row_bytes] — a view of the
memory-mapped file on the CPU, or a copy on the compute device — and turns them into values of the
compute dtype only for the rows an operation needs, through the backend of the device the values
are computed on (runtime/backend.py):

* `linear(x, W)` (runtime/graphs/ops.py -> the backend's `linear`) multiplies by W without W ever
  existing whole in float32 (fused kernels, or a chunk of rows at a time), once per forward however
  many tokens the batch holds;
* `W[token_ids]` dequantizes only the embedding rows asked for;
* `W[e]` is expert e of a 3-D expert tensor, still packed, and `W.take(index)` the experts of an
  index tensor (no host read of the index): a MoE forward touches only the routed experts;
* `W.to(dtype)` and `dense(W)` give the whole tensor dequantized, for the small or irregular uses
  that ask for it by name. Any other torch function given W is an error naming the function
  (`__torch_function__`): a silent whole-tensor dequantization in a forward is a bug.

Where the bytes live and where the values are computed are separate: with offloading the bytes
stay in the memory map and each use brings the rows it needs to the compute device.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from specconv.archs.errors import SpecconvError
from specconv.runtime import dequant
from specconv.runtime.backend import for_device
from specconv.runtime.placement import active_device

# Values dequantized per piece of a chunked product (4 MB in float32): big enough that the
# matrix product stays efficient, small enough to stay in cache and bound the temporaries.
CHUNK_ELEMENTS = 1 << 20


class ReadCounter:
    """Bytes of stored weights read by dequantization (what a forward pulls from the file)."""

    def __init__(self):
        self.bytes = 0

    def reset(self) -> int:
        seen, self.bytes = self.bytes, 0
        return seen


def _same_bytes(values: torch.Tensor, raw: torch.Tensor) -> bool:
    """Whether `values` reads raw's memory (a view, not a copy). Meta tensors have no memory to compare:
    there the dequantizer's own rule says so (a float type read in its own dtype is a view)."""
    if values.device != raw.device:
        return False
    return raw.is_meta or values.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


class StoredWeight:
    """One GGUF tensor in its stored type; `shape` is the torch-order shape of its values."""

    __slots__ = ("raw", "qtype", "shape", "dtype", "device", "counter", "_view")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, counter: ReadCounter | None = None):
        self.raw = raw  # uint8 [*shape[:-1], row_bytes], on `device` or on the CPU (offloaded)
        self.qtype = qtype
        self.shape = torch.Size(shape)
        self.dtype = dtype  # the values' dtype when used
        self.device = torch.device(device)  # where the values are computed
        self.counter = counter
        self._view = None  # the values as a view of `raw` (a float type in its own dtype), once built

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
        return for_device(device).dequantize_rows(raw, self.qtype, dtype or self.dtype)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All values, dequantized into `dtype` (default: the weight's compute dtype). A float type read
        in its own dtype is a view of the stored bytes: built once and kept, so each product by a small
        float weight does not pay the reinterpretation again (a decode step of a small model makes
        dozens)."""
        view = self._view
        if view is not None and view.dtype == (dtype or self.dtype) and view.device == (active_device() or self.device):
            if self.counter is not None:
                self.counter.bytes += self.raw.numel()
            return view
        values = self._values(self.raw, dtype).reshape(self.shape)
        if dequant.is_view(self.qtype, values.dtype) and _same_bytes(values, self.raw):
            self._view = values
        return values

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

    def take(self, index: torch.Tensor) -> "StoredWeight":
        """The experts `index` (a 1-D tensor, on any device: no host read) of a 3-D expert tensor,
        still packed: [len(index), out, in]."""
        picked = self.raw.index_select(0, index.to(self.raw.device))
        return StoredWeight(picked, self.qtype, (index.shape[0], *self.shape[1:]), self.dtype, self.device,
                            self.counter)

    def row_chunks(self, dtype: torch.dtype | None = None, elements: int | None = None):
        """(start, values [rows, in]) pieces of a 2-D weight, each dequantized when reached."""
        n_out, n_in = self.shape
        step = max(1, (elements or CHUNK_ELEMENTS) // max(1, n_in))
        for start in range(0, n_out, step):
            yield start, self._values(self.raw[start:start + step], dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Graphs multiply by stored weights through ops.linear / ops.moe and take values through
        # .to() / dense(); anything else would dequantize the whole tensor behind their back.
        name = torch.overrides.resolve_name(func) or str(func)
        raise SpecconvError(f"{name} was given a StoredWeight: multiply by it through ops.linear or "
                            f"ops.moe, or take its values with .to(dtype) / ops.dense (a whole-tensor dequantization)")
