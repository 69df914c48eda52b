"""Hot reloads in a process group: every rank swaps to a new policy at the same step (issue 23.1).

A reload reaches the ranks of a job at different times (a ConfigMap reaches each node
when its kubelet syncs; each rank's watcher looks on its own clock). These tests make
that happen on purpose: on 2 gloo ranks, DDP and FSDP2, each rank hands the reload path
(`Discovery.swaps.request`, what `--watch` and SIGHUP call) a new policy set at a step of
its own, rank 1 one step after rank 0 and sometimes never seeing an intermediate version
at all. The new set adds or removes skip, halt, clip, scale, AGC and capture rules.

The references, computed by the test and not by hookpolicy's reload:
- the same run with the policies attached and removed by hand (`PolicySet.attach` /
  `remove`) at the steps the reloaded run swapped: the parameters after every step equal
  bit for bit (the full tensors, under FSDP2 too);
- the other rank: the same parameters (DDP and FSDP2 keep one model) and the same
  policy revision at every step;
- the swap step: the first step boundary after the last rank had the new version.

End to end, `hookpolicy apply --watch -- torchrun` (DDP, FSDP2): the policy file edited three
times and reloaded once by SIGHUP while the job runs; each rank's watcher sees the edits
on its own clock, and both ranks must report the same versions at the same steps (and,
under DDP, the same parameters after every step).

Every process group has a 60 s timeout and every spawn a deadline, far below torch's
default of 30 minutes, so a reload that deadlocks the job fails the test.
"""

from __future__ import annotations

import hashlib
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.distributed import spawn
from helpers.policies import policy_text, write_policy
from helpers.processes import Run, child_env, torchrun

sys.path.insert(0, str(REPO / "examples"))
from train_mlp import build_model, make_data  # noqa: E402
from helpers.dist_train import wrap  # noqa: E402

pytestmark = pytest.mark.slow

# -- the policies a job is reloaded with --------------------------------------------------

CAPTURE = """\
- name: norms
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], per: rule}
"""
#: fires on one rank's own activations at some steps: only the agreement makes it every rank's
SKIP = """\
- name: skip
  match: {modules: ["4"]}
  trigger: {at: forward}
  target: output
  actions:
    - alert: {if: "max > 0.25", per: rule, severity: warning, then: skip_step}
"""
HALT = """\
- name: halt
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: halt}
"""
CLIP = """\
- name: clip
  priority: 10
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - clip: {max_norm: 0.2, per: rule}
"""
SCALE = """\
- name: scale
  priority: 5
  match: {modules: ["0"]}
  trigger: {at: step}
  target: grad
  actions:
    - scale: {factor: 0.5}
"""
AGC = """\
- name: agc
  priority: 20
  match: {modules: ["**"]}
  trigger: {at: step}
  actions:
    - clip: {unitwise_ratio: 0.01, eps: 0.001}
"""
ACTIVATIONS = """\
- name: activations
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions:
    - capture: {stats: [l2_norm, max], per: module}
"""

#: The versions a job goes through, one reload each: every kind of rule comes and goes.
VERSIONS = [
    CAPTURE, CAPTURE + SKIP, CAPTURE + CLIP, CAPTURE + SKIP + HALT, CAPTURE + SCALE, CAPTURE + AGC,
    ACTIVATIONS, CAPTURE + CLIP + SKIP, SCALE + AGC, CAPTURE + HALT, SKIP, CAPTURE + CLIP + SCALE,
    ACTIVATIONS + AGC + SKIP, CAPTURE, HALT + CLIP, SKIP + SCALE + ACTIVATIONS, AGC, CAPTURE + SKIP + CLIP + AGC,
    CAPTURE + HALT + SCALE, CLIP, CAPTURE + SKIP, ACTIVATIONS + CLIP, CAPTURE,
]
#: Steps between two versions: rank 0 gets version k at step SPACING*k - 2, rank 1 a step later.
SPACING = 3
#: Versions rank 1 never sees (the next one reached it first), as a ConfigMap update can.
UNSEEN = {6, 15}


def schedule(rank: int) -> dict[int, int]:
    """step -> the version this rank's reload path is handed before that step's forward."""
    return {SPACING * k - 2 + rank: k for k in range(1, len(VERSIONS)) if not (rank == 1 and k in UNSEEN)}


# -- one job, reloaded; then the same job with the policies swapped by hand ---------------


def wrapped(how: str) -> nn.Module:
    torch.manual_seed(0)
    return wrap(build_model(), how)  # the end-to-end tests' script wraps it the same way


def digest(model: nn.Module) -> str:
    """The full parameters (gathered under FSDP2, a collective), hashed."""
    from torch.distributed.tensor import DTensor
    tensors = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def train(rank: int, how: str, steps: int, before: Callable[[int, nn.Module], None],
          after: Callable[[int], None]) -> list[str]:
    """`steps` SGD steps on this rank's shard of the data; the parameters' digest after each."""
    model = wrapped(how)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(0)
    x, y = x[rank::2], y[rank::2]
    digests = []
    for step in range(steps):
        before(step, model)
        i = step % (len(x) // 16) * 16
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[i:i + 16]), y[i:i + 16]).backward()
        optimizer.step()
        after(step)
        digests.append(digest(model))
    return digests


def reloaded(rank: int, how: str, files: list[str], schedules: list[dict[str, int]]) -> dict[str, Any]:
    """The job under the reload path of `apply`: the versions handed in at this rank's own steps;
    then the same job with each version attached by hand from the step the reload swapped it in."""
    from hookpolicy.apply.discovery import Discovery
    versions = [hookpolicy.load(f) for f in files]
    steps = SPACING * len(VERSIONS) + 2
    discovery = Discovery(versions[0], registry=CollectorRegistry(), rank=rank)
    discovery.install()
    revisions: list[str] = []
    generations: list[int] = []  # the agreement's generation: ranks agree on rules of the same one only
    handed = {int(step): version for step, version in schedules[rank].items()}

    def hand(step: int, model: nn.Module) -> None:
        if step in handed:
            discovery.swaps.request(versions[handed[step]])

    def running(step: int) -> None:
        (governed,) = discovery.governed
        revisions.append(governed.attached.policies[0].revision)
        generations.append(governed.attached.generation)

    try:
        digests = train(rank, how, steps, hand, running)
    finally:
        discovery.remove()
    by_revision = {v.policies[0].revision: v for v in versions}
    attached: list[Optional[hookpolicy.Attached]] = [None]

    def by_hand(step: int, model: nn.Module) -> None:
        if step == 0 or revisions[step] != revisions[step - 1]:
            previous = attached[0]
            if previous is not None:
                previous.remove()
            attached[0] = by_revision[revisions[step]].attach(model, registry=CollectorRegistry(), rank=rank,
                                                              start_step=step)

    try:
        reference = train(rank, how, steps, by_hand, lambda step: None)
    finally:
        if attached[0] is not None:
            attached[0].remove()
    return {"digests": digests, "revisions": revisions, "generations": generations, "reference": reference,
            "order": [v.policies[0].revision for v in versions]}


def version_files(folder: Path) -> list[str]:
    """VERSIONS as files of one policy `p`, each with a revision of its own (whatever its rules)."""
    files = []
    for k, rules in enumerate(VERSIONS):
        (folder / f"v{k}").mkdir()
        path = write_policy(folder / f"v{k}", rules)
        path.write_text(path.read_text() + f"# version {k}\n")
        files.append(str(path))
    return files


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_reloads_swap_at_the_same_step_on_every_rank(tmp_path: Path, free_port: int, how: str) -> None:
    ranks = spawn(reloaded, tmp_path, free_port, how, version_files(tmp_path), [schedule(0), schedule(1)],
                  timeout=150)
    order = ranks[0]["order"]
    assert ranks[0]["revisions"] == ranks[1]["revisions"]  # the same policy at every step on both ranks
    assert ranks[0]["generations"] == ranks[1]["generations"]
    assert ranks[0]["digests"] == ranks[1]["digests"]  # one model: no rank parted ways
    for r in ranks:
        assert r["digests"] == r["reference"]  # = the policies swapped by hand at those steps
    # each version runs from the step boundary after the last rank had it; one a rank never saw, never
    swapped = {order.index(rev): step for step, rev in enumerate(ranks[0]["revisions"])
               if step and rev != ranks[0]["revisions"][step - 1]}
    assert swapped == {k: SPACING * k for k in range(1, len(VERSIONS)) if k not in UNSEEN}
    assert len(swapped) >= 20



def test_a_rank_without_the_new_version_keeps_the_job_on_the_old_one(
    tmp_path: Path, free_port: int, capfd: pytest.CaptureFixture[str],
) -> None:
    """Rank 1 cannot load version 2 (its reload failed) until step 30: no rank runs it before step 31."""
    ranks = spawn(reloaded, tmp_path, free_port, "ddp", version_files(tmp_path), [{4: 2}, {30: 2}], timeout=150)
    order = ranks[0]["order"]
    for r in ranks:
        assert r["revisions"] == [order[0]] * 31 + [order[2]] * (len(r["revisions"]) - 31)
        assert r["digests"] == r["reference"] == ranks[0]["digests"]
    waiting = [line for line in capfd.readouterr().err.splitlines() if " waits at step " in line]
    assert waiting == [f"hookpolicy: reload of p@{order[2][:12]} waits at step 4 of Sequential (rank 0): not every "
                       "rank of the process group has it; the job keeps running its current policies"]


# -- end to end: hookpolicy apply --watch -- torchrun, files edited and SIGHUP ------------

SCRIPT = str(REPO / "tests" / "helpers" / "dist_train.py")
STEP_LINE = re.compile(r"rank (\d) step (\d+) loss \S+ params (\w+)")
#: the two ranks share one stderr, so another rank's line may follow a version with no line break between
RELOADED = re.compile(r"reloaded policies at step (\d+) of Sequential \(rank (\d)\): (\S+?)(?=hookpolicy:|\s|$)")


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_watch_and_sighup_reloads_go_in_at_the_same_step_on_both_ranks(
    apply: Callable[..., Run], tmp_path: Path, how: str,
) -> None:
    """Each rank's watcher sees an edit on its own clock; the swap must still come at one step for both."""
    policy = write_policy(tmp_path, CAPTURE)
    run = apply(str(policy), "--watch", "--", *torchrun(), "--standalone", "--nproc_per_node", "2", SCRIPT,
                "--wrap", how, "--steps", "600", "--sleep", "0.05",
                env=child_env(HOOKPOLICY_WATCH_INTERVAL="0.3"))

    def reloads() -> list[tuple[int, int, str]]:
        return [(int(m[1]), int(m[2]), m[3]) for m in RELOADED.finditer(run.stderr)]

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 90
        while len(reloads()) < count:
            assert run.proc.poll() is None, run.stderr
            assert time.monotonic() < deadline, run.stderr
            time.sleep(0.1)

    deadline = time.monotonic() + 120
    while not re.search(r"rank 1 step 5 ", run.stdout):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.1)
    for k, rules in enumerate([CAPTURE + CLIP, CAPTURE + SKIP + AGC, CLIP + SCALE]):
        policy.write_text(policy_text(rules) + f"# edit {k}\n")
        wait_for(2 * (k + 1))
    policy.write_text(policy_text(CAPTURE + CLIP + SKIP) + "# by SIGHUP\n")
    run.proc.send_signal(signal.SIGHUP)
    wait_for(8)
    assert run.wait(180) == 0, run.stderr
    by_rank: dict[int, list[tuple[int, str]]] = {0: [], 1: []}
    for step, rank, names in reloads():
        by_rank[rank].append((step, names))
    assert len(by_rank[0]) == 4 and by_rank[0] == by_rank[1]  # the same versions at the same steps
    digests: dict[int, dict[int, str]] = {0: {}, 1: {}}
    for m in STEP_LINE.finditer(run.stdout):
        digests[int(m[1])][int(m[2])] = m[3]
    assert len(digests[0]) == 600
    if how == "ddp":  # one replica: the same parameters after every step (FSDP2's lines digest each rank's shard)
        assert digests[0] == digests[1]
