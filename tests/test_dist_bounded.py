"""A bounded skip (`skip_step: {max_in_a_row: N}`) in a process group: its count is the job's, not a rank's.

2 gloo ranks in process (`helpers.distributed.spawn`), a DDP model under AdamW, and a loss
rule with `ranks: own` (each rank judges its own loss) whose alert skips with a bound. Each
rank adds a constant to its loss at steps of its own (`FIRES`), so the alert fires on rank 0
alone, on both, or on rank 1 alone; a constant leaves the gradients as they are, so only the
skips make the ranks' runs differ from a plain one. Kept per rank, the count in a row would
differ between the ranks (a rank where the alert did not fire would start again from 0, and
its skip, agreed on by every rank, would carry the streak past N). The references, which
hookpolicy did not compute:

- the steps skipped follow the bound over the steps at which the alert fired on any rank,
  computed here from the losses each rank's script printed (`agreed_skips`);
- each rank's parameters after every step equal, bit for bit, those of the same DDP loop
  that leaves `optimizer.step()` out by hand at those steps (no hookpolicy);
- both ranks skip the same steps and end with the same parameters (the agreement), and
  both count the same skips (`hookpolicy_skipped_steps_total`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.distributed import spawn
from helpers.outputs import json_lines, metric
from helpers.policies import write_policy

sys.path.insert(0, str(REPO / "examples"))
from helpers.dist_train import wrap  # noqa: E402
from train_mlp import build_model, make_data  # noqa: E402

pytestmark = pytest.mark.slow

#: a rank's own loss over this is a spike
THRESHOLD = 100.0
#: per rank, the steps whose loss gets THRESHOLD * 10 added (gradients unchanged): rank 0 fires alone at 2-3,
#: both fire at 4-6, rank 1 alone at 7 and again at 9 after a step where neither fires
FIRES = ({2, 3, 4, 5, 6}, {4, 5, 6, 7, 9})
STEPS = 11

RULE = """\
- name: spike
  match: {root: true}
  trigger: {at: step}
  target: loss
  ranks: own
  actions:
    - alert:
        if: "loss > %g"
        per: rule
        then: skip_step
        skip_step: %s
        message: "loss {loss:.4g} at step {step}; {outcome}"
"""


def agreed_skips(losses: list[list[float]], max_in_a_row: int) -> list[int]:
    """The steps skipped, from each rank's printed losses: the alert fires at a step where it fired on any rank;
    a firing step is skipped unless `max_in_a_row` steps in a row were (then it is applied and the count starts
    again), and a step where it fired on no rank ends the count."""
    skipped: list[int] = []
    in_a_row = 0
    for step, seen in enumerate(zip(*losses)):
        if not any(loss > THRESHOLD for loss in seen):
            in_a_row = 0
        elif in_a_row >= max_in_a_row:
            in_a_row = 0
        else:
            skipped.append(step)
            in_a_row += 1
    return skipped


def train(rank: int, policy: Optional[str], by_hand: list[int]) -> dict[str, Any]:
    """STEPS DDP steps of this rank, under `policy` or with `optimizer.step()` left out at `by_hand`:
    the loss each step printed, the parameters after it, and the skips counted."""
    torch.manual_seed(0)
    model = wrap(build_model(), "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = make_data(rank)
    reg = CollectorRegistry()
    attached = None if policy is None else hookpolicy.load(policy).attach(model, registry=reg, rank=rank)
    losses: list[float] = []
    params: list[list[list[float]]] = []
    try:
        for step in range(STEPS):
            batch = slice(16 * step, 16 * (step + 1))
            loss = nn.functional.mse_loss(model(x[batch]), y[batch])
            if step in FIRES[rank]:
                loss = loss + 10 * THRESHOLD
            loss.backward()
            losses.append(loss.item())
            if step not in by_hand:
                optimizer.step()
            optimizer.zero_grad()
            params.append([p.detach().reshape(-1).tolist() for p in model.parameters()])
    finally:
        if attached is not None:
            attached.remove()
    return {"losses": losses, "params": params,
            "skipped": metric(reg, "hookpolicy_skipped_steps_total", {"rule": "spike"})}


def guarded_and_by_hand(rank: int, policy: str, max_in_a_row: int) -> dict[str, Any]:
    """This rank's run under `policy`, then the same loop leaving out by hand the steps `agreed_skips` computes
    from every rank's printed losses (gathered from the ranks, no hookpolicy attached)."""
    import torch.distributed as dist

    guarded = train(rank, policy, [])
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, guarded["losses"])
    want = agreed_skips(every, max_in_a_row)
    return {"guarded": guarded, "want": want, "by_hand": train(rank, None, want)}


def test_a_bounded_skip_counts_the_steps_every_rank_skipped(
    tmp_path: Path, free_port: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`max_in_a_row: 2` with the alert firing on rank 0 alone (steps 2-3), then on both (4-6), then on rank 1
    alone (7, and 9 after a quiet step): steps 2, 3 skipped, 4 applied on both ranks (2 in a row, though rank 1
    skipped none yet), 5, 6 skipped, 7 applied, 9 skipped; each rank equals the loop skipping them by hand."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    policy = str(write_policy(tmp_path, RULE % (THRESHOLD, "{max_in_a_row: 2}")))
    ranks = spawn(guarded_and_by_hand, tmp_path, free_port, policy, 2)
    want = ranks[0]["want"]
    assert want == ranks[1]["want"] == [2, 3, 5, 6, 9]  # the losses fired where FIRES says
    for r in ranks:
        guarded, by_hand = r["guarded"], r["by_hand"]
        params = guarded["params"]
        unchanged = [step for step in range(1, STEPS) if params[step] == params[step - 1]]
        assert unchanged == want, unchanged
        assert guarded["skipped"] == len(want)
        assert guarded["losses"] == by_hand["losses"]
        assert params == by_hand["params"]  # bit for bit, every step
    assert ranks[0]["guarded"]["params"] == ranks[1]["guarded"]["params"]
    records = json_lines(tmp_path / "alerts.jsonl")
    said = sorted((r["rank"], r["step"], r["outcome"].split(" (")[0]) for r in records)
    assert said == sorted((rank, step, "step skipped" if step in want else "step not skipped")
                          for rank in (0, 1) for step in sorted(FIRES[rank])), said
