"""The repository's README.md: Hub front matter, a file table, llama.cpp run commands, verify results.

Front matter follows docs/reference/hub.md §3: `base_model` + `base_model_relation: quantized` lists the
repository under the base model's quantizations; `library_name: gguf` puts it in the GGUF filter.
Run commands use the flags of the pinned llama.cpp (docs/reference/peers.md §1.5): `--spec-type
draft-mtp` for an embedded head, `-md mtp-X.gguf --spec-type draft-mtp` for a sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata

from huggingface_hub import ModelCardData

from specconv.hub.naming import Role, human_size
from specconv.hub.report import VerifyReport

TAGS = ["gguf", "llama.cpp", "mtp", "speculative-decoding", "specconv"]
DRAFT_N_MAX = 3  # llama.cpp's default --spec-draft-n-max


@dataclass
class CardEntry:
    """One model artifact as the card shows it."""

    name: str  # unsplit repository file name, e.g. Model-Q8_0.gguf
    paths: list[str]  # repository paths (one, or every shard in order)
    base: str
    quant: str
    role: Role
    size: int
    draft_max: int | None = None  # a DFlash drafter's block size - 1 (what llama.cpp clamps --spec-draft-n-max to)
    type_bytes: dict[str, int] = field(default_factory=dict)  # tensor bytes per ggml type
    report: VerifyReport | None = None  # the verify report run on this file (specconv/hub/verified.py)
    verified_with: str | None = None  # a sidecar: the model file whose report verified it


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.{digits}f}"
    return str(value)


def _version() -> str:
    try:
        return metadata.version("specconv")
    except metadata.PackageNotFoundError:
        return "unknown"


def front_matter(*, base_model: str | None, license: str | None, quantized_by: str) -> str:
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized" if base_model else None,
        library_name="gguf",
        pipeline_tag="text-generation",
        license=license,
        tags=list(TAGS),
        quantized_by=quantized_by,
    )
    return "---\n" + data.to_yaml() + "\n---\n"


def _pair_target(draft: CardEntry, entries: list[CardEntry]) -> CardEntry | None:
    """The model a draft belongs with: same base and quant, else same base, else any model."""
    models = [e for e in entries if not e.role.is_draft]
    for rule in (
        lambda m: m.base == draft.base and m.quant == draft.quant and m.role is Role.TRUNK,
        lambda m: m.base == draft.base and m.role is Role.TRUNK,
        lambda m: m.base == draft.base,
        lambda m: True,
    ):
        found = [m for m in models if rule(m)]
        if found:
            return found[0]
    return None


def _download(repo_id: str, entries: list[CardEntry]) -> str:
    """`hf download` for the given artifacts: file names, or `FOLDER/` for split shards in a folder."""
    names: list[str] = []
    for e in entries:
        folder = e.paths[0].rsplit("/", 1)[0] if "/" in e.paths[0] else None
        names.extend([folder + "/"] if folder and len(e.paths) > 1 else e.paths)
    return " ".join(["hf download", repo_id, *names, "--local-dir ."])


def usage_section(repo_id: str, entries: list[CardEntry]) -> str:
    lines = ["## How to run with llama.cpp", ""]
    spec = f"--spec-type draft-mtp --spec-draft-n-max {DRAFT_N_MAX}"
    shown = False
    sidecars = [e for e in entries if e.role is Role.SIDECAR]
    hf_lines = []
    for e in entries:
        paired = any(_pair_target(s, entries) is e and s.quant == e.quant for s in sidecars)
        if e.role is Role.EMBEDDED or (e.role is Role.TRUNK and paired):
            hf_lines.append(f"llama-server -hf {repo_id}:{e.quant} {spec}")
    if hf_lines:
        lines += [
            "Straight from the Hub (with `--spec-type draft-mtp`, llama.cpp also fetches the `mtp-` "
            "sidecar of the same quant):",
            "",
            "```sh",
            *dict.fromkeys(hf_lines),
            "```",
            "",
            "Or with downloaded files:",
            "",
        ]
    for e in entries:
        if e.role is Role.EMBEDDED:
            lines += [
                f"**{e.name}** carries its MTP head; llama.cpp drafts with it when asked:",
                "",
                "```sh",
                _download(repo_id, [e]),
                f"llama-server -m {e.paths[0]} {spec}",
                "```",
                "",
            ]
            shown = True
    for e in entries:
        if not e.role.is_draft or e.role.is_head:  # heads: draft_heads_section
            continue
        target = _pair_target(e, entries)
        model_path = target.paths[0] if target else "YOUR-MODEL.gguf"
        kind = "--spec-type draft-eagle3" if e.role is Role.EAGLE3 else spec
        if e.role is Role.EAGLE3:
            kind += f" --spec-draft-n-max {DRAFT_N_MAX}"
        lines += [
            f"**{e.name}** is the {e.role.value} for {target.name if target else 'the base model'}; "
            "pass it with `-md`:",
            "",
            "```sh",
            _download(repo_id, [t for t in (target, e) if t is not None]),
            f"llama-server -m {model_path} -md {e.paths[0]} {kind}",
            "```",
            "",
        ]
        shown = True
    trunks = [e for e in entries if e.role is Role.TRUNK]
    if trunks:
        lines += [
            "Without speculative decoding (any loader, including ones that predate MTP):",
            "",
            "```sh",
            f"llama-server -m {trunks[0].paths[0]}",
            "```",
            "",
        ]
        shown = True
    if any(len(e.paths) > 1 for e in entries):
        lines += ["Split files: pass the first shard (`-00001-of-`); llama.cpp finds the others.", ""]
    if any(e.role is Role.EMBEDDED for e in entries):
        lines += [
            "Loaders that predate MTP may refuse a file with an embedded head; use a trunk-only file "
            "with its `mtp-` sidecar there.",
            "",
        ]
    return "\n".join(lines) if shown else ""


# llama.cpp's --spec-type and specconv's --spec for each separately trained head (docs/upload.md)
HEAD_KINDS = {Role.EAGLE3: ("draft-eagle3", "eagle3", "an EAGLE-3 head: one decoder layer fed three of the "
                                                      "target's hidden states"),
              Role.DFLASH: ("draft-dflash", "dflash", "a DFlash drafter: drafts a whole block of tokens per "
                                                      "forward from several of the target's hidden states")}


def draft_heads_section(repo_id: str, entries: list[CardEntry]) -> str:
    """How to run each EAGLE-3 / DFlash head: llama.cpp fetching it next to the model (`-hf` with its
    `--spec-type`: common/download.cpp looks for an `eagle3-` / `dflash-` .gguf in the model's folder or
    above), llama.cpp with downloaded files (`-md`), and specconv's `generate` / `verify`."""
    heads = [e for e in entries if e.role.is_head]
    if not heads:
        return ""
    lines = ["## Draft heads", ""]
    for e in heads:
        spec_type, spec, what = HEAD_KINDS[e.role]
        n_max = e.draft_max if e.draft_max is not None else DRAFT_N_MAX
        target = _pair_target(e, entries)
        model = target.paths[0] if target else "YOUR-MODEL.gguf"
        head = e.paths[0]
        lines += [f"**{e.name}** is {what}, trained for "
                  f"{f'`{target.name}`' if target else 'the base model (no model file in this repository)'}.", ""]
        if target and len(e.paths) == 1:
            lines += [f"llama.cpp fetches it next to the model when asked for `--spec-type {spec_type}`:", "",
                      "```sh", f"llama-server -hf {repo_id}:{target.quant} --spec-type {spec_type} "
                      f"--spec-draft-n-max {n_max}", "```", ""]
        elif len(e.paths) > 1:
            lines += ["It is split: pass its first shard with `-md` (llama.cpp's `-hf` discovery takes one file).", ""]
        lines += ["With downloaded files:", "", "```sh", _download(repo_id, [t for t in (target, e) if t is not None]),
                  f"llama-server -m {model} -md {head} --spec-type {spec_type} --spec-draft-n-max {n_max}", "```", "",
                  "With specconv (`verify` checks that speculative output equals plain greedy "
                  "decoding and measures acceptance):", "", "```sh",
                  f'specconv generate {model} --spec {spec} --draft {head} --draft-max {n_max} -p "Hello"',
                  f"specconv verify {model} --draft {head} --draft-max {n_max}", "```", ""]
    return "\n".join(lines)


def type_mix(type_bytes: dict[str, int]) -> str:
    """`Q4_K 71%, Q6_K 22%, F32 7%`: the share of tensor bytes per storage type, largest first."""
    total = sum(type_bytes.values())
    if not total:
        return ""
    parts = []
    for name, n in sorted(type_bytes.items(), key=lambda kv: (-kv[1], kv[0])):
        share = 100 * n / total
        parts.append(f"{name} {'<1' if share < 1 else f'{share:.0f}'}%")
    return ", ".join(parts)


NOT_VERIFIED = "not verified"


def verify_cells(e: CardEntry) -> list[str]:
    """Max |Δlogit|, acceptance, speed-up and result of the file's own report; nothing invented: a file
    without a report says so, a figure its report lacks is "not measured"."""
    if e.report is None:
        if e.verified_with:
            return ["", "", "", f"with `{_cell(e.verified_with)}`"]
        return ["", "", "", NOT_VERIFIED]
    r, spec = e.report, e.report.speculative
    parity = r.parity.get("max_abs_logit_diff")
    parity = _fmt(parity) if parity is not None else "not measured"
    if spec.get("acceptance_rate") is not None:
        accept = _fmt(spec["acceptance_rate"])
        if spec.get("acceptance_length") is not None:
            accept += f" (length {_fmt(spec['acceptance_length'], 2)})"
    else:
        accept = "not measured"
    speed = f"{_fmt(spec['speedup'], 2)}× measured" if spec.get("speedup") is not None else "not measured"
    predicted = ((spec.get("costs") or {}).get("llama.cpp") or {}).get("best")
    if predicted is not None:
        speed += f", {_fmt(predicted, 2)}× predicted for llama.cpp"
    result = {True: "passed", False: "FAILED", None: "no result"}[r.passed]
    return [parity, accept, speed, result]


def file_table(entries: list[CardEntry]) -> str:
    lines = ["## Files", "", "| File | Quant type | Size | Split | Role | Tensor types | Max \\|Δlogit\\| | "
             "Acceptance | Speed-up | Verify |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        split = f"{len(e.paths)} parts, first `{e.paths[0]}`" if len(e.paths) > 1 else "no"
        cells = [f"`{_cell(e.name)}`", _cell(e.quant), human_size(e.size), _cell(split), _cell(e.role.value),
                 _cell(type_mix(e.type_bytes)), *(_cell(c) for c in verify_cells(e))]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if any(e.report is not None for e in entries):
        notes.append("Max |Δlogit|, acceptance and speed-up are `specconv verify`'s figures on that very file (its "
                     "report records the file's size and sha256; the details follow below). Acceptance is the "
                     "rate of accepted draft tokens, with the tokens accepted per round.")
    if any(e.report is None and not e.role.is_draft for e in entries):
        notes.append(f"\"{NOT_VERIFIED}\": no verify report was published for that file.")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def verify_section(report: VerifyReport, title: str = "## Verification (`specconv verify`)") -> str:
    lines = [title, ""]
    if report.passed is not None:
        lines += [f"Overall: **{'passed' if report.passed else 'FAILED'}**", ""]
    parity = report.parity
    if parity.get("max_abs_logit_diff") is not None:
        ref = parity.get("reference") or "the reference"
        lines += [f"Parity: max |Δlogit| = {_fmt(parity['max_abs_logit_diff'])} against {ref}.", ""]
    spec = report.speculative
    if spec.get("synthetic"):  # a measurement drafter: its acceptance was set, no head earned it
        lines += ["The speculative figures below come from the synthetic drafter (set acceptance): they measure "
                  "the runtime, not a draft head.", ""]
    rows = [
        ("Output identical to plain greedy decoding", spec.get("exact")),
        ("Draft tokens", spec.get("drafted")),
        ("Accepted draft tokens", spec.get("accepted")),
        ("Acceptance rate", spec.get("acceptance_rate")),
        ("Acceptance length (tokens per round)", spec.get("acceptance_length")),
        ("Tokens per target forward", spec.get("tokens_per_target_forward")),
        ("Bound", spec.get("bound")),
        ("Speed-up", spec.get("speedup")),
        ("Rollback", spec.get("rollback")),
    ]
    rows = [(k, v) for k, v in rows if v is not None]
    if rows:
        lines += ["### Speculative decoding", "", "| Measure | Value |", "|---|---|"]
        for key, value in rows:
            shown = ("yes" if value else "no") if isinstance(value, bool) else _fmt(value)
            if key == "Speed-up" and not isinstance(value, bool):
                shown += "×"
            lines.append(f"| {key} | {_cell(shown)} |")
        lines.append("")
    lines += cost_section(spec.get("costs"))
    if report.per_position:
        lines += ["### Acceptance by draft position", "", "| Position | Acceptance | Accepted / drafted |", "|---|---|---|"]
        for p in report.per_position:
            counts = f"{p.accepted} / {p.drafted}" if p.drafted is not None else "n/a"
            lines.append(f"| {p.position} | {_fmt(p.rate)} | {counts} |")
        lines.append("")
    if report.checks:
        lines += ["### Checks", "", "| Check | Result | Detail |", "|---|---|---|"]
        for c in report.checks:
            lines.append(f"| {_cell(c['name'])} | {'pass' if c['passed'] else 'FAIL'} | {_cell(c['detail'])} |")
        lines.append("")
    return "\n".join(lines)


def cost_section(costs: dict | None) -> list[str]:
    """What speed-up the measured costs predict, for specconv's runtime and for llama.cpp on the same file:
    the target's t(k+1)/t(1), the drafter's cost c per step and per round (in target forwards of one
    token), and E(α, k) / (t(k+1)/t(1) + k·c + c_round) at the measured α (specconv/verify/costs.py)."""
    runners = [(name, (costs or {}).get(name)) for name in ("specconv", "llama.cpp")]
    runners = [(n, c) for n, c in runners if c]
    if not runners:
        return []
    alpha = costs.get("alpha")
    lines = ["### Cost ratios and the speed-up they predict", "",
             "Measured on the publisher's machine when `specconv verify` ran; the predicted speed-up is "
             f"E(α, k) / (t(k+1)/t(1) + k·c + c_round) at the measured per-token acceptance α = {_fmt(alpha)}, "
             "so it tells what this head gains where a forward costs what it cost there.", "",
             "| Runner | Threads | t(k+1)/t(1), k = 1, 2, ... | Drafter step c | Drafter per round | "
             "Predicted speed-up (best k) |", "|---|---|---|---|---|---|"]
    for name, c in runners:
        if c.get("error"):
            lines.append(f"| {_cell(name)} | | not measured: {_cell(c['error'])} | | | |")
            continue
        ratios = ", ".join(_fmt(r, 2) for r in c["target_ratios"][1:])
        best = f"{_fmt(c['best'], 2)}× (k = {c['best_k']})" if c.get("best") is not None else "n/a (drafter cost unknown)"
        if c.get("best") is not None and c["best"] < 1:
            best += ": slower than plain decoding"
        lines.append(f"| {_cell(name)} | {_fmt(c.get('threads'))} | {_cell(ratios)} | {_fmt(c.get('c'))} | "
                     f"{_fmt(c.get('c_round'))} | {_cell(best)} |")
    lines.append("")
    return lines


def render_card(
    *,
    repo_id: str,
    entries: list[CardEntry],
    base_model: str | None,
    license: str | None,
    quantized_by: str,
    quality: str = "",
) -> str:
    title = repo_id.split("/", 1)[1]
    intro = "GGUF files with multi-token-prediction (MTP) heads for speculative decoding in llama.cpp"
    intro += f", quantized from [{base_model}](https://huggingface.co/{base_model})." if base_model else "."
    parts = [front_matter(base_model=base_model, license=license, quantized_by=quantized_by), f"# {title}", "", intro, ""]
    parts.append(file_table(entries))
    if quality:  # specconv/hub/quality.py: the `specconv compare` figures of each file
        parts.append(quality)
    usage = usage_section(repo_id, entries)
    if usage:
        parts.append(usage)
    heads = draft_heads_section(repo_id, entries)
    if heads:
        parts.append(heads)
    verified = [e for e in entries if e.report is not None]
    for e in verified:  # one report: the section as before; several (a ladder): one section per file
        title = "## Verification (`specconv verify`)" if len(verified) == 1 else f"## Verification of `{e.name}`"
        parts.append(verify_section(e.report, title))
    parts.append(f"Made with specconv {_version()}.\n")
    return "\n".join(parts)
