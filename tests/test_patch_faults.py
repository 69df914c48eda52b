"""hookpolicy's own patches of torch contain their faults: the original always runs, untouched.

Each place hookpolicy patches torch (the list is `hookpolicy/process.py`'s) is forced to
fail in hookpolicy's part; training goes on, and the weights equal those of the same run
without hookpolicy, bit for bit (the reference: the script run with nothing attached).
The policy only watches (captures, an alert that never fires), so a run it does not
break must end exactly where the run without it ends. Under `onError: halt` the fault
stops the run with `hookpolicy.Halt`, once the original call has returned.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy.engine import cycle
from hookpolicy.engine.execute import executor, steps
from hookpolicy.engine.hooks import contain, loss, module_hooks, optimizer_hooks, schedulers
from helpers.models import tiny
from helpers.outputs import metric
from helpers.policies import load_policy

STEPS = 6
SNAPS = "snapshots: {every: 2, keep: 1}\n"

#: watches only: the loss, gradient norms, activations, and snapshots a rewind that never fires would need
WATCH = """
- name: loss
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions: [{capture: {stats: [mean, max]}}]
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm]}
    - alert: {if: "l2_norm < 0", per: rule, then: rewind, rewind: {back: 1}}
- name: acts
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions: [{capture: {stats: [rms]}}]
"""


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def train(model: nn.Module, *, closure: bool = False, scaler: Optional[torch.amp.GradScaler] = None,
          schedule: bool = False, grow: bool = False) -> nn.Module:
    """SGD with momentum; optionally through a closure, a GradScaler, a scheduler made at step 2, a head swapped."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(data()):
        if schedule and i == 2:  # made while hookpolicy watches schedulers being made (then: rewind)
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        if grow and i == 3:  # a module assigned into the governed model: the registration hook
            model[2].extra = nn.Identity()

        def step() -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            return loss

        if closure:
            optimizer.step(step)
        elif scaler is not None:
            step()
            scaler.step(optimizer)
            scaler.update()
        else:
            step()
            optimizer.step()
    return model


def reference(**kwargs: Any) -> nn.Module:
    return train(tiny(seed=1), **kwargs)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("forced fault in hookpolicy's part")


#: (what is forced to fail, the object and attribute replaced by `boom`, the script's options)
FORCED: list[tuple[str, Callable[[], tuple[Any, str]], dict[str, Any]]] = [
    ("autograd.backward, before the call", lambda: (loss._Roots, "_values"), {}),
    ("autograd.backward, after the call", lambda: (loss.LossTap, "backward_ends"), {}),
    ("GradScaler.scale", lambda: (loss._Roots, "_remember"), {"scaler": "cpu"}),
    ("optimizer step pre-hook", lambda: (cycle.StepCycle, "before_update"), {}),
    ("optimizer step post-hook", lambda: (cycle.StepCycle, "after_update"), {}),
    ("optimizer step with a closure", lambda: (optimizer_hooks._ClosureThenUpdate, "__init__"), {"closure": True}),
    ("the closure's update", lambda: (cycle.StepCycle, "before_update"), {"closure": True}),
    ("the root's forward pre-hook", lambda: (cycle.StepCycle, "_root_pre"), {}),
    ("the root's forward hook", lambda: (cycle.StepCycle, "_root_post"), {}),
    ("the backward marker", lambda: (steps.StepTracker, "backward_starts"), {}),
    ("the tree watch (registration hooks)", lambda: (executor.Rebinding, "tree_changed"), {"grow": True}),
    ("LRScheduler.__init__", lambda: (schedulers._Made, "note"), {"schedule": True}),
]


@pytest.fixture(autouse=True)
def _parts_given_back() -> Iterator[None]:
    """A process-wide part these tests switch off stays off for the process (`hooks.contain`): each test gives the
    counts back, so a later test's copies, saves and closures run hookpolicy's part again."""
    faults = {part: part.faults for part in list(contain._PARTS)}
    yield
    for part, count in faults.items():
        part.faults = count


#: the parts no attachment owns: said once as the process's (`hooks.contain.Part`), not counted per rule
PROCESS_WIDE = [(schedulers._Made, "note"), (optimizer_hooks._ClosureThenUpdate, "__init__")]


@pytest.mark.parametrize("what,where,options", FORCED, ids=[f[0] for f in FORCED])
def test_a_fault_in_hookpolicys_part_of_a_patch_leaves_training_as_without_hookpolicy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    what: str, where: Callable[[], tuple[Any, str]], options: dict[str, Any],
) -> None:
    pol = load_policy(tmp_path, WATCH, spec=SNAPS)
    kwargs = dict(options)
    if kwargs.get("scaler"):
        kwargs["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    registry = CollectorRegistry()
    model = tiny(seed=1)
    monkeypatch.setattr(*where(), boom)
    with caplog.at_level(logging.ERROR, logger="hookpolicy"):
        with pol.attach(model, registry=registry):
            train(model, **kwargs)
    monkeypatch.undo()
    ref_kwargs = dict(options)
    if ref_kwargs.get("scaler"):
        ref_kwargs["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    assert_same(model, reference(**ref_kwargs))
    faults = [r for r in caplog.records if "raised" in r.getMessage()]
    assert len(faults) == 1, f"{what}: the fault was not said, or said more than once"
    if where() not in PROCESS_WIDE:  # a fault of an attachment's part is its rules'; a process-wide part's is the process's
        errors = sum(metric(registry, "hookpolicy_hook_errors_total", {"policy": "p", "rule": rule}) or 0
                     for rule in ("loss", "grads", "acts"))
        assert errors >= 1, f"{what}: the fault was not counted"


def test_the_fault_is_said_once_and_the_part_is_switched_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A part that fails at every step: one traceback, at most 3 counted per rule, then the rules are off."""
    pol = load_policy(tmp_path, WATCH, spec=SNAPS)
    registry = CollectorRegistry()
    model = tiny(seed=1)
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("forced fault in hookpolicy's part")

    monkeypatch.setattr(cycle.StepCycle, "before_update", counting)
    with caplog.at_level(logging.ERROR, logger="hookpolicy"):
        with pol.attach(model, registry=registry):
            train(model)
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage() or r.exc_info]
    assert len(tracebacks) == 1
    assert metric(registry, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "grads"}) == 3
    assert len(calls) == 3  # switched off after 3: not called at the later steps
    assert any("switched off" in r.getMessage() for r in caplog.records)


def test_under_on_error_halt_the_fault_halts_after_the_original_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pol = load_policy(tmp_path, WATCH, spec="onError: halt\n" + SNAPS)
    model = tiny(seed=1)
    x, y = data()[0]
    monkeypatch.setattr(loss._Roots, "_values", boom)
    with pol.attach(model, registry=CollectorRegistry()):
        out = nn.functional.mse_loss(model(x), y)
        with pytest.raises(hookpolicy.Halt):
            out.backward()
        assert all(p.grad is not None for p in model.parameters())  # the backward pass ran, untouched


def test_a_disabled_grad_scaler_is_called_through(tmp_path: Path) -> None:
    """nanoGPT's `GradScaler(enabled=(dtype == 'float16'))` on a CPU or a bf16 GPU: disabled, it has no `_scale`."""
    pol = load_policy(tmp_path, WATCH, spec=SNAPS)
    registry = CollectorRegistry()
    model = tiny(seed=1)
    with pol.attach(model, registry=registry) as attached:
        train(model, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert_same(model, reference())
    assert attached.last_values()["hookpolicy_loss_mean"]
    assert (metric(registry, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "loss"}) or 0) == 0


def test_a_discovery_subscriber_that_fails_is_switched_off(caplog: pytest.LogCaptureFixture) -> None:
    """The hook before every module call (apply's discovery): a fault is said once; the forward goes on."""
    calls: list[int] = []

    def failing(module: nn.Module, args: Any) -> None:
        calls.append(1)
        raise RuntimeError("forced fault in hookpolicy's part")

    model = tiny(seed=1)
    handle = module_hooks.global_forward_pre_hook(failing)
    try:
        with caplog.at_level(logging.ERROR, logger="hookpolicy"):
            for _ in range(4):
                out = model(torch.ones(2, 4))
    finally:
        handle.remove()
    assert torch.equal(out, tiny(seed=1)(torch.ones(2, 4)))
    assert len(calls) == 3
    assert len([r for r in caplog.records if "raised" in r.getMessage()]) == 1


def test_a_copy_of_a_governed_model_is_made_when_the_filter_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`nn.Module.__reduce_ex__`: the original reduction is what a copy gets when hookpolicy's filter fails."""
    pol = load_policy(tmp_path, WATCH, spec=SNAPS)
    model = tiny(seed=1)

    class Failing(set):  # type: ignore[type-arg]
        def __contains__(self, other: Any) -> bool:
            raise RuntimeError("forced fault in hookpolicy's part")

        def intersection(self, *others: Any) -> set[Any]:
            raise RuntimeError("forced fault in hookpolicy's part")

    with pol.attach(model, registry=CollectorRegistry()):
        monkeypatch.setattr(module_hooks, "_ours", Failing(module_hooks._ours))
        copied = copy.deepcopy(model)
        monkeypatch.undo()
        assert module_hooks._REDUCE_PART.off  # the forced faults reached the filter, which is off now
    assert_same(copied, model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copied.modules())  # none of ours


def test_a_scheduler_class_defined_while_the_subclass_hook_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`LRScheduler.__init_subclass__`: a class defined while hookpolicy's part fails is defined as without it."""
    pol = load_policy(tmp_path, WATCH, spec=SNAPS)
    model = tiny(seed=1)
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, schedule=True)  # the first update starts the watch
        monkeypatch.setattr(schedulers._Made, "_wrap", boom)

        class Mine(torch.optim.lr_scheduler.LambdaLR):
            pass

        monkeypatch.undo()
        mine = Mine(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 0.5)
        assert mine.get_last_lr() == [0.05]
