"""The guard policies of the library (`policies/`): nan-guard, explosion-guard, loss-spike-guard and
recover, each checked against its header and against a reference hookpolicy did not compute.

The model (helpers.models' `GPT`) uses the conventional GPT-2/nanoGPT names, so the library's
patterns are tested against the names they are written for.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.models import batch, make_model, train_step
from helpers.references import guard_skips, loss_spike as _loss_spike
from helpers.library import alert_records, counter, load, lr_seen, opt_state, POLICIES, same_state, same_tensors, snapshot, stat


def test_nan_guard_skips_the_step_bit_identically(workdir: Path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reg = CollectorRegistry()
    labels = {"policy": "nan-guard", "rule": "nonfinite-grads"}
    with load("nan-guard.yaml").attach(model, registry=reg, rank=0):
        for i in range(2):
            train_step(model, opt, i)
        params, state = snapshot(model), opt_state(opt)

        def poison() -> None:
            grad = model.transformer.h[1].mlp.c_fc.weight.grad
            assert grad is not None
            grad[0, 0] = float("nan")

        train_step(model, opt, 2, before_step=poison)
        after = snapshot(model)
        assert all(torch.equal(params[n], after[n]) for n in params)
        assert same_state(state, opt_state(opt))
        assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") >= 1
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 1

        train_step(model, opt, 3)  # a clean step is applied again
        assert not torch.equal(params["transformer.h.1.mlp.c_fc.weight"], model.transformer.h[1].mlp.c_fc.weight)
        assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 0
        assert counter(reg, "hookpolicy_steps_total") == 4


def test_explosion_guard_halts_after_three_bad_steps(workdir: Path) -> None:
    policies = load("explosion-guard.yaml")
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    taken = 0
    with pytest.raises(hookpolicy.Halt) as halted:
        with policies.attach(model, registry=reg, rank=0):
            for i in range(10):
                train_step(model, opt, i, loss_scale=1e6)
                taken += 1
    assert taken == 2  # the third optimizer.step() raised
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("explosion-guard", "global-grad-norm", 2)
    assert halted.value.line().startswith("hookpolicy: halted by explosion-guard/global-grad-norm at step 2: gradient norm")
    assert counter(reg, "hookpolicy_alerts_total", policy="explosion-guard", rule="global-grad-norm", severity="critical") == 1

    # single spikes between normal steps never reach 3 in a row
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with policies.attach(model, registry=reg, rank=0):
        for i in range(8):
            train_step(model, opt, i, loss_scale=1e6 if i % 3 != 2 else 1.0)
        assert counter(reg, "hookpolicy_alerts_total", policy="explosion-guard", rule="global-grad-norm", severity="critical") == 0


def test_explosion_guard_norm_is_the_global_grad_norm(workdir: Path) -> None:
    model = make_model()
    ref = copy.deepcopy(model)
    reg = CollectorRegistry()
    with load("explosion-guard.yaml").attach(model, registry=reg, rank=0):
        idx, targets = batch(0)
        for m in (model, ref):
            loss = m(idx, targets)[1]
            assert loss is not None
            loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
        assert stat(reg, "hookpolicy_grad_l2_norm", "explosion-guard", "global-grad-norm") == pytest.approx(expected.item(), rel=1e-5)


def _zscore_spike(loss: float, applied: list[float]) -> bool:
    """The guard's old spike test (bench/policies/loss-spike-zscore.yaml): mean and std, 6 sigma."""
    if len(applied) < 20:
        return False
    window = applied[-100:]
    mean, std = statistics.fmean(window), statistics.pstdev(window)
    return std > 0 and (loss - mean) / std > 6 and loss > 1.2 * mean


@pytest.mark.slow
def test_loss_spike_guard_skips_exactly_the_spikes_of_its_reference(workdir: Path) -> None:
    """One batch learned by heart, so the loss falls, then settles; scrambled targets make
    spikes, two smaller ones while the loss still falls and three once it settled. Each step
    is skipped (parameters and AdamW state bit for bit) exactly when the policy's condition,
    computed here from the losses the script saw, says so; the old z-score test missed the
    early ones."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    half = torch.cat((scrambled[:2], targets[2:]))  # two of the four rows scrambled: a smaller spike
    early, late = {40, 41}, {120, 121, 135}
    spikes = early | late
    applied: list[float] = []
    skipped: list[int] = []
    missed_by_zscore: list[int] = []
    reg = CollectorRegistry()
    with load("loss-spike-guard.yaml").attach(model, registry=reg, rank=0):
        for step in range(140):
            _, loss = model(idx, half if step in early else scrambled if step in late else targets)
            assert loss is not None
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            unchanged = all(torch.equal(params[n], p) for n, p in model.named_parameters())
            spike = _loss_spike(loss.item(), applied)
            assert unchanged == spike, f"step {step}: loss {loss.item()}"
            if step in spikes and not _zscore_spike(loss.item(), applied):
                missed_by_zscore.append(step)
            if spike:
                assert same_state(state, opt_state(opt))
                skipped.append(step)
            else:
                applied.append(loss.item())
        labels = {"policy": "loss-spike-guard", "rule": "loss-spike"}
        assert stat(reg, "hookpolicy_loss_mean", **labels) == pytest.approx(applied[-1], rel=1e-6)
    assert skipped == sorted(spikes)
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == len(spikes)
    assert missed_by_zscore == [40, 41]  # while the loss fell, its std hid them


@pytest.mark.slow
def test_loss_spike_guard_never_skips_more_than_four_spikes_in_a_row(workdir: Path) -> None:
    """The header: four spikes in a row are skipped; the fifth (on the weights the skips left as they
    were) is applied and the count starts again, so six scrambled batches in a row (a corrupted shard)
    have their fifth applied. Each step against the header's rule computed here from the losses the
    script saw (`guard_skips`): parameters and AdamW state bit for bit where it skips, changed where
    it applies."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    shard = set(range(100, 106))
    losses: list[float] = []
    with load("loss-spike-guard.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(110):
            _, loss = model(idx, scrambled if step in shard else targets)
            assert loss is not None
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            skip = step in guard_skips(losses, 4)
            unchanged = all(torch.equal(params[n], p) for n, p in model.named_parameters())
            assert unchanged == skip, f"step {step}: loss {loss.item()}"
            if skip:
                assert same_state(state, opt_state(opt))
    skipped = guard_skips(losses, 4)
    assert shard - {104} <= skipped and 104 not in skipped
    assert not any(set(range(s, s + 5)) <= skipped for s in skipped)


def test_loss_spike_guard_halts_when_the_loss_moved_for_good(workdir: Path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    with load("loss-spike-guard.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(100):
            train_loss = model(idx, targets)[1]
            assert train_loss is not None
            train_loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for spike in range(1, 21):  # from now on every batch is "a spike": 19 skipped, the 20th halts
            loss = model(idx, scrambled)[1]
            assert loss is not None
            loss.backward()
            if spike < 20:
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            with pytest.raises(hookpolicy.Halt, match="loss-spike-guard/loss-spike"):
                opt.step()


@pytest.mark.parametrize("clean", [0, 5, 40], ids=["from-the-first-step", "short-history", "settled"])
def test_loss_spike_guard_halts_at_the_20th_step_of_a_loss_that_stays_nan(
        workdir: Path, clean: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The header: a NaN loss is never applied, from the first step on, and 20 steps in a row
    that are spikes or not finite halt the run at the 20th. A NaN weight makes every later
    loss NaN (a skipped step cannot repair it), after `clean` applied steps of history."""
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")  # every alert record (readable lines stop at 10)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    reg = CollectorRegistry()
    with load("loss-spike-guard.yaml").attach(model, registry=reg, rank=0):
        for _ in range(clean):
            loss = model(idx, targets)[1]
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
        for nan_step in range(1, 21):
            loss = model(idx, targets)[1]
            assert loss is not None and loss.isnan()
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            if nan_step < 20:
                opt.step()
                assert same_tensors(params, snapshot(model)) and same_state(state, opt_state(opt)), nan_step
                opt.zero_grad(set_to_none=True)
                gauges = {k: stat(reg, f"hookpolicy_loss_{k}", "loss-spike-guard", "loss-spike")
                          for k in ("mean", "max", "nonfinite")}
                mean, largest, seen = gauges.pop("mean"), gauges.pop("max"), gauges
                continue
            with pytest.raises(hookpolicy.Halt) as halted:
                opt.step()
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("loss-spike-guard", "loss-spike", clean + 19)
    assert halted.value.message == (f"the loss was not finite or a spike for 20 steps in a row (the last: nan at step "
                                    f"{clean + 19}): it moved for good, stopping the run")
    alerts = [json.loads(line) for line in capsys.readouterr().err.splitlines()
              if line.startswith("{") and '"event": "alert"' in line]
    skipped = [a["message"] for a in alerts if a["severity"] == "warning"]
    assert skipped == [f"loss nan at step {clean + i} is not finite; step skipped" for i in range(20)]
    # "Exported: hookpolicy_loss_mean / _max / _nonfinite, hookpolicy_skipped_steps_total, hookpolicy_alerts_total"
    labels = {"policy": "loss-spike-guard", "rule": "loss-spike"}
    assert seen == {"nonfinite": 1} and math.isnan(mean) and math.isnan(largest)  # the gauges at step clean + 18
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 20  # the halting step's too
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="warning") == 20
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1


#: recover.yaml's header: "never more than 4 finite spikes skipped in a row", "at the 9th spike in a row ... x0.1
#: for 100 steps", "at the 12th spike in a row, the run goes back to the newest snapshot at least 15 steps older"
BOUND, COOL, REWIND = 4, 9, 12


@pytest.mark.slow
def test_recover_climbs_its_ladder_as_its_header_says(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recover.yaml against its header, the spikes told by loss-spike-guard's reference
    condition (`_loss_spike`) from the losses of the applied steps: a spike is skipped (bit for
    bit), the 5th in a row on the same weights is applied (its loss enters the history) unless a
    rung acted at it; from the 9th in a row the lr the optimizer uses (read by its own step
    pre-hook) is 0.1x for 100 steps, and those steps stay skipped; at the 12th the state is the
    test's own copy taken after step 149 (the newest snapshot at least 15 steps older, snapshots
    after every 50 steps), the streaks start again; the 4th rewind halts, and the rewind alerts'
    records say so. The spikes of 60, 80-87 (8 in a row: no rung acts, the 5th is applied) and
    100-108 (the 9th cools down) are the loss plus a constant (the gradients unchanged); 200-247
    are scrambled batches: the 5th in a row, applied, damages the weights of this batch learned
    by heart, so the spike stays and climbs to the rewinds."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    lr = 1e-2
    opt, used = lr_seen(torch.optim.AdamW(model.parameters(), lr=lr))
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    shifted = {60, *range(80, 88), *range(100, 100 + COOL)}
    bad = set(range(200, 200 + 4 * REWIND))
    applied: list[float] = []
    streak, in_a_row, cool_until, rewinds, skipped = 0, 0, 0, 0, 0
    expected_lr: list[float] = []
    held: list[int] = []  # the spikes applied past the bound
    copy_149: dict[str, Any] = {}
    reg = CollectorRegistry()
    with load("recover.yaml").attach(model, registry=reg, rank=0), pytest.raises(hookpolicy.Halt) as halted:
        for step in range(260):
            _, loss = model(idx, scrambled if step in bad else targets)
            assert loss is not None
            if step in shifted:
                loss = loss + 10.0
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            spike = _loss_spike(loss.item(), applied)
            assert spike or step not in shifted | bad, step
            streak = streak + 1 if spike else 0
            rewind = streak >= REWIND
            if rewind and rewinds == 3:
                expected_halt = step
            cooling = streak >= COOL and not rewind
            if cooling:
                cool_until = max(cool_until, step + 100)
            # past the bound the spike's step is applied, unless a rung acted at it (the rung's step stays skipped)
            skip = spike and (in_a_row < BOUND or cooling or rewind)
            in_a_row = in_a_row + 1 if skip else 0
            skipped += skip  # a rewinding or halting step is a skipped one
            if spike and not skip:
                held.append(step)
            expected_lr.append(lr * 0.1 if step < cool_until else lr)
            opt.step()
            assert used[-1] == expected_lr[-1], step
            if step == 149:
                copy_149 = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
            if rewind:
                rewinds += 1
                streak = in_a_row = 0
                assert all(torch.equal(p, copy_149["model"][n]) for n, p in model.state_dict().items()), step
                assert same_state(opt_state(opt), [s for s in copy_149["opt"]["state"].values()]), step
            elif skip:
                assert all(torch.equal(params[n], p) for n, p in model.named_parameters()), step
                assert same_state(state, opt_state(opt)), step
            else:
                assert not all(torch.equal(params[n], p) for n, p in model.named_parameters()), step
                applied.append(loss.item())
            opt.zero_grad(set_to_none=True)
    assert (halted.value.rule, halted.value.step) == ("recover", expected_halt)
    assert rewinds == 3  # the fourth halted inside its optimizer.step()
    assert held[:2] == [84, 104]  # the 5th of 80-87 and of 100-108, applied
    assert all(x == lr for x in expected_lr[:100 + COOL - 1])  # 8 spikes in a row cooled nothing down
    labels = {"policy": "recover", "rule": "recover"}
    assert counter(reg, "hookpolicy_rewinds_total", **labels, model="GPT") == 3
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels, model="GPT") == skipped
    assert 0.1 * lr in expected_lr and expected_lr.count(0.1 * lr) >= 100
    rewinding = [(a["step"], a["severity"], a["outcome"]) for a in alert_records(tmp_path / "alerts.jsonl")
                 if a["then"] == "rewind"]
    assert [outcome for *_, outcome in rewinding] == ["rewinding"] * 3 + ["not rewound (max_rewinds: 3 reached; halting)"]
    assert rewinding[-1][:2] == (expected_halt, "critical")


def test_explosion_guard_counts_a_non_finite_norm_as_beyond_the_limit(workdir: Path) -> None:
    """explosion-guard.yaml: "a critical alert when it is above 1000 or contains NaN/Inf. After 3
    consecutive such steps the run halts". Gradients of a normal size, one element poisoned by the
    test: NaN, then Inf, then NaN; the third halts. A poisoned step between clean ones never does.
    (The poisoned weight is left out of the optimizer, so lr 0 keeps every weight finite.)"""
    policies = load("explosion-guard.yaml")
    labels = {"policy": "explosion-guard", "rule": "global-grad-norm"}

    def run(model: nn.Module, poison: dict[int, float], steps: int) -> int:
        weight = model.transformer.h[0].attn.c_proj.weight
        opt = torch.optim.SGD([p for p in model.parameters() if p is not weight], lr=0.0)
        taken = 0
        for step in range(steps):
            loss = model(*batch(step))[1]
            assert loss is not None
            loss.backward()
            assert weight.grad is not None and torch.linalg.vector_norm(weight.grad) < 1000  # no explosion by itself
            if step in poison:
                weight.grad[0, 0] = poison[step]
            opt.step()
            model.zero_grad(set_to_none=True)
            taken += 1
        return taken

    model, reg = make_model(), CollectorRegistry()
    with pytest.raises(hookpolicy.Halt) as halted:
        with policies.attach(model, registry=reg, rank=0):
            run(model, {2: float("nan"), 3: float("inf"), 4: float("nan")}, 8)
    assert (halted.value.rule, halted.value.step) == ("global-grad-norm", 4)
    assert "(non-finite: 1)" in halted.value.message
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1

    model, reg = make_model(), CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        assert run(model, {s: float("nan") for s in range(9) if s % 3 != 2}, 9) == 9
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 0
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 0  # step 8 was clean


@pytest.mark.slow
def test_recover_heals_the_benchs_corrupted_shard_by_skips_alone(tmp_path: Path) -> None:
    """recover.yaml's header: "8 bad batches in a row (bench/instability.py's shard) have their 5th
    applied and no rung acts". The bench's script under `hookpolicy apply` (300 steps, batches 80-87 of
    every 100 scrambled): the steps it saw not applied (its own per-step report) are the skips of the
    header's rule computed by the test from the losses the script printed (`guard_skips`, no rung), they
    are each shard's batches but its 5th (84, 184, 284), and no cool-down or rewind alert fired."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HOOKPOLICY_ALERT_LOG": str(tmp_path / "alerts.jsonl")}
    done = subprocess.run([sys.executable, "-m", "hookpolicy", "apply", str(POLICIES / "recover.yaml"), "--",
                           sys.executable, str(REPO / "bench" / "instability.py"), "train", "--corrupt", "epoch",
                           "--steps", "300"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
    assert len(steps) == 300
    skipped = {s["step"] for s in steps if not s["updated"]}
    assert skipped == guard_skips([s["loss"] for s in steps], 4)
    assert skipped == {s["step"] for s in steps if s["corrupt"]} - {84, 184, 284}
    assert {a["then"] for a in alert_records(tmp_path / "alerts.jsonl")} == {"skip_step"}


def test_recover_takes_a_nan_loss_for_a_spike_up_its_ladder(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recover.yaml: a loss that is "not finite" is a spike, from the first step on (before any
    history), and climbs the ladder like any other: the script backpropagates `loss + nan` (the
    gradients stay finite, so only the loss tells) at step 0, at step 5, and at the twelve steps 62-73
    (a loss that is not finite is never applied: no bound); the cool-down from the 9th (70); a rewind
    at 73 goes back to the test's own copy taken after step 49 (the newest snapshot at least 15 steps
    older) and the counts in a row start again, so the NaN losses of 74 and 75 are single skips. Each step's alert records (rung, severity, outcome: at the rewind's step the cool-down's
    says it was not applied, the rewind took the step), the lr the optimizer's own pre-hook sees
    and the parameters and AdamW state are checked against the ladder the test climbs itself."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    lr = 1e-2
    opt, used = lr_seen(torch.optim.AdamW(model.parameters(), lr=lr))
    idx, targets = batch(0)
    nan = {0, 5, *range(62, 62 + REWIND), 74, 75}
    applied: list[float] = []
    streak, cool_until = 0, 0
    expected: list[tuple[int, str, str, str]] = []  # (step, then, severity, outcome) of each alert record
    copy_49: dict[str, Any] = {}
    reg = CollectorRegistry()
    with load("recover.yaml").attach(model, registry=reg, rank=0):
        for step in range(80):
            loss = model(idx, targets)[1]
            assert loss is not None
            (loss + float("nan") if step in nan else loss).backward()
            params, state = snapshot(model), opt_state(opt)
            spike = step in nan or _loss_spike(loss.item(), applied)
            assert spike == (step in nan), step  # the clean steps of a batch learned by heart hold no spike
            streak = streak + 1 if spike else 0
            rewind = streak >= REWIND
            if spike:
                expected.append((step, "skip_step", "warning", "step skipped"))
            if streak >= COOL:
                # at a rewind's step the cool-down's alert fires too, and the rewind takes the step
                expected.append((step, "cool_down", "warning", "cooling down" if not rewind else
                                 "not cooled down (a rewind by recover/recover took the step)"))
                if not rewind:
                    cool_until = max(cool_until, step + 100)
            if rewind:
                expected.append((step, "rewind", "critical", "rewinding"))
            opt.step()
            assert used[-1] == (lr * 0.1 if step < cool_until else lr), step
            seen = {k: stat(reg, f"hookpolicy_loss_{k}", "recover", "recover") for k in ("mean", "max", "nonfinite")}
            assert seen["nonfinite"] == (step in nan), step
            assert math.isnan(seen["mean"]) if step in nan else seen["mean"] == seen["max"] == pytest.approx(loss.item())
            if step == 49:
                copy_49 = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
            if rewind:
                streak = 0
                assert all(torch.equal(p, copy_49["model"][n]) for n, p in model.state_dict().items()), step
                assert same_state(opt_state(opt), list(copy_49["opt"]["state"].values())), step
            elif spike:
                assert same_tensors(params, snapshot(model)) and same_state(state, opt_state(opt)), step
            else:
                applied.append(loss.item())
            opt.zero_grad(set_to_none=True)
    alerts = alert_records(tmp_path / "alerts.jsonl")
    assert [(a["step"], a["then"], a["severity"], a["outcome"]) for a in alerts] == expected
    assert all(a["stats"]["nonfinite"] == 1 for a in alerts)
    labels = {"policy": "recover", "rule": "recover"}
    for severity in ("warning", "critical"):
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity=severity) == sum(
            e[2] == severity for e in expected)
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels, model="GPT") == len(nan)
    assert counter(reg, "hookpolicy_rewinds_total", **labels, model="GPT") == 1


def test_recover_says_what_its_snapshots_hold(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """recover.yaml: "Each snapshot holds the parameters and buffers plus the optimizer state (AdamW:
    3x the parameters in all), in host memory; explain and the attach line print the size." The
    sizes against the test's own sums of nbytes: explain on the charlm example, the attach line and
    the first snapshot's line (after step 49, AdamW's moments in it) on the GPT."""
    import logging

    import examples.charlm
    from click.testing import CliRunner
    from hookpolicy.cli import cli

    def size(n: int) -> str:
        return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"

    def own(model: nn.Module) -> int:  # parameters and buffers, a tied weight once
        return sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())

    charlm = own(examples.charlm.build_model())
    explained = CliRunner().invoke(cli, ["explain", str(POLICIES / "recover.yaml"), "--model",
                                         "examples.charlm:build_model"], prog_name="hookpolicy")
    assert explained.exit_code == 0, explained.output
    assert (f"snapshots for then: rewind after every 50 steps, at most 2 in host memory, each {size(charlm)} of "
            f"parameters and buffers plus the optimizer state (Adam: 2 x {size(charlm)} more): "
            f"{size(2 * 3 * charlm)} with Adam") in explained.output
    assert "(spec.limits.maxSnapshotBytes, by default a quarter of the host memory available)" in explained.output

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, "hookpolicy"), load("recover.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(50):
            train_step(model, opt, step)
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    params = own(model)
    assert 3 * params <= params + state <= 3 * params + 4 * len(list(model.parameters()))  # + AdamW's step counts
    said = [r.getMessage() for r in caplog.records]
    assert f"GPT: snapshots for then: rewind after every 50 steps, at most 2 in host memory, each {size(params)} " \
           f"of parameters and buffers plus the optimizer state (Adam: 2 x {size(params)} more): " \
           f"{size(2 * 3 * params)} with Adam; budget " in " ".join(said)  # then the budget (maxSnapshotBytes)
    assert f"GPT: first snapshot for then: rewind after step 49: {size(params + state)} (x 2 kept at most); " \
           "0 LR schedulers, 0 GradScalers with it" in said


def test_loss_spike_recorder_dumps_the_100_steps_before_each_skipped_spike(workdir: Path) -> None:
    """loss-spike-recorder.yaml with loss-spike-guard.yaml, against its header: a dump per step the guard's
    reference skips (and none other), named as the header says, holding that step and the 100 before it, each
    Linear, Embedding and LayerNorm module's gradient (its own parameters together) read by the test itself:
    vector_norm, the largest absolute value, the count of NaN/Inf; nothing exported; a ring of at most 200
    steps of every such module."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    spikes = {120, 121, 135}
    seen: set[int] = set()
    watched = []  # a parameter two modules share (lm_head's weight is wte's) counts once, under the first
    for n, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)) and own:
            watched.append((n, own))
    grads: dict[int, dict[str, torch.Tensor]] = {}
    applied: list[float] = []
    skipped: list[int] = []
    reg = CollectorRegistry()
    policies = hookpolicy.load([POLICIES / "loss-spike-guard.yaml", POLICIES / "loss-spike-recorder.yaml"])
    with policies.attach(model, registry=reg, rank=0) as attached:
        for step in range(140):
            _, loss = model(idx, scrambled if step in spikes else targets)
            assert loss is not None
            loss.backward()
            grads[step] = {n: torch.cat([p.grad.reshape(-1) for p in own])  # type: ignore[union-attr]
                           for n, own in watched}
            if _loss_spike(loss.item(), applied):
                skipped.append(step)
            else:
                applied.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert not [s for m in reg.collect() for s in m.samples if s.name.startswith("hookpolicy_grad_")]
        ring = attached.recorder.rings[(("loss-spike-recorder", "layers"), 0)]
        assert len(ring.steps) == 140 and ring.keep.steps == 200
        assert ring.steps[-1].groups == [(n, "") for n, _ in watched]
    assert skipped == sorted(spikes)
    files = sorted((workdir / "dumps").iterdir())
    assert [f.name for f in files] == [f"loss-spike-recorder-layers.step{s:08d}.rank0.jsonl" for s in skipped]
    for file, spike in zip(files, skipped):
        lines = [json.loads(line) for line in file.read_text().splitlines()]
        assert lines[0]["event"] == "dump" and lines[0]["alerts"] == ["loss-spike-guard/loss-spike"]
        assert lines[1]["event"] == "alert" and lines[1]["outcome"] == "step skipped" and lines[1]["step"] == spike
        records = lines[2:]
        assert [(r["step"], r["module"]) for r in records] == [
            (s, n) for s in range(spike - 100, spike + 1) for n, _ in watched]
        for r in records:
            g = grads[r["step"]][r["module"]].double()
            assert r["stats"]["l2_norm"] == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-5)
            assert r["stats"]["abs_max"] == pytest.approx(g.abs().max().item(), rel=1e-6)
            assert r["stats"]["nonfinite"] == 0 == int((~torch.isfinite(g)).sum())


def test_loss_spike_recorder_alone_keeps_its_ring_dumps_nothing_and_explain_says_why(workdir: Path) -> None:
    from hookpolicy.engine.decide.recorder import bounds

    model = make_model()
    policies = load("loss-spike-recorder.yaml")
    assert policies.policies[0].max_dumps == 20
    notes, warnings = bounds(policies.policies, policies.plan(model).bindings)
    modules = sum(isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)) for m in model.modules()) - 1  # lm_head: tied
    assert any(f"200 steps x {modules} groups (per: module) x 3 stats x 8 bytes + 8 bytes per group name = "
               f"{200 * modules * 3 * 8 + modules * 8} bytes" in n for n in notes)
    assert any("names loss-spike-guard/loss-spike, a rule none of the policies given has" in w for w in warnings)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with policies.attach(model, rank=0):
        for step in range(5):
            train_step(model, opt, step)
    assert not (workdir / "dumps").exists()
