"""`specconv quantize`: an existing F32 / F16 / BF16 GGUF (ours or anyone's) -> a K-quant file, with
the rules and bytes of llama.cpp's quantize tool (convert/quant_rules.py), every KV pair kept.

The input is memory-mapped (one file or split shards, given by the first); each tensor is cut into
chunks that the converter's workers encode (convert/kernels.py: the K-quant encoders, gguf.quants
for the fallback types) and write at their place in the output, as a conversion does. Tensors the
tool leaves alone are copied. A tensor already quantized (Q8_0, a K-quant…) is refused unless
`allow_requantize`: its values are then dequantized with gguf.quants first — llama.cpp dequantizes
with its own code, so requantized bytes are not claimed to equal the tool's.

With an importance matrix (convert/imatrix.py) each quantized tensor found in it is encoded with its
weights (whole rows; a 3-D expert tensor's rows use their expert's slice), the Q2_K_S file type
becomes possible, and the tool's `quantize.imatrix.*` KV pairs follow `general.file_type`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError
from specconv.runtime.gguf_reader import GgufTensor, open_gguf

from .imatrix import Imatrix, encode_weighted_run, imatrix_plan
from .kernels import encode_run, encoded_size
from .outtype import INTEGER_TYPES, nbytes
from .pipeline import OrderedPool, default_workers
from .quant_rules import IQ4_TYPES, KQUANT_FILE_TYPES, Hparams, TensorInfo, choose_types, ggml_shape, loader_order, \
    requantized_kv
from .stream import CHUNK
from .writer import AtomicOutputs, GgufOutput, TensorEntry

Q = GGMLQuantizationType
_FLOAT_VIEWS = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}  # BF16 as its bits, as kernels expect


def _with_types(kv: list[MetaKV], file_type: int, extra: list[MetaKV] = ()) -> list[MetaKV]:
    """The input's KV with `general.quantization_version` and `general.file_type` (u32) set, as the
    tool sets them: removed where they were and appended in that order, then `extra` (the imatrix
    keys, which the tool sets last)."""
    moved = {"general.quantization_version", "general.file_type", *(e.key for e in extra)}
    kept = [e for e in kv if e.key not in moved]
    return requantized_kv(kept + [MetaKV("general.quantization_version", 2, GGUFValueType.UINT32),
                                  MetaKV("general.file_type", file_type, GGUFValueType.UINT32)]) + list(extra)


def plan_requantize(src: Path, dst: Path, file_type: str, allow_requantize: bool = False,
                    split_max_size: int = 0, imatrix: Imatrix | None = None):
    """(the input file, the output, {name: (tensor, new type, weights or None)}) in the tool's order;
    nothing written."""
    key = file_type.lower()
    if key not in KQUANT_FILE_TYPES:
        raise SpecconvError(f"unknown file type {file_type!r}; choose one of {', '.join(KQUANT_FILE_TYPES)}")
    f = open_gguf(src)
    infos = [TensorInfo(t.name, t.torch_shape, t.ggml_type) for t in f]
    types = choose_types(key, Hparams.from_kv(f.arch, list(f.kv.values())), infos, imatrix is not None)
    changed = [t for t in f if types[t.name] != t.ggml_type]
    quantized = [t for t in changed if t.ggml_type not in _FLOAT_VIEWS]
    if quantized and not allow_requantize:
        t = quantized[0]
        raise SpecconvError(f"{Path(src).name}: {t.name} is already {t.ggml_type.name}; quantizing a quantized file "
                            f"loses precision twice (use --allow-requantize to do it anyway)")
    order = loader_order(list(f.tensors))
    weights = imatrix_plan(key, imatrix, [(n, f.tensors[n].torch_shape, types[n]) for n in order
                                          if types[n] != f.tensors[n].ggml_type])
    entries = [TensorEntry(n, ggml_shape(f.tensors[n].torch_shape), types[n],
                           nbytes(f.tensors[n].torch_shape, types[n])) for n in order]
    kv = _with_types([e for e in f.kv.values()], int(KQUANT_FILE_TYPES[key][0]), imatrix.kv() if imatrix else [])
    output = GgufOutput(Path(dst), f.arch, kv, entries, split_max_size)
    return f, output, {n: (f.tensors[n], types[n], weights.get(n)) for n in order}


def run_requantize(src: Path, dst: Path, file_type: str, *, allow_requantize: bool = False, overwrite: bool = False,
                   threads: int = 0, split_max_size: int = 0, imatrix: Imatrix | None = None,
                   on_bytes: Callable[[str, int], None] | None = None
                   ) -> tuple[list[Path], dict[str, GGMLQuantizationType]]:
    """Write the K-quant file; returns its paths (shards included) and each tensor's type. Atomic:
    nothing is left on error."""
    _, output, work = plan_requantize(src, dst, file_type, allow_requantize, split_max_size, imatrix)
    with AtomicOutputs([output], overwrite=overwrite), OrderedPool(threads or default_workers()) as pool:
        for name, (tensor, new_type, weights) in work.items():
            _queue(pool, output, tensor, new_type, on_bytes, weights)
    return output.final_paths, {name: new_type for name, (_, new_type, _) in work.items()}


def _queue(pool: OrderedPool, output: GgufOutput, tensor: GgufTensor, new_type: GGMLQuantizationType,
           on_bytes, weights: np.ndarray | None = None) -> None:
    name = tensor.name
    place = output.place(name)

    def written(n: int) -> None:
        output.written(n)
        if on_bytes is not None:
            on_bytes(name, n)

    pool.after(lambda: output.begin(name, place.nbytes))
    raw = tensor.raw()
    if new_type == tensor.ggml_type or new_type in INTEGER_TYPES:
        for start in range(0, raw.size, 4 * CHUNK):  # unchanged: the bytes as they are
            piece = raw[start:start + 4 * CHUNK]
            pool.submit(lambda piece=piece, start=start: _write(output, place, start, np.array(piece)), written)
    else:
        if tensor.ggml_type in _FLOAT_VIEWS:
            values = raw.view(_FLOAT_VIEWS[tensor.ggml_type])
        else:  # --allow-requantize: gguf.quants' dequantization
            values = tensor.to_float32().reshape(-1)
        row = tensor.shape[0]
        step = max(row, CHUNK // row * row)  # whole rows per chunk: blocks never span rows
        offset = 0
        for start in range(0, values.size, step):
            chunk = values[start:start + step]
            if weights is None and new_type not in IQ4_TYPES:
                job = lambda chunk=chunk, offset=offset: _write(output, place, offset,  # noqa: E731
                                                                encode_run(np.array(chunk), new_type))
            else:  # whole rows of one tensor: row start // row, experts of shape[1] rows each
                job = lambda chunk=chunk, offset=offset, first=start // row: _write(  # noqa: E731
                    output, place, offset, encode_weighted_run(np.array(chunk), new_type, weights, row,
                                                               tensor.shape[1], first))
            pool.submit(job, written)
            offset += encoded_size(chunk.size, new_type)
    pool.after(output.end)


def _write(output: GgufOutput, place, offset: int, data: np.ndarray) -> int:
    output.write_at(place, offset, data)
    return data.nbytes
