"""`specconv compare`: the source and each quant over the same chunks of text (docs/compare.md).

Two ways to hold the source while the quants run (`resident`):

* "one" (default): one model in memory at a time. The source runs first and its log-probabilities of
  the scored positions go to the compact store (specconv/compare/store.py, a file in a temporary folder,
  error of the KL divergence bounded per position); then each quant runs against the store.
  The source's MTP head on a quant's trunk needs both: each quant's hidden states and greedy tokens
  are kept on disk, and the source is loaded once more at the end to run its head over them.
* "both": the source and one quant at a time; the source is run again beside each quant and the
  KL divergence is exact (no store).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specconv.compare import mtp_acceptance as mtp
from specconv.compare import stats
from specconv.compare.chunks import Chunks, read_stream
from specconv.compare.scoring import ExactRows, RowScores, score_rows
from specconv.compare.store import RANGE, LogProbStore
from specconv.compare.trunks import SIDECAR_PREFIX, GgufTrunk, HfTrunk
from specconv.errors import SpecconvError
from specconv.runtime.spec_stats import SpecStats

RESIDENT = ("one", "both")
SOURCE_TYPES = ("F32", "F16", "BF16", "Q8_0")  # a source coarser than these is reported, not refused


@dataclass
class CompareOptions:
    source: Path  # a GGUF file, or the Hugging Face checkpoint folder
    quants: list[Path]
    text: Path | None = None
    tokens: Path | None = None
    ctx: int = 512
    chunks: int | None = None
    resident: str = "one"
    draft_max: int = 3
    mtp_stride: int = 1  # a round at every stride-th position
    mtp: list[Path] = field(default_factory=list)  # sidecars of the quants
    source_mtp: Path | None = None
    heads: bool = True  # measure MTP acceptance where a head exists
    costs: bool = True  # time the models for the predicted speed-up
    device: str = "auto"
    dtype: str | None = None


@dataclass
class _Pass:
    """What one file's runs gathered."""

    path: Path
    scores: list[RowScores] = field(default_factory=list)
    own: SpecStats | None = None  # its head on its trunk
    source_head: SpecStats | None = None  # the source's head on its trunk
    costs: dict | None = None
    info: dict = field(default_factory=dict)
    record: mtp.TrunkRecord | None = None


def run_compare(opts: CompareOptions, progress=None) -> dict:
    """The report (a JSON-ready dict). `progress(description, advance=0, total=None)` follows the work."""
    tick = progress or (lambda *a, **k: None)
    if opts.mtp_stride < 1:
        raise SpecconvError("--mtp-stride must be at least 1")
    if opts.resident not in RESIDENT:
        raise SpecconvError(f"--resident must be one of {', '.join(RESIDENT)}, not {opts.resident!r}")
    if not opts.quants:
        raise SpecconvError("give at least one QUANT file to compare with the source")
    source_hf = _source_is_checkpoint(opts.source)
    sidecars = match_sidecars(opts.quants, opts.mtp)
    if source_hf and opts.source_mtp is not None:
        raise SpecconvError("--source-mtp is for a GGUF source; a checkpoint's head does not run through transformers")
    from specconv.runtime.gguf_file import GGUFModelFile
    from specconv.runtime.tokenizer import GGUFTokenizer

    files = ([] if source_hf else [opts.source]) + list(opts.quants)
    headers = [GGUFModelFile([f]) for f in files]  # headers only: the tensors stay mapped, unread
    shapes = [_shape(h) for h in headers]
    for f, s in zip(files, shapes):
        if s != shapes[0]:
            raise SpecconvError(f"{Path(f).name} is {_shape_text(s)}, {Path(files[0]).name} {_shape_text(shapes[0])}: "
                                "compare files of one model")
    header, vocab_size = headers[0], shapes[0][2]
    tokenizer = GGUFTokenizer(header.kv)
    stream = read_stream(tokenizer, vocab_size, opts.text, opts.tokens)
    bos = tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id is not None else None
    chunks = Chunks.plan(stream, opts.ctx, bos, opts.chunks)
    job = _Job(opts, chunks, stream, header.arch, tick, source_hf, sidecars, vocab_size)
    with tempfile.TemporaryDirectory(prefix="specconv-compare-") as tmp:
        job.tmp = Path(tmp)
        try:
            source, quants = job.one_resident() if opts.resident == "one" else job.both_resident()
        finally:
            job.close_files()
    return job.report(source, quants)


def _shape(header) -> tuple[str, int | None, int]:
    """(arch, width, vocabulary) of a GGUF: what every file of one model shares."""
    embd = header.tensors.get("token_embd.weight")
    vocab = int(embd.shape[1]) if embd is not None else len(header.kv.get("tokenizer.ggml.tokens") or [])
    return header.arch, header.get(f"{header.arch}.embedding_length"), vocab


def _shape_text(shape) -> str:
    return f"{shape[0]} of width {shape[1]} and vocabulary {shape[2]}"


def _source_is_checkpoint(path: Path) -> bool:
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecconvError(f"SOURCE {path}: a folder without config.json (give a GGUF file or a checkpoint)")
        return True
    if not path.is_file():
        raise SpecconvError(f"SOURCE {path}: no such file or folder")
    return False


def match_sidecars(quants: list[Path], given: list[Path]) -> list[Path | None]:
    """The sidecar given for each quant (None: its embedded head, or mtp-<its name> next to it, GgufTrunk):
    `--mtp` files named mtp-<quant file name> go to that quant; otherwise as many `--mtp` as quants pair
    up in order."""
    quants = [Path(q) for q in quants]
    out: list[Path | None] = [None] * len(quants)
    names = {SIDECAR_PREFIX + q.name: i for i, q in enumerate(quants)}
    if given and all(Path(g).name in names for g in given):
        for g in given:
            out[names[Path(g).name]] = Path(g)
    elif given:
        if len(given) != len(quants):
            raise SpecconvError(f"{len(given)} --mtp file(s) for {len(quants)} quant(s): give one per QUANT in order, "
                                f"or name each mtp-<QUANT file name>")
        out = [Path(g) for g in given]
    return out


def _greedy(logits: torch.Tensor) -> np.ndarray:
    return logits.argmax(dim=-1).cpu().numpy()


class _Job:
    def __init__(self, opts: CompareOptions, chunks: Chunks, stream, arch: str, tick, source_hf: bool, sidecars,
                 vocab_size: int):
        self.opts, self.chunks, self.stream, self.arch, self.tick = opts, chunks, stream, arch, tick
        self.source_hf, self.sidecars = source_hf, sidecars
        self.k = opts.draft_max
        self.vocab_size = vocab_size  # every GGUF's (checked from the headers)
        self.tmp: Path | None = None
        self.store: LogProbStore | None = None
        self.records: list[mtp.TrunkRecord] = []

    def close_files(self) -> None:
        for f in [self.store, *self.records]:
            if f is not None:
                f.close()

    # ---- models --------------------------------------------------------------------------------
    def _open_source(self):
        o = self.opts
        if self.source_hf:
            dtype = torch.float64 if o.dtype == "f64" else torch.float32
            return HfTrunk(o.source, self.arch, self.vocab_size, dtype)
        return GgufTrunk(o.source, self.chunks.ctx, o.device, o.dtype, o.source_mtp)

    def _open_quant(self, i: int) -> GgufTrunk:
        return GgufTrunk(self.opts.quants[i], self.chunks.ctx, self.opts.device, self.opts.dtype, self.sidecars[i])

    def _drafter(self, trunk):
        if not self.opts.heads or trunk.head is None:
            return None
        return mtp.head_drafter(trunk.head, self.chunks.ctx + self.k + 1, trunk.model)

    def _rounds(self, drafter, ids, hidden, greedy, stats: SpecStats) -> None:
        mtp.teacher_forced(drafter, ids, hidden, greedy, self.chunks.first, self.k, stats, self.opts.mtp_stride)

    def _costs(self, trunk) -> dict | None:
        if not self.opts.costs or trunk.head is None or not self.opts.heads:
            return None
        return mtp.measure_costs(trunk.model, trunk.head, self.stream, self.k)

    def _quant_pass(self, j: int):
        """The j-th quant opened: its pass record, its trunk and its own MTP drafter (None without a head)."""
        q = _Pass(Path(self.opts.quants[j]))
        trunk = self._open_quant(j)
        q.info = self._describe(trunk)
        own = self._drafter(trunk)
        q.own = SpecStats(self.k) if own else None
        return q, trunk, own

    def _describe(self, trunk) -> dict:
        if isinstance(trunk, HfTrunk):
            return {"path": str(trunk.path), "kind": "transformers checkpoint", "type": None}
        from specconv.digest import sha256_file
        from specconv.hub.gguf_info import read_model

        info = read_model(trunk.model.file.paths)
        tensors = trunk.model.file.tensors.values()
        elements = sum(int(np.prod(t.shape)) for t in tensors)
        stored = sum(t.stored.n_bytes for t in tensors)
        paths = trunk.model.file.paths
        # one file's digest, so `upload --compare` can tell the measured file from another of its size
        digest = sha256_file(paths[0]).hex() if len(paths) == 1 else None
        return {"path": str(trunk.path), "kind": "gguf", "type": info.quant, "size_bytes": info.size,
                "sha256": digest, "bits_per_weight": 8.0 * stored / elements if elements else None,
                "head": str(trunk.head_file) if trunk.head_file is not None else None}

    # ---- the two ways of running -----------------------------------------------------------------
    def one_resident(self):
        c = self.chunks
        source = _Pass(Path(self.opts.source))
        n_quants = len(self.opts.quants)
        trunk = self._open_source()
        store = self.store = LogProbStore(c.n_chunks * c.scored, self.vocab_size, self.tmp)
        drafter = self._drafter(trunk)
        # chunks to run: the source, each quant, and the source's head over each quant's recorded trunk
        self.tick("source", total=c.n_chunks * (1 + n_quants + (n_quants if drafter is not None else 0)))
        source_hidden = mtp.wanted_hidden([drafter])
        source.own = SpecStats(self.k) if drafter else None
        base_rows = []
        source.info = self._describe(trunk)
        label = _label(source.info)
        for i in range(c.n_chunks):
            self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}")
            ids = c.ids(i)
            out = trunk.run(ids, c.first, source_hidden)
            base_rows.append(store.append(out.logits[:c.scored], c.targets(i)))
            if drafter is not None:
                self._rounds(drafter, ids, out.hidden, _greedy(out.logits), source.own)
            self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}", advance=1)
        source.costs = self._costs(trunk)
        trunk.close()
        quants = []
        for j in range(len(self.opts.quants)):
            q, trunk, own = self._quant_pass(j)
            if drafter is not None:
                q.record = mtp.TrunkRecord(self.tmp, f"quant{j}", c.n_chunks, c.ctx, c.ctx - c.first)
                self.records.append(q.record)
            names = tuple(dict.fromkeys(mtp.wanted_hidden([own]) + source_hidden))
            label = _label(q.info)
            for i in range(c.n_chunks):
                self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}")
                ids = c.ids(i)
                out = trunk.run(ids, c.first, names)
                q.scores.append(score_rows(base_rows[i], out.logits[:c.scored], c.targets(i)))
                greedy = _greedy(out.logits)
                if own is not None:
                    self._rounds(own, ids, out.hidden, greedy, q.own)
                if q.record is not None:
                    q.record.save(i, {n: out.hidden[n] for n in source_hidden}, greedy)
                self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}", advance=1)
            q.costs = self._costs(trunk)
            trunk.close()
            quants.append(q)
        if drafter is not None:
            self._source_head_on_records(quants)
        return source, quants

    def _source_head_on_records(self, quants: list[_Pass]) -> None:
        """The source's head over each quant's recorded trunk (the source loaded once more)."""
        c = self.chunks
        trunk = self._open_source()
        drafter = self._drafter(trunk)
        for q in quants:
            q.source_head = SpecStats(self.k)
            for i in range(c.n_chunks):
                self.tick(f"source head on {_label(q.info)}: chunk {i + 1}/{c.n_chunks}")
                hidden, greedy = q.record.load(i, trunk.model.device, trunk.model.dtype)
                self._rounds(drafter, c.ids(i), hidden, greedy, q.source_head)
                self.tick(f"source head on {_label(q.info)}: chunk {i + 1}/{c.n_chunks}", advance=1)
        trunk.close()

    def both_resident(self):
        c = self.chunks
        source = _Pass(Path(self.opts.source))
        self.tick("source", total=c.n_chunks * len(self.opts.quants))
        src = self._open_source()
        source.info = self._describe(src)
        drafter = self._drafter(src)
        source_hidden = mtp.wanted_hidden([drafter])
        source.own = SpecStats(self.k) if drafter else None
        quants = []
        for j in range(len(self.opts.quants)):
            q, trunk, own = self._quant_pass(j)
            q.source_head = SpecStats(self.k) if drafter else None
            names = tuple(dict.fromkeys(mtp.wanted_hidden([own]) + source_hidden))
            label = _label(q.info)
            for i in range(c.n_chunks):
                self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}")
                ids, targets = c.ids(i), c.targets(i)
                s_out = src.run(ids, c.first, source_hidden if j == 0 else ())
                base = ExactRows(s_out.logits[:c.scored], targets)
                if j == 0 and drafter is not None:
                    self._rounds(drafter, ids, s_out.hidden, _greedy(s_out.logits), source.own)
                out = trunk.run(ids, c.first, names)
                q.scores.append(score_rows(base, out.logits[:c.scored], targets))
                greedy = _greedy(out.logits)
                if own is not None:
                    self._rounds(own, ids, out.hidden, greedy, q.own)
                if drafter is not None:
                    self._rounds(drafter, ids, out.hidden, greedy, q.source_head)
                self.tick(f"{label}: chunk {i + 1}/{c.n_chunks}", advance=1)
            q.costs = self._costs(trunk)
            trunk.close()
            quants.append(q)
        source.costs = self._costs(src)
        src.close()
        return source, quants

    # ---- the report -----------------------------------------------------------------------------------
    def report(self, source: _Pass, quants: list[_Pass]) -> dict:
        c, o = self.chunks, self.opts
        all_scores = [RowScores.concat(q.scores) for q in quants]
        base_nll = all_scores[0].nll_base
        notes = []
        if source.info.get("type") not in (None, *SOURCE_TYPES):
            notes.append(f"the source is {source.info['type']}: the figures measure the distance to it, not to "
                         f"an unrounded model (give an F32/F16/BF16/Q8_0 file or the checkpoint)")
        if len(base_nll) < stats.MIN_COUNT_FOR_DISTRIBUTION:
            notes.append(f"{len(base_nll)} scored positions: llama-perplexity prints no percentiles below "
                         f"{stats.MIN_COUNT_FOR_DISTRIBUTION}")
        out = {
            "source": {**source.info, "ppl": stats.perplexity(base_nll),
                       "mtp": self._heads(source.own, source.costs)},
            "text": {"tokens": len(self.stream), "ctx": c.ctx, "chunks": c.n_chunks, "scored_per_chunk": c.scored,
                     "scored": len(base_nll), "bos_replaces_first_token": c.bos is not None},
            "resident": o.resident,
            "store": ({"format": f"uint16 log-probabilities over {RANGE:g} nats, renormalised (docs/compare.md §4)",
                       "bytes": self.store.nbytes} if self.store is not None else None),
            "draft_max": self.k if o.heads else None,
            "quants": [],
            "notes": notes,
        }
        for q, s in zip(quants, all_scores):
            entry = {**q.info, **stats.summarize(s.nll, s.nll_base, s.kld, s.p_diff, s.same_top)}
            entry["kld"]["store_bound"] = {"mean": float(s.kld_bound.mean()), "max": float(s.kld_bound.max())}
            entry["mtp"] = self._quant_heads(q, source)
            out["quants"].append(entry)
        return out

    def _heads(self, st: SpecStats | None, costs: dict | None) -> dict | None:
        return mtp.summary(st, costs) if st is not None else None

    def _quant_heads(self, q: _Pass, source: _Pass) -> dict | None:
        if q.own is None and q.source_head is None:
            return None
        own = self._heads(q.own, q.costs)
        on_trunk = self._heads(q.source_head, None)
        base = source.own.to_json()["per_position"] if source.own is not None else None
        line = None
        if own is not None and base is not None:
            line = (f"{q.info.get('type') or q.path.name}: acceptance at position 1 {base[0]:.2f} → "
                    f"{own['per_position'][0]:.2f}")
        return {"head": q.info.get("head"), "own_head": own, "source_head_on_this_trunk": on_trunk, "summary": line}


def _label(info: dict) -> str:
    return f"{Path(info['path']).name}" + (f" ({info['type']})" if info.get("type") else "")
