"""KV helpers: capture what gguf-py's typed `add_*` calls produce, and the `general.*` keys (§1).

gguf-py knows the value type of every standard key; rather than re-encode that knowledge, the
engine lets a path-less GGUFWriter collect the pairs and turns them into `MetaKV`s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFType, GGUFWriter
from gguf.metadata import Metadata
from gguf.utility import size_label

from specconv.archs.base import MetaKV


def captured_kv(writer: GGUFWriter) -> list[MetaKV]:
    """The KV pairs added to a path-less writer, in order (its automatic `general.architecture` dropped)."""
    return [MetaKV(key, v.value, v.type, v.sub_type) for key, v in writer.kv_data[0].items()
            if key != "general.architecture"]


def parameter_label(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """The size label gguf-py derives from tensor shapes (torch order), e.g. "250K" or "4x162K"."""
    counter = GGUFWriter(None, "counter")
    for name, shape in tensors:
        counter.add_tensor_info(name, shape, np.dtype(np.float32), 0)
    return size_label(*counter.get_total_parameter_count())


def load_model_metadata(model_dir: Path, total_params: int) -> Metadata:
    """Authorship/name metadata from the model card and config, as llama.cpp's converter gathers it."""
    meta = Metadata.load(None, model_dir, None, total_params)
    if meta.name is None:
        meta.name = model_dir.name  # the converter's fallback
    return meta


def general_kv(meta: Metadata, label: str) -> list[MetaKV]:
    """`general.type` and the model-card keys; `label` is the file's own size label unless the card has one."""
    writer = GGUFWriter(None, "capture")
    writer.add_type(GGUFType.MODEL)
    own = dataclasses.replace(meta, size_label=meta.size_label or label)
    own.set_gguf_meta_model(writer)
    return captured_kv(writer)


def closing_general_kv(file_type: int) -> list[MetaKV]:
    """`general.file_type` and `general.quantization_version`, written after the arch keys."""
    writer = GGUFWriter(None, "capture")
    writer.add_file_type(file_type)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    return captured_kv(writer)
