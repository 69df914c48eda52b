"""Ranks in process: `worker(rank, *args)` on 2 (or `nprocs`) gloo ranks started by `torch.multiprocessing.spawn`.

Every process group has a timeout of GROUP_TIMEOUT and every spawn a deadline, both far
below torch's default of 30 minutes, so a collective one rank never joins fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from . import REPO

#: Seconds a rank waits in a collective before the process group gives up.
GROUP_TIMEOUT = timedelta(seconds=60)


def spawn(worker: Callable[..., Any], folder: Path, port: int, *args: Any, timeout: float = 180,
          nprocs: int = 2) -> list[Any]:
    """Run `worker(rank, *args)` (a module-level function) on `nprocs` gloo ranks; what each rank returned (JSON).

    Ranks that have not finished after `timeout` seconds are killed and the test fails.
    """
    context = torch.multiprocessing.spawn(
        _entry, args=(worker.__module__, worker.__name__, port, str(folder), args, nprocs), nprocs=nprocs, join=False)
    assert context is not None
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{worker.__name__} did not finish on all {nprocs} ranks in {timeout} s (a rank left waiting)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _entry(rank: int, module: str, name: str, port: int, folder: str, args: tuple[Any, ...], world: int = 2) -> None:
    import sys
    sys.path.insert(0, str(REPO / "examples"))
    from train_ddp import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        result = getattr(importlib.import_module(module), name)(rank, *args)
    finally:
        dist.barrier()  # rank 0 serves the store: neither rank leaves while the other still uses it
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    leave(0)  # not through interpreter finalization, where a gloo thread can abort the process: train_ddp.leave
