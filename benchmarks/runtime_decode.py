"""Decode rate of one GGUF file, stored weights vs dequantize-everything, alternating in one process.

    python3 benchmarks/runtime_decode.py FILE.gguf [--rounds 2] [-n 12] [--threads 2]

The in-process complement of benchmarks/runtime.py (one process per run there): both forms of the
same model decode the same greedy tokens, one after the other, `--rounds` times; prints tokens/s of
each run and the ratio of the medians (stored / dense).
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("-n", "--n-predict", type=int, default=12)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specconv.runtime import load_model
    from specconv.runtime.generate import generate

    prompt = [3 + (i * 7919) % 2000 for i in range(8)]
    rates: dict[str, list[float]] = {"stored": [], "dense": []}
    tokens = {}
    for _ in range(args.rounds):
        for mode in rates:
            model = load_model(args.file, device="cpu", weights=mode)
            generate(model, prompt[:2], 2)  # one-time costs out of the timing
            result = generate(model, prompt, args.n_predict).to_json()
            rates[mode].append(result["decode_tokens_per_second"])
            tokens[mode] = result["tokens"]
            print(f"{mode:6} decode {rates[mode][-1]:.2f} tok/s", flush=True)
            del model
    ratio = statistics.median(rates["stored"]) / statistics.median(rates["dense"])
    print(f"stored / dense decode: {ratio:.2f}x ({args.threads} threads); same tokens: {tokens['stored'] == tokens['dense']}")


if __name__ == "__main__":
    main()
