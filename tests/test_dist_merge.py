"""The job's loss on 4 gloo ranks: every rank merges every rank's roots in rank order, so all agree bit for bit.

Two ranks cannot tell a merge in rank order from one that puts the rank's own roots first
(two orders, each rank sees one of them, and the sum of two is commutative); at 3 or more
the bits of the mean and the spread depend on the order. Each rank backpropagates roots
of magnitudes 1e-6 to 1e6, so a different order changes the last bits. The reference:
every rank's published statistics equal, bit for bit, and close to PyTorch's mean, std and
max of all ranks' roots together (float64), which the test gathers from each rank's own
record of its roots.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.distributed import spawn
from helpers.policies import write_policy

RANKS, STEPS, MICRO = 4, 12, 3
RULES = """
- name: job
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions:
    - capture: {stats: [mean, std, max, numel], per: rule}
    - alert: {if: "mean < -1", per: rule, then: skip_step}
"""


def worker(rank: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(100 + rank)
    roots: list[list[float]] = []
    published: list[dict[str, float]] = []
    with hookpolicy.load(Path(folder) / "p.yaml").attach(model, registry=CollectorRegistry()) as attached:
        for _ in range(STEPS):
            mine = []
            for _ in range(MICRO):
                scale = 10.0 ** float(torch.empty(()).uniform_(-6, 6, generator=g))
                loss = model(torch.randn(5, 4, generator=g)).pow(2).mean() * scale
                loss.backward()
                mine.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad()
            roots.append(mine)
            values = attached.last_values()
            published.append({stat: next(iter(values[f"hookpolicy_loss_{stat}"].values()))
                              for stat in ("mean", "std", "max", "numel")})
    return {"roots": roots, "published": published}


@pytest.mark.slow
def test_the_jobs_loss_is_merged_in_rank_order_on_4_ranks(tmp_path: Path, free_port: int) -> None:
    write_policy(tmp_path, RULES)
    results = spawn(worker, tmp_path, free_port, str(tmp_path), nprocs=RANKS, timeout=300)
    for step in range(STEPS):
        seen = [r["published"][step] for r in results]
        for other in seen[1:]:  # bit for bit: float's repr round-trips through JSON
            assert other == seen[0], (step, seen)
        every = torch.tensor([v for r in results for v in r["roots"][step]], dtype=torch.float64)
        assert seen[0]["numel"] == RANKS * MICRO
        assert math.isclose(seen[0]["mean"], float(every.mean()), rel_tol=1e-6)
        assert math.isclose(seen[0]["std"], float(every.std()), rel_tol=1e-6)
        assert seen[0]["max"] == pytest.approx(float(every.max()), rel=1e-6)
