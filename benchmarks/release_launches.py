"""Every Triton kernel wrapper called at the layer shapes of released checkpoints, on the CPU.

    python3 benchmarks/release_launches.py             # kernels and their specializations
    python3 benchmarks/release_launches.py -v          # every specialization, one per line

The tiny fixtures of benchmarks/triton_launches.py show what each forward launches, but their
widths choose small tiles: a kernel's constexprs (head widths' blocks, a norm's row block, the
experts' block), hence its shared memory, and the integers its address arithmetic multiplies follow
the model. Here each wrapper of runtime/kernels_triton is called with `meta` tensors of the shapes
of benchmarks/release_shapes.py (nothing is computed or allocated; each launch is recorded instead
of made: cuda_op_count.meta_launches, an H200's 132 multiprocessors), in bfloat16 and float32
compute:

* at batch widths WIDTHS (the decode step, verifications) against a K/V buffer of the model's whole
  context: every product by a matrix of each kernel weight type whose blocks divide its rows (the
  attention and feed-forward projections, the lm_head, the expert stacks by pairs, gate and up in
  one launch, the down product with its GLU input), the norms, ropes with the K/V store, attention
  of each layer kind (gates, windows, sinks, MLA with its sparse keep mask), the Gated DeltaNet step
  with its folded conv, gates and output norm, routing, the MoE sums, the DSA indexer;
* a prompt of PROMPT tokens (the dequantizing product path, the chunked delta rule);
* the decode step's products and Gated DeltaNet step as a CUDA-graph capture launches them where no
  tile counters can be had (a cut product's pieces added by a second kernel, the output norm apart);
* with `long_prompt`, a prompt of the model's whole context in one call through the kernels whose
  arguments grow with the rows (norms, GLU, rope and K/V store, attention, chunked delta rule,
  routing, sums, indexer): the largest integers their addresses multiply.

`ReleaseRecorder` keeps, besides each specialization (triton_launches.Recorder), the integer
arguments and the grid of its launches (`launches`), for tools/int_ranges.py's check of the
kernels' 32-bit arithmetic.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import cuda_op_count, triton_launches  # noqa: E402
from benchmarks.release_shapes import RELEASES, ReleaseShape  # noqa: E402

WIDTHS = (1, 4, 16)  # the decode step, a verification of 3 drafts, the widest one-pass product
PROMPT = 512  # prompt tokens: the dequantizing product path, the chunked delta rule
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
EPS = 1e-6


class ReleaseRecorder(triton_launches.Recorder):
    """A Recorder that also keeps each specialization's launches: {Specialization: {(integer
    arguments by name, grid)}}."""

    def __init__(self, widths: Iterable[int] = WIDTHS):
        super().__init__(widths)
        self.launches: dict = {}

    def __call__(self, module: str, kernel: str, grid, args: tuple, kwargs: dict) -> None:
        super().__call__(module, kernel, grid, args, kwargs)
        spec = self.sequences[self.key][-1]
        names = [name for name, _ in spec.signature]
        values = dict(zip(names, args))
        values.update((k, v) for k, v in kwargs.items() if k in values or k in names)
        ints = tuple(sorted((k, v) for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)))
        self.launches.setdefault(spec, set()).add((ints, tuple(grid) + (1,) * (3 - len(grid))))


def _empty(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _packed(qtype, rows: int, n_in: int, experts: int = 0) -> torch.Tensor:
    from specconv.runtime.dequant import row_bytes

    return _empty(*((experts,) if experts else ()), rows, row_bytes(qtype, n_in), dtype=torch.uint8)


def _types(n_in: int) -> list:
    """The kernel weight types a matrix with rows of n_in values can be stored in (whole blocks; the
    runtime's own rows-first types too)."""
    from specconv.runtime.dequant import block_geometry
    from specconv.runtime.kernels_triton.dequant import GEOMETRY

    return [t for t in sorted(GEOMETRY, key=int) if n_in % block_geometry(t)[0] == 0]


def matrices(r: ReleaseShape) -> list[tuple[str, int, int]]:
    """(name, n_out, n_in) of every 2-D weight of the model (each kind once)."""
    out = [("lm_head", r.vocab, r.hidden)]
    for label, h in (("attn", r.attention), ("swa", r.sliding)):
        if h is not None:
            q_width = h.heads * h.head_dim * (2 if h.gate == "value" else 1)
            out += [(f"{label}_q", q_width, r.hidden), (f"{label}_k", h.kv_heads * h.head_dim, r.hidden),
                    (f"{label}_v", h.kv_heads * h.dv, r.hidden), (f"{label}_o", r.hidden, h.heads * h.dv)]
            if h.gate == "head":
                out.append((f"{label}_gate", h.heads, r.hidden))
    for label, width in (("ffn", r.intermediate), ("shexp", r.shared_ffn)):
        if width:
            out += [(f"{label}_gate", width, r.hidden), (f"{label}_down", r.hidden, width)]
    if r.deltanet:
        d = r.deltanet
        out += [("ssm_qkv", d.conv_channels, r.hidden), ("ssm_z", d.value_heads * d.value_dim, r.hidden),
                ("ssm_ba", d.value_heads, r.hidden), ("ssm_out", r.hidden, d.value_heads * d.value_dim)]
    if r.latent:
        m = r.latent
        out += [("q_a", m.q_lora, r.hidden), ("q_b", m.heads * (m.nope_dim + m.rope_dim), m.q_lora),
                ("kv_a", m.kv_lora + m.rope_dim, r.hidden), ("mla_o", r.hidden, m.heads * m.v_dim)]
        if m.index_heads:
            out += [("idx_q", m.index_heads * m.index_dim, m.q_lora), ("idx_k", m.index_dim, r.hidden)]
    return out


def products(r: ReleaseShape, n: int, dtype: torch.dtype) -> None:
    """Every product of the model for n activation rows, in every kernel weight type its rows allow."""
    from specconv.runtime import kernels_triton as K

    x = _empty(n, r.hidden, dtype=dtype)
    for _, n_out, n_in in matrices(r):
        rows = x if n_in == r.hidden else _empty(n, n_in, dtype=dtype)
        for qtype in _types(n_in):
            K.quant_matmul(rows, _packed(qtype, n_out, n_in), qtype, n_out, n_in)
    if n <= K.FUSED_MAX_ROWS:
        _one_pass_extras(r, n, dtype)


def _one_pass_extras(r: ReleaseShape, n: int, dtype: torch.dtype) -> None:
    """The launches only the one-pass kernel makes: groups of a block's projections, GLU inputs, F32
    routers, experts by pairs (with their GLU down product), MLA's per-head products."""
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime import kernels_triton as K

    x = _empty(n, r.hidden, dtype=dtype)
    for h in r.attention_kinds:
        outs = [h.heads * h.head_dim, h.kv_heads * h.head_dim, h.kv_heads * h.dv]
        for qtype in _types(r.hidden):
            K.grouped_matmul(x, [_packed(qtype, o, r.hidden) for o in outs], qtype, outs, r.hidden)
    for width in (r.intermediate, r.shared_ffn):
        if width:
            gate = _empty(n, width, dtype=dtype)
            for qtype in _types(r.hidden):
                K.grouped_matmul(x, [_packed(qtype, width, r.hidden)] * 2, qtype, [width] * 2, r.hidden)
            for qtype in _types(width):
                K.quant_matmul(gate, _packed(qtype, r.hidden, width), qtype, r.hidden, width, up=gate, act=r.act)
    if r.experts:
        K.quant_matmul(x, _packed(QType.F32, r.experts, r.hidden), QType.F32, r.experts, r.hidden)
        pairs = n * r.experts_used
        chosen = _empty(pairs, dtype=torch.int64)
        for qtype in _types(r.hidden):
            stack = _packed(qtype, r.expert_ffn, r.hidden, r.experts)
            K.expert_matmul_pair(x, [stack, stack], qtype, r.expert_ffn, r.hidden, chosen, fanout=r.experts_used)
        gate = _empty(pairs, r.expert_ffn, dtype=dtype)
        for qtype in _types(r.expert_ffn):
            K.expert_matmul(gate, _packed(qtype, r.hidden, r.expert_ffn, r.experts), qtype, r.hidden, r.expert_ffn,
                            chosen, up=gate, act=r.act)
    if r.latent:  # k_b, v_b: the head of each (row, head) pair as its expert
        m = r.latent
        head = _empty(n * m.heads, dtype=torch.int32)
        for n_out, n_in in ((m.kv_lora, m.nope_dim), (m.v_dim, m.kv_lora)):
            rows = _empty(n * m.heads, n_in, dtype=dtype)
            for qtype in _types(n_in):
                K.expert_matmul(rows, _packed(qtype, n_out, n_in, m.heads), qtype, n_out, n_in, head)


def pointwise(r: ReleaseShape, n: int, dtype: torch.dtype) -> None:
    """Norms, GLU, routing and the MoE sums for n rows."""
    from specconv.runtime import kernels_triton as K

    f32 = torch.float32
    x = _empty(n, r.hidden, dtype=dtype)
    w = _empty(r.hidden, dtype=f32)
    K.rms_norm(x, w, EPS)
    K.rms_norm(x, w, EPS, residual=x)
    K.rms_norm(x, w, EPS, add_to=x, out_scale=_empty(1, dtype=f32))
    for width in {r.intermediate, r.shared_ffn, r.expert_ffn} - {0}:
        gate = _empty(n, width, dtype=dtype)
        K.glu(gate, gate, r.act)
    if r.experts:
        logits = _empty(n, r.experts, dtype=f32)
        k = r.experts_used
        if r.router == "softmax":
            K.softmax_topk(logits, k)
            K.grouped_topk(logits, k, False, expert_scale=_empty(r.experts, dtype=f32))
        else:
            K.grouped_topk(logits, k, True, _empty(r.experts, dtype=f32), *r.expert_groups)
        y = _empty(n * k, r.hidden, dtype=dtype)
        weights, chosen = _empty(n, k, dtype=f32), _empty(n, k, dtype=torch.int64)
        K.moe_combine(y, weights, chosen, None, dtype)
        K.moe_combine(y, weights, chosen, x, dtype)
        routed = _empty(n, r.hidden, dtype=f32)
        K.add_shared(routed, x)
        K.add_gated_shared(routed, x, _empty(n, 1, dtype=dtype))


def attention(r: ReleaseShape, n: int, dtype: torch.dtype, cells: int) -> None:
    """Rope (and norms) with the K/V store, then attention of every layer kind, for n rows against a
    buffer of `cells` cells."""
    from specconv.runtime import kernels_triton as K

    f32, i64 = torch.float32, torch.int64
    q_pos, k_pos, at = _empty(n, dtype=i64), _empty(cells, dtype=i64), _empty(n, dtype=i64)
    for h in r.attention_kinds:
        half = h.rotated // 2
        K.rope_table(q_pos, _empty(half, dtype=f32), scale=1.0)  # the batch's angles (YaRN's factor)
        cos = sin = _empty(n, half, dtype=f32)
        width = h.head_dim * (2 if h.gate == "value" else 1)
        qg = _empty(n, h.heads, width, dtype=dtype)
        q = qg[..., :h.head_dim]
        k, v = _empty(n, h.kv_heads, h.head_dim, dtype=dtype), _empty(n, h.kv_heads, h.dv, dtype=dtype)
        k_cache, v_cache = _empty(cells, h.kv_heads, h.head_dim, dtype=dtype), _empty(cells, h.kv_heads, h.dv,
                                                                                       dtype=dtype)
        norms = (_empty(h.head_dim, dtype=f32),) * 2 if r.qk_norm else (None, None)
        K.rope_qk_store(q, k, v, cos, sin, "neox", k_cache, v_cache, at, *norms, eps=EPS)
        K.rope_qk(q, k, cos, sin, "neox", *norms, eps=EPS)
        K.write_kv(k_cache, v_cache, at, k, v)
        gate = {"": None, "head": _empty(n, h.heads, dtype=dtype), "value": qg[..., h.head_dim:]}[h.gate]
        sinks = _empty(h.heads, dtype=f32) if h.sinks else None
        K.attention(q.contiguous(), k_cache, v_cache, q_pos, k_pos, h.head_dim ** -0.5, gate, h.window, sinks)
    if r.latent:
        m = r.latent
        kv = _empty(cells, 1, m.kv_lora + m.rope_dim, dtype=dtype)
        q_lat, q_pe = _empty(n, m.heads, m.kv_lora, dtype=dtype), _empty(n, m.heads, m.rope_dim, dtype=dtype)
        K.rope(q_pe, _empty(n, m.rope_dim // 2, dtype=f32), _empty(n, m.rope_dim // 2, dtype=f32), "norm")
        keep = _empty(n, cells, dtype=torch.bool) if m.index_heads else None
        K.attention(q_lat, kv, kv[..., :m.kv_lora], q_pos, k_pos, 0.1, keep=keep, q_rest=q_pe)
        if m.index_heads:
            keys = _empty(cells, m.index_dim, dtype=dtype)
            K.index_scores(_empty(n, m.index_heads, m.index_dim, dtype=dtype), _empty(n, m.index_heads, dtype=f32),
                           keys, m.index_dim ** -0.5)


def deltanet(r: ReleaseShape, n: int, dtype: torch.dtype) -> None:
    """The Gated DeltaNet's kernels for n tokens: the step with everything folded in and its parts
    (decode widths), or the chunked rule (a prompt)."""
    from specconv.runtime import kernels_triton as K
    from specconv.runtime.graphs.gdn import qkv_heads

    d = r.deltanet
    f32 = torch.float32
    slots = 17  # a ring for 15 drafts and its spare
    heads = (d.key_heads, d.key_dim, d.value_heads, d.value_dim)
    states = _empty(slots, d.value_heads, d.key_dim, d.value_dim, dtype=f32)
    m = _empty(n, d.conv_channels, dtype=dtype)
    q, k, v = qkv_heads(m, heads)
    b = alpha = _empty(n, d.value_heads, dtype=dtype)
    a = dt_bias = _empty(d.value_heads, dtype=f32)
    K.gdn_gates(b, alpha, a, dt_bias)
    K.l2_norm(q, EPS, scale=d.key_dim ** -0.5)
    if n > K.MAX_TOKENS:
        g = beta = _empty(n, d.value_heads, dtype=f32)
        K.gdn_chunked(q, k, v, g, beta, states, 0, [1], group=1)
        return
    windows = _empty(slots, d.conv_kernel - 1, d.conv_channels, dtype=f32)
    weight = _empty(d.conv_channels, d.conv_kernel, dtype=f32)
    dst = list(range(1, n + 1))
    K.causal_conv(m, windows, weight, 0, dst)
    g = beta = _empty(n, d.value_heads, dtype=f32)
    K.gdn_step(q, k, v, g, beta, states, 0, dst, group=1)
    z = _empty(n, d.value_heads, d.value_dim, dtype=dtype)
    K.gdn_step(q, k, v, alpha, b, states, 0, dst, eps=EPS, scale=d.key_dim ** -0.5, gate_weights=(a, dt_bias),
               conv=(windows, weight), gated_norm=(_empty(d.value_dim, dtype=f32), z, EPS, dtype))


def launch_model(r: ReleaseShape, n: int, dtype: torch.dtype, with_products: bool = True) -> None:
    """Every wrapper at the model's shapes for n rows against a buffer of the model's whole context."""
    if with_products:
        products(r, n, dtype)
    pointwise(r, n, dtype)
    attention(r, n, dtype, r.context)
    if r.deltanet:
        deltanet(r, n, dtype)


@contextlib.contextmanager
def _without_tile_counters() -> Iterator[None]:
    """No tile counters to be had (as inside a CUDA-graph capture without them): cut products add
    their pieces by a second launch."""
    from specconv.runtime.kernels_triton import _common

    real = _common.tile_counters
    _common.tile_counters = lambda device, count: None
    try:
        yield
    finally:
        _common.tile_counters = real


def record(releases: Iterable[ReleaseShape] = RELEASES, dtypes: Iterable[str] = tuple(DTYPES),
           widths: Iterable[int] = WIDTHS, product_dtypes: Iterable[str] | None = None,
           product_widths: Iterable[int] | None = None, long_prompt: bool = True,
           progress: Callable[[str], None] | None = None) -> ReleaseRecorder:
    """A ReleaseRecorder that ran launch_model for every release, compute dtype, width and the prompt
    (and with `long_prompt`, a prompt of the whole context, without the products); the products in
    `product_dtypes` at `product_widths` only (default: `dtypes`, `widths`)."""
    product_dtypes = tuple(dtypes if product_dtypes is None else product_dtypes)
    product_widths = tuple(widths if product_widths is None else product_widths)
    recorder = ReleaseRecorder(widths)
    cuda_op_count.launch_observers.append(recorder)
    try:
        with cuda_op_count.meta_launches():
            for r in releases:
                for dtype in dtypes:
                    products_too = dtype in product_dtypes
                    runs = [(f"width {n}", n, products_too and n in product_widths) for n in widths]
                    runs.append((f"prompt {PROMPT}", PROMPT, products_too))
                    if long_prompt:
                        runs.append((f"prompt {r.context}", r.context, False))
                    for batch, n, with_products in runs:
                        recorder.key = (r.name, dtype, batch)
                        launch_model(r, n, DTYPES[dtype], with_products)
                    recorder.key = (r.name, dtype, "width 1, captured")
                    with _without_tile_counters():
                        if products_too:
                            products(r, 1, DTYPES[dtype])
                        if r.deltanet:
                            deltanet(r, 1, DTYPES[dtype])
                if progress:
                    progress(f"{r.name}: {len(recorder.found)} specializations so far")
    finally:
        cuda_op_count.launch_observers.remove(recorder)
    return recorder


def main(argv=None) -> ReleaseRecorder:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="every specialization, one per line")
    args = p.parse_args(argv)
    recorder = record(progress=lambda line: print(line, file=sys.stderr))
    kernels: dict[str, int] = {}
    for spec in recorder.found:
        kernels[spec.name] = kernels.get(spec.name, 0) + 1
    print(f"{len(recorder.found)} specializations of {len(kernels)} kernels")
    for name, n in sorted(kernels.items()):
        print(f"  {name}: {n}")
    if args.verbose:
        for spec, labels in recorder.found.items():
            print(f"{spec.describe()}  [{labels[0]}{' ...' if len(labels) > 1 else ''}]")
    return recorder


if __name__ == "__main__":
    main()
