"""`then: cool_down` and `then: rewind` against runs that do the same by hand.

The reference for a cool-down is the same script multiplying every group's lr by the
factor around `optimizer.step()` for those steps; for a rewind, a deep copy of the model's
and optimizer's `state_dict()` taken by the test at the snapshot step, and the same script
that never saw the dropped batches. Every comparison is bit for bit.
"""

from __future__ import annotations

import copy
import gc
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hookpolicy import Halt
from helpers.models import tiny
from helpers.outputs import json_lines, metric
from helpers.policies import load_policy

STEPS = 14


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def setup(schedule: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = tiny(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    if schedule == "cosine":  # chainable: each lr is computed from the group's lr as it finds it
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def unscheduled() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of `setup`, with no scheduler."""
    model = tiny(seed=3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


#: called right after `optimizer.step()` with the step index and the objects
AfterStep = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, data: list[Any], *,
          by_hand: Optional[Callable[[int], float]] = None, after_step: Optional[AfterStep] = None,
          scaler: Optional[torch.amp.GradScaler] = None) -> None:
    """The script: forward, backward, step, scheduler step. `by_hand(i)` is the lr factor the test applies itself."""
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        kept = [g["lr"] for g in optimizer.param_groups]
        if by_hand is not None:
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * by_hand(i)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        if by_hand is not None:
            for g, lr in zip(optimizer.param_groups, kept):
                g["lr"] = lr
        if after_step is not None:
            after_step(i, model, optimizer)
        if scaler is not None:
            scaler.update()
        scheduler.step()
        optimizer.zero_grad()


def fires_at(first: int, last: int, then: str, extra: str = "") -> str:
    """A rule whose alert fires at steps first..last (its trigger window), with `then`."""
    return f"""
        - name: heal
          match: {{modules: ["**"]}}
          trigger: {{at: step, steps: {{from: {first}, until: {last + 1}}}}}
          target: grad
          actions: [{{alert: {{if: "l2_norm >= 0", per: rule, then: {then}{extra}}}}}]
    """


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def assert_same_state(live: dict[str, Any], saved: dict[str, Any]) -> None:
    """Two optimizer state_dicts, bit for bit."""
    assert live["param_groups"] == saved["param_groups"]
    assert live["state"].keys() == saved["state"].keys()
    for key, state in saved["state"].items():
        for k, v in state.items():
            assert torch.equal(live["state"][key][k], v), (key, k)


@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_a_cool_down_equals_the_lr_lowered_by_hand_under_a_scheduler(tmp_path: Path, schedule: str) -> None:
    pol = load_policy(tmp_path, fires_at(4, 4, "cool_down", ", cool_down: {factor: 0.1, steps: 5}"))
    data = batches()
    model, optimizer, scheduler = setup(schedule)
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup(schedule)
    train(ref_model, ref_optimizer, ref_scheduler, data, by_hand=lambda i: 0.1 if 4 <= i <= 8 else 1.0)
    assert_same(model, ref_model)
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict())
    assert scheduler.state_dict() == ref_scheduler.state_dict()
    plain_model, plain_optimizer, plain_scheduler = setup(schedule)
    train(plain_model, plain_optimizer, plain_scheduler, data)
    assert not torch.equal(plain_model[0].weight, model[0].weight)  # the cool-down changed the run


def test_a_cool_down_that_fires_again_extends_the_window(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, fires_at(3, 5, "cool_down", ", cool_down: {factor: 0.5, steps: 3}"))
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data, by_hand=lambda i: 0.5 if 3 <= i <= 7 else 1.0)
    assert_same(model, ref_model)


def test_an_audited_cool_down_changes_nothing(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, fires_at(2, 9, "cool_down", ", cool_down: {factor: 0.1, steps: 5}"))
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry(), audit=True):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data)
    assert_same(model, ref_model)


SNAPSHOTS = "snapshots: {every: 4, keep: 2}\n"


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "gradscaler"])
def test_a_rewind_restores_the_snapshot_and_then_equals_the_run_without_those_batches(
    tmp_path: Path, scaled: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    # snapshots after steps 3 and 7 (4 and 8 updates); the alert fires at step 9: back to 8 updates,
    # the batches of steps 8 and 9 dropped
    pol = load_policy(tmp_path, fires_at(9, 9, "rewind"), spec=SNAPSHOTS)
    data = batches()
    registry = CollectorRegistry()
    copies: dict[str, Any] = {}

    def keep_and_check(i: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if i == 7:  # the test's own copy, at the snapshot's point of the step
            copies.update(model=copy.deepcopy(model.state_dict()), optimizer=copy.deepcopy(optimizer.state_dict()))
        if i == 9:  # right after the rewinding step
            for name, p in model.state_dict().items():
                assert torch.equal(p, copies["model"][name]), name
            assert_same_state(optimizer.state_dict(), copies["optimizer"])

    def scaler() -> Optional[torch.amp.GradScaler]:
        return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3) if scaled else None

    model, optimizer, scheduler = setup("lambda")
    scaler_, ref_scaler = scaler(), scaler()
    with caplog.at_level(logging.INFO, "hookpolicy"), pol.attach(model, registry=registry) as attached:
        train(model, optimizer, scheduler, data, after_step=keep_and_check, scaler=scaler_)
        assert attached.step == STEPS
    # the run summary says the one rewind the test's own copies saw (and the counter below counts)
    assert attached.summary()[1:2] == ["  p/heal: rewound 1 time, 1 warning alert"]
    assert copies
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:8] + data[10:], scaler=ref_scaler)
    if scaler_ is not None and ref_scaler is not None:  # grown at different steps without the scaler's restore
        assert scaler_.state_dict() == ref_scaler.state_dict()
        assert scaler_.get_scale() > 2.0**8
    assert_same(model, ref_model)
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict())
    assert scheduler.state_dict() == ref_scheduler.state_dict()  # rewound too: last_epoch STEPS - 2
    assert registry.get_sample_value("hookpolicy_rewinds_total", {"policy": "p", "rule": "heal", "model": "Sequential",
                                                                  "rank": "0"}) == 1
    said = [r.getMessage() for r in caplog.records if "rewound" in r.getMessage()]
    assert said == ["p/heal: rewound at step 9 to the snapshot taken after step 7: the 2 steps 8..9 are dropped "
                    "(rewind 1 of 3)"]


def test_a_rewind_goes_back_far_enough_and_drops_the_newer_snapshots(tmp_path: Path) -> None:
    # snapshots after steps 3, 7, 11, keep 3; at step 12, back: 5 -> the one after step 7 (12 - 7 = 5 steps
    # older; the one after 11 is 1 step older): steps 8..12 dropped; a second rewind at step 13 finds the one
    # after step 7 again (13 - 7 >= 5; the one after 11 was dropped with the first)
    pol = load_policy(tmp_path, fires_at(12, 13, "rewind", ", rewind: {back: 5}"),
                      spec="snapshots: {every: 4, keep: 3}\n")
    data = batches(16)
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:8] + data[14:])
    assert_same(model, ref_model)


@pytest.mark.parametrize(("back", "after"), [(6, 19), (7, 14)])
def test_back_is_how_many_steps_older_than_the_rewinding_step_the_snapshot_is(
    tmp_path: Path, back: int, after: int,
) -> None:
    """The boundary: snapshots taken after steps 4, 9, 14, 19, 24; at step 25, `back: 6` takes the one after step
    19 (25 - 19 = 6 steps older: steps 20..25 dropped), `back: 7` the one after step 14."""
    pol = load_policy(tmp_path, fires_at(25, 25, "rewind", f", rewind: {{back: {back}}}"),
                      spec="snapshots: {every: 5, keep: 5}\n")
    data = batches(28)
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:after + 1] + data[26:])
    assert_same(model, ref_model)


#: two rings that hold 2 snapshots: `keep: 2`, and `keep: 3` with a budget for 2 (~0.7 KiB each)
RINGS_OF_TWO = {
    "keep-2": "snapshots: {every: 2, keep: 2}\n",
    "budget-for-2-of-keep-3": "snapshots: {every: 2, keep: 3}\nlimits: {maxSnapshotBytes: 1500}\n",
}


@pytest.mark.parametrize("spec", list(RINGS_OF_TWO.values()), ids=list(RINGS_OF_TWO))
def test_the_ring_keeps_exactly_keep_snapshots_or_as_many_as_fit(tmp_path: Path, spec: str) -> None:
    """every: 2: after steps 1, 3, 5, 7 a ring of 2 holds those after 5 and 7; at step 8 `back: 6` finds
    none old enough and takes the oldest kept, the one after step 5 (a ring of 3 would hold the one after 3)."""
    pol = load_policy(tmp_path, fires_at(8, 8, "rewind", ", rewind: {back: 6}"), spec=spec)
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:6] + data[9:])
    assert_same(model, ref_model)


def test_remove_frees_the_snapshots(tmp_path: Path) -> None:
    """A handle kept after its `with` block (as the README's example keeps it) holds no snapshot."""
    pol = load_policy(tmp_path, fires_at(30, 30, "rewind"), spec="snapshots: {every: 2, keep: 2}\n")
    model, optimizer, scheduler = setup("lambda")
    import hookpolicy.engine.heal.snapshots as snapshots_module
    held: list[weakref.ref[torch.Tensor]] = []
    original = snapshots_module._host_copy

    def noted(t: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        copied = original(t, into)
        held.append(weakref.ref(copied))
        return copied

    snapshots_module._host_copy = noted  # type: ignore[assignment]
    try:
        with pol.attach(model, registry=CollectorRegistry()) as attached:
            train(model, optimizer, scheduler, batches(6))
    finally:
        snapshots_module._host_copy = original  # type: ignore[assignment]
    assert held and attached.removed
    gc.collect()
    assert [r for r in held if r() is not None] == []


#: two cool-downs (step, factor, steps each) and the steps the lr must be x0.1 on
TWO_COOL_DOWNS = {
    # x0.1 for 6 steps from step 2, then x0.5 for 6 steps from step 4: x0.1 from step 2 to step 9 (the later end)
    "overlapping-take-the-smaller-factor": ((2, 0.1, 6), (4, 0.5, 6), range(2, 10)),
    # x0.1 and x0.5, both for 3 steps, fire at step 4 (x0.5 declared last): x0.1 for steps 4..6
    "at-one-step-take-the-strongest": ((4, 0.1, 3), (4, 0.5, 3), range(4, 7)),
}


@pytest.mark.parametrize("case", list(TWO_COOL_DOWNS))
def test_two_cool_downs_take_the_smaller_factor_to_the_later_end(tmp_path: Path, case: str) -> None:
    (step, factor, steps), (step2, factor2, steps2), lowered = TWO_COOL_DOWNS[case]
    rules = (fires_at(step, step, "cool_down", f", cool_down: {{factor: {factor}, steps: {steps}}}")
             + fires_at(step2, step2, "cool_down", f", cool_down: {{factor: {factor2}, steps: {steps2}}}")
             .replace("name: heal", "name: mild"))
    pol = load_policy(tmp_path, rules)
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data, by_hand=lambda i: 0.1 if i in lowered else 1.0)
    assert_same(model, ref_model)


def test_a_rewind_starts_every_for_count_again(tmp_path: Path) -> None:
    # for: 2 over steps 8..11: fires at 9 (back to 8 updates), then counts 10, 11 afresh and fires at 11
    # (back to 8 again); without the restart it would fire at 9, 10 and 11
    pol = load_policy(tmp_path, fires_at(8, 11, "rewind", ", for: 2"), spec=SNAPSHOTS)
    data = batches()
    registry = CollectorRegistry()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=registry):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:8] + data[12:])
    assert_same(model, ref_model)
    assert registry.get_sample_value("hookpolicy_rewinds_total", {"policy": "p", "rule": "heal", "model": "Sequential",
                                                                  "rank": "0"}) == 2


def test_rewinds_past_max_rewinds_halt(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, fires_at(5, 6, "rewind", ", rewind: {max_rewinds: 1}"), spec=SNAPSHOTS)
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()), pytest.raises(Halt) as info:
        train(model, optimizer, scheduler, batches())
    assert (info.value.policy, info.value.rule, info.value.step) == ("p", "heal", 6)
    assert "max_rewinds: 1" in info.value.line()


def test_a_rewind_before_the_first_snapshot_skips_the_step_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, fires_at(2, 2, "rewind"), spec=SNAPSHOTS)
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    reg = CollectorRegistry()
    with caplog.at_level(logging.WARNING, "hookpolicy"), pol.attach(model, registry=reg):
        train(model, optimizer, scheduler, data)
    assert any("cannot rewind at step 2 (no snapshot yet" in r.getMessage() for r in caplog.records)
    # the skip it fell back to is counted as one, and no rewind is
    assert metric(reg, "hookpolicy_skipped_steps_total", {"policy": "p"}) == 1
    assert not metric(reg, "hookpolicy_rewinds_total", {"policy": "p"})
    assert [r["outcome"] for r in json_lines(tmp_path / "alerts.jsonl")] == [
        "not rewound (no snapshot yet: the first is taken after 4 steps: step skipped instead (1 of max_rewinds 3))"]
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")  # a skipped step: no update, the scheduler steps on
    for i, (x, y) in enumerate(data):
        if i != 2:
            nn.functional.mse_loss(ref_model(x), y).backward()
            ref_optimizer.step()
        ref_scheduler.step()
        ref_optimizer.zero_grad()
    assert_same(model, ref_model)


# -- what a snapshot finds: schedulers and GradScalers made late, dropped ones, no heap scan -------

WARMUP = 6


def train_switching(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any],
                    after_step: Optional[AfterStep] = None) -> tuple[Any, Any]:
    """The script: a LinearLR warm-up; at the end of step WARMUP - 1 it makes a CosineAnnealingLR (dropping
    the warm-up's) and a GradScaler (AMP after the warm-up). Returns the cosine schedule and the scaler."""
    schedule: Any = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=WARMUP)
    scaler: Optional[torch.amp.GradScaler] = None
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        if after_step is not None:
            after_step(i, model, optimizer)
        if scaler is not None:
            scaler.update()
        schedule.step()
        optimizer.zero_grad()
        if i == WARMUP - 1:
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return schedule, scaler


def test_a_scheduler_and_a_gradscaler_made_after_the_first_snapshot_are_rewound_too(tmp_path: Path) -> None:
    # snapshots after steps 3 (before the cosine schedule and the scaler exist) and 7; the alert fires at
    # step 9: back to 8 updates. Without their restore, the cosine schedule would be 2 steps further and
    # the scaler would have doubled its scale at step 8 and counted on from there
    pol = load_policy(tmp_path, fires_at(9, 9, "rewind"), spec=SNAPSHOTS)
    data = batches()
    model, optimizer = unscheduled()
    with pol.attach(model, registry=CollectorRegistry()):
        schedule, scaler = train_switching(model, optimizer, data)
    ref_model, ref_optimizer = unscheduled()
    ref_schedule, ref_scaler = train_switching(ref_model, ref_optimizer, data[:8] + data[10:])
    assert_same(model, ref_model)
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict())
    assert schedule.state_dict() == ref_schedule.state_dict()
    assert schedule.last_epoch == len(data) - 2 - WARMUP  # 2 more without its restore
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert scaler.state_dict()["_growth_tracker"] == 0  # 6 updates, growth_interval 3; 8 (2) without its restore


def test_a_scheduler_the_script_dropped_is_not_kept_alive_by_a_snapshot(tmp_path: Path) -> None:
    # snapshots after steps 1 and 3 hold the scheduler; the script drops it after step 3; the rewind at
    # step 5 goes back to 4 updates without it
    pol = load_policy(tmp_path, fires_at(5, 5, "rewind"), spec="snapshots: {every: 2, keep: 2}\n")
    data = batches(6)
    model, optimizer, scheduler = setup("lambda")
    held = [scheduler]  # the script's one reference
    dropped = weakref.ref(scheduler)
    del scheduler
    with pol.attach(model, registry=CollectorRegistry()):
        for i, (x, y) in enumerate(data):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if held:
                held[0].step()
            optimizer.zero_grad()
            if i == 3:
                held.clear()
                gc.collect()
                assert dropped() is None  # the two snapshots taken with it did not keep it
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    for i, (x, y) in enumerate(data[:4]):  # the snapshot after step 3 came before its scheduler step
        nn.functional.mse_loss(ref_model(x), y).backward()
        ref_optimizer.step()
        if i < 3:
            ref_scheduler.step()
        ref_optimizer.zero_grad()
    assert_same(model, ref_model)
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict())


def test_snapshots_after_the_first_update_scan_no_heap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # snapshots after steps 3, 7 and 11; the rewind at step 13 goes back to the one after step 11. The heap
    # is scanned (gc.get_objects) at most at the first update, for the schedulers made before it
    pol = load_policy(tmp_path, fires_at(13, 13, "rewind"), spec=SNAPSHOTS)
    data = batches()
    scans: list[int] = []
    get_objects = gc.get_objects

    def counted(*args: Any, **kwargs: Any) -> list[Any]:
        scans.append(1)
        return get_objects(*args, **kwargs)

    def count_from_step_1(i: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if i == 0:
            monkeypatch.setattr(gc, "get_objects", counted)

    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data, after_step=count_from_step_1)
        assert scans == []
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data[:12])
    assert_same(model, ref_model)
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict())
    assert scheduler.state_dict() == ref_scheduler.state_dict()


def test_a_dropped_model_gives_the_scheduler_constructors_back(tmp_path: Path) -> None:
    # `apply` governs models it does not own: what is left of a dropped one is removed from the process
    pol = load_policy(tmp_path, fires_at(99, 99, "rewind"), spec=SNAPSHOTS)
    torch_own = torch.optim.lr_scheduler.LambdaLR.__dict__["__init__"]
    queued: list[Callable[[], None]] = []
    model, optimizer, scheduler = setup("lambda")
    attached = pol.attach(model, registry=CollectorRegistry())
    attached.when_dropped(queued.append)
    train(model, optimizer, scheduler, batches(1))  # the first update: the snapshots watch the constructors
    assert torch.optim.lr_scheduler.LambdaLR.__dict__["__init__"] is not torch_own
    del attached, model, optimizer, scheduler
    gc.collect()
    assert len(queued) == 1
    queued[0]()
    assert torch.optim.lr_scheduler.LambdaLR.__dict__["__init__"] is torch_own


# -- on 2 ranks: one rank's alert, every rank's rewind -------------------------------------------

LOSS_SPIKE = """
    - name: heal
      match: {root: true}
      trigger: {at: step}
      target: loss
      ranks: %s
      actions: [{alert: {if: "mean > 100", per: rule, then: rewind}}]
"""


def ranks_rewind(rank: int, wrapper: str, policy: Optional[str], dropped: list[int]) -> dict[str, Any]:
    """DDP or FSDP2 on 2 ranks, each its own batches; rank 0's loss x1000 at step 9 (its own rule fires, not rank 1's).

    With `policy`, the step-9 spike makes every rank rewind to the snapshot after step 7 (each
    rank its own shards under FSDP2); without it, the batches of `dropped` are never trained on
    (the reference)."""
    import hookpolicy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model: nn.Module = tiny(seed=3)
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = batches(STEPS + rank * STEPS)[rank * STEPS:]
    attached = None if policy is None else hookpolicy.load(policy).attach(model, registry=CollectorRegistry())
    for i, (x, y) in enumerate(data):
        if i in dropped:
            continue
        loss = nn.functional.mse_loss(model(x), y) * (1000.0 if i == 9 and rank == 0 else 1.0)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if attached is not None:
        attached.remove()
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"params": [p.detach().flatten().tolist() for p in full], "lr": scheduler.get_last_lr()}


@pytest.mark.slow
@pytest.mark.parametrize(("wrapper", "ranks"), [("ddp", "own"), ("fsdp2", "own"), ("ddp", "job")])
def test_a_rewind_one_rank_decides_is_taken_by_every_rank_and_equals_the_batches_dropped(
    tmp_path: Path, free_port: int, wrapper: str, ranks: str,
) -> None:
    """`ranks: own`: rank 0 alone sees its spike, the agreement's heal code makes it every rank's;
    `ranks: job`: every rank sees the job's loss (rank 0's spike in it) and decides alike."""
    from helpers.distributed import spawn
    from helpers.policies import write_policy

    policy = str(write_policy(tmp_path, LOSS_SPIKE % ranks, spec=SNAPSHOTS))
    rewound = spawn(ranks_rewind, tmp_path, free_port, wrapper, policy, [])
    reference = spawn(ranks_rewind, tmp_path, free_port + 1, wrapper, None, [8, 9])
    assert rewound[0] == rewound[1] == reference[0] == reference[1]


# -- several healing alerts at one step: the records say which one the step took ----------------

BOTH = """
    - name: heal
      match: {modules: ["**"]}
      trigger: {at: step, steps: {from: 9, until: 10}}
      target: grad
      actions:
        - {alert: {if: "l2_norm >= 0", per: rule, then: cool_down, cool_down: {factor: 0.5, steps: 3},
                   message: "lr x0.5 from step {step}: {outcome}"}}
        - {alert: {if: "l2_norm >= 0", per: rule, then: rewind, severity: critical}}
    - name: cool
      match: {modules: ["**"]}
      trigger: {at: step, steps: {from: 11, until: 12}}
      target: grad
      actions: [{alert: {if: "l2_norm >= 0", per: rule, then: cool_down, cool_down: {factor: 0.5, steps: 2}}}]
"""


def test_a_cool_down_and_a_rewind_at_one_step_are_recorded_as_the_rewind_taking_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At step 9 a cool-down and a rewind fire together: the rewind takes the step (back to the
    snapshot after step 7), the cool-down is not applied, and its record says so; at step 11 a
    cool-down alone is applied and recorded as cooling down. The reference is the script without
    the policy that never saw batches 8 and 9 and lowers the lr by hand at steps 11 and 12 (its
    indices 9 and 10): the lr each optimizer's own step pre-hook sees, and the weights, bit for bit."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, BOTH, spec=SNAPSHOTS)
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    used: list[float] = []
    optimizer.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, data)
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    ref_used: list[float] = []
    ref_optimizer.register_step_pre_hook(lambda o, *_: ref_used.append(o.param_groups[0]["lr"]))
    train(ref_model, ref_optimizer, ref_scheduler, data[:8] + data[10:], by_hand=lambda i: 0.5 if i in (9, 10) else 1.0)
    assert_same(model, ref_model)
    assert used[:9] == ref_used[:9] and used[10:] == ref_used[8:]  # step 10 runs as the reference's 8th
    assert used[9] == ref_used[9] / 0.5  # the rewinding step's lr: not lowered (the reference's is, by hand)
    records = json_lines(tmp_path / "alerts.jsonl")
    assert [(r["step"], r["rule"], r["then"], r["outcome"]) for r in records] == [
        (9, "heal", "cool_down", "not cooled down (a rewind by p/heal took the step)"),
        (9, "heal", "rewind", "rewinding"),
        (11, "cool", "cool_down", "cooling down"),
    ]
    assert records[0]["message"] == "lr x0.5 from step 9: not cooled down (a rewind by p/heal took the step)"


def test_a_rewind_past_max_rewinds_is_recorded_as_halting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewind alert at step 6 halts (max_rewinds: 1 spent at step 5): its record says it did not
    rewind, and the cool-down's beside it that the run halts (at step 5 that the rewind took the step)."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    rules = fires_at(5, 6, "rewind", ", rewind: {max_rewinds: 1}").replace(
        "actions: [", 'actions: [{alert: {if: "l2_norm >= 0", per: rule, then: cool_down, '
        'cool_down: {factor: 0.5, steps: 3}}}, ')
    pol = load_policy(tmp_path, rules, spec=SNAPSHOTS)
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()), pytest.raises(Halt) as halted:
        train(model, optimizer, scheduler, batches())
    assert halted.value.step == 6
    records = json_lines(tmp_path / "alerts.jsonl")
    assert [(r["step"], r["then"], r["outcome"]) for r in records] == [
        (5, "cool_down", "not cooled down (a rewind by p/heal took the step)"), (5, "rewind", "rewinding"),
        (6, "cool_down", "not cooled down (the run halts at this step)"),
        (6, "rewind", "not rewound (max_rewinds: 1 reached; halting)")]


def test_a_cool_down_without_an_optimizer_is_recorded_as_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A script that updates its weights by hand steps no optimizer (a step is a backward pass):
    there is no learning rate to lower. The cool-down alert's record says so, and the weights are
    those of the same script without the policy, bit for bit."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, fires_at(2, 2, "cool_down", ", cool_down: {factor: 0.1, steps: 5}"))

    def by_hand(model: nn.Module) -> None:
        for x, y in batches(5):
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p -= 0.05 * p.grad
                    p.grad = None

    model, reference = tiny(seed=3), tiny(seed=3)
    with caplog.at_level(logging.WARNING, "hookpolicy"), pol.attach(model, registry=CollectorRegistry()):
        by_hand(model)
    by_hand(reference)
    assert_same(model, reference)
    assert [(r["step"], r["outcome"]) for r in json_lines(tmp_path / "alerts.jsonl")] == [
        (2, "not cooled down (no optimizer steps this model)")]
    assert any("cannot cool down at step 2 (no optimizer steps this model); not taken" in r.getMessage()
               for r in caplog.records)


LADDER = """
    - name: heal
      match: {modules: ["**"]}
      trigger: {at: step, steps: {from: 2}}
      target: grad
      actions:
        - alert: {if: "l2_norm >= 0", per: rule, then: cool_down, cool_down: {factor: 0.1, steps: 5}}
        - alert: {if: "l2_norm >= 0", for: 3, per: rule, then: rewind, rewind: {max_rewinds: 2}}
"""


def test_a_ladder_whose_rungs_cannot_act_climbs_to_its_halt_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weights updated by hand (no optimizer): the cool-down cannot act, so its rule's rewind takes the
    step; the rewind cannot act either (nothing to restore into), so each such step is skipped and spends
    one of its max_rewinds, and the firing past them halts: the ladder climbs instead of stalling on skips.
    The reference is the same loop by hand with the skipped steps' updates left out."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, LADDER, spec=SNAPSHOTS)

    def by_hand(model: nn.Module, skipped: set[int]) -> None:
        for i, (x, y) in enumerate(batches(8)):
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    if i not in skipped:
                        p -= 0.05 * p.grad
                    p.grad = None

    model, reference = tiny(seed=3), tiny(seed=3)
    with pol.attach(model, registry=CollectorRegistry()), pytest.raises(Halt) as info:
        by_hand(model, set())
    assert (info.value.rule, info.value.step) == ("heal", 4)
    assert "past max_rewinds: 2" in info.value.line()
    by_hand_steps = 4  # steps 0..3 ran their update code (2 and 3 with zeroed gradients); 4 halted in its backward
    for i, (x, y) in enumerate(batches(by_hand_steps)):
        nn.functional.mse_loss(reference(x), y).backward()
        with torch.no_grad():
            for p in reference.parameters():
                assert p.grad is not None
                if i < 2:
                    p -= 0.05 * p.grad
                p.grad = None
    assert_same(model, reference)
    records = [(r["step"], r["outcome"]) for r in json_lines(tmp_path / "alerts.jsonl")]
    assert records[:2] == [
        (2, "not cooled down (no optimizer steps this model: its rewind took the step, not rewound "
            "(no optimizer steps this model: step skipped instead (1 of max_rewinds 2)))"),
        (3, "not cooled down (no optimizer steps this model: its rewind took the step, not rewound "
            "(no optimizer steps this model: step skipped instead (2 of max_rewinds 2)))"),
    ]


def test_a_rewind_that_cannot_act_is_not_said_to_have_taken_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cool-down beside a rewind that fell back to a skip: its record names the rewind as chosen and
    says that it could not act, never that "a rewind took the step"."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    both = """
    - name: heal
      match: {modules: ["**"]}
      trigger: {at: step, steps: {from: 1, until: 2}}
      target: grad
      actions:
        - alert: {if: "l2_norm >= 0", per: rule, then: cool_down, cool_down: {factor: 0.5, steps: 2}}
        - alert: {if: "l2_norm >= 0", per: rule, then: rewind}
    """
    pol = load_policy(tmp_path, both, spec=SNAPSHOTS)  # the first snapshot is taken after 4 steps
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=CollectorRegistry()):
        train(model, optimizer, scheduler, batches(3))
    outcomes = {r["then"]: r["outcome"] for r in json_lines(tmp_path / "alerts.jsonl")}
    assert outcomes["rewind"].startswith("not rewound (no snapshot yet")
    assert outcomes["cool_down"] == ("not cooled down (the step went to a rewind by p/heal, which could not act: "
                                     "step skipped)")


def test_snapshots_past_max_snapshot_bytes_are_not_taken_and_a_rewind_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """`limits.maxSnapshotBytes: 100`: one snapshot of the tiny model with AdamW needs ~0.7 KiB; the attach line warns,
    none is taken, and the rewind at step 9 skips its step instead (said), never an exception."""
    pol = load_policy(tmp_path, fires_at(9, 9, "rewind"), spec=SNAPSHOTS + "limits: {maxSnapshotBytes: 100}\n")
    registry = CollectorRegistry()
    model, optimizer, scheduler = setup("lambda")
    with caplog.at_level(logging.INFO, "hookpolicy"), pol.attach(model, registry=registry):
        train(model, optimizer, scheduler, batches())
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "budget 100.0 B" in said or "budget 0.1 KiB" in said
    assert "more than the budget: none will be taken" in said
    assert "more than spec.limits.maxSnapshotBytes" in said
    labels = {"policy": "p", "rule": "heal", "model": "Sequential", "rank": "0"}
    assert registry.get_sample_value("hookpolicy_skipped_steps_total", labels) == 1
    assert not registry.get_sample_value("hookpolicy_rewinds_total", labels)
    assert not registry.get_sample_value("hookpolicy_hook_errors_total", labels)


def test_a_snapshot_that_cannot_get_host_memory_is_a_fault_of_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host copy fails (as an allocation does without memory): counted as the rewind rule's error, switched off
    after 3, and training goes on exactly as without the policy (its rewind never fires)."""
    import hookpolicy.engine.heal.snapshots as snapshots_module

    def no_memory(t: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(snapshots_module, "_host_copy", no_memory)
    pol = load_policy(tmp_path, fires_at(50, 50, "rewind"), spec="snapshots: {every: 2, keep: 2}\n")
    registry = CollectorRegistry()
    data = batches()
    model, optimizer, scheduler = setup("lambda")
    with pol.attach(model, registry=registry):
        train(model, optimizer, scheduler, data)
        errors = registry.get_sample_value("hookpolicy_hook_errors_total", {"policy": "p", "rule": "heal",
                                                                            "model": "Sequential", "rank": "0"})
    assert errors == 3
    ref_model, ref_optimizer, ref_scheduler = setup("lambda")
    train(ref_model, ref_optimizer, ref_scheduler, data)
    assert_same(model, ref_model)


BOUNDED = """
    - name: heal
      match: {modules: ["**"]}
      trigger: {at: step, steps: {from: 2}}
      target: grad
      actions:
        - alert: {if: "l2_norm >= 0", per: rule, then: skip_step, skip_step: {max_in_a_row: 2}}
        - alert: {if: "l2_norm >= 0", for: 3, per: rule, then: cool_down, cool_down: {factor: 0.1, steps: 5}}
        - alert: {if: "l2_norm >= 0", for: 3, per: rule, then: rewind, rewind: {max_rewinds: 2}}
"""


def test_a_bounded_skip_applies_the_step_its_rungs_cannot_act_on_by_hand_then_climbs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weights updated by hand (no optimizer) under a rule whose skip is bounded (`max_in_a_row: 2`) and
    whose cool-down and rewind cannot act: steps 2 and 3 are skipped; at step 4 (the third in a row on
    the same weights) the rungs leave the step to the skip, which applies it, spending no max_rewinds,
    and its count starts again; the condition still holds after it, so at steps 5 and 6 the rungs climb
    as before (each skips and spends one of max_rewinds 2), step 7 is applied as step 4 was, and step 8
    halts. The reference is the same loop by hand with the updates of 2, 3, 5 and 6 left out."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, BOUNDED, spec=SNAPSHOTS)

    def by_hand(model: nn.Module, skipped: set[int], n: int) -> None:
        for i, (x, y) in enumerate(batches(n)):
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    if i not in skipped:
                        p -= 0.05 * p.grad
                    p.grad = None

    model, reference = tiny(seed=3), tiny(seed=3)
    with pol.attach(model, registry=CollectorRegistry()), pytest.raises(Halt) as info:
        by_hand(model, set(), 10)
    assert (info.value.rule, info.value.step) == ("heal", 8)
    by_hand(reference, {2, 3, 5, 6}, 8)  # steps 0..7 ran their update code; 8 halted in its backward
    assert_same(model, reference)
    records = [(r["step"], r["then"], r["outcome"]) for r in json_lines(tmp_path / "alerts.jsonl")]
    assert [r for r in records if r[1] == "skip_step"] == [
        (2, "skip_step", "step skipped"), (3, "skip_step", "step skipped"),
        (4, "skip_step", "step not skipped (2 skipped in a row on the same weights: a spike that outlasts them may be the "
                         "weights', which only an update undoes; the update is applied)"),
        (5, "skip_step", "step skipped"), (6, "skip_step", "step skipped"),
        (7, "skip_step", "step not skipped (2 skipped in a row on the same weights: a spike that outlasts them may be the "
                         "weights', which only an update undoes; the update is applied)"),
        (8, "skip_step", "step skipped")]
    assert (4, "rewind", "not rewound (no optimizer steps this model: the step is its rule's skip_step's "
                         "(max_in_a_row: 2))") in records
    assert (4, "cool_down", "not cooled down (the step went to a rewind by p/heal, which could not act: "
                            "step applied)") in records
    assert (5, "rewind", "not rewound (no optimizer steps this model: step skipped instead (1 of max_rewinds 2))") \
        in records


def test_a_bounded_skip_stays_a_skip_where_its_rules_cool_down_acts(tmp_path: Path) -> None:
    """With an optimizer, the rule's cool-down acts at the third step in a row: that is the rule's answer,
    and the step stays skipped (as recover.yaml's ladder says); the lr is lowered from there. The
    reference: the same loop by hand, steps 2..4 not applied, then lr x0.1."""
    pol = load_policy(tmp_path, BOUNDED.replace("steps: {from: 2}", "steps: {from: 2, until: 5}").rsplit("\n        - alert", 1)[0])
    model, reference = tiny(seed=3), tiny(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    registry = CollectorRegistry()
    with pol.attach(model, registry=registry):
        for x, y in batches(8):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for i, (x, y) in enumerate(batches(8)):
        nn.functional.mse_loss(reference(x), y).backward()
        for group in ref_opt.param_groups:
            group["lr"] = 0.05 * (0.1 if 4 < i < 9 else 1.0)
        if i not in (2, 3, 4):
            ref_opt.step()
        ref_opt.zero_grad()
    assert_same(model, reference)
    assert metric(registry, "hookpolicy_skipped_steps_total", {"policy": "p", "rule": "heal"}) == 3


#: the steps at which the test makes each Linear's gradient a spike (its weight's gradient x 2**14, put back
#: before the update by the script's own step pre-hook): the two groups of a `per: module` alert take turns
TURNS: dict[int, set[str]] = {2: {"0"}, 3: {"2"}, 4: {"0"}, 5: {"2"}, 7: {"0"}, 8: {"0", "2"}, 9: {"2"}}

PER_MODULE = """
    - name: spikes
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "l2_norm > 100", per: module, then: skip_step, skip_step: {max_in_a_row: 2}}
"""


def test_a_bounded_skip_per_module_counts_the_alerts_steps_in_a_row_whichever_group_fired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`skip_step: {max_in_a_row: 2}` on a `per: module` alert whose groups take turns firing (module 0 at
    2, module 2 at 3, ...): the count in a row is the alert's, not a group's, so step 4 (module 0 firing for
    the second time, the alert's third step in a row) is applied, and a step where no group fires (6) ends
    the count. A count per group would have skipped every firing step. The reference: the firing steps from
    the gradient norms the test computes itself (torch.linalg.vector_norm), the skips from them by the
    header's rule, and the same SGD loop leaving `optimizer.step()` out at those steps, parameters bit for
    bit after every step; each group's alert record says skipped or applied as the reference does."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, PER_MODULE)
    scale = 2.0 ** 14  # a power of two: x and / are exact

    def run(model: nn.Module, skipped: Optional[set[int]], seen: list[set[str]], after: AfterStep) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        spiked: list[nn.Module] = []

        def put_back(*_: Any) -> None:  # after hookpolicy's global pre-hook read the gradients
            for module in spiked:
                if module.weight.grad is not None:  # None: hidden by a skip
                    module.weight.grad.div_(scale)

        opt.register_step_pre_hook(put_back)
        for i, (x, y) in enumerate(batches(10)):
            nn.functional.mse_loss(model(x), y).backward()
            spiked[:] = [model[int(name)] for name in sorted(TURNS.get(i, set()))]
            for module in spiked:
                module.weight.grad.mul_(scale)
            seen.append({name for name in ("0", "2") if torch.linalg.vector_norm(torch.cat(
                [model[int(name)].weight.grad.flatten(), model[int(name)].bias.grad.flatten()])) > 100})
            if skipped is None or i not in skipped:
                opt.step()
            after(i, model, opt)
            opt.zero_grad()

    firing: list[set[str]] = []
    live: list[dict[str, torch.Tensor]] = []
    model = tiny(seed=3)
    with pol.attach(model, registry=CollectorRegistry()):
        run(model, None, firing, lambda i, m, o: live.append(copy.deepcopy(m.state_dict())))
    assert firing == [TURNS.get(i, set()) for i in range(10)]  # the test's gradients fire where it meant
    expected: set[int] = set()
    in_a_row = 0
    for i, fired in enumerate(firing):  # the alert's count: skipped steps in a row at which any group fired
        if not fired:
            in_a_row = 0
        elif in_a_row >= 2:
            in_a_row = 0
        else:
            expected.add(i)
            in_a_row += 1
    assert expected == {2, 3, 5, 7, 8}
    by_hand: list[dict[str, torch.Tensor]] = []
    run(tiny(seed=3), expected, [], lambda i, m, o: by_hand.append(copy.deepcopy(m.state_dict())))
    for i, (a, b) in enumerate(zip(live, by_hand)):
        assert all(torch.equal(a[k], b[k]) for k in a), i
    records = {(r["step"], r["module"], r["outcome"] == "step skipped") for r in json_lines(tmp_path / "alerts.jsonl")}
    assert records == {(i, name, i in expected) for i, fired in enumerate(firing) for name in fired}
