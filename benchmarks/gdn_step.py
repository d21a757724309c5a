"""The native Gated DeltaNet step against the torch forms it replaces, for decode and verification.

    python3 benchmarks/gdn_step.py                                  # the step alone, 1 thread
    python3 benchmarks/gdn_step.py --model FILE.gguf --threads 2    # a model's forward, n = 1 and 4

Without --model: one layer's delta rule for 16 heads of 128 x 128 (a 1 MB state, as the ~1 B
Qwen3.5-shaped model), n = 1, 4, 9 tokens: the native form (runtime/gdn_step.c) writing the state
after the batch into a slot, against the torch batched form plus the write of that state
(gdn.PendingStates.state), as the runtime ran it before; and the causal conv (4096 channels,
4 taps) native against torch. With --model: one forward of n = 1 and n = 4 tokens of the model
(logits for every row, at position 16, rolled back after each), the native step on and off
alternating in one process. Medians; the ratio is torch / native.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _median_us(run, calls: int, repeats: int) -> float:
    for _ in range(5):
        run()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def step_alone(repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from specconv.runtime import gdn_native
    from specconv.runtime.graphs import gdn
    gen = torch.Generator().manual_seed(0)
    nv, dk, dv = 16, 128, 128
    print("delta rule, 16 heads of 128 x 128, µs per call (torch batched form + state write / native):")
    for n in (1, 4, 9):
        q = torch.randn(n, nv, dk, generator=gen) * dk ** -0.5
        k = F.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1)
        v, g = torch.randn(n, nv, dv, generator=gen), -torch.rand(n, nv, generator=gen)
        beta, state = torch.rand(n, nv, generator=gen), torch.randn(nv, dk, dv, generator=gen) * 0.1
        out = torch.empty_like(state)
        native = _median_us(lambda: gdn_native.delta_rule_tokens(q, k, v, g, beta, state, out=out), 50, repeats)
        torch_form = _median_us(lambda: gdn.batched_delta_rule(q, k, v, g, beta, state, keep=n, lazy=True)[1]
                                .state(n - 1, out=out), 50, repeats)
        print(f"  n={n}: {torch_form:.0f} / {native:.0f}  ({torch_form / native:.1f}x)")
    channels, taps = 4096, 4
    weight, conv_state = torch.randn(channels, taps, generator=gen), torch.randn(taps - 1, channels, generator=gen)
    print("causal conv, 4096 channels, 4 taps, µs per call (torch / native):")
    for n in (1, 4, 9):
        m = torch.randn(n, channels, generator=gen)
        native = _median_us(lambda: gdn.causal_conv(m, conv_state, weight, n), 200, repeats)
        real = gdn_native.conv_applies
        gdn_native.conv_applies = lambda *a: False
        try:
            torch_form = _median_us(lambda: gdn.causal_conv(m, conv_state, weight, n), 200, repeats)
        finally:
            gdn_native.conv_applies = real
        print(f"  n={n}: {torch_form:.0f} / {native:.0f}  ({torch_form / native:.1f}x)")


def model_forward(path: str, repeats: int) -> None:
    from specconv.runtime import gdn_native, load_model
    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType
    model = load_model(path, device="cpu", weights="stored")
    prefix = 16
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(prefix + 4)]
    ctx = Context(model, GraphType.MAIN, n_ctx=prefix + 5, n_rs_seq=4)
    ctx.decode(ids[:prefix], hidden=(), logits=None)
    real = gdn_native.available
    modes = {"native": real, "torch": lambda: False}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for mode, switch in modes.items():
            gdn_native.available = switch
            for n in (1, 4):
                t0 = time.perf_counter()
                ctx.decode(ids[prefix:prefix + n], hidden=(), logits="all")
                times.setdefault((mode, n), []).append(time.perf_counter() - t0)
                ctx.seq_rm(0, prefix)
    gdn_native.available = real
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"{Path(path).name}, forward ms (medians of {repeats}):")
    for mode in modes:
        print(f"  {mode:6s} t(1) {med[(mode, 1)]:.1f}  t(4) {med[(mode, 4)]:.1f}  "
              f"t(4)/t(1) {med[(mode, 4)] / med[(mode, 1)]:.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Qwen3.5-family GGUF: its forward with the native step on and off")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.model:
        model_forward(args.model, args.repeats)
    else:
        step_alone(args.repeats)


if __name__ == "__main__":
    main()
