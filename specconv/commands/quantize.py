"""`specconv quantize`: an F32 / F16 / BF16 GGUF -> a K-quant GGUF, as llama.cpp's quantize tool makes it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specconv.errors import SpecconvError

FILE_TYPES = ["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k"]


@click.command("quantize")
@click.argument("src", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(path_type=Path))
@click.argument("file_type", type=click.Choice(FILE_TYPES, case_sensitive=False), metavar="TYPE")
@click.option("--allow-requantize", is_flag=True,
              help="Accept an input whose tensors are already quantized (they are dequantized first; the result "
                   "is not claimed to equal llama.cpp's).")
@click.option("--force", is_flag=True, help="Overwrite DST if it exists.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Encoding threads (0: one per core plus 2). The bytes do not depend on it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(src, dst, file_type, allow_requantize, force, threads, as_json):
    """Requantize SRC (a GGUF with F32, F16 or BF16 weights: ours or any converter's; give the first
    shard of a split file) to TYPE (Q2_K ... Q6_K, any case), writing DST.

    Each tensor gets the type llama.cpp's quantize tool gives it for that file type, its blocks are
    the tool's bytes (no importance matrix), every KV pair is kept (general.file_type and
    general.quantization_version set as the tool sets them), so DST equals the tool's output byte for
    byte. Written under a temporary name and renamed when complete.
    """
    from specconv.convert.requantize import run_requantize

    if dst.exists() and not force:
        raise SpecconvError(f"{dst} already exists (use --force to overwrite)")
    paths, chosen = run_requantize(src, dst, file_type, allow_requantize=allow_requantize, overwrite=force,
                                   threads=threads)
    types: dict[str, int] = {}
    for new_type in chosen.values():
        types[new_type.name] = types.get(new_type.name, 0) + 1
    result = {"source": str(src), "written": [str(p) for p in paths], "file_type": file_type.upper(),
              "tensors": len(chosen), "types": types, "bytes": sum(p.stat().st_size for p in paths)}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"wrote {', '.join(result['written'])}: {result['tensors']} tensors "
                   f"({', '.join(f'{n} {t}' for t, n in sorted(types.items()))}), {result['bytes']} bytes")
