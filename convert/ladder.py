"""Several output types from one conversion run: `--outtype q8_0,q6_k,q4_k_m` (a publisher's ladder).

Each type is planned as its own conversion (its files named from `-o` with the type inserted:
`DIR/NAME.gguf` -> `DIR/NAME-Q8_0.gguf`, `DIR/NAME-Q4_K_M.gguf`, ...; a folder or a `{ftype}`
template names them as single runs do). The checkpoint's headers are read once, and the run
streams each tensor once: its chunks are read and encoded once per distinct type (a tensor stored
F32 in every file is encoded once and written to all of them), by the same workers, into every file
that holds it, all files atomic together (an error or Ctrl-C leaves none). A conversion writes the
tensors of all its files in one order, so when the ladder has a K-quant every file takes llama.cpp's
quantize order (the K-quant files are then the single runs' bytes; a q8_0/bf16 file of the ladder
has the single run's tensors and KV, in that order instead).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specconv.archs.errors import SpecconvError

from .naming import is_directory_target
from .quant_rules import KQUANT_FILE_TYPES


def is_ladder(outtype: str) -> bool:
    return "," in outtype


def _names_per_type(out: str) -> str:
    """`-o` for one type of the ladder: folders and {ftype} templates already differ per type."""
    if is_directory_target(out) or re.search(r"\{ftype\}|\{FTYPE\}", out):
        return out
    path = Path(out)
    if path.suffix != ".gguf":
        raise SpecconvError(f"-o {out}: give a file name ending in .gguf, or a folder ending in /")
    return str(path.with_name(f"{path.stem}-{{FTYPE}}.gguf"))


@dataclass
class _Label:
    name: str


@dataclass
class LadderPlan:
    """The plans of every type; reads like one ConversionPlan for the reports (files of all types)."""
    plans: list

    def __getattr__(self, item):  # src, arch, hf_architecture, mode, n_trunk, n_mtp, skipped, notices...
        return getattr(self.plans[0], item)

    @property
    def outtype(self) -> _Label:
        return _Label(",".join(p.outtype.name for p in self.plans))

    @property
    def files(self) -> list:
        return [f for p in self.plans for f in p.files]

    def close(self) -> None:
        self.plans[0].reader.close()


def plan_ladder(req, reader, plan_one: Callable) -> LadderPlan:
    types = [t.strip().lower() for t in req.outtype.split(",")]
    if any(not t for t in types) or len(set(types)) != len(types):
        raise SpecconvError(f"--outtype {req.outtype}: give distinct types separated by commas")
    tool_order = any(t in KQUANT_FILE_TYPES for t in types)
    out = _names_per_type(req.out)
    plans = [plan_one(dataclasses.replace(req, outtype=t, out=out), reader, tool_order) for t in types]
    return LadderPlan(plans)


def ladder_calls(lp: LadderPlan) -> list[tuple[object, list]]:
    """(planned tensor, outputs) in write order: per tensor, one entry per distinct type."""
    plans = lp.plans
    by_plan = [{t.name: t for t in p.tensors} for p in plans]
    members = [[{t.name for t in f.tensors} for f in p.files] for p in plans]
    calls = []
    for t0 in plans[0].tensors:
        groups: dict = {}
        for p, m, tensors in zip(plans, members, by_plan):
            t = tensors[t0.name]
            outs = [f.output for f, names in zip(p.files, m) if t0.name in names]
            if outs:
                key = (t.ggml_type, t.weights is not None)  # --imatrix weighs K-quant files only
                groups.setdefault(key, (t, []))[1].extend(outs)
        calls.extend(groups.values())
    orders = {tuple(t.name for t in p.tensors) for p in plans}
    if len(orders) != 1:
        raise SpecconvError("internal: the ladder's plans list their tensors in different orders")
    return calls
