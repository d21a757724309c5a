"""Parity with transformers on the checkpoint folder that was converted (`--hf`).

The trunk: our runtime's logits for every prompt position vs the transformers class the family's
plugin declares for the checkpoint (`ArchPlugin.hf_reference`, e.g. `Qwen3_5ForCausalLM`; float32).
Release layouts (`...ForConditionalGeneration` configs with `text_config`, `model.language_model.*`
names) load into the CausalLM class through transformers' own key mapping; a load report with
missing or mismatched keys fails the check instead of comparing against random weights.
The MTP head: our MTP graph vs transformers' `MtpModel` on llama.cpp's rows (row p = (x_p, h_{p-1}),
h_{-1} = 0, docs/reference/model-math.md §7.2), both fed transformers' trunk hidden states so the head is judged alone.

Criteria by the file's weight storage and the compute dtype (`criterion`): float32 files computed
in float32 still differ by float32 rounding, which tiny random Gated DeltaNet layers amplify to ~4e-4
(docs/testing.md), so they are held to max |Δlogit| ≤ 2e-3; files with rounded weights (F16, BF16,
quantized), or any file computed in bf16/f16, are held to a relative RMS error per storage / compute
type. A planted defect (a swapped or perturbed tensor) moves logits by O(1).

The reference is loaded with an accelerate device map (`device_map="auto"`, offload to a temporary
folder), in float32 or, when verify computes in bf16/f16, in bf16: a checkpoint bigger than the GPUs
and the RAM is spread over them and the disk, so release-size parity checks run on one machine.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from torch.overrides import TorchFunctionMode

from specconv.archs import plugin_class_for
from specconv.errors import SpecconvError
from specconv.runtime import Context, GraphType
from specconv.runtime.model import Model
from specconv.verify.dsa_ties import DSA_MODEL_TYPES, EarliestOnTies

# Float32 files are judged on max |Δlogit|; files with rounded weights on the relative RMS of the
# logit error (rms over the vocabulary of Δ / std of the reference logits, averaged over positions),
# whose size follows the storage's precision and not the logit scale. Measured on the tiny random
# Qwen3.5 (docs/verify.md): F32 max 7e-5; relative RMS F16 0.006, BF16 0.026, Q8_0 0.11-0.18, while two
# swapped trunk tensors give 1.3 (and max |Δ| 5.1 in F32).
F32_MAX_ABS = 2e-3
# Float32 weights computed in float64 on both sides (verify --dtype f64): only float64 rounding is left,
# so 1e-9 still leaves room for the Gated DeltaNet conditioning (docs/robustness.md has the figures).
F64_MAX_ABS = 1e-9
REL_RMS_TOLERANCE = {Q.F16: 0.05, Q.BF16: 0.1, Q.Q8_0: 0.4}
DEFAULT_REL_RMS_TOLERANCE = 0.7
# Computing in half precision rounds every activation; both sides do (ours in the compute dtype, the
# reference in bf16 for either), so the bf16 reference's rounding sets the scale. Measured (docs/verify.md):
# relative RMS 0.02 on the tiny Llama, 0.058 (bf16) / 0.062 (f16) on the tiny random Qwen3.5; two swapped
# trunk tensors give 1.3.
COMPUTE_REL_RMS_TOLERANCE = {torch.float16: 0.1, torch.bfloat16: 0.1}


def reference_class_name(hf_dir: Path, arch: str) -> str:
    """The transformers class the checkpoint in `hf_dir` loads into: what its family's plugin declares
    for its config.json `architectures` (ArchPlugin.hf_reference); a SpecconvError when it declares
    none, or when the folder converts to another GGUF arch than `arch`."""
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    plugin = plugin_class_for(config)
    if plugin.gguf_arch != arch:
        raise SpecconvError(f"--hf {hf_dir}: a {plugin.gguf_arch} checkpoint, not the {arch} the GGUF file holds")
    for hf_arch in config.get("architectures") or []:
        if hf_arch in plugin.hf_reference:
            return plugin.hf_reference[hf_arch]
    raise SpecconvError(f"--hf: no transformers reference for GGUF arch {arch!r} "
                        f"({', '.join(config.get('architectures') or [])}: family {plugin.family})")


def criterion(*models: Model) -> tuple[str, float]:
    """("max_abs", 2e-3) when every 2-D weight is F32 and the compute dtype float32 (or 64), else
    ("rel_rms", the loosest tolerance of the storage types and the compute dtype)."""
    types = {t.tensor_type for m in models for t in m.file.tensors.values() if len(t.shape) >= 2}
    rounded = types - {Q.F32}
    half = {m.dtype for m in models} & set(COMPUTE_REL_RMS_TOLERANCE)
    if not rounded and not half:
        exact = all(m.dtype == torch.float64 for m in models)
        return "max_abs", F64_MAX_ABS if exact else F32_MAX_ABS
    return "rel_rms", max([REL_RMS_TOLERANCE.get(t, DEFAULT_REL_RMS_TOLERANCE) for t in rounded] +
                          [COMPUTE_REL_RMS_TOLERANCE[d] for d in half])


def reference_dtype(compute: torch.dtype) -> torch.dtype:
    """The transformers reference's dtype: bf16 when verify computes in bf16/f16, float64 with float64,
    float32 otherwise."""
    if compute == torch.float64:
        return torch.float64
    return torch.bfloat16 if compute in COMPUTE_REL_RMS_TOLERANCE else torch.float32


class _Float64Everywhere(TorchFunctionMode):
    """Inside a float64 reference forward, every float32 request (`.float()`, `.to(torch.float32)`,
    `dtype=torch.float32`) gives float64. transformers writes those upcasts for half-precision runs
    (RMSNorm, rope angles, the delta rule, softmax); in a float64 model they would round to float32
    and leave ~1e-4 of Gated DeltaNet noise in the reference. Rope frequencies stay the float32
    values both sides hold (docs/runtime.md), now used in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def reference_precision(model):
    """The context the reference runs in: float64 everywhere for a float64 model, else nothing."""
    param = next(model.parameters(), None)
    return _Float64Everywhere() if param is not None and param.dtype == torch.float64 else nullcontext()


def _errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |Δ|, mean over rows of rms(Δ) / std(ref))."""
    d = ours.double() - ref.double()  # float64 differences: f64 runs are judged at 1e-9
    rel = d.pow(2).mean(-1).sqrt() / ref.double().std(-1).clamp_min(1e-12)
    return float(d.abs().max()), float(rel.mean())


@contextmanager
def reference_model(hf_dir: Path, arch: str, dtype: torch.dtype = torch.float32, max_memory: dict | None = None):
    """`load_reference` with a temporary offload folder that lives as long as the model is used."""
    with tempfile.TemporaryDirectory(prefix="specconv-offload-") as offload:
        model, bad = load_reference(hf_dir, arch, dtype, offload_folder=offload, max_memory=max_memory)
        try:
            yield model, bad
        finally:
            del model


@torch.no_grad()
def round_as_stored_(model) -> None:
    """A float64 reference with the float32 roundings a GGUF file holds for transformed weights, so an
    F32 file is judged on its arithmetic (to 1e-9) and not on the converter's single rounding of each
    transform (~6e-8 relative, which Gated DeltaNet layers amplify to 1e-5): a `(1 + w)` RMSNorm
    weight is stored as f32(1 + w), `A_log` as ssm_a = f32(-exp(A_log)), and the norm epsilon and
    routed-expert scale as FLOAT32 KV values."""
    import inspect

    def f32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).to(torch.float64)

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float64 and "RMSNorm" in type(module).__name__:
            source = inspect.getsource(type(module).forward)
            if "1.0 + self.weight" in source or "1 + self.weight" in source:
                weight.copy_(f32(1.0 + weight) - 1.0)
        a_log = getattr(module, "A_log", None)
        if isinstance(a_log, torch.nn.Parameter) and a_log.dtype == torch.float64:
            a_log.copy_(torch.log(f32(torch.exp(a_log))))
        for name in _STORED_AS_F32:  # hyperparameters GGUF keeps as FLOAT32 KV values
            if type(getattr(module, name, None)) is float:
                setattr(module, name, float(torch.tensor(getattr(module, name), dtype=torch.float32)))
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        for name in ("rms_norm_eps", "routed_scaling_factor", "router_scaling_factor"):
            if type(getattr(config, name, None)) is float:
                setattr(config, name, float(torch.tensor(getattr(config, name), dtype=torch.float32)))


_STORED_AS_F32 = ("variance_epsilon", "eps", "epsilon", "routed_scaling_factor", "router_scaling_factor", "v_scale")


def _config_as_stored(hf_dir: Path, cls):
    """The config `cls.from_pretrained` would read (its own config class: the text config of a release
    whose config.json wraps one in `text_config`), with YaRN's mscale as GGUF keeps it:
    yarn_log_multiplier = f32(0.1 x), read back as x / 0.1 for both mscale and mscale_all_dim (equal in
    DeepSeek-V3, as the runtime assumes)."""
    config = cls.config_class.from_pretrained(str(hf_dir))
    for c in (config, getattr(config, "text_config", None)):
        rope = getattr(c, "rope_parameters", None) if c is not None else None
        if isinstance(rope, dict) and rope.get("mscale_all_dim") and rope.get("mscale") == rope["mscale_all_dim"]:
            stored = float(torch.tensor(0.1 * rope["mscale_all_dim"], dtype=torch.float32)) / 0.1
            rope["mscale"] = rope["mscale_all_dim"] = stored
    return config


def load_reference(hf_dir: Path, arch: str, dtype: torch.dtype = torch.float32, offload_folder: str | None = None,
                   max_memory: dict | None = None):
    """(model, load-report problems) for `hf_dir`, placed by accelerate's device map over the GPUs, the
    CPU and (with `offload_folder`) the disk; `max_memory` ({device: bytes or "1GiB"}) caps each place."""
    import transformers
    from transformers.utils import logging as hf_logging

    from specconv.verify.chained_mtp import REFERENCES

    if arch in REFERENCES:  # no transformers CausalLM class: built from its text model (chained_mtp.py)
        model, bad = REFERENCES[arch](hf_dir, dtype)
        if dtype == torch.float64:
            round_as_stored_(model)
        return model, bad
    if not (hf_dir / "config.json").is_file():
        raise SpecconvError(f"--hf {hf_dir}: no config.json")
    name = reference_class_name(hf_dir, arch)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    cls = getattr(transformers, name)
    placement = {"device_map": "auto"}
    if offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    if max_memory is not None:
        placement["max_memory"] = max_memory
    if dtype == torch.float64:  # grouped_mm (the default experts kernel) has no float64
        placement["experts_implementation"] = "eager"
        placement["config"] = _config_as_stored(hf_dir, cls)
    try:
        model, info = cls.from_pretrained(str(hf_dir), output_loading_info=True, dtype=dtype, **placement)
    except ValueError as exc:
        if "experts" not in str(exc) or placement.pop("experts_implementation", None) is None:
            raise
        model, info = cls.from_pretrained(str(hf_dir), output_loading_info=True, dtype=dtype, **placement)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys", "error_msgs") and v}
    if dtype == torch.float64:
        round_as_stored_(model)
    if model.config.model_type in DSA_MODEL_TYPES:
        EarliestOnTies(model)  # the runtime's rule for exact ties in the key selection (docs/dsa.md "Ties")
    return model.eval(), bad


def load_mtp_reference(main, n_mtp: int):
    from transformers.modeling_layers import MtpModel

    # Qwen configs do not carry the names MtpModel reads (docs/reference/peers.md §2.2)
    main.config.num_mtp_layers = n_mtp
    main.config.mtp_layer_types = ["full_attention"] * n_mtp
    if getattr(main.config, "mlp_layer_types", None) is not None:  # GLM-4.7-Flash: the nextn layer is MoE
        main.config.mtp_mlp_layer_types = ["sparse"] * n_mtp
    checkpoint = json.loads((Path(main.config.name_or_path) / "config.json").read_text(encoding="utf-8"))
    if plugin_class_for(checkpoint).mtp_as_trunk_layers:  # the release's config.json, not the text config
        # nextn layers at model.layers.{N..}; the class regexes name the release's N (61, 92, 46)
        n = main.config.num_hidden_layers
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n + j}\..*" for j in range(n_mtp)]
    mtp = MtpModel.from_pretrained(main).eval()
    mtp.layers.to(input_device(main))  # its own layers where the shared embedding and head are (not the CPU)
    if next(mtp.parameters()).dtype == torch.float64:
        round_as_stored_(mtp)
    if main.config.model_type in DSA_MODEL_TYPES:
        mtp.config._attn_implementation = "eager"  # the DSA indexer needs the explicit causal mask (docs/dsa.md)
        EarliestOnTies(mtp)
    if main.config.model_type == "glm_moe_dsa":  # its decoder layer returns (hidden, top-k indices)
        for layer in mtp.layers:
            layer.mtp_block.register_forward_hook(lambda _m, _i, out: out[0] if isinstance(out, tuple) else out)
    return mtp


def module_device(module) -> torch.device:
    """Where a (possibly device-mapped) module computes: its weights' device, or the CPU for weights
    offloaded by accelerate (on `meta`; its hook brings them in)."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return tensor.device if tensor is not None and tensor.device.type != "meta" else torch.device("cpu")


def input_device(model) -> torch.device:
    """Where a (possibly device-mapped) transformers model takes its input ids: its embedding's device."""
    return module_device(model.get_input_embeddings())


@torch.no_grad()
def trunk_parity(target: Model, hf_main, prompts: list[list[int]]) -> tuple[float, float, list[torch.Tensor]]:
    """(max |Δlogit|, mean relative RMS error over all prompt positions, transformers' post-norm hidden per prompt)."""
    worst, rels, hidden = 0.0, [], []
    for ids in prompts:
        ours = Context(target, GraphType.MAIN, n_ctx=len(ids)).decode(ids, hidden=()).logits.cpu()
        with reference_precision(hf_main):
            out = hf_main(torch.tensor([ids], device=input_device(hf_main)), output_hidden_states=True, use_cache=False)
        m, r = _errors(ours, out.logits[0][:, :ours.shape[-1]].cpu())  # Gemma: the GGUF vocabulary is trimmed
        worst, rels = max(worst, m), rels + [r]
        hidden.append(out.hidden_states[-1][0].cpu())  # in the reference's dtype (float64 stays float64)
    return worst, sum(rels) / len(rels), hidden


@torch.no_grad()
def mtp_parity(head: Model, hf_mtp, prompts: list[list[int]], hidden: list[torch.Tensor]) -> tuple[float, float]:
    """(max |Δlogit|, mean relative RMS error) of our MTP graph against transformers' MtpModel on
    llama.cpp's rows, both fed the reference's trunk hidden states. Each side gets its inputs on its own
    device: the runtime's on the model's, the reference's on its embedding's."""
    worst, rels = 0.0, []
    where = input_device(hf_mtp)
    dtype = next(hf_mtp.parameters()).dtype
    for ids, h in zip(prompts, hidden):
        rows = torch.cat([torch.zeros(1, h.shape[1], dtype=h.dtype, device=h.device), h[:-1]])
        pos = list(range(len(ids)))
        ours = Context(head, GraphType.MTP, n_ctx=len(ids)).decode(ids, pos, hidden_in=rows.to(head.device))
        with reference_precision(hf_mtp):
            hs = hf_mtp.forward_layer(0, rows[None].to(where, dtype), position_ids=torch.tensor([pos], device=where),
                                      mtp_cache=None, input_ids=torch.tensor([ids], device=where))
            ref = hf_mtp._project_to_logits(hs)[0].cpu()
        m, r = _errors(ours.logits.cpu(), ref)
        worst, rels = max(worst, m), rels + [r]
    return worst, sum(rels) / len(rels)


def hf_config_summary(hf_dir: Path) -> str:
    cfg = json.loads((hf_dir / "config.json").read_text())
    return ",".join(cfg.get("architectures", [])) or cfg.get("model_type", "?")
