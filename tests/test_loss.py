"""`target: loss`: the loss a script backpropagates, per micro-batch, reduced per step.

Each test computes the loss itself (the value the script backpropagated, read with
`.item()` in the test, never in a hook) and compares it with what hookpolicy captured
at each step: from a loss module, from the model's `(logits, loss)` output, from a
closure's return value. A script whose loss no source can see gets one `hookpolicy:` line.
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.hooks import global_hook_counts, module_hook_count, no_host_sync
from helpers.models import batch, make_model
from helpers.outputs import json_lines
from helpers.policies import load_policy, policy_text
from hookpolicy.engine import loss as loss_engine
from hookpolicy.errors import PolicyError

pytestmark = pytest.mark.usefixtures("out")  # the captures' logs go to a test's own folder

CAPTURE = """
    - name: loss
      match: {root: true}
      trigger: {at: step}
      target: loss
      actions:
        - capture: {stats: [mean, max, min, nonfinite, numel], log: {path: loss.jsonl}}
"""


def captured(out: Path) -> list[dict[str, Any]]:
    """The per-step statistics the capture logged, in step order."""
    return [r["stats"] | {"step": r["step"], "module": r["module"], "target": r["target"]}
            for r in json_lines(out / "loss.jsonl")]


def classifier(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(), nn.Sequential(nn.LogSoftmax(-1)), nn.NLLLoss()],
                         ids=["cross-entropy", "log-softmax-model", "nll"])
def test_a_loss_module_gives_each_micro_batch_and_the_step_mean(tmp_path: Path, out: Path, criterion: nn.Module) -> None:
    """Three steps of four accumulated micro-batches: mean, max, min and numel per step equal the script's own."""
    model = classifier()
    if isinstance(criterion, nn.Sequential):  # a model ending in LogSoftmax, NLLLoss as the criterion
        model, criterion = nn.Sequential(model, criterion), nn.NLLLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[float]] = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            seen.append([])
            for _ in range(4):
                x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
                loss = criterion(model(x), y)
                seen[-1].append(loss.item())
                (loss / 4).backward()
            opt.step()
            opt.zero_grad()
    got = captured(out)
    assert [r["step"] for r in got] == [0, 1, 2]
    for record, losses in zip(got, seen):
        assert record["numel"] == 4 and record["nonfinite"] == 0
        assert record["mean"] == pytest.approx(sum(losses) / 4, rel=1e-6)
        assert record["max"] == pytest.approx(max(losses), rel=1e-6)
        assert record["min"] == pytest.approx(min(losses), rel=1e-6)
        assert record["module"] == "" and record["target"] == "loss"


def test_the_tiny_gpt_returning_logits_and_loss(tmp_path: Path, out: Path) -> None:
    """nanoGPT's `(logits, loss)`: the model's own output is the source; metrics are hookpolicy_loss_<stat>."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    registry = CollectorRegistry()
    seen = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=registry):
        for step in range(4):
            idx, targets = batch(step)
            _, loss = model(idx, targets)
            seen.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        last = registry.get_sample_value("hookpolicy_loss_mean", {"policy": "p", "rule": "loss", "module": "",
                                                                 "tensor": "", "model": "GPT", "rank": "0"})
    assert [r["mean"] for r in captured(out)] == pytest.approx(seen, rel=1e-6)
    assert last == pytest.approx(seen[-1], rel=1e-6)


def test_a_closure_return_value_is_preferred(tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A closure returns the loss times 3 while the model returns the loss: the closure's value is the step's loss."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), \
            load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                _, loss = model(*batch(step))
                loss.backward()
                seen.append(3 * loss.item())
                return loss * 3
            opt.step(closure)
    assert [r["mean"] for r in captured(out)] == pytest.approx(seen, rel=1e-6)
    assert [r["numel"] for r in captured(out)] == [1, 1, 1]
    assert not caplog.records  # the closure zeroes the gradients: nothing was accumulated outside it


def test_a_closure_after_micro_batches_outside_step_is_said(
    tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """As Lightning accumulates: micro-batch 1 run by the script, micro-batch 2 in the closure, no zero_grad between.

    The step's loss is what the closure returned (micro-batch 2's) and one line says that
    the earlier micro-batches' losses are not in it.
    """
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), \
            load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            opt.zero_grad()
            _, first = model(*batch(2 * step))
            (first / 2).backward()

            def closure() -> torch.Tensor:
                _, loss = model(*batch(2 * step + 1))
                (loss / 2).backward()
                seen.append(loss.item() / 2)
                return loss / 2
            opt.step(closure)
    assert [r["mean"] for r in captured(out)] == pytest.approx(seen, rel=1e-6)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("GPT: the closure passed to optimizer.step() added its gradients")


def test_lbfgs_gives_the_first_closure_call_of_a_step(tmp_path: Path, out: Path) -> None:
    model = classifier()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    firsts = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for _ in range(2):
            calls: list[float] = []

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                calls.append(loss.item())
                return loss
            opt.step(closure)
            assert len(calls) > 1
            firsts.append(calls[0])
    assert [r["mean"] for r in captured(out)] == pytest.approx(firsts, rel=1e-6)


def test_a_criterion_made_anew_at_each_call_is_seen_at_every_step(tmp_path: Path, out: Path) -> None:
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for _ in range(4):
            loss = nn.CrossEntropyLoss()(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            seen.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert loss_engine._MODULES.watching_every_call  # such criteria are found only by watching every call
    assert [r["mean"] for r in captured(out)] == pytest.approx(seen, rel=1e-6)


def test_the_global_hook_lasts_one_step_and_nothing_stays(tmp_path: Path) -> None:
    """Every call watched only in the first active step; after it one hook on the criterion; nothing after remove()."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = global_hook_counts()
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        assert global_hook_counts()[3] == before[3] + 1
        for _ in range(2):
            criterion(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
            assert global_hook_counts()[3] == before[3]
            assert len(criterion._forward_hooks) == 1
    assert global_hook_counts() == before
    assert module_hook_count(criterion) == 0 and module_hook_count(model) == 0


def test_a_loss_rule_not_active_watches_nothing(tmp_path: Path) -> None:
    """`every: 2`: the criterion's hook is there on even steps only, and no statistic on odd ones."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = load_policy(tmp_path, CAPTURE.replace("at: step}", "at: step, every: 2}"))
    hooked = []
    with policy.attach(model, registry=CollectorRegistry()) as attached:
        for _ in range(4):
            criterion(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            hooked.append(len(criterion._forward_hooks))
            opt.step()
            opt.zero_grad()
        numel = attached.last_values()["hookpolicy_loss_numel"][("p", "loss", "", "")]
    assert hooked == [1, 0, 1, 0]  # step 0 watched through the global hook (it hooks the criterion), ...
    assert numel == 1


def test_alert_skips_the_step_with_a_nan_loss(tmp_path: Path) -> None:
    """`nonfinite > 0` on the loss skips the step: parameters bit-identical to before it."""
    rules = CAPTURE + """
        - alert: {if: "nonfinite > 0", then: skip_step, message: "loss {max} at step {step}"}
    """
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    changed = []
    registry = CollectorRegistry()
    with load_policy(tmp_path, rules).attach(model, registry=registry):
        for step in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            for micro in range(2):
                x = torch.randn(8, 4) * (float("nan") if (step, micro) == (2, 1) else 1.0)
                criterion(model(x), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
            changed.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    assert changed == [True, True, False, True]
    assert registry.get_sample_value("hookpolicy_skipped_steps_total", {"policy": "p", "rule": "loss", "model": "Sequential", "rank": "0"}) == 1


def test_a_functional_loss_is_said_once_and_evaluates_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    rules = CAPTURE + """
        - alert: {if: "mean > -1", then: halt}
    """
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), \
            load_policy(tmp_path, rules).attach(model, registry=CollectorRegistry()) as attached:
        for _ in range(3):
            nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()  # the halt would raise here had the rule evaluated anything
            opt.zero_grad()
        assert "hookpolicy_loss_mean" not in attached.last_values()
        assert not loss_engine._MODULES.watching_every_call  # a rule that sees nothing costs nothing after its line
    said = [r.getMessage() for r in caplog.records if "no loss seen" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("p/loss: no loss seen at step 0 of Sequential; looked for: an optimizer closure's")
    assert "nn.CrossEntropyLoss()(logits, y)" in said[0]


def test_no_host_sync_in_the_loss_hooks(tmp_path: Path) -> None:
    """The criterion's hook, the model-output and closure taps only detach: a sync inside one would raise."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    with load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", "")).attach(model, registry=registry) as attached:
        for step in range(2):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = criterion(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
                loss.backward()
                return loss

            with no_host_sync():
                closure()  # an accumulated micro-batch outside step(): the criterion's hook
                assert attached._cycle._loss is not None and attached._cycle._loss._sources[2]
            opt.step(closure)
        assert registry.get_sample_value("hookpolicy_hook_errors_total", {"policy": "p", "rule": "loss",
                                                                         "model": "Sequential", "rank": "0"}) == 0
        assert attached.last_values()["hookpolicy_loss_numel"][("p", "loss", "", "")] == 1  # the closure's


# -- the policy language --------------------------------------------------------------

@pytest.mark.parametrize("keys, message", [
    (["trigger: {at: forward}", "target: loss"], "target 'loss' does not fit trigger.at 'forward'"),
    (["trigger: {at: step}", "target: loss", "select: [0]"], "select narrows a module's inputs and outputs"),
    (["trigger: {at: step, phase: eval}", "target: loss"], "only phase: train (the default) applies"),
    (["trigger: {at: step}", "target: loss", "actions: [{clip: {max_norm: 1}}]"], "clip cannot change target: loss"),
    (["trigger: {at: step}", "target: loss", "actions: [{scale: {factor: 0.5}}]"], "scale cannot change target: loss"),
])
def test_a_loss_rule_that_cannot_work_is_refused_at_its_line(tmp_path: Path, keys: list[str], message: str) -> None:
    if not any(k.startswith("actions") for k in keys):
        keys = [*keys, "actions: [{capture: {stats: [mean]}}]"]
    rule = "- name: l\n  match: {root: true}\n" + "".join(f"  {k}\n" for k in keys)
    (tmp_path / "p.yaml").write_text(policy_text(rule))
    with pytest.raises(PolicyError) as caught:
        hookpolicy.load(tmp_path / "p.yaml")
    shown = str(caught.value)
    assert message in shown, shown
    assert shown.startswith(f"{tmp_path / 'p.yaml'}:")


@pytest.mark.parametrize("match, binds", [
    ("{root: true}", True), ("{modules: ['**']}", True), ("{types: [Sequential]}", True),
    ("{types: [Linear]}", False), ("{modules: ['0']}", False),
])
def test_match_selects_the_model_at_its_root(tmp_path: Path, match: str, binds: bool) -> None:
    policy = load_policy(tmp_path, CAPTURE.replace("{root: true}", match))
    plan = policy.plan(classifier())
    assert [(b.module, b.hook, b.target) for b in plan.bindings] == ([("", "step", "loss")] if binds else [])
    if binds:
        assert plan.notes and "looked for at each step in an optimizer closure's return value" in plan.notes[0]
    else:
        assert "target: loss is the loss of the whole model, so match must select its root" in plan.warnings[0]


def test_loss_names_the_step_mean_in_conditions_functions_and_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rules = """
        - name: l
          match: {root: true}
          trigger: {at: step}
          target: loss
          actions:
            - alert: {if: "loss > 0 and max(loss, 5) < 100", message: "loss={loss:.6f} max={max:.6f} prev={prev(loss):.6f}"}
    """
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    means, maxima = [], []
    with load_policy(tmp_path, rules).attach(model, registry=CollectorRegistry()):
        for _ in range(3):
            losses = []
            for _ in range(3):
                loss = criterion(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
                losses.append(loss.item())
                loss.backward()
            means.append(sum(losses) / 3)
            maxima.append(max(losses))
            opt.step()
            opt.zero_grad()
    messages = [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines() if '"event": "alert"' in line]
    # step 0 has no past loss: max(loss, 5) is NaN there and the condition false (ISSUE13 section 1)
    assert messages == [f"loss={m:.6f} max={x:.6f} prev={p:.6f}" for m, x, p in zip(means[1:], maxima[1:], means)]


def test_loss_is_no_name_outside_a_loss_rule(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(policy_text("""
        - name: g
          match: {root: true}
          trigger: {at: step}
          actions: [{alert: {if: "loss > 3"}}]
    """))
    with pytest.raises(PolicyError) as caught:
        hookpolicy.load(tmp_path / "p.yaml")
    assert "p.yaml:11:31: $.spec.rules[0].actions[0].alert.if: invalid condition: unknown statistic 'loss'" in str(
        caught.value)


def test_criteria_built_per_call_leave_nothing_behind(tmp_path: Path) -> None:
    """Each collected criterion lets go of its hook: module_hooks holds no id of a dead module's hook."""
    from hookpolicy.engine import module_hooks

    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", "")).attach(model, registry=CollectorRegistry()):
        held = []
        for _ in range(6):
            nn.CrossEntropyLoss()(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
            gc.collect()  # a criterion is freed by the cyclic collector: count after it ran, not when it happens to
            held.append(len(module_hooks._ours))
    assert held[-1] == held[1]  # not one more per step
    assert not module_hooks._ours


def test_no_host_sync_when_the_model_returns_its_loss(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    registry = CollectorRegistry()
    with load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", "")).attach(model, registry=registry) as attached:
        for step in range(2):
            with no_host_sync():
                _, loss = model(*batch(step))  # the root's forward hook takes the loss from (logits, loss)
                loss.backward()
            opt.step()
            opt.zero_grad()
        assert registry.get_sample_value("hookpolicy_hook_errors_total", {"policy": "p", "rule": "loss",
                                                                         "model": "GPT", "rank": "0"}) == 0
        assert attached.last_values()["hookpolicy_loss_numel"][("p", "loss", "", "")] == 1


def test_a_compiled_model_under_autocast_and_grad_scaler(tmp_path: Path, out: Path) -> None:
    """torch.compile (no warning about the global hook of the first step), bf16 autocast, GradScaler: the unscaled loss."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    seen = []
    with pytest.warns() as caught, load_policy(tmp_path, CAPTURE).attach(compiled, registry=CollectorRegistry()):
        import warnings
        warnings.warn("the test's own, so that pytest.warns has one", UserWarning)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(compiled(torch.randn(8, 4)).float(), torch.randint(0, 3, (8,)))
            seen.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert [str(w.message) for w in caught] == ["the test's own, so that pytest.warns has one"]
    assert [r["mean"] for r in captured(out)] == pytest.approx(seen, rel=1e-6)


def test_a_loss_module_shared_by_two_governed_models_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A GAN-like pair: one criterion, two models with a loss rule; its value goes to both, and one line says so."""
    loss_engine._MODULES._said_shared = False
    policy = load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", ""))
    first, second, criterion = classifier(0), classifier(1), nn.CrossEntropyLoss()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), \
            policy.attach(first, registry=registry), policy.attach(second, registry=registry):
        for _ in range(2):
            for model, opt in zip((first, second), optimizers):
                criterion(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
                opt.step()
                opt.zero_grad()
    said = [r.getMessage() for r in caplog.records if "cannot tell whose loss it is" in r.getMessage()]
    assert said == ["a CrossEntropyLoss's loss goes to every governed model with a loss rule active (Sequential, "
                    "Sequential#2): hookpolicy cannot tell whose loss it is; return each model's loss from its "
                    "forward to keep them apart"]
