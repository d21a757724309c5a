"""The layer shapes of released checkpoints the runtime's kernels must take, as data.

    python3 benchmarks/release_shapes.py      # the table, one model a line

Each entry is what a model's config.json gives the kernels (benchmarks/release_launches.py calls
every Triton wrapper at these shapes, tools/triton_aot.py --release compiles what they launch):
widths of the residual stream and the feed-forwards, experts, attention heads and head widths (the
global and the sliding-window layers where they differ), the Gated DeltaNet's heads and conv,
multi-head latent attention and its sparse indexer, the vocabulary and the longest context (a
prompt of that many tokens in one call, a K/V buffer of that many cells). Values from the releases'
config.json files (transformers 5.23's config defaults where those are the release's: HYV3Config,
Step3p7TextConfig, MiMoV2FlashConfig, DeepseekV32Config; Step-3.5-Flash's sliding layers from its
`attention_other_setting`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Heads:
    """One kind of attention layer: query and KV heads, the key and value widths, the rotated part."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0: head_dim
    rope_dims: int = 0  # 0: head_dim
    window: int = 0  # sliding-window layers
    sinks: bool = False  # one learnt logit per head (attention sinks)
    gate: str = ""  # "": none, "head": one sigmoid gate per head, "value": one per output value

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rotated(self) -> int:
        return self.rope_dims or self.head_dim


@dataclass(frozen=True)
class DeltaNet:
    """Gated DeltaNet layers: key / value heads and widths, the depthwise conv's taps."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention: the latent cell [c | rope(k_pe)] and the per-head widths; with
    `index_heads`, DeepSeek Sparse Attention's indexer (heads of `index_dim`, `index_topk` keys)."""

    heads: int
    kv_lora: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    q_lora: int
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0


@dataclass(frozen=True)
class ReleaseShape:
    name: str
    hidden: int
    vocab: int
    context: int  # the longest context: a prompt of this many tokens, a buffer of this many cells
    attention: Heads | None  # the full-attention layers (None: MLA only)
    sliding: Heads | None = None  # the sliding-window layers where their heads differ
    intermediate: int = 0  # dense feed-forward width (0: none)
    act: str = "silu"  # the feed-forwards' GLU activation
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # shared expert's width (0: none)
    router: str = "softmax"  # "softmax" (softmax_topk) or "sigmoid" (grouped_topk with a bias)
    expert_groups: tuple[int, int] = (1, 1)  # (groups, groups used) of grouped_topk
    qk_norm: bool = False
    deltanet: DeltaNet | None = None
    latent: Latent | None = None

    @property
    def attention_kinds(self) -> tuple[Heads, ...]:
        return tuple(h for h in (self.attention, self.sliding) if h is not None)


RELEASES = (
    ReleaseShape("Qwen3.5-27B", hidden=5120, vocab=248320, context=262144,
                 attention=Heads(24, 4, 256, rope_dims=64, gate="value"), intermediate=17408, qk_norm=True,
                 deltanet=DeltaNet(16, 48, 128, 128, 4)),
    ReleaseShape("Qwen3.5-397B-A17B", hidden=4096, vocab=248320, context=262144,
                 attention=Heads(32, 2, 256, rope_dims=64, gate="value"), experts=512, experts_used=10,
                 expert_ffn=1024, shared_ffn=1024, qk_norm=True, deltanet=DeltaNet(16, 64, 128, 128, 4)),
    ReleaseShape("Qwen3-235B-A22B", hidden=4096, vocab=151936, context=40960, attention=Heads(64, 4, 128),
                 experts=128, experts_used=8, expert_ffn=1536, qk_norm=True),
    ReleaseShape("GLM-4.5", hidden=5120, vocab=151552, context=131072, attention=Heads(96, 8, 128, rope_dims=64),
                 intermediate=12288, experts=160, experts_used=8, expert_ffn=1536, shared_ffn=1536,
                 router="sigmoid", qk_norm=True),
    ReleaseShape("GLM-4.6", hidden=5120, vocab=151552, context=202752, attention=Heads(96, 8, 128, rope_dims=64),
                 intermediate=12288, experts=160, experts_used=8, expert_ffn=1536, shared_ffn=1536,
                 router="sigmoid", qk_norm=True),
    ReleaseShape("DeepSeek-V3", hidden=7168, vocab=129280, context=163840, attention=None, intermediate=18432,
                 experts=256, experts_used=8, expert_ffn=2048, shared_ffn=2048, router="sigmoid",
                 expert_groups=(8, 4), latent=Latent(128, 512, 64, 128, 128, 1536)),
    ReleaseShape("DeepSeek-V3.2", hidden=7168, vocab=129280, context=163840, attention=None, intermediate=18432,
                 experts=256, experts_used=8, expert_ffn=2048, shared_ffn=2048, router="sigmoid",
                 expert_groups=(8, 4), latent=Latent(128, 512, 64, 128, 128, 1536, 64, 128, 2048)),
    ReleaseShape("Gemma-4-31B", hidden=5376, vocab=262144, context=262144, attention=Heads(32, 4, 512),
                 sliding=Heads(32, 16, 256, window=1024), intermediate=21504, act="gelu_tanh", qk_norm=True),
    ReleaseShape("Gemma-4-26B-A4B", hidden=2816, vocab=262144, context=262144, attention=Heads(16, 2, 512),
                 sliding=Heads(16, 8, 256, window=1024), intermediate=2112, act="gelu_tanh", experts=128,
                 experts_used=8, expert_ffn=704, qk_norm=True),
    ReleaseShape("Step-3.5-Flash", hidden=4096, vocab=128815, context=262144, attention=Heads(64, 8, 128, gate="head"),
                 sliding=Heads(96, 8, 128, window=512, sinks=True, gate="head"), intermediate=11264, experts=288,
                 experts_used=8, expert_ffn=1280, shared_ffn=1280, router="sigmoid", qk_norm=True),
    ReleaseShape("MiMo-V2-Flash", hidden=4096, vocab=152576, context=262144,
                 attention=Heads(64, 4, 192, v_head_dim=128, rope_dims=64),
                 sliding=Heads(64, 8, 192, v_head_dim=128, rope_dims=64, window=128, sinks=True),
                 intermediate=16384, experts=256, experts_used=8, expert_ffn=2048, router="sigmoid"),
    ReleaseShape("Hy3", hidden=4096, vocab=120832, context=262144, attention=Heads(64, 8, 128), intermediate=13312,
                 experts=192, experts_used=8, expert_ffn=1536, shared_ffn=1536, router="sigmoid", qk_norm=True),
    ReleaseShape("Llama-3.1-8B", hidden=4096, vocab=128256, context=131072, attention=Heads(32, 8, 128),
                 intermediate=14336),
    ReleaseShape("Llama-3.1-70B", hidden=8192, vocab=128256, context=131072, attention=Heads(64, 8, 128),
                 intermediate=28672),
)


def by_name(name: str) -> ReleaseShape:
    found = {r.name: r for r in RELEASES}
    if name not in found:
        raise SystemExit(f"no release shape {name!r}; one of {', '.join(found)}")
    return found[name]


def describe(r: ReleaseShape) -> str:
    parts = [f"hidden {r.hidden}", f"vocab {r.vocab}", f"context {r.context}"]
    for label, h in (("attention", r.attention), ("sliding", r.sliding)):
        if h is not None:
            parts.append(f"{label} {h.heads}/{h.kv_heads}×{h.head_dim}" + (f"→{h.dv}" if h.dv != h.head_dim else "")
                         + (f" window {h.window}" if h.window else ""))
    if r.intermediate:
        parts.append(f"ffn {r.intermediate}")
    if r.experts:
        parts.append(f"experts {r.experts_used}/{r.experts}×{r.expert_ffn}" + (f" shared {r.shared_ffn}"
                                                                                  if r.shared_ffn else ""))
    if r.deltanet:
        d = r.deltanet
        parts.append(f"GDN {d.key_heads}/{d.value_heads}×{d.key_dim}/{d.value_dim} conv {d.conv_kernel}")
    if r.latent:
        m = r.latent
        parts.append(f"MLA {m.heads}×({m.kv_lora}+{m.rope_dim})" + (f" indexer {m.index_heads}×{m.index_dim}"
                                                                     if m.index_heads else ""))
    return f"{r.name}: " + ", ".join(parts)


if __name__ == "__main__":
    print("\n".join(describe(r) for r in RELEASES))
