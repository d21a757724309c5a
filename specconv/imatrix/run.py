"""`specconv imatrix`: a GGUF model over chunks of text through the runtime with the collector
watching every weight product, written in llama-imatrix's format (docs/imatrix.md).

The text is tokenized and cut as llama-imatrix cuts it (specconv/compare/chunks.py: the GGUF
tokenizer with a BOS first when the vocabulary adds one, ⌊tokens / ctx⌋ chunks of ctx tokens, each
chunk's first token replaced by BOS when the vocabulary adds one, the rest left out); each chunk is
evaluated from an empty memory, and every position of it counts.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specconv.compare.chunks import Chunks, read_stream
from specconv.errors import SpecconvError
from specconv.imatrix.collector import OUTPUT, ImatrixCollector

FORMATS = ("gguf", "dat")


@dataclass
class ImatrixOptions:
    model: Path
    output: Path
    text: Path | None = None
    tokens: Path | None = None
    ctx: int = 512
    chunks: int | None = None
    process_output: bool = False  # also output.weight (llama-imatrix's --process-output)
    output_format: str = "gguf"  # or "dat", llama-imatrix's legacy format
    device: str = "auto"
    dtype: str | None = None


@dataclass
class ImatrixResult:
    sums: dict[str, np.ndarray]  # name -> float64 [experts, row length]
    counts: dict[str, np.ndarray]  # name -> int64 [experts]
    chunks: Chunks
    n_tokens: int  # of the whole text
    chunk_count: int  # llama-imatrix's imatrix.chunk_count: the largest count // ctx
    dataset: str
    unnamed: int  # products by computed tensors (no GGUF name), not recorded
    own_output: bool  # the model has an output.weight (not a head tied to token_embd)
    model_info: dict


def collect(opts: ImatrixOptions, progress=None) -> ImatrixResult:
    """Run the model over the chunks and return the sums and counts (nothing written)."""
    from specconv.runtime import Context, GraphType, load_model
    from specconv.runtime.backend import observing

    tick = progress or (lambda *a, **k: None)
    if opts.output_format not in FORMATS:
        raise SpecconvError(f"--output-format must be one of {', '.join(FORMATS)}, not {opts.output_format!r}")
    model = load_model(opts.model, device=opts.device, dtype=opts.dtype)
    model.require(GraphType.MAIN)
    tokenizer = model.tokenizer
    stream = read_stream(tokenizer, model.vocab_size, opts.text, opts.tokens)
    bos = tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id is not None else None
    chunks = Chunks.plan(stream, opts.ctx, bos, opts.chunks)
    context = Context(model, GraphType.MAIN, n_ctx=chunks.ctx, n_rs_seq=0)
    collector = ImatrixCollector(model.weights, opts.process_output)
    # llama-imatrix asks for every position's logits, so the head sees every row
    logits = "all" if opts.process_output else None
    tick("chunks", total=chunks.n_chunks)
    with observing(collector):
        for i in range(chunks.n_chunks):
            tick(f"chunk {i + 1}/{chunks.n_chunks}")
            context.clear()
            context.decode(chunks.ids(i), hidden=(), logits=logits)
            tick(f"chunk {i + 1}/{chunks.n_chunks}", advance=1)
    collector.check_finite()
    sums, counts = collector.arrays()
    if not sums:
        raise SpecconvError(f"{Path(opts.model).name}: the runtime multiplied by no blk.* weight "
                            f"({model.arch} graphs reach no recorded weight)")
    chunk_count = max(int(c.max()) for c in counts.values()) // chunks.ctx
    info = {"path": str(opts.model), "arch": model.arch, "dtype": str(model.dtype).replace("torch.", ""),
            "device": str(model.device)}
    return ImatrixResult(sums, counts, chunks, len(stream), chunk_count, str(opts.text or opts.tokens),
                         collector.unnamed, OUTPUT in model.weights, info)


def write(result: ImatrixResult, path: Path, output_format: str = "gguf") -> None:
    """The file, written under a temporary name in its folder and renamed (never half a file)."""
    from specconv.convert import imatrix as im

    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise SpecconvError(f"-o {path}: cannot write there ({exc.strerror or exc})") from None
    try:
        ctx = result.chunks.ctx
        if output_format == "gguf":
            im.write_gguf(tmp, result.sums, result.counts, [result.dataset], result.chunk_count, ctx)
        else:
            im.write_legacy(tmp, result.sums, result.counts, ctx, result.chunk_count, result.dataset)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SpecconvError(f"-o {path}: cannot write it ({exc.strerror or exc})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_imatrix(opts: ImatrixOptions, progress=None) -> dict:
    """Collect, write `opts.output`, and return the report (a JSON-ready dict)."""
    result = collect(opts, progress)
    write(result, opts.output, opts.output_format)
    return report(result, opts)


def report(result: ImatrixResult, opts: ImatrixOptions) -> dict:
    c = result.chunks
    tensors = []
    for name in sorted(result.sums):
        s, n = result.sums[name], result.counts[name]
        routed = n > 0
        mean = float((s[routed] / n[routed, None]).mean()) if routed.any() else None
        tensors.append({"name": name, "experts": int(n.size), "row": int(s.shape[1]), "counts": n.tolist(),
                        "mean_square": mean, "experts_without_data": int((~routed).sum())})
    notes = []
    partial = [t["name"] for t in tensors if t["experts_without_data"]]
    if partial:
        notes.append(f"{len(partial)} expert tensor(s) with experts the text never routed to (weights 1 there "
                     "when quantizing): more text, or text closer to the model's use, reaches them")
    if result.unnamed:
        notes.append(f"{result.unnamed} product(s) by tensors the graph computes from its weights were not recorded")
    if result.own_output and not opts.process_output:
        notes.append(f"{OUTPUT} not recorded (as llama-imatrix without --process-output)")
    return {
        "model": result.model_info,
        "output": {"path": str(opts.output), "format": opts.output_format},
        "text": {"dataset": result.dataset, "tokens": result.n_tokens, "ctx": c.ctx, "chunks": c.n_chunks,
                 "evaluated_tokens": c.n_chunks * c.ctx, "bos_replaces_first_token": c.bos is not None},
        "chunk_count": result.chunk_count,
        "chunk_size": c.ctx,
        "entries": len(tensors),
        "tensors": tensors,
        "notes": notes,
    }
