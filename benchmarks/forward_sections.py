"""Where the CPU time of one target forward goes, by section, with float32 and 8-bit activations.

    python3 benchmarks/forward_sections.py FILE.gguf [FILE2.gguf ...] [--repeats 7] [--threads 1]

One forward of n = 1 and n = 4 tokens (logits for every row, after a 48-token prefix, rolled back
after each), the products' activations float32 (SPECCONV_NATIVE_FLOAT_ACTIVATIONS=1) and 8-bit
(runtime/dq_dot_i8.inc) alternating in one process, then llama.cpp's forward of the same file in
the same process; medians of --repeats passes, process CPU time (the work of this process alone:
the measure that holds on a shared machine, with one thread). The native kernels are not torch
operations, so torch's profiler does not see them: each section is timed around the CPU backend's
call (products by weight kind, routed experts with their routing, the Gated DeltaNet's conv,
delta rule and gates, the attention core); "rest" is the forward's time outside them (Python,
norms, rope, embedding rows, the memory's bookkeeping).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PREFIX = 48
# weight name (without blk.N.) -> the section its products are counted in
KINDS = {
    "ffn_gate.weight": "FFN", "ffn_up.weight": "FFN", "ffn_down.weight": "FFN",
    "ffn_gate_shexp.weight": "shared expert", "ffn_up_shexp.weight": "shared expert",
    "ffn_down_shexp.weight": "shared expert", "ffn_gate_inp_shexp.weight": "router and shared-expert gate",
    "ffn_gate_inp.weight": "router and shared-expert gate",
    "attn_q.weight": "attention projections", "attn_k.weight": "attention projections",
    "attn_v.weight": "attention projections", "attn_output.weight": "attention projections",
    "attn_qkv.weight": "Gated DeltaNet projections", "attn_gate.weight": "Gated DeltaNet projections",
    "ssm_out.weight": "Gated DeltaNet projections", "ssm_alpha.weight": "Gated DeltaNet alpha/beta",
    "ssm_beta.weight": "Gated DeltaNet alpha/beta", "ssm_ba.weight": "Gated DeltaNet alpha/beta",
    "output.weight": "output head", "token_embd.weight": "output head",
}
REST = "rest: Python, norms, rope, embedding rows"


class Sections:
    """CPU time per section, around the backend's calls (outermost call only); installed once per
    process, told each model's weight names by `use`."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.depth = 0
        self.installed = False

    def use(self, model) -> "Sections":
        self.names = {id(w): name for name, w in model.weights.items()}
        if not self.installed:
            self.install()
            self.installed = True
        return self

    def kind(self, w) -> str:
        name = self.names.get(id(w))
        if name is None:
            return "products: expert slices"
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        return "products: " + KINDS.get(short, short)

    def timed(self, label, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label(args)] += time.process_time() - start
                self.depth -= 1
        return run

    def install(self):
        from specconv.runtime import backend_cpu
        from specconv.runtime.graphs import gdn, ops

        cpu = backend_cpu.NativeCpuBackend
        cpu.linear = self.timed(lambda a: self.kind(a[2]), cpu.linear)
        cpu.moe = self.timed(lambda a: "products: routed experts (with routing)", cpu.moe)
        cpu.delta_rule = self.timed(lambda a: "Gated DeltaNet delta rule", cpu.delta_rule)
        cpu.causal_conv = self.timed(lambda a: "Gated DeltaNet conv", cpu.causal_conv)
        gdn.gates = self.timed(lambda a: "Gated DeltaNet gates", gdn.gates)
        ops.causal_attention = self.timed(lambda a: "attention (scores, softmax, values)", ops.causal_attention)


SECTIONS = Sections()


def llama_forward(path: Path, threads: int, ids: list[int]):
    """A function n -> one llama.cpp forward of ids[PREFIX:PREFIX+n] after the prefix, rolled back."""
    import llama_cpp
    from llama_cpp._logger import set_verbose

    from specconv.verify import costs

    set_verbose(False)
    llama_cpp.llama_backend_init()
    model = costs._load(llama_cpp, path, load_mtp=False, models=[])
    ctx = costs._context(llama_cpp, model, threads, n_rs_seq=4, contexts=[])
    costs._decode(llama_cpp, ctx, ids[:PREFIX], 0)

    def forward(n: int) -> None:
        costs._decode(llama_cpp, ctx, ids[PREFIX:PREFIX + n], PREFIX)
        costs._seq_rm(llama_cpp, ctx, PREFIX)
    return forward


def measure(path: Path, repeats: int, threads: int, with_llama: bool) -> str:
    from specconv.runtime import load_model
    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType

    model = load_model(path, device="cpu")
    sections = SECTIONS.use(model)
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(PREFIX + 4)]
    ctx = Context(model, GraphType.MAIN, n_ctx=PREFIX + 5, n_rs_seq=4)
    ctx.decode(ids[:PREFIX], hidden=(), logits=None)
    llama = llama_forward(path, threads, ids) if with_llama else None
    runs: dict[tuple, list[float]] = collections.defaultdict(list)
    for rep in range(repeats + 1):  # the first pass only warms up
        for mode in ("float32", "int8"):
            os.environ["SPECCONV_NATIVE_FLOAT_ACTIVATIONS"] = "1" if mode == "float32" else "0"
            for n in (1, 4):
                sections.seconds.clear()
                start = time.process_time()
                ctx.decode(ids[PREFIX:PREFIX + n], hidden=(), logits="all")
                total = time.process_time() - start
                ctx.seq_rm(0, PREFIX)
                if rep:
                    runs[(mode, n, "TOTAL")].append(total)
                    runs[(mode, n, REST)].append(total - sum(sections.seconds.values()))
                    for label, s in sections.seconds.items():
                        runs[(mode, n, label)].append(s)
        for n in (1, 4):
            if llama is not None:
                start = time.process_time()
                llama(n)
                if rep:
                    runs[("llama.cpp", n, "TOTAL")].append(time.process_time() - start)
    os.environ.pop("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", None)

    def ms(mode, n, label):
        values = runs.get((mode, n, label))
        return statistics.median(values) * 1e3 if values else 0.0

    labels = sorted({label for (_, _, label) in runs if label != "TOTAL"}, key=lambda k: -ms("float32", 1, k))
    hp = model.hparams
    lines = [f"{path.name} (hidden {model.hidden_size}, vocabulary {model.vocab_size}, {hp.num_hidden_layers} blocks): CPU ms, "
             f"{threads} thread(s), medians of {repeats}, load average {os.getloadavg()[0]:.1f}", "",
             "| section | float32 n=1 | n=4 | 8-bit n=1 | n=4 |", "|---|---|---|---|---|"]
    for label in ["TOTAL"] + labels:
        cells = " | ".join(f"{ms(mode, n, label):.1f}" for mode in ("float32", "int8") for n in (1, 4))
        lines.append(f"| {'**one forward**' if label == 'TOTAL' else label} | {cells} |")
    if llama is not None:
        lines.append(f"| llama.cpp, same file and threads | {ms('llama.cpp', 1, 'TOTAL'):.1f} | "
                     f"{ms('llama.cpp', 4, 'TOTAL'):.1f} | | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-llamacpp", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    for path in args.files:
        print(measure(path, args.repeats, args.threads, not args.no_llamacpp), flush=True)
        print()


if __name__ == "__main__":
    main()
