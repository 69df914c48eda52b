"""A series set per job: statistics the same on every rank are exported by rank 0 only (`engine/decide/replicas.py`).

2 gloo ranks in process (`helpers.distributed.spawn`), each with its own registry (as
`hookpolicy apply` gives each rank its own `/metrics`). The references are PyTorch's:
`torch.linalg.vector_norm` of the gradients DDP left in `.grad` (or of FSDP2's
`full_tensor()`), computed by the test on each rank, never by hookpolicy.
"""

from __future__ import annotations

import gc
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy.engine.hooks.wrappers import data_parallel
from helpers import REPO
from helpers.distributed import spawn
from helpers.policies import write_policy

sys.path.insert(0, str(REPO / "examples"))
from train_mlp import build_model, make_data  # noqa: E402

pytestmark = pytest.mark.slow

LINEARS = ("0", "2", "4")

RULES = """\
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm]}
- name: grads-each
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], series: rank}
- name: weights
  match: {types: [Linear]}
  trigger: {at: step}
  target: weight
  actions:
    - capture: {stats: [l2_norm], per: tensor}
- name: updates
  match: {types: [Linear]}
  trigger: {at: step}
  target: update
  actions:
    - capture: {stats: [l2_norm]}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions:
    - capture: {stats: [abs_max]}
- name: loss
  match: {root: true}
  trigger: {at: step}
  target: loss
  actions:
    - capture: {stats: [mean]}
- name: loss-own
  match: {root: true}
  trigger: {at: step}
  target: loss
  ranks: own
  actions:
    - capture: {stats: [mean]}
"""


def series(reg: CollectorRegistry, name: str, rule: str) -> dict[str, tuple[str, float]]:
    """module[.tensor] -> (rank label, value) of one rule's series in a registry."""
    found: dict[str, tuple[str, float]] = {}
    for family in reg.collect():
        for s in family.samples:
            if s.name == name and s.labels["rule"] == rule:
                key = s.labels["module"] + (f".{s.labels['tensor']}" if s.labels["tensor"] else "")
                assert key not in found
                found[key] = (s.labels["rank"], s.value)
    return found


def norm(*tensors: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors])))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def listen() -> Lines:
    lines = Lines()
    logging.getLogger("hookpolicy").addHandler(lines)
    return lines


def linear(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


# -- DDP ---------------------------------------------------------------------------------


def ddp_series(rank: int, policy: str) -> dict[str, Any]:
    """Two DDP steps: what this rank's registry exports, and the references of the last step."""
    torch.manual_seed(0)
    inner = build_model()
    model = nn.parallel.DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    outputs: dict[str, float] = {}
    for name in LINEARS:
        linear(inner, name).register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, float(out.detach().abs().max())))
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    reg = CollectorRegistry()
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank) as attached:
        for step in range(2):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32])
            loss.backward()
            grads = {m: norm(linear(inner, m).weight.grad, linear(inner, m).bias.grad) for m in LINEARS}
            weights = {f"{m}.{t}": norm(getattr(linear(inner, m), t)) for m in LINEARS for t in ("weight", "bias")}
            before = {m: [p.detach().clone() for p in linear(inner, m).parameters()] for m in LINEARS}
            optimizer.step()
            if step == 0:  # an update is read back at the next step: after two steps, the first one's shows
                updates = {m: norm(*(after - b for after, b in zip(linear(inner, m).parameters(), before[m])))
                           for m in LINEARS}
        kept = attached.last_values()["hookpolicy_grad_l2_norm"]
        return {
            "grads": series(reg, "hookpolicy_grad_l2_norm", "grads"),
            "grads-each": series(reg, "hookpolicy_grad_l2_norm", "grads-each"),
            "weights": series(reg, "hookpolicy_weight_l2_norm", "weights"),
            "outputs": series(reg, "hookpolicy_output_abs_max", "outputs"),
            "loss": series(reg, "hookpolicy_loss_mean", "loss"),
            "updates": series(reg, "hookpolicy_update_l2_norm", "updates"),
            "loss-own": series(reg, "hookpolicy_loss_mean", "loss-own"),
            "last_values": {labels[2]: v for labels, v in kept.items() if labels[1] == "grads"},
            "reference": {"grads": grads, "weights": weights, "outputs": outputs, "loss": float(loss),
                          "updates": updates},
        }


def test_ddp_gradients_weights_and_the_jobs_loss_are_exported_once_per_job_activations_per_rank(
    tmp_path: Path, free_port: int,
) -> None:
    ranks = spawn(ddp_series, tmp_path, free_port, str(write_policy(tmp_path, RULES)))
    zero, one = ranks
    # the gradients after DDP's all-reduce are the same on both ranks (PyTorch's norms of .grad)
    for m in LINEARS:
        assert zero["reference"]["grads"][m] == pytest.approx(one["reference"]["grads"][m], rel=1e-12)
    # exported once per job: by rank 0, equal to the norms of the gradients
    assert set(zero["grads"]) == set(LINEARS) and one["grads"] == {}
    for m in LINEARS:
        assert zero["grads"][m][0] == "0"
        assert zero["grads"][m][1] == pytest.approx(zero["reference"]["grads"][m], rel=1e-6)
        assert one["last_values"][m] == pytest.approx(one["reference"]["grads"][m], rel=1e-6)  # still computed
    assert set(zero["weights"]) == set(zero["reference"]["weights"]) and one["weights"] == {}
    for key, (rank, got) in zero["weights"].items():
        assert rank == "0" and got == pytest.approx(zero["reference"]["weights"][key], rel=1e-6)
    # the update w_after - w_before of the first step (read back at the second), the same on both ranks
    assert set(zero["updates"]) == set(LINEARS) and one["updates"] == {}
    for m in LINEARS:
        assert zero["reference"]["updates"][m] == pytest.approx(one["reference"]["updates"][m], rel=1e-12)
        assert zero["updates"][m] == ["0", pytest.approx(zero["reference"]["updates"][m], rel=1e-5)]
    # `series: rank` keeps them per rank
    for r, result in enumerate(ranks):
        assert set(result["grads-each"]) == set(LINEARS)
        for m in LINEARS:
            assert result["grads-each"][m] == [str(r), pytest.approx(result["reference"]["grads"][m], rel=1e-6)]
    # activations are each rank's own: exported by both, each its own value
    for r, result in enumerate(ranks):
        for m in LINEARS:
            assert result["outputs"][m] == [str(r), pytest.approx(result["reference"]["outputs"][m], rel=1e-6)]
    assert zero["reference"]["outputs"] != one["reference"]["outputs"]
    # the job's loss (issue 23.2): the same on every rank, exported once; `ranks: own`: each rank's, per rank
    job_loss = (zero["reference"]["loss"] + one["reference"]["loss"]) / 2
    assert zero["loss"] == {"": ["0", pytest.approx(job_loss, rel=1e-6)]} and one["loss"] == {}
    for r, result in enumerate(ranks):
        assert result["loss-own"] == {"": [str(r), pytest.approx(result["reference"]["loss"], rel=1e-6)]}


# -- FSDP2 -------------------------------------------------------------------------------


def fsdp_series(rank: int, policy: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    reg = CollectorRegistry()

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        for step in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
            grads = {m: norm(full(linear(model, m).weight.grad), full(linear(model, m).bias.grad)) for m in LINEARS}
            before = {m: [full(p).detach().clone() for p in linear(model, m).parameters()] for m in LINEARS}
            optimizer.step()
            if step == 0:  # read back at the next step
                updates = {m: norm(*(full(p).detach() - b for p, b in zip(linear(model, m).parameters(), before[m])))
                           for m in LINEARS}
        return {"grads": series(reg, "hookpolicy_grad_l2_norm", "grads"), "updates": updates,
                "update series": series(reg, "hookpolicy_update_l2_norm", "updates"),
                "grads-each": series(reg, "hookpolicy_grad_l2_norm", "grads-each"),
                "outputs": series(reg, "hookpolicy_output_abs_max", "outputs"), "reference": grads}


def test_fsdp2_full_tensor_statistics_are_exported_once_per_job(tmp_path: Path, free_port: int) -> None:
    zero, one = spawn(fsdp_series, tmp_path, free_port, str(write_policy(tmp_path, RULES)))
    assert set(zero["grads"]) == set(LINEARS) and one["grads"] == {}
    for m in LINEARS:
        assert zero["grads"][m] == ["0", pytest.approx(zero["reference"][m], rel=1e-6)]
        assert one["grads-each"][m] == ["1", pytest.approx(one["reference"][m], rel=1e-6)]
    assert set(one["outputs"]) == set(LINEARS)
    assert set(zero["update series"]) == set(LINEARS) and one["update series"] == {}
    for m in LINEARS:
        assert zero["update series"][m] == ["0", pytest.approx(zero["updates"][m], rel=1e-5)]


# -- what hookpolicy cannot be sure of stays per rank --------------------------------------

ONE_RULE = """\
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm]}
"""


def own_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a hook annotated otherwise than torch's types
    """A DDP communication hook that is not torch's: hookpolicy cannot know what it does (here: all-reduce)."""
    import torch.distributed as dist
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


class Headed(nn.Module):
    """A DDP body and a head outside it: the head's gradients are each rank's own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.parallel.DistributedDataParallel(build_model())
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class HeapScans:
    """Counts the heap scans for modules (`heap.live_modules`' calls of `gc.get_objects`) inside the block."""

    def __enter__(self) -> "HeapScans":
        self.count = 0
        self._get_objects = gc.get_objects

        def counted(*args: Any) -> list[Any]:
            if sys._getframe(2).f_code.co_name == "live_modules":  # through heap.live_of
                self.count += 1
            return self._get_objects(*args)

        gc.get_objects = counted
        return self

    def __exit__(self, *exc: object) -> None:
        gc.get_objects = self._get_objects


def kept_per_rank(rank: int, policy: str) -> dict[str, Any]:
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    out: dict[str, Any] = {}
    lines = listen()

    def train(model: nn.Module, steps: int, manual: bool = False, unsynced: Optional[int] = None,
              through: Optional[nn.Module] = None) -> dict[str, Any]:
        """`steps` steps of `model` (called as `through`, a wrapper, when given) under the policy: its grad series."""
        reg = CollectorRegistry()
        call = model if through is None else through
        optimizer = None if manual else torch.optim.SGD(model.parameters(), lr=0.05)
        with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
            for step in range(steps):
                batch = slice(step * 32, (step + 1) * 32)
                if step == unsynced:
                    with model.no_sync():  # type: ignore[operator]
                        nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
                        assert optimizer is not None
                        optimizer.step()  # a local step, inside no_sync: nothing all-reduced
                        out["unsynced"] = norm(model.module[0].weight.grad, model.module[0].bias.grad)
                    optimizer.zero_grad()
                    continue
                nn.functional.mse_loss(call(x[batch]), y[batch]).backward()
                if manual:
                    out["manual synced"] = norm(model.module[0].weight.grad, model.module[0].bias.grad)
                    with torch.no_grad():
                        for p in model.parameters():
                            p -= 0.05 * p.grad
                            p.grad = None
                else:
                    assert optimizer is not None
                    out["synced"] = norm(model.module[0].weight.grad, model.module[0].bias.grad) \
                        if hasattr(model, "module") else None
                    optimizer.step()
                    optimizer.zero_grad()
            return series(reg, "hookpolicy_grad_l2_norm", "grads")  # before detaching, which drops them

    torch.manual_seed(0)
    hooked = nn.parallel.DistributedDataParallel(build_model())
    hooked.register_comm_hook(None, own_hook)
    out["comm hook"] = train(hooked, 1)
    torch.manual_seed(0)
    inner = build_model()
    around = nn.parallel.DistributedDataParallel(inner)
    with HeapScans() as scans:
        assert data_parallel(inner)  # what `apply` asks of a model it meets, before it attaches
        out["governed inside DDP"] = train(inner, 1, through=around)
    out["scans for the wrapper around"] = scans.count
    out["head outside DDP"] = train(Headed(), 1)
    torch.manual_seed(0)
    out["no optimizer"] = train(nn.parallel.DistributedDataParallel(build_model()), 1, manual=True)
    torch.manual_seed(0)
    out["no_sync step"] = train(nn.parallel.DistributedDataParallel(build_model()), 2, unsynced=1)
    out["lines"] = lines.lines
    return out


def test_what_may_differ_by_rank_stays_per_rank_and_rank_0_says_why(tmp_path: Path, free_port: int) -> None:
    zero, one = spawn(kept_per_rank, tmp_path, free_port, str(write_policy(tmp_path, ONE_RULE)))
    for case, modules in (("comm hook", set(LINEARS)), ("head outside DDP", {"body.0", "body.2", "body.4", "head"})):
        for r, result in enumerate((zero, one)):
            assert set(result[case]) == modules, case
            assert {rank for rank, _ in result[case].values()} == {str(r)}, case
    said = [line for line in zero["lines"] if "its series stay per rank" in line]
    assert any("a DDP communication hook (own_hook) may not all-reduce" in line for line in said), said
    # a script that steps no optimizer: its step is evaluated after DDP's all-reduce (the
    # cycle's callback runs behind the reducer's), so its gradients are the job's: rank 0's
    # series is the norm of the gradient DDP averaged, the same on both ranks; rank 1 exports none
    assert zero["manual synced"] == one["manual synced"]
    assert set(zero["no optimizer"]) == set(LINEARS) and one["no optimizer"] == {}
    assert list(zero["no optimizer"]["0"]) == ["0", pytest.approx(zero["manual synced"], rel=1e-6)]
    assert not any("no optimizer steps this model" in line for line in said), said
    assert any("head.weight is not all-reduced by a DistributedDataParallel over every rank" in line for line in said), said
    assert not [line for line in one["lines"] if "its series stay per rank" in line]  # said once per job
    # a model governed inside a DDP wrapper (as Lightning does): its gradients are the job's
    assert set(zero["governed inside DDP"]) == set(LINEARS) and one["governed inside DDP"] == {}
    # found by one heap scan, which data_parallel made and Replicas did not make again
    assert zero["scans for the wrapper around"] == one["scans for the wrapper around"] == 1
    # a step inside no_sync: rank 0 keeps the last all-reduced value; rank 1 exports none
    assert one["no_sync step"] == {}
    assert zero["no_sync step"]["0"] == ["0", pytest.approx(zero["synced"], rel=1e-6)]
    assert zero["unsynced"] != pytest.approx(one["unsynced"])  # the local gradients did differ
    assert sum("gradient sync off (no_sync)" in line for line in zero["lines"]) == 1


# -- maxJobSeries ------------------------------------------------------------------------

#: RULES' activation, gradient (the job's and `series: rank`) and job's-loss rules
BUDGETED = yaml.safe_dump([rule for rule in yaml.safe_load(RULES)
                           if rule["name"] in ("outputs", "grads", "grads-each", "loss")], sort_keys=False)

#: Without a budget the job exports 3 activation and 3 `series: rank` gradient series on
#: each of the 2 ranks, and once (rank 0) 3 gradient series and the job's loss: 16. A
#: budget of 12 keeps, at the first step, the job's gradients and the job's loss first (4),
#: then in publish order the activations (10) and one gradient of each rank (12).
JOB_SERIES = 12
UNCAPPED = 16


def budgeted_series(rank: int, policy: str) -> dict[str, Any]:
    """Three DDP steps under a policy with a series budget: every series this rank exports, its drops, the warnings."""
    torch.manual_seed(0)
    inner = build_model()
    model = nn.parallel.DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    reg = CollectorRegistry()
    lines = listen()
    exported: list[list[Any]] = []  # after each step: [[family, rule, module, value], ...]
    grads: list[float] = []
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        for step in range(3):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
            grads = [norm(linear(inner, m).weight.grad, linear(inner, m).bias.grad) for m in LINEARS]
            optimizer.step()
            exported.append(sorted(
                [s.name, s.labels["rule"], s.labels["module"], s.value] for family in reg.collect()
                for s in family.samples if s.name.startswith(("hookpolicy_output_", "hookpolicy_grad_", "hookpolicy_loss_"))
                and s.labels["rank"] == str(rank)))
        dropped = sum(s.value for family in reg.collect() for s in family.samples
                      if s.name == "hookpolicy_series_dropped_total")
    return {"exported": exported, "dropped": dropped, "grads": grads,
            "lines": [line for line in lines.lines if "spec.limits.max" in line]}


def test_the_jobs_series_stay_within_max_job_series_on_every_rank(tmp_path: Path, free_port: int) -> None:
    """`spec.limits.maxJobSeries` bounds what the whole job exports: both ranks keep the same series.

    A series every rank exports costs 2 (the ranks), one rank 0 exports for the job costs 1;
    every rank counts alike, so the job's total is within the budget and each rank's own
    series are the same ones.
    """
    path = write_policy(tmp_path, BUDGETED, spec=f"limits: {{maxJobSeries: {JOB_SERIES}}}\n")
    zero, one = spawn(budgeted_series, tmp_path, free_port, str(path))
    for step in range(3):
        kept = [zero["exported"][step], one["exported"][step]]
        names = [{tuple(s[:3]) for s in rank} for rank in kept]
        assert len(names[0]) + len(names[1]) == JOB_SERIES  # the job's whole budget, not more
        own = {s for s in names[0] if s[1] in ("outputs", "grads-each")}
        assert names[1] == own  # rank 1 keeps exactly the series of its own rank 0 keeps
        assert len(own) == 4 and {s[1] for s in names[0] - own} == {"grads", "loss"}
    # the gradients rank 0 exports for the job are still PyTorch's norms of the averaged gradients
    for name, rule, module, value in zero["exported"][-1]:
        if rule == "grads":
            assert value == pytest.approx(zero["grads"][LINEARS.index(module)], rel=1e-6)
    # each copy not exported is counted once, by the rank that would have exported it
    assert zero["dropped"] + one["dropped"] == UNCAPPED - JOB_SERIES
    assert len(zero["lines"]) == 1 and one["lines"] == []  # rank 0 says it for the job
    assert f"maxJobSeries={JOB_SERIES} in a job of 2 rank(s)" in zero["lines"][0]


#: The job's loss (RULES' `loss`), a `ranks: job` activation rule and each rank's own activations:
#: the three kinds of series a step publishes, two of them known only after the step's agreement.
ADMITTED = yaml.safe_dump([rule for rule in yaml.safe_load(RULES) if rule["name"] == "loss"], sort_keys=False) + """\
- name: acts
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  ranks: job
  actions:
    - capture: {stats: [mean]}
- name: mine
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions:
    - capture: {stats: [mean]}
"""


_LOSS, _ACTS, _MINE = [["loss", ""]], [["acts", m] for m in LINEARS], [["mine", m] for m in LINEARS]


@pytest.mark.parametrize("limit, budget, zero, one", [
    # maxSeries, per process, in the order the step publishes: this rank's own activations (3), then
    # what the agreement reduced: the job's loss (rank 0 exports it: dropped there) and, from the
    # second step on (the first announces the layout), the `ranks: job` activations (dropped)
    ("maxSeries", 3, [_MINE, _MINE, _MINE], [_MINE, _MINE, _MINE]),
    # maxJobSeries, for the whole job: a rank's own series cost 2 (the ranks), the job's 1. Of the
    # series new at a step, the job's first, the job's loss included (the step's one read-back
    # publishes after the agreement; before, the loss came after the step's rank series and was
    # dropped), then each rank's: the loss (1), two of the three own activations (5), the third
    # dropped on both ranks; at the second step the first `ranks: job` activation takes the last place
    ("maxJobSeries", 6, [_LOSS + _MINE[:2], _LOSS + _MINE[:2] + _ACTS[:1], _LOSS + _MINE[:2] + _ACTS[:1]],
     [_MINE[:2], _MINE[:2], _MINE[:2]]),
    # room for all: every series, at the step it first appears
    ("maxJobSeries", 13, [_MINE + _LOSS, _MINE + _LOSS + _ACTS, _MINE + _LOSS + _ACTS], [_MINE, _MINE, _MINE]),
])
def test_which_series_a_step_admits_under_each_budget(
    tmp_path: Path, free_port: int, limit: str, budget: int, zero: list[Any], one: list[Any],
) -> None:
    """The series a budget admits, and drops, at a step with a loss rule and a `ranks: job` rule.

    Pinned on both ranks step by step: which series each exports, how many it drops
    (`hookpolicy_series_dropped_total`: each once, by the rank that would export it) and which
    limit the one warning names (maxSeries: the rank that drops; maxJobSeries: rank 0 for the job).
    """
    path = write_policy(tmp_path, ADMITTED, spec=f"limits: {{{limit}: {budget}}}\n")
    ranks = spawn(budgeted_series, tmp_path, free_port, str(path))
    expected = [zero, one]
    uncapped = [[_MINE + _LOSS, _MINE + _LOSS + _ACTS, _MINE + _LOSS + _ACTS], [_MINE, _MINE, _MINE]]
    for rank, got in enumerate(ranks):
        assert [sorted(s[1:3] for s in step) for step in got["exported"]] == [sorted(s) for s in expected[rank]], rank
        assert got["dropped"] == len(uncapped[rank][-1]) - len(expected[rank][-1]), rank
    full = expected[0] != uncapped[0]
    assert len(ranks[0]["lines"]) == full and all(f"spec.limits.{limit}={budget}" in s for s in ranks[0]["lines"])
    assert ranks[1]["lines"] == []  # maxSeries: rank 1 drops none here; maxJobSeries: rank 0 says it for the job


def loss_at_a_no_sync_step(rank: int, policy: str) -> dict[str, Any]:
    """Two DDP steps, the second inside no_sync: the job's loss rank 0 exports after each, and each rank's loss."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    reg = CollectorRegistry()
    exported: list[Any] = []
    losses: list[float] = []
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        for step in range(2):
            batch = slice(step * 32, (step + 1) * 32)
            with model.no_sync() if step == 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            exported.append(series(reg, "hookpolicy_loss_mean", "loss"))
    return {"exported": exported, "losses": losses}


def test_the_jobs_loss_is_exported_at_a_step_ddp_did_not_sync(tmp_path: Path, free_port: int) -> None:
    """The job's loss is merged in the agreement, not all-reduced by DDP: a step inside no_sync (whose
    gradients are each rank's own, so the gradient series wait) still exports it, rank 0 alone."""
    rules = yaml.safe_dump([rule for rule in yaml.safe_load(RULES) if rule["name"] in ("grads", "loss")], sort_keys=False)
    zero, one = spawn(loss_at_a_no_sync_step, tmp_path, free_port, str(write_policy(tmp_path, rules)))
    for step in range(2):
        job = (zero["losses"][step] + one["losses"][step]) / 2
        assert zero["exported"][step] == {"": ["0", pytest.approx(job, rel=1e-6)]}
        assert one["exported"][step] == {}
