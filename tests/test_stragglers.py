"""Stragglers: `hookpolicy_agreement_wait_seconds_total`, the time each rank waits in the step's agreement.

2 gloo ranks in process (`helpers.distributed.spawn`), DDP, a policy that skips a step on a
NaN (so the ranks agree at every step). One rank is slowed on purpose: it sleeps between its
backward pass and `optimizer.step()`, where the agreement runs, so its peer arrives first and
waits for it. The reference is what the test measures itself: how long the slowed rank slept
(its peer should have waited about that long) and how long each rank's `optimizer.step()`
took in all (the wait is part of it, so it bounds the wait from above). Bounds are
generous: the machine is shared; nothing asserts how fast hookpolicy is.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.distributed import spawn

sys.path.insert(0, str(REPO / "examples"))
from helpers.dist_train import wrap  # noqa: E402
from train_mlp import build_model, make_data  # noqa: E402

STEPS, DELAY = 6, 0.25
WAIT = "hookpolicy_agreement_wait_seconds_total"


def slowed(rank: int, policy: str, slow: int) -> dict[str, Any]:
    """Train STEPS steps, rank `slow` sleeping DELAY before each optimizer.step(); what was measured and exported."""
    torch.manual_seed(0)
    model = wrap(build_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    registry = CollectorRegistry()
    attached = hookpolicy.load(policy).attach(model, registry=registry, rank=rank)
    slept = in_step = 0.0
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[32 * step:32 * (step + 1)]), y[32 * step:32 * (step + 1)]).backward()
            if rank == slow:
                started = time.perf_counter()
                time.sleep(DELAY)
                slept += time.perf_counter() - started
            started = time.perf_counter()
            optimizer.step()
            in_step += time.perf_counter() - started
        samples = {(s.name, s.labels["rank"]): s.value for f in registry.collect() for s in f.samples
                   if s.name in (WAIT, "hookpolicy_steps_total")}
    finally:
        attached.remove()
    return {"slept": slept, "in_step": in_step, "waited": samples.get((WAIT, str(rank))),
            "steps": samples.get(("hookpolicy_steps_total", str(rank)))}


@pytest.mark.slow
@pytest.mark.parametrize("slow", [0, 1])
def test_the_peers_of_a_slowed_rank_wait_about_its_delay_and_it_waits_least(
        tmp_path: Path, free_port: int, slow: int) -> None:
    policy = tmp_path / "guard.yaml"
    policy.write_text(
        "apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: {name: guard}\nspec:\n  rules:\n"
        "    - name: nan\n      match: {modules: ['**']}\n      trigger: {at: step}\n      target: grad\n"
        "      actions:\n        - alert: {if: 'nonfinite > 0', then: skip_step}\n")
    ranks = spawn(slowed, tmp_path, free_port, str(policy), slow)
    peer = 1 - slow
    slowed_rank, waiting = ranks[slow], ranks[peer]
    assert slowed_rank["steps"] == waiting["steps"] == STEPS
    assert slowed_rank["slept"] >= STEPS * DELAY
    # each rank exports its own wait; the peer's holds most of the slowed rank's sleep, and never more
    # than the time its own optimizer.step() calls took in all (the agreement runs inside them)
    assert waiting["waited"] is not None and slowed_rank["waited"] is not None
    assert 0.6 * slowed_rank["slept"] <= waiting["waited"] <= waiting["in_step"]
    # the slowed rank arrives last: it waits least, far less than it made the other wait
    assert slowed_rank["waited"] <= slowed_rank["in_step"]
    assert slowed_rank["waited"] < 0.3 * waiting["waited"]
