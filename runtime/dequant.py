"""Dequantize GGUF tensor rows in torch, bit-identical to `gguf.quants.dequantize` in float32.

A quantized row is a run of fixed-size blocks; each block holds `block` values. All multi-byte
fields are little-endian; "f16" is an IEEE half scale. The value formulas below are also the
order of the float32 operations (the same as gguf.quants, so the results are bit-identical).

  Q8_0   34 B / 32: f16 d, 32 int8 q                               x = d * q
  Q4_0   18 B / 32: f16 d, 16 B of nibbles                          x = d * (q - 8)
  Q4_1   20 B / 32: f16 d, f16 m, 16 B of nibbles                   x = d * q + m
  Q5_0   22 B / 32: f16 d, 4 B high bits, 16 B of nibbles           x = d * (q - 16)
  Q5_1   24 B / 32: f16 d, f16 m, 4 B high bits, 16 B of nibbles    x = d * q + m
  Q2_K   84 B / 256: 16 B of (4-bit scale, 4-bit min), 64 B of 2-bit q, f16 d, f16 dmin
                                                  x = (d * scale) * q - (dmin * min)
  Q3_K  110 B / 256: 32 B high bits, 64 B of 2-bit q, 12 B of 6-bit scales, f16 d
                                                  x = (d * (scale - 32)) * q, q in [-4, 3]
  Q4_K  144 B / 256: f16 d, f16 dmin, 12 B of 6-bit scales and mins, 128 B of nibbles
  Q5_K  176 B / 256: as Q4_K plus 32 B of high bits before the nibbles
                                                  x = (d * scale) * q - (dmin * min)
  Q6_K  210 B / 256: 128 B low nibbles, 64 B 2-bit high parts, 16 int8 scales, f16 d
                                                  x = (d * scale) * (q - 32)
  IQ4_NL 18 B / 32: f16 d, 16 B of nibbles indexing a 16-entry table      x = d * table[q]
  IQ4_XS 136 B / 256: f16 d, 2 B high and 4 B low bits of 8 6-bit scales, 128 B of nibbles
                                                  x = (d * (scale - 32)) * table[q]
  TQ1_0  54 B / 256: 48 B + 4 B of base-3 packed trits, f16 d        x = d * (t - 1)
  TQ2_0  66 B / 256: 64 B of 2-bit q, f16 d                          x = d * (q - 1)
  MXFP4  17 B / 32: e8m0 exponent e (scale 2^(e-128)), 16 B of nibbles (doubled e2m1 table)
  NVFP4  36 B / 64: 4 unsigned e4m3 sub-block scales (halved), 32 B of nibbles (as MXFP4)

Nibbles: in a run of n bytes, value i is the low nibble of byte i and value n + i the high
nibble. Packed 2-bit and 1-bit fields follow the same rule: field j of byte i is value j*n + i.
K-quant values come in sub-blocks of 16 or 32 that share one scale.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from specconv.archs.errors import SpecconvError
from specconv.runtime.rows_first import RowsFirstType, file_type, to_ggml_layout


# --- small helpers -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant table on `device`, copied once per device."""
    return table.to(device)


def _on_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _unpack(packed: torch.Tensor, bits: int, byte_major: bool = False) -> torch.Tensor:
    """The `bits`-wide fields of each byte, lowest first, as uint8 in a new dimension.

    [..., n] -> [..., 8 // bits, n] (field j of byte i at [j, i]), or [..., n, 8 // bits] when
    `byte_major` (the bit order of a little-endian word)."""
    # CPU: one copy first, so the ops below run over whole rows, not short runs between headers
    dense = packed.contiguous() if _on_cpu(packed) else packed
    dim = -1 if byte_major else -2
    if bits == 1:  # one broadcast shift instead of eight
        shifts = _on_device(_BIT_SHIFTS, packed.device)
        fields = dense.unsqueeze(dim) >> (shifts if byte_major else shifts.unsqueeze(-1))
    else:  # a shift by a constant is much faster on CPU than a broadcast one
        fields = torch.stack([dense >> s if s else dense for s in range(0, 8, bits)], dim)
    return fields.bitwise_and_((1 << bits) - 1)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of every block, widened exactly to float32: [..., nb, 1]."""
    field = blocks[..., offset:offset + 2]
    try:
        half = field.view(torch.float16)
    except RuntimeError:  # odd byte address: build the 16-bit pattern from its two bytes
        bits = field[..., 0].to(torch.int16) | (field[..., 1].to(torch.int16) << 8)
        half = bits.view(torch.float16).unsqueeze(-1)
    return half.to(torch.float32)


def _times(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes * scale in float32 (codes are small integers, converted exactly; one rounding)."""
    if _on_cpu(codes):
        # CPU promotion would first copy codes to a float32 temporary; converting once and
        # scaling in place writes one large buffer instead of two
        return codes.to(torch.float32).mul_(scale)
    return codes * scale


def _pair_table(values: list[int]) -> torch.Tensor:
    """byte -> int16 holding (values[low nibble], values[high nibble]) as two int8, little-endian."""
    return torch.tensor([(values[b & 15] & 0xFF) | (values[b >> 4] << 8) for b in range(256)],
                        dtype=torch.int16)


def _lookup_nibbles(packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """table[nibble] for [..., n] bytes -> float32 [..., 2, n] (low nibbles' values, then high).

    One lookup per byte yields both values (interleaved); the float32 conversion writes them
    in block order."""
    found = torch.index_select(_on_device(pairs, packed.device), 0, packed.int().reshape(-1))
    interleaved = found.view(torch.int8).view(*packed.shape, 2)
    return interleaved.transpose(-1, -2).to(torch.float32, memory_format=torch.contiguous_format)


def _byte_table(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """table[code] for every byte code (small per-block fields)."""
    return _on_device(table, codes.device)[codes.long()]


# --- lookup tables -------------------------------------------------------------------------------

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_IQ4_PAIRS = _pair_table([int(v) for v in gguf_quants.IQ4_NL.kvalues])
_FP4_PAIRS = _pair_table([int(v) for v in gguf_quants.MXFP4.kvalues])


def _e8m0_half_table() -> torch.Tensor:
    """e -> 2^(e - 128) as float32 bit patterns (subnormal for e < 2)."""
    bits = [(0x00200000 << e) if e < 2 else (e - 1) << 23 for e in range(256)]
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def _ue4m3_half_table() -> torch.Tensor:
    """byte -> half its unsigned e4m3 value (bias 7; 0x00 and 0x7F read as 0), as NVFP4 uses it."""
    def value(b: int) -> float:
        exp, man = (b >> 3) & 0xF, b & 7
        if b in (0, 0x7F):
            return 0.0
        return 0.5 * (man * 2.0 ** -9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor([value(b) for b in range(256)], dtype=torch.float32)  # all exact


_E8M0_HALF = _e8m0_half_table()
# byte -> eight bytes (an int64, little-endian), byte k = 16 if bit k is set: Q5 fifth bits in place
_FIFTH_BITS = torch.tensor([sum(((b >> k) & 1) << (8 * k + 4) for k in range(8)) for b in range(256)],
                           dtype=torch.int64)
_UE4M3_HALF = _ue4m3_half_table()


# --- one decoder per type: uint8 blocks [..., nb, type_size] -> float32 [..., nb, ...] ----------

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _times(b[..., 2:].view(torch.int8), _f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[..., 2:], 4).flatten(-2).view(torch.int8).sub_(8)
    return _times(q, _f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _times(_unpack(b[..., 4:], 4).flatten(-2), _f16(b, 0)).add_(_f16(b, 2))


def _five_bit(b: torch.Tensor, high_at: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes 0..31: 4 bytes of fifth bits (bit i of that word is value i's), nibbles."""
    high = _byte_table(_FIFTH_BITS, b[..., high_at:high_at + 4]).view(torch.uint8)  # [..., nb, 32]
    return _unpack(b[..., high_at + 4:], 4).flatten(-2).bitwise_or_(high)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _times(_five_bit(b, 2).view(torch.int8).sub_(16), _f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _times(_five_bit(b, 4), _f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[..., :16]
    step = (_f16(b, 80) * (scales & 0xF)).unsqueeze(-1)  # [..., nb, 16, 1]
    offset = (_f16(b, 82) * (scales >> 4)).unsqueeze(-1)
    q = _unpack(b[..., 16:80].unflatten(-1, (2, 32)), 2).flatten(-3).unflatten(-1, (16, 16))
    return _times(q, step).sub_(offset)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    packed = b[..., 96:108]  # low 4 bits of the 16 scales in bytes 0-7, high 2 bits in 8-11
    low, high = _unpack(packed[..., :8], 4).flatten(-2), _unpack(packed[..., 8:], 2).flatten(-2)
    step = (_f16(b, 108) * ((low | (high << 4)).view(torch.int8) - 32)).unsqueeze(-1)
    high = _unpack(b[..., :32], 1).flatten(-2).bitwise_left_shift_(2)
    q = _unpack(b[..., 32:96].unflatten(-1, (2, 32)), 2).flatten(-3).bitwise_or_(high)
    return _times(q.view(torch.int8).sub_(4).unflatten(-1, (16, 16)), step)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (uint8 [..., nb, 8] each).

    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
    a nibble of bytes 8-11 for the low bits and the top 2 bits of bytes 0-3 / 4-7 for the high."""
    first, second, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((first & 63, (extra & 15) | ((first >> 2) & 48)), -1)
    mins = torch.cat((second & 63, (extra >> 4) | ((second >> 2) & 48)), -1)
    return scales, mins


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: (d * scale) * q - (dmin * min) per 32-value sub-block; q is [..., nb, 8, 32]."""
    scales, mins = _k_scales_mins(b[..., 4:16])
    step = (_f16(b, 0) * scales).unsqueeze(-1)
    offset = (_f16(b, 2) * mins).unsqueeze(-1)
    return _times(q, step).sub_(offset)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _unpack(b[..., 16:].unflatten(-1, (4, 32)), 4).flatten(-3, -2))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _unpack(b[..., 48:].unflatten(-1, (4, 32)), 4).flatten(-3, -2)
    return _k_quant(b, low.bitwise_or_(_unpack(b[..., 16:48], 1).bitwise_left_shift_(4)))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    step = (_f16(b, 208) * b[..., 192:208].view(torch.int8)).unsqueeze(-1)  # [..., nb, 16, 1]
    low = _unpack(b[..., :128].unflatten(-1, (2, 64)), 4).flatten(-3)
    high = _unpack(b[..., 128:192].unflatten(-1, (2, 32)), 2).flatten(-3)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    return _times(q.unflatten(-1, (16, 16)), step)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _lookup_nibbles(b[..., 2:], _IQ4_PAIRS).flatten(-2).mul_(_f16(b, 0))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    low = _unpack(b[..., 4:8], 4, byte_major=True).flatten(-2)  # scale j: nibble j % 2 of byte j // 2
    high = _unpack(b[..., 2:4], 2, byte_major=True).flatten(-2)  # bits 2j..2j+1 of a 16-bit word
    step = (_f16(b, 0) * ((low | (high << 4)).view(torch.int8) - 32)).unsqueeze(-1)
    values = _lookup_nibbles(b[..., 8:].unflatten(-1, (8, 16)), _IQ4_PAIRS).flatten(-2)
    return values.mul_(step)


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    # byte * 3^k (mod 256) brings trit k to the top; (x * 3) >> 8 reads it as 0, 1 or 2
    def spread(packed: torch.Tensor, n_trits: int) -> torch.Tensor:
        return torch.stack([packed * 3 ** k if k else packed for k in range(n_trits)], -2).flatten(-2)
    x = torch.cat((spread(b[..., :32], 5), spread(b[..., 32:48], 5), spread(b[..., 48:52], 4)), -1)
    trits = x.to(torch.int16).mul_(3).bitwise_right_shift_(8).sub_(1)
    return _times(trits, _f16(b, 52))


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[..., :64].unflatten(-1, (2, 32)), 2).flatten(-3).view(torch.int8).sub_(1)
    return _times(q, _f16(b, 64))


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    return _lookup_nibbles(b[..., 1:], _FP4_PAIRS).flatten(-2).mul_(_byte_table(_E8M0_HALF, b[..., :1]))


def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    scales = _byte_table(_UE4M3_HALF, b[..., :4]).unsqueeze(-1)  # [..., nb, 4, 1]
    values = _lookup_nibbles(b[..., 4:].unflatten(-1, (4, 8)), _FP4_PAIRS).flatten(-2)
    return values.mul_(scales)


_DECODERS = {
    QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k, QType.Q3_K: _q3_k, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl, QType.IQ4_XS: _iq4_xs, QType.TQ1_0: _tq1_0, QType.TQ2_0: _tq2_0,
    QType.MXFP4: _mxfp4, QType.NVFP4: _nvfp4,
}
_FLOATS = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}

SUPPORTED: frozenset[QType] = frozenset(_DECODERS) | frozenset(_FLOATS)


# --- public API ----------------------------------------------------------------------------------

def row_bytes(qtype: QType, n_elems: int) -> int:
    """Bytes of one row of `n_elems` values stored as `qtype` (any type gguf knows the size of)."""
    block, size = block_geometry(qtype)
    if n_elems < 0 or n_elems % block:
        raise SpecconvError(f"a row of {n_elems} values is not a whole number of {_name(qtype)} "
                            f"blocks ({block} values each)")
    return n_elems // block * size


def block_geometry(qtype) -> tuple[int, int]:
    """(values, bytes) of a block of `qtype` (any type gguf knows the size of; a rows-first type: its
    file type's, runtime/rows_first.py)."""
    qtype = file_type(qtype)
    if qtype not in GGML_QUANT_SIZES:
        raise SpecconvError(f"tensor type {_name(qtype)} has no known block size")
    return GGML_QUANT_SIZES[qtype]


def require_supported(qtype: QType) -> None:
    """A one-line SpecconvError naming `qtype` unless the runtime can dequantize it."""
    if file_type(qtype) not in SUPPORTED:
        raise SpecconvError(f"tensor type {_name(qtype)} is not supported by the runtime "
                            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED))})")


def dequantize_rows(raw: torch.Tensor, qtype: QType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 rows [..., row_bytes] stored as `qtype` -> values [..., n] in `dtype` on raw's device.

    Values are computed in float32 (bit-identical to gguf.quants) and then cast. `raw` is only
    read. For F32/F16/BF16 in their own dtype the result is a view of `raw` (no copy). These are
    the torch decoders, the reference; a backend's `dequantize_rows` (runtime/backend.py) gives the
    same values from native or Triton decoders where it has them. Rows of a rows-first type
    (runtime/rows_first.py) are put back in the file's order first."""
    check_rows(raw, qtype, dtype)
    if isinstance(qtype, RowsFirstType):
        raw, qtype = to_ggml_layout(raw, qtype), qtype.file_type
    if is_view(qtype, dtype):
        return _reinterpret(raw, dtype)
    if qtype in _FLOATS:
        return _reinterpret(raw, _FLOATS[qtype]).to(dtype)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = raw.shape[-1] // size
    values = _DECODERS[qtype](raw.unflatten(-1, (n_blocks, size)))
    return values.reshape(*raw.shape[:-1], n_blocks * block).to(dtype)


def is_view(qtype: QType, dtype: torch.dtype) -> bool:
    """Whether rows of `qtype` read as `dtype` are their own bytes (a 16/32-bit float type in its dtype)."""
    return qtype in _FLOATS and _FLOATS[qtype] == dtype


def check_rows(raw: torch.Tensor, qtype: QType, dtype: torch.dtype) -> None:
    """The one-line SpecconvErrors of a call that cannot be dequantized (type, bytes, dtype)."""
    require_supported(qtype)
    if raw.dtype != torch.uint8 or raw.dim() == 0:
        raise SpecconvError(f"{qtype.name} rows must be a uint8 tensor with a byte dimension "
                            f"(got {raw.dtype}, shape {tuple(raw.shape)})")
    size = block_geometry(qtype)[1]
    if raw.shape[-1] % size:
        raise SpecconvError(f"a {qtype.name} row has a whole number of {size}-byte blocks "
                            f"(got {raw.shape[-1]} bytes)")
    if not dtype.is_floating_point:
        raise SpecconvError(f"cannot dequantize into {dtype} (a floating-point dtype is needed)")


def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes read as `dtype`; a misaligned start is first copied to an aligned buffer."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def _name(qtype) -> str:
    return qtype.name if isinstance(qtype, QType) else str(qtype)  # a raw id the gguf enum does not know
