"""`ranks: job`: activation statistics of every rank together, reduced in the step's one agreement collective.

2 gloo ranks in process (`helpers.distributed.spawn`), DDP, each rank with its own data.
The reference: each rank's own forward hooks (registered by the test, not by hookpolicy)
keep every Linear output of every micro-batch; the test computes the statistics of both
ranks' outputs together with PyTorch and compares them with what each rank published.
"""

from __future__ import annotations

import math
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
from helpers.outputs import Said
from helpers.policies import refusal, write_policy

sys.path.insert(0, str(REPO / "examples"))
from helpers.dist_train import wrap  # noqa: E402
from train_mlp import build_model, make_data  # noqa: E402

STATS = ["mean", "std", "min", "max", "l2_norm", "numel", "nonfinite"]
RULES = """\
- name: acts
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  ranks: job
  actions:
    - capture: {stats: [%(stats)s], per: module}
    - capture: {stats: [mean, numel], per: rule}
- name: mine
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions:
    - capture: {stats: [mean, numel]}
""" % {"stats": ", ".join(STATS)}
#: one more `ranks: job` rule, on rank 1 only: the ranks' layouts differ
EXTRA = """\
- name: more
  match: {types: [ReLU]}
  trigger: {at: forward}
  target: output
  ranks: job
  actions:
    - capture: {stats: [mean]}
"""
STEPS, MICRO = 4, 2


def activations(rank: int, policies: list[str], reattach: bool = False) -> dict[str, Any]:
    """DDP, MICRO micro-batches a step; each Linear's outputs as this rank's own hooks saw them, and what it published.

    `reattach`: rank r detaches and attaches its policy again before step 2 + r, as a reload
    that is not agreed on swaps each rank at its own step.
    """
    import torch.distributed as dist

    said = Said()
    lines = said.lines
    issued: list[str] = []
    original = dist.all_gather_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        issued.append("all_gather_single")
        return original(*args, **kwargs)

    dist.all_gather_single = counted
    torch.manual_seed(0)
    model = wrap(build_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    seen: dict[str, list[float]] = {}
    # hookpolicy names modules as in the unwrapped model (DDP's `module.` is not part of a name)
    linears = {name.removeprefix("module."): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    handles = [m.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, []).extend(
        out.detach().double().reshape(-1).tolist())) for name, m in linears.items()]
    reg = CollectorRegistry()
    outputs: list[dict[str, list[float]]] = []
    published: list[dict[str, Any]] = []
    collectives: list[int] = []
    attached = hookpolicy.load(policies[rank]).attach(model, registry=reg, rank=rank)
    try:
        for step in range(STEPS):
            if reattach and step == 2 + rank:
                attached.remove()
                attached = hookpolicy.load(policies[rank]).attach(model, registry=reg, rank=rank)
            seen.clear()
            for k in range(MICRO):
                batch = slice(16 * (step * MICRO + k), 16 * (step * MICRO + k + 1))
                (nn.functional.mse_loss(model(x[batch]), y[batch]) / MICRO).backward()
            outputs.append({name: list(values) for name, values in seen.items()})
            issued.clear()
            optimizer.step()
            collectives.append(len(issued))
            optimizer.zero_grad()
            values = attached.last_values()
            published.append({
                "job": {name: {s: values.get(f"hookpolicy_output_{s}", {}).get(("p", "acts", name, ""))
                               for s in STATS} for name in linears},
                "rule": {s: values.get(f"hookpolicy_output_{s}", {}).get(("p", "acts", "", "")) for s in ("mean", "numel")},
                "own": {name: values["hookpolicy_output_mean"][("p", "mine", name, "")] for name in linears},
            })
        exported = sorted({s.labels["rule"] for f in reg.collect() for s in f.samples if s.name == "hookpolicy_output_mean"})
    finally:
        attached.remove()
        for handle in handles:
            handle.remove()
        said.stop()
    return {"outputs": outputs, "published": published, "collectives": collectives, "lines": lines,
            "exported": exported}


def statistics(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std()), "min": float(t.min()), "max": float(t.max()),
            "l2_norm": float(torch.linalg.vector_norm(t)), "numel": float(t.numel()),
            "nonfinite": float((~torch.isfinite(t)).sum())}


@pytest.mark.slow
@pytest.mark.parametrize("reattach", [False, True])
def test_ranks_job_captures_the_statistics_of_every_ranks_activations(
    tmp_path: Path, free_port: int, reattach: bool,
) -> None:
    """From the second step on (the first announces the layout), each Linear's statistics (per
    module) and their whole (per rule) are those of both ranks' outputs together, the same on both
    ranks (exported to Prometheus by rank 0 alone); the default (ranks: own) stays each rank's
    own; one collective a step. The same when each rank attaches its policy again at a step of
    its own (rank 0 before step 2, rank 1 before step 3): the new attachment sends what the
    other rank's expects, so the collective keeps its shape and the statistics go on."""
    policy = str(write_policy(tmp_path, RULES))
    ranks = spawn(activations, tmp_path, free_port, [policy, policy], reattach)
    names = sorted(ranks[0]["outputs"][0])
    assert len(names) == 3
    for r in ranks:
        assert r["collectives"] == [1] * STEPS
        assert all(v is None for name in names for v in r["published"][0]["job"][name].values())  # not reduced yet
    for step in range(1, STEPS):
        together = {name: ranks[0]["outputs"][step][name] + ranks[1]["outputs"][step][name] for name in names}
        for r in ranks:
            for name in names:
                expected, got = statistics(together[name]), r["published"][step]["job"][name]
                assert got == {s: pytest.approx(expected[s], rel=1e-6, abs=1e-9) for s in STATS}, (step, name)
                assert r["published"][step]["own"][name] == pytest.approx(statistics(r["outputs"][step][name])["mean"],
                                                                          rel=1e-6, abs=1e-9)
            everything = [v for name in names for v in together[name]]
            assert r["published"][step]["rule"] == pytest.approx(
                {"mean": math.fsum(everything) / len(everything), "numel": len(everything)}, rel=1e-6)
        assert ranks[0]["published"][step]["job"] == ranks[1]["published"][step]["job"]  # bit for bit
        assert ranks[0]["published"][step]["own"] != ranks[1]["published"][step]["own"]
    assert [r["exported"] for r in ranks] == [["acts", "mine"], ["mine"]]  # the job's series: once, by rank 0


@pytest.mark.slow
def test_ranks_with_other_job_statistics_publish_none_and_say_so(tmp_path: Path, free_port: int) -> None:
    """Rank 1 has one `ranks: job` rule more: no rank can reduce what the other does not send.
    Neither publishes job statistics (nor hangs, nor crashes); each says so once."""
    for folder in ("r0", "r1"):
        (tmp_path / folder).mkdir()
    first = write_policy(tmp_path / "r0", RULES)
    second = write_policy(tmp_path / "r1", RULES + EXTRA)
    ranks = spawn(activations, tmp_path, free_port, [str(first), str(second)])
    for r in ranks:
        assert r["collectives"] == [1] * STEPS
        assert all(v is None for step in r["published"] for job in step["job"].values() for v in job.values())
        said = [line for line in r["lines"] if "ranks: job statistics are not those of another rank" in line]
        assert len(said) == 1 and "at step 0" in said[0], r["lines"]


@pytest.mark.parametrize("keys, actions, message", [
    ("trigger: {at: forward}\n  target: output", "- alert: {if: 'max > 1'}",
     "ranks: job reduces captured statistics across ranks; alert acts on this rank's tensors"),
    ("trigger: {at: forward}\n  target: output", "- clip: {max: 1.0}", "clip acts on this rank's tensors"),
    ("trigger: {at: forward}\n  target: output", "- capture: {stats: [mean], per: tensor}",
     "per: module or per: rule"),
    ("trigger: {at: forward}\n  target: output", "- capture: {stats: [mean], tensors: {dir: t}}",
     "tensor files and histograms would hold this rank's tensors"),
    ("trigger: {at: forward, phase: eval}\n  target: output", "- capture: {stats: [mean]}",
     "only phase: train (the default) applies"),
    ("trigger: {at: step}\n  target: grad", "- capture: {stats: [mean]}", "are the job's already"),
])
def test_a_ranks_job_rule_that_cannot_be_reduced_is_refused_at_its_line(
    tmp_path: Path, keys: str, actions: str, message: str,
) -> None:
    rule = f"- name: r\n  match: {{types: [Linear]}}\n  {keys}\n  ranks: job\n  actions:\n    {actions}\n"
    shown = refusal(tmp_path, rule)
    assert message in shown, shown


def two_models(rank: int, policy: str) -> dict[str, Any]:
    """Two DDP models of one class, each attached with a registry of its own (so both are labelled
    `Sequential`), stepped in turn: what each published of its `ranks: job` statistics."""
    torch.manual_seed(0)
    models = [wrap(build_model(), "ddp") for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    x, y = make_data(rank)
    attached = [hookpolicy.load(policy).attach(m, registry=CollectorRegistry(), rank=rank) for m in models]
    published: list[list[Optional[float]]] = [[], []]
    try:
        for step in range(STEPS):
            for i, (model, optimizer) in enumerate(zip(models, optimizers)):
                nn.functional.mse_loss(model(x[16 * step:16 * (step + 1)]), y[16 * step:16 * (step + 1)]).backward()
                optimizer.step()
                optimizer.zero_grad()
                published[i].append(attached[i].last_values().get("hookpolicy_output_numel", {}).get(("p", "acts", "", "")))
    finally:
        for a in attached:
            a.remove()
    return {"published": published}


@pytest.mark.slow
def test_two_models_of_one_class_each_carry_their_own_layout(tmp_path: Path, free_port: int) -> None:
    """The layout a model's next agreement follows is kept per model object: two models that share a
    label (one class, two registries) both publish the job's statistics from their second step on
    (both ranks' outputs: 2 ranks x 16 rows x the Linears' widths). It was kept per label, and
    each model's agreement overwrote the other's: neither ever published."""
    zero, one = spawn(two_models, tmp_path, free_port, str(write_policy(tmp_path, RULES)))
    widths = sum(m.out_features for m in build_model() if isinstance(m, nn.Linear))
    for result in (zero, one):
        for series in result["published"]:
            assert series[0] is None and series[1:] == [2 * 16 * widths] * (STEPS - 1), series
