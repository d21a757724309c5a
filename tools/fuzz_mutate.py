"""GGUF files as editable documents, and the mutations `tools/fuzz_gguf.py` applies to them.

A `Doc` is a parsed GGUF file (KV entries with their value types, tensor infos, the data section);
`Doc.to_bytes()` writes it back byte for byte. Mutations are structured (a KV value set to an edge
value or another type, an array shortened or lengthened, an element replaced, a key removed or
added; a tensor's dimensions, type, offset or name changed, a tensor dropped or its integer data
corrupted) or raw (bits flipped in the header, 4- and 8-byte fields set to edge values,
truncation). Each is chosen from a `random.Random`, so a case is reproduced from its seed.
"""

from __future__ import annotations

import copy
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFValueType

from specconv.runtime.gguf_reader import scan_header

V = GGUFValueType
_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
        V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_RANGE = {V.UINT8: (0, 255), V.INT8: (-128, 127), V.UINT16: (0, 65535), V.INT16: (-32768, 32767),
          V.UINT32: (0, 2**32 - 1), V.INT32: (-2**31, 2**31 - 1), V.UINT64: (0, 2**64 - 1),
          V.INT64: (-2**63, 2**63 - 1)}
_F32_MAX = 3.4028234663852886e38
EDGE_INTS = [0, 1, 2, 3, 7, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
             2**64 - 1, -1, -2**31]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf"), 0.5]
TYPES = [t for t in GGMLQuantizationType]
# Keys the runtime reads that a file may lack: a mutation adds them with odd values.
EXTRA_KEYS = ["{a}.attention.head_count_kv", "{a}.rope.dimension_count", "{a}.nextn_predict_layers",
              "{a}.expert_count", "{a}.attention.recurrent_layers", "{a}.feed_forward_length",
              "{a}.attention.sliding_window_pattern", "{a}.expert_group_count", "{a}.leading_dense_block_count",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
              "general.alignment", "split.count", "split.no", "{a}.vocab_size", "{a}.rope.scaling.type"]


@dataclass
class KV:
    key: str
    vtype: GGUFValueType
    value: object  # scalars; bytes for strings; lists for arrays
    sub: GGUFValueType | None = None


@dataclass
class TI:
    name: str
    dims: list[int]
    qtype: int
    offset: int  # relative to the data section


@dataclass
class Doc:
    version: int
    kvs: list[KV]
    tensors: list[TI]
    alignment: int
    data: bytearray
    note: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, path: Path) -> "Doc":
        raw = Path(path).read_bytes()
        h = scan_header(raw, Path(path).name)
        version = struct.unpack_from("<I", raw, 4)[0]
        kvs = [KV(e.key, e.vtype, copy.copy(e.value), e.sub_type) for e in h.kv.values()]
        tensors = [TI(t.name, list(t.shape), int(t.ggml_type), t.offset - h.data_offset) for t in h.tensors]
        return cls(version, kvs, tensors, h.alignment, bytearray(raw[h.data_offset:]))

    def arch(self) -> str:
        for kv in self.kvs:
            if kv.key == "general.architecture" and isinstance(kv.value, bytes):
                return kv.value.decode("utf-8", "replace")
        return "x"

    def to_bytes(self) -> bytes:
        out = [struct.pack("<IIQQ", 0x46554747, self.version, len(self.tensors), len(self.kvs))]
        for kv in self.kvs:
            out.append(_str(kv.key.encode()) + struct.pack("<I", kv.vtype) + _value(kv.vtype, kv.value, kv.sub))
        for t in self.tensors:
            out.append(_str(t.name.encode()) + struct.pack("<I", len(t.dims))
                       + b"".join(struct.pack("<Q", d % 2**64) for d in t.dims) + struct.pack("<IQ", t.qtype % 2**32,
                                                                                             t.offset % 2**64))
        head = b"".join(out)
        pad = (-len(head)) % self.alignment if self.alignment > 0 else 0
        return head + b"\0" * pad + bytes(self.data)


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _scalar(vtype: GGUFValueType, v) -> bytes:
    if vtype == V.STRING:
        return _str(v if isinstance(v, bytes) else str(v).encode())
    fmt = _FMT[vtype]
    if vtype in _RANGE:
        lo, hi = _RANGE[vtype]
        v = int(v) if not isinstance(v, float) or v == v and abs(v) != float("inf") else 0
        v = min(max(v, lo), hi)
    elif vtype == V.BOOL:
        v = bool(v)
    else:
        try:
            v = float(v) if isinstance(v, (int, float)) else 0.0
        except OverflowError:  # an int beyond any double
            v = float("inf") if v > 0 else float("-inf")
        if fmt == "<f" and abs(v) > _F32_MAX and v == v:  # what a float32 holds of it (struct refuses)
            v = float("inf") if v > 0 else float("-inf")
    return struct.pack(fmt, v)


def _value(vtype: GGUFValueType, v, sub) -> bytes:
    if vtype != V.ARRAY:
        return _scalar(vtype, v)
    items = v if isinstance(v, list) else []
    return struct.pack("<IQ", sub, len(items)) + b"".join(_scalar(sub, x) for x in items)


# ---- structured mutations ----------------------------------------------------------------------

def _edge_for(kv: KV, rng: random.Random):
    t = kv.vtype
    if t in _RANGE:
        v = kv.value
        return rng.choice(EDGE_INTS + [v + 1, v - 1, v * 2, v // 2, rng.randrange(0, 1 << rng.choice((4, 8, 16, 32)))])
    if t in (V.FLOAT32, V.FLOAT64):
        return rng.choice(EDGE_FLOATS + [kv.value * 2, -kv.value])
    if t == V.BOOL:
        return not kv.value
    if t == V.STRING:
        return rng.choice([b"", b"gpt2", b"gemma4", b"llama", b"qwen35", b"default", b"\xff\xfe", b"a b c",
                           kv.value[: len(kv.value) // 2], kv.value + b"x", b"deepseek2", b"yarn"])
    return kv.value


def _retype(kv: KV, rng: random.Random) -> None:
    choices = [V.UINT32, V.INT32, V.FLOAT32, V.BOOL, V.STRING, V.UINT64, V.INT8, V.ARRAY]
    kv.vtype = rng.choice(choices)
    if kv.vtype == V.ARRAY:
        kv.sub = rng.choice([V.UINT32, V.INT32, V.STRING, V.BOOL, V.FLOAT32])
        kv.value = [rng.choice([0, 1, 2, 4, 64]) if kv.sub != V.STRING else b"x" for _ in range(rng.choice([0, 1, 3, 5]))]
    elif kv.vtype == V.STRING:
        kv.value = rng.choice([b"4", b"", b"gpt2"])
    elif kv.vtype in (V.FLOAT32,):
        kv.value = rng.choice(EDGE_FLOATS)
    else:
        kv.value = rng.choice([0, 1, 2, 4, 64, 255])


def _mutate_array(kv: KV, rng: random.Random) -> None:
    items = list(kv.value)
    op = rng.randrange(7)
    if op == 0 or not items:
        items = items[: rng.randrange(len(items) + 1)]
    elif op == 1:
        items = items + items[: rng.randrange(1, len(items) + 1)]
    elif op == 2:
        items = []
    elif op == 3:  # one element replaced
        i = rng.randrange(len(items))
        if kv.sub == V.STRING:
            items[i] = rng.choice([b"", b" ", b"a b", b"\xff", items[rng.randrange(len(items))], b"x y z", b"\xc4\xa0 "])
        elif kv.sub in _RANGE:
            items[i] = rng.choice(EDGE_INTS)
        elif kv.sub in (V.FLOAT32, V.FLOAT64):
            items[i] = rng.choice(EDGE_FLOATS)
        else:
            items[i] = not items[i]
    elif op == 4:
        kv.sub = rng.choice([V.UINT32, V.INT32, V.STRING, V.BOOL, V.FLOAT32, V.UINT8])
        items = [(b"1" if kv.sub == V.STRING else 1) for _ in items] if rng.random() < 0.5 else items
        if kv.sub != V.STRING:
            items = [x if not isinstance(x, bytes) else len(x) for x in items]
        else:
            items = [x if isinstance(x, bytes) else str(x).encode() for x in items]
    elif op == 5:
        rng.shuffle(items)
    else:  # a few elements replaced by their neighbours
        for _ in range(rng.randrange(1, 4)):
            i, j = rng.randrange(len(items)), rng.randrange(len(items))
            items[i] = items[j]
    kv.value = items


def mutate_kv(doc: Doc, rng: random.Random) -> None:
    op = rng.randrange(10)
    if op == 9 or not doc.kvs:  # add a key the runtime reads
        key = rng.choice(EXTRA_KEYS).format(a=doc.arch())
        doc.kvs = [kv for kv in doc.kvs if kv.key != key]
        kv = KV(key, V.UINT32, 0)
        _retype(kv, rng)
        if rng.random() < 0.5 and kv.vtype in _RANGE:
            kv.value = rng.choice(EDGE_INTS[:12])
        doc.kvs.append(kv)
        doc.note.append(f"add {key}")
        return
    kv = rng.choice(doc.kvs)
    doc.note.append(f"kv {kv.key}")
    if op == 8:
        doc.kvs.remove(kv)
    elif op == 7:
        _retype(kv, rng)
    elif kv.vtype == V.ARRAY:
        _mutate_array(kv, rng)
    else:
        kv.value = _edge_for(kv, rng)


def mutate_tensor(doc: Doc, rng: random.Random) -> None:
    if not doc.tensors:
        return
    t = rng.choice(doc.tensors)
    doc.note.append(f"tensor {t.name}")
    op = rng.randrange(9)
    if op == 0:
        i = rng.randrange(len(t.dims)) if t.dims else 0
        if t.dims:
            t.dims[i] = rng.choice([0, 1, t.dims[i] + 1, t.dims[i] - 1, t.dims[i] * 2, t.dims[i] // 2, 2**31, 2**32,
                                    2**63, 2**64 - 1, 2**33 + t.dims[i]])
    elif op == 1:
        t.dims = list(reversed(t.dims)) if rng.random() < 0.5 else t.dims + [rng.choice([1, 2])]
    elif op == 2:
        t.dims = t.dims[:-1] if rng.random() < 0.5 else t.dims * 2
    elif op == 3:
        t.qtype = int(rng.choice(TYPES)) if rng.random() < 0.9 else rng.choice([40, 255, 2**31])
    elif op == 4:
        t.offset = rng.choice([0, t.offset + 1, t.offset + doc.alignment, t.offset - doc.alignment, 2**40, 2**64 - 1,
                               rng.choice(doc.tensors).offset])
    elif op == 5:
        t.name = rng.choice([rng.choice(doc.tensors).name, "", "blk.999.attn_q.weight", t.name + "x",
                             t.name.replace("blk.0.", "blk.1.")])
    elif op == 6:
        doc.tensors.remove(t)
    elif op == 7:  # 2 dims swapped: same element count, wrong layout
        if len(t.dims) >= 2:
            t.dims[0], t.dims[1] = t.dims[1], t.dims[0]
    else:  # integer data corrupted (EAGLE-3's d2t ids)
        if t.qtype in (24, 25, 26, 27):
            size = {24: 1, 25: 2, 26: 4, 27: 8}[t.qtype]
            at = t.offset + size * rng.randrange(max(1, t.dims[0] if t.dims else 1))
            if 0 <= at < len(doc.data) - size:
                doc.data[at:at + size] = rng.choice([b"\xff" * size, b"\x7f" * size, b"\x10" * size])
        else:
            t.dims = [d for d in t.dims if d != 1] or [1]


# ---- raw mutations -----------------------------------------------------------------------------

def mutate_bytes(raw: bytes, header_len: int, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(raw)
    op = rng.randrange(4)
    if op == 0:
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(min(header_len, len(b)))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), "bit flips"
    if op == 1:
        i = rng.randrange(0, max(1, min(header_len, len(b)) - 8))
        width = rng.choice((4, 8))
        value = rng.choice([0, 2**31, 2**63 % 2**(8 * width), 2**(8 * width) - 1, 1, 2**32 % 2**(8 * width)])
        b[i:i + width] = value.to_bytes(width, "little")
        return bytes(b), f"field at {i} = {value}"
    if op == 2:
        cut = rng.randrange(len(b))
        return bytes(b[:cut]), f"truncated at {cut}"
    return bytes(b[: len(b) - rng.randrange(1, 64)]) + b"\0" * rng.randrange(0, 128), "tail changed"


def mutate(doc: Doc, rng: random.Random) -> tuple[bytes, str]:
    """One mutated file's bytes and a description of what changed."""
    d = copy.deepcopy(doc)
    kind = rng.random()
    if kind < 0.15:
        base = d.to_bytes()
        header_len = len(base) - len(d.data)
        return mutate_bytes(base, header_len, rng)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        (mutate_kv if rng.random() < 0.6 else mutate_tensor)(d, rng)
    return d.to_bytes(), "; ".join(d.note)
