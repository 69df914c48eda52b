"""History in expressions: alerts over a series' past, adaptive clipping (ZClip), reload, clip reporting.

The references are written here from the published equations (ZClip, arXiv 2504.02507:
warm-up mean and population variance, z-score, clip to mean + k * std, EMA of the
effective norm) and from plain Python over the values a test fed in; hookpolicy never
computes them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.hooks import no_host_sync
from helpers.outputs import metric
from helpers.policies import load_policy, policy_text, write_policy
from helpers.references import ZClipReference
from hookpolicy.api import PolicySet

# --------------------------------------------------------------------------- ZClip


ZCLIP = """
- name: zclip
  match: {modules: ["**"]}
  trigger: {at: step}
  actions:
    - clip: {max_norm: "ema(norm, 0.97) + 2.5 * ema_std(norm, 0.97)", warmup: 25, per: rule}
"""

STEPS = 60
SPIKES = {40: 40.0, 41: 25.0, 52: 60.0}  # step -> loss multiplier: an injected gradient spike


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _backward(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    (nn.functional.mse_loss(model(x), y) * SPIKES.get(step, 1.0)).backward()


def _clipped(reg: CollectorRegistry, mode: str) -> float:
    return metric(reg, "hookpolicy_clipped_total", {"rule": "zclip", "module": "", "mode": mode}) or 0.0


@pytest.mark.parametrize("audit", [False, True], ids=["enforce", "audit"])
def test_adaptive_max_norm_reproduces_zclip_step_by_step(tmp_path: Path, audit: bool) -> None:
    """Each step's gradients, after hookpolicy's clip, equal ZClip's (enforce) or are untouched
    bit for bit (audit), and hookpolicy_clipped_total moves exactly on the steps ZClip clips."""
    policy = load_policy(tmp_path, ZCLIP)
    model, shadow = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.05)
    reference = ZClipReference()
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()]))
    reg = CollectorRegistry()
    clipped_steps: list[int] = []
    with policy.attach(model, registry=reg, rank=0, audit=audit):
        for step in range(STEPS):
            _backward(model, step)
            _backward(shadow, step)
            before = [p.grad.clone() for p in model.parameters()]
            count = _clipped(reg, "audit" if audit else "enforce")
            opt.step()
            if reference.step(list(shadow.parameters()), apply=not audit):
                clipped_steps.append(step)
            after = seen[-1]
            if audit:  # nothing changes, bit for bit
                assert all(torch.equal(a, b) for a, b in zip(after, before)), step
            for got, want in zip(after, [p.grad for p in shadow.parameters()]):
                torch.testing.assert_close(got, want, msg=f"step {step}")
            assert _clipped(reg, "audit" if audit else "enforce") - count == (step in clipped_steps), step
            shadow_opt.step()
            opt.zero_grad()
            shadow_opt.zero_grad()
    assert {40, 52} <= set(clipped_steps), clipped_steps  # the injected spikes are clipped (or would be)
    assert min(clipped_steps) >= 25  # not during the warm-up


@pytest.mark.parametrize("spike_at", [4, 5], ids=["on-the-last-warm-up-step", "on-the-first-step-after"])
def test_an_adaptive_clip_acts_from_the_first_step_after_its_warmup(tmp_path: Path, spike_at: int) -> None:
    """`warmup: 5` and `max_norm: 2 * max(norm, 5)`: a spike at step 4 (the last evaluation of the
    warm-up, 4 norms of past) passes untouched; one at step 5 (the first with 5 norms of past)
    is clipped as `clip_grad_norm_` clips the same gradients to twice the largest of the 5
    norms before it (each the norm the optimizer used: a clipped step enters at its threshold)."""
    policy = load_policy(tmp_path, """
        - name: adaptive
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: "2 * max(norm, 5)", warmup: 5, per: rule}}]
    """)
    model, shadow = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.05)
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()]))
    reg = CollectorRegistry()
    norms: list[float] = []
    clipped_steps: list[int] = []
    with policy.attach(model, registry=reg, rank=0):
        for step in range(8):
            for m in (model, shadow):
                x, y = _batch(step)
                (nn.functional.mse_loss(m(x), y) * (50.0 if step == spike_at else 1.0)).backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in shadow.parameters()]).item()
            if len(norms) >= 5 and norm > 2 * max(norms[-5:]):
                threshold = 2 * max(norms[-5:])
                torch.nn.utils.clip_grad_norm_(shadow.parameters(), threshold)
                clipped_steps.append(step)
                norm = threshold
            norms.append(norm)
            opt.step()
            for got, want in zip(seen[-1], [p.grad for p in shadow.parameters()]):
                torch.testing.assert_close(got, want, msg=f"step {step}")
            shadow_opt.step()
            opt.zero_grad()
            shadow_opt.zero_grad()
    assert clipped_steps == ([5] if spike_at == 5 else [])
    assert (metric(reg, "hookpolicy_clipped_total", {"rule": "adaptive", "module": "", "mode": "enforce"}) or 0.0) \
        == len(clipped_steps)


def test_a_fixed_max_norm_counts_its_clips_per_group(tmp_path: Path) -> None:
    """per: tensor: one count per tensor whose norm was over max_norm, against vector_norm."""
    policy = load_policy(tmp_path, """
        - name: fixed
          match: {modules: ["0", "2"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: 0.3, per: tensor}}]
    """)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reg = CollectorRegistry()
    want = {"0": 0, "2": 0}
    with policy.attach(model, registry=reg, rank=0):
        for step in range(5):
            _backward(model, step)
            for name, module in model.named_children():
                if name in want:
                    want[name] += sum(int(torch.linalg.vector_norm(p.grad) + 1e-6 > 0.3) for p in module.parameters())
            opt.step()
            opt.zero_grad()
    for module, count in want.items():
        assert metric(reg, "hookpolicy_clipped_total", {"rule": "fixed", "module": module, "mode": "enforce"}) == count
    assert sum(want.values()) > 0


def test_an_adaptive_clip_reads_no_value_back_inside_its_hook(tmp_path: Path) -> None:
    """The threshold is a host float from the history: clipping syncs nothing; the read-back does, once."""
    policy = load_policy(tmp_path, """
        - name: zclip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: "mean(norm, 3) + 2 * std(norm, 3)", per: tensor}}]
        - name: robust
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {max_norm: "median(norm, 3) + 3 * mad(norm, 3)", per: rule}
            - alert: {if: "robust_z(l2_norm, 3) > 3 and l2_norm > median(l2_norm, 3)"}
        - name: bwd
          match: {types: [Linear]}
          trigger: {at: backward}
          actions: [{clip: {max_norm: "1.5 * prev(norm)", per: module}}]
    """)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reg = CollectorRegistry()
    with policy.attach(model, registry=reg, rank=0) as attached:
        for step in range(4):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
        assert attached.history.series  # the thresholds have a past now

        with no_host_sync():
            _backward(model, 10)
            cycle = attached._cycle
            cycle.programs.run_step_rules(cycle.installer.step_rules())
        assert any(type(e).__name__ == "ClipEntry" for e in cycle.ledger.entries)
        for rule in ("zclip", "robust", "bwd"):
            assert metric(reg, "hookpolicy_hook_errors_total", {"rule": rule}) == 0


# --------------------------------------------------------------------------- alerts over a series' past

#: the series fed in: calm, a spike at 12 (skipped by the guard), calm again, a drift.
SERIES = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.2, 0.8, 1.0, 1.1, 0.9, 1.0, 50.0, 1.0, 1.05, 3.0, 1.0, 0.97, 1.02, 4.0]

WATCH = """
- name: watch
  match: {types: [Linear]}
  trigger: {at: forward}
  target: input
  actions:
    - alert:
        if: "numel > 0"
        severity: info
        message: "{mean:.17g}|{prev(mean):.17g}|{ema(mean, 0.8):.17g}|{ema_std(mean, 0.8):.17g}|{mean(mean, 4):.17g}|{std(mean, 4):.17g}|{min(mean, 4):.17g}|{max(mean, 4):.17g}|{zscore(mean, 4):.17g}|{count(mean):.17g}|{median(mean, 4):.17g}|{mad(mean, 4):.17g}|{robust_z(mean, 4):.17g}"
    - alert: {if: "zscore(mean, 4) > 3", warmup: 3, severity: critical}
- name: guard
  match: {types: [Linear]}
  trigger: {at: forward}
  target: input
  actions:
    - alert: {if: "mean > 10", then: skip_step, severity: warning}
"""


def _ieee_divide(a: float, b: float) -> float:
    if b != 0:
        return a / b
    return math.nan if a == 0 else math.copysign(math.inf, a)


def _reference(values: list[float], warmup: int = 0) -> list[dict[str, float]]:
    """Per evaluation, each function over the values before it (skipped ones left out)."""
    out: list[dict[str, float]] = []
    past: list[float] = []
    m: Optional[float] = None
    v = 0.0
    for x in values:
        window = past[-4:]
        mean = statistics.fmean(window) if window else math.nan
        std = math.sqrt(statistics.pvariance(window)) if window else math.nan
        z = _ieee_divide(x - mean, std) if window else math.nan
        median = statistics.median(window) if window else math.nan
        mad = statistics.median([abs(v - median) for v in window]) if window else math.nan
        robust = _ieee_divide(x - median, 1.4826 * mad) if window else math.nan
        out.append({"x": x, "prev": past[-1] if past else math.nan, "ema": math.nan if m is None else m,
                    "ema_std": math.nan if m is None else math.sqrt(v), "mean": mean, "std": std,
                    "min": min(window) if window else math.nan, "max": max(window) if window else math.nan,
                    "zscore": z, "count": len(past), "median": median, "mad": mad, "robust_z": robust})
        if x > 10:  # the guard skips the step: it never enters the history
            continue
        past.append(x)
        if m is None:
            m, v = x, 0.0  # seeded with the first value (warmup 0)
        else:
            m = 0.8 * m + 0.2 * x
            v = 0.8 * v + 0.2 * (x - m) ** 2
    return out


@pytest.fixture(autouse=True)
def _alert_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alerts on stderr as JSON records: these tests read every one (the readable lines stop at 10 a rule)."""
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")


def _alerts(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"event": "alert"' in line]


def test_history_functions_in_conditions_and_messages_match_a_reference(
    tmp_path: Path, out: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """prev, ema, ema_std, mean, std, min, max, zscore, count, median, mad, robust_z against plain Python over the fed values;
    a skipped step's value never enters the history; warmup holds the alert back."""
    policy = load_policy(tmp_path, WATCH)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    values = [float(torch.tensor(v, dtype=torch.float32)) for v in SERIES]  # what a float32 input holds
    with policy.attach(model, rank=0):
        for v in SERIES:
            model(torch.full((1, 1), v)).sum().backward()
            opt.step()
            opt.zero_grad()
    records = _alerts(capsys.readouterr().err)
    shown = [r for r in records if r["rule"] == "watch" and r["severity"] == "info"]
    reference = _reference(values)
    assert len(shown) == len(values)
    names = ["x", "prev", "ema", "ema_std", "mean", "std", "min", "max", "zscore", "count", "median", "mad", "robust_z"]
    for step, (record, want) in enumerate(zip(shown, reference)):
        got = [float(part) for part in record["message"].split("|")]
        assert got == pytest.approx([want[n] for n in names], rel=1e-12, abs=1e-12, nan_ok=True), step
    fired = [r["step"] for r in records if r["rule"] == "watch" and r["severity"] == "critical"]
    assert fired == [s for s, w in enumerate(reference) if w["count"] >= 3 and w["zscore"] > 3]
    assert {12, 15} <= set(fired)  # the spikes
    skipped = [r["step"] for r in records if r["rule"] == "guard"]
    assert skipped == [12] and reference[13]["prev"] == values[11]


def test_warmup_holds_an_alert_back_until_its_series_has_n_values(tmp_path: Path, out: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    policy = load_policy(tmp_path, """
        - name: w
          match: {types: [Linear]}
          trigger: {at: forward}
          target: input
          actions: [{alert: {if: "mean > 0", warmup: 4}}]
    """)
    model = nn.Sequential(nn.Linear(3, 1))
    with policy.attach(model, rank=0):
        for _ in range(7):
            model(torch.ones(2, 3)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
    assert [r["step"] for r in _alerts(capsys.readouterr().err)] == [4, 5, 6]


#: two windows on one series: the ring keeps 8 values, the window of 3 reads the last 3 of them
WINDOWS = """
- name: windows
  match: {types: [Linear]}
  trigger: {at: forward}
  target: input
  actions:
    - alert:
        if: "numel > 0"
        severity: info
        message: "{mean(mean, 3):.17g}|{std(mean, 3):.17g}|{min(mean, 3):.17g}|{max(mean, 3):.17g}|{median(mean, 3):.17g}|{mad(mean, 3):.17g}|{zscore(mean, 3):.17g}|{mean(mean, 8):.17g}|{min(mean, 8):.17g}"
"""


def test_a_window_shorter_than_the_series_reads_its_last_values(
    tmp_path: Path, out: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """mean, std, min, max, median, mad and zscore over 3 next to mean and min over 8 of one
    series, fed 30 values (the ring of 8 wraps three times), against `statistics` over the
    last 3 and the last 8 values fed before each evaluation."""
    policy = load_policy(tmp_path, WINDOWS)
    model = nn.Sequential(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    fed = [float(torch.tensor((7 * i) % 11 + 0.1 * i, dtype=torch.float32)) for i in range(30)]
    with policy.attach(model, rank=0):
        for v in fed:
            model(torch.full((1, 1), v)).sum().backward()
            opt.step()
            opt.zero_grad()
    shown = [r["message"] for r in _alerts(capsys.readouterr().err) if r["rule"] == "windows"]
    assert len(shown) == len(fed)
    for step, (message, x) in enumerate(zip(shown, fed)):
        got = [float(part) for part in message.split("|")]
        if step == 0:
            assert all(math.isnan(g) for g in got)
            continue
        last3, last8 = fed[max(step - 3, 0):step], fed[max(step - 8, 0):step]
        median = statistics.median(last3)
        want = [statistics.fmean(last3), statistics.pstdev(last3), min(last3), max(last3), median,
                statistics.median([abs(v - median) for v in last3]),
                _ieee_divide(x - statistics.fmean(last3), statistics.pstdev(last3)),
                statistics.fmean(last8), min(last8)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12, nan_ok=True), step


# --------------------------------------------------------------------------- reload


RELOADED = """
- name: watch
  match: {types: [Linear]}
  trigger: {at: forward}
  target: input
  actions: [{alert: {if: "mean > 2 * ema(mean, 0.5)", message: "{ema(mean, 0.5):.6g}"}}]
- name: other
  match: {types: [Linear]}
  trigger: {at: forward}
  target: input
  actions: [{alert: {if: "mean > 3 * prev(mean)"}}]
"""


def test_a_reload_keeps_the_history_of_unchanged_rules_only(tmp_path: Path) -> None:
    from hookpolicy.apply.reload import Governed, Swaps

    path = write_policy(tmp_path, RELOADED)
    model = nn.Sequential(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    swaps = Swaps(hookpolicy.load(path), rank=0)
    old = hookpolicy.load(path).attach(model, registry=CollectorRegistry(), rank=0)
    for v in (1.0, 2.0, 3.0):
        model(torch.full((2, 3), v)).sum().backward()
        opt.step()
    before = {key: list(s.values) for key, s in old.history.series.items()}
    assert {key[0][1] for key in before} == {"watch", "other"}
    # `other` changes (3 -> 4), `watch` moves below it but is otherwise the same rule
    changed = RELOADED.replace("3 * prev(mean)", "4 * prev(mean)")
    first, second = changed.split("- name: other")
    path.write_text(policy_text("- name: other" + second + first.lstrip("\n")))
    swaps.request(hookpolicy.load(path))
    governed = Governed(model, old, generation=0)

    def attach(policies: PolicySet, module: nn.Module, step: int, generation: int) -> Any:
        return policies.attach(module, registry=CollectorRegistry(), rank=0, start_step=step)

    assert swaps.next is not None
    swaps._swap(governed, [governed], attach, *swaps.next)
    new = governed.attached
    try:
        assert new is not old and new.step == 3
        kept = {key: list(s.values) for key, s in new.history.series.items()}
        assert kept == {key: values for key, values in before.items() if key[0][1] == "watch"}
        assert kept  # the unchanged rule's ema goes on where it was
    finally:
        new.remove()


# --------------------------------------------------------------------------- the history budget


#: every Linear parameter's gradient norm, kept in a 10-value window per tensor: one series of 10
#: values per group; the alert fires at every evaluation, so the alerts say which groups are evaluated
WINDOWED = """
- name: z
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions: [{alert: {if: "count(l2_norm) >= 0 or max(l2_norm, 10) > 0", per: tensor, severity: info}}]
"""
WINDOW, BUDGET_STEPS = 10, 4


def _run_windowed(tmp_path: Path, spec: str) -> tuple[dict[tuple[str, str], Any], set[tuple[str, str]]]:
    """WINDOWED on three Linear layers (six tensors) for BUDGET_STEPS steps: its series per
    (module, tensor) and the (module, tensor) of the groups its budget refused."""
    policy = load_policy(tmp_path, WINDOWED, spec=spec)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=CollectorRegistry(), rank=0) as attached:
        for step in range(BUDGET_STEPS):
            model(_batch(step)[0][:, :3]).sum().backward()
            opt.step()
            opt.zero_grad()
        kept = {(key[2], key[3]): s for key, s in attached.history.series.items()}
        return kept, {(key[2], key[3]) for key in attached.history.refused}


def test_a_history_past_its_budget_keeps_the_series_that_fit_and_says_so_once(
    tmp_path: Path, out: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """maxHistoryValues 35 holds three groups of one 10-value series: exactly three series are
    made, only their groups are evaluated (at every step), the other three never, said once."""
    budget = 35
    fit = budget // WINDOW
    kept, refused = _run_windowed(tmp_path, f"limits: {{maxHistoryValues: {budget}}}\n")
    err = capsys.readouterr().err
    tensors = {(str(layer), kind) for layer in (0, 2, 4) for kind in ("weight", "bias")}
    assert len(kept) == fit
    assert all(s.spec.size == WINDOW and s.count == BUDGET_STEPS for s in kept.values())
    assert set(kept) | refused == tensors and not set(kept) & refused
    evaluated = [(r["module"], r["tensor"]) for r in _alerts(err)]
    assert sorted(evaluated) == sorted(list(kept) * BUDGET_STEPS)
    (said,) = [line for line in err.splitlines() if "maxHistoryValues" in line]
    assert said.startswith(f"hookpolicy: policy p reached spec.limits.maxHistoryValues={budget} ({fit * WINDOW} in use)")
    assert "so it is not evaluated there" in said


def test_a_history_within_its_budget_behaves_as_without_one(
    tmp_path: Path, out: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A budget that holds every group exactly (6 tensors x 10 values) changes nothing: the same
    series, the same alerts as the default budget, and nothing said about it."""
    runs = []
    for spec in ("", f"limits: {{maxHistoryValues: {6 * WINDOW}}}\n"):
        series, refused = _run_windowed(tmp_path, spec)
        err = capsys.readouterr().err
        assert "maxHistoryValues" not in err and not refused
        kept = {group: list(s.values) for group, s in series.items()}
        runs.append((kept, [{k: v for k, v in r.items() if k != "time"} for r in _alerts(err)]))
    (kept, alerts), again = runs
    assert len(kept) == 6 and all(len(values) == BUDGET_STEPS for values in kept.values())
    assert len(alerts) == 6 * BUDGET_STEPS
    assert again == (kept, alerts)


def test_history_values_are_counted_per_series_of_a_group() -> None:
    """The cost of a group is its ring plus 2 per ema alpha (at least 1 a series), reserved whole
    at its first evaluation: a second group that does not fit gets no series at all."""
    from hookpolicy.engine.measure.history import History
    from hookpolicy.policy.expr import parse

    calls = parse("max(l2_norm, 8) > 0 or ema(mean, 0.9) > 0 or count(std) > 0").calls
    group = 8 + (1 + 2) + 1  # a ring of 8; a ring of 1 (the ema's seed) and its ema; a count, at least 1
    history = History(budgets={"p": 2 * group - 1})  # room for one group of three series, not two
    tracked = history.tracking(("p", "r"), 0, ("l2_norm", "mean", "std"), calls, warmup=0)
    assert tracked.ready("a", "") and not tracked.ready("b", "") and tracked.ready("a", "")
    history.commit([tracked.observe(m, "", {"l2_norm": 1.0, "mean": 2.0, "std": 3.0}) for m in ("a", "b")])
    assert sorted(key[2:] for key in history.series) == [("a", "", "l2_norm"), ("a", "", "mean"), ("a", "", "std")]
    assert history.used == {"p": group} and history.refused == {(("p", "r"), 0, "b", "")}


# --------------------------------------------------------------------------- malformed expressions


@pytest.mark.parametrize("expression, column, message", [
    ("zscore(l2_norm, 100) > 3", None, None),
    ("l2_norm > ema(l2_norm, 0.97) + 2.5 * ema_std(l2_norm, 0.97)", None, None),
    ("l2_norm > 2 * prev(l2_norm) and -mean / (1 + std) < 0", None, None),
    ("zscor(l2_norm, 100) > 3", 0, "'zscor' is not a function; did you mean 'zscore'?"),
    ("emma(l2_norm, 0.9) > 1", 0, "did you mean 'ema'?"),
    ("mean(l2_norm) > 1", 12, "mean takes two arguments (mean(x, W))"),
    ("prev(l2_norm, 2) > 1", 12, "prev takes one argument (prev(x))"),
    ("ema(l2_norm, 0.9, 1) > 1", 16, "ema takes two arguments"),
    ("mean(l2_norm, 0) > 1", 14, "the window of mean is a whole number of values from 1 to 10000, not 0"),
    ("max(l2_norm, 10001) > 1", 13, "not 10001"),
    ("std(l2_norm, 2.5) > 1", 13, "not 2.5"),
    ("median(l2_norm, 0) > 1", 16, "the window of median is a whole number of values from 1 to 10000, not 0"),
    ("mad(l2_norm, 10001) > 1", 13, "not 10001"),
    ("robust_z(l2_norm) > 3", 16, "robust_z takes two arguments (robust_z(x, W))"),
    ("robustz(l2_norm, 9) > 3", 0, "did you mean 'robust_z'?"),
    ("ema(l2_norm, 1) > 1", 13, "the alpha of ema must be between 0 and 1 (exclusive), not 1"),
    ("ema_std(l2_norm, 0) > 1", 17, "not 0"),
    ("ema(l2_norm, -0.5) > 1", 13, "not -0.5"),
    ("ema(2, 0.5) > 1", 4, "ema takes the name of a series first"),
    ("mean(l2_nrom, 5) > 1", 5, "unknown statistic 'l2_nrom'; did you mean 'l2_norm'?"),
    ("l2_norm() > 1", 0, "'l2_norm' is a statistic, not a function"),
    ("l2_norm + 1", 0, "expected a comparison"),
    ("(l2_norm > 1) * 2 > 1", 1, "'*' takes numbers"),
    ("l2_norm and mean > 1", 0, "'and' joins comparisons"),
    ("l2_norm > 1 > 0", 12, "expected an operator, 'and', 'or' or the end but found '>'"),
    ("l2_norm ** 2 > 1", 9, "expected a number, a name, a function or '(' after '*'"),
    ("(" * 33 + "l2_norm > 1" + ")" * 33, 32, "nested deeper than 32 parentheses or signs"),
    ("l2_norm > " + "-" * 33 + "1", 42, "nested deeper than 32"),
])
def test_malformed_expressions_are_refused_at_their_file_line_column(
    tmp_path: Path, expression: str, column: Optional[int], message: Optional[str],
) -> None:
    """FILE:LINE:COL points at the offending character inside the quoted condition."""
    path = write_policy(tmp_path, f"""
        - name: r
          match: {{types: [Linear]}}
          trigger: {{at: step}}
          actions:
            - alert: {{if: "{expression}"}}
    """)
    if message is None:
        hookpolicy.load(path)
        return
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    (problem,) = caught.value.problems
    line = path.read_text().splitlines()[problem.line - 1]
    assert problem.file == str(path) and problem.path == "$.spec.rules[0].actions[0].alert.if"
    assert problem.column == line.index('"') + 2 + column, (problem, line)
    assert message in problem.message


@pytest.mark.parametrize("body, where, message", [
    ('{max_norm: "ema(norm, 0.9)", when: "norm + 1"}', "when", "invalid when condition: expected a comparison"),
    ('{min: 0, when: "norm > 1"}', "when", "when restricts a clip by norm to the groups where it holds: add max_norm"),
    ('{max_norm: "ema(norm, 0.9)", when: "l2_norm > 1"}', "when", "unknown name 'l2_norm'; did you mean 'norm'?"),
    ('{max_norm: "ema(l2_norm, 0.9)"}', "max_norm", "unknown name 'l2_norm'; did you mean 'norm'? one of: norm"),
    ('{max_norm: "ema(norm, 1.5)"}', "max_norm", "the alpha of ema must be between 0 and 1"),
    ('{max_norm: 1.0, warmup: 5}', "warmup", "warmup applies to a max_norm expression"),
    ('{max_norm: "prev(norm)", warmup: -1}', "warmup", "below the minimum 0"),
    ('{max_norm: ""}', "max_norm", "must not be empty"),
])
def test_malformed_clip_thresholds_are_refused(tmp_path: Path, body: str, where: str, message: str) -> None:
    path = write_policy(tmp_path, f"""
        - name: r
          match: {{types: [Linear]}}
          trigger: {{at: step}}
          actions:
            - clip: {body}
    """)
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    (problem,) = caught.value.problems
    assert problem.path == f"$.spec.rules[0].actions[0].clip.{where}" and message in problem.message, problem


@pytest.mark.parametrize("message, wanted", [
    ("{zscore(l2_norm, 100):.1f} sigma", None),
    ("{l2_norm / mean(l2_norm, 10):.2f}x", None),
    ("{zscore(l2_nrom, 100)}", "invalid expression in a message field: unknown statistic 'l2_nrom'"),
    ("{mean(l2_norm, 0)}", "not 0"),
    ("{zscore(l2_norm, 100):d}", "cannot be formatted"),
    ("{0}", "unknown message field {0}"),
])
def test_message_fields_may_be_expressions(tmp_path: Path, message: str, wanted: Optional[str]) -> None:
    path = write_policy(tmp_path, f"""
        - name: r
          match: {{types: [Linear]}}
          trigger: {{at: step}}
          actions:
            - alert: {{if: "l2_norm > 1", message: "{message}"}}
    """)
    if wanted is None:
        alert = hookpolicy.load(path).policies[0].rules[0].actions[0]
        assert "l2_norm" in alert.stats  # type: ignore[union-attr]
        return
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    (problem,) = caught.value.problems
    assert problem.path.endswith(".alert.message") and wanted in problem.message, problem
    if "invalid expression" in wanted:
        line = path.read_text().splitlines()[problem.line - 1]
        assert line[problem.column - 1:].startswith("l2_nrom")



@pytest.mark.parametrize("text", [
    "ema(l2_norm, 0.97) + 2.5 * ema_std(l2_norm, 0.97) < l2_norm",
    "(mean + 1) * 2 > 3 and (std < 1 or -(min - max) / 2 >= -1)",
    "l2_norm - (prev(l2_norm) - 1) != 1 - 2 - 3",
    "zscore(mean, 10) > 3 or mean / (2 * max(mean, 5)) == 0",
])
def test_a_condition_prints_as_text_that_parses_to_the_same_tree(text: str) -> None:
    """`{condition}` and explain show the parsed form: it must mean what the file said."""
    from hookpolicy.policy.expr import parse

    parsed = parse(text)
    assert parse(str(parsed)).root == parsed.root


def test_an_adaptive_clip_keeps_one_series_per_group(tmp_path: Path) -> None:
    """per: module: each module's threshold comes from its own norms, against a reference per module."""
    policy = load_policy(tmp_path, """
        - name: per-module
          match: {modules: ["0", "2"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: "1.2 * mean(norm, 3)", per: module}}]
    """)
    model, shadow = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.05)
    past: dict[str, list[float]] = {"0": [], "2": []}
    clipped = 0
    with policy.attach(model, registry=CollectorRegistry(), rank=0) as attached:
        for step in range(12):
            _backward(model, step)
            _backward(shadow, step)
            for name, series in past.items():
                grads = [p.grad for p in shadow.get_submodule(name).parameters()]
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
                limit = 1.2 * statistics.fmean(series[-3:]) if series else math.nan
                if series:
                    torch._foreach_mul_(grads, torch.clamp(limit / (total + 1e-6), max=1.0))
                    clipped += int(limit / (total.item() + 1e-6) < 1.0)
                series.append(total.item() if not series else min(total.item(), limit))
            opt.step()
            shadow_opt.step()
            for got, want in zip(model.parameters(), shadow.parameters()):
                torch.testing.assert_close(got, want, msg=f"step {step}")
            opt.zero_grad()
            shadow_opt.zero_grad()
        kept = {key[2]: list(s.values) for key, s in attached.history.series.items()}
    assert kept == {name: pytest.approx(series[-3:], rel=1e-6) for name, series in past.items()}
    assert clipped > 0  # the reference clipped some steps, so the comparison could fail


def test_micro_batches_share_a_threshold_and_append_their_largest_norm_once(tmp_path: Path) -> None:
    """A forward clip runs once per call: every call of a step is clipped to the same threshold,
    and the step appends max(min(norm, threshold)) over its calls, once."""
    policy = load_policy(tmp_path, """
        - name: out
          match: {types: [Linear]}
          trigger: {at: forward}
          target: output
          actions: [{clip: {max_norm: "0.9 * prev(norm)", per: tensor}}]
    """)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: outputs are known in advance
    lin = copy_of(model[0])
    series: list[float] = []
    clips = 0
    with policy.attach(model, registry=CollectorRegistry(), rank=0) as attached:
        for step in range(6):
            limit = 0.9 * series[-1] if series else math.nan
            effective = []
            for micro in range(3):
                x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + micro)) * (1 + micro)
                out = model(x)
                want = lin(x).detach()
                norm = torch.linalg.vector_norm(want).item()
                if series and norm > limit:
                    clips += 1
                    want = want * torch.clamp(limit / (torch.linalg.vector_norm(want) + 1e-6), max=1.0)
                torch.testing.assert_close(out.detach(), want)
                effective.append(norm if not series else min(norm, limit))
                out.sum().backward()
            opt.step()
            opt.zero_grad()
            series.append(max(effective))
        (kept,) = [list(s.values) for s in attached.history.series.values()]
    assert kept == [pytest.approx(series[-1], rel=1e-6)]  # prev keeps one value
    assert attached.history.series[next(iter(attached.history.series))].count == 6
    assert 0 < clips < 15  # some calls were clipped, some not: the comparison could fail either way


def copy_of(module: nn.Module) -> nn.Module:
    clone = nn.Linear(3, 4)
    clone.load_state_dict(module.state_dict())
    return clone


def test_non_finite_values_never_enter_a_series() -> None:
    from hookpolicy.engine.measure.history import History, Observation, SeriesSpec

    history = History()
    spec = {"loss": SeriesSpec(size=3, alphas=(0.5,), warmup=0)}
    for value in (1.0, math.nan, 3.0, math.inf, -math.inf, 5.0):
        history.commit([Observation((("p", "r"), 0, "", ""), {"loss": value}, spec)])
    (series,) = history.series.values()
    assert list(series.values) == [1.0, 3.0, 5.0] and series.count == 3
    past = history.past((("p", "r"), 0, "", ""))
    m = 0.5 * (0.5 * 1.0 + 0.5 * 3.0) + 0.5 * 5.0
    assert past.aggregate("ema", "loss", 0.5) == m


def test_window_functions_over_a_wrapping_ring_match_numpy() -> None:
    """median, mad and robust_z (and mean, std, zscore) over the last W of 350 values, the ring
    wrapping three times, against NumPy on the plain list; a window longer than what is kept
    reads all of it."""
    import numpy as np

    from hookpolicy.engine.measure.history import History, Observation, spec_for
    from hookpolicy.policy.expr import Call, parse

    condition = parse("robust_z(mean, 100) > 0 or zscore(mean, 100) > 0 or median(mean, 7) > 0 or mad(mean, 100) > 0")
    specs = {"mean": spec_for(condition.calls, "mean", 0)}
    assert specs["mean"].size == 100  # bounded by the largest window
    key = (("p", "r"), 0, "", "")
    history, fed = History(), []
    rng = np.random.default_rng(0)
    for i, x in enumerate(rng.standard_normal(350) + np.linspace(3, 1, 350)):
        past = history.past(key)
        for w in (7, 100):
            window = np.array(fed[-w:])
            if not fed:
                assert math.isnan(past.aggregate("median", "mean", w))
                continue
            median = float(np.median(window))
            mad = float(np.median(np.abs(window - median)))
            assert past.aggregate("median", "mean", w) == pytest.approx(median, rel=1e-12), (i, w)
            assert past.aggregate("mad", "mean", w) == pytest.approx(mad, rel=1e-12, abs=1e-15), (i, w)
        if len(fed) >= 2:
            window = np.array(fed[-100:])
            median = float(np.median(window))
            robust = (x - median) / (1.4826 * float(np.median(np.abs(window - median))))
            assert Call("robust_z", "mean", "mean", 100).evaluate({"mean": float(x)}, past) == pytest.approx(robust, rel=1e-9)
        history.commit([Observation(key, {"mean": float(x)}, specs)])
        fed.append(float(x))
    (series,) = history.series.values()
    assert len(series.values) == 100 and series.count == 350
