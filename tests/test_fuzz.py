"""Bad policy input, generated: every mutation of a valid policy loads or is refused cleanly.

Each test mutates one of a few valid policies (spec section 1 and friends) and loads the
result through the public `hookpolicy.load`. The outcome must be one of two things:

- a `PolicySet`, which then compiles against a small model, attaches, trains a step and
  detaches leaving no hook behind (module hooks and PyTorch's global optimizer hooks);
- a `PolicyError` whose every problem names the file, a line and column (1-based; 0:0
  only for whole-file problems at `$`, such as size or encoding), a `$`-rooted JSON path
  and a one-line message, exactly what `hookpolicy check` prints as
  `FILE:LINE:COL: $.path: message`.

Never another exception, never a hang: hypothesis' `deadline` bounds every example, and
the example counts keep this file well under a minute on two cores. A load that raises
installs nothing, because only a `PolicySet` can be attached.
"""

from __future__ import annotations

import copy
import os
import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import pytest
import torch
import torch.nn as nn
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import hookpolicy
from hookpolicy import Halt, PolicyError, PolicySet, Problem
from hookpolicy.policy import patterns
from hookpolicy.policy.linear import compile_linear
from hookpolicy.policy.loader import MAX_BYTES, MAX_NESTING
from hookpolicy.policy.model import STATS

from helpers.hooks import global_hook_counts, module_hook_count
from helpers.policies import SPEC_EXAMPLE as SPEC

# --------------------------------------------------------------------------- seeds

#: The spec's example (helpers.policies', which test_build checks), with a real runbook and a steps window that
#: opens at step 0, so the few training steps of a fuzz run evaluate its rule.
SPEC_EXAMPLE = (
    SPEC
    .replace('annotations: {runbook: "..."}', 'annotations: {runbook: "https://example.org/runbook"}')
    .replace("steps: {from: 100, until: 5000}", "steps: {from: 0, until: 5000}")
)
assert "example.org" in SPEC_EXAMPLE and "from: 0," in SPEC_EXAMPLE, "helpers.policies' example changed"

#: Forward, backward and step rules, tuple selection, files and logs, clamping, scaling.
EVERY_HOOK = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: every-hook
spec:
  onError: continue
  rules:
    - name: inputs
      match: {modules: ["**.mlp"]}
      trigger: {at: forward_pre, every: 2}
      target: input
      select: [0]
      actions:
        - capture: {stats: [mean, std], per: tensor}
        - clip: {min: -10, max: 10}
    - name: outputs
      priority: 10
      match: {types: [torch.nn.Linear], exclude: ["lm_head"]}
      trigger: {at: forward, phase: any}
      actions:
        - capture: {stats: [rms, zero_fraction], log: {path: logs/out.jsonl, max_bytes: 4096, keep: 2}}
        - scale: {factor: 1.0}
    - name: grad-out
      match: {modules: ["re:transformer\\\\.h\\\\.\\\\d+\\\\.attn\\\\.c_proj"]}
      trigger: {at: backward}
      target: grad_output
      actions:
        - alert: {if: "abs_max > 1e6 or (nonfinite > 0 and numel >= 1)", for: 2, severity: warning}
    - name: weights
      match: {root: true, modules: ["**"]}
      trigger: {at: step, steps: {from: 0, until: 3}}
      target: weight
      actions:
        - capture: {stats: [min, max, numel], per: rule, tensors: {dir: tensors, max_files: 4, max_bytes: 100000}}
"""

#: The smallest useful policy: a gradient norm per Linear.
MINIMAL = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: minimal}
spec:
  rules:
    - name: norms
      match: {types: [Linear]}
      trigger: {at: step}
      actions:
        - capture: {stats: [l2_norm]}
"""

SEEDS = (SPEC_EXAMPLE, EVERY_HOOK, MINIMAL)
SEED_DATA = tuple(yaml.safe_load(text) for text in SEEDS)

#: `$`, then `.key`, `[index]` or `['quoted key']` segments (`document.json_path`).
JSON_PATH = re.compile(r"\$(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\]|\['(?:[^'\\]|\\.)*'\])*\Z", re.S)

#: Examples per property; raise it for a longer hunt (`HOOKPOLICY_FUZZ_EXAMPLES=5000 pytest ...`).
EXAMPLES = int(os.environ.get("HOOKPOLICY_FUZZ_EXAMPLES", "120"))
#: A hang guard, not a timing: an example that takes this long is stuck (a typical one takes
#: milliseconds, a 1 MiB file a second or two on a busy 2-core machine).
DEADLINE_MS = 20_000

FUZZ = settings(
    max_examples=EXAMPLES, deadline=DEADLINE_MS,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


# --------------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.relu(self.c_attn(x)))


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.c_fc(x) * scale


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = Attention(d)
        self.mlp = Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class Transformer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.h = nn.ModuleList([Layer(d), Layer(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.h:
            x = layer(x)
        return x


class TinyLM(nn.Module):
    """Module names the seeds match: transformer.h.N.attn.c_attn, ...c_proj, ...mlp, lm_head."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.transformer = Transformer(d)
        self.lm_head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(x))


# --------------------------------------------------------------------------- checking


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch folder that is also the output folder for logs and tensor files."""
    path = tmp_path_factory.mktemp("fuzz")
    previous = os.environ.get("HOOKPOLICY_OUTPUT_DIR")
    os.environ["HOOKPOLICY_OUTPUT_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("HOOKPOLICY_OUTPUT_DIR", None)
    else:
        os.environ["HOOKPOLICY_OUTPUT_DIR"] = previous


def check_problem(problem: Problem, file: str, lines: int) -> None:
    """One problem is printable as FILE:LINE:COL: $.path: message, on one line."""
    assert isinstance(problem, Problem)
    assert problem.file == file
    assert isinstance(problem.line, int) and isinstance(problem.column, int)
    if problem.line == 0:  # a whole-file problem: size, encoding, unreadable
        assert (problem.column, problem.path) == (0, "$"), problem
    else:
        assert 1 <= problem.line <= lines + 1, problem
        assert problem.column >= 1, problem
    assert JSON_PATH.match(problem.path), f"not a JSON path: {problem.path!r}"
    assert isinstance(problem.message, str) and problem.message.strip(), problem
    assert "\n" not in problem.message and "\n" not in problem.path, f"not one line: {problem}"
    if problem.line == 0:  # no position to print: FILE: message
        assert str(problem) == f"{file}: {problem.message}"
    else:
        assert str(problem).startswith(f"{file}:{problem.line}:{problem.column}: $")


def load_outcome(folder: Path, content: Union[str, bytes], name: str = "p.yaml") -> Optional[PolicySet]:
    """Load `content` from a file: a PolicySet, or None after checking the PolicyError."""
    raw = content.encode("utf-8") if isinstance(content, str) else content
    path = folder / name
    path.write_bytes(raw)
    before = global_hook_counts()
    try:
        loaded = hookpolicy.load(path)
    except PolicyError as exc:
        assert exc.problems, "a PolicyError with no problem"
        lines = raw.count(b"\n") + 1
        for problem in exc.problems:
            check_problem(problem, str(path), lines)
        assert global_hook_counts() == before  # loading installs nothing
        return None
    assert isinstance(loaded, PolicySet) and len(loaded.policies) == 1
    return loaded


def train_under(policies: PolicySet, steps: int = 2) -> None:
    """Attach to a fresh model, train, detach; nothing may be left behind."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = global_hook_counts()
    try:
        with policies.attach(model, registry=CollectorRegistry(), rank=0) as attached:
            assert attached.plan is not None
            for _ in range(steps):
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randn(2, 4))
            model.train()
    except Halt:
        pass  # a mutated alert may say `then: halt`; a halt is a clean stop
    assert module_hook_count(model) == 0
    assert global_hook_counts() == before


# --------------------------------------------------------------------------- mutations

Path_ = tuple[Union[str, int], ...]


def paths_of(value: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path into a plain-data tree, the root included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_of(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_of(item, prefix + (index,))
    return found


def get(tree: Any, path: Path_) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def nested(depth: int, leaf: Any, kind: str) -> Any:
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"k": leaf}
    return leaf


FINITE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 101, 2**63, 2**64, -(2**63) - 1, 1e308, -1e-308, 5e-324]),
)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
UNICODE = st.text(st.characters(codec="utf-8"), max_size=30)
SCALAR = st.one_of(FINITE, NON_FINITE, UNICODE, st.booleans(), st.none())
VALUE = st.recursive(
    SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(UNICODE, inner, max_size=3)),
    max_leaves=8,
)
KEY = st.one_of(
    UNICODE,
    st.sampled_from([
        "modules", "modles", "at", "on", "every", "target", "actions", "name", "if", "then", "max_norm",
        "tensors", "dir", "path", "<<", "__class__", "apiVersion", "kind", "spec", "metadata", "rules",
    ]),
)


@st.composite
def mutated_data(draw: st.DrawFn) -> Any:
    """A seed's data with 1-4 structural mutations applied at random places."""
    data = copy.deepcopy(draw(st.sampled_from(SEED_DATA)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = paths_of(data)
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(
            ["delete", "retype", "rename", "number", "nonfinite", "unicode", "deep", "add", "copy"]
        ))
        if not path:  # the root: replace it outright or wrap it
            if kind in ("retype", "deep"):
                data = draw(VALUE) if kind == "retype" else nested(draw(st.integers(1, 80)), data, "list")
            continue
        parent, last = get(data, path[:-1]), path[-1]
        if kind == "delete":
            del parent[last]
        elif kind == "retype":
            parent[last] = draw(VALUE)
        elif kind == "rename" and isinstance(parent, dict):
            parent[draw(KEY)] = parent.pop(last)
        elif kind == "number":
            parent[last] = draw(FINITE)
        elif kind == "nonfinite":
            parent[last] = draw(NON_FINITE)
        elif kind == "unicode":
            parent[last] = draw(UNICODE)
        elif kind == "deep":
            depth = draw(st.integers(min_value=MAX_NESTING - 8, max_value=MAX_NESTING + 16))
            parent[last] = nested(depth, parent[last], draw(st.sampled_from(["list", "dict"])))
        elif kind == "add" and isinstance(parent, dict):
            parent[draw(KEY)] = draw(VALUE)
        elif kind == "copy" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
        elif kind == "copy" and isinstance(parent, dict):
            parent[f"{last}2" if isinstance(last, str) else "x"] = copy.deepcopy(parent[last])
    return data


class _NoAliases(yaml.SafeDumper):
    """Writes a shared Python object out in full each time, never as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(data: Any, flow: Optional[bool], unicode: bool) -> str:
    return yaml.dump(
        data, Dumper=_NoAliases, default_flow_style=flow, allow_unicode=unicode, sort_keys=False, width=80,
    )


TAGS = st.sampled_from([
    "!!python/object/apply:os.system ['touch {canary}']",
    "!!python/object/new:os.system ['touch {canary}']",
    "!!python/name:os.system",
    "!!python/module:os",
    "!!python/object:collections.OrderedDict {}",
    "!!binary aGVsbG8=",
    "!!set {a, b}",
    "!!omap [a: 1]",
    "!!str 1",
    "!!float 2",
    "!custom x",
    "!<tag:yaml.org,2002:python/object/apply:os.system> ['touch {canary}']",
])


@st.composite
def text_mutation(draw: st.DrawFn) -> Callable[[str, Path], str]:
    """A textual change: a line duplicated, a tag or alias bomb inserted, characters replaced."""
    kind = draw(st.sampled_from(["dup-line", "tag", "alias-bomb", "splice", "indent", "merge"]))
    position = draw(st.floats(min_value=0, max_value=1))
    splice = draw(st.lists(
        st.one_of(st.sampled_from(list(" \n\t-:{}[],'\"&*!|>#%?.@`\\") + ["<<", "---", "...", "&a", "*a"]),
                  st.characters(codec="utf-8")), max_size=6).map("".join))
    deleted = draw(st.integers(min_value=0, max_value=8))
    tag = draw(TAGS)
    levels = draw(st.integers(min_value=2, max_value=12))

    def apply(text: str, canary: Path) -> str:
        lines = text.splitlines(keepends=True)
        at = int(position * len(text))
        line_at = min(int(position * len(lines)), len(lines) - 1)
        if kind == "dup-line":
            return "".join(lines[:line_at + 1] + [lines[line_at]] + lines[line_at + 1:])
        if kind == "tag":
            colon = text.find(": ", at)
            if colon < 0:
                colon = text.find(": ")
            return text[:colon + 2] + tag.replace("{canary}", str(canary)) + "\n" + text[colon + 2:].split("\n", 1)[-1]
        if kind == "alias-bomb":
            bomb = ['x0: &x0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
            bomb += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 8) + "]" for i in range(1, levels)]
            return text + "\n".join(bomb) + "\n"
        if kind == "indent":
            return "".join(lines[:line_at] + ["  " + lines[line_at]] + lines[line_at + 1:])
        if kind == "merge":
            return "".join(lines[:line_at] + ["<<: {apiVersion: x}\n"] + lines[line_at:])
        return text[:at] + splice + text[at + deleted:]

    return apply


# --------------------------------------------------------------------------- properties


def test_the_seeds_are_valid_and_attach(folder: Path) -> None:
    for index, text in enumerate(SEEDS):
        loaded = load_outcome(folder, text, f"seed{index}.yaml")
        assert loaded is not None, f"seed {index} does not load"
        assert loaded.plan(TinyLM()).bindings, f"seed {index} binds nothing"
        train_under(loaded)


@FUZZ
@given(data=mutated_data(), flow=st.sampled_from([None, True, False]), unicode=st.booleans())
def test_structural_mutations_load_or_give_positioned_problems(
    folder: Path, data: Any, flow: Optional[bool], unicode: bool,
) -> None:
    loaded = load_outcome(folder, dump(data, flow, unicode))
    event("valid" if loaded is not None else "refused")
    if loaded is not None:
        train_under(loaded)


@FUZZ
@given(seed=st.sampled_from(SEEDS), mutations=st.lists(text_mutation(), min_size=1, max_size=3))
def test_textual_mutations_load_or_give_positioned_problems(
    folder: Path, seed: str, mutations: list[Callable[[str, Path], str]],
) -> None:
    canary = folder / "canary"
    text = seed
    for mutation in mutations:
        text = mutation(text, canary)
    loaded = load_outcome(folder, text)
    assert not canary.exists(), "a YAML tag constructed an object"
    event("valid" if loaded is not None else "refused")
    if loaded is not None:
        train_under(loaded)


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(SEEDS),
    flips=st.lists(st.tuples(st.floats(min_value=0, max_value=1), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_random_byte_flips_load_or_give_positioned_problems(
    folder: Path, seed: str, flips: list[tuple[float, int]],
) -> None:
    raw = bytearray(seed.encode("utf-8"))
    for position, byte in flips:
        raw[min(int(position * len(raw)), len(raw) - 1)] = byte
    loaded = load_outcome(folder, bytes(raw))
    event("valid" if loaded is not None else "refused")
    if loaded is not None:
        train_under(loaded)


STAT_NAMES = [s for s in STATS if s != "update_ratio"]  # a statistic of target: update only
TARGETS_AT = {
    "forward_pre": ["input"], "forward": ["output", "input"],
    "backward": ["grad_output", "grad_input"], "step": ["grad", "weight", "update", "optimizer_state"],
}
#: measured after the update: nothing changes them, a skip cannot undo them
AFTER_UPDATE = ("update", "optimizer_state")


@st.composite
def valid_rule(draw: st.DrawFn, name: str) -> dict[str, Any]:
    """A rule that the schema and the semantic checks accept, drawn from the whole language."""
    at = draw(st.sampled_from(sorted(TARGETS_AT)))
    target = draw(st.sampled_from(TARGETS_AT[at]))
    match: dict[str, Any] = draw(st.sampled_from([
        {"modules": ["**"]}, {"types": ["Linear"]}, {"modules": ["transformer.h.*.attn.*"], "exclude": ["**.c_proj"]},
        {"root": True}, {"modules": ["re:.*mlp.*"], "types": ["torch.nn.Module"]}, {"modules": ["lm_head", "nothing.*"]},
    ]))
    if target in ("grad", "weight", *AFTER_UPDATE) and draw(st.booleans()):
        match = {**match, "params": draw(st.sampled_from([["weight"], ["bias"], ["*"]]))}
    if target == "optimizer_state" and draw(st.booleans()):
        match = {**match, "state": draw(st.sampled_from([["exp_avg_sq"], ["exp_avg*"], ["momentum_buffer", "step"]]))}
    trigger: dict[str, Any] = {"at": at, "every": draw(st.integers(1, 3)),
                               "phase": draw(st.sampled_from(["train", "eval", "any"]))}
    if draw(st.booleans()):
        start = draw(st.integers(0, 2))
        trigger["steps"] = {"from": start, "until": start + draw(st.integers(1, 3))}
    stats = draw(st.lists(st.sampled_from(STAT_NAMES + (["update_ratio"] if target == "update" else [])),
                          min_size=1, max_size=4, unique=True))
    per = draw(st.sampled_from(["module", "tensor", "rule"]))
    changes_input_too_late = (at == "forward" and target == "input") or target in AFTER_UPDATE
    actions: list[dict[str, Any]] = []
    for kind in draw(st.lists(st.sampled_from(["capture", "log", "tensors", "clip", "clamp", "scale", "alert"]),
                              min_size=1, max_size=4)):
        if kind == "capture":
            actions.append({"capture": {"stats": stats, "per": per}})
        elif kind == "log":
            actions.append({"capture": {"stats": stats, "log": {"path": f"logs/{name}.jsonl", "max_bytes": 600, "keep": 1}}})
        elif kind == "tensors":
            actions.append({"capture": {"tensors": {"dir": f"tensors/{name}", "max_files": 3, "max_bytes": 20000}}})
        elif kind in ("clip", "clamp", "scale") and changes_input_too_late:
            continue
        elif kind == "clip":
            clip_per = draw(st.sampled_from(["tensor", "module", "rule"] if at == "step" else ["tensor", "module"]))
            threshold: Any = draw(st.one_of(st.floats(1e-3, 1e3), st.sampled_from(
                ["ema(norm, 0.9) + 2 * ema_std(norm, 0.9)", "1.5 * prev(norm)", "mean(norm, 2) + std(norm, 2)"])))
            clip: dict[str, Any] = {"max_norm": threshold, "norm_type": draw(st.sampled_from([1, 2, "inf"])), "per": clip_per}
            if isinstance(threshold, str):
                clip["warmup"] = draw(st.integers(0, 2))
            actions.append({"clip": clip})
        elif kind == "clamp":
            actions.append({"clip": {"min": -draw(st.floats(0, 10)), "max": draw(st.floats(0, 10))}})
        elif kind == "scale":
            actions.append({"scale": {"factor": draw(st.floats(-2, 2))}})
        else:
            condition = draw(st.sampled_from(["numel > 0", "nonfinite > 0", "l2_norm >= 0 and (mean < 1e9 or std != 0)",
                                              "zscore(l2_norm, 3) > 2 or mean > 2 * ema(mean, 0.5) + 1",
                                              "l2_norm - prev(l2_norm) > -1e9"]))
            actions.append({"alert": {"if": condition, "for": draw(st.integers(1, 2)), "warmup": draw(st.integers(0, 2)),
                                      "then": draw(st.sampled_from(["log", "halt"] if target in AFTER_UPDATE
                                                                   else ["log", "skip_step", "halt"])), "per": per,
                                      "severity": draw(st.sampled_from(["info", "warning", "critical"])),
                                      "message": "{policy}/{rule} {module} {tensor} step {step}: {condition} "
                                                 "{zscore(l2_norm, 3):.2f}"}})
    if not actions:
        actions = [{"capture": {"stats": stats}}]
    rule: dict[str, Any] = {"name": name, "match": match, "trigger": trigger, "target": target, "actions": actions,
                            "priority": draw(st.integers(0, 100)), "mode": draw(st.sampled_from(["enforce", "audit"]))}
    if target not in ("grad", "weight", *AFTER_UPDATE) and draw(st.booleans()):
        rule["select"] = draw(st.sampled_from([[0], ["scale"], [0, 1]]))
    return rule


@st.composite
def valid_policy(draw: st.DrawFn) -> dict[str, Any]:
    """A seed with its rules replaced, extended or edited, still valid by construction."""
    data = copy.deepcopy(draw(st.sampled_from(SEED_DATA)))
    spec = data["spec"]
    spec["onError"] = draw(st.sampled_from(["continue", "halt"]))
    spec["mode"] = draw(st.sampled_from(["enforce", "audit"]))
    spec["limits"] = {"maxSeries": draw(st.integers(1, 50))}
    count = draw(st.integers(0, 4))
    spec["rules"] = spec["rules"][: draw(st.integers(0 if count else 1, len(spec["rules"])))]
    spec["rules"] += [draw(valid_rule(f"fuzz-{i}")) for i in range(count)]
    data["metadata"]["name"] = draw(st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True))
    return data


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(data=valid_policy(), flow=st.sampled_from([None, True, False]))
def test_mutated_policies_that_stay_valid_compile_attach_and_detach_cleanly(
    folder: Path, data: dict[str, Any], flow: Optional[bool],
) -> None:
    loaded = load_outcome(folder, dump(data, flow, True))
    assert loaded is not None, "a policy valid by construction was refused"
    loaded.plan(TinyLM())
    train_under(loaded, steps=3)


@settings(max_examples=25, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    seed=st.sampled_from(SEEDS),
    extra=st.integers(min_value=-64, max_value=4096),
    filler=st.sampled_from(["#", "x", "é", "\n", "  # comment\n"]),
)
def test_files_around_one_mib_are_refused_before_parsing_or_load(
    folder: Path, seed: str, extra: int, filler: str,
) -> None:
    """Padding with a trailing comment to just under or over 1 MiB: bounded either way."""
    body = seed.encode("utf-8") + b"\n#"
    unit = filler.encode("utf-8") if filler.startswith(("#", " ", "\n")) else filler.encode("utf-8")
    want = MAX_BYTES + extra - len(body) - 1
    assume(want > 0)
    padding = (unit * (want // len(unit) + 1))[:want]
    if not filler.startswith(("\n", " ")):  # keep it one comment line
        padding = padding.replace(b"\n", b"#")
    raw = body + padding + b"\n"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raw = raw[:-2] + b"#\n"  # a multi-byte character cut in half at the end
    loaded = load_outcome(folder, raw)
    if len(raw) > MAX_BYTES:
        assert loaded is None
    else:
        assert loaded is not None


@settings(max_examples=40, deadline=DEADLINE_MS)
@given(
    depth=st.integers(min_value=1, max_value=5000),
    opening=st.sampled_from(["[", "{a: ", "- ", "? ", "{", "[{x: "]),
    where=st.sampled_from(["top", "match", "actions"]),
)
def test_deep_nesting_is_refused_with_a_position_never_a_recursion_error(
    folder: Path, depth: int, opening: str, where: str,
) -> None:
    if where == "top":
        text = "a: " + opening * depth + "x\n"
    else:
        nest = "[" * depth + "1" + "]" * depth
        text = MINIMAL.replace("{types: [Linear]}" if where == "match" else "[l2_norm]", nest)
    loaded = load_outcome(folder, text)
    assert loaded is None


@settings(max_examples=30, deadline=DEADLINE_MS)
@given(levels=st.integers(min_value=2, max_value=40), width=st.integers(min_value=2, max_value=40))
def test_alias_bombs_are_refused_without_expansion(folder: Path, levels: int, width: int) -> None:
    bomb = [f'a0: &a0 [{", ".join(["x"] * width)}]']
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    text = MINIMAL + "\n".join(bomb) + "\n"
    assert load_outcome(folder, text) is None


def test_a_worst_case_file_below_the_limit_loads_in_bounded_time(folder: Path) -> None:
    """Many small rules, as large as CI affords: pure-Python YAML is linear, no hang.

    The full 1 MiB version takes ~8 s on one core (docs/reliability.md); this one is 1/8.
    """
    rule = textwrap.dedent("""\
        - name: r{i}
          match: {{modules: ["**"]}}
          trigger: {{at: step}}
          actions:
            - capture: {{stats: [l2_norm]}}
    """)
    head = "apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: {name: big}\nspec:\n  rules:\n"
    parts = [head]
    size, i = len(head), 0
    while size < MAX_BYTES // 8:
        part = textwrap.indent(rule.format(i=i), "    ")
        parts.append(part)
        size += len(part)
        i += 1
    loaded = load_outcome(folder, "".join(parts))
    assert loaded is not None and len(loaded.policies[0].rules) == i


# =========================================================================== the linear pattern engine

GLOB_PARTS = ["a", "b", ".", "*", "**", "?", "[ab]", "[!a]", "[a-b]", "[.]"]
REGEX_PARTS = ["a", "b", "\\.", ".", "*", "+", "?", "*?", "|", "(", ")", "(?:", "[ab]", "[^a]", "{1,2}",
               "\\d", "(?!a)", "(?=b)", "[.]", "\\w"]
NAMES = st.text(alphabet="ab.1", max_size=10)


@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(st.lists(st.sampled_from(GLOB_PARTS), min_size=1, max_size=8).map("".join), st.lists(NAMES, max_size=8))
def test_the_linear_automaton_of_a_glob_agrees_with_re(glob: str, names: list[str]) -> None:
    """Every glob, on the automaton, selects exactly what re selects with its translation."""
    regex = patterns._glob_to_regex(glob)
    automaton = compile_linear(regex, glob)
    assert automaton is not None
    for name in names:
        assert (automaton.fullmatch(name) is not None) == (re.fullmatch(regex, name) is not None), (glob, name)


@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(st.lists(st.sampled_from(REGEX_PARTS), min_size=1, max_size=8).map("".join), st.lists(NAMES, max_size=8))
def test_the_linear_automaton_of_a_regex_agrees_with_re(regex: str, names: list[str]) -> None:
    try:
        re.compile(regex)
    except re.error:
        return
    automaton = compile_linear(regex, "re:" + regex)
    event("linear" if automaton is not None else "left to re")
    if automaton is None:
        return
    for name in names:
        assert (automaton.fullmatch(name) is not None) == (re.fullmatch(regex, name) is not None), (regex, name)
