"""Load-time checks of a GGUF model, before any tensor is read (llama.cpp's `check_tensor_dims` and
hparams sanity): a hostile or broken file gets a one-line `SpecconvError` naming the file and the
key or tensor, never an exception from deep inside a graph, a hang or an unbounded allocation.

* `check_kv(kv)`: types and ranges of the hyperparameter keys a graph reads (called first thing in
  every `HParams.from_kv`, so nothing there divides by zero or compares a string with an int).
* `read_hparams(file, graph)`: `from_kv` with the file named in its errors.
* `validate_model(file, graph, hparams, needed)`: hparams consistent with each other, every needed
  tensor of the shape the hparams imply (the graph's `expected_shapes`, from its family's tensor
  table, archs/tensor_table.py), element counts without overflow, a storage type the runtime computes with, the
  tokenizer's arrays and special ids.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.errors import SpecconvError

MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # embedding / FFN widths (largest real: ~74k)
MAX_HEADS = 4096
MAX_HEAD_DIM = 8192
MAX_EXPERTS = 1 << 14
MAX_ELEMENTS = 1 << 48  # per tensor: far above any real model, far below an int64 overflow
INTEGER_TYPES = {Q.I8, Q.I16, Q.I32, Q.I64}

# key suffix (after "{arch}.") -> (kind, lo, hi); kinds: int, ints (int or per-layer list), float, bool,
# bools (list), intlist (list), str
_KEYS: dict[str, tuple[str, float, float]] = {
    "block_count": ("int", 1, MAX_LAYERS),
    "nextn_predict_layers": ("int", 0, MAX_LAYERS),
    "context_length": ("int", 0, 1 << 40),
    "vocab_size": ("int", 0, 1 << 31),
    "embedding_length": ("int", 1, MAX_WIDTH),
    "embedding_length_out": ("int", 0, MAX_WIDTH),
    "embedding_length_per_layer_input": ("int", 0, MAX_WIDTH),
    "feed_forward_length": ("ints", 0, MAX_WIDTH),
    "attention.head_count": ("ints", 1, MAX_HEADS),
    "attention.head_count_kv": ("ints", 1, MAX_HEADS),
    "attention.key_length": ("int", 1, MAX_HEAD_DIM),
    "attention.value_length": ("int", 1, MAX_HEAD_DIM),
    "attention.key_length_swa": ("int", 1, MAX_HEAD_DIM),
    "attention.value_length_swa": ("int", 1, MAX_HEAD_DIM),
    "attention.key_length_mla": ("int", 1, MAX_HEAD_DIM),
    "attention.value_length_mla": ("int", 1, MAX_HEAD_DIM),
    "attention.q_lora_rank": ("int", 0, MAX_WIDTH),
    "attention.kv_lora_rank": ("int", 1, MAX_WIDTH),
    "attention.layer_norm_rms_epsilon": ("float", 0.0, 1.0),
    "attention.sliding_window": ("int", 1, 1 << 40),
    "attention.sliding_window_pattern": ("bools", 0, 1),
    "attention.shared_kv_layers": ("int", 0, MAX_LAYERS),
    "attention.recurrent_layers": ("bools", 0, 1),
    "full_attention_interval": ("int", 1, MAX_LAYERS),
    "rope.dimension_count": ("int", 0, MAX_HEAD_DIM),
    "rope.dimension_count_swa": ("int", 0, MAX_HEAD_DIM),
    "rope.dimension_sections": ("intlist", 0, MAX_HEAD_DIM),
    "rope.freq_base": ("float", 1e-30, 1e30),
    "rope.freq_base_swa": ("float", 1e-30, 1e30),
    "rope.scaling.type": ("str", 0, 0),
    "rope.scaling.factor": ("float", 1e-30, 1e30),
    "rope.scaling.original_context_length": ("int", 1, 1 << 40),
    "rope.scaling.yarn_beta_fast": ("float", 1e-30, 1e30),
    "rope.scaling.yarn_beta_slow": ("float", 1e-30, 1e30),
    "rope.scaling.yarn_attn_factor": ("float", -1e30, 1e30),
    "rope.scaling.yarn_log_multiplier": ("float", -1e30, 1e30),
    "expert_count": ("int", 0, MAX_EXPERTS),
    "expert_used_count": ("int", 0, MAX_EXPERTS),
    "expert_feed_forward_length": ("int", 0, MAX_WIDTH),
    "expert_shared_feed_forward_length": ("int", 0, MAX_WIDTH),
    "expert_shared_count": ("int", 0, MAX_EXPERTS),
    "expert_group_count": ("int", 0, MAX_EXPERTS),
    "expert_group_used_count": ("int", 0, MAX_EXPERTS),
    "expert_weights_scale": ("float", -1e30, 1e30),
    "expert_weights_norm": ("bool", 0, 1),
    "expert_gating_func": ("int", 0, 1 << 31),
    "leading_dense_block_count": ("int", 0, MAX_LAYERS),
    "final_logit_softcapping": ("float", 0.0, 1e30),
    "ssm.conv_kernel": ("int", 1, 1024),
    "ssm.state_size": ("int", 1, MAX_HEAD_DIM),
    "ssm.group_count": ("int", 1, MAX_HEADS),
    "ssm.time_step_rank": ("int", 1, MAX_HEADS),
    "ssm.inner_size": ("int", 1, MAX_WIDTH),
    "target_layers": ("intlist", -1, MAX_LAYERS),
    "target_hidden_size": ("int", 1, MAX_WIDTH),
    "norm_before_residual": ("bool", 0, 1),
    "norm_before_fc": ("bool", 0, 1),
    "attention.value_scale": ("float", -1e30, 1e30),
    "swiglu_clamp_exp": ("floats", 0.0, 1e30),
    "swiglu_clamp_shexp": ("floats", 0.0, 1e30),
    "attention.indexer.head_count": ("int", 1, MAX_HEADS),
    "attention.indexer.key_length": ("int", 1, MAX_HEAD_DIM),
    "attention.indexer.top_k": ("int", 1, 1 << 40),
    "attention.indexer.types": ("bools", 0, 1),  # one per trunk block (checked in runtime/graphs/dsa.py)
    "attention.causal": ("bool", 0, 1),
    "block_size": ("int", 1, 4096),  # DFlash: tokens drafted per block
    "conv_kernel_size": ("int", 0, 1024),
    "conv_group_size": ("int", 0, MAX_WIDTH),
    "selector_rank": ("int", 0, MAX_WIDTH),
    "selector_top_k": ("int", 0, 1 << 24),
    "logit_scale": ("float", -1e30, 1e30),
    "embedding_scale": ("float", -1e30, 1e30),
}
# Keys a graph takes as per-layer lists are its Graph.PER_LAYER_KEYS (llama.cpp's get_key_or_arr); the
# others need one value. A list has block_count entries (trunk and MTP blocks) unless named in _ANY_LENGTH.
_ANY_LENGTH = {"attention.indexer.types"}
GLOBAL_INT_KEYS = ("tokenizer.ggml.mask_token_id",)  # read with int() by a graph (DFlash)


def _per_layer_keys(arch: str) -> tuple[str, ...]:
    """The keys the arch's graph reads per layer (none for an arch without a graph)."""
    from specconv.runtime import graphs  # imported here: every graph module imports this one

    return graphs.graph_for(arch).PER_LAYER_KEYS if arch in graphs.supported_archs() else ()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_value(key: str, v: Any, kind: str, lo: float, hi: float, arch: str) -> None:
    if kind == "str":
        if not isinstance(v, str):
            raise SpecconvError(f"KV {key} must be a string, found {type(v).__name__}")
        return
    if kind == "bool":
        if not (isinstance(v, bool) or (_is_int(v) and v in (0, 1))):
            raise SpecconvError(f"KV {key} must be a boolean, found {v!r}"[:200])
        return
    if kind in ("bools", "intlist") or (kind in ("ints", "floats") and isinstance(v, list)):
        if not isinstance(v, list):
            raise SpecconvError(f"KV {key} must be an array, found {type(v).__name__}")
        if kind in ("ints", "floats") and key[len(arch) + 1:] not in _per_layer_keys(arch):
            raise SpecconvError(f"KV {key}: the {arch} graph needs one value, found an array")
        if kind == "bools":
            bad = [x for x in v if not (isinstance(x, bool) or (_is_int(x) and x in (0, 1)))]
            if bad:
                raise SpecconvError(f"KV {key} must be an array of booleans, found {bad[0]!r}"[:200])
            return
        for x in v:
            _check_value(key, x, "float" if kind == "floats" else "int", lo, hi, arch)
        return
    if kind in ("int", "ints"):
        if not _is_int(v):
            raise SpecconvError(f"KV {key} must be an integer, found {type(v).__name__} {v!r}"[:200])
        if not lo <= v <= hi:
            raise SpecconvError(f"KV {key} = {v} is outside [{int(lo)}, {int(hi)}]")
        return
    # float, floats
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise SpecconvError(f"KV {key} must be a number, found {type(v).__name__} {v!r}"[:200])
    if not math.isfinite(v) or not lo <= v <= hi:
        raise SpecconvError(f"KV {key} = {v} is outside [{lo:g}, {hi:g}]")


def check_kv(kv: Mapping[str, Any]) -> None:
    """Every hyperparameter key a graph reads has the type and a range it can compute with."""
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise SpecconvError(f"KV general.architecture must be a non-empty string, found {arch!r}"[:200])
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):  # graphs count the vocabulary from it
        raise SpecconvError(f"KV tokenizer.ggml.tokens must be an array, found {type(tokens).__name__}")
    for suffix, (kind, lo, hi) in _KEYS.items():
        key = f"{arch}.{suffix}"
        if key in kv:
            _check_value(key, kv[key], kind, lo, hi, arch)
    # what decides the tensor lists must agree before they are built
    blocks, nextn = kv.get(f"{arch}.block_count"), kv.get(f"{arch}.nextn_predict_layers", 0)
    if _is_int(blocks) and nextn > blocks:
        raise SpecconvError(f"KV {arch}.nextn_predict_layers {nextn} exceeds block_count {blocks}")
    lead = kv.get(f"{arch}.leading_dense_block_count", 0)
    if _is_int(blocks) and nextn and lead > blocks - nextn:  # the MTP block is a MoE block
        raise SpecconvError(f"KV {arch}.leading_dense_block_count {lead} reaches the MTP block {blocks - nextn}")
    for suffix, (kind, _, _) in _KEYS.items():
        v = kv.get(f"{arch}.{suffix}")
        if kind in ("ints", "floats", "bools") and isinstance(v, list) and _is_int(blocks) and len(v) != blocks \
                and suffix not in _ANY_LENGTH:
            raise SpecconvError(f"KV {arch}.{suffix} has {len(v)} entries for block_count {blocks}")
    _check_heads(kv, arch)
    for key in GLOBAL_INT_KEYS:
        if key in kv:
            _check_value(key, kv[key], "int", 0, (1 << 31) - 1, arch)


def _check_heads(kv: Mapping[str, Any], arch: str) -> None:
    """Query heads a multiple of KV heads, block by block where either is a per-layer array."""
    heads, kv_heads = kv.get(f"{arch}.attention.head_count"), kv.get(f"{arch}.attention.head_count_kv")
    if heads is None or kv_heads is None:
        return
    n = max(len(v) if isinstance(v, list) else 1 for v in (heads, kv_heads))
    per_block = [v if isinstance(v, list) else [v] * n for v in (heads, kv_heads)]
    for i, (h, k) in enumerate(zip(*per_block)):
        if h % k:
            where = f" (block {i})" if n > 1 else ""
            raise SpecconvError(f"KV {arch}.attention.head_count {h} is not a multiple of head_count_kv {k}{where}")


def read_hparams(file, graph):
    """`graph.HParams.from_kv(file.kv)`, its errors prefixed with the file's name."""
    try:
        check_kv(file.kv)  # also for graphs whose from_kv reads per-layer keys itself (step35, mimo2)
        return graph.HParams.from_kv(file.kv)
    except SpecconvError as exc:
        raise SpecconvError(_named(file, str(exc))) from None


def _named(file, message: str) -> str:
    name = file.paths[0].name
    return message if message.startswith(name) else f"{name}: {message}"


def validate_model(file, graph, hparams, needed: list[str]) -> None:
    """One-line SpecconvError naming the file and the key or tensor, unless the file can be run."""
    from specconv.runtime.tokenizer import check_tokenizer_kv

    try:
        check_hparams(hparams, file.kv)
        if graph.check_hparams is not None:
            graph.check_hparams(hparams, file.kv)
        for name in needed:
            if name in file.tensors:
                check_tensor_info(name, file.tensors[name], graph.INTEGER_TENSORS)
        expected = graph.expected_shapes(hparams)
        bound: dict[str, int] = {}
        for name in needed:
            if name in expected and name in file.tensors:
                check_shape(name, tuple(int(d) for d in file.tensors[name].shape), expected[name], bound)
        tokens = file.kv.get("tokenizer.ggml.tokens")
        if "tokenizer.ggml.tokens" in file.kv or "tokenizer.ggml.model" in file.kv:
            check_tokenizer_kv(file.kv, supported=False)
            # more rows than tokens is allowed (padded embeddings); a token without a row is not
            if "V" in bound and isinstance(tokens, list) and len(tokens) > bound["V"]:
                raise SpecconvError(f"tokenizer.ggml.tokens has {len(tokens)} entries, more than the {bound['V']} "
                                    f"rows of the embedding and output")
        if graph.check_values is not None:
            graph.check_values(file, hparams, needed)
    except SpecconvError as exc:
        raise SpecconvError(_named(file, str(exc))) from None


def check_tensor_info(name: str, t, integer_ok=()) -> None:
    """Element count without overflow, whole blocks per row, a type the runtime computes with."""
    dims = [int(d) for d in t.shape]
    if not 1 <= len(dims) <= 4:
        raise SpecconvError(f"tensor {name} has {len(dims)} dimensions (1 to 4 expected)")
    if any(d < 1 for d in dims):
        raise SpecconvError(f"tensor {name} has an empty dimension: ggml shape {dims}")
    n = math.prod(dims)
    if n > MAX_ELEMENTS:
        raise SpecconvError(f"tensor {name}: ggml shape {dims} has {n} elements (over {MAX_ELEMENTS})")
    qtype = t.tensor_type
    if qtype not in GGML_QUANT_SIZES:
        raise SpecconvError(f"tensor {name} has type {qtype!r}, which the runtime cannot read")
    block, size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise SpecconvError(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
    nbytes = n // block * size
    stored = t.data.nbytes if hasattr(t, "data") else nbytes
    if stored != nbytes:
        raise SpecconvError(f"tensor {name}: ggml shape {dims} of {qtype.name} needs {nbytes} bytes, "
                            f"the file holds {stored}")
    supported = _computable_types()
    if supported is not None and qtype not in supported and qtype not in INTEGER_TYPES:
        raise SpecconvError(f"tensor {name} has type {qtype.name}, which the runtime cannot compute with")
    if (qtype in INTEGER_TYPES) != (name in integer_ok):
        want = "an integer" if name in integer_ok else "a floating-point or quantized"
        raise SpecconvError(f"tensor {name} has type {qtype.name}; {want} type is expected")


def _computable_types():
    """The storage types the runtime's dequantizer reads (None: unknown here, left to the loader)."""
    try:
        from specconv.runtime.dequant import SUPPORTED
    except ImportError:
        return None
    return SUPPORTED


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_shape(name: str, found: tuple[int, ...], expected, bound: dict[str, int]) -> None:
    """`expected`: one shape, or a list of the shapes a graph accepts."""
    options = expected if isinstance(expected, list) else [expected]
    for option in options:
        want = [bound.get(d, d) if isinstance(d, str) else d for d in option]
        if len(found) == len(want) and all(isinstance(b, str) or a == b for a, b in zip(found, want)):
            for a, b in zip(found, want):
                if isinstance(b, str):
                    bound[b] = a
            return
    shown = " or ".join(_fmt([bound.get(d, "*") if isinstance(d, str) else d for d in o]) for o in options)
    raise SpecconvError(f"tensor {name} has the wrong shape: expected {shown}, found {_fmt(found)} (ggml order)")


def check_rope_width(what: str, rotary_dim: int, head: int) -> None:
    """A rope width the graph slices a head by: even and within the head."""
    if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head:
        raise SpecconvError(f"{what} {rotary_dim} must be even and at most the head size {head}")


def check_hparams(hp, kv: Mapping[str, Any]) -> None:
    """Hyperparameters consistent with each other (what the graphs divide, index and slice by); a
    graph's own checks are its `check_hparams`."""
    if hp.num_hidden_layers < 0 or hp.num_nextn_predict_layers < 0:
        raise SpecconvError(f"{hp.arch}: block_count is smaller than nextn_predict_layers")
    kv_heads = hp.per_block(hp.num_key_value_heads)
    for i, (heads, kv_count) in enumerate(zip(hp.per_block(hp.num_attention_heads), kv_heads)):
        if kv_count and (heads < 1 or heads % kv_count):  # 0: a family without these heads
            where = f" (block {i})" if len(set(kv_heads)) > 1 else ""
            raise SpecconvError(f"{hp.arch}.attention.head_count {heads} is not a multiple of head_count_kv "
                                f"{kv_count}{where}")
    head_dims = [d for d in hp.per_block(hp.head_dim) if d]
    if hp.rotary_dim is not None and head_dims:
        if hp.rotary_dim % 2 or hp.rotary_dim > min(head_dims):
            raise SpecconvError(f"{hp.arch}.rope.dimension_count {hp.rotary_dim} must be even and at most the head size "
                                f"{min(head_dims)}")
        sections = kv.get(f"{hp.arch}.rope.dimension_sections")
        if isinstance(sections, list) and 2 * sum(sections) > hp.rotary_dim:
            raise SpecconvError(f"{hp.arch}.rope.dimension_sections {sections} do not fit rope.dimension_count "
                                f"{hp.rotary_dim} (2 x their sum must be at most it)")
    if hp.num_experts and not 1 <= hp.num_experts_per_tok <= hp.num_experts:
        raise SpecconvError(f"{hp.arch}.expert_used_count {hp.num_experts_per_tok} must be within 1..expert_count "
                            f"{hp.num_experts}")
    block_count = hp.num_hidden_layers + hp.num_nextn_predict_layers
    for key in ("attention.recurrent_layers", "attention.sliding_window_pattern"):
        v = kv.get(f"{hp.arch}.{key}")
        if isinstance(v, list) and len(v) != block_count:
            raise SpecconvError(f"{hp.arch}.{key} has {len(v)} entries for block_count {block_count}")
