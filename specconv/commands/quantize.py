"""`specconv quantize`: an F32 / F16 / BF16 GGUF -> a K-quant (or IQ4) GGUF, as llama.cpp's quantize tool makes it
(with its importance matrix when given --imatrix)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from specconv.commands.outputs import MKDIR_HELP, check_output_folder
from specconv.errors import SpecconvError

FILE_TYPES = ["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q2_k_s", "iq4_nl",
              "iq4_xs"]
IMATRIX_HELP = (
    "llama.cpp's importance matrix (the GGUF file llama-imatrix writes, or its legacy .dat format): every "
    "quantized tensor with an entry is encoded with its weights, as llama-quantize --imatrix does (same bytes; "
    "experts of a 3-D tensor use their own slice; tensors without an entry are encoded without). Required for "
    "Q2_K_S. The file's name, dataset and counts are recorded as quantize.imatrix.* keys.")


def requantized_name(src: Path, tag: str) -> str:
    """The file name `convert` would give SRC's model at quant `tag` (specconv/hub/naming.py)."""
    from specconv.convert.gguf_summary import serves
    from specconv.hub.naming import SHARD_RE, file_type_tag, scheme_base, strip_quant_tag
    from specconv.runtime.gguf_reader import open_gguf

    f = open_gguf(src)
    match = SHARD_RE.match(src.name)
    stem = match.group("prefix") if match else src.name.removesuffix(".gguf")
    own = file_type_tag(int(f.get("general.file_type", -1)))
    if own is not None and strip_quant_tag(stem, own) != stem:  # already <prefix><base>-<TAG>
        return f"{strip_quant_tag(stem, own)}-{tag}.gguf"
    base = scheme_base(*(f.get(f"general.{k}") for k in ("name", "basename", "size_label", "finetune", "version")))
    prefix = "mtp-" if serves(f)[0] == ["mtp"] else ""
    return f"{prefix}{base or stem}-{tag}.gguf"


def check_file_type(name: str, have_imatrix: bool, param_hint: str) -> str:
    """A file type name (any case) that specconv can make, or a click error saying why not."""
    from specconv.convert.quant_rules import NEEDS_IMATRIX, NOT_ENCODED

    key = name.strip().lower()
    if key in NOT_ENCODED:
        need = " (llama.cpp's quantize also needs an importance matrix for it)" if key in NEEDS_IMATRIX else ""
        raise click.BadParameter(f"{name!r}: not supported by specconv yet: it has no encoder for the "
                                 f"{key.split('_')[0].upper()} types{need}", param_hint=param_hint)
    if key == "q2_k_s" and not have_imatrix:
        raise click.BadParameter(f"{name!r} needs an importance matrix: llama.cpp's quantize refuses Q2_K_S "
                                 "without one; give --imatrix FILE", param_hint=param_hint)
    return key


@click.command("quantize")
@click.argument("src", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("dst", type=click.Path())  # a str: a trailing / names a folder
@click.argument("file_type", metavar="TYPE")
@click.option("--allow-requantize", is_flag=True,
              help="Accept an input whose tensors are already quantized (they are dequantized first; the result "
                   "is not claimed to equal llama.cpp's).")
@click.option("--imatrix", "imatrix_file", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
              metavar="FILE", help=IMATRIX_HELP)
@click.option("--force", is_flag=True, help="Overwrite DST if it exists.")
@click.option("--mkdir", is_flag=True, help=MKDIR_HELP)
@click.option("--threads", type=click.IntRange(0, 1024), default=0, show_default=True,
              help="Encoding threads (0: one per core plus 2). The bytes do not depend on it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(src, dst, file_type, allow_requantize, imatrix_file, force, mkdir, threads, as_json):
    """Requantize SRC (a GGUF with F32, F16 or BF16 weights: ours or any converter's; give the first
    shard of a split file) to TYPE, writing DST: a file, or a folder (DST/, or one that exists) where the
    file is named as `convert` names it, `<Name>-<Size>-<TYPE>.gguf` (`mtp-` first for an MTP sidecar):
    SRC's own name with TYPE for its quant tag when it is named so, else from its general.* keys. TYPE (any case): Q2_K, Q3_K_S, Q3_K_M, Q3_K_L,
    Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, IQ4_NL, IQ4_XS, or Q2_K_S (with --imatrix).

    Each tensor gets the type llama.cpp's quantize tool gives it for that file type, its blocks are
    the tool's bytes (with --imatrix: weighted as the tool weighs them), every KV pair is kept
    (general.file_type and general.quantization_version set as the tool sets them), so DST equals the
    tool's output byte for byte. Written under a temporary name and renamed when complete.
    """
    from specconv.convert.imatrix import load as load_imatrix
    from specconv.convert.requantize import run_requantize

    key = check_file_type(file_type, imatrix_file is not None, "'TYPE'")
    if key not in FILE_TYPES:
        raise click.BadParameter(f"{file_type!r} is not one of {', '.join(FILE_TYPES)}", param_hint="'TYPE'")
    folder = dst.endswith(("/", os.sep)) or Path(dst).is_dir()
    dst = Path(dst)
    check_output_folder(dst if folder else dst.parent, mkdir=mkdir, option="DST", named_folder=folder)
    if folder:
        dst = dst / requantized_name(src, key.upper())
    if dst.exists() and not force:
        raise SpecconvError(f"{dst} already exists (use --force to overwrite)")
    imatrix = load_imatrix(imatrix_file) if imatrix_file is not None else None
    paths, chosen = run_requantize(src, dst, key, allow_requantize=allow_requantize, overwrite=force,
                                   threads=threads, imatrix=imatrix)
    types: dict[str, int] = {}
    for new_type in chosen.values():
        types[new_type.name] = types.get(new_type.name, 0) + 1
    result = {"source": str(src), "written": [str(p) for p in paths], "file_type": key.upper(),
              "tensors": len(chosen), "types": types, "bytes": sum(p.stat().st_size for p in paths)}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"wrote {', '.join(result['written'])}: {result['tensors']} tensors "
                   f"({', '.join(f'{n} {t}' for t, n in sorted(types.items()))}), {result['bytes']} bytes")
