"""What `target: loss` costs: per backward call, and per training step.

    python bench/loss_rule.py            # about a minute on 2 CPU cores

1. Per backward call (`Linear(8, 8)` on one row, `out.sum().backward()`, 5,000 calls, the
   fastest of 7 rounds): torch alone; with the post-accumulate-grad hooks step tracking
   puts on every governed parameter (`steps.Scopes`, two here); with those and the
   wrapped `torch.autograd.backward` feeding an active loss rule (`loss.LossTap`): the
   root's value detached before the call, handed to the model after it.
2. Per training step of the bundled tiny GPT (`examples.charlm`, AdamW, batch 16 x 32),
   interleaved, medians over 100 steps: no policy; the loss policy attached but not active
   (`steps: {from: 10**9}`); a `target: loss` capture and NaN alert on the root the
   script backpropagates, the model's `(logits, loss)`; the same with the loss computed
   by an `nn.CrossEntropyLoss()` module in the script; the policy with `every: 10`; for
   comparison, the same capture and alert on one small gradient (`lm_head.bias`,
   `target: grad`).
Timings are printed, never asserted.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from prometheus_client import CollectorRegistry
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from timing import step_table  # noqa: E402
from examples.charlm import batch, build_model, encode  # noqa: E402
from hookpolicy.engine.hooks.loss import LossTap  # noqa: E402
from hookpolicy.engine.execute.steps import Scopes  # noqa: E402

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: bench}
spec:
  rules:
    - name: loss
      match: {root: true}
      trigger: {at: step, every: EVERY, steps: {from: FROM}}
      target: loss
      actions:
        - capture: {stats: [mean, max, nonfinite, numel]}
        - alert: {if: "nonfinite > 0", then: skip_step}
"""


#: for comparison: the same two actions on one small gradient (lm_head's bias) instead of the loss
GRAD_POLICY = POLICY.replace("match: {root: true}", "match: {modules: [lm_head], params: [bias]}").replace(
    "target: loss", "target: grad")


def per_call_us(call: Callable[[], object], calls: int = 5000, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)  # the least disturbed round: the machine is shared


def backward_calls() -> None:
    layer, x = nn.Linear(8, 8), torch.randn(1, 8)

    def backward() -> None:
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)

    bare = per_call_us(backward)
    scopes = Scopes(lambda: list(layer.parameters()))
    hooked = per_call_us(backward)
    tap = LossTap("bench", scopes)
    tap.set_active(True)
    wrapped = per_call_us(backward)
    tap.remove()
    scopes.remove()
    print(f"per backward call: torch alone {bare:.2f} us; with the parameters' post-accumulate-grad hooks "
          f"{hooked:.2f} us (+{hooked - bare:.2f} for 2 parameters); and the wrapped torch.autograd.backward "
          f"of an active loss rule {wrapped:.2f} us (+{wrapped - hooked:.2f})")


def steps(rounds: int = 100) -> None:
    torch.manual_seed(0)
    data = encode()
    x, y = batch(data, torch.randint(0, len(data) - 33, (16,)), 32)
    folder = Path(tempfile.mkdtemp())
    variants: dict[str, Callable[[], None]] = {}
    registries: dict[str, CollectorRegistry] = {}
    for key, every, start, module_loss in (
            ("none", None, 0, False), ("not active", 1, 10**9, False), ("output", 1, 0, False),
            ("module", 1, 0, True), ("output every 10", 10, 0, False), ("grad, for comparison", 1, 0, False)):
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        criterion = nn.CrossEntropyLoss()

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt, criterion: nn.Module = criterion,
                 module_loss: bool = module_loss) -> None:
            if module_loss:
                logits, _ = model(x)
                loss = criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            else:
                _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        if every is not None:
            path = folder / f"{key.replace(' ', '-')}.yaml"
            text = GRAD_POLICY if key.startswith("grad") else POLICY
            path.write_text(text.replace("EVERY", str(every)).replace("FROM", str(start)))
            registries[key] = CollectorRegistry()
            hookpolicy.load(path).attach(model, registry=registries[key])
        variants[key] = step
    step_table(variants, rounds, lambda key: registries[key].get_sample_value(
        "hookpolicy_hook_seconds_total", {"policy": "bench", "rule": "loss", "model": "TinyGPT", "rank": "0"}
    ) if key in registries else None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    backward_calls()
    steps()
