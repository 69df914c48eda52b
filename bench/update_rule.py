"""What `target: update` and `target: optimizer_state` cost per training step.

    python bench/update_rule.py          # about a minute on 2 CPU cores

Per training step of the bundled tiny GPT (`examples.charlm`, AdamW, batch 16 x 32),
interleaved, medians over 100 steps: no policy; an update rule attached but not active
(`steps: {from: 10**9}`: no copy is made); `update` with `l2_norm` and `update_ratio` per
module over every parameter, every step (a copy of every parameter before each update);
the same with `every: 10`; `optimizer_state` (`exp_avg_sq`, `l2_norm` and `max`) every
step (no copy); for comparison, the same capture on `target: grad`. Timings are printed,
never asserted.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from timing import step_table  # noqa: E402
from examples.charlm import batch, build_model, encode  # noqa: E402

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: bench}
spec:
  rules:
    - name: rule
      match: {modules: ["**"]MATCH}
      trigger: {at: step, every: EVERY, steps: {from: FROM}}
      target: TARGET
      actions:
        - capture: {stats: [STATS]}
"""

#: variant -> (target, stats, every, from, extra match keys)
VARIANTS = {
    "not active": ("update", "l2_norm, update_ratio", 1, 10**9, ""),
    "update": ("update", "l2_norm, update_ratio", 1, 0, ""),
    "update every 10": ("update", "l2_norm, update_ratio", 10, 0, ""),
    "optimizer_state": ("optimizer_state", "l2_norm, max", 1, 0, ", state: [exp_avg_sq]"),
    "grad, for comparison": ("grad", "l2_norm", 1, 0, ""),
}


def steps(rounds: int = 100) -> None:
    torch.manual_seed(0)
    data = encode()
    x, y = batch(data, torch.randint(0, len(data) - 33, (16,)), 32)
    folder = Path(tempfile.mkdtemp())
    variants: dict[str, Callable[[], None]] = {}
    registries: dict[str, CollectorRegistry] = {}
    for key in ("none", *VARIANTS):
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        if key in VARIANTS:
            target, stats, every, start, match = VARIANTS[key]
            path = folder / f"{key.replace(' ', '-').replace(',', '')}.yaml"
            path.write_text(POLICY.replace("TARGET", target).replace("STATS", stats).replace("EVERY", str(every))
                            .replace("FROM", str(start)).replace("MATCH", match))
            registries[key] = CollectorRegistry()
            hookpolicy.load(path).attach(model, registry=registries[key])
        variants[key] = step
    params = sum(p.numel() for p in build_model().parameters())
    print(f"model: {params} parameters ({params * 4 / 2**20:.2f} MiB in float32, the copy an active update rule makes)")
    step_table(variants, rounds, lambda key: registries[key].get_sample_value(
        "hookpolicy_hook_seconds_total", {"policy": "bench", "rule": "rule", "model": "TinyGPT", "rank": "0"}
    ) if key in registries else None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    steps()
