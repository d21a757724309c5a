"""The shape of the speculative loop and the drafter contract (runtime/speculative.py, runtime/drafters/base.py):

* the round (`speculative_round`) reads top to bottom in at most 60 lines;
* every drafter in `DRAFTERS` subclasses `Drafter`, every drafter class the runtime defines is registered,
  and a drafter missing a hook (or a name, or an `attach` while reading its target's K/V) is refused
  where it is defined; registering anything else is refused;
* no getattr / hasattr capability probe in the loop, its helpers or the drafters (an AST scan);
* the prompt start is one routine for the loop and `specconv verify`: the drafter is attached to the
  target context, started on the prompt minus its last token with the target's rows it declared, and the
  first draft follows the prompt's last token;
* the deferred catch-up of `--draft-max auto` tells the drafter the same committed tokens and rows as
  telling it round by round.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import DRAFTERS, Draft, Drafter, register
from specconv.runtime.generate import generate
from specconv.runtime.spec_link import DrafterLink
from specconv.runtime.speculative import SpecConfig, speculative_generate, speculative_round
from specconv.verify.roundtrip import distribution_check
import specconv.runtime.drafters as drafters_pkg
from tests.fixtures import speculative_models
from tests.fixtures.paths import ROOT

ROUND_MAX_LINES = 60


def test_round_fits_on_one_screen():
    lines = inspect.getsource(speculative_round).splitlines()
    print(f"speculative_round: {len(lines)} lines")
    assert len(lines) <= ROUND_MAX_LINES


def test_every_drafter_is_registered_and_built_on_the_base():
    assert DRAFTERS, "no drafter registered"
    for name, cls in DRAFTERS.items():
        assert issubclass(cls, Drafter) and cls.name == name
    defined = set()
    for info in pkgutil.iter_modules(drafters_pkg.__path__):
        module = __import__(f"specconv.runtime.drafters.{info.name}", fromlist=["_"])
        defined |= {c for c in vars(module).values()
                    if isinstance(c, type) and issubclass(c, Drafter) and c is not Drafter
                    and c.__module__ == module.__name__}
    assert defined == set(DRAFTERS.values())


def _define(**body):
    """A drafter class with the given members (start / draft / accept / name unless left out)."""
    members = {"name": "probe", "start": lambda self, prefix, hidden: None,
               "draft": lambda self, id_last, n_max, *a: Draft([]), "accept": lambda self, j, batch, hidden: None}
    members.update(body)
    return type("Incomplete", (Drafter,), {k: v for k, v in members.items() if v is not None})


@pytest.mark.parametrize("hook", ["start", "draft", "accept"])
def test_a_drafter_missing_a_hook_fails_where_it_is_defined(hook):
    with pytest.raises(TypeError, match=f"Incomplete does not implement {hook}"):
        _define(**{hook: None})


def test_a_drafter_without_a_name_or_attach_fails_where_it_is_defined():
    with pytest.raises(TypeError, match="declares no name"):
        _define(name=None)
    with pytest.raises(TypeError, match="reads its target's K/V but has no attach"):
        _define(reads_target_kv=True)
    with pytest.raises(TypeError, match="target_hidden must be a tuple"):
        _define(target_hidden="post_norm")
    assert _define(reads_target_kv=True, attach=lambda self, ctx: None).reads_target_kv


def test_registration_refuses_other_classes_and_duplicate_names():
    class DuckTyped:  # every hook, but not built on the contract
        name = "duck"

        def start(self, prefix, hidden): ...

        def draft(self, *args): ...

        def accept(self, *args): ...

    registry = dict(DRAFTERS)
    with pytest.raises(TypeError, match="is not a Drafter subclass"):
        register(registry, DuckTyped)
    with pytest.raises(TypeError, match="two drafters are named 'ngram'"):
        register(registry, _define(name="ngram"))
    assert register(registry, _define(name="fresh")) is registry["fresh"]


def _probes(path: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(file, call) of every getattr with a default and every hasattr in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                found.append((str(path.relative_to(root)), ast.unparse(node)))
    return found


# The MTP drafter's reads of its head's graph capabilities: the graph contract declares them with
# defaults (runtime/graphs/), after which these become plain attribute reads.
ALLOWED: set[tuple[str, str]] = set()  # graph capabilities are declared fields (runtime/graphs/contract.py)


def test_no_capability_probes_in_the_loop_and_drafters():
    files = [ROOT / "runtime/speculative.py", ROOT / "specconv/verify/roundtrip.py",
             *sorted((ROOT / "runtime").glob("spec_*.py")), *sorted((ROOT / "runtime/drafters").glob("*.py"))]
    found = [p for f in files for p in _probes(f)]
    print(f"{len(found)} probe(s), {len(set(found) & ALLOWED)} of them allowed: {sorted(set(found) - ALLOWED)}")
    assert set(found) <= ALLOWED, sorted(set(found) - ALLOWED)


def test_the_scan_sees_probes(tmp_path):
    f = tmp_path / "sample.py"
    f.write_text("def f(d):\n    if hasattr(d, 'attach'):\n        return getattr(d, 'x', 1) + getattr(d, 'y')\n")
    assert [call for _, call in _probes(f, tmp_path)] == ["hasattr(d, 'attach')", "getattr(d, 'x', 1)"]


class Recorder(Drafter):
    """Records what the loop hands it; drafts the target's greedy continuation when given one."""

    name = "recorder"
    needs_hidden = True
    target_hidden = ("layer:1", "post_norm")
    reads_target_kv = True

    def __init__(self, truth=()):
        self.calls, self.truth, self.committed = [], list(truth), 0

    def attach(self, target_ctx):
        self.calls.append(("attach", target_ctx, target_ctx.n_past()))

    def start(self, prefix, hidden):
        self.calls.append(("start", list(prefix), None if hidden is None else hidden.clone()))
        self.committed = len(prefix)

    def draft(self, id_last, n_max, p_min=0.0, temperature=0.0, generator=None):
        self.calls.append(("draft", id_last))
        return Draft(self.truth[self.committed + 1:self.committed + 1 + n_max])

    def accept(self, n_accepted, batch, hidden):
        self.calls.append(("accept", n_accepted, list(batch), hidden.shape))
        self.committed += n_accepted + 1


@pytest.fixture(scope="module")
def target():
    return load_model(speculative_models.gguf("embedded"), device="cpu")


def _expected_rows(target, prefix):
    out = Context(target, GraphType.MAIN, n_ctx=len(prefix) + 1).decode(prefix, hidden=("layer:1", "post_norm"))
    return torch.cat([out.hidden["layer:1"], out.hidden["post_norm"]], dim=-1)


@pytest.mark.parametrize("path", ["generate", "verify"])
def test_prompt_start_is_shared(target, path):
    prompt = [5, 17, 42, 99, 3]
    rec = Recorder()
    if path == "generate":
        speculative_generate(target, rec, prompt, 2, SpecConfig(draft_max=2))
    else:
        distribution_check(target, rec, [prompt], temperature=1.0)
    (a, ctx, n_before), (s, prefix, rows), (d, id_last) = rec.calls[:3]
    assert (a, s, d) == ("attach", "start", "draft")
    assert ctx.model is target and n_before == 0  # attached to the target's context before the prompt
    assert prefix == prompt[:-1] and id_last == prompt[-1]
    want = _expected_rows(target, prompt[:-1])
    delta = float((rows - want).abs().max())
    print(f"{path}: start rows {tuple(rows.shape)}, max |Δ| against a fresh evaluation {delta:.2e}")
    assert rows.shape == want.shape and delta == 0.0


def test_declared_rows_reach_accept_and_tokens_match_plain(target):
    prompt, n = [11, 300, 12, 64, 128], 9
    truth = prompt + generate(target, prompt, n).tokens
    rec = Recorder(truth)
    res = speculative_generate(target, rec, prompt, n, SpecConfig(draft_max=3))
    assert res.tokens == truth[len(prompt):]
    width = target.hidden_size * 2  # layer:1 ‖ post_norm
    accepts = [c for c in rec.calls if c[0] == "accept"]
    assert accepts and all(shape == (len(batch), width) for _, _, batch, shape in accepts)
    assert res.stats["speculative"]["accepted"] == res.stats["speculative"]["drafted"] > 0


class Log(Drafter):
    name = "log"
    needs_hidden = True

    def __init__(self):
        self.told = []

    def start(self, prefix, hidden): ...

    def draft(self, id_last, n_max, p_min=0.0, temperature=0.0, generator=None):
        return Draft([7] * (n_max + 2))  # more than asked: the link keeps k

    def accept(self, n_accepted, batch, hidden):
        self.told.append((list(batch[:n_accepted + 1]), hidden[:n_accepted + 1].clone()))


def test_deferred_catch_up_tells_the_same_tokens_and_rows():
    """Rounds (k, batch, accepted); a round without drafts is deferred and told before the next draft."""
    rounds = [(0, [1], 0), (0, [2], 0), (2, [3, 7, 7], 1), (0, [4], 0), (1, [5, 7], 1)]
    told = {}
    for defer in (False, True):
        log = Log()
        link = DrafterLink(log, defer=defer)
        for i, (k, batch, j) in enumerate(rounds):
            draft = link.draft(batch[0], k, 0.0, 0.0, None)
            assert len(draft) == k
            rows = torch.arange(len(batch) * 2, dtype=torch.float32).reshape(-1, 2) + 10 * i
            link.accept(j, batch, {"post_norm": rows}, drafted=bool(k))
            times = link.times(1.0)
            assert times.draft >= 0 and times.accept >= 0 and times.target == 1.0 - times.draft - times.accept
        told[defer] = log.told
    tokens = lambda t: [x for batch, _ in t for x in batch]  # noqa: E731
    rows = lambda t: torch.cat([r for _, r in t])  # noqa: E731
    assert tokens(told[True]) == tokens(told[False]) == [1, 2, 3, 7, 4, 5, 7]
    assert torch.equal(rows(told[True]), rows(told[False]))
    assert len(told[False]) == 5 and len(told[True]) == 4  # [1, 2] in one call, then [3, 7], [4], [5, 7]
