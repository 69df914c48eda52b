"""A rewind or a cool-down after the run moved on: the script changed its model, optimizer or scheduler.

A snapshot records what it holds (each tensor's module path and name, shape, dtype; each
optimizer's class and parameter groups; the schedulers); a restore writes back only what
still matches, and refuses the rest out loud. The reference for every case is the same
script run without hookpolicy, doing by hand what the case must come to: the step not
applied (a refused rewind skips instead), the model's `state_dict()` deep-copied by the
test at the snapshot step and loaded back (`nn.Module.load_state_dict`, which matches by
name), the optimizer's too where it still matches (`Optimizer.load_state_dict`), the lr
multiplied around `optimizer.step()` for a cool-down, `scaler.unscale_` before a clip or a
skipped step as `GradScaler.step` does. Every comparison is bit for bit (a clip's to the last bit).

`test_the_run_moved_on_matrix` crosses each change (a layer inserted, reshaped or removed; a dtype
move; the optimizer made again, of the same class or another; a group added; a scheduler made later;
a GradScaler enabled mid-run, disabled, or on "cpu") with each action (skip, clip, the loss tap, an
`update` target, a cool-down). A device move is not tested: this machine has no GPU. A reload in the
middle of the ladder is tests/test_reload_healing.py's.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from helpers.outputs import metric
from helpers.policies import load_policy

STEPS = 10
SNAP = 5  # snapshots every 2 steps: taken after steps 1, 3, 5; the rewind at REWIND goes back to the one after 5
CHANGE = 6
REWIND = 7


def build() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


#: change(model, optimizer) -> the optimizer from then on; the model is changed in place
Change = Callable[[nn.Sequential, torch.optim.Optimizer], torch.optim.Optimizer]
#: a GradScaler the script steps through: (the step it is made at, how)
Scaler = tuple[int, Callable[[], torch.amp.GradScaler]]


def inserted(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A layer inserted (the names under model.2 move), the optimizer made again for the new parameters."""
    torch.manual_seed(9)
    model[2] = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return sgd(model)


def reshaped(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Two layers of other shapes under the same names."""
    torch.manual_seed(9)
    model[2] = nn.Linear(8, 16)
    model[4] = nn.Linear(16, 2)
    return sgd(model)


def removed(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    model[2] = nn.Identity()
    return sgd(model)


def to_double(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    model.double()
    return sgd(model)


def adam(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer made again, of another class: SGD with momentum, then Adam."""
    return torch.optim.Adam(model.parameters(), lr=0.01)


def same_again(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer made again, of the same class, over the same parameters."""
    return sgd(model)


def grouped(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A parameter group added: the head's bias moves into a group of its own."""
    head = model[4].bias
    fresh = torch.optim.SGD([p for n, p in model.named_parameters() if n != "4.bias"], lr=0.05, momentum=0.9)
    fresh.add_param_group({"params": [head], "lr": 0.01})
    return fresh


def replaced_head(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new head of the same shape (a re-initialised classifier): the same names, other tensors; the optimizer
    keeps stepping the old head's parameters (the script did not tell it)."""
    torch.manual_seed(9)
    model[4] = nn.Linear(8, 2)
    return optimizer


def script(change: Optional[Change], *, by_hand: Optional[Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]],
                                                                  None]] = None,
           lr_factor: Callable[[int], float] = lambda i: 1.0, model: Optional[nn.Sequential] = None,
           clip: Optional[float] = None, seen: Optional[Callable[[int, float], None]] = None,
           scaler: Optional[Scaler] = None) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """The training script; `by_hand` replaces `optimizer.step()` at REWIND (the test's reference).

    With `scaler` (made at its step), the script is torch's AMP recipe: `scaler.scale(loss).backward()`,
    `scaler.unscale_` before a clip, `scaler.step(optimizer)`, `scaler.update()`."""
    model = build() if model is None else model
    optimizer = sgd(model)
    saved: dict[str, Any] = {}
    amp: Optional[torch.amp.GradScaler] = None
    for i, (x, y) in enumerate(data()):
        if change is not None and i == CHANGE:
            optimizer = change(model, optimizer)
        if scaler is not None and i == scaler[0]:
            amp = scaler[1]()
        x, y = x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if amp is None:
            loss.backward()
        else:
            amp.scale(loss).backward()
        if seen is not None:
            seen(i, float(loss.detach()))
        if clip is not None:
            if amp is not None:
                amp.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        kept = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * lr_factor(i)
        if by_hand is not None and i == REWIND:
            if amp is not None and clip is None:
                amp.unscale_(optimizer)  # what scaler.step does before it calls optimizer.step()
            by_hand(model, optimizer, saved)
        elif amp is not None:
            amp.step(optimizer)
        else:
            optimizer.step()
        if amp is not None:
            amp.update()
        for g, lr in zip(optimizer.param_groups, kept):
            g["lr"] = lr
        if i == SNAP:
            saved["model"] = copy.deepcopy(model.state_dict())
            saved["optimizer"] = copy.deepcopy(optimizer.state_dict())
    return model, optimizer


def skipped(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A refused rewind: the step is skipped instead."""


def model_back(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    model.load_state_dict(saved["model"])


def both_back(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])


REWINDS = f"""
- name: heal
  match: {{modules: ["**"]}}
  trigger: {{at: step, steps: {{from: {REWIND}, until: {REWIND + 1}}}}}
  target: grad
  actions: [{{alert: {{if: "l2_norm >= 0", per: rule, then: rewind, rewind: {{back: 1, max_rewinds: 3}}}}}}]
"""

#: (the change, what the rewind must come to, words the warning must hold)
CASES: list[tuple[Change, Callable[..., None], list[str]]] = [
    (inserted, skipped, ["2.weight", "2.0.weight"]),
    (reshaped, skipped, ["2.weight is 16x8 now, 8x8 in the snapshot"]),
    (removed, skipped, ["2.weight"]),
    (to_double, skipped, ["float64"]),
    (adam, model_back, ["Adam", "SGD", "not restored"]),
    (same_again, both_back, []),
    (grouped, model_back, ["group", "not restored"]),
    (replaced_head, model_back, ["not restored"]),
]


@pytest.mark.parametrize("change,reference,words", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_rewind_after_the_run_moved_on_restores_what_matches_and_refuses_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: Change, reference: Callable[..., None],
    words: list[str],
) -> None:
    pol = load_policy(tmp_path, REWINDS, spec="snapshots: {every: 2, keep: 2}\n")
    model = build()
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with pol.attach(model, registry=registry):
            model, _ = script(change, model=model)
    expected, _ = script(change, by_hand=reference)
    for (name, p), q in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(p, q), name
    said = " ".join(r.getMessage() for r in caplog.records)
    for word in words:
        assert word in said, (word, said)
    errors = metric(registry, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "heal"})
    assert not errors
    if reference is skipped:
        assert metric(registry, "hookpolicy_skipped_steps_total", {"policy": "p", "rule": "heal"}) == 1
        assert not metric(registry, "hookpolicy_rewinds_total", {"policy": "p", "rule": "heal"})


COOLS = """
- name: cool
  match: {modules: ["**"]}
  trigger: {at: step, steps: {from: 3, until: 4}}
  target: grad
  actions: [{alert: {if: "l2_norm >= 0", per: rule, then: cool_down, cool_down: {factor: 0.1, steps: 6}}}]
"""


@pytest.mark.parametrize("change", [adam, same_again, grouped, inserted], ids=lambda c: c.__name__)
def test_a_cool_down_follows_the_optimizer_the_script_made_again(tmp_path: Path, change: Change) -> None:
    """The cool-down (steps 3..8) lowers the lr of whichever optimizer steps the model, the new one too."""
    pol = load_policy(tmp_path, COOLS)
    model = build()
    with pol.attach(model, registry=CollectorRegistry()):
        model, optimizer = script(change, model=model)
    expected, expected_optimizer = script(change, lr_factor=lambda i: 0.1 if 3 <= i <= 8 else 1.0)
    for (name, p), q in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(p, q), name
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in expected_optimizer.param_groups]


def test_a_cool_down_survives_a_step_that_raised_before_its_post_hook(tmp_path: Path) -> None:
    """A step pre-hook of the script's raised at step 4 (caught by the script): torch ran no post-hook, so the
    lr the cool-down lowered was not put back then; the next steps are still cooled, by the factor once. A step
    that raised before its update is no step: the 6 steps of the cool-down are the updates at 3 and 5..9."""
    def run(attach: bool) -> nn.Module:
        model = build()
        optimizer = sgd(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))

        def refuse(opt: Any, args: Any, kwargs: Any) -> None:
            if state["i"] == 4:
                raise ValueError("the script's own pre-hook refused this step")

        state = {"i": 0}
        optimizer.register_step_pre_hook(refuse)
        context = load_policy(tmp_path, COOLS).attach(model, registry=CollectorRegistry()) if attach else None
        for i, (x, y) in enumerate(data()):
            state["i"] = i
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            kept = [g["lr"] for g in optimizer.param_groups]
            if not attach:
                for g in optimizer.param_groups:
                    g["lr"] = g["lr"] * (0.1 if 3 <= i <= 9 else 1.0)
            try:
                optimizer.step()
            except ValueError:
                pass
            if not attach:
                for g, lr in zip(optimizer.param_groups, kept):
                    g["lr"] = lr
            scheduler.step()
        if context is not None:
            context.remove()
        return model

    got, expected = run(True), run(False)
    for (name, p), q in zip(got.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(p, q), name


def scheduler_replaced(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A scheduler made after the start (its first lr is the optimizer's as it finds it): the lr itself is kept."""
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return optimizer


#: what acts: the rules, and how the script does the same by hand (keyword arguments of `script`)
ACTS: dict[str, tuple[str, dict[str, Any]]] = {
    "skip": (f"""
- name: act
  match: {{modules: ["**"]}}
  trigger: {{at: step, steps: {{from: {REWIND}, until: {REWIND + 1}}}}}
  target: grad
  actions: [{{alert: {{if: "l2_norm >= 0", per: rule, then: skip_step}}}}]
""", {"by_hand": skipped}),
    "clip": ("""
- name: act
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions: [{clip: {max_norm: 0.05, per: rule}}]
""", {"clip": 0.05}),
    "loss": ("""
- name: act
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions: [{capture: {stats: [mean]}}]
""", {}),
    "update": ("""
- name: act
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions: [{capture: {stats: [l2_norm]}}]
""", {}),
    # in force over steps 3..8, across the change at step 6
    "cool_down": (COOLS.replace("name: cool", "name: act"), {"lr_factor": lambda i: 0.1 if 3 <= i <= 8 else 1.0}),
}

#: what changes at step CHANGE (or from the start, for a scaler): the script's change of its model or optimizer,
#: and the GradScaler it steps through. Only torch.amp.GradScaler("cpu") scales on this CPU-only machine (its
#: __init__ disables a "cuda" one without CUDA), so "enabled" is a cpu scaler the script starts using mid-run,
#: with a scale that doubles every step; "cpu" is one with torch's defaults from the start.
CHANGES: dict[str, tuple[Optional[Change], Optional[Scaler]]] = {
    "unchanged": (None, None),
    "inserted": (inserted, None),
    "reshaped": (reshaped, None),
    "removed": (removed, None),
    "to_double": (to_double, None),
    "adam": (adam, None),
    "same_again": (same_again, None),
    "grouped": (grouped, None),
    "scheduler_replaced": (scheduler_replaced, None),
    "scaler_enabled": (None, (CHANGE, lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1))),
    "scaler_disabled": (None, (0, lambda: torch.amp.GradScaler(enabled=False))),
    "scaler_cpu": (None, (0, lambda: torch.amp.GradScaler("cpu"))),
}


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("moved", sorted(CHANGES))
def test_the_run_moved_on_matrix(tmp_path: Path, caplog: pytest.LogCaptureFixture, act: str, moved: str) -> None:
    """Each action after each change: the weights equal the script doing the same by hand, nothing raised, no
    fault counted, at most one `hookpolicy:` warning; the loss tap's value is the script's own loss (divided by
    the scaler's scale by hookpolicy, not by the test).

    Rewinds after each change: test_a_rewind_after_the_run_moved_on_restores_what_matches_and_refuses_the_rest.
    A reload in the middle of the ladder (cool-down, snapshots, max_rewinds): tests/test_reload_healing.py.
    A device move is not tested: this machine has no GPU (a dtype move, to_double, is)."""
    rules, by_hand = ACTS[act]
    change, scaler = CHANGES[moved]
    pol = load_policy(tmp_path, rules)
    model = build()
    registry = CollectorRegistry()
    published: list[float] = []
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with pol.attach(model, registry=registry) as attached:
            def after(i: int, loss: float) -> None:
                published.append(loss)

            model, optimizer = script(change, model=model, seen=after, scaler=scaler)
            values = attached.last_values()
            errors = metric(registry, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "act"})
    expected, expected_optimizer = script(change, scaler=scaler, **by_hand)
    for (name, p), q in zip(model.state_dict().items(), expected.state_dict().values()):
        if act == "clip":  # hookpolicy's norm and clip_grad_norm_'s may differ in the last bit
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        else:
            assert torch.equal(p, q), name
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in expected_optimizer.param_groups]
    assert not errors
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [m for m in said if not m.startswith(("WARNING p/act step", "p/act: learning rate x0.1 from step 3 to"))]
    assert len(said) <= 1, said  # beside the action's own lines (its alert, its cool-down): one refusal at most
    if act == "loss":
        assert next(iter(values["hookpolicy_loss_mean"].values())) == pytest.approx(published[-1], rel=1e-6)
