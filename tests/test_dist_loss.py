"""The job's loss: in a process group a loss rule sees every rank's backward roots together.

2 gloo ranks in process (`helpers.distributed.spawn`), each with its own data and its own
loss (rank r's loss is scaled by 1 + r, so the ranks' losses differ at every step). Each
rank writes out the roots it backpropagated (`loss.item()` after its backward, read by the
script, not by hookpolicy); the test computes the job's statistics from both ranks' roots
with PyTorch and compares them with what each rank published. References: the ranks' own
roots (job and `ranks: own`), the other rank (same statistics, same skipped step, same
parameters), and the collectives each rank issued (counted by wrapping
`torch.distributed`'s functions in the rank).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.distributed import spawn
from helpers.outputs import Said, json_lines
from helpers.policies import write_policy

sys.path.insert(0, str(REPO / "examples"))
from helpers.dist_train import wrap  # noqa: E402
from train_mlp import build_model, make_data  # noqa: E402

pytestmark = pytest.mark.slow

STATS = ["mean", "max", "min", "std", "numel", "nonfinite"]

#: `job` sees the job's loss (the default), `own` this rank's; `spike` skips a step on the job's loss.
RULES = """\
- name: job
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions:
    - capture: {stats: [%(stats)s]}
- name: own
  match: {root: true}
  trigger: {at: step}
  target: loss
  ranks: own
  actions:
    - capture: {stats: [%(stats)s]}
- name: spike
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions:
    - alert: {if: "loss > 4 * median(loss, 3)", warmup: 3, then: skip_step}
""" % {"stats": ", ".join(STATS)}

#: rank 1's loss is multiplied by this at SPIKE_STEP: the job's mean jumps, rank 0's own does not
SPIKE, SPIKE_STEP, STEPS = 50.0, 4, 6


def job_loss(rank: int, policy: str, how: str, micro: list[int]) -> dict[str, Any]:
    """`micro[rank]` backward calls a step; what this rank backpropagated, published, issued and did."""
    import torch.distributed as dist

    said = Said()
    lines = said.lines
    issued: list[str] = []
    for name in ("all_gather_single", "all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            issued.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    torch.manual_seed(0)
    model = build_model() if how == "plain" else wrap(build_model(), how.removesuffix("-inside"))
    governed = model.module if how == "ddp-inside" else model  # as Lightning: the module inside DDP is governed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    reg = CollectorRegistry()
    roots: list[list[float]] = []
    published: list[dict[str, dict[str, float]]] = []
    collectives: list[list[str]] = []
    params: list[float] = []
    attached = hookpolicy.load(policy).attach(governed, registry=reg, rank=rank)
    try:
        for step in range(STEPS):
            step_roots = []
            for k in range(micro[rank]):
                batch = slice(16 * (step * 4 + k), 16 * (step * 4 + k + 1))
                loss = nn.functional.mse_loss(model(x[batch]), y[batch]) * (1 + rank)
                if step == SPIKE_STEP and rank == 1:
                    loss = loss * SPIKE
                loss.backward()
                step_roots.append(loss.item())
            roots.append(step_roots)
            issued.clear()
            optimizer.step()
            collectives.append(list(issued))
            optimizer.zero_grad()
            values = attached.last_values()
            published.append({rule: {stat: values[f"hookpolicy_loss_{stat}"][("p", rule, "", "")] for stat in STATS}
                              for rule in ("job", "own")})
            params.append(sum(float(full(p).detach().double().sum()) for p in model.parameters()))
        skipped = [s.value for f in reg.collect() for s in f.samples
                   if s.name == "hookpolicy_skipped_steps_total" and s.labels.get("rule") == "spike"]
    finally:
        attached.remove()
        said.stop()
    return {"roots": roots, "published": published, "collectives": collectives, "params": params,
            "skipped": skipped, "lines": lines}


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def statistics(values: list[float]) -> dict[str, float]:
    """The statistics of `values` by PyTorch's own reductions."""
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "max": float(t.max()), "min": float(t.min()),
            "std": float(t.std()) if len(values) > 1 else float("nan"), "numel": float(len(values)),
            "nonfinite": float((~torch.isfinite(t)).sum())}


def same(published: dict[str, float], expected: dict[str, float]) -> bool:
    return all(published[s] == pytest.approx(expected[s], rel=1e-6, nan_ok=True) for s in STATS)


@pytest.mark.parametrize("how, micro", [("ddp", [2, 2]), ("fsdp", [1, 1]), ("plain", [3, 1]), ("ddp-inside", [1, 1])])
def test_a_loss_rule_sees_the_jobs_loss_and_decides_the_same_on_every_rank(
    tmp_path: Path, free_port: int, how: str, micro: list[int],
) -> None:
    """DDP and FSDP2 (the same number of micro-batches on each rank), the module inside a DDP
    wrapper governed while the script calls the wrapper (as Lightning does), and a model with
    no wrapper in a process group with 3 roots on rank 0 and 1 on rank 1 (the job's mean
    weighs each root once): the job's statistics are those of both ranks' roots together, on both
    ranks; `ranks: own` gives each rank its own; a spike on rank 1 alone skips the same step on
    both; one collective a step, and it is the agreement's."""
    policy = str(write_policy(tmp_path, RULES))
    ranks = spawn(job_loss, tmp_path, free_port, policy, how, micro)
    for step in range(STEPS):
        together = ranks[0]["roots"][step] + ranks[1]["roots"][step]
        for r in ranks:
            assert same(r["published"][step]["job"], statistics(together)), (step, r["published"][step]["job"])
            assert same(r["published"][step]["own"], statistics(r["roots"][step])), (step, r["published"][step])
        assert ranks[0]["published"][step]["job"] == ranks[1]["published"][step]["job"]  # bit for bit
        assert ranks[0]["published"][step]["own"] != ranks[1]["published"][step]["own"]
        for r in ranks:
            assert r["collectives"][step] == ["all_gather_single"], (step, r["collectives"])
    own_zero = [statistics(step)["mean"] for step in ranks[0]["roots"]]
    assert own_zero[SPIKE_STEP] < 4 * sorted(own_zero[SPIKE_STEP - 3:SPIKE_STEP])[1]  # rank 0 alone would not skip
    for r in ranks:
        assert r["skipped"] == [1]
        assert r["params"][SPIKE_STEP] == r["params"][SPIKE_STEP - 1] != r["params"][SPIKE_STEP + 1]
    if how.startswith("ddp"):
        assert ranks[0]["params"] == ranks[1]["params"]
    said = [[line for line in r["lines"] if "holds no DDP, FSDP or DTensor parameters" in line] for r in ranks]
    assert [len(s) for s in said] == ([1, 1] if how == "plain" else [0, 0]), said


#: A rule on the job's loss that fires at every step (an MSE loss is positive) and skips it.
ALWAYS = """\
- name: always
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions:
    - alert: {if: "loss > 0", then: skip_step}
"""
#: One more rule, on rank 0 only in the first case: the ranks hold different rules.
WATCH = """\
- name: watch
  match: {root: true}
  trigger: {at: step}
  target: loss
  ranks: own
  actions:
    - capture: {stats: [mean]}
"""


def decided_on_the_jobs_loss(rank: int, policies: list[str]) -> dict[str, Any]:
    """Three DDP steps under this rank's policy: whether each step left the parameters as they were."""
    torch.manual_seed(0)
    model = wrap(build_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    unchanged: list[bool] = []
    with hookpolicy.load(policies[rank]).attach(model, registry=CollectorRegistry(), rank=rank):
        for step in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            nn.functional.mse_loss(model(x[16 * step:16 * (step + 1)]), y[16 * step:16 * (step + 1)]).backward()
            optimizer.step()
            optimizer.zero_grad()
            unchanged.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return {"unchanged": unchanged}


@pytest.mark.parametrize("differ", [True, False])
def test_a_decision_on_the_jobs_loss_is_taken_only_when_the_ranks_hold_the_same_rules(
    tmp_path: Path, free_port: int, differ: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job's loss rules are evaluated after the step's agreement, in the step's one read-back: their
    skip is every rank's when the ranks hold the same rules (the parameters stay as they were on both),
    and, as any decision, no rank's when they differ (the parameters move; each record says why)."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    for folder in ("r0", "r1"):
        (tmp_path / folder).mkdir()
    first = write_policy(tmp_path / "r0", ALWAYS + (WATCH if differ else ""))
    second = write_policy(tmp_path / "r1", ALWAYS)
    ranks = spawn(decided_on_the_jobs_loss, tmp_path, free_port, [str(first), str(second)])
    for r in ranks:
        assert r["unchanged"] == [not differ] * 3, r
    outcome = "step not skipped (the ranks hold different rules: no decision at this step)" if differ else "step skipped"
    records = json_lines(tmp_path / "alerts.jsonl")
    assert sorted((r["rank"], r["step"], r["outcome"]) for r in records) == [
        (rank, step, outcome) for rank in (0, 1) for step in range(3)]
