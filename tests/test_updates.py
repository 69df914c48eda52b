"""`target: update` and `target: optimizer_state`, against what the test itself saw the optimizer do.

The references are the test's own: a copy of every parameter taken before `opt.step()`
(or by an optimizer step pre-hook the test registers), `torch.linalg.vector_norm` of
`after - before` and of `before`, and `optimizer.state[p][key]` read right after the step.
Both targets are read back at the next step's read-back (or at detach), so the records of
a JSON-lines log carry the step whose update they measured.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hookpolicy import Halt
from hookpolicy.engine.execute import updates

from helpers.models import tiny
from helpers.outputs import json_lines
from helpers.policies import load_policy

UPDATE_RULES = """\
- name: update
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions:
    - capture: {stats: [l2_norm, update_ratio, mean, max, numel], per: tensor, log: {path: tensor.jsonl}}
    - capture: {stats: [l2_norm, update_ratio], per: module, log: {path: module.jsonl}}
"""

STATE_RULES = """\
- name: state
  match: {types: [Linear]}
  trigger: {at: step}
  target: optimizer_state
  actions:
    - capture: {stats: [l2_norm, max], per: tensor, log: {path: state.jsonl}}
    - capture: {stats: [l2_norm], per: module, log: {path: state-module.jsonl}}
- name: second-moment
  match: {types: [Linear], params: [weight], state: [exp_avg_sq]}
  trigger: {at: step}
  target: optimizer_state
  actions:
    - capture: {stats: [l2_norm], per: rule, log: {path: second.jsonl}}
"""

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def norm(*tensors: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors])))


def records(path: Path) -> dict[tuple[int, str, str], dict[str, float]]:
    """(step, module, tensor) -> stats of a capture log."""
    return {(r["step"], r["module"], r["tensor"]): r["stats"] for r in json_lines(path)}


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(6, 4, generator=g)).pow(2).mean()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def layers(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_and_update_ratio_are_the_change_of_a_copy_the_test_took(tmp_path: Path, out: Path, name: str) -> None:
    """update = w_after - w_before and update_ratio = ||update|| / ||w_before||, per tensor and per module."""
    model = tiny()
    opt = OPTIMIZERS[name](list(model.parameters()))
    expected: list[dict[str, torch.Tensor]] = []
    with load_policy(tmp_path, UPDATE_RULES).attach(model, registry=CollectorRegistry()):
        for step in range(4):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
            expected.append({n: (before[n], p.detach().clone()) for n, p in model.named_parameters()})
    per_tensor, per_module = records(out / "tensor.jsonl"), records(out / "module.jsonl")
    assert {step for step, _, _ in per_tensor} == {0, 1, 2, 3}  # the last one at detach
    for step, params in enumerate(expected):
        for module, _ in layers(model):
            for tensor in ("weight", "bias"):
                before, after = params[f"{module}.{tensor}"]
                delta = (after - before).double()
                got = per_tensor[(step, module, tensor)]
                assert got["l2_norm"] == pytest.approx(norm(delta), rel=1e-6)
                assert got["update_ratio"] == pytest.approx(norm(delta) / norm(before), rel=1e-6)
                assert got["mean"] == pytest.approx(float(delta.mean()), rel=1e-5, abs=1e-9)
                assert got["max"] == pytest.approx(float(delta.max()), rel=1e-6)
                assert got["numel"] == delta.numel()
            (wb, wa), (bb, ba) = params[f"{module}.weight"], params[f"{module}.bias"]
            joint = norm(wa - wb, ba - bb)
            assert per_module[(step, module, "")]["l2_norm"] == pytest.approx(joint, rel=1e-6)
            assert per_module[(step, module, "")]["update_ratio"] == pytest.approx(joint / norm(wb, bb), rel=1e-6)


def test_optimizer_state_is_what_the_optimizer_holds_after_the_step(tmp_path: Path, out: Path) -> None:
    """Read from `optimizer.state[p][key]` right after each step: by default the tensors shaped like their
    parameter (exp_avg, exp_avg_sq; not step), per: module one value per key, `state:` narrows."""
    model = tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    expected: list[dict[tuple[str, str], torch.Tensor]] = []
    with load_policy(tmp_path, STATE_RULES).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
            expected.append({(n, key): value.clone() for n, p in model.named_parameters()
                             for key, value in opt.state[p].items()})
    per_tensor, per_module = records(out / "state.jsonl"), records(out / "state-module.jsonl")
    second = records(out / "second.jsonl")
    assert {tensor for _, _, tensor in per_tensor} == {f"{p}.{k}" for p in ("weight", "bias") for k in ("exp_avg", "exp_avg_sq")}
    assert {tensor for _, _, tensor in per_module} == {"exp_avg", "exp_avg_sq"}  # keys are never mixed
    for step, state in enumerate(expected):
        for module, _ in layers(model):
            for key in ("exp_avg", "exp_avg_sq"):
                w, b = state[(f"{module}.weight", key)], state[(f"{module}.bias", key)]
                got = per_tensor[(step, module, f"weight.{key}")]
                assert got["l2_norm"] == pytest.approx(norm(w), rel=1e-6)
                assert got["max"] == pytest.approx(float(w.max()), rel=1e-6)
                assert per_module[(step, module, key)]["l2_norm"] == pytest.approx(norm(w, b), rel=1e-6)
        weights = [state[(f"{module}.weight", "exp_avg_sq")] for module, _ in layers(model)]
        assert second == {**second, (step, "", "exp_avg_sq"): {"l2_norm": pytest.approx(norm(*weights), rel=1e-6)}}
    assert len(second) == 3


def test_several_optimizers_of_one_step_against_the_tests_own_step_hooks(tmp_path: Path, out: Path) -> None:
    """Two optimizers after one backward pass make one step; each parameter's update is the one its
    optimizer applied, as step pre- and post-hooks registered by the test see it."""
    model = tiny()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    seen: list[dict[str, float]] = []
    copies: dict[int, torch.Tensor] = {}

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        copies.update({id(p): p.detach().clone() for g in opt.param_groups for p in g["params"]})

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for name, p in model.named_parameters():
            if any(p is q for g in opt.param_groups for q in g["params"]):
                seen[-1][name] = norm(p - copies[id(p)])

    for opt in (first, second):
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
    with load_policy(tmp_path, UPDATE_RULES).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            seen.append({})
            for opt in (first, second):
                opt.zero_grad()
            loss_of(model, step).backward()
            first.step()
            second.step()
    got = records(out / "tensor.jsonl")
    assert {step for step, _, _ in got} == {0, 1, 2}  # one step each, not two
    for step, norms in enumerate(seen):
        for name, want in norms.items():
            module, tensor = name.split(".")
            assert got[(step, module, tensor)]["l2_norm"] == pytest.approx(want, rel=1e-6)


def test_lbfgs_update_is_the_whole_change_of_its_step(tmp_path: Path, out: Path) -> None:
    """LBFGS calls its closure many times in one step(): the update is everything the step changed."""
    model = tiny()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    expected = []
    with load_policy(tmp_path, UPDATE_RULES).attach(model, registry=CollectorRegistry()):
        for step in range(2):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                return loss
            before = model[0].weight.detach().clone()
            opt.step(closure)
            expected.append(norm(model[0].weight - before))
    got = records(out / "tensor.jsonl")
    assert [got[(step, "0", "weight")]["l2_norm"] for step in range(2)] == pytest.approx(expected, rel=1e-6)
    assert all(e > 0 for e in expected)


SKIP_AT_ONE = """\
- name: skip-one
  match: {types: [Linear]}
  trigger: {at: step, steps: {from: 1, until: 2}}
  target: grad
  actions:
    - alert: {if: "l2_norm >= 0", then: skip_step, per: rule}
"""


def test_a_skipped_step_has_no_update(tmp_path: Path, out: Path) -> None:
    """Step 1 is skipped by a policy: its parameters do not move and it has no update record."""
    model = tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    moved = []
    with load_policy(tmp_path, UPDATE_RULES + SKIP_AT_ONE).attach(model, registry=CollectorRegistry()):
        for step in range(3):
            before = model[0].weight.detach().clone()
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
            moved.append(norm(model[0].weight - before))
    got = records(out / "tensor.jsonl")
    assert moved[1] == 0.0 and moved[0] > 0 and moved[2] > 0
    assert sorted({step for step, _, _ in got}) == [0, 2]
    assert got[(2, "0", "weight")]["l2_norm"] == pytest.approx(moved[2], rel=1e-6)


def test_a_step_gradscaler_skipped_has_no_update(tmp_path: Path, out: Path) -> None:
    """GradScaler skips the step whose gradients overflow (no optimizer.step() runs): no record for it."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    applied = []
    with load_policy(tmp_path, UPDATE_RULES).attach(model, registry=CollectorRegistry()):
        for step in range(4):
            before = model[0].weight.detach().clone()
            opt.zero_grad()
            loss = loss_of(model, step) * (math.inf if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            applied.append(norm(model[0].weight - before))
    got = records(out / "tensor.jsonl")
    assert applied[1] == 0.0 and all(a > 0 for a in applied[0:1] + applied[2:])
    # steps count the updates that happened: three, each measured against the test's copy
    assert [got[(step, "0", "weight")]["l2_norm"] for step in range(3)] == pytest.approx(
        [applied[0], applied[2], applied[3]], rel=1e-6)
    assert len({step for step, _, _ in got}) == 3


def test_no_copy_on_a_step_where_no_update_rule_is_active(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """trigger.every: 3 copies the parameters on steps 0 and 3 only; a state rule never copies."""
    copied: list[int] = []
    real = updates._snapshot

    def counting(params: list[torch.Tensor]) -> list[torch.Tensor]:
        copied.append(len(params))
        return real(params)

    monkeypatch.setattr(updates, "_snapshot", counting)
    rules = UPDATE_RULES.replace("trigger: {at: step}", "trigger: {at: step, every: 3}") + STATE_RULES
    model = tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with load_policy(tmp_path, rules).attach(model, registry=CollectorRegistry()):
        train(model, opt, 6)
    assert copied == [4, 4]  # weight and bias of both Linear layers, at steps 0 and 3
    assert sorted({step for step, _, _ in records(out / "tensor.jsonl")}) == [0, 3]


HALT_ON_UPDATE = """\
- name: halt-on-update
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions:
    - alert: {if: "update_ratio > 1e-9", then: halt, message: "ratio {update_ratio:.3g} at step {step}"}
"""


def test_a_halt_on_an_update_stops_before_the_next_update(tmp_path: Path) -> None:
    """The update of step 0 is read back at step 1: the halt names step 0 and step 1 never updates."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with load_policy(tmp_path, HALT_ON_UPDATE).attach(model, registry=CollectorRegistry()):
        opt.zero_grad()
        loss_of(model, 0).backward()
        opt.step()
        after_first = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss_of(model, 1).backward()
        with pytest.raises(Halt) as halted:
            opt.step()
    assert halted.value.step == 0 and "at step 0" in str(halted.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_first))


FSDP_RULES = """\
- name: update
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions:
    - capture: {stats: [l2_norm, update_ratio, max, numel], per: tensor}
    - capture: {stats: [l2_norm, update_ratio], per: module}
- name: state
  match: {types: [Linear], state: [exp_avg_sq]}
  trigger: {at: step}
  target: optimizer_state
  actions:
    - capture: {stats: [l2_norm, min], per: tensor}
"""


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fsdp_updates(rank: int, policy: str) -> list[list[Any]]:
    """Four FSDP2 Adam steps: (what, published, reference on the full tensors) of each update and state statistic.

    The update of step i is read back at step i+1 (the last one, at detach, is not: sharded
    statistics need a collective), so the values are read after the next `opt.step()`.
    """
    import hookpolicy
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # 3 rows over 2 ranks: uneven shards
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    names = [name.rsplit(".", 1) for name, _ in model.named_parameters()]
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []
    rows: list[list[Any]] = []
    with hookpolicy.load(policy).attach(model, registry=CollectorRegistry(), rank=rank) as attached:
        for step in range(4):
            before = [full(p) for p in model.parameters()]
            g = torch.Generator().manual_seed(2 * step + rank)
            opt.zero_grad()
            model(torch.randn(4, 4, generator=g)).pow(2).mean().backward()
            opt.step()
            if step == 0:
                assert not attached.last_values().get("hookpolicy_update_l2_norm")
            else:
                old_before, old_after, old_state = seen[-1]
                values = attached.last_values()
                for (module, tensor), b, a, s in zip(names, old_before, old_after, old_state):
                    what = f"step {step - 1} {module}.{tensor}"
                    key = ("p", "update", module, tensor)
                    rows.append([f"{what} l2_norm", values["hookpolicy_update_l2_norm"][key], norm(a - b)])
                    rows.append([f"{what} ratio", values["hookpolicy_update_update_ratio"][key], norm(a - b) / norm(b)])
                    rows.append([f"{what} max", values["hookpolicy_update_max"][key], float((a - b).max())])
                    rows.append([f"{what} numel", values["hookpolicy_update_numel"][key], float(a.numel())])
                    skey = ("p", "state", module, f"{tensor}.exp_avg_sq")
                    rows.append([f"{what} state", values["hookpolicy_optimizer_state_l2_norm"][skey], norm(s)])
                    rows.append([f"{what} state min", values["hookpolicy_optimizer_state_min"][skey], float(s.min())])
                for module in ("0", "2"):
                    pairs = [(b, a) for (m, _), b, a in zip(names, old_before, old_after) if m == module]
                    joint = norm(*(a - b for b, a in pairs))
                    rows.append([f"step {step - 1} {module} joint ratio",
                                 values["hookpolicy_update_update_ratio"][("p", "update", module, "")],
                                 joint / norm(*(b for b, _ in pairs))])
            seen.append((before, [full(p) for p in model.parameters()],
                         [full(opt.state[p]["exp_avg_sq"]) for p in model.parameters()]))
    return rows


@pytest.mark.slow
def test_fsdp2_update_and_state_are_those_of_the_full_tensors(tmp_path: Path, free_port: int) -> None:
    from helpers.distributed import spawn
    from helpers.policies import write_policy

    policy = str(write_policy(tmp_path, FSDP_RULES))
    ranks = spawn(fsdp_updates, tmp_path, free_port, policy)
    assert ranks[0] and [r[0] for r in ranks[0]] == [r[0] for r in ranks[1]]
    for rows in ranks:
        for what, got, want in rows:
            assert got == pytest.approx(want, rel=1e-6), what
    assert [got for _, got, _ in ranks[0]] == [got for _, got, _ in ranks[1]]  # the same numbers on both ranks


def test_measuring_the_update_reads_nothing_back_inside_the_step_hooks(tmp_path: Path) -> None:
    """The pre-hook's copy and the post-hook's update and state statistics stay on the device."""
    from helpers.hooks import no_host_sync
    from helpers.outputs import errors_of

    model = tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    reg = CollectorRegistry()
    with load_policy(tmp_path, UPDATE_RULES.replace(", log: {path: tensor.jsonl}", "").replace(
            ", log: {path: module.jsonl}", "") + STATE_RULES.replace(", log: {path: state.jsonl}", "").replace(
            ", log: {path: state-module.jsonl}", "").replace(", log: {path: second.jsonl}", "")).attach(
            model, registry=reg) as attached:
        loss_of(model, 0).backward()
        opt.step()  # Adam's state exists from here on
        cycle = attached._cycle
        rules = cycle.installer.step_rules()
        loss_of(model, 1).backward()
        with no_host_sync():
            cycle.updates.before(opt, rules)
        with torch.no_grad():  # an update, outside the optimizer's hooks
            for p in model.parameters():
                p.sub_(0.01 * p.grad)
        with no_host_sync():
            cycle.updates.after(opt, 1, skipped=False)
        stamped = [e for e in cycle.ledger.entries if getattr(e, "step", None) == 1]
        assert {e.target for e in stamped} == {"update", "optimizer_state"}
        for rule in ("update", "state", "second-moment"):
            assert errors_of(reg, rule) == 0


HISTORY_ACROSS_A_SKIP = """\
- name: update
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions:
    - alert: {if: "l2_norm >= 0", per: rule, message: "{count(l2_norm):.0f} before"}
- name: skip-two
  match: {types: [Linear]}
  trigger: {at: step, steps: {from: 2, until: 3}}
  target: grad
  actions:
    - alert: {if: "l2_norm >= 0", then: skip_step, per: rule}
"""


def test_an_update_enters_the_history_also_when_the_step_reading_it_back_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Step 1's update is read back at step 2, which is skipped: it happened all the same, so it counts."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with load_policy(tmp_path, HISTORY_ACROSS_A_SKIP).attach(model, registry=CollectorRegistry()):
        train(model, opt, 5)
    # updates of steps 0, 1, 3, 4 (2 was skipped); each one's past holds all the ones before it
    shown = [found[1] for r in caplog.records if (found := re.search(r"(\d+) before$", r.getMessage()))]
    assert shown == ["0", "1", "2", "3"]


def test_the_plan_leaves_frozen_parameters_out_and_says_what_the_copy_costs(tmp_path: Path) -> None:
    """A frozen parameter gets no update; explain's note names the size of the copy of the rest."""
    from hookpolicy.plan.planner import build_plan

    model = tiny()
    model[2].bias.requires_grad_(False)
    policies = load_policy(tmp_path, UPDATE_RULES + STATE_RULES).policies
    plan = build_plan(policies, model)
    update = [b for b in plan.bindings if b.rule.name == "update"]
    assert [(b.module, b.params) for b in update] == [("0", ("weight", "bias")), ("2", ("weight",))]
    copied = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    note = next(n for n in plan.notes if n.startswith("p/update:"))
    assert f"a copy of its 3 parameters ({copied / 2**10:.1f} KiB" in note
    assert any(n.startswith("p/state:") and "after the optimizer applied the step" in n for n in plan.notes)
    frozen = [w.split(":")[0] for w in plan.warnings if "frozen parameters (requires_grad=False) left out" in w]
    assert frozen == ["p/update", "p/state"]  # second-moment binds weights only


def test_a_rewound_step_has_no_update(tmp_path: Path, out: Path) -> None:
    """A rewind at step 3 hides the step's gradients and restores a snapshot at its end: neither is an update."""
    rewind = SKIP_AT_ONE.replace("skip-one", "rewind-three").replace("from: 1, until: 2", "from: 3, until: 4").replace(
        "then: skip_step", "then: rewind")
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with load_policy(tmp_path, UPDATE_RULES + rewind, spec="snapshots: {every: 2, keep: 2}\n").attach(
            model, registry=CollectorRegistry()):
        train(model, opt, 5)
    assert sorted({step for step, _, _ in records(out / "tensor.jsonl")}) == [0, 1, 2, 4]
