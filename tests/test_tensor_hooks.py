"""`engine/hooks/tensor_hooks.add` against `Tensor.register_hook` itself: the same calls, order and gradients."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hookpolicy.engine.hooks import tensor_hooks

Hook = Callable[[torch.Tensor], Optional[torch.Tensor]]


def _run(register: Callable[[torch.Tensor, Hook], Any], leaf: bool) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """A graph whose middle tensor (or a leaf) carries a user's hooks and added ones; what each saw, and x.grad.

    An added hook comes first (it makes the tensor's hook dict), the user's first hook doubles the gradient and its handle removes a third user hook; the
    added hooks record and one of them scales what flows on. `register` adds the two hooks
    (`tensor_hooks.add`, or `register_hook` as the reference)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 4).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    seen: list[tuple[str, torch.Tensor]] = []
    t = x if leaf else lin(x)
    register(t, lambda g: seen.append(("ours first", g.clone())))  # type: ignore[func-returns-value]  # makes the dict
    first = t.register_hook(lambda g: g * 2)
    gone = t.register_hook(lambda g: seen.append(("removed", g.clone())))  # type: ignore[func-returns-value]
    register(t, lambda g: seen.append(("ours", g.clone())))  # type: ignore[func-returns-value]
    register(t, lambda g: g * 3)
    t.register_hook(lambda g: seen.append(("user after", g.clone())))  # type: ignore[func-returns-value]
    register(t, lambda g: seen.append(("ours again", g.clone())))  # type: ignore[func-returns-value]
    gone.remove()
    assert first is not None
    (lin(t) ** 2).sum().backward() if leaf else (t * t).sum().backward()
    assert x.grad is not None
    return seen, x.grad


@pytest.mark.parametrize("leaf", [False, True], ids=["non-leaf", "leaf"])
def test_an_added_hook_runs_as_register_hook_s_would(leaf: bool) -> None:
    seen, grad = _run(tensor_hooks.add, leaf)
    want_seen, want_grad = _run(lambda t, hook: t.register_hook(hook), leaf)
    assert [name for name, _ in seen] == [name for name, _ in want_seen] == ["ours first", "ours", "user after", "ours again"]
    for (_, got), (_, want) in zip(seen, want_seen):
        assert torch.equal(got, want)
    assert torch.equal(grad, want_grad)
    # the hooks took effect: doubled, then tripled, on the way down
    assert torch.equal(seen[1][1], seen[0][1] * 2) and torch.equal(seen[2][1], seen[1][1] * 3)


def test_a_user_s_handle_removes_only_its_own_hook() -> None:
    x = torch.randn(4, requires_grad=True)
    t = x * 2
    calls: list[str] = []
    theirs = t.register_hook(lambda g: calls.append("theirs"))  # type: ignore[func-returns-value]
    tensor_hooks.add(t, lambda g: calls.append("ours"))  # type: ignore[func-returns-value]
    later = t.register_hook(lambda g: calls.append("later"))  # type: ignore[func-returns-value]
    theirs.remove()
    later.remove()
    theirs.remove()  # twice, as a handle allows
    t.sum().backward()
    assert calls == ["ours"]


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_the_registration() -> None:
    x = torch.randn(4, requires_grad=True)
    t = x * 2
    calls: list[torch.Tensor] = []
    with _Seen() as mode:
        tensor_hooks.add(t, lambda g: calls.append(g))  # type: ignore[func-returns-value]
    assert torch.Tensor.register_hook in mode.funcs
    t.sum().backward()
    assert len(calls) == 1 and torch.equal(calls[0], torch.ones(4))


GRAD_OUTPUT = """
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: compiled}
spec:
  rules:
    - name: grads
      match: {types: [Linear]}
      trigger: {at: backward}
      target: grad_output
      actions:
        - capture: {stats: [l2_norm, abs_max]}
"""


@pytest.mark.slow
def test_a_compiled_model_s_grad_output_is_register_hook_s_without_a_graph_break_of_its_own(tmp_path: Any) -> None:
    """Under `torch.compile` Dynamo traces the forward hook; `add` then goes through `register_hook`, which
    Dynamo knows (writing `_backward_hooks` would break the graph). Each step's grad_output norm and abs max
    are those of the gradients a `register_hook` on an uncompiled twin saw."""
    import hookpolicy
    from prometheus_client import CollectorRegistry
    from torch._dynamo.utils import counters

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    model, twin = build(), build()
    path = tmp_path / "policy.yaml"
    path.write_text(GRAD_OUTPUT)
    registry = CollectorRegistry()
    attached = hookpolicy.load(path).attach(model, registry=registry)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(3):
            compiled(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            seen: dict[str, torch.Tensor] = {}
            first = twin[0](x)
            first.register_hook(lambda g: seen.__setitem__("0", g.clone()))  # type: ignore[func-returns-value]
            last = twin[2](twin[1](first))
            last.register_hook(lambda g: seen.__setitem__("2", g.clone()))  # type: ignore[func-returns-value]
            last.square().sum().backward()
            twin_opt.step()
            twin_opt.zero_grad()
            for module, grad in seen.items():
                labels = {"model": "Sequential", "policy": "compiled", "rule": "grads", "module": module, "tensor": "",
                          "rank": "0"}
                norm = registry.get_sample_value("hookpolicy_grad_output_l2_norm", labels)
                top = registry.get_sample_value("hookpolicy_grad_output_abs_max", labels)
                assert norm == pytest.approx(float(torch.linalg.vector_norm(grad.double())), rel=1e-6)
                assert top == float(grad.abs().max())
    finally:
        attached.remove()
    assert not [reason for reason in counters["graph_break"] if "_backward_hooks" in reason]
