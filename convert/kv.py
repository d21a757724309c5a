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
from specconv.archs.config_reader import ConfigReader

from .checkpoint import read_config


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
    ConfigReader(read_config(model_dir)).string("_name_or_path", default=None)  # gguf-py reads it as a string
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


# Arch keys llama.cpp's converter writes in its generic `TextModel.set_gguf_parameters`, which ends
# with `general.file_type`; architecture-specific keys follow it.
_GENERIC_SUFFIXES = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.causal", "rope.dimension_sections", "rope.freq_base",
    "rope.freq_base_swa", "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "expert_count",
    "expert_used_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
    "attention.key_length", "attention.value_length",
}


def with_file_type(arch: str, arch_kv: list[MetaKV], file_type: int) -> list[MetaKV]:
    """The arch KV with `general.file_type` where llama.cpp's converter puts it (after the generic
    keys) and `general.quantization_version` at the end, so files match the converter's byte for byte."""
    writer = GGUFWriter(None, "capture")
    writer.add_file_type(file_type)
    ftype = captured_kv(writer)
    writer = GGUFWriter(None, "capture")
    writer.add_quantization_version(GGML_QUANT_VERSION)
    qver = captured_kv(writer)
    generic = [i for i, e in enumerate(arch_kv) if e.key.startswith(arch + ".")
               and (e.key[len(arch) + 1:] in _GENERIC_SUFFIXES or e.key[len(arch) + 1:].startswith("rope.scaling."))]
    at = generic[-1] + 1 if generic else len(arch_kv)
    return arch_kv[:at] + ftype + arch_kv[at:] + qver
