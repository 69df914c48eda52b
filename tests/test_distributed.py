"""Distributed training: FSDP2/DTensor statistics of the full tensor, one skip/halt decision on every rank.

Two kinds of tests, all with 2 CPU ranks on gloo:

- in process, `torch.multiprocessing.spawn`: policies attached with the API, each rank
  compares what hookpolicy published with PyTorch's own functions on the full tensors
  (`DTensor.full_tensor()`, `vector_norm`, `std`, `clip_grad_norm_`); results come back as
  JSON files and are asserted here;
- end to end, `hookpolicy apply -- torchrun`: the DDP and FSDP2 rows of the compatibility
  matrix (tests/helpers/dist_train.py, which reads the gradients the optimizer used with an
  optimizer step pre-hook of its own).
"""

from __future__ import annotations

import errno
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.distributed import spawn
from helpers.outputs import Said, json_lines
from helpers.policies import write_policy
from helpers.processes import Run, labels_of, losses, torchrun, value, wait_metrics

sys.path.insert(0, str(REPO / "examples"))
from train_mlp import build_model, make_data  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "helpers" / "dist_train.py")
STATS = ["l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel"]


# -- in process: torch.multiprocessing.spawn ----------------------------------------------


def gauge(reg: CollectorRegistry, name: str, **labels: str) -> Optional[float]:
    found = [s.value for f in reg.collect() for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def reference(t: torch.Tensor) -> dict[str, float]:
    """The statistics of spec section 4, by PyTorch's own functions on the whole tensor."""
    t = t.detach().double().reshape(-1)
    n = t.numel()
    norm = float(torch.linalg.vector_norm(t))
    return {
        "l2_norm": norm, "mean": float(t.mean()), "std": float(t.std()), "min": float(t.min()),
        "max": float(t.max()), "abs_max": float(t.abs().max()), "rms": norm / math.sqrt(n),
        "zero_fraction": float((t == 0).sum()) / n, "nonfinite": float((~torch.isfinite(t)).sum()),
        "numel": float(n),
    }


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def fsdp_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


# `series: rank`: both ranks export their numbers, which are compared (by default only rank 0
# exports statistics that are the same on every rank: tests/test_replicas.py)
FSDP_RULES = """\
- name: grads
  priority: 0
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [%s], per: tensor, series: rank}
    - capture: {stats: [l2_norm, mean, std, min, max, nonfinite], per: module, series: rank}
    - capture: {stats: [l2_norm, std, numel], per: rule, series: rank}
- name: weights
  priority: 0
  match: {types: [Linear]}
  trigger: {at: step}
  target: weight
  actions:
    - capture: {stats: [%s], per: tensor, series: rank}
- name: clip
  priority: 10
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - clip: {max_norm: 0.05, per: rule}
""" % (", ".join(STATS), ", ".join(STATS))


def fsdp_statistics(rank: int, policy: str) -> list[list[Any]]:
    """Two FSDP2 steps: (what, published, reference) for every statistic, and the clip against clip_grad_norm_."""
    model = fsdp_model()
    params = list(model.parameters())
    named = [(name.rsplit(".", 1), p) for name, p in model.named_parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    used: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda o, a, k: used.extend(full(p.grad) for p in params))
    reg = CollectorRegistry()
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    out: list[list[Any]] = []
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        for step in range(2):
            loss = nn.functional.mse_loss(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32])
            optimizer.zero_grad()
            loss.backward()
            grads = {(m, t): full(p.grad) for (m, t), p in named}
            weights = {(m, t): full(p).detach().clone() for (m, t), p in named}
            shadows = [nn.Parameter(p.detach().clone()) for p in params]
            for s, p in zip(shadows, params):
                s.grad = p.grad.clone()
            torch.nn.utils.clip_grad_norm_(shadows, 0.05)
            used.clear()
            optimizer.step()
            for target, tensors, rule in (("grad", grads, "grads"), ("weight", weights, "weights")):
                for (module, tensor), t in tensors.items():
                    want = reference(t)
                    for stat in STATS:
                        got = gauge(reg, f"hookpolicy_{target}_{stat}", rule=rule, module=module, tensor=tensor)
                        out.append([f"step {step} {target} {module}.{tensor} {stat}", got, want[stat]])
            for module in ("0", "2", "4"):
                want = reference(torch.cat([grads[(module, "weight")].reshape(-1), grads[(module, "bias")]]))
                for stat in ("l2_norm", "mean", "std", "min", "max", "nonfinite"):
                    got = gauge(reg, f"hookpolicy_grad_{stat}", rule="grads", module=module, tensor="")
                    out.append([f"step {step} grad {module} {stat}", got, want[stat]])
            want = reference(torch.cat([g.reshape(-1) for g in grads.values()]))
            for stat in ("l2_norm", "std", "numel"):
                out.append([f"step {step} grad rule {stat}", gauge(reg, f"hookpolicy_grad_{stat}", rule="grads",
                                                                      module=""), want[stat]])
            diff = max(float((u - full(s.grad)).abs().max()) for u, s in zip(used, shadows))
            out.append([f"step {step} clip - clip_grad_norm_", diff, 0.0])
    return out


def test_fsdp2_statistics_are_those_of_the_full_tensors(tmp_path: Path, free_port: int) -> None:
    policy = str(write_policy(tmp_path, FSDP_RULES))
    ranks = spawn(fsdp_statistics, tmp_path, free_port, policy)
    assert ranks[0] and [r[0] for r in ranks[0]] == [r[0] for r in ranks[1]]
    for rows in ranks:
        for what, got, want in rows:
            assert got is not None, what
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6 if "clip" in what else 1e-12, nan_ok=True), what
    published = [[got for _, got, _ in rows] for rows in ranks]
    assert published[0] == published[1]  # the same numbers on both ranks, bit for bit


AGC_RULES = """\
- name: agc
  match: {modules: ["**"]}
  trigger: {at: step}
  actions:
    - clip: {unitwise_ratio: 0.05, eps: 0.001}
"""


def agc_reference(grad: torch.Tensor, weight: torch.Tensor, ratio: float, eps: float) -> tuple[torch.Tensor, int]:
    """NFNets' unit-wise clip of one full gradient (see tests/test_agc.py), out of place, and its units clipped."""
    dims = tuple(range(1, grad.ndim)) if grad.ndim > 1 else None
    bound = torch.linalg.vector_norm(weight, dim=dims, keepdim=True).clamp(min=eps) * ratio
    g_norm = torch.linalg.vector_norm(grad, dim=dims, keepdim=True)
    over = g_norm > bound
    return torch.where(over, grad * (bound / g_norm.clamp(min=1e-6)), grad), int(over.sum())


def fsdp_agc(rank: int, policy: str, rows: bool) -> list[list[Any]]:
    """Two FSDP2 steps under AGC: the gradients the optimizer used against the reference on the full tensors.

    `rows`: FSDP2's default Shard(0) (each unit on one rank, biases split); else weights
    sharded on dim 1 (`shard_placement_fn`), so every unit is split across the ranks.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    torch.manual_seed(0)
    model = build_model()
    placement = None if rows else (lambda p: Shard(1) if p.ndim == 2 else None)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, shard_placement_fn=placement)
    fully_shard(model)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    used: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda o, a, k: used.extend(full(p.grad) for p in params))
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    out: list[list[Any]] = []
    counts = {"0": 0, "2": 0, "4": 0}
    reg = CollectorRegistry()
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        for step in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
            want = []
            for name, p in model.named_parameters():
                clipped, count = agc_reference(full(p.grad), full(p).detach(), 0.05, 0.001)
                want.append(clipped)
                counts[name.split(".")[0]] += count
            used.clear()
            optimizer.step()
            for (name, p), u, w in zip(model.named_parameters(), used, want):
                out.append([f"step {step} {name} {tuple(p.placements)}", float((u - w).abs().max()), 0.0])
        for module, count in counts.items():  # the units of the full tensors, the same on every rank
            out.append([f"units clipped in {module}", gauge(reg, "hookpolicy_clipped_total", rule="agc",
                                                            module=module), float(count)])
        out.append(["the reference clipped something", float(sum(counts.values()) > 0), 1.0])
    return out


@pytest.mark.parametrize("rows", [True, False], ids=["shard-dim0", "shard-dim1"])
def test_fsdp2_agc_equals_the_reference_on_the_full_tensors(tmp_path: Path, free_port: int, rows: bool) -> None:
    policy = str(write_policy(tmp_path, AGC_RULES))
    ranks = spawn(fsdp_agc, tmp_path, free_port, policy, rows)
    for rows_ in ranks:
        for what, got, want in rows_:
            assert got == pytest.approx(want, abs=1e-7), what


PLACEMENT_RULES = """\
- name: replicated
  match: {modules: [rep]}
  trigger: {at: step}
  target: weight
  actions:
    - capture: {stats: [l2_norm, mean, std, min, max, numel], per: tensor}
- name: sharded-out
  match: {modules: [out]}
  trigger: {at: forward}
  target: output
  actions:
    - capture: {stats: [l2_norm, mean, std, min, max, nonfinite, numel], per: tensor, tensors: {dir: shards}}
- name: partial
  match: {modules: [pending]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], per: tensor}
"""


class ShardedOutput(nn.Module):
    """Returns its input as the rank's rows of a `Shard(0)` DTensor (as a tensor-parallel layer may)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
        return DTensor.from_local(x * 2, mesh, [Shard(0)], run_check=False)


class Placements(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        self.rep = nn.Linear(6, 5)
        for name in ("weight", "bias"):
            setattr(self.rep, name, nn.Parameter(distribute_tensor(getattr(self.rep, name).detach(), mesh, [Replicate()])))
        self.out = ShardedOutput()
        self.pending = nn.Linear(3, 1)
        self.pending.weight = nn.Parameter(distribute_tensor(self.pending.weight.detach(), mesh, [Replicate()]))
        self._mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def placements(rank: int, policy: str, folder: str) -> list[list[Any]]:
    from torch.distributed.tensor import DTensor, Partial
    os.environ["HOOKPOLICY_OUTPUT_DIR"] = folder
    model = Placements()
    reg = CollectorRegistry()
    out: list[list[Any]] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookpolicy.load(policy).attach(model, registry=reg, rank=rank):
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (rank + 1) - 5
        y = model(x)
        whole = y.full_tensor()
        model.pending.weight.grad = DTensor.from_local(torch.full((1, 3), float(rank + 1)), model._mesh, [Partial()])
        for p in model.rep.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for stat, want in reference(whole).items():
            if stat in ("l2_norm", "mean", "std", "min", "max", "nonfinite", "numel"):
                out.append([f"output {stat}", gauge(reg, f"hookpolicy_output_{stat}", rule="sharded-out"), want])
        for name in ("weight", "bias"):
            want = reference(getattr(model.rep, name).to_local())  # replicated: every rank holds the whole tensor
            for stat in ("l2_norm", "mean", "std", "min", "max", "numel"):  # the same on every rank: rank 0 exports it
                out.append([f"rep.{name} {stat}", gauge(reg, f"hookpolicy_weight_{stat}", rule="replicated",
                                                         tensor=name), want[stat] if rank == 0 else None])
        out.append(["partial: no statistic", gauge(reg, "hookpolicy_grad_l2_norm", rule="partial"), None])
        out.append(["partial: one hook error", gauge(reg, "hookpolicy_hook_errors_total", rule="partial"), 1.0])
    saved = torch.load(Path(folder, "shards", f"step00000000-out-output-shard{rank}.pt"))
    out.append(["tensor file: this rank's shard", float((saved - x * 2).abs().max()), 0.0])
    return out


def test_replicated_sharded_and_partial_placements(tmp_path: Path, free_port: int) -> None:
    policy = str(write_policy(tmp_path, PLACEMENT_RULES))
    for rows in spawn(placements, tmp_path, free_port, policy, str(tmp_path)):
        for what, got, want in rows:
            if want is None:
                assert got is None, what
            else:
                assert got == pytest.approx(want, rel=1e-6, abs=1e-12), what


DECISION_RULES = """\
- name: guard
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: %s}
"""


def one_decision(rank: int, policy: str) -> dict[str, Any]:
    """Plain model, no wrapper: a NaN in rank 0's gradient at step 1 only; what each rank did."""
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    digests: list[list[float]] = []
    raised = None
    steps = -1
    reg = CollectorRegistry()
    attached = hookpolicy.load(policy).attach(model, registry=reg, rank=rank)
    try:
        for step in range(3):
            nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            if step == 1 and rank == 0:
                model[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            digests.append([float(p.detach().double().sum()) for p in model.parameters()])
    except hookpolicy.Halt as halt:
        raised = str(halt)
    finally:
        steps = attached.step
        skipped = gauge(reg, "hookpolicy_skipped_steps_total", rule="guard")
        attached.remove()
    return {"digests": digests, "halt": raised, "steps": steps, "skipped": skipped}


def test_skip_decided_on_one_rank_is_taken_by_all(tmp_path: Path, free_port: int) -> None:
    policy = str(write_policy(tmp_path, DECISION_RULES % "skip_step"))
    ranks = spawn(one_decision, tmp_path, free_port, policy)
    for r in ranks:
        assert r["halt"] is None and r["steps"] == 3 and r["skipped"] == 1
        assert r["digests"][0] == r["digests"][1] != r["digests"][2]  # step 1 changed nothing, step 2 did


def test_halt_decided_on_one_rank_is_taken_by_all(tmp_path: Path, free_port: int) -> None:
    policy = str(write_policy(tmp_path, DECISION_RULES % "halt"))
    ranks = spawn(one_decision, tmp_path, free_port, policy)
    assert ranks[0]["halt"].startswith("hookpolicy: halted by p/guard at step 1")
    assert ranks[1]["halt"].startswith("hookpolicy: halted by p/guard at step 1") and "rank 0" in ranks[1]["halt"]
    assert [len(r["digests"]) for r in ranks] == [1, 1]  # no rank applied step 1


# -- onError: halt on one rank -------------------------------------------------------------

SINK_RULES = """\
- name: dump
  match: {modules: ["0"]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], tensors: {dir: tensors}}
- name: norms
  match: {modules: ["0"]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], log: {path: norms.jsonl}}
"""


def one_fault(rank: int, policy: str, folder: str, where: str, at: int = 1) -> dict[str, Any]:
    """Rank 1's sink fails for real at step `at` (`where`: its log path turned into a symbolic link, read
    before the step's agreement; or its tensor files' `os.replace` out of space, written after it)."""
    from hookpolicy.export import sinks

    said = Said()
    os.environ["HOOKPOLICY_OUTPUT_DIR"] = str(Path(folder) / f"out{rank}")
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    digests: list[list[float]] = []
    raised: Optional[dict[str, Any]] = None
    attached = hookpolicy.load(policy).attach(model, registry=CollectorRegistry(), rank=rank)
    try:
        for step in range(4):
            nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            if step == at and rank == 1:
                if where == "log":
                    log = Path(folder) / f"out{rank}" / "norms.jsonl"
                    log.unlink()
                    log.symlink_to(Path(folder) / "elsewhere.jsonl")
                else:
                    def full(*args: Any, **kwargs: Any) -> None:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    sinks.os.replace = full  # type: ignore[assignment]
            optimizer.step()
            optimizer.zero_grad()
            digests.append([float(p.detach().double().sum()) for p in model.parameters()])
    except hookpolicy.Halt as halt:
        raised = {"rule": halt.rule, "step": halt.step, "line": str(halt)}
    finally:
        steps = attached.step
        attached.remove()
        said.stop()
    final = [float(p.detach().double().sum()) for p in model.parameters()]
    return {"digests": digests, "final": final, "halt": raised, "steps": steps, "lines": said.lines}


@pytest.mark.parametrize(("where", "rule", "at"), [("log", "norms", 1), ("tensors", "dump", 2)])
def test_a_fault_under_on_error_halt_on_one_rank_halts_every_rank_at_the_same_step(
    tmp_path: Path, free_port: int, where: str, rule: str, at: int,
) -> None:
    """Alone, `onError: halt` raises where the fault is; in a group every rank must stop at the same step,
    or the others wait in their next collective. A fault read before the step's agreement halts that step;
    one written after it (the step's tensor files) the next. No rank applies the halting step."""
    policy = str(write_policy(tmp_path, SINK_RULES, spec="onError: halt\n"))
    ranks = spawn(one_fault, tmp_path, free_port, policy, str(tmp_path), where)
    for r in ranks:
        assert r["halt"] is not None and (r["halt"]["rule"], r["halt"]["step"]) == (rule, at), r
        assert len(r["digests"]) == at and r["final"] == r["digests"][-1]  # the steps before `at` applied, `at` not
    assert "rank 1 halted" in ranks[0]["halt"]["line"]


def test_a_fault_under_on_error_halt_after_the_last_step_decision_is_said_at_remove_not_raised(
    tmp_path: Path, free_port: int,
) -> None:
    """The last step's tensor files fail on rank 1 after the ranks agreed on it: no later agreement can take the
    halt, and raising it on one rank alone is what the agreement is for: it is said at `remove()`."""
    policy = str(write_policy(tmp_path, SINK_RULES, spec="onError: halt\n"))
    ranks = spawn(one_fault, tmp_path, free_port, policy, str(tmp_path), "tensors", 3)
    for r in ranks:
        assert r["halt"] is None and len(r["digests"]) == 4, r
    assert any("p/dump: not halted (onError: halt)" in line for line in ranks[1]["lines"]), ranks[1]["lines"]
    assert not any("not halted" in line for line in ranks[0]["lines"])


# -- ranks holding different rules ---------------------------------------------------------

EXTRA_RULE = """\
- name: watch
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], per: rule}
"""


def rule_sets(rank: int, policies: list[str], generations: list[int]) -> dict[str, Any]:
    """Each rank attaches its own policy file and generation; a NaN in rank 0's gradient at step 1."""
    from hookpolicy.engine.runtime import Attached

    said = Said()
    lines = said.lines
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    raised = None
    finite: list[bool] = []
    reg = CollectorRegistry()
    attached = Attached(hookpolicy.load(policies[rank]).policies, model, registry=reg, rank=rank,
                        generation=generations[rank])
    try:
        for step in range(3):
            nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            if step == 1 and rank == 0:
                model[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            finite.append(all(bool(p.isfinite().all()) for p in model.parameters()))
    except hookpolicy.Halt as halt:
        raised = str(halt)
    finally:
        steps = attached.step
        skipped = {rule: gauge(reg, "hookpolicy_skipped_steps_total", rule=rule) for rule in ("guard", "a")}
        attached.remove()
        said.stop()
    return {"halt": raised, "steps": steps, "skipped": skipped, "finite": finite, "lines": lines}


@pytest.mark.parametrize("then", ["skip_step", "halt"])
@pytest.mark.parametrize("differ", ["rules", "generation"])
def test_ranks_holding_different_rules_take_no_decision_and_say_so(
    tmp_path: Path, free_port: int, then: str, differ: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 holds one rule more than rank 1 (or the same rules of another generation): the
    position of a rule in one rank's rules names nothing on the other. Neither rank raises
    (IndexError) or hangs; neither skips nor halts, rank 0's own NaN decision included; each says so,
    and so do rank 0's alert records (at step 1, and at step 2: the NaN reached the weights)."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    guard = DECISION_RULES % then
    for folder in ("r0", "r1"):
        (tmp_path / folder).mkdir()
    first = write_policy(tmp_path / "r0", guard + (EXTRA_RULE if differ == "rules" else ""))
    second = write_policy(tmp_path / "r1", guard)
    ranks = spawn(rule_sets, tmp_path, free_port, [str(first), str(second)], [0, 1 if differ == "generation" else 0])
    said = [[line for line in r["lines"] if "holds other rules than another rank" in line] for r in ranks]
    for r, lines in zip(ranks, said):
        assert r["halt"] is None and r["steps"] == 3, r
        assert "at step 0" in lines[0] and "not taken" not in lines[0], lines
        if then == "skip_step":
            assert r["skipped"]["guard"] == 0
    assert len(said[1]) == 1  # said once when it began
    decided = "skip" if then == "skip_step" else "halt"
    assert len(said[0]) == 3 and all(f"not taken here: {decided} by p/guard" in line for line in said[0][1:])
    assert ranks[0]["finite"] == [True, False, False]  # the NaN step was taken: no rank decided alone
    assert ranks[1]["finite"] == [True, True, True]
    undone = "step not skipped" if then == "skip_step" else "not halted"
    records = json_lines(tmp_path / "alerts.jsonl")
    assert [(r["rank"], r["step"], r["outcome"]) for r in records] == [
        (0, step, f"{undone} (the ranks hold different rules: no decision at this step)") for step in (1, 2)]


def test_a_decision_names_its_rule_by_identity_not_by_position(tmp_path: Path, free_port: int) -> None:
    """The same rules declared in another order on each rank: rank 0's skip by `guard` is counted
    under `guard` on rank 1 too, where `guard` is at the place rank 0 has `a`."""
    guard = DECISION_RULES % "skip_step"
    other = EXTRA_RULE.replace("name: watch", "name: a")
    for folder in ("r0", "r1"):
        (tmp_path / folder).mkdir()
    first = write_policy(tmp_path / "r0", guard + other)
    second = write_policy(tmp_path / "r1", other + guard)
    ranks = spawn(rule_sets, tmp_path, free_port, [str(first), str(second)], [0, 0])
    for r in ranks:
        assert r["halt"] is None and r["steps"] == 3 and r["finite"] == [True, True, True], r
        assert r["skipped"] == {"guard": 1, "a": None}
        assert not any("holds other rules" in line for line in r["lines"])
    assert any("step 1 skipped, as rank 0 decided" in line for line in ranks[1]["lines"])


# -- end to end: hookpolicy apply -- torchrun (the DDP and FSDP2 rows of the matrix) --------

MATRIX_RULES = """\
- name: nan-guard
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: skip_step}
- name: grad-norms
  priority: 5
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm, nonfinite]}
- name: clip
  priority: 10
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - clip: {max_norm: 0.5, per: rule}
"""

ACTIVATION_RULES = """\
- name: act-guard
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions:
    - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: %s}
"""

LINE = re.compile(r"rank (\d) step (\d+) loss \S+ params (\w+) norm (\S+)(?: clipdiff (\S+))?")


def steps_of(stdout: str) -> dict[int, list[tuple[str, Optional[float], Optional[float]]]]:
    """Per rank, per step: (parameter digest, norm the optimizer used, clip difference)."""
    by_rank: dict[int, list[tuple[str, Optional[float], Optional[float]]]] = {0: [], 1: []}
    for line in losses(stdout):
        m = LINE.match(line)
        assert m, line
        norm = None if m[4] == "None" else float(m[4])
        by_rank[int(m[1])].append((m[3], norm, None if m[5] is None else float(m[5])))
    return by_rank


def run_matrix(apply: Callable[..., Run], policy: str, wrap: str, *args: str) -> Run:
    return apply(policy, "--", *torchrun(), "--standalone", "--nproc_per_node", "2", SCRIPT, "--wrap", wrap, *args)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_matrix_steps_clip_labels_and_nan_gradient_on_one_rank(
    apply: Callable[..., Run], tmp_path: Path, free_port: int, wrap: str,
) -> None:
    hold = tmp_path / "hold"
    policy = str(write_policy(tmp_path, MATRIX_RULES))
    run = apply(policy, "--metrics-port", str(free_port), "--", *torchrun(), "--standalone", "--nproc_per_node",
                "2", SCRIPT, "--wrap", wrap, "--steps", "4", "--clip-ref", "0.5", "--nan-at", "2",
                "--nan-rank", "0", "--nan-in", "grad", "--hold-file", str(hold))
    ranks = []
    for r in (0, 1):
        ranks.append(wait_metrics(run, free_port + r, lambda s: value(s, "hookpolicy_steps_total") == 4, 120))
    hold.touch()
    assert run.wait(180) == 0, run.stderr
    for r, samples in enumerate(ranks):
        assert f"hookpolicy: governing Sequential (rank {r}, " in run.stderr  # not FSDPSequential, not DDP
        assert value(samples, "hookpolicy_skipped_steps_total", rule="nan-guard") == 1
    # DDP: after the all-reduce; FSDP2: of the full gradient: the job's series, exported by rank 0 alone
    assert [{lab["module"] for lab in labels_of(s, "hookpolicy_grad_l2_norm")} for s in ranks] == [{"0", "2", "4"}, set()]
    for module in ("0", "2", "4"):
        norm = value(ranks[0], "hookpolicy_grad_l2_norm", module=module, rank="0")
        assert norm is not None and norm > 0
    steps = steps_of(run.stdout)
    for r in (0, 1):
        digests, norms, diffs = zip(*steps[r])
        assert len(digests) == 4
        assert digests[2] == digests[1] != digests[3]  # step 2 skipped on both ranks, bit for bit
        assert norms[2] is None  # the optimizer saw no gradient at all
        for step in (0, 1, 3):
            assert norms[step] <= 0.5 * (1 + 1e-6)
            assert diffs[step] <= 1e-6  # the clip is clip_grad_norm_'s


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_matrix_nan_activation_on_one_rank_skips_on_both(
    apply: Callable[..., Run], tmp_path: Path, wrap: str,
) -> None:
    policy = str(write_policy(tmp_path, ACTIVATION_RULES % "skip_step"))
    run = run_matrix(apply, policy, wrap, "--steps", "3", "--nan-at", "1", "--nan-rank", "1", "--nan-in", "input")
    assert run.wait(180) == 0, run.stderr
    steps = steps_of(run.stdout)
    for r in (0, 1):
        digests = [d for d, _, _ in steps[r]]
        assert len(digests) == 3 and digests[0] == digests[1] != digests[2]
        assert steps[r][1][1] is None


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_matrix_halt_on_one_rank_halts_both(apply: Callable[..., Run], tmp_path: Path, wrap: str) -> None:
    policy = str(write_policy(tmp_path, ACTIVATION_RULES % "halt"))
    run = run_matrix(apply, policy, wrap, "--steps", "4", "--nan-at", "2", "--nan-rank", "0", "--nan-in", "input")
    assert run.wait(180) == 3, run.stderr
    assert run.stderr.splitlines()[-1].startswith("hookpolicy: halted by p/act-guard at step 2: ")
    assert sorted(line for line in run.stdout.splitlines() if " exit " in line) == [
        "rank 0 exit Halt", "rank 1 exit Halt"]
    assert [len(s) for s in steps_of(run.stdout).values()] == [2, 2]
