"""What a checkpoint or a copy of a governed model costs: `torch.save`, `copy.deepcopy`, `state_dict()` (issue 36).

    python bench/save.py [--models wide nanogpt gpt] [--rounds 8] [--policy monitor.yaml] [--against DIR]

One process, one model at a time, timed in turns (the order rotates each round): the model
without a policy, then the same model object with the policy attached by this tree, and
with `--against DIR` attached by the hookpolicy of the tree DIR (loaded beside this one under
another name, as `inactive.py --against` does; only one policy is attached at a time, so only
one tree's `nn.Module.__reduce_ex__` filter is in). `wide` is `bench/models.py:wide_model`
(10,001 modules, 5,000 Linear layers: the filter runs once per module), the others are
`bench/models.py`'s workloads. `checkpoint` is `torch.save({"model": model.state_dict()})`, the
file nanoGPT, Lightning and HF write: no module is in it, so no module's `__reduce_ex__` runs.

Each turn attaches (not timed), runs one forward and backward so that the hooks are as in
training, then `gc.collect()` before the timed operations: the first full collection after an
attach walks every object the attach made, and that is the attach's cost, not the save's.
Each operation is timed in CPU time of this thread (one torch thread), and the time the
garbage collector ran inside it is counted apart (`gc.callbacks`): a full collection walks
the whole heap (the model, and the runtime of an attached policy) and comes at most once in a
few saves of a large model, so a median with it would be a coin toss. Printed per operation:
the median CPU time outside the collector, the collector's CPU time per operation averaged
over all turns, the full collections counted, and the governed ratio of the medians.
Then a checkpoint loop (`--in-a-row N`): N saves of the wide model in a row, one collection
before the first only, and the collector's CPU time per save over all of them (the share of
the full collections a loop of saves pays, whatever the save they fell in), each variant in a
fresh process of its own (`--processes` of them, in turns): the collector walks the whole
heap, so what an earlier variant left in a shared process would count against the next.

Checked on every turn: the governed `torch.save` and checkpoint write the bytes of the same
model's without a policy; a deep copy carries no hook more than the copy without a policy
(hookpolicy's are left out); `state_dict()` has the same keys and tensors.
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from models import WORKLOADS, wide_model  # noqa: E402
from collector import Collector  # noqa: E402
from timing import other_tree  # noqa: E402
from variants import POLICIES  # noqa: E402

#: "checkpoint": `torch.save({"model": model.state_dict()})`, the file nanoGPT, Lightning and HF write (no module in it)
OPERATIONS = ("torch.save", "deepcopy", "state_dict", "checkpoint")
#: a timed sample runs an operation this long at least (a small model's save is repeated, and averaged)
SAMPLE_S = 0.05
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def _model(name: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]:
    """The model and one training forward and backward of it (hooks fire as in training)."""
    g = torch.Generator().manual_seed(0)
    if name == "wide":
        model, x = wide_model(), torch.randn(16, 8, generator=g)
        return model, lambda m: m(x).square().mean().backward()
    wl = WORKLOADS[name]
    torch.manual_seed(0)
    model = wl.build()
    x, y = wl.batch(g, torch.device("cpu"))
    return model, lambda m: wl.loss(m(x), y).backward()  # type: ignore[no-untyped-call]


def _governed(model: torch.nn.Module, train: Callable[[torch.nn.Module], None], package: Optional[types.ModuleType],
              policy: str) -> Optional[Any]:
    """Attach `policy` with `package` (none: no policy), train once (hooks as in training), then a full collection."""
    attached = None
    if package is not None:
        attached = package.load(POLICIES / policy).attach(model, registry=CollectorRegistry())
    train(model)
    model.zero_grad(set_to_none=True)
    gc.collect()
    return attached


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(getattr(m, name) or ()) for m in model.modules() for name in HOOK_DICTS)


def _saved(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def measure(name: str, rounds: int, policy: str, packages: dict[str, Optional[types.ModuleType]]) -> None:
    model, train = _model(name)
    modules = sum(1 for _ in model.modules())
    train(model)
    model.zero_grad(set_to_none=True)
    reference = _saved(model)
    reference_checkpoint = _saved({"model": model.state_dict()})
    reference_hooks = _hooks(copy.deepcopy(model))
    reference_state = model.state_dict()
    operations: dict[str, Callable[[], object]] = {
        "torch.save": lambda: _saved(model), "deepcopy": lambda: copy.deepcopy(model), "state_dict": model.state_dict,
        "checkpoint": lambda: _saved({"model": model.state_dict()}),
    }
    outside: dict[str, dict[str, list[float]]] = {label: {op: [] for op in OPERATIONS} for label in packages}
    #: label -> operation -> [the collector's CPU time, full collections], summed over the counted rounds
    collected: dict[str, dict[str, list[float]]] = {label: {op: [0.0, 0] for op in OPERATIONS} for label in packages}
    repeats = dict.fromkeys(OPERATIONS, 1)
    collector = Collector()
    labels = list(packages)
    try:
        for turn in range(rounds + 1):  # the first round warms up and is not counted
            for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
                attached = _governed(model, train, packages[label], policy)
                try:
                    for op in OPERATIONS:
                        spent, full = collector.spent, collector.full
                        start = time.thread_time()
                        for _ in range(repeats[op]):
                            result = operations[op]()
                        took = (time.thread_time() - start) / repeats[op]
                        in_gc = (collector.spent - spent) / repeats[op]
                        if turn:
                            outside[label][op].append(took - in_gc)
                            collected[label][op][0] += in_gc
                            collected[label][op][1] += collector.full - full
                        else:  # the warm-up round sets how often an operation runs in a timed sample
                            repeats[op] = max(repeats[op], min(100, int(SAMPLE_S / max(took, 1e-6))))
                        _check(op, result, reference if op == "torch.save" else reference_checkpoint, reference_hooks,
                               reference_state, label)
                        del result
                finally:
                    if attached is not None:
                        attached.remove()
    finally:
        collector.close()
    print(f"\n{name}: {modules:,} modules, policy {policy}, {rounds} rounds, CPU time of this thread; runs per "
          f"sample: " + ", ".join(f"{op} {n}" for op, n in repeats.items()))
    print(f"  {'':22s} {'median ms':>10s} {'x plain':>8s} {'collector ms/op':>16s} {'full collections':>17s}")
    for op in OPERATIONS:
        base = statistics.median(outside["no policy"][op])
        for label in labels:
            m = statistics.median(outside[label][op])
            spent, full = collected[label][op]
            print(f"  {op + ', ' + label:22s} {m * 1e3:10.2f} {m / base:8.3f} {spent / rounds * 1e3:16.1f} "
                  f"{int(full):17d}")


def in_a_row(saves: int, processes: int, policy: str, against: Optional[str]) -> None:
    """A checkpoint loop: `saves` saves of the wide model in a row, each variant in a process of its own.

    The collector's share depends on the whole heap of the process (and on what earlier
    variants left in it), so each run is a fresh process, the variants in turns (A B C, B C A, ...).
    """
    labels = ["no policy", *([against] if against is not None else []), "this tree"]
    runs: dict[str, list[tuple[float, float, int]]] = {label: [] for label in labels}
    for turn in range(processes):
        for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
            command = [sys.executable, __file__, "--loop", label, "--in-a-row", str(saves), "--policy", policy]
            if label == against:
                command += ["--against", against]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            outside, spent, full = json.loads(out.strip().splitlines()[-1])
            runs[label].append((outside, spent, full))
    print(f"\nwide: {saves} saves in a row (a checkpoint loop) in a fresh process, {processes} processes a variant; "
          "CPU time of the main thread per save, the mean over the processes")
    print(f"  {'':22s} {'outside ms':>10s} {'collector ms':>13s} {'total ms':>9s} {'full collections':>17s}")
    for label, got in runs.items():
        outside, spent = statistics.mean(r[0] for r in got), statistics.mean(r[1] for r in got)
        fulls = "/".join(str(r[2]) for r in got)
        print(f"  {label:22s} {outside * 1e3:10.1f} {spent * 1e3:13.1f} {(outside + spent) * 1e3:9.1f} {fulls:>17s}")


def _loop(label: str, saves: int, policy: str, package: Optional[types.ModuleType]) -> None:
    """One variant of `in_a_row`, in this process: prints [CPU s outside the collector, the collector's, full ones]."""
    model, train = _model("wide")
    attached = _governed(model, train, package if label != "no policy" else None, policy)
    collector = Collector()
    try:
        start = time.thread_time()
        for _ in range(saves):
            _saved(model)
        took = (time.thread_time() - start) / saves
    finally:
        collector.close()
        if attached is not None:
            attached.remove()
    print(json.dumps([took - collector.spent / saves, collector.spent / saves, collector.full]))


def _check(op: str, result: object, reference: bytes, hooks: int, state: dict[str, torch.Tensor], label: str) -> None:
    """What a governed model's save, copy and state dict must be: those of the same model without a policy."""
    if op in ("torch.save", "checkpoint") and result != reference:
        raise AssertionError(f"{label}: {op} wrote other bytes than without a policy")
    if op == "deepcopy" and isinstance(result, torch.nn.Module) and _hooks(result) != hooks:
        raise AssertionError(f"{label}: the deep copy carries {_hooks(result)} hooks, not {hooks}")
    if op == "state_dict":
        got: dict[str, torch.Tensor] = result  # type: ignore[assignment]
        if list(got) != list(state) or any(got[k] is not state[k] and not torch.equal(got[k], state[k]) for k in got):
            raise AssertionError(f"{label}: state_dict() differs from without a policy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["wide", "nanogpt", "gpt"], choices=["wide", *sorted(WORKLOADS)])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--policy", default="monitor.yaml", help="a file of bench/policies/")
    parser.add_argument("--in-a-row", type=int, default=8, metavar="N",
                        help="then N saves of the wide model in a row per variant (0: none)")
    parser.add_argument("--processes", type=int, default=2, help="with --in-a-row: fresh processes per variant")
    parser.add_argument("--loop", metavar="LABEL", help=argparse.SUPPRESS)  # one process of --in-a-row
    parser.add_argument("--against", metavar="DIR", help="also the hookpolicy of the tree DIR, in the same turns")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("hookpolicy").setLevel(logging.ERROR)  # the wide model meets monitor.yaml's maxSeries
    if args.loop is not None:
        _loop(args.loop, args.in_a_row, args.policy, other_tree(args.against) if args.against else hookpolicy)
        return
    before = os.getloadavg()
    packages: dict[str, Optional[types.ModuleType]] = {"no policy": None}
    if args.against is not None:
        packages[args.against] = other_tree(args.against)
    packages["this tree"] = hookpolicy
    for name in args.models:
        measure(name, args.rounds, args.policy, packages)
    if args.in_a_row:
        in_a_row(args.in_a_row, args.processes, args.policy, args.against)
    print(f"\nload average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
