"""`target: loss`: the tensor a script backpropagates into the model, one value per backward root, per step.

Each test computes the value the script backpropagated itself (read with `.item()` in
the test, never in a hook) and compares it with what hookpolicy captured at each step,
whatever the script did after its criterion: a division, a regulariser, a NaN
multiplied in, a closure returning something else, GradScaler's scaling. A step whose
NaN any backward root carries is skipped: parameters bit for bit those of an unguarded
run that does not take it. A script whose loss has no backward root gets one
`hookpolicy:` line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.utils.checkpoint import checkpoint

import hookpolicy
from helpers import REPO
from helpers.hooks import no_host_sync
from helpers.models import batch, make_model
from helpers.outputs import alert_lines, json_lines, metric
from helpers.policies import load_policy, policy_text, refusal
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
GUARD = CAPTURE + """
        - alert: {if: "nonfinite > 0", then: skip_step}
"""


def captured(out: Path) -> list[dict[str, Any]]:
    """The per-step statistics the capture logged, in step order."""
    return [r["stats"] | {"step": r["step"], "module": r["module"], "target": r["target"]}
            for r in json_lines(out / "loss.jsonl")]


def classifier(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def data(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def check(out: Path, roots: list[list[float]]) -> None:
    """Per step: numel, mean, max, min and mean * numel (the loss whose gradient is applied) = the script's roots."""
    got = captured(out)
    assert [r["step"] for r in got] == list(range(len(roots)))
    for record, values in zip(got, roots):
        assert record["numel"] == len(values) and record["nonfinite"] == 0
        assert record["mean"] == pytest.approx(sum(values) / len(values), rel=1e-6)
        assert record["mean"] * record["numel"] == pytest.approx(sum(values), rel=1e-6)
        assert record["max"] == pytest.approx(max(values), rel=1e-6)
        assert record["min"] == pytest.approx(min(values), rel=1e-6)
        assert record["module"] == "" and record["target"] == "loss"


#: how a script backpropagates `loss`: (backward it, the value it backpropagated)
BACKWARDS: dict[str, Callable[[torch.Tensor], float]] = {
    "tensor.backward": lambda loss: (loss.backward(), loss.item())[1],
    "autograd.backward": lambda loss: (torch.autograd.backward(loss), loss.item())[1],
    "autograd.backward-list": lambda loss: (torch.autograd.backward([loss]), loss.item())[1],
    "with-gradient": lambda loss: (loss.backward(torch.tensor(3.0)), 3 * loss.item())[1],
    "non-scalar-root": lambda loss: (
        torch.stack([loss, loss]).backward(torch.tensor([1.0, 0.5])), 1.5 * loss.item())[1],
}


@pytest.mark.parametrize("how", BACKWARDS)
def test_each_backward_root_is_a_value_of_its_step(tmp_path: Path, out: Path, how: str) -> None:
    """Three steps of four micro-batches, `(loss / 4)` backpropagated: each root is one value of its step.

    The optimizer applies the gradient of the roots' sum: `mean * numel`, the average
    micro-batch loss here. A gradient passed to backward makes the root's value the
    scalar whose gradient that call backpropagates, `(root * gradient).sum()`.
    """
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    roots: list[list[float]] = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            roots.append([])
            for micro in range(4):
                roots[-1].append(BACKWARDS[how](criterion(model(data(step, micro)[0]), data(step, micro)[1]) / 4))
            opt.step()
            opt.zero_grad()
    check(out, roots)


def test_the_tiny_gpt_returning_logits_and_loss(tmp_path: Path, out: Path) -> None:
    """nanoGPT's `(logits, loss)`, backpropagated as is; metrics are hookpolicy_loss_<stat>."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    registry = CollectorRegistry()
    seen = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=registry):
        for step in range(4):
            _, loss = model(*batch(step))
            seen.append([loss.item()])
            loss.backward()
            opt.step()
            opt.zero_grad()
        last = metric(registry, "hookpolicy_loss_mean", {"policy": "p", "rule": "loss", "model": "GPT"})
    check(out, seen)
    assert last == pytest.approx(seen[-1][0], rel=1e-6)


class Scored(nn.Module):
    """A model returning what scripts often return: `(accuracy, loss)` or `(aux_loss, loss, logits)`."""

    def __init__(self, aux_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.aux_first = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)), aux_first

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        if self.aux_first:
            return logits.pow(2).mean(), loss, logits
        return (logits.argmax(-1) == y).float().mean(), loss


@pytest.mark.parametrize("aux_first", [False, True], ids=["accuracy-loss", "aux-loss-logits"])
def test_the_root_not_an_element_of_the_models_output(tmp_path: Path, out: Path, aux_first: bool) -> None:
    """The element a model returns first (an accuracy, an auxiliary loss) is not the loss: the root is."""
    model = Scored(aux_first)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            first, loss, *_ = model(*data(step))
            total = loss + 0.01 * first if aux_first else loss
            total.backward()
            roots.append([total.item()])
            opt.step()
            opt.zero_grad()
    check(out, roots)


def test_the_root_not_the_closure_return_value(tmp_path: Path, out: Path) -> None:
    """A closure returns the loss times 3 while it backpropagates the loss: the root is the step's loss."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                _, loss = model(*batch(step))
                loss.backward()
                roots.append([loss.item()])
                return loss * 3
            opt.step(closure)
    check(out, roots)


def test_micro_batches_outside_and_inside_the_closure_all_count(tmp_path: Path, out: Path) -> None:
    """As Lightning accumulates: micro-batch 1 backpropagated by the script, micro-batch 2 in the closure.

    Both roots are the step's: their sum is the loss whose gradient the optimizer applies.
    """
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            opt.zero_grad()
            _, first = model(*batch(2 * step))
            (first / 2).backward()

            inside: list[float] = []

            def closure() -> torch.Tensor:
                _, loss = model(*batch(2 * step + 1))
                (loss / 2).backward()
                inside.append(loss.item() / 2)
                return loss / 2
            opt.step(closure)
            roots.append([first.item() / 2, *inside])
    check(out, roots)


def test_lbfgs_gives_the_first_closure_call_of_a_step(tmp_path: Path, out: Path) -> None:
    """The step is evaluated after the first closure call: its root; the later calls' belong to no step."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = data(0)
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
            firsts.append([calls[0]])
    check(out, firsts)


@pytest.mark.parametrize("nan_at", ["input", "after-criterion", "regulariser"])
def test_a_nan_any_root_carries_skips_its_step(tmp_path: Path, nan_at: str) -> None:
    """A NaN in the root, however it got there, skips the step: parameters = an unguarded run without that step.

    `after-criterion`: the script multiplies its loss by NaN after the criterion (as
    examples/train_mlp.py --nan-at does); `regulariser`: a NaN weight-decay term added to
    the criterion's loss. The other micro-batch of the step is finite.
    """
    criterion = nn.CrossEntropyLoss()

    def train(model: nn.Module, take: Callable[[int], bool]) -> list[bool]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        changed = []
        for step in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            for micro in range(2):
                poisoned = (step, micro) == (2, 1)
                x, y = data(step, micro)
                if poisoned and nan_at == "input":
                    x = x * float("nan")
                loss = criterion(model(x), y)
                if poisoned and nan_at == "after-criterion":
                    loss = loss * float("nan")
                if poisoned and nan_at == "regulariser":
                    loss = loss + float("nan") * sum(p.pow(2).sum() for p in model.parameters())
                (loss / 2).backward()
            if take(step):
                opt.step()
            opt.zero_grad()
            changed.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        return changed

    model, registry = classifier(), CollectorRegistry()
    with load_policy(tmp_path, GUARD).attach(model, registry=registry):
        changed = train(model, lambda step: True)
    assert changed == [True, True, False, True]
    assert metric(registry, "hookpolicy_skipped_steps_total", {"rule": "loss"}) == 1
    unguarded = classifier()
    train(unguarded, lambda step: step != 2)
    for got, want in zip(model.parameters(), unguarded.parameters()):
        assert torch.equal(got, want)


def test_a_functional_loss_and_no_optimizer(tmp_path: Path, out: Path) -> None:
    """`F.mse_loss` in the script, a manual SGD update (no optimizer: a step per backward pass): the root is seen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            x = data(step)[0]
            loss = nn.functional.mse_loss(model(x), x[:, :1]) + 1e-3 * model[0].weight.pow(2).sum()
            loss.backward()
            roots.append([loss.item()])
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
                    p.grad = None
    check(out, roots)


def test_reentrant_checkpointing_backpropagates_inside_the_root_and_adds_no_root(tmp_path: Path, out: Path) -> None:
    """`checkpoint(use_reentrant=True)` calls torch.autograd.backward inside the backward pass: not a root."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(model, registry=CollectorRegistry()):
        for step in range(2):
            x, y = data(step)
            loss = criterion(checkpoint(model, x.requires_grad_(), use_reentrant=True), y)
            loss.backward()
            roots.append([loss.item()])
            opt.step()
            opt.zero_grad()
    check(out, roots)


def test_a_backward_that_does_not_reach_the_model_is_not_its_loss(tmp_path: Path, out: Path) -> None:
    """Two models, each backpropagated on its own (a discriminator on a detached output): each gets only its roots."""
    generator, discriminator = classifier(0), nn.Sequential(nn.Linear(3, 1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (generator, discriminator)]
    roots = []
    with load_policy(tmp_path, CAPTURE).attach(generator, registry=CollectorRegistry()):
        for step in range(3):
            fake = generator(data(step)[0])
            d_loss = discriminator(fake.detach()).pow(2).mean() * 7
            d_loss.backward()  # reaches the discriminator only
            opts[1].step()
            opts[1].zero_grad()
            g_loss = fake.pow(2).mean()
            g_loss.backward()
            roots.append([g_loss.item()])
            opts[0].step()
            opts[0].zero_grad()
    check(out, roots)


def test_gradients_from_autograd_grad_are_said_once_and_evaluate_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """`torch.autograd.grad` assigned to `.grad`: no backward root, one line, no statistic, no halt."""
    rules = CAPTURE + """
        - alert: {if: "mean > -1", then: halt}
    """
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), \
            load_policy(tmp_path, rules).attach(model, registry=CollectorRegistry()) as attached:
        for step in range(3):
            loss = nn.functional.cross_entropy(model(data(step)[0]), data(step)[1])
            for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
                p.grad = g
            opt.step()  # the halt would raise here had the rule evaluated anything
            opt.zero_grad()
        assert "hookpolicy_loss_mean" not in attached.last_values()
    said = [r.getMessage() for r in caplog.records if "no loss seen" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("p/loss: no loss seen at step 0 of Sequential: no backward pass reached its parameters")
    assert "torch.autograd.grad" in said[0]


def test_no_host_sync_and_nothing_left_behind(tmp_path: Path) -> None:
    """The wrapped backward and GradScaler.scale only detach; both are torch's own again after remove()."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    backward, scale = torch.autograd.backward, GradScaler.__dict__["scale"]
    scaler = GradScaler("cpu")
    policy = load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", ""))
    with policy.attach(model, registry=registry) as attached:
        for step in range(2):
            with no_host_sync():
                loss = criterion(model(data(step)[0]), data(step)[1])
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert torch.autograd.backward is not backward
        assert metric(registry, "hookpolicy_hook_errors_total", {"rule": "loss"}) == 0
        assert attached.last_values()["hookpolicy_loss_numel"][("p", "loss", "", "")] == 1
        assert attached.last_values()["hookpolicy_loss_mean"][("p", "loss", "", "")] == pytest.approx(loss.item())
    assert torch.autograd.backward is backward and GradScaler.__dict__["scale"] is scale


def test_a_loss_rule_not_active_keeps_nothing(tmp_path: Path) -> None:
    """`every: 2`: odd steps keep no root (the statistic of step 2 has its own one root)."""
    model, criterion = classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = load_policy(tmp_path, CAPTURE.replace("at: step}", "at: step, every: 2}"))
    with policy.attach(model, registry=CollectorRegistry()) as attached:
        for step in range(3):
            criterion(model(data(step)[0]), data(step)[1]).backward()
            opt.step()
            opt.zero_grad()
        numel = attached.last_values()["hookpolicy_loss_numel"][("p", "loss", "", "")]
    assert numel == 1


def test_two_governed_models_get_their_own_roots(tmp_path: Path) -> None:
    """Two models, one criterion, each backpropagated on its own: each model's loss is its own root."""
    policy = load_policy(tmp_path, CAPTURE.replace(", log: {path: loss.jsonl}", ""))
    first, second, criterion = classifier(0), classifier(1), nn.CrossEntropyLoss()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    roots: list[list[list[float]]] = [[], []]
    with policy.attach(first, registry=CollectorRegistry()) as a, \
            policy.attach(second, registry=CollectorRegistry()) as b:
        for step in range(2):
            for k, (model, opt) in enumerate(zip((first, second), optimizers)):
                loss = criterion(model(data(step, k)[0]), data(step, k)[1]) * (k + 1)
                loss.backward()
                roots[k].append([loss.item()])
                opt.step()
                opt.zero_grad()
        means = [x.last_values()["hookpolicy_loss_mean"][("p", "loss", "", "")] for x in (a, b)]
    assert means == pytest.approx([roots[0][-1][0], roots[1][-1][0]], rel=1e-6)


# -- the policy language --------------------------------------------------------------

@pytest.mark.parametrize("keys, message", [
    (["trigger: {at: forward}", "target: loss"], "target 'loss' does not fit trigger.at 'forward'"),
    (["trigger: {at: step}", "target: loss", "select: [0]"], "select narrows a module's inputs and outputs"),
    (["trigger: {at: step, phase: eval}", "target: loss"], "only phase: train (the default) applies"),
    (["trigger: {at: step}", "target: loss", "actions: [{clip: {max_norm: 1}}]"], "clip cannot change target: loss"),
    (["trigger: {at: step}", "target: loss", "actions: [{scale: {factor: 0.5}}]"], "scale cannot change target: loss"),
    (["trigger: {at: step}", "target: grad", "ranks: own"], "ranks applies to target: loss"),
    (["trigger: {at: step}", "target: loss", "ranks: each"], "ranks"),
])
def test_a_loss_rule_that_cannot_work_is_refused_at_its_line(tmp_path: Path, keys: list[str], message: str) -> None:
    if not any(k.startswith("actions") for k in keys):
        keys = [*keys, "actions: [{capture: {stats: [mean]}}]"]
    rule = "- name: l\n  match: {root: true}\n" + "".join(f"  {k}\n" for k in keys)
    shown = refusal(tmp_path, rule)
    assert message in shown, shown


@pytest.mark.parametrize("match, binds", [
    ("{root: true}", True), ("{modules: ['**']}", True), ("{types: [Sequential]}", True),
    ("{types: [Linear]}", False), ("{modules: ['0']}", False),
])
def test_match_selects_the_model_at_its_root(tmp_path: Path, match: str, binds: bool) -> None:
    policy = load_policy(tmp_path, CAPTURE.replace("{root: true}", match))
    plan = policy.plan(classifier())
    assert [(b.module, b.hook, b.target) for b in plan.bindings] == ([("", "step", "loss")] if binds else [])
    if binds:
        assert plan.notes and "is the tensor the script calls backward() on" in plan.notes[0]
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
    messages = [a["message"] for a in alert_lines(capsys.readouterr().err)]
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


def test_a_compiled_model_under_autocast_and_grad_scaler(tmp_path: Path, out: Path) -> None:
    """torch.compile (no warning), bf16 autocast, GradScaler: the root is `scale * loss`, the value the loss itself."""
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
    check(out, [[v] for v in seen])


def test_a_compiled_training_step_that_backpropagates_inside(tmp_path: Path, out: Path) -> None:
    """`torch.compile` over the whole step, `loss.backward()` inside it (Dynamo hands backward to Python):
    the root is seen, and the NaN one (multiplied in after the criterion) skips its step."""
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def forward_backward(x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y) * factor
        loss.backward()
        return loss

    roots, changed = [], []
    with load_policy(tmp_path, GUARD).attach(model, registry=CollectorRegistry()):
        for step in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            loss = forward_backward(*data(step), torch.tensor(float("nan") if step == 2 else 2.0))
            roots.append(loss.item())
            opt.step()
            opt.zero_grad()
            changed.append(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    assert changed == [True, True, False, True]
    got = captured(out)
    assert [r["numel"] for r in got] == [1] * 4 and [r["nonfinite"] for r in got] == [0, 0, 1, 0]
    assert [r["mean"] for r in got[:2] + got[3:]] == pytest.approx(roots[:2] + roots[3:], rel=1e-6)


def test_the_loss_spike_guard_skips_a_nan_multiplied_after_the_criterion(apply: Callable[..., Any]) -> None:
    """The issue's run: `examples/train_mlp.py --nan-at 30` multiplies its loss by NaN after the criterion.

    Under `hookpolicy apply policies/loss-spike-guard.yaml` step 30 is skipped, once, and
    every later loss the script prints is finite (before, the NaN reached the weights and
    every later step was skipped).
    """
    run = apply(str(REPO / "policies" / "loss-spike-guard.yaml"), "--", sys.executable,
                str(REPO / "examples" / "train_mlp.py"), "--steps", "40", "--accum", "2", "--nan-at", "30")
    assert run.wait(180) == 0, run.stderr
    skipped = [a for a in alert_lines(run.stderr) if a["message"].endswith("step skipped")]
    assert [r["step"] for r in skipped] == [30], run.stderr
    printed = {int(line.split()[1]): float(line.split()[-1]) for line in run.stdout.splitlines()
               if line.startswith("step ") and " loss " in line and "validation" not in line}
    assert sorted(printed) == list(range(40))
    assert printed[30] != printed[30] and all(v == v for step, v in printed.items() if step != 30)
