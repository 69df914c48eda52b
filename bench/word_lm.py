"""Issue 33's proof, over several seeds: the loss guards on a healthy noisy run and on a corrupted shard.

    python bench/word_lm.py                                  # 5 seeds, loss-spike-guard and recover.yaml
    python bench/word_lm.py --seeds 0 1 2 --policies policies/recover.yaml my-guard.yaml
    python bench/word_lm.py --jobs 3 --launcher /work/team/slot   # runs in parallel, each through a wrapper

Two workloads, each run bare and under every policy, per seed:

- transformer: tests/stacks/word_lm_pattern.py, a script of pytorch/examples' word_language_model
  shape under `--model Transformer` (weights updated by hand at lr 20 after clip 0.25, no optimizer).
  Its unguarded run is healthy and noisy: isolated spikes that the next update undoes. The number is
  the best validation loss (what main.py keeps); a guard should stay within a few % of the bare run.
- shard: bench/instability.py's `--corrupt epoch` (TinyGPT under AdamW, batches 80-87 of every 100
  with scrambled targets). The number is the final held-out loss; a guard should stay within 2% of
  the clean run of the same seed (no corruption, no policy).

Each run is a subprocess with OMP_NUM_THREADS=1 (the losses are then the same on every rerun);
the table gives, per workload and policy, the mean and the range over the seeds of the ratio
to the reference (bare or clean), and how many steps the script saw skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
WORD_LM = ROOT / "tests" / "stacks" / "word_lm_pattern.py"
INSTABILITY = ROOT / "bench" / "instability.py"


#: the control's steps: the bare Transformer run with these updates left out by hand (`--skip`), no policy
CONTROL = "20,40,60,80,100"


def command(workload: str, seed: int, policy: Optional[str], launcher: list[str], epochs: int) -> list[str]:
    if workload in ("transformer", "control"):
        script = [sys.executable, str(WORD_LM), "--seed", str(seed), "--epochs", str(epochs),
                  *(["--skip", CONTROL] if workload == "control" else [])]
    else:
        script = [sys.executable, str(INSTABILITY), "train", "--steps", "300", "--seed", str(seed),
                  "--corrupt", "none" if policy is None and workload == "clean" else "epoch"]
    head = [] if policy is None else [sys.executable, "-m", "hookpolicy", "apply", str(Path(policy).resolve()), "--"]
    return [*launcher, *head, *script]


def run(workload: str, seed: int, policy: Optional[str], launcher: list[str], epochs: int) -> dict[str, Any]:
    """One run: its final number (best val for transformer, held-out loss otherwise) and skipped steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command(workload, seed, policy, launcher, epochs), capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1800)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    final = next((r["val_loss"] for r in records if r.get("final")), float("nan"))
    return {"workload": workload, "seed": seed, "policy": policy, "exit": done.returncode, "val": final,
            "skipped": sum(1 for r in records if "step" in r and not r["updated"])}


def table(results: list[dict[str, Any]], policies: list[str]) -> str:
    ref = {(r["workload"], r["seed"]): r["val"] for r in results if r["policy"] is None}
    lines = ["| workload | policy | reference | mean vs reference | min | max | skipped (mean) | exits |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, reference in (("transformer", "transformer"), ("control", "transformer"), ("shard", "clean")):
        for policy in [None, *policies]:
            if workload == "shard" and policy is None:
                rows = [r for r in results if r["workload"] == "shard" and r["policy"] is None]
            else:
                rows = [r for r in results if r["workload"] == workload and r["policy"] == policy]
            if not rows:
                continue
            ratios = [100 * (r["val"] / ref[(reference, r["seed"])] - 1) for r in rows]
            name = "bare" if policy is None else Path(policy).stem
            refs = statistics.fmean(ref[(reference, r["seed"])] for r in rows)
            if workload == "control":
                name = f"bare, steps {CONTROL} left out by hand"
            lines.append(f"| {workload} | {name if workload != 'shard' or policy else 'unguarded'} | "
                         f"{reference} {refs:.4f} | {statistics.fmean(ratios):+.2f}% | {min(ratios):+.2f}% | "
                         f"{max(ratios):+.2f}% | {statistics.fmean(r['skipped'] for r in rows):.1f} | "
                         f"{sorted({r['exit'] for r in rows})} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--policies", nargs="+", default=["policies/loss-spike-guard.yaml", "policies/recover.yaml"])
    p.add_argument("--workloads", nargs="+", default=["transformer", "shard"], choices=("transformer", "shard"))
    p.add_argument("--epochs", type=int, default=2, help="the Transformer's epochs (its script's default: 2)")
    p.add_argument("--control", action="store_true",
                   help=f"also the bare Transformer with the updates of steps {CONTROL} left out by hand: how far "
                        "a few lost updates move this chaotic run's val loss with no guard at all")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--launcher", default="", help="a command each run goes through (e.g. a job-slot wrapper)")
    p.add_argument("--unguarded", action="store_true", help="also the shard run with no policy")
    p.add_argument("--json", type=Path, default=None, help="also write every run's result here")
    args = p.parse_args()
    launcher = shlex.split(args.launcher)
    todo: list[tuple[str, int, Optional[str]]] = []
    for seed in args.seeds:
        if "transformer" in args.workloads:
            todo += [("transformer", seed, None), *(("transformer", seed, q) for q in args.policies)]
            if args.control:
                todo.append(("control", seed, None))
        if "shard" in args.workloads:
            todo += [("clean", seed, None), *(("shard", seed, q) for q in args.policies)]
            if args.unguarded:
                todo.append(("shard", seed, None))
    loads = [os.getloadavg()[0]]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda t: run(*t, launcher, args.epochs), todo))
    loads.append(os.getloadavg()[0])
    for r in results:
        print(json.dumps(r), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, args.policies))
    print(f"\nSeeds {args.seeds}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} (the losses do not depend on it).")


if __name__ == "__main__":
    main()
