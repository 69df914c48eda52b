"""CPU time spent inside hookpolicy per step, robust to a busy machine (issue 36).

    python bench/inside_cpu.py            # GPT, nanoGPT, CNN, LSTM: monitor.yaml and seed-stats.yaml
    python bench/inside_cpu.py --workloads nanogpt cnn  # the same on these workloads
    python bench/inside_cpu.py --publish  # also the step that publishes 10,000 series, split
    python bench/inside_cpu.py --split nanogpt  # monitor.yaml's step cost: the statistics and the rest
    python bench/inside_cpu.py --entries nanogpt cnn --against /work/main  # all of hookpolicy's CPU, two trees A/B

hookpolicy's own `hookpolicy_hook_seconds_total` is wall time: on a shared machine it
counts the time other processes held the core. Here the hook bodies and the read-back are
timed with `time.thread_time` instead (one torch thread), so preemption does not count;
contention for caches and the core's other hyperthread still does, so compare two trees
by running this alternately, twice each. `--publish` times, in CPU time, the optimizer
step of `bench/models.py:wide_model` under `policies/scrape.yaml` (10,000 series) against
the same step without a policy, split into computing the statistics (the step rules) and
publishing them (the read-back, `timing.readback_cpu`: fetch, finish or hand over, alerts, the store).
`--split` steps, interleaved, the floor, `monitor.yaml`, `monitor.yaml` with its statistics not
computed (every hook, the ledger, the read-back and the publishing run on rows of placeholder
partials that prove every element finite) and a second floor (the A/A spread), and gives each
one's median CPU time per step over the floor: what the statistics' operators cost against what
hookpolicy's machinery around them does.
`--entries` times hookpolicy at every entry point torch calls (module hooks, tensor hooks, the
post-accumulate-grad hooks, the end-of-backward callbacks, the optimizer step hooks): all of its
CPU, the walk and the dispatch around the hook bodies included, which `hookpolicy_hook_seconds`
leaves out. With `--against DIR` the hookpolicy package of another tree (a copy of main, say)
is loaded beside this one under another name, both are attached to copies of one model, and
their steps are interleaved in one process: an A/B that two processes on a busy machine cannot
resolve (the process-wide patches of both copies are in, each answering only for its own model).
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib
import sys
import time
import types
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from hookpolicy.engine.decide import readback  # noqa: E402
from hookpolicy.engine.execute import programs  # noqa: E402
from models import WORKLOADS, wide_model  # noqa: E402
from timing import other_tree, readback_cpu  # noqa: E402
from variants import POLICIES, build_variants  # noqa: E402


def inside(steps: dict[str, int]) -> None:
    cpu = types.SimpleNamespace(perf_counter=time.thread_time, time=time.time)
    programs.time = cpu  # type: ignore[attr-defined]  # Faults.guarded's timer
    readback.time = cpu  # type: ignore[attr-defined]  # the read-back's
    for name, n in steps.items():
        variants = build_variants(WORKLOADS[name], torch.device("cpu"), ["hp", "hp_seed"])
        for _ in range(3):
            for v in variants:
                v.step()
        seconds = [0.0] * len(variants)
        for k, v in enumerate(variants):
            seconds[k] = -sum(v.attached.store.store.snapshot()[0]["hookpolicy_hook_seconds"].values())  # type: ignore[union-attr]
        for _ in range(n):
            for v in variants:
                v.step()
        shown = []
        for k, v in enumerate(variants):
            seconds[k] += sum(v.attached.store.store.snapshot()[0]["hookpolicy_hook_seconds"].values())  # type: ignore[union-attr]
            shown.append(f"{v.key} {seconds[k] / n * 1e3:.2f} ms")
            v.close()
        print(f"{name}: CPU inside hookpolicy per step: {', '.join(shown)}", flush=True)


def publish(repeats: int = 7) -> None:
    model = wide_model()
    x = torch.randn(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    split: dict[str, list[float]] = {"compute": [], "publish": []}

    def steps(n: int) -> float:
        out = []
        for _ in range(n):
            model(x).square().mean().backward()
            start = time.thread_time()
            opt.step()
            out.append(time.thread_time() - start)
            opt.zero_grad(set_to_none=True)
        return sorted(out)[len(out) // 2]

    plain = steps(repeats)
    run = programs.Programs.run_step_rules

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.thread_time()
        try:
            return run(*args, **kwargs)
        finally:
            split["compute"].append(time.thread_time() - start)

    programs.Programs.run_step_rules = timed  # type: ignore[method-assign]
    try:
        with readback_cpu() as spent, \
                hookpolicy.load(POLICIES / "scrape.yaml").attach(model, registry=CollectorRegistry()):
            steps(2)  # the first step admits the series (maxSeries); the next ones hand their values over
            split["compute"].clear()
            governed = []
            for _ in range(repeats):
                spent[0] = 0.0
                governed.append(steps(1))
                split["publish"].append(spent[0])
    finally:
        programs.Programs.run_step_rules = run  # type: ignore[method-assign]
    med = {k: sorted(v)[len(v) // 2] for k, v in split.items()}
    step = sorted(governed)[len(governed) // 2]
    print(f"10,000 series: the step {step * 1e3:.1f} ms CPU against {plain * 1e3:.1f} ms without a policy; "
          f"computing the statistics {med['compute'] * 1e3:.1f} ms, publishing them {med['publish'] * 1e3:.1f} ms")


def split(name: str, rounds: int) -> None:
    real, real_row = programs.host_partials, programs.host_row

    def unserved(t, plan):  # type: ignore[no-untyped-def]
        return None  # a hook's one tensor goes to host_partials: placeholders too

    def placeholders(tensors, kinds, references=None):  # type: ignore[no-untyped-def]
        return [[float(t.numel()) if k == "finite" else 1.0 for k in kinds] for t in tensors]

    variants = build_variants(WORKLOADS[name], torch.device("cpu"), ["floor", "hp", "hp", "floor"])
    keys = ["floor", "monitor.yaml", "without statistics", "floor again"]

    def step(k: int) -> float:
        programs.host_partials = placeholders if k == 2 else real  # type: ignore[assignment]
        programs.host_row = unserved if k == 2 else real_row  # type: ignore[assignment]  # to host_partials
        start = time.thread_time()
        try:
            variants[k].step()
        finally:
            programs.host_partials = real  # type: ignore[assignment]
            programs.host_row = real_row  # type: ignore[assignment]
        return time.thread_time() - start

    for _ in range(3):
        for k in range(len(variants)):
            step(k)
    seconds: list[list[float]] = [[] for _ in variants]
    for r in range(rounds):
        for i in range(len(variants)):
            k = (i + r) % len(variants)  # rotate who goes first
            seconds[k].append(step(k))
    for v in variants:
        v.close()
    med = [sorted(s)[len(s) // 2] * 1e3 for s in seconds]
    print(f"{name}: CPU per step, median of {rounds}: " + ", ".join(
        f"{key} {m:.2f} ms (+{m - med[0]:.2f})" for key, m in zip(keys, med)), flush=True)


#: (module under the package, class, method): every place torch calls into hookpolicy on a training step
ENTRIES = [
    ("engine.execute.executor", "Executor", "pre_hook"), ("engine.execute.executor", "Executor", "post_hook"),
    ("engine.execute.executor", "Executor", "_grad_hook"), ("engine.execute.steps", "Scopes", "_wrote"),
    ("engine.cycle", "StepCycle", "_pre_hook"), ("engine.cycle", "StepCycle", "_post_hook"),
    ("engine.cycle", "StepCycle", "_grad_hook"), ("engine.cycle", "StepCycle", "_pass_ends"),
    ("engine.cycle", "StepCycle", "_pass_ended"), ("engine.cycle", "StepCycle", "before_update"),
    ("engine.cycle", "StepCycle", "after_update"),
]


def _timed_entries(package: types.ModuleType, spent: dict[str, float]) -> None:
    """Wrap `package`'s entry points (before it attaches: hooks bind them then) to add their CPU time to `spent`."""
    for module, cls, attr in ENTRIES:
        owner = getattr(importlib.import_module(f"{package.__name__}.{module}"), cls)
        original = getattr(owner, attr, None)
        if original is None:  # not in this tree (Scopes._wrote: since session 6 a hook that runs no Python)
            continue

        def timed(*args, _f=original, _attr=attr, **kwargs):  # type: ignore[no-untyped-def]
            start = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_attr] += time.thread_time() - start

        setattr(owner, attr, timed)


def entries(names: list[str], rounds: int, against: str | None, policy: str) -> None:
    packages: list[types.ModuleType] = [hookpolicy]
    if against is not None:
        packages.insert(0, other_tree(against))
    spent = [collections.defaultdict(float) for _ in packages]
    for package, into in zip(packages, spent):
        _timed_entries(package, into)
    for name in names:
        workload = WORKLOADS[name]
        torch.manual_seed(0)
        base = workload.build()
        x, y = workload.batch(torch.Generator().manual_seed(0), torch.device("cpu"))
        steps, handles = [], []
        models = [copy.deepcopy(base) for _ in packages]  # before any attaches: each copy patches Module's reduce
        for package, model in zip(packages, models):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            handles.append(package.load(POLICIES / policy).attach(model, registry=CollectorRegistry()))

            def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
                workload.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps.append(step)
        for _ in range(3):
            for step in steps:
                step()
        totals: list[list[float]] = [[] for _ in packages]
        per: list[dict[str, list[float]]] = [collections.defaultdict(list) for _ in packages]
        for r in range(rounds):
            for i in range(len(packages)):
                k = (i + r) % len(packages)  # rotate who goes first
                spent[k].clear()
                steps[k]()
                totals[k].append(sum(spent[k].values()))
                for attr, seconds in spent[k].items():
                    per[k][attr].append(seconds)
        for handle in reversed(handles):  # last in, first out: the copies' patches of torch nest
            handle.remove()
        med = [sorted(t)[len(t) // 2] * 1e3 for t in totals]
        label = ["this tree"] if against is None else [against, "this tree"]
        print(f"{name} {policy}: hookpolicy's CPU at its entry points per step, median of {rounds}: " + ", ".join(
            f"{lab} {m:.2f} ms" for lab, m in zip(label, med)), flush=True)
        for attr in per[-1]:
            print(f"    {attr}: " + " / ".join(f"{sorted(p[attr])[len(p[attr]) // 2] * 1e3:.3f}" for p in per), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--publish", action="store_true", help="also the 10,000-series step, split")
    parser.add_argument("--split", metavar="WORKLOAD", help="only monitor.yaml's step cost split (gpt, nanogpt, ...)")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of --split and --entries")
    parser.add_argument("--entries", nargs="+", metavar="WORKLOAD",
                        help="only hookpolicy's CPU at its entry points on these workloads (nanogpt, cnn, ...)")
    parser.add_argument("--against", metavar="DIR", help="with --entries: A/B against the hookpolicy of the tree DIR")
    parser.add_argument("--policy", default="monitor.yaml", help="with --entries: the policy in bench/policies")
    parser.add_argument("--workloads", nargs="+", default=["gpt", "nanogpt", "cnn", "lstm"], metavar="WORKLOAD",
                        help="the workloads of the default run (gpt, nanogpt, cnn, lstm)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {open('/proc/loadavg').read().split()[0]}", flush=True)
    if args.split:
        split(args.split, args.rounds)
        return
    if args.entries:
        entries(args.entries, args.rounds, args.against, args.policy)
        return
    steps = {"gpt": 6, "nanogpt": 20, "cnn": 40, "lstm": 20}
    inside({name: steps.get(name, 20) for name in args.workloads})
    if args.publish:
        publish()


if __name__ == "__main__":
    main()
