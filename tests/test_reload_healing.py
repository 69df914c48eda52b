"""A hot reload carries the healing state of every rule that keeps its identity.

The cool-down in force, the snapshots and the rewind counts of a rule that is the same
after the reload (an annotation edited, then SIGHUP) go on as if no reload happened; a
rule removed or changed ends its own cool-down and says so. The reference is the same
script without hookpolicy, doing by hand what the ladder does (the lr multiplied around
`optimizer.step()`; the steps a rewind drops never trained on), compared bit for bit.
The swap is `apply`'s own (`Swaps._swap`), driven between two steps as in test_history.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy import Halt, PolicySet
from helpers.policies import policy_text

STEPS = 12


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def rule(name: str, first: int, last: int, then: str) -> str:
    return f"""
- name: {name}
  match: {{modules: ["**"]}}
  trigger: {{at: step, steps: {{from: {first}, until: {last + 1}}}}}
  target: grad
  actions: [{{alert: {{if: "l2_norm >= 0", per: rule, then: {then}}}}}]
"""


def text(rules: str, note: str = "first") -> str:
    return policy_text(rules, spec="snapshots: {every: 2, keep: 2}\n").replace(
        "metadata:\n  name: p\n", f"metadata:\n  name: p\n  annotations: {{note: {note}}}\n")


def run(tmp_path: Path, before: str, after: Optional[str], reload_after: int,
        steps: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> nn.Module:
    """Train under `before`; after step `reload_after`, swap `after` in as `apply` does (None: no reload)."""
    from hookpolicy.apply.reload import Governed, Swaps

    path = tmp_path / "p.yaml"
    path.write_text(before)
    model, optimizer = build()
    swaps = Swaps(hookpolicy.load(path), rank=0)
    governed = Governed(model, hookpolicy.load(path).attach(model, registry=CollectorRegistry(), rank=0),
                        generation=0)

    def attach(policies: PolicySet, module: nn.Module, step: int, generation: int) -> Any:
        return policies.attach(module, registry=CollectorRegistry(), rank=0, start_step=step)

    try:
        for i, (x, y) in enumerate(data() if steps is None else steps):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if i == reload_after and after is not None:
                path.write_text(after)
                swaps.request(hookpolicy.load(path))
                assert swaps.next is not None
                swaps._swap(governed, [governed], attach, *swaps.next)
    finally:
        governed.attached.remove()
    return model


def by_hand(factor: Callable[[int], float], batches: Optional[list[Any]] = None) -> nn.Module:
    model, optimizer = build()
    for i, (x, y) in enumerate(data() if batches is None else batches):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        kept = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * factor(i)
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, kept):
            g["lr"] = lr
    return model


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


COOL = rule("cool", 2, 2, "cool_down, cool_down: {factor: 0.1, steps: 8}")


def test_a_reload_that_leaves_the_rule_keeps_its_cool_down(tmp_path: Path) -> None:
    """x0.1 from step 2 to 9; an annotation edited and reloaded after step 4: still x0.1 until step 9."""
    model = run(tmp_path, text(COOL), text(COOL, note="second"), reload_after=4)
    assert_same(model, by_hand(lambda i: 0.1 if 2 <= i <= 9 else 1.0))


def test_a_reload_that_changes_the_rule_ends_its_cool_down_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    changed = COOL.replace("factor: 0.1", "factor: 0.2")
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        model = run(tmp_path, text(COOL), text(changed, note="second"), reload_after=4)
    assert_same(model, by_hand(lambda i: 0.1 if 2 <= i <= 4 else 1.0))
    said = [r.getMessage() for r in caplog.records if "cool-down" in r.getMessage() and "ends" in r.getMessage()]
    assert len(said) == 1 and "p/cool" in said[0], said


def test_a_reload_that_removes_the_rule_ends_its_cool_down(tmp_path: Path) -> None:
    other = rule("other", 100, 100, "log")
    model = run(tmp_path, text(COOL + other), text(other, note="second"), reload_after=4)
    assert_same(model, by_hand(lambda i: 0.1 if 2 <= i <= 4 else 1.0))


def test_a_reload_keeps_the_snapshots(tmp_path: Path) -> None:
    """Snapshots after steps 1 and 3; reloaded after step 4; the rewind at step 5 goes back to the one after 3."""
    rewind = rule("back", 5, 5, "rewind")
    model = run(tmp_path, text(rewind), text(rewind, note="second"), reload_after=4)
    batches = data()
    assert_same(model, by_hand(lambda i: 1.0, batches[:4] + batches[6:]))


def test_a_reload_keeps_the_rewind_count(tmp_path: Path) -> None:
    """max_rewinds: 1, the rule fires at steps 5..7; reloaded after the rewind of step 5: it halts at step 6,
    as without the reload (a count started again would rewind at 6 and halt at 7)."""
    rewind = rule("back", 5, 7, "rewind, rewind: {max_rewinds: 1}")
    with pytest.raises(Halt) as info:
        run(tmp_path, text(rewind), text(rewind, note="second"), reload_after=5)
    assert (info.value.rule, info.value.step) == ("back", 6)
