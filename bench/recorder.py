"""What the flight recorder's ring (`capture.keep`) costs per training step, on a 96-layer model.

    python bench/recorder.py            # about a minute on 2 CPU cores; also part of bench/run.py

A 96-layer MLP (96 `Linear(256, 256)` with ReLU between, batch 64, SGD), every step,
timed interleaved: no policy (the floor); a capture of the gradient's `l2_norm`, `abs_max`
and `nonfinite` per module exported to Prometheus (capture without keep); the same kept in
a ring of 200 steps instead (`keep.export: false`); and both (`keep.export: true`). Each
as a ratio to the floor and to the capture without keep, wall and CPU time, with the
ring's entries and bytes counted at the end. Timings are reported, never asserted.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from timing import Summary, interleave, summarize  # noqa: E402
from variants import Variant  # noqa: E402

LAYERS, WIDTH, BATCH, STEPS_KEPT = 96, 256, 64, 200

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: bench-recorder}
spec:
  rules:
    - name: layers
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm, abs_max, nonfinite], per: module KEEP}
"""

#: variant -> (label, the capture's keep; None: no policy)
VARIANTS: dict[str, tuple[str, str | None]] = {
    "floor": ("no policy (the floor)", None),
    "capture": ("capture, exported (no keep)", ""),
    "keep": (f"capture kept in a ring of {STEPS_KEPT} steps, not exported", f", keep: {{steps: {STEPS_KEPT}}}"),
    "both": ("capture kept and exported", f", keep: {{steps: {STEPS_KEPT}, export: true}}"),
}


@dataclass
class RecorderResult:
    rows: dict[str, tuple[str, Summary, Summary]]  # key -> (label, wall, CPU) per step
    ring_steps: int
    ring_bytes: int
    modules: int

    def ratio(self, key: str, base: str, cpu: bool = False) -> float:
        pick = 2 if cpu else 1
        return self.rows[key][pick].median / self.rows[base][pick].median  # type: ignore[union-attr]


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if i < LAYERS - 1 else [])
    return nn.Sequential(*layers)


def measure_recorder(rounds: int, warmup: int) -> RecorderResult:
    folder = Path(tempfile.mkdtemp())
    x = torch.randn(BATCH, WIDTH)
    variants: list[Variant] = []
    attached: dict[str, hookpolicy.Attached] = {}
    for key, (label, keep) in VARIANTS.items():
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step(net: nn.Module = net, opt: torch.optim.Optimizer = opt) -> None:
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        close: Callable[[], None] = lambda: None
        if keep is not None:
            path = folder / f"{key}.yaml"
            path.write_text(POLICY.replace(" KEEP", keep))
            from prometheus_client import CollectorRegistry

            attached[key] = hookpolicy.load(path).attach(net, registry=CollectorRegistry(), rank=0)
            close = attached[key].remove
        variants.append(Variant(key, label, step, close))
    samples = interleave(variants, rounds, warmup, cuda=False)
    ring = attached["keep"].recorder.rings[(("bench-recorder", "layers"), 0)]
    result = RecorderResult(
        {v.key: (v.label, summarize(samples[v.key].times), summarize(samples[v.key].cpu)) for v in variants},
        len(ring.steps), ring.bytes, len(ring.steps[-1].groups))
    for v in variants:
        v.close()
    return result


def lines(r: RecorderResult) -> list[str]:
    """The terminal lines of the result (bench/run.py prints them too)."""
    out = [f"flight recorder on a {LAYERS}-layer MLP (Linear({WIDTH}, {WIDTH}), batch {BATCH}, SGD), every step: "
           f"the ring held {r.ring_steps} steps x {r.modules} modules x 3 stats = {r.ring_bytes} bytes"]
    for key, (label, wall, cpu) in r.rows.items():
        vs_capture = "" if key in ("floor", "capture") else \
            f"  x{r.ratio(key, 'capture'):.3f} of capture (CPU x{r.ratio(key, 'capture', True):.3f})"
        out.append(f"  {label:52s} {wall.median * 1e3:7.2f} ms  x{r.ratio(key, 'floor'):.3f} of floor "
                   f"(CPU x{r.ratio(key, 'floor', True):.3f}){vs_capture}")
    return out


def markdown(r: RecorderResult) -> list[str]:
    out = ["## The flight recorder's ring", "",
           f"`bench/recorder.py`: a {LAYERS}-layer MLP (`Linear({WIDTH}, {WIDTH})`, batch {BATCH}, SGD), a capture "
           f"of `l2_norm`, `abs_max` and `nonfinite` of every layer's gradient every step; the ring held "
           f"{r.ring_steps} steps x {r.modules} modules x 3 stats = {r.ring_bytes:,} bytes at the end.", "",
           "| variant | median ms/step | x floor | x floor, CPU | x capture | x capture, CPU |",
           "|---|---:|---:|---:|---:|---:|"]
    for key, (label, wall, _) in r.rows.items():
        rel = ("", "") if key in ("floor", "capture") else (f"{r.ratio(key, 'capture'):.3f}",
                                                           f"{r.ratio(key, 'capture', True):.3f}")
        out.append(f"| {label} | {wall.median * 1e3:.2f} | {r.ratio(key, 'floor'):.3f} | "
                   f"{r.ratio(key, 'floor', True):.3f} | {rel[0]} | {rel[1]} |")
    return out + [""]


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("\n".join(lines(measure_recorder(60, 5))))
