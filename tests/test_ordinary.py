"""A governed model stays an ordinary model (issue 12), under `attach`.

Saved, pickled, deep-copied, averaged and loaded exactly as without hookpolicy (the same
bytes as a twin model that never saw a policy), copies carry no hook and feed no metric,
and the things users do to a model right after it is attached (`to(dtype)`, train/eval,
`requires_grad_`, their own hooks, replacing a submodule) keep it governed correctly.
The same operations under `hookpolicy apply`, in real processes: test_ordinary_apply.py.
"""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry, generate_latest
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hookpolicy.engine.hooks import module_hooks
from hookpolicy.engine.hooks.contain import MAX_FAULTS

from helpers.outputs import metric
from helpers.policies import load_policy

RULES = """
- name: act
  match: {types: [Linear]}
  trigger: {at: forward, phase: any}
  target: output
  actions: [{capture: {stats: [l2_norm]}}]
- name: grads
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions: [{capture: {stats: [l2_norm], per: tensor}}]
"""

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range,
          after: Callable[[], None] = lambda: None) -> None:
    for step in steps:
        x, y = data(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after()


def hooks(model: nn.Module) -> int:
    return sum(len(getattr(m, name)) for m in model.modules() for name in HOOK_DICTS)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return metric(reg, name, {"rank": "0", "policy": "p", **labels})


def output_norm(reg: CollectorRegistry, module: str) -> float | None:
    return sample(reg, "hookpolicy_output_l2_norm", rule="act", module=module, tensor="")


def grad_norm(reg: CollectorRegistry, module: str, tensor: str) -> float | None:
    return sample(reg, "hookpolicy_grad_l2_norm", rule="grads", module=module, tensor=tensor)


class Governed:
    """A model trained two steps under the policy, and its twin trained the same way without it."""

    def __init__(self, tmp_path: Path) -> None:
        self.policy = load_policy(tmp_path, RULES)
        self.registry = CollectorRegistry()
        self.model, self.twin = build(), build()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.twin_opt = torch.optim.SGD(self.twin.parameters(), lr=0.1, momentum=0.9)
        self.attached = self.policy.attach(self.model, registry=self.registry)
        train(self.model, self.opt, range(2))
        train(self.twin, self.twin_opt, range(2))

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


@pytest.fixture
def governed(tmp_path: Path) -> Iterator[Governed]:
    g = Governed(tmp_path)
    yield g
    g.attached.remove()


def _sample_steps(reg: CollectorRegistry) -> float | None:
    return metric(reg, "hookpolicy_steps_total", {"rank": "0"})


def assert_still_governed(g: Governed) -> None:
    """One more step of the original: counted, and its series are its own numbers."""
    steps = _sample_steps(g.registry)
    assert steps is not None
    seen: list[float] = []
    handle = g.model[2].register_forward_hook(
        lambda m, a, o: seen.append(torch.linalg.vector_norm(o.detach().double()).item()))
    x, y = data(2)
    nn.functional.mse_loss(g.model(x), y).backward()
    weight_grad = torch.linalg.vector_norm(g.model[2].weight.grad.double()).item()
    g.opt.step()
    g.opt.zero_grad()
    handle.remove()
    assert _sample_steps(g.registry) == steps + 1
    assert output_norm(g.registry, "2") == pytest.approx(seen[-1], rel=1e-6)
    assert grad_norm(g.registry, "2", "weight") == pytest.approx(weight_grad, rel=1e-6)


def use_copy(copied: nn.Module, g: Governed) -> None:
    """Call a copy as training and as evaluation would: none of it may reach the original's metrics."""
    before = g.metrics()
    big = data(0)[0] * 1000
    copied.train()
    copied(big).sum().backward()
    copied.eval()
    with torch.no_grad():
        copied(big)
    assert g.metrics() == before


def same_outputs(a: nn.Module, b: nn.Module) -> None:
    x = data(7)[0]
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def saved(model: nn.Module) -> bytes:
    """`torch.save`'s bytes: deterministic, unlike `pickle.dumps` of tensors (it writes storage addresses)."""
    out = io.BytesIO()
    torch.save(model, out)
    return out.getvalue()


# -- copies and saves ----------------------------------------------------------------------

def test_torch_save_is_byte_identical_to_the_twin_and_loads_without_hooks(governed: Governed) -> None:
    data_ = saved(governed.model)
    assert data_ == saved(governed.twin)
    assert b"hookpolicy" not in data_
    loaded = torch.load(io.BytesIO(data_), weights_only=False)
    assert hooks(loaded) == 0
    same_outputs(loaded, governed.model)
    use_copy(loaded, governed)
    assert_still_governed(governed)


def test_with_the_copy_filter_switched_off_a_save_and_a_copy_are_still_the_twins(
    governed: Governed, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After 3 faults the filter of `__reduce_ex__` tells hookpolicy's hooks by their code, not their ids: the
    flags torch keeps under a hook's key (`_forward_hooks_with_kwargs`, `_forward_hooks_always_called`) go too."""
    monkeypatch.setattr(module_hooks._REDUCE_PART, "faults", MAX_FAULTS)  # given back at the test's end
    assert any(getattr(m, name) for m in governed.model.modules()
               for name in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"))  # what is at stake
    assert saved(governed.model) == saved(governed.twin)
    copied = copy.deepcopy(governed.model)
    assert hooks(copied) == 0
    same_outputs(copied, governed.model)
    assert_still_governed(governed)


def test_pickle_round_trip_is_the_twin(governed: Governed) -> None:
    data_ = pickle.dumps(governed.model)
    assert b"hookpolicy" not in data_
    loaded = pickle.loads(data_)
    assert hooks(loaded) == 0
    assert saved(loaded) == saved(governed.twin)
    same_outputs(loaded, governed.model)
    use_copy(loaded, governed)
    assert_still_governed(governed)


def test_deepcopy_carries_no_hook_and_feeds_no_metric(governed: Governed) -> None:
    copied = copy.deepcopy(governed.model)
    assert hooks(copied) == 0
    assert saved(copied) == saved(governed.twin)
    same_outputs(copied, governed.model)
    use_copy(copied, governed)
    assert_still_governed(governed)


def test_shallow_copy_carries_no_hook_of_hookpolicy(governed: Governed) -> None:
    user: list[int] = []
    governed.model.register_forward_hook(lambda m, a, o: user.append(1))
    copied = copy.copy(governed.model)  # shares its children with the original, as in PyTorch
    assert sum(len(getattr(copied, name)) for name in HOOK_DICTS) == 1  # the user's hook, and only it
    copied(data(0)[0])
    assert user == [1]


def test_averaged_model_equals_the_twins_and_its_evaluation_feeds_no_metric(governed: Governed) -> None:
    ema = AveragedModel(governed.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    twin_ema = AveragedModel(governed.twin, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    assert hooks(ema) == 0
    train(governed.model, governed.opt, range(2, 4), after=lambda: ema.update_parameters(governed.model))
    train(governed.twin, governed.twin_opt, range(2, 4), after=lambda: twin_ema.update_parameters(governed.twin))
    for p, q in zip(ema.parameters(), twin_ema.parameters()):
        assert torch.equal(p, q)
    use_copy(ema, governed)
    assert_still_governed(governed)


def test_state_dict_round_trip_is_the_twins(governed: Governed) -> None:
    state, twin_state = io.BytesIO(), io.BytesIO()
    torch.save(governed.model.state_dict(), state)
    torch.save(governed.twin.state_dict(), twin_state)
    assert state.getvalue() == twin_state.getvalue()
    fresh = build(seed=1)
    state.seek(0)
    fresh.load_state_dict(torch.load(state))
    same_outputs(fresh, governed.model)
    governed.model.load_state_dict(build(seed=2).state_dict())  # into the governed model: still governed
    assert_still_governed(governed)


def test_a_copy_trained_on_its_own_is_governed_only_when_attached_itself(governed: Governed, tmp_path: Path) -> None:
    copied = copy.deepcopy(governed.model)
    opt = torch.optim.SGD(copied.parameters(), lr=0.1)
    before = governed.metrics()
    train(copied, opt, range(2, 3))
    assert governed.metrics() == before
    registry = CollectorRegistry()
    with governed.policy.attach(copied, registry=registry):
        seen: list[float] = []
        copied[2].register_forward_hook(lambda m, a, o: seen.append(torch.linalg.vector_norm(o.detach().double()).item()))
        train(copied, opt, range(3, 4))
        assert output_norm(registry, "2") == pytest.approx(seen[-1], rel=1e-6)
    assert governed.metrics() == before
    assert_still_governed(governed)


# -- right after attach --------------------------------------------------------------------

def test_to_dtype_after_attach_keeps_the_statistics_right(governed: Governed) -> None:
    governed.model.to(torch.float64)
    seen: list[float] = []
    governed.model[2].register_forward_hook(lambda m, a, o: seen.append(torch.linalg.vector_norm(o.detach()).item()))
    x, y = data(2)
    nn.functional.mse_loss(governed.model(x.double()), y.double()).backward()
    weight_grad = torch.linalg.vector_norm(governed.model[2].weight.grad).item()
    governed.opt.step()
    assert output_norm(governed.registry, "2") == pytest.approx(seen[-1], rel=1e-12)
    assert grad_norm(governed.registry, "2", "weight") == pytest.approx(weight_grad, rel=1e-12)


def test_train_eval_switches_keep_counting(governed: Governed) -> None:
    governed.model.eval()
    with torch.no_grad():
        out = governed.model(data(9)[0])
    assert output_norm(governed.registry, "2") == pytest.approx(torch.linalg.vector_norm(out.double()).item(), rel=1e-6)
    governed.model.train()
    assert_still_governed(governed)


def test_requires_grad_changes_are_seen_at_the_next_step(governed: Governed) -> None:
    governed.model[0].requires_grad_(False)
    before = grad_norm(governed.registry, "0", "weight")
    assert_still_governed(governed)
    assert grad_norm(governed.registry, "0", "weight") == before  # no gradient, no new value
    governed.model[0].requires_grad_(True)
    x, y = data(3)
    nn.functional.mse_loss(governed.model(x), y).backward()
    expected = torch.linalg.vector_norm(governed.model[0].weight.grad.double()).item()
    governed.opt.step()
    assert grad_norm(governed.registry, "0", "weight") == pytest.approx(expected, rel=1e-6)


def test_users_own_hooks_run_and_come_off(governed: Governed) -> None:
    calls: list[str] = []
    handles = [
        governed.model[2].register_forward_hook(lambda m, a, o: calls.append("post")),
        governed.model[2].register_forward_pre_hook(lambda m, a: calls.append("pre")),
        governed.model.register_forward_hook(lambda m, a, k, o: calls.append("root"), with_kwargs=True),
    ]
    assert_still_governed(governed)
    assert calls == ["pre", "post", "root"]
    for handle in handles:
        handle.remove()
    assert_still_governed(governed)
    assert calls == ["pre", "post", "root"]


class LoRA(nn.Module):
    """A LoRA-style wrapper, injected as peft does: `setattr(parent, name, LoRA(old))`."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("after_steps", [0, 2], ids=["right-after-attach", "mid-training"])
def test_a_replaced_submodule_is_governed_from_the_next_step(tmp_path: Path, after_steps: int) -> None:
    policy = load_policy(tmp_path, RULES)
    model = build()
    registry = CollectorRegistry()
    with policy.attach(model, registry=registry) as attached:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, range(after_steps))
        old = model[2]
        model[2] = nn.Linear(8, 2)
        model[0] = LoRA(model[0])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen: dict[str, float] = {}
        handles = [
            model.get_submodule(name).register_forward_hook(
                lambda m, a, o, name=name: seen.__setitem__(name, torch.linalg.vector_norm(o.detach().double()).item()))
            for name in ("2", "0.base", "0.up")
        ]
        x, y = data(after_steps)
        nn.functional.mse_loss(model(x), y).backward()
        expected = {name: torch.linalg.vector_norm(model.get_submodule(name).weight.grad.double()).item()
                    for name in ("2", "0.base", "0.down")}
        opt.step()
        for handle in handles:
            handle.remove()
        assert hooks(old) == 0  # nothing stale left behind
        assert {b.module for b in attached.plan.bindings} >= {"0.base", "0.down", "0.up", "2"}
        for name, norm in seen.items():
            assert output_norm(registry, name) == pytest.approx(norm, rel=1e-6), name
        for name, norm in expected.items():
            assert grad_norm(registry, name, "weight") == pytest.approx(norm, rel=1e-6), name
        assert output_norm(registry, "0") is None  # the old name is gone with the module
        assert metric(registry, "hookpolicy_steps_total", {"rank": "0"}) == after_steps + 1
        model[2] = nn.Sequential(nn.Linear(8, 2))  # "2" is no longer bound: its series go, "2.0" comes
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, range(after_steps + 1, after_steps + 2))
        assert output_norm(registry, "2") is None and grad_norm(registry, "2", "weight") is None
        assert output_norm(registry, "2.0") is not None and grad_norm(registry, "2.0", "weight") is not None
    assert hooks(model) == 0


def test_a_replaced_parameter_is_the_one_the_step_rule_reads(governed: Governed) -> None:
    governed.model[2].weight = nn.Parameter(torch.zeros(2, 8))
    governed.opt = torch.optim.SGD(governed.model.parameters(), lr=0.1)
    assert_still_governed(governed)


class SelfReducing(nn.Linear):
    """A module class that reduces itself: pickle never asks nn.Module how."""

    def __reduce_ex__(self, protocol: object) -> object:
        return super().__reduce_ex__(protocol)  # type: ignore[arg-type]


def test_a_class_that_reduces_itself_is_named_at_attach(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = load_policy(tmp_path, RULES)
    model = nn.Sequential(SelfReducing(4, 2))
    with caplog.at_level("WARNING", logger="hookpolicy"), policy.attach(model, registry=CollectorRegistry()):
        pass
    assert [r.getMessage() for r in caplog.records if "SelfReducing" in r.getMessage()] == [
        "SelfReducing defines its own __reduce_ex__/__reduce__, so a copy, pickle or torch.save of it would "
        "carry hookpolicy's hooks; remove() the policy before copying it"
    ]


def test_a_compiled_model_is_not_named_and_its_copy_carries_no_hook(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = load_policy(tmp_path, RULES)
    compiled = torch.compile(build())  # never called: nothing is compiled, only wrapped
    with caplog.at_level("WARNING", logger="hookpolicy"), policy.attach(compiled, registry=CollectorRegistry()):
        copied = copy.deepcopy(compiled)
        assert hooks(copied) == 0 and hooks(copied._orig_mod) == 0
    assert not [r for r in caplog.records if "__reduce" in r.getMessage()]
