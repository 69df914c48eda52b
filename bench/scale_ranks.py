"""Issue 23.4: hookpolicy's step cycle on many ranks of one machine, the agreement's cost and the series per job.

    python bench/scale_ranks.py                     # 2, 4, 8, 16 gloo ranks (about 3 minutes on 2 cores)
    python bench/scale_ranks.py --ranks 2 4 --steps 40
    python bench/scale_ranks.py --fake 64 1024      # the collectives' shape and series at 64, 1,024 ranks

Each world size is W processes started by `torch.multiprocessing.spawn`, one torch thread
each, a gloo process group over localhost; every rank trains the same small MLP
(`LAYERS` Linear layers, DDP) under one policy (`POLICY`): gradient statistics per
module at `step` (the same on every rank after DDP's all-reduce), an activation
statistic per module at `forward` (each rank's own), a `skip_step` guard, and the job's
loss (both make the step's agreement run). Per rank it records:

- `agree`: the seconds spent in the agreement's collective (`agreement._all_gather`)
  at each step of the training loop: the collective itself plus the wait for the
  slowest rank to arrive (skew);
- `loop`: the same `Agreement.agree` called back to back, `LOOP` times after a barrier:
  the collective's cost without the training's skew; and, for comparison, a bare
  `all_reduce(MAX)` of 6 int64 (the agreement's shape before issue 23.2);
- the series its `/metrics` exports (every sample line of `generate_latest`), once with
  the policy as written (statistics the same on every rank exported by rank 0 only) and
  once with `series: rank` on every capture (every rank exports its own, as before
  issue 23.3).

`--fake N...` runs one process per N with PyTorch's fake process group (collectives do
nothing, so no timing): at rank 0 and rank 1 of a world of N it counts the series
exported and the collectives one step issues (calls and bytes), which is the shape at N
ranks without N processes. Timings are reported, never asserted; on 2 cores W > 2 ranks
share the cores, so the step's skew grows with W: read `loop` for the collective.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, generate_latest

import hookpolicy
from hookpolicy.engine.decide import agreement
from hookpolicy.engine.decide.alerts import StepReport

#: Linear layers of the MLP (each with weight and bias): per-module series scale with it.
LAYERS = 8
WIDTH = 64
#: back-to-back agreements per rank in the `loop` measurement
LOOP = 200

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: ranks}}
spec:
  rules:
    - name: grads
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - capture: {{stats: [l2_norm, abs_max, nonfinite]{extra}}}
        - alert: {{if: "nonfinite > 0", then: skip_step}}
    - name: activations
      match: {{types: [Linear]}}
      trigger: {{at: forward}}
      target: output
      actions:
        - capture: {{stats: [abs_max]{extra}}}
    - name: loss
      match: {{root: true}}
      trigger: {{at: step}}
      target: loss
      actions:
        - capture: {{stats: [mean, max]{extra}}}
"""


def _policy(folder: Path, per_rank: bool) -> Path:
    path = folder / ("per-rank.yaml" if per_rank else "per-job.yaml")
    path.write_text(POLICY.format(extra=", series: rank" if per_rank else ""))
    return path


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _series(registry: CollectorRegistry) -> dict[str, int]:
    """Sample lines of a scrape: statistic series (hookpolicy_<target>_<stat>) and the engine's."""
    counts = {"statistics": 0, "engine": 0}
    for line in generate_latest(registry).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        stat = line.startswith(("hookpolicy_grad_", "hookpolicy_output_", "hookpolicy_loss_"))
        counts["statistics" if stat else "engine"] += 1
    return counts


def _train(policy: Path, steps: int, rank: int) -> tuple[list[float], list[float], dict[str, int], Any]:
    """Train `steps` steps under `policy`: per step the agreement's collective and the whole step, the series."""
    model = torch.nn.parallel.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    registry = CollectorRegistry()
    spent: list[float] = []
    collective = agreement._all_gather

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return collective(*args)
        finally:
            spent.append(time.perf_counter() - start)

    agreement._all_gather = timed  # type: ignore[assignment]
    attached = hookpolicy.load(policy).attach(model, registry=registry)
    torch.manual_seed(rank)
    x = torch.randn(16, WIDTH)
    whole: list[float] = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            whole.append(time.perf_counter() - start)
        return spent, whole, _series(registry), attached
    finally:
        agreement._all_gather = collective  # type: ignore[assignment]


def _rank(rank: int, world: int, port: int, steps: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    out: dict[str, Any] = {}
    try:
        spent, whole, out["series_job"], attached = _train(_policy(Path(folder), False), steps, rank)
        out["agree"], out["step"] = spent[3:], whole[3:]  # the first steps build DDP's buckets
        cycle = attached._cycle
        dist.barrier()
        loop = []
        for i in range(LOOP):
            start = time.perf_counter()
            cycle.agreement.agree(StepReport(), steps + i)
            loop.append(time.perf_counter() - start)
        out["loop"] = loop
        flags = torch.zeros(6, dtype=torch.int64)
        dist.barrier()
        reduce = []
        for _ in range(LOOP):  # the agreement's shape before issue 23.2: all_reduce(MAX) of 6 int64
            start = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            reduce.append(time.perf_counter() - start)
        out["reduce6"] = reduce
        attached.remove()
        try:
            _, _, out["series_rank"], attached = _train(_policy(Path(folder), True), 3, rank)
            attached.remove()
        except hookpolicy.PolicyError:  # a hookpolicy before `series: rank`: every rank exported its own
            out["series_rank"] = out["series_job"]
    finally:
        dist.barrier()
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # not through interpreter finalization (a gloo thread can abort it: examples/train_ddp.py leave())


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(world: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(_rank, args=(world, _free_port(), steps, folder), nprocs=world, join=True)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    ms = 1000.0

    def per_rank_median(key: str) -> list[float]:
        return [statistics.median(r[key]) * ms for r in ranks]

    return {
        "ranks": world,
        "agree_ms": max(per_rank_median("agree")),  # the slowest rank's median: the job waits for it
        "agree_p90_ms": max(sorted(r["agree"])[int(0.9 * len(r["agree"]))] * ms for r in ranks),
        "loop_ms": statistics.median(per_rank_median("loop")),
        "reduce6_ms": statistics.median(per_rank_median("reduce6")),
        "step_ms": max(per_rank_median("step")),
        "series_job": {k: sum(r["series_job"][k] for r in ranks) for k in ("statistics", "engine")},
        "series_rank": {k: sum(r["series_rank"][k] for r in ranks) for k in ("statistics", "engine")},
        "rank0": ranks[0]["series_job"], "rank1": ranks[1]["series_job"],
    }


def fake(world: int) -> dict[str, Any]:
    """At rank 0 and 1 of a fake group of `world`: series exported and one step's collectives."""
    out: dict[str, Any] = {"ranks": world}
    for rank in (0, 1):
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import scale_ranks as s; "
                f"print(__import__('json').dumps(s._fake_rank({world}, {rank})))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out[f"rank{rank}"] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _fake_rank(world: int, rank: int) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    calls: list[tuple[str, str, int]] = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor")}

    def counting(name: str) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            who = "hookpolicy" if caller.startswith("hookpolicy") else "fsdp"
            calls.append((who, name, tensor.numel() * tensor.element_size()))  # the output's bytes for a gather
            return real[name](tensor, *args, **kwargs)
        return counted

    with tempfile.TemporaryDirectory() as folder:
        model = _fsdp(_mlp())  # DDP's reducer refuses the fake group's empty results; FSDP2 takes them
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        registry = CollectorRegistry()
        attached = hookpolicy.load(_policy(Path(folder), False)).attach(model, registry=registry)
        x = torch.randn(16, WIDTH)
        for step in range(3):
            if step == 2:
                for name in real:
                    setattr(dist, name, counting(name))
            model(x).square().mean().backward()  # FSDP2's own collectives are not counted here
            opt.step()
            opt.zero_grad(set_to_none=True)
        for name, function in real.items():
            setattr(dist, name, function)
        series = _series(registry)
        attached.remove()
    dist.destroy_process_group()
    mine = [c[1:] for c in calls if c[0] == "hookpolicy"]
    return {"series": series, "hookpolicy": mine, "fsdp_calls": sum(c[0] == "fsdp" for c in calls)}


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8, 16])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fake", type=int, nargs="*", default=[])
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}; torch {torch.__version__}")
    rows = [measure(w, args.steps) for w in args.ranks]
    print("| ranks | agreement in the step (slowest rank's median / p90) | agreement back to back (median) "
          "| all_reduce of 6 int64 back to back | step (slowest rank's median) | series per job: once per job "
          "| per rank (`series: rank`) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        job, each = r["series_job"], r["series_rank"]
        print(f"| {r['ranks']} | {r['agree_ms']:.3f} / {r['agree_p90_ms']:.3f} ms | {r['loop_ms']:.3f} ms "
              f"| {r['reduce6_ms']:.3f} ms "
              f"| {r['step_ms']:.2f} ms | {job['statistics']} + {job['engine']} engine "
              f"| {each['statistics']} + {each['engine']} engine |")
    if len(rows) >= 2:
        for key in ("loop_ms", "reduce6_ms", "agree_ms"):
            a, b = fit([r["ranks"] for r in rows], [r[key] for r in rows])
            print(f"{key}: {a:.3f} ms + {b:.4f} ms per rank -> 64 ranks {a + 64 * b:.2f} ms, "
                  f"1,024 ranks {a + 1024 * b:.2f} ms")
        print(f"rank 0 exports {rows[0]['rank0']}, every other rank {rows[0]['rank1']}")
    if args.fake:
        print("| ranks (fake group) | hookpolicy's collectives in one step (bytes each rank receives) "
              "| series of rank 0 / of any other rank | series per job |")
        print("|---:|---|---:|---:|")
    for n in args.fake:
        f = fake(n)
        zero, other = (sum(f[r]["series"].values()) for r in ("rank0", "rank1"))
        shape = ", ".join(f"{name} {size:,} B" for name, size in f["rank0"]["hookpolicy"])
        print(f"| {n:,} | {shape} | {zero} / {other} | {zero + (n - 1) * other:,} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
