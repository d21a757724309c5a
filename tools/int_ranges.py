"""Which 32-bit integer operations of a compiled Triton kernel leave the int32 range at given launches.

    overflows(ttir, launches) -> ["file:line: arith.muli i32 in [lo, hi]", ...]

Triton computes index arithmetic in the type of its operands: a program id, `tl.arange` and an
integer argument below 2^31 are int32, so `row * stride` wraps silently once the product passes
2^31 - 1, and the address it feeds lands elsewhere (a bf16 embedding of 248k × 5120 values, an
expert stack of 4 GB, a prompt of a whole context times a feed-forward's width). This walks a
kernel's TTIR once per launch with an interval per integer SSA value: the launch's integer
arguments (points), program ids and counts from its grid, `tl.arange` ranges, constants, and the
integer operations (add, sub, mul, div, rem, min, max, select, shifts, extensions, splat /
broadcast / reshape); a loop's induction variable spans its bounds. Values the walk cannot bound
(loaded values, loop-carried ones) are left out, so a report is a real overflow at that launch,
and what it cannot see it does not claim. Every addi / subi / muli / shli with an int32 result is
checked: its exact interval must lie within int32.
"""

from __future__ import annotations

import re

INT32 = (-(1 << 31), (1 << 31) - 1)
_LINE = re.compile(r'^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*"?([\w.]+)"?(.*)$')
_VALUE = re.compile(r"%[\w.$-]+")
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)$")
_ARG = re.compile(r"%(\w+): (i32|i64|i1)\b")
_FOR = re.compile(r"^\s*(?:%[\w.$-]+(?::\d+)?\s*=\s*)?scf\.for (%[\w.$-]+) = (%[\w.$-]+) to (%[\w.$-]+) step")
_CHECKED = {"arith.addi", "arith.subi", "arith.muli", "arith.shli"}
_SAME = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans", "arith.extsi", "arith.index_cast",
         "ttg.convert_layout"}


def _int_type(text: str) -> str:
    """'i32' / 'i64' for a scalar or tensor integer type at the end of an operation's text, else ''."""
    m = re.search(r"(?:x|\s|^|<)(i32|i64)>?\s*$", text.strip())
    return m.group(1) if m else ""


def _result_type(rest: str) -> str:
    rest = re.sub(r"\s*loc\(.*$", "", rest)
    if "->" in rest:
        return rest.rsplit("->", 1)[1].strip()
    if " to " in rest.rsplit(" : ", 1)[-1]:
        return rest.rsplit(" to ", 1)[1].strip()
    return rest.rsplit(" : ", 1)[1].strip() if " : " in rest else ""


def _locations(ttir: str) -> dict[str, str]:
    """#locN -> "file:line" (name and call-site locations resolved to the innermost file position)."""
    raw = {}
    for line in ttir.splitlines():
        m = _LOC_DEF.match(line.strip())
        if m:
            raw[m.group(1)] = m.group(2)

    def resolve(ref: str, depth: int = 0) -> str:
        text = raw.get(ref, "")
        m = re.match(r'^"([^"]+)":(\d+):\d+$', text)
        if m:
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
        inner = re.findall(r"#loc\d*", text)
        return resolve(inner[0], depth + 1) if inner and depth < 50 else "?"
    return {ref: resolve(ref) for ref in raw}


def _div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _evaluate(name: str, operands: list, rest: str, grid: tuple):
    """The interval of one operation's integer result, or None where it cannot be bounded."""
    if name == "arith.constant":
        m = re.match(r"\s*(?:dense<)?(-?\d+)>?\s*:", rest)
        return (int(m.group(1)),) * 2 if m else None
    if name in ("tt.get_program_id", "tt.get_num_programs"):
        axis = "xyz".index(rest.split()[0])
        return (0, grid[axis] - 1) if name == "tt.get_program_id" else (grid[axis],) * 2
    if name == "tt.make_range":
        start, end = (int(re.search(rf"{k} = (-?\d+)", rest).group(1)) for k in ("start", "end"))
        return start, end - 1
    if any(o is None for o in operands) or not operands:
        return None
    if name in _SAME or name == "arith.trunci":
        return operands[0]
    a = operands[0]
    if name == "arith.select":
        if len(operands) < 3 or operands[1] is None or operands[2] is None:
            return None
        return min(operands[1][0], operands[2][0]), max(operands[1][1], operands[2][1])
    b = operands[1] if len(operands) > 1 else None
    if b is None:
        return None
    if name == "arith.addi":
        return a[0] + b[0], a[1] + b[1]
    if name == "arith.subi":
        return a[0] - b[1], a[1] - b[0]
    if name == "arith.muli":
        corners = [x * y for x in a for y in b]
        return min(corners), max(corners)
    if name == "arith.divsi" and (b[0] > 0 or b[1] < 0):
        corners = [_div(x, y) for x in a for y in b]
        return min(corners), max(corners)
    if name == "arith.remsi" and b[0] > 0:
        return (0, min(a[1], b[1] - 1)) if a[0] >= 0 else (-(b[1] - 1), b[1] - 1)
    if name == "arith.minsi":
        return min(a[0], b[0]), min(a[1], b[1])
    if name == "arith.maxsi":
        return max(a[0], b[0]), max(a[1], b[1])
    if name == "arith.shli" and b[0] == b[1] and 0 <= b[0] < 64:
        return a[0] << b[0], a[1] << b[0]
    if name == "arith.shrsi" and b[0] == b[1] and 0 <= b[0] < 64:
        return a[0] >> b[0], a[1] >> b[0]
    if name == "arith.andi" and (a[0] >= 0 or b[0] >= 0):
        return 0, min(x[1] for x in (a, b) if x[0] >= 0)
    return None


def overflows(ttir: str, launches) -> list[str]:
    """One line per int32 add / sub / mul / shift of `ttir` whose result leaves the int32 range at
    any of `launches`: (integer arguments as (name, value) pairs, grid (x, y, z)); each location once,
    with its widest interval."""
    locations = _locations(ttir)
    lines = ttir.splitlines()
    header = next((line for line in lines if "tt.func" in line), "")
    args = {m.group(1): m.group(2) for m in _ARG.finditer(header)}
    found: dict[str, tuple[str, int, int]] = {}
    for ints, grid in launches:
        known = {f"%{k}": (v, v) for k, v in ints if k in args}
        for line in lines:
            loop = _FOR.match(line)
            if loop:
                iv, lb, ub = loop.groups()
                if known.get(lb) and known.get(ub):
                    known[iv] = (known[lb][0], max(known[lb][0], known[ub][1] - 1))
                continue
            m = _LINE.match(line)
            if not m:
                continue
            value, name, rest = m.groups()
            kind = _int_type(_result_type(rest))
            if not kind:
                continue
            body = re.sub(r"\s*loc\(.*$", "", rest)
            operands = [known.get(v) for v in _VALUE.findall(body.split(" : ")[0])]
            interval = _evaluate(name, operands, body, grid)
            if interval is None:
                continue
            known[value] = interval
            if kind == "i32" and name in _CHECKED and (interval[0] < INT32[0] or interval[1] > INT32[1]):
                ref = _LOC_REF.search(line)
                where = locations.get(ref.group(1), "?") if ref else "?"
                key = f"{where}: {name}"
                widest = found.get(key)
                if widest is None or interval[1] - interval[0] > widest[2] - widest[1]:
                    found[key] = (key, interval[0], interval[1])
    return [f"{key} i32 in [{lo}, {hi}]" for key, lo, hi in found.values()]
