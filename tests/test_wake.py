"""Rules that wake on an alert (`trigger.after`): active on exactly the K steps after the step whose
decision fired the alert, on every rank at the same steps, asleep with no hook installed.

The reference is the test's own loop: it makes the loss a spike at steps it chooses, records
where its own loss crossed the alert's threshold (the alert's condition, computed by hand on
every rank's loss), counts the steps, and reads every parameter's gradient norm
(`torch.linalg.vector_norm`) and the hooks torch holds on each Linear (`_forward_hooks`,
`_forward_pre_hooks`) at every step. The woken rules' log records must be exactly those steps,
with those norms.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy.errors import PolicyError
from helpers import REPO
from helpers.distributed import spawn
from helpers.outputs import json_lines

sys.path.insert(0, str(REPO / "examples"))
from train_mlp import build_model, make_data  # noqa: E402

#: the alert's threshold: the script's loss is below 1, a spike is it plus `BURST` (the same gradients)
THRESHOLD = 10.0
BURST = 1000.0

GUARD = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: guard}}
spec:
{snapshots}  rules:
    - name: spike
      match: {{root: true}}
      trigger: {{at: step}}
      target: loss
      ranks: {ranks}
      actions:
        - alert: {{if: "max > {threshold}", per: rule, then: {then}{heal}}}
"""

DEBUG = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: debug}}
spec:
  rules:
    - name: grads
      match: {{types: [Linear]}}
      trigger: {{at: step, after: {{alert: guard/spike, steps: {k}}}}}
      target: grad
      actions:
        - capture: {{stats: [l2_norm], per: tensor, log: {{path: {prefix}grads.jsonl}}}}
    - name: outputs
      match: {{types: [Linear]}}
      trigger: {{at: forward, after: {{alert: guard/spike, steps: {k}}}}}
      target: output
      ranks: {out_ranks}
      actions:
        - capture: {{stats: [rms], log: {{path: {prefix}outputs.jsonl}}}}
"""


def write(folder: Path, k: int, then: str = "log", ranks: str = "own", prefix: str = "", snapshots: str = "",
          heal: str = "", out_ranks: str = "own") -> list[str]:
    guard, debug = folder / f"{prefix}guard.yaml", folder / f"{prefix}debug.yaml"
    guard.write_text(GUARD.format(ranks=ranks, threshold=THRESHOLD, then=then, snapshots=snapshots, heal=heal))
    debug.write_text(DEBUG.format(k=k, prefix=prefix, out_ranks=out_ranks))
    return [str(guard), str(debug)]


def awake(alerts: list[int], k: int, steps: int) -> list[int]:
    """The steps the docs promise: the K steps after each step whose decision fired the alert."""
    return sorted({s for t in alerts for s in range(t + 1, t + 1 + k)} & set(range(steps)))


def hooks_on(model: nn.Module) -> int:
    """The forward hooks torch holds on the model's Linears (the woken `outputs` rule's, when awake)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules() if isinstance(m, nn.Linear))


def grad_norms(model: nn.Module) -> dict[str, float]:
    """Every parameter's gradient norm by (module, parameter), torch's own function."""
    return {name: float(torch.linalg.vector_norm(p.grad.double())) for name, p in model.named_parameters()}


def logged(path: Path) -> dict[int, dict[str, float]]:
    """A woken grads rule's records: per step, per `module.parameter`, its l2_norm."""
    by_step: dict[int, dict[str, float]] = {}
    for r in json_lines(path) if path.exists() else []:
        by_step.setdefault(r["step"], {})[f"{r['module']}.{r['tensor']}"] = r["stats"]["l2_norm"]
    return by_step


def assert_norms(by_step: dict[int, dict[str, float]], norms: dict[int, dict[str, float]]) -> None:
    for step, seen in by_step.items():
        assert seen.keys() == norms[step].keys(), step
        for name, value in seen.items():
            assert value == pytest.approx(norms[step][name], rel=1e-5), (step, name)


# -- one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("then", ["log", "skip_step"])
def test_a_woken_rule_is_active_on_exactly_the_k_steps_after_the_alert(
        workdir: Path, tmp_path: Path, then: str) -> None:
    """Spikes at 3 and 5 (5 inside 3's window: the end moves to 5 + K) and at 14; K = 4.
    With skip_step the spike steps are skipped: step 5 is still one of the window's steps."""
    k, steps, spikes = 4, 22, {3, 5, 14}
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(0)
    alerts: list[int] = []
    hooked: list[int] = []
    norms: dict[int, dict[str, float]] = {}
    policies = hookpolicy.load(write(tmp_path, k, then))
    with policies.attach(model, registry=CollectorRegistry(), rank=0) as attached:
        for step in range(steps):
            hooked.append(hooks_on(model))
            rows = slice(16 * step, 16 * step + 16)
            loss = nn.functional.mse_loss(model(x[rows]), y[rows]) + (BURST if step in spikes else 0.0)
            if loss.item() > THRESHOLD:
                alerts.append(step)
            loss.backward()
            norms[step] = grad_norms(model)
            optimizer.step()
            optimizer.zero_grad()
        assert attached.step == steps
    assert alerts == sorted(spikes)
    expected = awake(alerts, k, steps)
    assert expected == [4, 5, 6, 7, 8, 9, 15, 16, 17, 18]
    grads = logged(workdir / "grads.jsonl")
    assert sorted(grads) == expected
    assert_norms(grads, norms)
    assert sorted({r["step"] for r in json_lines(workdir / "outputs.jsonl")}) == expected
    # asleep, the woken rules have no hook on any module; awake, the outputs rule has one per Linear
    assert [s for s, n in enumerate(hooked) if n] == expected
    assert {n for n in hooked if n} == {3}


def test_after_a_rewind_the_woken_rule_captures_the_rerun_steps(workdir: Path, tmp_path: Path) -> None:
    """`then: rewind` at step 8 (back 2: to the snapshot taken after step 6) wakes the rule for
    steps 9..11, which run from the restored weights: the test's twin, trained by hand without
    hookpolicy, restores its own copy of step 6's weights and optimizer state at step 8, and the
    woken rule's norms are the twin's gradients at steps 9..11, its weights the twin's at the end."""
    k, steps, spike = 3, 14, 8
    torch.manual_seed(0)
    model = build_model()
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(0)
    kept: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    norms: dict[int, dict[str, float]] = {}
    files = write(tmp_path, k, then="rewind", snapshots="  snapshots: {every: 1, keep: 3}\n",
                  heal=", rewind: {back: 2, max_rewinds: 2}")
    with hookpolicy.load(files).attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(steps):
            rows = slice(16 * step, 16 * step + 16)
            burst = BURST if step == spike else 0.0
            for m in (model, twin):
                (nn.functional.mse_loss(m(x[rows]), y[rows]) + burst).backward()
            norms[step] = grad_norms(twin)
            if step == spike:  # the twin goes back to the state after step spike - 2
                weights, state = kept[spike - 2]
                twin.load_state_dict(weights)
                twin_opt.load_state_dict(state)
            else:
                twin_opt.step()
            optimizer.step()
            for o in (optimizer, twin_opt):
                o.zero_grad()
            kept[step] = (copy.deepcopy(twin.state_dict()), copy.deepcopy(twin_opt.state_dict()))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    grads = logged(workdir / "grads.jsonl")
    assert sorted(grads) == awake([spike], k, steps) == [9, 10, 11]
    assert_norms(grads, norms)


def test_explain_shows_the_wake_up(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from hookpolicy.cli import cli

    result = CliRunner().invoke(cli, ["explain", *write(tmp_path, 50), "--model", "examples.train_mlp:build_model"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("debug/grads")]
    assert rows and all("50 steps after an alert of guard/spike" in line for line in rows)
    assert ("note: guard/spike wakes debug/grads, debug/outputs for 50 steps after each step whose decision fires "
            "one of its alerts") in result.output
    assert "asleep they have no hook installed" in result.output


@pytest.mark.parametrize("alert, why", [
    ("guard/spik", "policy 'guard' (") ,
    ("gaurd/spike", "no policy named 'gaurd' is applied with this one (loaded: debug, guard)"),
    ("guard/quiet", "rule guard/quiet ("),
])
def test_an_after_that_names_no_alert_is_refused_at_its_position(tmp_path: Path, alert: str, why: str) -> None:
    guard, debug = write(tmp_path, 5)
    text = Path(guard).read_text() + """\
    - name: quiet
      match: {root: true}
      trigger: {at: step}
      target: loss
      actions:
        - capture: {stats: [mean]}
"""
    Path(guard).write_text(text)
    Path(debug).write_text(Path(debug).read_text().replace("alert: guard/spike", f"alert: {alert}", 1))
    with pytest.raises(PolicyError) as raised:
        hookpolicy.load([guard, debug])
    problems = raised.value.problems
    assert len(problems) == 1
    problem = problems[0]
    assert (problem.file, problem.line, problem.path) == (debug, 8, "$.spec.rules[0].trigger.after.alert")
    assert why in problem.message
    if alert == "guard/spik":
        assert "has no rule 'spik'" in problem.message and "did you mean 'spike'?" in problem.message
    if alert == "guard/quiet":
        assert "has no alert" in problem.message


def test_a_rule_cannot_wake_on_its_own_alert(tmp_path: Path) -> None:
    guard, debug = write(tmp_path, 5)
    Path(debug).write_text(Path(debug).read_text().replace("alert: guard/spike", "alert: grads", 1))
    with pytest.raises(PolicyError) as raised:
        hookpolicy.load([guard, debug])
    assert [p.path for p in raised.value.problems] == ["$.spec.rules[0].trigger.after.alert"]
    assert "its own alert" in raised.value.problems[0].message


# -- two gloo ranks under DDP ---------------------------------------------------------------


def woken_under_ddp(rank: int, folder: str, ranks: str, spikes: list[list[int]], k: int, steps: int) -> dict[str, Any]:
    """DDP over 2 ranks; at step s the ranks listed in `spikes` make their own loss a spike. What this rank
    saw: its own loss over the threshold, its gradients' norms (DDP's average), its Linears' hooks."""
    from helpers.dist_train import wrap

    os.environ["HOOKPOLICY_OUTPUT_DIR"] = folder
    torch.manual_seed(0)
    model = wrap(build_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    over: list[int] = []
    hooked: list[int] = []
    norms: dict[int, dict[str, float]] = {}
    policies = hookpolicy.load(write(Path(folder), k, ranks=ranks, prefix=f"rank{rank}-", out_ranks=ranks))
    with policies.attach(model, registry=CollectorRegistry(), rank=rank):
        for step in range(steps):
            hooked.append(hooks_on(model))
            rows = slice(16 * step, 16 * step + 16)
            burst = BURST if rank in dict(spikes).get(step, ()) else 0.0
            loss = nn.functional.mse_loss(model(x[rows]), y[rows]) + burst
            if loss.item() > THRESHOLD:
                over.append(step)
            loss.backward()
            norms[step] = {n.removeprefix("module."): v for n, v in grad_norms(model).items()}
            optimizer.step()
            optimizer.zero_grad()
    return {"over": over, "hooked": hooked, "norms": norms}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["own", "job"])
def test_woken_on_both_ranks_at_the_same_steps_when_one_or_both_ranks_alert(
        tmp_path: Path, free_port: int, ranks: str) -> None:
    """Step 2: rank 1's loss alone is a spike; step 9: both ranks'. With `ranks: own` each rank's alert
    fires on its own loss (at step 2 on rank 1 only) and the agreement carries it to rank 0; with
    `ranks: job` the job's loss (both ranks' roots) fires on both alike, and the woken outputs rule is
    `ranks: job` too (its statistics reduced in the agreement's tail from its first awake step). K = 3."""
    k, steps = 3, 14
    spikes = [[2, [1]], [9, [0, 1]]]
    results = spawn(woken_under_ddp, tmp_path, free_port, str(tmp_path), ranks, spikes, k, steps)
    assert [r["over"] for r in results] == [[9], [2, 9]]  # the alert fires on one rank, then on both
    expected = awake(sorted({s for r in results for s in r["over"]}), k, steps)
    assert expected == [3, 4, 5, 10, 11, 12]
    for rank, r in enumerate(results):
        grads = logged(tmp_path / f"rank{rank}-grads.jsonl")
        assert sorted(grads) == expected, rank
        assert_norms(grads, {int(s): v for s, v in r["norms"].items()})
        assert sorted({x["step"] for x in json_lines(tmp_path / f"rank{rank}-outputs.jsonl")}) == expected, rank
        assert [s for s, n in enumerate(r["hooked"]) if n] == expected, rank
    rms = [{(x["step"], x["module"]): x["stats"]["rms"] for x in json_lines(tmp_path / f"rank{rank}-outputs.jsonl")}
           for rank in range(2)]
    # the ranks' batches differ: their own outputs' rms differ, the job's (every rank's outputs together) are one
    assert (rms[0] == rms[1]) == (ranks == "job")


# -- the shipped policy ---------------------------------------------------------------------


def test_debug_after_spike_does_what_its_header_says(workdir: Path) -> None:
    """policies/debug-after-spike.yaml with loss-spike-guard.yaml on the GPT of the library's tests (AdamW,
    tied embeddings): the loop adds 100 to its loss at steps 30 and 40, which the guard skips (the loop sees
    its parameters unchanged there). Until step 30 no statistic of the policy exists, as series or file; the
    gradient norms are logged on exactly steps 31..90 (40 moved the end), each Linear, Embedding and LayerNorm
    module's own parameters together (the tied weight under transformer.wte) against torch.linalg.vector_norm;
    the update ratios on the same steps but 40 (skipped), against the loop's ||w_after - w_before|| /
    ||w_before||; the gauges keep step 90's values; `hookpolicy report` draws the log. Every rank waking at
    the same step is test_woken_on_both_ranks_at_the_same_steps_when_one_or_both_ranks_alert."""
    from click.testing import CliRunner
    from hookpolicy.cli import cli
    from helpers.library import load
    from helpers.models import batch, make_model
    from helpers.outputs import metric

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spikes, steps = {30, 40}, 95
    owned: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            mine = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in mine)
            if mine:
                owned[name] = mine
    assert "lm_head" not in owned and "transformer.wte" in owned  # the tied weight is the embedding's

    def norm(ts: list[torch.Tensor]) -> float:
        return float(torch.linalg.vector_norm(torch.cat([t.detach().double().flatten() for t in ts])))

    grads: dict[int, dict[str, float]] = {}
    ratios: dict[int, dict[str, float]] = {}
    skipped: list[int] = []
    reg = CollectorRegistry()
    with load("debug-after-spike.yaml").attach(model, registry=reg, rank=0):
        for step in range(steps):
            if step == 31:
                families = {s.name for f in reg.collect() for s in f.samples
                            if s.labels.get("policy") == "debug-after-spike"}
                assert not {f for f in families if f.startswith(("hookpolicy_grad_", "hookpolicy_update_"))}
                assert not (workdir / "debug-after-spike" / "grads.jsonl").exists()
                assert not (workdir / "debug-after-spike" / "updates.jsonl").exists()
            idx, targets = batch(step)
            _, loss = model(idx, targets)
            (loss + (100.0 if step in spikes else 0.0)).backward()
            grads[step] = {name: norm([p.grad for p in ps]) for name, ps in owned.items()}
            before = {name: [p.detach().clone() for p in ps] for name, ps in owned.items()}
            optimizer.step()
            optimizer.zero_grad()
            if all(torch.equal(p, b) for name, ps in owned.items() for p, b in zip(ps, before[name])):
                skipped.append(step)
            ratios[step] = {name: norm([p - b for p, b in zip(ps, before[name])]) / norm(before[name])
                            for name, ps in owned.items()}
        for name in owned:  # the gauges keep the window's last values (step 90's)
            labels = {"policy": "debug-after-spike", "module": name, "tensor": ""}
            assert metric(reg, "hookpolicy_grad_l2_norm", {**labels, "rule": "layer-grads"}) == \
                pytest.approx(grads[90][name], rel=1e-5)
            assert metric(reg, "hookpolicy_update_update_ratio", {**labels, "rule": "update-ratios"}) == \
                pytest.approx(ratios[90][name], rel=1e-4)
    assert skipped == [30, 40]
    window = awake(skipped, 50, steps)
    assert window == list(range(31, 91))
    logged_grads: dict[int, dict[str, float]] = {}
    for r in json_lines(workdir / "debug-after-spike" / "grads.jsonl"):
        logged_grads.setdefault(r["step"], {})[r["module"]] = r["stats"]["l2_norm"]
    assert sorted(logged_grads) == window
    for step, values in logged_grads.items():
        assert values.keys() == owned.keys()
        for name, value in values.items():
            assert value == pytest.approx(grads[step][name], rel=1e-5), (step, name)
    logged_ratios: dict[int, dict[str, float]] = {}
    for r in json_lines(workdir / "debug-after-spike" / "updates.jsonl"):
        logged_ratios.setdefault(r["step"], {})[r["module"]] = r["stats"]["update_ratio"]
    assert sorted(logged_ratios) == [s for s in window if s != 40]
    for step, values in logged_ratios.items():
        assert values.keys() == owned.keys()
        for name, value in values.items():
            assert value == pytest.approx(ratios[step][name], rel=1e-4), (step, name)
    for log in ("grads", "updates"):  # the guard's alert records beside each log, which the report marks
        records = json_lines(workdir / "debug-after-spike" / f"{log}.alerts.jsonl")
        fired = [(r["policy"], r["rule"], r["step"]) for r in records if r["event"] == "alert"]
        assert fired == [("loss-spike-guard", "loss-spike", 30), ("loss-spike-guard", "loss-spike", 40)]
    page = workdir / "page.html"
    result = CliRunner().invoke(cli, ["report", str(workdir / "debug-after-spike" / "grads.jsonl"), "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "debug-after-spike/layer-grads" in text and "transformer.wte" in text  # the layers' figure
    assert "loss-spike-guard/loss-spike" in text  # and the guard's alerts, from grads.alerts.jsonl
