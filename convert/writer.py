"""Atomic GGUF output: temporary names in the target folder, renamed only when every file is complete.

One `GgufOutput` is one logical file (possibly split into `-00001-of-0000N.gguf` shards by
gguf-py's writer, which puts `split.no`/`split.count`/`split.tensors.count` in every shard and all
other KV in shard 1). Once opened, every tensor has a fixed place in its file, so its chunks are
written with positioned writes from whichever thread encoded them, in any order; the bytes are the
same as writing them in sequence. `AtomicOutputs` writes several outputs in one pass, so `--mtp separate` reads
each source tensor once, and guarantees that on any error, a full disk, Ctrl-C or SIGTERM no file is left
behind and a file it would replace is untouched: write errors become one-line errors naming the file,
SIGTERM raises like Ctrl-C while outputs are open, and two runs writing the same names take turns
renaming (a lock on the folder), the later one refusing unless it may overwrite.

Signals (`_Interrupts`): SIGINT / SIGTERM raise only in the caller's code between `__enter__` and
`__exit__`, which Python's `with` always follows with `__exit__`. While the files are opened, renamed or
removed a signal is recorded instead, and raised once that step is done (after the renames: the
output is complete, the interrupt still reported). The recording is done by the Python-level handler,
not a signal mask, so it holds whichever thread the kernel hands the signal to (progress bars and
encoding workers are threads), and it also covers the first instruction of `__exit__`, where CPython
runs a pending handler before any line of it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import struct
import threading
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from types import CodeType
from typing import Any, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter
from gguf.gguf_writer import SHARD_NAME_FORMAT

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError

# gguf-py warns through logging when a split limit leaves one shard ("not splitting"); that is expected.
logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF shows the reverse)
    ggml_type: GGMLQuantizationType
    nbytes: int


@dataclass(frozen=True)
class Place:
    """Where a tensor's bytes lie: an open file and the offset of its first byte."""
    fd: int
    offset: int
    nbytes: int


class _Writer(GGUFWriter):
    """gguf-py's writer with array values packed in one call instead of one call per item.

    A 250k-token vocabulary is three arrays of 250k items; gguf-py packs them item by item (seconds
    per file). The bytes are the same: u32 item type, u64 count, then the items as gguf-py packs them.
    The files it opens are `shard_paths` (GgufOutput's temporary names) instead of names derived from
    one stem, so each shard's temporary sits next to its final name.
    """

    shard_paths: Sequence[Path] = ()

    def format_shard_names(self, path: Path) -> list[Path]:
        return list(self.shard_paths) if self.shard_paths else super().format_shard_names(path)

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None) -> bytes:
        if vtype == GGUFValueType.ARRAY and self.endianess == GGUFEndian.LITTLE and isinstance(val, (list, tuple)) \
                and len(val) > 0:
            item_type = sub_type if sub_type is not None else _item_type(val)
            items = _pack_items(val, item_type) if item_type is not None else None
            if items is not None:
                head = struct.pack("<I", vtype) if add_vtype else b""
                return head + struct.pack("<IQ", item_type, len(val)) + items
        return super()._pack_val(val, vtype, add_vtype, sub_type)


# The item type gguf-py infers (GGUFValueType.get_type) for arrays of plain Python values.
_PLAIN_TYPES = {str: GGUFValueType.STRING, bool: GGUFValueType.BOOL, int: GGUFValueType.INT32,
                float: GGUFValueType.FLOAT32}


def _item_type(values: Sequence[Any]) -> GGUFValueType | None:
    first = type(values[0])
    if first not in _PLAIN_TYPES or set(map(type, values)) != {first}:
        return None  # mixed or numpy items: gguf-py's own inference and checks
    return _PLAIN_TYPES[first]


def _pack_items(values: Sequence[Any], item_type: GGUFValueType) -> bytes | None:
    if item_type == GGUFValueType.STRING:
        encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
        return b"".join(struct.pack("<Q", len(e)) + e for e in encoded)
    fmt = GGUFWriter._simple_value_packing.get(item_type)
    if fmt is None:
        return None  # nested arrays: gguf-py's own path
    return struct.pack(f"{'' if item_type == GGUFValueType.BOOL else '<'}{len(values)}{fmt}", *values)


def _cut(shards: list[dict], counts: Sequence[int]) -> list[dict]:
    """Tensor infos re-cut into shards of `counts` tensors each, order kept."""
    items = [item for shard in shards for item in shard.items()]
    if sum(counts) != len(items) or any(c <= 0 for c in counts):
        raise SpecconvError(f"internal: shards of {list(counts)} tensors for {len(items)} tensors")
    ends = list(accumulate(counts))
    return [dict(items[end - c:end]) for c, end in zip(counts, ends)]


class Terminated(KeyboardInterrupt):
    """SIGTERM while outputs are open: unwinds like Ctrl-C, so temporary files are removed."""


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class _Interrupts:
    """SIGINT and SIGTERM for the life of one `AtomicOutputs` (main thread only; elsewhere nothing changes).

    `holding`: a signal is recorded in `pending` instead of raised; so is one that lands in a frame
    running one of `steps` (code that sets `holding` as its first statement, before which CPython may
    already run the handler). Otherwise SIGINT raises KeyboardInterrupt and SIGTERM `Terminated`.
    SIGINT is taken over only from Python's own handler (default_int_handler): an ignored or custom
    SIGINT stays as it is; an ignored SIGTERM stays ignored.
    """

    def __init__(self, steps: Sequence[CodeType]):
        self.steps = frozenset(steps)
        self.holding = False
        self.pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take the signals over, holding (the first step, opening, is not to be cut)."""
        self.holding = True
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, takes_over in ((signal.SIGINT, lambda h: h is signal.default_int_handler),
                                   (signal.SIGTERM, lambda h: h is not signal.SIG_IGN and h is not None)):
            if takes_over(signal.getsignal(signum)):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.holding or (frame is not None and frame.f_code in self.steps):
            self.pending.append(signum)
            return
        raise _interrupt(signum)

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had (a signal from here on goes to them)."""
        while self._previous:
            signum, previous = self._previous.popitem()
            signal.signal(signum, previous)


def write_error(path: Path, exc: OSError) -> SpecconvError:
    """A failed write as one line: which file, and why (a full disk, a file-size limit...)."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why += " (the disk is full)"
    elif exc.errno == errno.EFBIG:
        why += " (over the file-size limit)"
    return SpecconvError(f"cannot write {Path(path).name}: {why}; nothing was written")


COPY_BUFFER = 8 << 20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


class GgufOutput:
    """A GGUF file to be written: its KV, its tensor list (in write order) and its shard layout."""

    def __init__(self, path: Path, arch: str, kv: Sequence[MetaKV], tensors: Sequence[TensorEntry],
                 split_max_size: int = 0, shard_counts: Sequence[int] | None = None,
                 shard_names: Sequence[Path] | None = None):
        """`split_max_size` lets gguf-py cut shards by tensor bytes; `shard_counts` (tensors per shard,
        in order) sets the cut exactly instead. `shard_names`: the final name of each shard, instead of
        `{path stem}-0000i-of-0000N.gguf` next to `path`."""
        self.path = Path(path)
        self.arch = arch
        self.kv = list(kv)
        self.tensors = list(tensors)
        self._writer = _Writer(None, arch, split_max_size=split_max_size)
        for entry in self.kv:
            if entry.key == "general.alignment":  # a copied key must describe the data written
                self._writer.data_alignment = int(entry.value)
            if entry.key == "general.architecture":
                continue  # the writer adds it first, from `arch`
            if entry.vtype == GGUFValueType.ARRAY and len(entry.value) == 0:
                continue  # GGUF cannot encode an empty array; readers treat absent and empty alike
            self._writer.add_key_value(entry.key, entry.value, entry.vtype, entry.sub_type)
        for t in self.tensors:
            # A non-uint8 dtype makes the writer take the shape as given (torch order).
            self._writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        if shard_counts is not None:
            self._writer.tensors = _cut(self._writer.tensors, shard_counts)
        n = len(self._writer.tensors)
        if shard_names is not None and len(shard_names) != n:
            raise SpecconvError(f"internal: {len(shard_names)} names for {n} shards of {self.path.name}")
        self.final_paths = [Path(p) for p in shard_names] if shard_names is not None else [self.path] if n == 1 else [
            self.path.with_name(SHARD_NAME_FORMAT.format(self.path.stem, i + 1, n)) for i in range(n)]
        self.shard_sizes = [sum(ti.nbytes for ti in shard.values()) for shard in self._writer.tensors]
        # Each temporary next to its final name (a rename, never a copy), hidden, and named for this process.
        self.temp_paths = [p.with_name(f".{p.stem}.partial-{os.getpid()}.gguf") for p in self.final_paths]
        self._writer.shard_paths = self.temp_paths
        self._places: dict[str, Place] = {}
        self._next = 0  # tensors accounted for, in order
        self._due: int | None = None  # bytes still due of the tensor being written

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def existing(self) -> list[Path]:
        return [p for p in self.final_paths if p.exists()]

    def open(self) -> None:
        """Write header, KV and tensor infos, and size every file to its final length: from here on each
        tensor has a fixed place, so any thread can write any chunk of it (`write_at`)."""
        try:
            self._open()
        except OSError as exc:
            raise write_error(self.path, exc) from None
        except (struct.error, TypeError, ValueError) as exc:  # a KV value that does not fit its declared type
            raise SpecconvError(f"cannot write {self.path.name}: a KV value does not fit its GGUF type ({exc})"
                                [:300]) from None

    def _open(self) -> None:
        w = self._writer
        w.write_header_to_file(self.temp_paths[0])
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self._places = {}
        for fout, shard in zip(w.fout, w.tensors):
            fout.flush()  # header, KV and infos reach the file before any positioned write
            at = w.ggml_pad(fout.tell(), w.data_alignment)
            for name, info in shard.items():  # the order and padding of the offsets in the infos
                self._places[name] = Place(fout.fileno(), at, info.nbytes)
                at = w.ggml_pad(at + info.nbytes, w.data_alignment)
            os.ftruncate(fout.fileno(), at)  # alignment padding stays a hole: it reads as the zeros it is

    def place(self, name: str) -> Place:
        """Where tensor `name`'s bytes go (known once the file is open)."""
        return self._places[name]

    def write_at(self, place: Place, offset: int, data: np.ndarray) -> None:
        """Bytes of a tensor starting `offset` bytes into it; safe from any thread, outside the GIL."""
        if offset < 0 or offset + data.nbytes > place.nbytes:
            raise SpecconvError(f"internal: {data.nbytes} bytes at {offset} do not fit a {place.nbytes}-byte tensor")
        view, at = memoryview(data).cast("B"), place.offset + offset
        try:
            while view:
                n = os.pwrite(place.fd, view, at)
                view, at = view[n:], at + n
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def copy(self, name: str, src_fd: int, src_offset: int) -> None:
        """The next tensor's bytes, copied from another file (from `src_offset` on): like `write`,
        by the kernel where it can (`copy_file_range`: the bytes never pass through this process),
        else through a buffer."""
        place = self.place(name)
        self.begin(name, place.nbytes)
        self._copy_into(place, src_fd, src_offset)
        self.written(place.nbytes)
        self.end()

    def _copy_into(self, place: Place, src_fd: int, src_offset: int) -> None:
        done = 0
        try:
            while done < place.nbytes:
                n = os.copy_file_range(src_fd, place.fd, place.nbytes - done, src_offset + done, place.offset + done)
                if n == 0:
                    raise SpecconvError(f"the source file ended {place.nbytes - done} bytes early (changed while copying?)")
                done += n
        except (AttributeError, OSError) as exc:  # not Linux, or a file system pair that cannot
            if isinstance(exc, OSError) and exc.errno not in _NO_KERNEL_COPY:
                raise write_error(self.path, exc) from None
            buf = np.empty(min(place.nbytes - done, COPY_BUFFER), dtype=np.uint8)
            while done < place.nbytes:
                piece = buf[:min(buf.size, place.nbytes - done)]
                if os.preadv(src_fd, [piece], src_offset + done) != piece.size:
                    raise SpecconvError(f"the source file ended {place.nbytes - done} bytes early (changed while copying?)")
                self.write_at(place, done, piece)
                done += piece.size

    def write(self, name: str, data: np.ndarray) -> None:
        """The next tensor's bytes (flat uint8) in one piece."""
        self.begin(name, data.nbytes)
        self.write_at(self.place(name), 0, data)
        self.written(data.nbytes)
        self.end()

    def begin(self, name: str, nbytes: int) -> None:
        """Account for the next tensor; tensors must come in the declared order."""
        expected = self.tensors[self._next] if self._next < len(self.tensors) else None
        if expected is None or name != expected.name or nbytes != expected.nbytes or self._due is not None:
            raise SpecconvError(f"internal: {self.path.name} expected "
                                f"{expected.name if expected else 'no more tensors'}, got {name} ({nbytes} bytes)")
        self._due = nbytes

    def written(self, nbytes: int) -> None:
        """`nbytes` more of the open tensor's bytes are in the file."""
        if self._due is None or nbytes > self._due:
            raise SpecconvError(f"internal: {self.path.name}: {self.tensors[self._next].name} got too many bytes")
        self._due -= nbytes

    def end(self) -> None:
        if self._due:
            raise SpecconvError(f"internal: {self.path.name}: {self.tensors[self._next].name} is "
                                f"{self._due} bytes short")
        self._due = None
        self._next += 1

    def close(self) -> None:
        try:
            self._writer.close()
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def complete(self) -> bool:
        return self._next == len(self.tensors) and self._due is None


class AtomicOutputs:
    """Context manager: open every output, and on exit rename all (success) or remove all (any error).

    On SIGINT / SIGTERM the outputs are either all removed (the signal came before the renames; a file
    that was to be replaced is untouched) or all in place (it came during them, and is raised after):
    never a temporary file or part of a set, wherever the signal lands (`_Interrupts`)."""

    def __init__(self, outputs: Sequence[GgufOutput], overwrite: bool = False):
        self.outputs = list(outputs)
        finals = [p for o in self.outputs for p in o.final_paths]
        if len(set(finals)) != len(finals):
            raise SpecconvError(f"two outputs would share the name {finals[0].name}; choose another -o")
        existing = [p for o in self.outputs for p in o.existing()]
        if existing and not overwrite:
            raise SpecconvError(f"{existing[0]} already exists (use --force to overwrite)")
        self.overwrite = overwrite
        self._made_dirs: list[Path] = []
        self._interrupts = _Interrupts([AtomicOutputs.__enter__.__code__, AtomicOutputs.__exit__.__code__])

    def __enter__(self) -> "AtomicOutputs":
        self._interrupts.install()  # before the first file exists; a signal while opening waits
        try:
            for o in self.outputs:
                for folder in dict.fromkeys(p.parent for p in o.final_paths):
                    self._make_dir(folder)
                o.open()
        except BaseException:
            self._discard()
            self._interrupts.uninstall()
            raise
        if self._interrupts.pending:  # Ctrl-C while opening: nothing is written
            self._discard()
            self._interrupts.uninstall()
            raise _interrupt(self._interrupts.pending[0])
        self._interrupts.holding = False  # from here to __exit__, the caller's code: signals raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._interrupts.holding = True  # first: a signal from here on waits until the files are settled
        try:
            if exc_type is not None:
                self._discard()
                return False
            try:
                for o in self.outputs:
                    o.close()
                    if not o.complete():
                        raise SpecconvError(f"internal: {o.path.name} was closed before all tensors were written")
                self._publish()
            except BaseException:
                self._discard()
                raise
        finally:
            self._interrupts.uninstall()
        if self._interrupts.pending:  # it came while renaming: the output is complete, the interrupt still ends the run
            raise _interrupt(self._interrupts.pending[0])
        return False  # (a signal during a discard: the exception on its way ends the run anyway)

    def _publish(self) -> None:
        """Rename every temporary file to its final name, holding the folder's lock: a concurrent run to
        the same names renames before or after, never in between, and without --force the later refuses."""
        folders = sorted({p.parent for o in self.outputs for p in o.final_paths})
        locks = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in folders]
        try:
            for fd in locks:
                fcntl.flock(fd, fcntl.LOCK_EX)
            existing = [p for o in self.outputs for p in o.existing()]
            if existing and not self.overwrite:
                raise SpecconvError(f"{existing[0]} appeared while this run was writing (another run?); "
                                    f"nothing was written (use --force to overwrite)")
            done: list[Path] = []
            try:
                for o in self.outputs:
                    for src, dst in zip(o.temp_paths, o.final_paths):
                        os.replace(src, dst)
                        done.append(dst)
            except OSError as exc:
                for p in done:  # all or nothing
                    p.unlink(missing_ok=True)
                raise write_error(dst, exc) from None
        finally:
            for fd in locks:
                os.close(fd)  # closing releases the lock

    def _make_dir(self, folder: Path) -> None:
        missing = [p for p in [folder, *folder.parents] if not p.exists()]
        for made in reversed(missing):  # outermost first; each recorded as soon as it exists
            try:
                made.mkdir()
            except FileExistsError:
                if not made.is_dir():
                    raise SpecconvError(f"cannot create folder {made}: a file of that name is in the way") from None
                continue
            except OSError as exc:
                raise SpecconvError(f"cannot create folder {made}: {exc.strerror or exc}") from None
            self._made_dirs.insert(0, made)  # deepest first, so they can be removed in this order

    def _discard(self) -> None:
        for o in self.outputs:
            try:
                o.close()
            except SpecconvError:
                pass  # the write already failed; the files go anyway
            for p in o.temp_paths:
                try:
                    p.unlink()
                except (FileNotFoundError, NotADirectoryError):
                    pass  # never created (its folder could not be)
        for d in self._made_dirs:
            try:
                d.rmdir()  # only folders this run created, and only when empty
            except OSError:
                pass
