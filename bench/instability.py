"""Guardrails on a real instability (issue 13): does a policy let a run survive a loss spike?

    python bench/instability.py                      # the runs and a table (11 runs of 37-53 s each on the shared 2-core machine: docs/guardrails.md)
    python bench/instability.py --out docs/instability.md
    python bench/instability.py train [--corrupt epoch|early]  # one run: the unmodified script the policies govern
    hookpolicy apply policies/loss-spike-guard.yaml -- python bench/instability.py train --corrupt epoch --steps 100
                                                     # the README's demo (seconds): steps 80-87 fire, all but 84 skipped
    python bench/instability.py overhead             # what the history functions cost per step
    python bench/instability.py heal                 # issue 26: a divergence skipping cannot undo (lr x30
                                                     # for 20 steps): clean, unguarded, skip-only, recover.yaml

The bundled tiny GPT (`examples.charlm.TinyGPT`) learns a seeded random bigram language
(a Markov chain over 24 symbols with peaked transition rows: a loss floor the model reaches in a few hundred steps,
so a missing step costs little and damage shows). A corrupted shard comes round once per
epoch of 100 steps: batches 80-87 of each epoch have scrambled targets (random labels),
which sends the loss from about 1.2-1.3 to about 5.4 and the gradient norm up 4-7x; AdamW's
second moments remember that for hundreds of steps.

A second corruption, `early`, scrambles single batches and a run of three at steps 20, 21,
35, 50-52, 70 and 90, while the loss still falls (from about 3.5 to about 1.3 over the
first 50 steps): the standard deviation of a falling loss is large, so a z-score test
against the mean misses them.

Runs, all from the same seed and drawing the same batches:

- clean: no corruption, no policy; then clean under each loss guard (what it skips of a
  run that has nothing to skip);
- per corruption (epoch, early): unguarded, no policy; the shipped loss-spike guard
  (`policies/loss-spike-guard.yaml`, median and MAD), the old one
  (`bench/policies/loss-spike-zscore.yaml`, mean and standard deviation) and zclip
  (`policies/zclip.yaml`, adaptive gradient clipping), each under `hookpolicy apply`.

Each training step is reported by the script itself, not by hookpolicy: the loss, the
gradient norm before `optimizer.step()`, the gradient norm the update saw (from an
optimizer step pre-hook the script registers, which runs after hookpolicy's), and whether
the parameters changed. The final number is the loss on held-out text after the last step.

`heal` (issue 26): the script multiplies its learning rate by 30 for steps 160-179 (`--corrupt
lr`). The first such update damages the weights before any loss shows it, so every later
batch's loss is a spike: skipping (bench/policies/skip-only.yaml) stops updating a damaged
model, while policies/recover.yaml (skip, cool down, rewind to a snapshot, halt last) goes
back to the snapshot taken before the damage. Four runs, same seed and batches: clean,
unguarded, skip-only, the ladder; then the cost of one snapshot of this model (in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.charlm import TinyGPT, batch  # noqa: E402

SYMBOLS = 24
CONTEXT = 32
EPOCH = 100
#: batches of each epoch whose targets are scrambled with --corrupt epoch
CORRUPT = range(80, 88)
#: the steps whose targets are scrambled with --corrupt early: while the loss still falls
EARLY = (20, 21, 35, 50, 51, 52, 70, 90)
#: the steps whose learning rate the script multiplies by LR_FACTOR with --corrupt lr
HOT = range(160, 180)
LR_FACTOR = 30.0


def corrupted(scenario: str, step: int) -> bool:
    """Whether `step`'s batch is corrupted in `scenario` (none, epoch or early)."""
    if scenario == "epoch":
        return step % EPOCH in CORRUPT
    if scenario == "lr":
        return step in HOT
    return scenario == "early" and step in EARLY


def corpus(seed: int, length: int = 30_000) -> torch.Tensor:
    """A seeded random bigram chain: each symbol's successor drawn from a peaked random row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.softmax(3.0 * torch.randn(SYMBOLS, SYMBOLS, generator=g), dim=1)
    out = torch.empty(length, dtype=torch.long)
    out[0] = 0
    draws = torch.rand(length, generator=g)
    cdf = rows.cumsum(dim=1)
    for i in range(1, length):
        out[i] = min(int(torch.searchsorted(cdf[out[i - 1]], draws[i])), SYMBOLS - 1)
    return out


def train(args: argparse.Namespace) -> None:
    """One run; a JSON line per step and a final one. No hookpolicy here."""
    data = corpus(args.seed)
    split = int(len(data) * 0.8)
    torch.manual_seed(args.seed)
    model = TinyGPT(SYMBOLS, context=CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    batches = torch.Generator().manual_seed(args.seed + 1)
    scrambles = torch.Generator().manual_seed(args.seed + 2)
    seen: dict[str, float] = {}

    def update_norm(opt: torch.optim.Optimizer, *_: Any) -> None:
        # registered on this optimizer, so it runs after hookpolicy's global step pre-hook:
        # the gradient the update is about to use
        seen["update"] = total_norm(model)

    optimizer.register_step_pre_hook(update_norm)
    probe = model.lm_head.weight
    for step in range(args.steps):
        x, y = batch(data, torch.randint(0, split - CONTEXT - 1, (args.batch,), generator=batches), CONTEXT)
        scrambled = torch.randint(0, SYMBOLS, y.shape, generator=scrambles)
        corrupt = corrupted(args.corrupt, step)
        if corrupt and args.corrupt != "lr":
            y = scrambled
        for group in optimizer.param_groups:  # the script's own schedule: constant, x30 on HOT with --corrupt lr
            group["lr"] = args.lr * (LR_FACTOR if corrupt and args.corrupt == "lr" else 1.0)
        logits, _ = model(x)  # the script's own criterion computes the loss (a loss module)
        loss = criterion(logits.reshape(-1, SYMBOLS), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before = total_norm(model)
        seen.pop("update", None)
        old = probe.detach().clone()
        optimizer.step()
        print(json.dumps({
            "step": step, "corrupt": corrupt, "loss": loss.item(), "grad_norm": before,
            "update_norm": seen.get("update"), "updated": not torch.equal(old, probe.detach()),
        }), flush=True)
    model.eval()
    with torch.no_grad():
        vx, vy = batch(data, torch.arange(split, len(data) - CONTEXT - 1, 97), CONTEXT)
        val = criterion(model(vx)[0].reshape(-1, SYMBOLS), vy.reshape(-1)).item()
    print(json.dumps({"final": True, "val_loss": val}), flush=True)


def total_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


@dataclass
class Run:
    name: str
    policy: Optional[str]
    corrupt: str
    steps: list[dict[str, Any]]
    val_loss: float
    seconds: float

    @property
    def skipped(self) -> int:
        return sum(1 for s in self.steps if not s["updated"])

    @property
    def clipped(self) -> int:
        """Steps whose update saw a smaller gradient than backward produced (beyond float noise)."""
        return sum(1 for s in self.steps if _clipped(s))

    @property
    def corrupt_steps(self) -> int:
        return sum(1 for s in self.steps if s["corrupt"])

    @property
    def caught(self) -> int:
        """Corrupted steps that were skipped or clipped."""
        return sum(1 for s in self.steps if s["corrupt"] and (not s["updated"] or _clipped(s)))

    @property
    def false_skips(self) -> int:
        """Clean steps that were skipped."""
        return sum(1 for s in self.steps if not s["corrupt"] and not s["updated"])

    @property
    def false_clips(self) -> int:
        """Clean steps that were clipped."""
        return sum(1 for s in self.steps if not s["corrupt"] and _clipped(s))


def _clipped(step: dict[str, Any]) -> bool:
    """An applied step whose update saw a smaller gradient norm than backward produced."""
    return bool(step["updated"] and step["update_norm"] is not None and step["update_norm"] < step["grad_norm"] * (1 - 1e-4))


def run(name: str, policy: Optional[str], corrupt: str, steps: int, seed: int, stderr: Optional[list[str]] = None) -> Run:
    script = [sys.executable, str(Path(__file__).resolve()), "train", "--steps", str(steps), "--seed", str(seed),
              "--corrupt", corrupt]
    command = script if policy is None else [sys.executable, "-m", "hookpolicy", "apply", str(ROOT / policy), "--", *script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    if stderr is not None:
        stderr.extend(done.stderr.splitlines())
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    final = next(r for r in records if r.get("final"))
    return Run(name, policy, corrupt, [r for r in records if "step" in r], final["val_loss"], seconds)


GUARDS = (
    ("loss-spike-guard (median, MAD)", "policies/loss-spike-guard.yaml"),
    ("old loss-spike guard (mean, std)", "bench/policies/loss-spike-zscore.yaml"),
    ("zclip", "policies/zclip.yaml"),
)
#: (name, policy, corruption): the clean reference first
RUNS = (
    ("clean", None, "none"),
    *((f"clean under {name}", policy, "none") for name, policy in GUARDS[:2]),
    *((f"{corrupt}: {name}", policy, corrupt) for corrupt in ("epoch", "early")
      for name, policy in (("unguarded", None), *GUARDS)),
)


def table(runs: list[Run]) -> str:
    clean = runs[0].val_loss
    lines = [
        "| run | final held-out loss | vs clean | corrupted steps | caught | missed | clean steps skipped "
        "| clean steps clipped | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.val_loss:.4f} | {100 * (r.val_loss / clean - 1):+.2f}% | {r.corrupt_steps} | "
            f"{r.caught} | {r.corrupt_steps - r.caught} | {r.false_skips} | {r.false_clips} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


#: the policies timed against each other: (key, label, policy file or None)
OVERHEAD = (
    ("floor", "no policy", None),
    ("fixed_loss", "loss rule, fixed thresholds", "bench/policies/fixed-loss.yaml"),
    ("spike_guard", "loss-spike-guard.yaml (robust_z, median)", "policies/loss-spike-guard.yaml"),
    ("fixed_clip", "clip max_norm 1.0 per rule", "bench/policies/fixed-clip.yaml"),
    ("zclip", "zclip.yaml (ema, ema_std)", "policies/zclip.yaml"),
)


def overhead(rounds: int, seed: int) -> str:
    """Interleaved step times (bench/timing.py) of the same loop under each policy of OVERHEAD."""
    import copy

    import hookpolicy
    from prometheus_client import CollectorRegistry

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import interleave, quantile
    from variants import Variant

    torch.set_num_threads(1)
    data = corpus(seed)
    torch.manual_seed(seed)
    base = TinyGPT(SYMBOLS, context=CONTEXT)
    x, y = batch(data, torch.arange(0, 16 * 97, 97), CONTEXT)
    variants, attachments = [], []
    for key, label, policy in OVERHEAD:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            # the model returns its loss (each model's own: a criterion module would be
            # shared by the loss rules of every model stepped in turn here)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if policy is not None:
            attachments.append(hookpolicy.load(ROOT / policy).attach(model, registry=CollectorRegistry(), rank=0))
        variants.append(Variant(key, label, step, lambda: None, model=model))
    try:
        samples = interleave(variants, rounds=rounds, warmup=30, cuda=False)
    finally:
        for a in attachments:
            a.remove()
    median = {k: quantile(s.times, 0.5) * 1e3 for k, s in samples.items()}
    host = history_host_cost()
    lines = ["| variant | median ms/step | vs no policy |", "|---|---|---|"]
    for key, label, _ in OVERHEAD:
        lines.append(f"| {label} | {median[key]:.3f} | {median[key] / median['floor']:.3f}x |")
    lines.append("")
    lines.append(f"History functions, per step: loss-spike-guard {1e3 * (median['spike_guard'] - median['fixed_loss']):+.0f} µs "
                 f"against the same rule with fixed thresholds; zclip {1e3 * (median['zclip'] - median['fixed_clip']):+.0f} µs "
                 f"against a fixed max_norm ({rounds} interleaved steps each, 1 thread).")
    lines.append("")
    lines.append("Host work of the history alone, per step (evaluation and append, timed over 20,000 steps "
                 "with full windows): " + "; ".join(f"{name} {us:.1f} µs" for name, us in host.items()) + ".")
    return "\n".join(lines)


def history_host_cost(steps: int = 20_000) -> dict[str, float]:
    """µs per step of what the read-back does for a policy's history: evaluate, then append."""
    import math

    import hookpolicy
    from hookpolicy.engine.measure.history import History, Observation, spec_for
    from hookpolicy.policy.model import Alert, Clip

    out: dict[str, float] = {}
    for name in ("loss-spike-guard", "zclip"):
        rule = hookpolicy.load(ROOT / "policies" / f"{name}.yaml").policies[0].rules[0]
        history = History()
        work = []
        for index, action in enumerate(rule.actions):
            key = ((name, rule.name), index, "", "")
            if isinstance(action, Alert) and action.calls:
                specs = {stat: spec_for(action.calls, stat, action.warmup) for stat in sorted(action.stats)}
                work.append((key, specs, action.condition.evaluate))
            elif isinstance(action, Clip) and action.adaptive is not None:
                work.append((key, {"norm": spec_for(action.calls, "norm", action.warmup)}, action.adaptive.evaluate))

        def step(i: int) -> None:
            x = 1.2 + 0.01 * math.sin(i)
            values = {"mean": x, "max": x, "nonfinite": 0.0, "norm": x}
            observed = []
            for key, specs, evaluate in work:
                evaluate(values, history.past(key))
                observed.append(Observation(key, {s: values[s] for s in specs}, specs))
            history.commit(observed)

        for i in range(200):  # fill the windows
            step(i)
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        out[name] = (time.perf_counter() - start) / steps * 1e6
    return out


HEAL_RUNS = (
    ("clean", None, "none"),
    ("lr x30: unguarded", None, "lr"),
    ("lr x30: skip-only (bench/policies/skip-only.yaml)", "bench/policies/skip-only.yaml", "lr"),
    ("lr x30: recover.yaml (skip, cool down, rewind, halt)", "policies/recover.yaml", "lr"),
)


def heal(steps: int, seed: int) -> str:
    """Issue 26's proof: the table of HEAL_RUNS, and what a snapshot of this model costs."""
    import re

    lines = ["| run | final held-out loss | vs clean | steps skipped | rewinds | steps dropped by rewinds | wall s |",
             "|---|---|---|---|---|---|---|"]
    loads = [os.getloadavg()[0]]
    clean = None
    for name, policy, corrupt in HEAL_RUNS:
        said: list[str] = []
        r = run(name, policy, corrupt, steps, seed, said)
        loads.append(os.getloadavg()[0])
        clean = r.val_loss if clean is None else clean
        rewound = [re.search(r"the (\d+) steps", line) for line in said if "rewound at step" in line]
        dropped = sum(int(m.group(1)) for m in rewound if m)
        lines.append(f"| {name} | {r.val_loss:.4f} | {100 * (r.val_loss / clean - 1):+.2f}% | "
                     f"{_summary_count(said, 'skipped')} | {len(rewound)} | {dropped} | {r.seconds:.0f} |")
        print(f"{name}: held-out loss {r.val_loss:.4f} ({r.seconds:.0f} s)", file=sys.stderr, flush=True)
    size, seconds, first, scans, objects = snapshot_cost(seed)
    lines += ["", f"One snapshot of this model (TinyGPT, AdamW state included): {size / 1024:.0f} KiB of host memory, "
              f"{seconds * 1e3:.2f} ms on the CPU (median of 200, 1 thread, {scans} heap scans in them); the first "
              f"update's share, once: {first * 1e3:.2f} ms (the heap scan for the LR schedulers and GradScalers made "
              f"before, {objects} objects on the heap); recover.yaml takes one every 50 steps and keeps 2: "
              f"{2 * size / 1024:.0f} KiB, {seconds * 1e3 / 50:.3f} ms a step on average.",
              "", f"Load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}."]
    return "\n".join(lines)


def _summary_count(said: list[str], what: str) -> int:
    """`skipped N steps` from the run summary's line of the policy's rule (0 when it has none)."""
    import re

    for line in said:
        found = re.search(rf"{what} (\d+) step", line)
        if found:
            return int(found.group(1))
    return 0


def snapshot_cost(seed: int) -> tuple[int, float, float, int, int]:
    """One snapshot of the bench's model with its AdamW state: its bytes, the median seconds to take one (200,
    `every: 1`), the seconds of the first update's share (the one heap scan, for the schedulers made before),
    the heap scans made by the 200 snapshots, and the objects on the heap."""
    import gc
    import statistics

    from hookpolicy.engine.heal.snapshots import Snapshots

    torch.set_num_threads(1)
    data = corpus(seed)
    torch.manual_seed(seed)
    model = TinyGPT(SYMBOLS, context=CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)  # noqa: F841 (kept alive)
    x, y = batch(data, torch.arange(0, 16 * 97, 97), CONTEXT)
    model(x, y)[1].backward()
    optimizer.step()
    snapshots = Snapshots(model, every=1, keep=2, name="bench")
    start = time.perf_counter()
    snapshots.before_update(optimizer)
    first = time.perf_counter() - start
    scans = [0]
    get_objects = gc.get_objects

    def counted(*args: Any) -> list[Any]:
        scans[0] += 1
        return get_objects(*args)

    gc.get_objects = counted
    times = []
    try:
        for step in range(200):
            start = time.perf_counter()
            snapshots.take_if_due(step)
            times.append(time.perf_counter() - start)
    finally:
        gc.get_objects = get_objects
        for handle in getattr(snapshots, "handles", []):
            handle.remove()
    assert len(snapshots.kept[-1].schedulers) == 1
    return snapshots.kept[-1].nbytes, statistics.median(times), first, scans[0], len(gc.get_objects())


def snapshot(seed: int) -> str:
    """What one snapshot of this model costs (`snapshot_cost`), in a line, with the load average."""
    load = os.getloadavg()[0]
    size, seconds, first, scans, objects = snapshot_cost(seed)
    return (f"One snapshot (TinyGPT, AdamW state, a CosineAnnealingLR): {size / 1024:.0f} KiB, {seconds * 1e3:.2f} ms "
            f"(median of 200, 1 thread); heap scans in those 200: {scans}; the first update's share: "
            f"{first * 1e3:.2f} ms ({objects} objects on the heap); load average {load:.1f}-{os.getloadavg()[0]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="one run (the script the policies govern)")
    for q in (p, t):
        q.add_argument("--steps", type=int, default=300)
        q.add_argument("--seed", type=int, default=0)
    t.add_argument("--corrupt", choices=("none", "epoch", "early", "lr"), default="none",
                   help="scramble the targets of batches 80-87 of every 100 (epoch) or of steps 20, 21, 35, 50-52, 70, 90 "
                        "(early: while the loss still falls), or multiply the lr by 30 on steps 160-179 (lr)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--batch", type=int, default=16)
    h = sub.add_parser("heal", help="issue 26: clean, unguarded, skip-only and recover.yaml on lr x30 for 20 steps")
    h.add_argument("--steps", type=int, default=300)
    h.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("snapshot", help="what one snapshot of this model costs, and the heap scans it makes")
    c.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("overhead", help="what the history functions cost per step (interleaved timing)")
    o.add_argument("--rounds", type=int, default=300)
    o.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the table as markdown here")
    args = p.parse_args()
    if args.command == "train":
        train(args)
        return
    if args.command == "overhead":
        print(overhead(args.rounds, args.seed))
        return
    if args.command == "snapshot":
        print(snapshot(args.seed))
        return
    if args.command == "heal":
        print(heal(args.steps, args.seed))
        return
    runs = []
    loads = [os.getloadavg()[0]]
    for name, policy, corrupt in RUNS:
        runs.append(run(name, policy, corrupt, args.steps, args.seed))
        loads.append(os.getloadavg()[0])
        print(f"{name}: held-out loss {runs[-1].val_loss:.4f} ({runs[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    text = table(runs) + f"\n\nLoad average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}."
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
