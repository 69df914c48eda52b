"""`hookpolicy replay` against the live run it replays.

The reference is the live run's own alert records (FILE.alerts.jsonl beside its capture
log): a run records, in audit mode, the shipped guards that decide steps with a recorder
policy logging what they read; replaying that log as in audit mode must give exactly the
records the run wrote, step by step (every message renders the history functions' values,
so equal messages are equal histories). A run in enforce mode decides: its log, replayed as
enforced, must give the decisions it took (skips, cool-downs, rewinds, the halt) record for
record. Then the command: its summary, the series a log lacks, bad input, --report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy import Halt
from hookpolicy.cli import cli
from hookpolicy.engine.replay import replay
from hookpolicy.policy.model import Alert
from helpers import REPO
from helpers.outputs import json_lines
from helpers.policies import policy_text

POLICIES = REPO / "policies"


def rule(name: str, target: str, *actions: str) -> str:
    """One rule at every step on `target` (every module's; the root for the loss), `actions` as YAML flow mappings."""
    match = "{root: true}" if target == "loss" else '{modules: ["**"]}'
    return (f"- name: {name}\n  match: {match}\n  trigger: {{at: step}}\n  target: {target}\n  actions:\n"
            + "".join(f"    - {action}\n" for action in actions))


def capture(stats: str, per: str) -> str:
    return f"capture: {{stats: [{stats}], per: {per}, log: {{path: record.jsonl}}}}"
#: The shipped policies whose alerts decide steps (skip_step, halt, cool_down, rewind) on a model without adapters.
GUARDS = ("loss-spike-guard", "nan-guard", "explosion-guard", "recover", "example-monitor")

#: What the guards read, logged: the loss, the gradients per rule (explosion-guard, example-monitor) and per
#: module (nan-guard's alert has the default per: module).
RECORDER = policy_text(rule("loss", "loss", capture("mean, max, nonfinite", "rule"))
                       + rule("grads", "grad", capture("l2_norm, nonfinite", "rule"))
                       + rule("layers", "grad", capture("l2_norm, nonfinite", "module")), name="record")

#: History functions the shipped guards do not call, a warm-up and a `for:` on a per-module alert.
TUNED = policy_text(rule(
    "layers", "grad",
    'alert: {if: "l2_norm > ema(l2_norm, 0.9) + 3 * ema_std(l2_norm, 0.9)", warmup: 10, severity: info, '
    'message: "{module}: {l2_norm:.4g} over {ema(l2_norm, 0.9):.4g} + 3 x {ema_std(l2_norm, 0.9):.4g}"}',
    'alert: {if: "zscore(l2_norm, 15) > 2 or l2_norm > 3 * prev(l2_norm) or l2_norm > 2 * max(l2_norm, 5)", for: 2, '
    'severity: warning, then: skip_step, message: "{module}: z {zscore(l2_norm, 15):.3f}, mean {mean(l2_norm, 15):.4g}, '
    'std {std(l2_norm, 15):.4g}, min {min(l2_norm, 7):.4g}, mad {mad(l2_norm, 9):.4g}; {outcome}"}'), name="tuned")

#: step -> what the script multiplies its loss by (and divides its gradients by before the update, so the
#: weights see a normal step): NaN (a non-finite loss and gradients), 5 and 20 (loss spikes), 1e4 (a gradient explosion).
SCALES: dict[int, float] = {
    5: math.nan, 45: 1e4, **{s: 5.0 for s in range(30, 34)}, **{s: 1e4 for s in range(60, 63)},
    **{s: 20.0 for s in range(80, 89)}, **{s: 20.0 for s in range(100, 148)},
}
STEPS = 160  # 100-147: 48 spikes in a row, recover.yaml's 4 rewinds at its 12th (the 4th halts)


def train(policies: hookpolicy.PolicySet, audit: bool, steps: int = STEPS) -> Optional[Halt]:
    """The script: a seeded MLP regression with SGD, its loss scaled by SCALES; the Halt that stopped it, if any."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scale = [1.0]

    def undo(*_: Any) -> None:  # after hookpolicy's global pre-hook measured the step
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(scale[0]).nan_to_num_(0.0, 0.0, 0.0)

    optimizer.register_step_pre_hook(undo)
    g = torch.Generator().manual_seed(1)
    with policies.attach(model, registry=CollectorRegistry(), audit=audit):
        for step in range(steps):
            x = torch.randn(32, 8, generator=g)
            y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
            scale[0] = SCALES.get(step, 1.0)
            loss = nn.functional.mse_loss(model(x), y) * scale[0]
            loss.backward()
            try:
                optimizer.step()
            except Halt as halt:
                return halt
            optimizer.zero_grad()
    return None


def recorded(out: Path, names: tuple[str, ...], extra: tuple[Path, ...] = (), audit: bool = True,
             ) -> tuple[list[dict[str, Any]], Optional[Halt]]:
    """Run the script under the recorder and `names` (shipped policies) plus `extra`; its alert records."""
    (out / "record.yaml").write_text(RECORDER, encoding="utf-8")
    policies = hookpolicy.load([out / "record.yaml", *(POLICIES / f"{n}.yaml" for n in names), *extra])
    halt = train(policies, audit)
    return [r for r in json_lines(out / "record.alerts.jsonl") if r.get("event") == "alert"], halt


#: What a replayed record must equal of the live one: all of it but the time (the statistics compared apart).
SAME = ("run", "step", "rank", "model", "policy", "rule", "module", "target", "tensor", "event", "severity", "then",
        "mode", "outcome", "condition", "message")


def assert_same_records(live: list[dict[str, Any]], replayed: list[dict[str, Any]]) -> None:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["step"], r["policy"], r["rule"], r["module"], r["tensor"], r["condition"])
    live, replayed = sorted(live, key=key), sorted(replayed, key=key)
    assert [key(r) for r in replayed] == [key(r) for r in live]
    for a, b in zip(live, replayed):
        assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}
        assert json.dumps({k: b["stats"][k] for k in a["stats"]}) == json.dumps(a["stats"])  # NaN equals NaN here


def fired_alerts(records: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(r["policy"], r["rule"], r["condition"]) for r in records}


def every_alert(names: tuple[str, ...]) -> set[tuple[str, str, str]]:
    loaded = hookpolicy.load([POLICIES / f"{n}.yaml" for n in names]).policies
    return {(p.name, r.name, a.source) for p in loaded for r in p.rules for a in r.actions
            if isinstance(a, Alert)}


def test_an_audit_log_replayed_in_audit_mode_gives_the_live_runs_alert_records(out: Path) -> None:
    (out / "tuned.yaml").write_text(TUNED, encoding="utf-8")
    live, halt = recorded(out, GUARDS, (out / "tuned.yaml",))
    assert halt is None
    # the run exercised every alert of every guard (a rewind's and a halt's for: included), and the tuned ones
    assert fired_alerts(live) >= every_alert(GUARDS)
    assert {r["rule"] for r in live if r["policy"] == "tuned"} == {"layers"}
    assert len({r["condition"] for r in live if r["policy"] == "tuned"}) == 2
    policies = hookpolicy.load([*(POLICIES / f"{n}.yaml" for n in GUARDS), out / "tuned.yaml"]).policies
    result = replay(policies, [str(out / "record.jsonl")], audit=True)
    assert_same_records([r for r in live if r["policy"] != "record"], result.alerts)
    assert not result.missing or not any(result.missing.values())


def test_lora_gradient_health_replayed_in_audit_mode_gives_the_live_records(out: Path) -> None:
    """The adapters' guard on a PEFT model: the recorder logs what it reads (`adapters: all`, per module)."""
    from helpers.models import lora, make_model, train_step

    adapters = rule("adapters", "grad", capture("nonfinite", "module")).replace('{modules: ["**"]}', "{adapters: all}")
    (out / "record.yaml").write_text(policy_text(adapters, name="record"), encoding="utf-8")
    model = lora(make_model())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def clean(*_: Any) -> None:  # after hookpolicy measured the step: the weights stay finite
        for p in model.parameters():
            if p.grad is not None:
                p.grad.nan_to_num_(0.0, 0.0, 0.0)

    optimizer.register_step_pre_hook(clean)
    policies = hookpolicy.load([out / "record.yaml", POLICIES / "lora-gradient-health.yaml"])
    with policies.attach(model, registry=CollectorRegistry(), audit=True):
        for step in range(12):
            train_step(model, optimizer, step, loss_scale=math.nan if step in (3, 7, 8) else 1.0)
    live = [r for r in json_lines(out / "record.alerts.jsonl") if r.get("event") == "alert"]
    assert {r["step"] for r in live} == {3, 7, 8} and len({r["module"] for r in live}) > 1
    result = replay(hookpolicy.load(POLICIES / "lora-gradient-health.yaml").policies, [str(out / "record.jsonl")],
                    audit=True)
    assert_same_records(live, result.alerts)
    assert any("selects by" in note for note in result.notes)  # a log holds names, not adapters: said


@pytest.mark.parametrize("name", ["loss-spike-guard", "nan-guard", "explosion-guard", "recover", "example-monitor"])
def test_an_enforced_run_replayed_as_enforced_gives_its_decisions(out: Path, name: str) -> None:
    live, halt = recorded(out, (name,), audit=False)
    result = replay(hookpolicy.load(POLICIES / f"{name}.yaml").policies, [str(out / "record.jsonl")])
    assert_same_records(live, result.alerts)
    decided = {r["outcome"] for r in live}
    assert decided & {"step skipped", "halting", "rewinding", "cooling down"}  # the run decided something
    if halt is None:
        assert result.halt is None
    else:
        assert result.halt == (halt.step, halt.message)
    for key, rule in result.rules.items():
        mine = [r for r in live if (r["policy"], r["rule"]) == key]
        skipped = {r["step"] for r in mine if r["outcome"] in ("step skipped", "rewinding")
                   or "step skipped instead" in r["outcome"]}
        assert set(rule.skipped) == skipped
        assert rule.rewound == [r["step"] for r in mine if r["outcome"] == "rewinding"]
        assert rule.cooled == [r["step"] for r in mine if r["outcome"] == "cooling down"]


def test_recover_enforced_climbs_its_whole_ladder(out: Path) -> None:
    """The reference run of `recover` took every rung: the replay above compares a ladder, not a skip alone."""
    live, halt = recorded(out, ("recover",), audit=False)
    outcomes = [r["outcome"] for r in live]
    assert {"step skipped", "cooling down", "rewinding"} <= set(outcomes)
    assert halt is not None and "max_rewinds" in halt.message


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, ["replay", *args], prog_name="hookpolicy")


def ranges(steps: list[int]) -> str:
    """The test's own `3, 7-9` (not replay's)."""
    out: list[str] = []
    for s in sorted(steps):
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def test_the_command_prints_what_the_enforced_run_decided_per_rule(out: Path) -> None:
    live, halt = recorded(out, ("loss-spike-guard",), audit=False)
    assert halt is not None
    result = run_cli(str(POLICIES / "loss-spike-guard.yaml"), str(out / "record.jsonl"))
    assert result.exit_code == 0, result.output
    skipped = sorted({r["step"] for r in live if r["outcome"] == "step skipped"})
    lines = result.output.splitlines()
    assert "loss-spike-guard/loss-spike:" in lines
    assert f"  skipped: {len(skipped)} steps ({ranges(skipped)})" in lines
    assert f"  halted: at step {halt.step}" in lines
    assert f"halted at step {halt.step}: {halt.message}" in lines  # the live run stopped there: no later step logged
    for index, action in enumerate(hookpolicy.load(POLICIES / "loss-spike-guard.yaml").policies[0].rules[0].actions):
        if isinstance(action, Alert):
            steps = sorted(r["step"] for r in live if r["condition"] == action.source)
            said = f"  action {index} (if: {action.source}; then {action.then}): fired {len(steps)} time{'s' if len(steps) != 1 else ''}"
            assert said + (f" at steps {ranges(steps)}" if steps else "") in lines
    # the log's run skipped exactly these steps: its later values are a skipping run's, and the command says so
    assert any(line.startswith("note: the log's own run skipped the same steps") for line in lines)


def test_an_audit_log_replayed_as_enforced_says_the_later_steps_came_from_a_run_that_did_not_skip(out: Path) -> None:
    live, _ = recorded(out, ("loss-spike-guard",))
    result = run_cli(str(POLICIES / "loss-spike-guard.yaml"), str(out / "record.jsonl"))
    assert result.exit_code == 0, result.output
    first = min(r["step"] for r in live if r["then"] == "skip_step")
    assert f"note: from step {first} on the log's values came from a run that was not skipped there" in result.output
    audit = run_cli("--audit", str(POLICIES / "loss-spike-guard.yaml"), str(out / "record.jsonl"))
    assert audit.exit_code == 0, audit.output
    assert "as in audit mode" in audit.output and "note: from step" not in audit.output
    assert "  skipped:" not in audit.output  # nothing is decided in audit mode: the alerts say what would have been


LOSS_ONLY = policy_text(rule("loss", "loss", capture("mean, nonfinite", "rule")), name="lossonly")

LAYER_NORMS = rule("layer-norms", "grad", 'alert: {if: "l2_norm > 100", per: module, then: skip_step}')
READS = policy_text(LAYER_NORMS + rule("loss", "loss", 'alert: {if: "loss > 2 * median(loss, 10)", then: skip_step}',
                                       'alert: {if: "abs_max > 10", then: halt}'), name="reads")


def test_series_the_log_lacks_are_named_one_line_each_and_a_rule_with_none_fails(out: Path, tmp_path: Path) -> None:
    (out / "lossonly.yaml").write_text(LOSS_ONLY, encoding="utf-8")
    train(hookpolicy.load(out / "lossonly.yaml"), audit=True, steps=30)
    (tmp_path / "reads.yaml").write_text(READS, encoding="utf-8")
    result = run_cli(str(tmp_path / "reads.yaml"), str(out / "record.jsonl"))
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert ("  not evaluated: action 0 (if: l2_norm > 100) reads l2_norm of the grad per module: the log has no grad "
            "series at all") in lines
    assert ("  not evaluated: action 1 (if: abs_max > 10) reads abs_max of the loss: the log has none (its loss "
            "records hold lossonly/loss: mean, nonfinite)") in lines
    assert "  action 0 (if: loss > 2 * median(loss, 10); then skip_step): fired 0 times" in lines
    assert lines[-1] == "Error: reads/layer-norms: no alert could be evaluated over the logs (the series above are missing)"
    # the alert that could be evaluated was: its replay is the loss rule's, with one alert
    assert sum(line.startswith("  action ") for line in lines) == 1


def test_a_statistic_logged_per_rule_is_not_taken_for_one_per_module(out: Path, tmp_path: Path) -> None:
    recorded(out, ("explosion-guard",))
    (tmp_path / "reads.yaml").write_text(policy_text(LAYER_NORMS, name="reads"), encoding="utf-8")
    (out / "record.jsonl").write_text("".join(  # keep the per-rule grad records only
        line + "\n" for line in (out / "record.jsonl").read_text().splitlines() if '"rule": "layers"' not in line))
    result = run_cli(str(tmp_path / "reads.yaml"), str(out / "record.jsonl"))
    assert ("  not evaluated: action 0 (if: l2_norm > 100) reads l2_norm of the grad per module: the log has the grad "
            "only per rule (record/grads); replay does not combine groups") in result.output.splitlines()
    assert result.exit_code == 1


@pytest.mark.parametrize("case", ["missing", "text", "empty", "json-not-ours", "bad-policy", "no-log", "no-policy",
                                  "rank", "run", "no-alert"])
def test_bad_input_is_one_clear_error_and_no_traceback(out: Path, tmp_path: Path, case: str) -> None:
    (out / "lossonly.yaml").write_text(LOSS_ONLY, encoding="utf-8")
    train(hookpolicy.load(out / "lossonly.yaml"), audit=True, steps=3)
    guard, log = str(POLICIES / "loss-spike-guard.yaml"), str(out / "record.jsonl")
    (tmp_path / "notes.txt").write_text("step 1 loss 2.3\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text('{"level": "info", "msg": "hello"}\n')
    (tmp_path / "bad.yaml").write_text("apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: {name: b}\nspec:\n  rulez: []\n")
    args, code, needle = {
        "missing": ([guard, str(tmp_path / "nope.jsonl")], 1, f"Error: {tmp_path / 'nope.jsonl'}: no such file"),
        "text": ([guard, str(tmp_path / "notes.txt")], 1, f"Error: {tmp_path / 'notes.txt'}: neither a capture log"),
        "empty": ([guard, str(tmp_path / "empty.jsonl")], 1, "an empty file, no capture log record in it"),
        "json-not-ours": ([guard, str(tmp_path / "other.jsonl")], 1, "Error: no hookpolicy record in"),
        "bad-policy": ([str(tmp_path / "bad.yaml"), log], 1, f"{tmp_path / 'bad.yaml'}:5:3: $.spec.rulez"),
        "no-log": ([guard], 2, "no capture log given"),
        "no-policy": ([log], 2, "no policy given"),
        "rank": (["--rank", "3", guard, log], 1, "Error: no records of rank 3 in the logs (ranks: 0)"),
        "run": (["--run", "nosuchrun", guard, log], 1, "Error: no run 'nosuchrun' in"),
        "no-alert": ([str(POLICIES / "observe.yaml").replace("observe", "clip-global"), log], 1,
                     "Error: clip-global: no rule has an alert; replay evaluates alerts"),
    }[case]
    result = run_cli(*args)
    assert result.exit_code == code, result.output
    assert needle in result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)


def test_report_draws_the_replayed_decisions_on_the_runs_figures(out: Path, tmp_path: Path) -> None:
    live, _ = recorded(out, ("loss-spike-guard",))
    page = tmp_path / "replay.html"
    result = run_cli("--report", str(page), str(POLICIES / "loss-spike-guard.yaml"), str(out / "record.jsonl"))
    assert result.exit_code == 0, result.output
    text = page.read_text()
    summary = result.output.splitlines()[0]
    assert summary.startswith("replay of loss-spike-guard over ") and summary in text.replace("&#x27;", "'")
    skipped = result.output.split("  skipped: ")[1].split(" steps")[0]
    # the table's row of the replayed rule counts the replayed skips, not the audit run's (which skipped none)
    row = text.split("<td>loss-spike-guard/loss-spike</td>")[1].split("</tr>")[0]
    assert row.endswith(f"<td>{skipped}</td>") and int(skipped) > 0
    assert 'alt="alerts and skipped steps"' in text and text.count("data:image/png;base64,") >= 2
    assert f"{page}: " in result.output.splitlines()[-1]


def test_the_replayed_rewinds_cool_downs_and_halt_are_drawn_where_the_live_run_took_them(out: Path) -> None:
    from hookpolicy.export.report import figures, replayed

    live, halt = recorded(out, ("recover",), audit=False)
    assert halt is not None
    result = replay(hookpolicy.load(POLICIES / "recover.yaml").policies, [str(out / "record.jsonl")])
    (timeline,) = [fig for title, name, fig in figures(replayed(result.records, result.alerts)) if name == "alerts.png"]
    drawn: dict[str, set[float]] = {}
    for line in timeline.axes[0].get_lines():
        drawn.setdefault(line.get_label(), set()).add(float(line.get_xdata()[0]))
    taken = {outcome: {float(r["step"]) for r in live if r["outcome"] == outcome}
             for outcome in ("step skipped", "rewinding", "cooling down")}
    assert all(taken.values())  # the live run took every kind of decision
    assert drawn == {"skipped step": taken["step skipped"], "rewound step": taken["rewinding"],
                     "cool-down (set or extended)": taken["cooling down"], "halt": {float(halt.step)}}


def test_a_rule_that_wakes_on_an_alert_is_replayed_on_exactly_its_awake_steps(out: Path) -> None:
    woke = policy_text(
        rule("spike", "loss", 'alert: {if: "loss > 3 * median(loss, 20)", severity: info}')
        + rule("after", "grad", 'alert: {if: "l2_norm >= 0", per: rule, severity: info}').replace(
            "trigger: {at: step}", "trigger: {at: step, after: {alert: spike, steps: 3}}"), name="woke")
    (out / "woke.yaml").write_text(woke, encoding="utf-8")
    live, _ = recorded(out, (), (out / "woke.yaml",))
    spikes = sorted(r["step"] for r in live if r["rule"] == "spike")
    awake = sorted({s + k for s in spikes for k in (1, 2, 3)})  # the test's own windows: the 3 steps after each
    assert spikes and [r["step"] for r in live if r["rule"] == "after"] == awake
    result = replay(hookpolicy.load(out / "woke.yaml").policies, [str(out / "record.jsonl")], audit=True)
    assert_same_records(live, result.alerts)
    assert result.rules[("woke", "after")].fired[0] == awake


def test_steps_the_log_lacks_where_the_rule_is_active_are_said(out: Path) -> None:
    every3 = policy_text(rule("loss", "loss", capture("mean, max, nonfinite", "rule")).replace(
        "trigger: {at: step}", "trigger: {at: step, every: 3}"), name="sparse")
    (out / "sparse.yaml").write_text(every3, encoding="utf-8")
    train(hookpolicy.load(out / "sparse.yaml"), audit=True, steps=20)  # logged at 0, 3, ..., 18
    result = replay(hookpolicy.load(POLICIES / "loss-spike-guard.yaml").policies, [str(out / "record.jsonl")])
    missing = [s for s in range(0, 19) if s % 3]
    assert (f"loss-spike-guard/loss-spike: action 1 reads sparse/loss, which has no value at {len(missing)} of the "
            f"19 steps 0-18 the rule is active on (e.g. 1-2, 4-5, 7): replayed, its history and for: count only the "
            "logged steps, live they counted them all") in result.notes
    assert result.steps == list(range(0, 19, 3))


def test_a_second_run_in_the_log_is_named_and_the_last_replayed(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (out / "lossonly.yaml").write_text(LOSS_ONLY, encoding="utf-8")
    for n in range(2):
        monkeypatch.setenv("HOOKPOLICY_RUN_ID", f"run-{n}")
        train(hookpolicy.load(out / "lossonly.yaml"), audit=True, steps=3)
    runs = list(dict.fromkeys(r["run"] for r in json_lines(out / "record.jsonl")))
    assert runs == ["run-0", "run-1"]
    result = replay(hookpolicy.load(POLICIES / "loss-spike-guard.yaml").policies, [str(out / "record.jsonl")])
    assert result.records.run == runs[1]
    assert f"the logs hold 1 other run(s), not replayed (--run ID): {runs[0]}" in result.notes
