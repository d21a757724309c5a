"""Run every verify check on a GGUF model and collect them in a Report.

Order: load and structure checks (each file alone, then the pair), parity with transformers
(`--hf`), speculative round trips for the main drafter (the MTP head, `--mtp` sidecar or embedded,
or the `--draft` model) and the n-gram drafter, the timing of plain against speculative decoding,
the cost ratios, the statistics algebra, and at T > 0 the distribution check. A check that cannot
run because an earlier one failed is reported as failed with the reason, so the exit status never
hides a skipped check.

How much work: by default every drafter's round trips run at draft_max K with both rollbacks on
every prompt, and at k = 1..K-1 on the first prompt, -n 16 tokens each; `--thorough` runs every k on
every prompt, 32 tokens, and measures llama.cpp's cost ratios on the same file too. Every check
records the work it did (`work`: prompts, tokens, draws), and `settings` the effective values.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from specconv.errors import SpecconvError
from specconv.threads import set_threads
from specconv.runtime import GraphType, load_model
from specconv.runtime.drafters import DraftModelDrafter, Eagle3Drafter, Gemma4AssistantDrafter, MtpDrafter, NgramDrafter
from specconv.runtime.drafters.draft_model import check_same_vocabulary
from specconv.runtime.drafters.eagle3 import check_head_fits_target
from specconv.runtime.drafters.mtp import block_of_position as mtp_block_of_position
from specconv.runtime.graphs import kind_of
from specconv.runtime.spec_stats import expected_tokens, per_block
from specconv.verify import roundtrip, structure
from specconv.verify.hf_checks import run_hf_checks
from specconv.verify.report import Report, file_identity

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\nimport sys\n\nfor name in sorted(os.listdir(path)):\n    print(name)\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


# tokens per prompt: the default sized so that the bundled model verifies in seconds (docs/verify.md)
QUICK_N, THOROUGH_N = 12, 32


class Progress:
    """What run_verify reports as it works: a stage with its number of steps, then each step. The CLI
    draws a bar per stage; this default ignores them."""

    def stage(self, name: str, total: int) -> None:
        pass

    def step(self, detail: str = "") -> None:
        pass


class StatusProgress(Progress):
    """The stages and steps as one status line (`demo`, `upload --verify`): show(text) is called on each."""

    def __init__(self, show, prefix: str = ""):
        self.show, self.prefix = show, prefix
        self.name, self.done, self.total = "", 0, 0

    def stage(self, name: str, total: int) -> None:
        self.name, self.done, self.total = name, 0, total
        self.show(f"{self.prefix}{name}")

    def step(self, detail: str = "") -> None:
        self.done += 1
        self.show(f"{self.prefix}{self.name} {self.done}/{self.total}" + (f": {detail}" if detail else ""))


@dataclass
class VerifyOptions:
    model: Path
    mtp: Path | None = None
    draft: Path | None = None
    hf: Path | None = None
    draft_hf: Path | None = None  # the EAGLE-3 head's checkpoint folder (with hf: the head vs its reference)
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    n_predict: int | None = None  # None: QUICK_N, or THOROUGH_N with `thorough`
    draft_max: int = 3
    thorough: bool = False  # every k on every prompt, and llama.cpp's cost ratios
    repeats: int = 3  # timed repeats of plain and speculative decoding (the speed-up's noise)
    threads: int = 0  # torch's threads; 0: by the model's matrix sizes (specconv/threads.py)
    temperature: float = 0.0
    device: str = "auto"
    dtype: str | None = None  # compute dtype (runtime default when None); the reference follows it
    seed: int = 0
    hf_max_memory: dict | None = None  # accelerate max_memory for the reference ({device: bytes}), tests
    offload: bool = False  # the runtime's weights stay in the memory map (runtime/placement.py)
    costs: bool = True  # measure cost ratios and the predicted speed-up (specconv/verify/costs.py)


def read_prompts(path) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecconvError(f"--prompts {path}: no prompt (one per line)")
    return prompts


def run_verify(opts: VerifyOptions, progress: Progress | None = None) -> Report:
    progress = progress or Progress()
    if opts.n_predict is None:
        opts = replace(opts, n_predict=THOROUGH_N if opts.thorough else QUICK_N)
    if opts.mtp and opts.draft:
        raise SpecconvError("give at most one of --mtp and --draft")
    if opts.draft_max < 1 or opts.n_predict < 1:
        raise SpecconvError("--draft-max and -n must be ≥ 1")
    if opts.repeats < 2:
        raise SpecconvError("--repeats must be ≥ 2: the spread of the repeats is the speed-up's noise")
    if opts.draft_hf and not (opts.hf and opts.draft):
        raise SpecconvError("--draft-hf (the EAGLE-3 head's checkpoint) needs --draft HEAD.gguf and --hf TARGET_DIR")
    if opts.draft_hf and _gguf_arch(opts.draft) is not None and _draft_kind(opts.draft) not in ("eagle3", "dflash"):
        raise SpecconvError(f"--draft-hf is for an EAGLE-3 head or a DFlash drafter; {Path(opts.draft).name} is "
                            f"{_gguf_arch(opts.draft)}")
    report = Report(model=str(opts.model))
    report.settings = {"mtp": str(opts.mtp) if opts.mtp else None, "draft": str(opts.draft) if opts.draft else None,
                       "hf": str(opts.hf) if opts.hf else None,
                       "draft_hf": str(opts.draft_hf) if opts.draft_hf else None, "n_predict": opts.n_predict,
                       "draft_max": opts.draft_max, "temperature": opts.temperature, "prompts": len(opts.prompts),
                       "thorough": opts.thorough, "repeats": opts.repeats}
    report.files = {role: file_identity(path) for role, path in (("model", opts.model), ("mtp", opts.mtp),
                                                                  ("draft", opts.draft)) if path and Path(path).is_file()}
    progress.stage("loading and checking the files", 1 + bool(opts.mtp or opts.draft))
    target = _load(report, "model", opts.model, opts.device, dtype=opts.dtype, offload=opts.offload)
    progress.step(Path(opts.model).name)
    if target is None:
        return report
    report.settings["threads"] = set_threads(target, opts.threads)
    report.settings["device"] = str(target.device)
    report.settings["dtype"] = str(target.dtype).replace("torch.", "")
    structure.check_file(report, target, "model")
    report.add("model: runs the main graph", GraphType.MAIN in target.serves,
               f"kind {target.kind}" + ("" if GraphType.MAIN in target.serves else ": an MTP-only sidecar needs its trunk"))
    if GraphType.MAIN not in target.serves:
        return report
    head = draft_model = None
    if opts.mtp or opts.draft:
        progress.step(Path(opts.mtp or opts.draft).name)
    if opts.mtp:
        head = _load(report, "sidecar", opts.mtp, opts.device, share_from=target, dtype=target.dtype)
        if head is not None:
            structure.check_file(report, head, "sidecar")
            report.add("sidecar: serves the MTP graph", GraphType.MTP in head.serves, f"kind {head.kind}")
            structure.check_pair(report, target, head, "sidecar")
    elif GraphType.MTP in target.serves:
        head = target
    eagle_head = assistant = dflash = None
    if opts.draft and _draft_kind(opts.draft) == "eagle3":
        eagle_head = _eagle3_head(report, target, opts)
    elif opts.draft and _draft_kind(opts.draft) == "dflash":
        dflash = _dflash(report, target, opts)
    elif opts.draft and _draft_kind(opts.draft) == "assistant":
        assistant = _assistant(report, target, opts)
    elif opts.draft:
        draft_model = _load(report, "draft", opts.draft, opts.device, dtype=target.dtype, offload=target.offload)
        if draft_model is not None:
            structure.check_file(report, draft_model, "draft")
            try:
                check_same_vocabulary(target, draft_model)
                report.add("draft: same vocabulary as the model", True, f"{draft_model.vocab_size} tokens")
            except SpecconvError as exc:
                report.add("draft: same vocabulary as the model", False, str(exc))
                draft_model = None
    prompts = _tokenize(report, target, opts.prompts)
    if prompts is None:
        return report
    if opts.hf:
        progress.stage("parity with transformers", 1)
        with report.work(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions"):
            run_hf_checks(report, target, head, eagle_head, Path(opts.hf), opts.draft_hf, prompts,
                          opts.hf_max_memory, dflash=dflash)
        progress.step()
        if opts.draft_hf and eagle_head is None and dflash is None:
            report.add("parity: EAGLE-3 head vs its checkpoint" if _draft_kind(opts.draft) != "dflash" else
                       "parity: DFlash drafter vs its checkpoint", False,
                       "not run: the draft did not load or does not fit the model (see above)")
    _speculative(report, target, head, draft_model, prompts, opts, progress, eagle_head, assistant, dflash)
    return report


def _gguf_arch(path) -> str | None:
    from specconv.runtime.gguf_file import GGUFModelFile

    try:
        return GGUFModelFile([Path(path)]).arch
    except Exception:  # unreadable: _load reports it
        return None


def _draft_kind(path) -> str | None:
    """The drafter kind of a --draft file (Graph.KIND: "eagle3", "dflash", "assistant"), None for a model."""
    arch = _gguf_arch(path)
    return kind_of(arch) if arch is not None else None


def _eagle3_head(report: Report, target, opts: VerifyOptions):
    """An EAGLE-3 --draft: loaded next to the target (its embedding / head), checked to belong to it."""
    def detail(head):
        hp = head.hparams
        return (f"target layers {list(hp.target_layers)} of {target.hparams.num_hidden_layers}, width {hp.target_hidden_size}, "
                f"draft vocabulary {head.weights['output.weight'].shape[0]} of {target.vocab_size}")

    return _draft_reading_target(report, target, opts, "EAGLE-3 head", check_head_fits_target, detail)


def _assistant(report: Report, target, opts: VerifyOptions):
    """A Gemma 4 assistant --draft: loaded next to the target (its embedding), checked to fit its K/V."""
    from specconv.runtime.drafters.gemma4_assistant import check_assistant_fits_target

    def detail(assistant):
        return (f"{assistant.hparams.num_nextn_predict_layers} layers reading target layers "
                f"{sorted(set(target.hparams.store.values()))}, backbone width {assistant.hparams.backbone_hidden_size}")

    return _draft_reading_target(report, target, opts, "Gemma 4 assistant", check_assistant_fits_target, detail)


def _dflash(report: Report, target, opts: VerifyOptions):
    """A DFlash --draft: loaded next to the target (its embedding / head), checked to belong to it."""
    from specconv.runtime.drafters.dflash import check_drafter_fits_target

    def detail(d):
        return (f"target layer inputs {list(d.hparams.target_layers)} of {target.hparams.num_hidden_layers}, "
                f"block {d.hparams.block_size}, mask token {d.hparams.mask_token_id}")

    return _draft_reading_target(report, target, opts, "DFlash drafter", check_drafter_fits_target, detail)


def _draft_reading_target(report: Report, target, opts: VerifyOptions, kind: str, fits, detail):
    """Load a draft that borrows the target's tensors, check its file and that it fits the target."""
    draft = _load(report, "draft", opts.draft, opts.device, share_from=target, dtype=target.dtype)
    if draft is None:
        return None
    structure.check_file(report, draft, "draft")
    try:
        fits(target, draft)
    except SpecconvError as exc:
        report.add(f"draft: {kind} fits the model", False, str(exc))
        return None
    report.add(f"draft: {kind} fits the model", True, detail(draft))
    return draft


def _load(report: Report, label: str, path, device, share_from=None, dtype=None, offload=None):
    try:
        model = load_model(path, device=device, dtype=dtype, share_from=share_from, offload=offload)
    except SpecconvError as exc:
        report.add(f"{label}: loads", False, str(exc))
        return None
    report.add(f"{label}: loads", True, f"{Path(path).name}: {model.arch}, {model.kind}, vocab {model.vocab_size}, "
                                         f"{len(model.file.tensors)} tensors")
    return model


def _tokenize(report: Report, target, texts):
    try:
        ids = [target.tokenizer.encode(t) for t in texts]
    except SpecconvError as exc:
        report.add("tokenizer encodes the prompts", False, str(exc))
        return None
    tok = target.tokenizer
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []  # encode added it (Gemma)
    back_ok = all(tok.decode(i[len(bos):] if i[:len(bos)] == bos else i) == t for i, t in zip(ids, texts))
    report.add("tokenizer round-trips the prompts", back_ok and all(ids),
               f"{len(texts)} prompts, {sum(map(len, ids))} tokens")
    return [i for i in ids if i]


def round_trip_trials(k: int, n_prompts: int, thorough: bool, full: bool) -> list[tuple[int, str, int]]:
    """(draft_max, rollback, prompt index) of the greedy round trips of one drafter. --thorough: every
    k ≤ K (snapshot) and K (checkpoint) on every prompt. Default, `full`: K with both rollbacks on every
    prompt and k < K (snapshot) on the first; otherwise (the n-gram drafter beside a drafter of the
    model's, which needs no file and whose rollbacks are the target's, already run): K (snapshot) on
    every prompt."""
    if not (thorough or full):
        return [(k, "snapshot", i) for i in range(n_prompts)]
    below = [(kk, "snapshot", i) for kk in range(1, k) for i in range(n_prompts if thorough else 1)]
    return below + [(k, rollback, i) for rollback in ("snapshot", "checkpoint") for i in range(n_prompts)]


def _trials_text(k: int, thorough: bool, full: bool) -> str:
    if not (thorough or full):
        return f"draft_max {k} (snapshot rollback) on every prompt"
    at_k = f"draft_max {k} with snapshot and checkpoint rollback on every prompt"
    if k == 1:
        return at_k
    below = f"1..{k - 1}" if k > 2 else "1"
    return at_k + f", {below} (snapshot) on {'every prompt' if thorough else 'the first'}"


def _speculative(report: Report, target, head, draft_model, prompts, opts: VerifyOptions, progress: Progress,
                 eagle_head=None, assistant=None, dflash=None):
    """Greedy round trips of every drafter, the timing and statistics of the main one (the first of: MTP
    head, draft model, EAGLE-3 head, Gemma 4 assistant, DFlash drafter, n-gram) at draft_max K. The
    timed runs at (K, snapshot) are that drafter's round trips there, and their plain runs the
    reference of every round trip."""
    from specconv.demo.measure import measure, speedup_verdict

    n, k = opts.n_predict, opts.draft_max
    n_ctx = max(map(len, prompts)) + n + k + 2
    drafters = {}
    if head is not None and GraphType.MTP in head.serves:
        drafters["mtp"] = lambda kk: MtpDrafter(head, n_ctx, target)
    if draft_model is not None:
        drafters["draft"] = lambda kk: DraftModelDrafter(draft_model, n_ctx, kk, target)
    if eagle_head is not None:
        drafters["eagle3"] = lambda kk: Eagle3Drafter(eagle_head, target, n_ctx)
    if assistant is not None:
        drafters[Gemma4AssistantDrafter.name] = lambda kk: Gemma4AssistantDrafter(assistant, target)
    if dflash is not None:
        from specconv.runtime.drafters.dflash import DFlashDrafter

        drafters["dflash"] = lambda kk: DFlashDrafter(dflash, target, n_ctx, kk)
    drafters["ngram"] = lambda kk: NgramDrafter()
    main_name = next(iter(drafters))
    t0 = time.perf_counter()
    work = f"{len(prompts)} prompts x {n} tokens"
    progress.stage(f"timing plain and speculative decoding ({main_name})", 2 * opts.repeats)
    try:
        m = measure(target, lambda n_ctx: drafters[main_name](k), prompts, n, [(k, "snapshot")], repeats=opts.repeats,
                    progress=lambda msg: progress.step(msg))
    except Exception as exc:  # a crash of the main drafter: its round trips failed; the others still run
        m, failed = None, roundtrip.RunError(0, k, "snapshot", f"{type(exc).__name__}: {exc}")
    if m is None:
        plain = [r.tokens for r in roundtrip.plain_runs(target, prompts, n)]
    else:
        plain = m.plain.tokens
        timed = m.runs[0]
        failed = next((d for i, (tokens, ref) in enumerate(zip(timed.tokens, plain))
                       if (d := roundtrip.divergence(target, prompts[i], i, k, "snapshot", tokens, ref))), None)
    full = {name: name == main_name or name != "ngram" for name in drafters}
    trials = {name: round_trip_trials(k, len(prompts), opts.thorough, full[name]) for name in drafters}
    todo = {name: [t for t in trials[name] if name != main_name or t[:2] != (k, "snapshot")] for name in drafters}
    progress.stage("greedy round trips", sum(map(len, todo.values())))
    exact = True
    for name, make in drafters.items():
        def step(kk, rollback, i, name=name):
            progress.step(f"{name}, draft_max {kk} {rollback}, prompt {i + 1}")

        div = failed if name == main_name and failed else None
        div = div or roundtrip.greedy_round_trips(target, make, prompts, plain, todo[name], n, on_run=step)
        with report.work(f"{work}, {len(trials[name])} runs"):
            report.add(f"greedy exact: {name}", div is None, str(div) if div else
                       f"identical to plain greedy: {_trials_text(k, opts.thorough, full[name])}")
        exact &= div is None
    if m is None:
        report.speculative = {"exact": False, "drafter": main_name, "rollback": "snapshot"}
        return
    stats = timed.stats()
    s = stats.to_json()
    if main_name == "mtp":  # acceptance by MTP block (chained heads: draft position i is block i's)
        s["per_block"] = per_block(stats, mtp_block_of_position(head))
    timing = speedup_verdict(m.plain.seconds, timed.seconds, drafted=stats.drafted)
    timing.update(repeats=opts.repeats, prompts=len(prompts), n_predict=n)
    s.update(exact=exact, drafter=main_name, draft_max=k, rollback="snapshot", temperature=0.0, prompts=len(prompts),
             n_predict=n, seconds=statistics.median(timed.seconds), plain_seconds=statistics.median(m.plain.seconds),
             speedup=timing["speedup"], timing=timing)
    if opts.costs:
        progress.stage("cost ratios", 1 + opts.thorough)
        s["costs"] = _costs(target, drafters[main_name](k), main_name, prompts[0], s.get("alpha"), opts, progress)
    s["verify_seconds"] = time.perf_counter() - t0
    report.speculative = s
    with report.work(f"{work} at draft_max {k}"):
        _metrics_algebra(report, s, k)
    if opts.temperature > 0:
        _distribution(report, target, drafters[main_name](k), prompts, opts, progress)


def _costs(target, drafter, name: str, prompt, alpha, opts: VerifyOptions, progress: Progress) -> dict:
    """Measured cost ratios and the speed-up they predict at the measured α (specconv/verify/costs.py),
    for this runtime and (--thorough) for llama.cpp on the same file."""
    from specconv.verify import costs

    k = opts.draft_max
    ours = costs.runtime_costs(target, drafter, prompt, k, opts.n_predict)
    ours["predicted"] = costs.predicted(alpha, ours["target_ratios"], ours["c"], ours["c_round"], k)
    progress.step("specconv")
    if not opts.thorough:
        return {"drafter": name, "alpha": alpha, "specconv": ours}
    theirs = costs.llamacpp_costs_isolated(opts.model, k, mtp_path=opts.mtp if name == "mtp" else None)
    progress.step("llama.cpp")
    if "error" not in theirs:
        if name == "ngram":  # prompt lookup costs llama.cpp no forward either
            theirs["c"] = theirs["c_round"] = 0.0
        theirs["predicted"] = costs.predicted(alpha, theirs["target_ratios"], theirs["c"], theirs["c_round"], k)
    return {"drafter": name, "alpha": alpha, "specconv": ours, "llama.cpp": theirs}


def _metrics_algebra(report: Report, s: dict, k: int):
    problems = []
    if s["drafts"]:
        if abs((s["acceptance_length"] - 1) - sum(s["per_position"])) > 1e-9:
            problems.append("AL - 1 ≠ Σ per_position")
        if any(a < b for a, b in zip(s["per_position"], s["per_position"][1:])):
            problems.append("per_position increases")
        if s["alpha"] is not None and abs(s["bound"] - expected_tokens(s["alpha"], k)) > 1e-9:
            problems.append("bound ≠ E(alpha, k)")
    if s["accepted"] > s["drafted"]:
        problems.append("accepted > drafted")
    if s["tokens_per_target_forward"] is not None and s["tokens_per_target_forward"] > k + 1 + 1e-12:
        problems.append(f"tokens per target forward > {k + 1}")
    report.add("statistics algebra", not problems, "; ".join(problems) or
               "AL - 1 = Σ per_position, per_position non-increasing, accepted ≤ drafted, "
               f"tokens/forward ≤ {k + 1}, bound = E(alpha, {k})")


def _distribution(report: Report, target, drafter, prompts, opts: VerifyOptions, progress: Progress):
    progress.stage(f"distribution at T={opts.temperature:g}", len(prompts))
    results = roundtrip.distribution_check(target, drafter, prompts, opts.temperature, opts.seed,
                                           on_prompt=lambda i: progress.step(f"prompt {i + 1}"))
    alpha = roundtrip.DIST_ALPHA / len(results)
    ok_dist = all(p >= alpha for p, *_ in results)
    ok_rate = all(roundtrip.acceptance_close(m, e) for _, m, e, _ in results)
    rule = results[0][3] if results else "?"
    with report.work(f"{len(results)} prompts x {roundtrip.DIST_TRIALS} draws"):
        report.add(f"distribution at T={opts.temperature:g} ({rule} rule)", ok_dist and ok_rate,
                   "; ".join(f"chi-square p {p:.3f}, acceptance {m:.3f} vs exact {e:.3f}" for p, m, e, _ in results)
                   + f" ({roundtrip.DIST_TRIALS} draws per prompt, fails at p < {alpha:.1e})")
