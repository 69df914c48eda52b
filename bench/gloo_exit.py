"""How often a gloo rank aborts at exit, with and without `leave()` (the stress check of docs/compatibility.md).

    python bench/gloo_exit.py --runs 20 --finalize      # through interpreter finalization: some runs abort
    python bench/gloo_exit.py --runs 20                 # examples/train_ddp.py as shipped, ending with leave()
    python bench/gloo_exit.py --runs 20 --apply policies/example-monitor.yaml --finalize

Each run is `torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 3`
(under `hookpolicy apply POLICY --` with `--apply`), started through a small wrapper that
sets `sys.setswitchinterval(--switch-interval)` first: the main thread then keeps the GIL
until it blocks, so a gloo worker thread that waits for the GIL to free a finished
collective is more often still waiting when the interpreter starts finalizing. With the
default 100 s about one run in five aborts through finalization on the 2-core machine;
with CPython's own 0.005 s, about one in thirty. A run counts as an abort when its output
holds "terminate called without an active exception". Counts are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_ddp.py"
ABORT = "terminate called without an active exception"

WRAPPER = """\
import runpy, sys
sys.setswitchinterval({interval!r})
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def command(wrapper: Path, args: argparse.Namespace) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    line = torchrun + [str(wrapper), "--steps", "3"] + (["--finalize"] if args.finalize else [])
    if args.apply:
        line = [sys.executable, "-m", "hookpolicy", "apply", args.apply, "--"] + line
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--finalize", action="store_true", help="end the ranks through interpreter finalization")
    p.add_argument("--apply", metavar="POLICY", help="run under `hookpolicy apply POLICY`")
    p.add_argument("--switch-interval", type=float, default=100.0, metavar="S")
    p.add_argument("--keep", metavar="DIR", help="keep each run's output in DIR")
    args = p.parse_args()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    aborts = failures = 0
    with tempfile.TemporaryDirectory() as folder:
        wrapper = Path(folder, "train_ddp_wrapped.py")
        wrapper.write_text(WRAPPER.format(interval=args.switch_interval, script=str(SCRIPT)))
        for i in range(args.runs):
            run = subprocess.run(command(wrapper, args), env=env, capture_output=True, text=True, timeout=300)
            output = run.stdout + run.stderr
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                Path(args.keep, f"run{i}.log").write_text(output)
            if ABORT in output:
                aborts += 1
            elif run.returncode != 0:
                failures += 1
            print(f"run {i + 1}/{args.runs}: status {run.returncode}{' abort' if ABORT in output else ''}", flush=True)
    how = "finalize" if args.finalize else "leave()"
    print(f"{how}{' under apply ' + args.apply if args.apply else ''}, switch interval {args.switch_interval} s: "
          f"{aborts} abort(s), {failures} other failure(s) in {args.runs} runs")


if __name__ == "__main__":
    main()
