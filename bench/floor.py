"""The floor of `monitor.yaml` every step: its statistics' kernels alone, without hookpolicy (issue 36).

    python bench/floor.py [--workload nanogpt] [--rounds 150] [--threads 2]
    python bench/floor.py --stats seed --workload lstm   # the seed's six: kernels alone against its monitor

Three copies of one model train in turns, in one process, as `bench/run.py` times them: the
loop without hooks, the same loop with plain torch hooks that launch exactly the operators
`monitor.yaml`'s statistics need on a CPU and nothing else, and the loop under `monitor.yaml`.
The kernels-only loop is what no machinery could beat with these statistics:

- every Linear's output (`l2_norm, abs_max, nonfinite`): its sum of squares (`dot` of the
  flat tensor with itself) and `aminmax` (a finite minimum and maximum prove the count of
  non-finite elements is 0, as hookpolicy's CPU path proves it);
- every Linear's grad_output (`l2_norm, abs_max`): the same two kernels, in a tensor hook
  on the output, as hookpolicy registers it;
- every parameter's gradient at the step (`l2_norm, nonfinite`): one `_foreach_norm`.

Its results are kept in a list and never read, combined or published. Printed: each loop's
median step (wall time) over the floor's with a 95% bootstrap interval, and the share of
hookpolicy's overhead the kernels account for; give the load with the numbers.

`--stats seed` does the same for `seed-stats.yaml` (the seed's six statistics of every Linear
output and grad_output): the kernels of `stats.host_row`'s row (`aminmax`, `dot`, `sum`, the
deviations' `sub` into a scratch buffer and their `dot`, `ne` into the scratch and its `sum`),
and adds the seed's hand-written `GradientMonitor` (`bench/monitors.py`), whose overhead the
goal wants hookpolicy's to be a third of: it prints the kernels' overhead as a share of it,
the lowest share any machinery around these kernels could reach.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).parent))
from models import WORKLOADS  # noqa: E402
from timing import bootstrap_ratio, bootstrap_share, interleave, quantile, resampled_median  # noqa: E402
from variants import Variant, build_variants  # noqa: E402


def kernels_only(floor: Variant, seed: bool = False) -> Variant:
    """`floor`'s model and loop with hooks that run monitor.yaml's kernels (with `seed`, seed-stats.yaml's) and keep
    what they return, unread."""
    assert floor.model is not None
    kept: list[Any] = []
    zero = torch.zeros(())  # as host_row compares: with a 0-d tensor, not a Python 0 cast at every call

    def reduce(t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        kept.append(torch.dot(flat, flat))
        kept.append(torch.aminmax(flat))
        if seed:
            total = torch.sum(flat)
            scratch = torch.sub(flat, total, alpha=1.0 / flat.numel())
            kept.append(torch.dot(scratch, scratch))
            kept.append(torch.sum(torch.ne(flat, zero, out=scratch)))

    def forward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        reduce(out)
        if out.requires_grad:
            out.register_hook(lambda g: reduce(g))

    handles = [m.register_forward_hook(forward) for m in floor.model.modules() if isinstance(m, nn.Linear)]
    params = [p for p in floor.model.parameters() if p.requires_grad]

    def step() -> None:
        kept.clear()
        floor.step()  # the step pre-hook below reduces the gradients before the update

    def at_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt.param_groups[0]["params"][0] is not params[0]:  # torch's step hooks are global: another loop's step
            return
        kept.append(torch._foreach_norm([p.grad for p in params if p.grad is not None]))

    if not seed:  # seed-stats.yaml has no step rule
        handles.append(register_optimizer_step_pre_hook(at_step))

    def close() -> None:
        for h in handles:
            h.remove()
    which = "seed-stats.yaml" if seed else "monitor.yaml"
    return Variant("kernels", f"{which}'s kernels by hand, unread", step, close, model=floor.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workload", default="nanogpt", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stats", default="monitor", choices=["monitor", "seed"],
                        help="monitor.yaml's statistics, or the seed's six (seed-stats.yaml, against the seed's monitor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    seed = args.stats == "seed"
    keys = ["floor", "floor", "hp_seed", "seed"] if seed else ["floor", "floor", "hp"]
    floor, kernel_base, *others = build_variants(WORKLOADS[args.workload], torch.device("cpu"), keys)
    kernels = kernels_only(kernel_base, seed)
    variants = [floor, kernels, *others]
    samples = interleave(variants, args.rounds, args.warmup, cuda=False)
    base = samples["floor"].times
    f50 = quantile(base, 0.5)
    print(f"{args.workload}, {args.threads} torch threads, {args.rounds} rounds, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    medians = {}
    for v in variants:
        times = samples[v.key].times
        medians[v.key] = quantile(times, 0.5)
        lo, hi = bootstrap_ratio(resampled_median(times), resampled_median(base)) if v.key != "floor" else (1.0, 1.0)
        print(f"  {v.label:50s} {medians[v.key] * 1e3:8.2f} ms  x{medians[v.key] / f50:.3f}  (95%: {lo:.3f}-{hi:.3f})")
    over_hp, over_k = medians[others[0].key] - f50, medians["kernels"] - f50
    if over_hp > 0:
        print(f"  the kernels are {over_k * 1e3:.2f} ms of hookpolicy's {over_hp * 1e3:.2f} ms overhead"
              f" ({over_k / over_hp:.0%}); the machinery {(over_hp - over_k) * 1e3:.2f} ms")
    if seed and medians["seed"] > f50:
        over_seed = medians["seed"] - f50
        lo, hi = bootstrap_share(samples["kernels"].times, samples["seed"].times, base)
        print(f"  the kernels alone are {over_k / over_seed:.2f} (95%: {lo:.2f}-{hi:.2f}) of the seed monitor's "
              f"{over_seed * 1e3:.2f} ms overhead; hookpolicy's share is {over_hp / over_seed:.2f} (goal <= 0.33)")
    for v in variants:
        v.close()


if __name__ == "__main__":
    main()
