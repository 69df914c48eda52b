"""The flight recorder (`capture.keep`, `engine/decide/recorder.py`): the ring of the last steps' statistics, the
dumps alerts write of it, and their bounds.

References: the capture log of the same capture in the same run (a dump's records must be the log's, field for
field and bit for bit), `torch.linalg.vector_norm` of the gradients the test reads itself, counted entries and
bytes (never time), and the files on disk.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import hookpolicy
from hookpolicy.engine.decide.recorder import VALUE_BYTES
from hookpolicy.errors import PolicyError
from helpers.distributed import spawn
from helpers.library import load_text
from helpers.models import tiny
from helpers.outputs import json_lines
from helpers.processes import child_env

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: rec}}
spec:
  limits: {{maxDumps: {dumps}, maxDumpBytes: {dump_bytes}, maxRingBytes: {ring_bytes}}}
  rules:
    - name: layers
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - capture:
            stats: [l2_norm, abs_max, mean]
            {log}
            keep: {{steps: {steps}, export: {export}, dump: {{alerts: [rec/guard], before: {before}, after: {after}}}}}
    - name: guard
      match: {{root: true}}
      trigger: {{at: step}}
      target: loss
      actions:
        - alert: {{if: "max > 50"}}
"""


def policy(tmp_path: Path, *, steps: int = 40, before: int = 10, after: int = 3, dumps: int = 10,
           dump_bytes: int = 1 << 26, ring_bytes: int = 1 << 28, export: str = "false", log: bool = True,
           target: str = "grad") -> Any:
    text = POLICY.format(steps=steps, before=before, after=after, dumps=dumps, dump_bytes=dump_bytes,
                         ring_bytes=ring_bytes, export=export, log="log: {path: full.jsonl}" if log else "")
    text = text.replace("      target: grad\n", f"      target: {target}\n")
    return load_text(tmp_path, text)


def run(model: torch.nn.Module, steps: int, spikes: set[int], grads: dict[int, dict[str, torch.Tensor]] | None = None,
        each: Any = None, updates: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
    """`steps` SGD steps of `tiny`; at `spikes` the loss is 1000 times larger (the guard's alert fires)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        loss = model(torch.randn(6, 4, generator=gen)).pow(2).mean() * (1000.0 if step in spikes else 1.0) + 1.0
        if step in spikes:
            loss = loss + 100.0
        loss.backward()
        if grads is not None:
            grads[step] = {name: torch.cat([p.grad.reshape(-1) for p in m.parameters()])  # type: ignore[union-attr]
                           for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if updates is not None:
            before = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                      for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        opt.step()
        if updates is not None:
            updates[step] = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) - before[name]
                             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        opt.zero_grad()
        if each is not None:
            each(step)


def dump_files(workdir: Path) -> list[Path]:
    return sorted((workdir / "dumps").glob("*.jsonl"))


@pytest.mark.parametrize("target", ["grad", "update"])
def test_a_dumps_window_is_the_same_steps_of_the_full_capture_bit_for_bit(workdir: Path, target: str) -> None:
    """The capture logs every step and keeps them; the alert at 25 and 50 dumps steps 15..28 and 40..53: each
    record of a dump is the log's record of that step and module, every field (time included) equal, the
    statistics bit for bit; the L2 norms are those of the gradients (the updates: parameters after the step
    minus before) the test read (vector_norm). An update of step S is read back at S + 1, kept under S."""
    model = tiny()
    grads: dict[int, dict[str, torch.Tensor]] = {}
    reg = CollectorRegistry()
    with policy(workdir, target=target).attach(model, registry=reg, rank=0):
        run(model, 60, {25, 50}, None if target == "update" else grads,
            updates=grads if target == "update" else None)
        assert [s.name for m in reg.collect() for s in m.samples if s.name.startswith(f"hookpolicy_{target}_")] == []
        assert [s.value for m in reg.collect() for s in m.samples if s.name == "hookpolicy_steps_total"] == [60]
    log = json_lines(workdir / "full.jsonl")
    by_step = {(r["step"], r["module"]): r for r in log}
    files = dump_files(workdir)
    assert [f.name for f in files] == ["rec-layers.step00000025.rank0.jsonl", "rec-layers.step00000050.rank0.jsonl"]
    for file, spike in zip(files, (25, 50)):
        lines = [json.loads(line) for line in file.read_text().splitlines()]
        header, alert, records = lines[0], lines[1], lines[2:]
        assert header["event"] == "dump" and header["step"] == spike and (header["first"], header["last"]) == (
            spike - 10, spike + 3)
        assert alert["event"] == "alert" and alert["step"] == spike and (alert["policy"], alert["rule"]) == ("rec", "guard")
        window = [r for r in log if spike - 10 <= r["step"] <= spike + 3]
        assert len(records) == len(window) == 14 * 2
        for record in records:
            assert record == by_step[(record["step"], record["module"])]
            assert all(type(v) is type(by_step[(record["step"], record["module"])]["stats"][k])
                       for k, v in record["stats"].items())
            reference = torch.linalg.vector_norm(grads[record["step"]][record["module"]].double()).item()
            assert record["stats"]["l2_norm"] == pytest.approx(reference, rel=1e-6)


def test_keep_with_export_publishes_the_series_as_without_keep(workdir: Path) -> None:
    model = tiny()
    reg = CollectorRegistry()
    with policy(workdir, export="true").attach(model, registry=reg, rank=0) as attached:
        run(model, 5, set())
        last = attached.recorder.rings[(("rec", "layers"), 0)].steps[-1]
        exported = {s.labels["module"]: s.value for m in reg.collect() for s in m.samples
                    if s.name == "hookpolicy_grad_l2_norm"}
    assert exported == {module: last.values[row * 3] for row, (module, _) in enumerate(last.groups)}
    assert set(exported) == {"0", "2"}


def test_the_ring_stays_within_its_bound_over_a_long_run(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """1,500 steps of a ring of keep.steps 200 whose maxRingBytes holds 30 steps (2 modules x 3 stats x 8 bytes,
    and one list of group names, shared by every step after the first): after every step the ring holds at most
    30 steps and at most its bytes, counted; its bound is said once."""
    per_step = 2 * 3 * VALUE_BYTES
    budget = 30 * per_step + 2 * VALUE_BYTES  # the oldest step holds the group list the others share
    model = tiny()
    seen: list[tuple[int, int]] = []
    with policy(workdir, steps=200, ring_bytes=budget, log=False, before=5, after=0).attach(model, rank=0) as attached:
        def each(step: int) -> None:
            ring = attached.recorder.rings[(("rec", "layers"), 0)]
            counted = sum(VALUE_BYTES * len(s.values) + (0 if s.shared else VALUE_BYTES * len(s.groups))
                          for s in ring.steps)
            assert ring.bytes == counted <= budget
            assert [s.step for s in ring.steps] == list(range(max(0, step - 29), step + 1))
            seen.append((len(ring.steps), ring.bytes))
        with caplog.at_level(logging.WARNING, logger="hookpolicy"):
            run(model, 1500, set(), each=each)
    assert max(seen) == (30, budget)
    said = [r for r in caplog.records if "keeps fewer than keep.steps=200" in r.getMessage()]
    assert len(said) == 1
    # without a byte bound, keep.steps is the bound: 200 entries, every one's bytes counted
    model = tiny()
    with policy(workdir, steps=200, log=False, before=5, after=0).attach(model, rank=0) as attached:
        run(model, 600, set())
        ring = attached.recorder.rings[(("rec", "layers"), 0)]
        assert len(ring.steps) == 200 and ring.bytes == 200 * per_step + 2 * VALUE_BYTES


def test_dumps_past_max_dumps_are_said_once_and_counted_never_written(
        workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with policy(workdir, dumps=2, after=0).attach(model, rank=0) as attached:
            run(model, 50, {12, 20, 30, 40})
    summary = "\n".join(attached.summary())
    for step in (12, 20):  # the run summary names each dump written, with its records (the alert, 11 steps x 2)
        assert f"wrote 23 records to {workdir / 'dumps' / f'rec-layers.step{step:08d}.rank0.jsonl'}" in summary
    assert "step00000030" not in summary
    assert [f.name for f in dump_files(workdir)] == ["rec-layers.step00000012.rank0.jsonl",
                                                     "rec-layers.step00000020.rank0.jsonl"]
    said = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(said) == 2, said
    assert "the dump of step 30" in said[0] and "spec.limits.maxDumps=2 reached" in said[0]
    assert "2 dump(s) not written on rank 0" in said[1]


def test_a_dump_past_max_dump_bytes_is_not_written_in_part(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first dump's size is measured in a run without a byte bound; with a bound of 1.5 of it, the second
    is not written (no partial file), said once, and counted at detach."""
    model = tiny()
    with policy(workdir, after=0).attach(model, rank=0):
        run(model, 30, {12})
    (first,) = dump_files(workdir)
    size = first.stat().st_size
    first.unlink()
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with policy(workdir, after=0, dump_bytes=size * 3 // 2).attach(model, rank=0):
            run(model, 30, {12, 20})
    (only,) = dump_files(workdir)
    assert only.name == "rec-layers.step00000012.rank0.jsonl" and size // 2 < only.stat().st_size <= size * 3 // 2
    assert len([json.loads(line) for line in only.read_text().splitlines()]) == 2 + 11 * 2
    assert not list((workdir / "dumps").glob(".tmp-*"))
    said = [r.getMessage() for r in caplog.records if "the dump of step 20" in r.getMessage()]
    assert len(said) == 1 and "spec.limits.maxDumpBytes" in said[0]


def test_a_dump_waiting_for_its_after_steps_is_written_at_detach_with_what_there_is(workdir: Path) -> None:
    model = tiny()
    with policy(workdir, after=5).attach(model, rank=0):
        run(model, 23, {20})
    (file,) = dump_files(workdir)
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    assert (lines[0]["first"], lines[0]["last"]) == (10, 22)
    assert sorted({r["step"] for r in lines[2:]}) == list(range(10, 23))


def test_a_dump_window_longer_than_the_ring_is_refused_at_check(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as error:
        policy(tmp_path, steps=10, before=8, after=2)
    text = str(error.value)
    assert "keep.steps must be at least 11" in text and "$.spec.rules[0].actions[0].capture.keep.steps" in text


def test_explain_shows_the_rings_memory_and_its_cap_which_the_ring_keeps(
        workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """explain's count of the ring's memory is the ring's own count at run time, and the cap it warns about at
    load (and at attach) is the number of steps the ring then keeps."""
    from hookpolicy.engine.decide.recorder import bounds

    model = tiny()
    policies = policy(workdir, steps=40, ring_bytes=20 * 2 * 3 * VALUE_BYTES, log=False)
    notes, warnings = bounds(policies.policies, policies.plan(model).bindings)
    assert any("keeps a ring of 40 steps x 2 groups (per: module) x 3 stats x 8 bytes + 8 bytes per group name = "
               "1936 bytes of 960" in n for n in notes), notes
    assert any("it keeps only the last 19 steps" in w for w in warnings), warnings
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with policies.attach(model, rank=0) as attached:
            assert [r.getMessage() for r in caplog.records if "it keeps only the last 19 steps" in r.getMessage()]
            run(model, 50, set())
            ring = attached.recorder.rings[(("rec", "layers"), 0)]
            assert len(ring.steps) == 19 and ring.bytes == 19 * 2 * 3 * VALUE_BYTES + 2 * VALUE_BYTES
    uncapped = policy(workdir, steps=40, log=False)
    model = tiny()
    with uncapped.attach(model, rank=0) as attached:
        run(model, 50, set())
        assert attached.recorder.rings[(("rec", "layers"), 0)].bytes == 1936


# -- several ranks -------------------------------------------------------------------------------------------------

def ddp_rank(rank: int, folder: str, text: str, lr: float) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer,
                                                                      torch.Generator]:
    """On a spawned rank: the policy `text` (written by rank 0), a DDP `tiny`, its SGD and this rank's batches."""
    import os

    from torch.nn.parallel import DistributedDataParallel

    os.environ["HOOKPOLICY_OUTPUT_DIR"] = folder
    os.environ["HOOKPOLICY_RUN_ID"] = "one-job"  # as `hookpolicy apply` gives every rank of a job
    path = Path(folder) / "policy.yaml"
    if rank == 0:
        path.write_text(text)
    torch.distributed.barrier()
    model = DistributedDataParallel(tiny())
    return hookpolicy.load(path), model, torch.optim.SGD(model.parameters(), lr=lr), \
        torch.Generator().manual_seed(10 + rank)


def ranks_dump(rank: int, folder: str, text: str) -> dict[str, Any]:
    """Both ranks train a DDP `tiny` on their own batches; rank 1's loss spikes at step 15 (the loss rule
    sees the job's loss: the alert fires on both ranks)."""
    policies, model, opt, gen = ddp_rank(rank, folder, text, 1e-3)
    with policies.attach(model, rank=rank):
        for step in range(25):
            loss = model(torch.randn(6, 4, generator=gen)).pow(2).mean()
            if rank == 1 and step == 15:
                loss = loss + 1000.0
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"files": sorted(p.name for p in (Path(folder) / "dumps").glob("*.jsonl"))}


def test_two_gloo_ranks_dump_at_the_same_step_and_report_merges_them(tmp_path: Path, free_port: int) -> None:
    text = POLICY.format(steps=40, before=10, after=2, dumps=10, dump_bytes=1 << 26, ring_bytes=1 << 28,
                         export="false", log="")
    ranks = spawn(ranks_dump, tmp_path, free_port, str(tmp_path), text)
    names = ["rec-layers.step00000015.rank0.jsonl", "rec-layers.step00000015.rank1.jsonl"]
    assert ranks[0]["files"] == ranks[1]["files"] == names
    from hookpolicy.export.report import read_logs

    records = read_logs([str(tmp_path / "dumps" / n) for n in names])
    assert {key[6] for key in records.series} == {0, 1}
    assert {s for points in records.series.values() for s in points} == set(range(5, 18))
    assert [e[2] for e in records.events] == [15, 15]
    # after DDP's all-reduce both ranks hold the same gradients: their rings agree bit for bit
    zero, one = ({(k[3], k[4]): v for k, v in records.series.items() if k[6] == rank} for rank in (0, 1))
    assert zero == one and all(math.isfinite(v) for points in zero.values() for v in points.values())


def test_report_of_a_dump_draws_the_layers_around_the_event_with_the_alert_marked(workdir: Path) -> None:
    pytest.importorskip("matplotlib")
    from hookpolicy.export.report import figures, read_runs, write_report

    model = tiny()
    with policy(workdir, log=False).attach(model, rank=0):
        run(model, 40, {25})
    (file,) = dump_files(workdir)
    found = read_runs([str(file)])
    assert found.ignored == 0  # the header is read as the dump's event, not skipped
    (records,) = found.pick()
    assert records.dumps == [(0, "rec", "layers", 25, 15, 28, ("rec/guard",))]
    assert records.events == [("rec", "guard", 25, "warning")]
    drawn = {name: fig for _, name, fig in figures(records)}
    heatmaps = [fig for name, fig in drawn.items() if name.endswith("-layers.png")]
    assert len(heatmaps) == 3  # l2_norm, abs_max, mean: modules x steps
    for fig in heatmaps:
        ax = fig.axes[0]
        marks = [line.get_xdata()[0] for line in ax.get_lines()]
        assert marks == [25]
        assert ax.get_xlim() == (14.5, 28.5)  # the window, each step a column
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2"]
    page = workdir / "page.html"
    write_report([str(file)], page)
    assert "dump of rec/layers on rank 0 around the alert of rec/guard at step 25 (steps 15-28)" in page.read_text()


def test_keeping_costs_no_transfer_and_no_hook_of_its_own(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring is fed from the values the read-back already fetched: with keep, the same hooks are installed
    and the same matrices are fetched from the device, as many times with as many values, as without it."""
    from hookpolicy.engine.decide import readback
    from helpers.hooks import module_hook_count

    fetched: list[tuple[int, int]] = []
    original = readback._fetch

    def counted(matrices: Any) -> Any:
        fetched.append((len(matrices), sum(m.numel() if isinstance(m, torch.Tensor) else len(m) * len(m[0])
                                           for m in matrices)))
        return original(matrices)

    monkeypatch.setattr(readback, "_fetch", counted)
    seen: dict[str, list[tuple[int, int]]] = {}
    hooks: dict[str, int] = {}
    for name, text in (("without", POLICY.replace("            keep: {{steps: {steps}, export: {export}, dump: "
                                                   "{{alerts: [rec/guard], before: {before}, after: {after}}}}}\n",
                                                   "")),
                       ("with", POLICY)):
        fetched.clear()
        model = tiny()
        assert ("keep" in text) == (name == "with")
        with load_text(workdir, text.format(steps=40, before=10, after=3, dumps=10, dump_bytes=1 << 26,
                                            ring_bytes=1 << 28, export="true", log="")).attach(model, rank=0):
            hooks[name] = module_hook_count(model)
            run(model, 30, {12})
        seen[name] = list(fetched)
    assert hooks["with"] == hooks["without"]
    assert seen["with"] == seen["without"] and len(seen["with"]) == 31  # 30 steps, and the last at detach


def test_replay_reads_a_dump_as_a_log(workdir: Path) -> None:
    """A guard on the layers' gradient norms, replayed over a dump, fires at exactly the steps and modules of
    the window where the gradients the test read have a norm above its threshold."""
    from hookpolicy.engine.replay import replay

    model = tiny()
    grads: dict[int, dict[str, torch.Tensor]] = {}
    with policy(workdir, log=False).attach(model, rank=0):
        run(model, 40, {25}, grads)
    (file,) = dump_files(workdir)
    norms = {(s, m): torch.linalg.vector_norm(g.double()).item() for s in range(15, 29) for m, g in grads[s].items()}
    ranked = sorted(norms.values())
    threshold = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2  # half-way between two norms
    guard = load_text(workdir, f"""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: rec}}
spec:
  rules:
    - name: layers
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - alert: {{if: "l2_norm > {threshold!r}"}}
""", name="guard.yaml")
    replayed = replay(guard.policies, [str(file)])
    assert replayed.steps == list(range(15, 29))
    fired = {(r["step"], r["module"]) for r in replayed.alerts}
    assert fired == {k for k, v in norms.items() if v > threshold} and len(fired) == len(norms) // 2


ONE_RANK = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: rec}
spec:
  rules:
    - name: layers
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm], keep: {steps: 40, dump: {alerts: [rec/act], before: 5, after: 1}}}
    - name: act
      match: {modules: ["0"]}
      trigger: {at: forward}
      target: output
      actions:
        - alert: {if: "abs_max > 1000"}
"""


def ranks_one_alert(rank: int, folder: str) -> dict[str, Any]:
    """DDP `tiny` on 2 ranks; at step 15 only rank 1's input is huge: its own activation alert fires there alone."""
    policies, model, opt, gen = ddp_rank(rank, folder, ONE_RANK, 1e-6)
    with policies.attach(model, rank=rank):
        for step in range(20):
            x = torch.randn(6, 4, generator=gen) * (1e5 if rank == 1 and step == 15 else 1.0)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    files = sorted((Path(folder) / "dumps").glob(f"*.rank{rank}.jsonl"))
    return {"files": [p.name for p in files],
            "lines": [[json.loads(line) for line in p.read_text().splitlines()] for p in files]}


def test_an_alert_of_one_rank_dumps_every_ranks_ring_at_the_same_step(tmp_path: Path, free_port: int) -> None:
    """The alerts a dump names are agreed on at each step (the step's agreement, `StepReport.fired`): an
    activation alert that fired on rank 1 alone dumps rank 0's ring too, at the same step, with the same window;
    only rank 1's dump holds the alert record; `report` merges both ranks' dumps."""
    zero, one = spawn(ranks_one_alert, tmp_path, free_port, str(tmp_path))
    assert zero["files"] == ["rec-layers.step00000015.rank0.jsonl"]
    assert one["files"] == ["rec-layers.step00000015.rank1.jsonl"]
    (z,), (o,) = zero["lines"], one["lines"]
    for lines, rank in ((z, 0), (o, 1)):
        assert {k: lines[0][k] for k in ("event", "step", "first", "last", "alerts", "rank")} == {
            "event": "dump", "step": 15, "first": 10, "last": 16, "alerts": ["rec/act"], "rank": rank}
    assert [r["rank"] for r in o if r.get("event") == "alert"] == [1]
    assert not [r for r in z if r.get("event") == "alert"]
    from hookpolicy.export.report import read_logs

    records = read_logs([str(tmp_path / "dumps" / n) for n in zero["files"] + one["files"]])
    assert sorted(d[0] for d in records.dumps) == [0, 1] and {d[3] for d in records.dumps} == {15}
    assert {key[6] for key in records.series} == {0, 1}
    assert records.marked() == [15]


def test_hookpolicy_explain_prints_the_ring_and_the_dump(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hookpolicy.cli import cli

    path = tmp_path / "rec.yaml"
    path.write_text(POLICY.format(steps=40, before=10, after=3, dumps=10, dump_bytes=1 << 26, ring_bytes=1 << 28,
                                  export="false", log=""))
    result = CliRunner().invoke(cli, ["explain", str(path), "--model", "examples.train_mlp:build_model"])
    assert result.exit_code == 0, result.output
    linears = sum(isinstance(m, torch.nn.Linear) for m in __import__("examples.train_mlp").train_mlp.build_model().modules())
    assert "capture(l2_norm,abs_max,mean per=module keep=40,not-exported,dump=dumps)" in result.output
    assert (f"rec/layers: action 0 keeps a ring of 40 steps x {linears} groups (per: module) x 3 stats x 8 bytes + 8 "
            f"bytes per group name = {40 * linears * 24 + linears * 8} bytes of 268435456") in result.output
    assert "dumps 10 steps before and 3 after an alert of rec/guard to dumps/ (at most 10 files" in result.output


# -- a hot reload ----------------------------------------------------------------------------------------------------

#: a third rule, unrelated to the ring: its threshold is what a reload edits
UNRELATED = """\
    - name: other
      match: {{types: [Linear]}}
      trigger: {{at: forward}}
      target: output
      actions:
        - alert: {{if: "abs_max > 1e9"}}
"""


def reload_policy(workdir: Path, name: str = "policy.yaml", edit: Any = lambda text: text, **kw: Any) -> Any:
    """`policy` with UNRELATED appended (`edit` changes the text before it is loaded)."""
    base = dict(steps=20, before=10, after=3, dumps=10, dump_bytes=1 << 26, ring_bytes=1 << 28, export="false",
                log="log: {path: full.jsonl}")
    base.update(kw)
    return load_text(workdir, edit((POLICY + UNRELATED).format(**base)), name=name)


def reloading_run(model: torch.nn.Module, first: Any, then: Any, at: int, steps: int, spikes: set[int],
                  grads: dict[int, dict[str, torch.Tensor]] | None = None,
                  each: Any = None) -> tuple[Any, Any]:
    """`run` under `first`, reloaded to `then` after `at` steps as `apply --watch` swaps (`Swaps._swap`, between
    two steps); returns both attachments (the new one removed). `each(step, attachment)` after every step, before
    the reload."""
    from hookpolicy.apply.reload import Governed, Swaps

    old = first.attach(model, registry=CollectorRegistry(), rank=0)
    swaps = Swaps(first, rank=0)
    governed = Governed(model, old, generation=0)

    def attach(policies: Any, module: torch.nn.Module, step: int, generation: int) -> Any:
        return policies.attach(module, registry=CollectorRegistry(), rank=0, start_step=step)

    def at_step(step: int) -> None:
        if each is not None:
            each(step, governed.attached)
        if step == at - 1:
            swaps.request(then)
            assert swaps.next is not None
            swaps._swap(governed, [governed], attach, *swaps.next)
            assert governed.attached.step == at  # the model's step numbers go on

    try:
        run(model, steps, spikes, grads, each=at_step)
    finally:
        governed.attached.remove()
    return old, governed.attached


def dump_lines(file: Path, timeless: bool = False) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time"} for r in lines] if timeless else lines


def test_a_reload_that_leaves_the_capture_alone_continues_its_ring(workdir: Path) -> None:
    """keep.steps 20, reloaded after step 11 with the unrelated rule's threshold changed, the alert at 16: the
    dump holds steps 6..19, half of them kept by the old attachment, and is the dump of the same run without
    a reload but for its times; each record is the capture log's (both attachments wrote it) bit for bit, time
    included, and its L2 norms those of the gradients the test read."""
    with reload_policy(workdir).attach(model := tiny(), registry=CollectorRegistry(), rank=0):
        run(model, 24, {16})  # the reference: the same loop without a reload
    (reference,) = dump_files(workdir)
    reference = reference.rename(workdir / "reference.jsonl")
    (workdir / "full.jsonl").unlink()

    then = reload_policy(workdir, "edited.yaml", lambda text: text.replace("abs_max > 1e9", "abs_max > 1e8"))
    grads: dict[int, dict[str, torch.Tensor]] = {}
    old, new = reloading_run(model := tiny(), reload_policy(workdir), then, 12, 24, {16}, grads)
    (file,) = dump_files(workdir)
    assert file.name == "rec-layers.step00000016.rank0.jsonl"
    lines = dump_lines(file)
    header, records = lines[0], lines[2:]
    assert (header["step"], header["first"], header["last"]) == (16, 6, 19)
    assert sorted({r["step"] for r in records}) == list(range(6, 20))
    assert dump_lines(file, timeless=True) == dump_lines(reference, timeless=True)
    log = {(r["step"], r["module"]): r for r in json_lines(workdir / "full.jsonl")}
    assert {s for s, _ in log} == set(range(24))
    for record in records:
        assert record == log[(record["step"], record["module"])]
        want = torch.linalg.vector_norm(grads[record["step"]][record["module"]].double()).item()
        assert record["stats"]["l2_norm"] == pytest.approx(want, rel=1e-6)
    assert new.recorder.rings[(("rec", "layers"), 0)].rule is new._cycle.rules[("rec", "layers")]
    assert not old.recorder.rings and new.recorder.written == [file]


def test_a_reload_that_changes_the_capture_starts_its_ring_anew(workdir: Path) -> None:
    """The captured rule itself changed (its dump's `before`): its ring starts empty at the reload, and its dump
    waiting at the reload (alert at 10, after: 5) is written at the old detach with what the old ring held."""
    seen: dict[int, list[int]] = {}
    then = reload_policy(workdir, "edited.yaml", lambda text: text.replace("before: 10", "before: 9"), after=5)

    def each(step: int, attached: Any) -> None:
        ring = attached.recorder.rings.get((("rec", "layers"), 0))
        seen[step] = [] if ring is None else [s.step for s in ring.steps]

    old, new = reloading_run(tiny(), reload_policy(workdir, after=5), then, 12, 24, {10, 20}, each=each)
    assert seen[11] == list(range(0, 12))
    assert seen[12] == [12] and seen[19] == list(range(12, 20))
    first, second = dump_files(workdir)
    assert first.name == "rec-layers.step00000010.rank0.jsonl" and old.recorder.written == [first]
    header = dump_lines(first)[0]
    assert (header["first"], header["last"]) == (0, 11)  # written at the reload, short of its after steps
    assert sorted({r["step"] for r in dump_lines(first)[2:]}) == list(range(0, 12))
    header = dump_lines(second)[0]
    assert (header["step"], header["first"], header["last"]) == (20, 12, 23)  # only what the new ring holds
    assert new.recorder.written == [second]


def test_a_dump_waiting_at_a_reload_is_written_once_by_the_new_attachment(workdir: Path) -> None:
    """The alert at 10 waits for its after: 5 steps; the reload after step 11 leaves the capture alone: no
    file at the reload, one at step 15, written by the new attachment, the same as without a reload but its
    times, with the alert record of step 10."""
    first = reload_policy(workdir, after=5)
    with first.attach(model := tiny(), registry=CollectorRegistry(), rank=0):
        run(model, 24, {10})
    (reference,) = dump_files(workdir)
    reference = reference.rename(workdir / "reference.jsonl")

    then = reload_policy(workdir, "edited.yaml", lambda text: text.replace("abs_max > 1e9", "abs_max > 1e8"), after=5)
    files_at: dict[int, list[str]] = {}

    def each(step: int, attached: Any) -> None:
        files_at[step] = [f.name for f in dump_files(workdir)]

    old, new = reloading_run(tiny(), reload_policy(workdir, after=5), then, 12, 24, {10}, each=each)
    assert files_at[12] == files_at[14] == []  # not at the reload's detach, not before step 15 is kept
    assert files_at[15] == ["rec-layers.step00000010.rank0.jsonl"]
    (file,) = dump_files(workdir)
    assert old.recorder.written == [] and new.recorder.written == [file]
    header, alert = dump_lines(file)[:2]
    assert (header["step"], header["first"], header["last"]) == (10, 0, 15)
    assert alert["event"] == "alert" and alert["step"] == 10 and alert["rule"] == "guard"
    assert dump_lines(file, timeless=True) == dump_lines(reference, timeless=True)


class _Scaled(torch.nn.Module):
    """No Linear: the capture rule binds nothing here (its rule has no rule state)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_a_held_dump_whose_rule_binds_nothing_after_the_reload_is_written_at_its_next_step(workdir: Path) -> None:
    """`carry_history` driven by hand: the dump of the alert at 10 (after: 5) is held at the reload after step
    11, but the new attachment (on a model without Linear layers) has no rule state for the capture: the dump is
    not lost, it is written once, at the new attachment's first step, with the steps the old ring held."""
    policies = reload_policy(workdir, after=5)
    old = policies.attach(model := tiny(), registry=CollectorRegistry(), rank=0)
    try:
        run(model, 12, {10})
    finally:
        old.hold_recorder(policies.policies)
        old.remove()
    assert dump_files(workdir) == []  # held: not written at the detach
    other = _Scaled()
    new = policies.attach(other, registry=CollectorRegistry(), rank=0, start_step=12)
    try:
        new.carry_history(old)
        assert ("rec", "layers") not in new._cycle.rules
        run(other, 1, set())
        (file,) = dump_files(workdir)
        assert new.recorder.written == [file]
        run(other, 3, set())
    finally:
        new.remove()
    assert dump_files(workdir) == [file]  # once
    header = dump_lines(file)[0]
    assert (header["step"], header["first"], header["last"]) == (10, 0, 11)
    assert sorted({r["step"] for r in dump_lines(file)[2:]}) == list(range(0, 12))


def test_max_dumps_holds_across_a_reload(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """maxDumps: 1, one dump before the reload: the one after it is not written, said once, and the count of
    those not written is said once, at the end (by the new attachment, not at the reload)."""
    then = reload_policy(workdir, "edited.yaml", lambda text: text.replace("abs_max > 1e9", "abs_max > 1e8"),
                         dumps=1, after=0)
    said_at: dict[int, int] = {}

    def each(step: int, attached: Any) -> None:
        said_at[step] = len([r for r in caplog.records if "not written" in r.getMessage()])

    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        old, new = reloading_run(tiny(), reload_policy(workdir, dumps=1, after=0), then, 12, 24, {5, 16}, each=each)
    assert [f.name for f in dump_files(workdir)] == ["rec-layers.step00000005.rank0.jsonl"]
    said = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert said_at[15] == 0 and said_at[16] == 1 and len(said) == 2, said
    assert "the dump of step 16" in said[0] and "spec.limits.maxDumps=1 reached" in said[0]
    assert "1 dump(s) not written on rank 0" in said[1] and "1 written" in said[1]


def test_a_carried_ring_is_bounded_by_the_new_share(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """maxRingBytes holds 20 steps of the one ring; the reload adds a second capture with keep, so each ring's
    share is half: the carried ring keeps its newest steps within the new share (counted), said once."""
    per_step = 2 * 3 * VALUE_BYTES
    budget = 20 * per_step + 2 * VALUE_BYTES
    second = """\
    - name: second
      match: {types: [Linear]}
      trigger: {at: step}
      target: weight
      actions:
        - capture: {stats: [l2_norm], keep: {steps: 20}}
"""
    then = reload_policy(workdir, "edited.yaml", lambda text: text + second, ring_bytes=budget, log="")
    seen: dict[int, tuple[list[int], int]] = {}

    def each(step: int, attached: Any) -> None:
        ring = attached.recorder.rings[(("rec", "layers"), 0)]
        seen[step] = ([s.step for s in ring.steps], ring.bytes)
        counted = sum(VALUE_BYTES * len(s.values) + (0 if s.shared else VALUE_BYTES * len(s.groups))
                      for s in ring.steps)
        assert ring.bytes == counted <= ring.budget

    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        old, new = reloading_run(tiny(), reload_policy(workdir, ring_bytes=budget, log=""), then, 20, 24, set(),
                                 each=each)
    assert seen[19] == (list(range(0, 20)), budget)
    share = budget // 2
    fits = (share - 2 * VALUE_BYTES) // per_step
    assert fits == 9
    assert seen[20] == (list(range(12, 21)), fits * per_step + 2 * VALUE_BYTES)  # re-bounded at the reload
    assert seen[23] == (list(range(15, 24)), fits * per_step + 2 * VALUE_BYTES)
    said = [r.getMessage() for r in caplog.records if "keeps fewer than keep.steps=20" in r.getMessage()
            and "rec/layers" in r.getMessage()]
    assert len(said) == 1 and f"may hold {share} bytes" in said[0]


def ranks_reload_dump(rank: int, folder: str, first: str, then: str) -> dict[str, Any]:
    """DDP `tiny` on 2 ranks under `apply`'s reload path (`Discovery`): rank 0 is handed the edited policy
    before step 8, rank 1 before step 9 (their watchers look on their own clocks); rank 1's loss spikes at 9 and
    13 (the guard sees the job's loss: it fires on both ranks). Returns the dumps, the revision each step ran,
    and the L2 norm of each Linear's gradient the rank read itself."""
    from hookpolicy.apply.discovery import Discovery

    edited = Path(folder) / "then.yaml"
    if rank == 0:
        edited.write_text(then)  # before `ddp_rank`'s barrier
    policies, model, opt, gen = ddp_rank(rank, folder, first, 1e-3)
    discovery = Discovery(policies, registry=CollectorRegistry(), rank=rank)
    discovery.install()
    revisions: list[str] = []
    norms: dict[str, float] = {}
    try:
        for step in range(20):
            if step == 8 + rank:
                discovery.swaps.request(hookpolicy.load(edited))
            loss = model(torch.randn(6, 4, generator=gen)).pow(2).mean()
            if rank == 1 and step in (9, 13):
                loss = loss + 1000.0
            loss.backward()
            for name, m in model.module.named_modules():
                if isinstance(m, torch.nn.Linear):
                    grad = torch.cat([p.grad.reshape(-1) for p in m.parameters()])  # type: ignore[union-attr]
                    norms[f"{step} {name}"] = torch.linalg.vector_norm(grad.double()).item()
            opt.step()
            opt.zero_grad()
            (governed,) = discovery.governed
            revisions.append(governed.attached.policies[0].revision)
    finally:
        discovery.remove()
    files = sorted((Path(folder) / "dumps").glob(f"*.rank{rank}.jsonl"))
    return {"files": [p.name for p in files], "revisions": revisions, "norms": norms,
            "lines": [[json.loads(line) for line in p.read_text().splitlines()] for p in files]}


def test_two_ranks_reloaded_at_one_step_carry_their_rings_and_dump_at_the_same_step(
        tmp_path: Path, free_port: int) -> None:
    """Both ranks swap at the one agreed step (10) though they were handed the edit at 8 and 9; the dump of the
    alert at 9 (after: 3) waits across the reload and is written once with steps 4..12, the one at 13 holds
    8..16, half of it kept before the reload, on both ranks; the ranks' rings agree bit for bit (DDP's gradients
    are one), and every L2 norm is the one each rank read of its gradients."""
    text = POLICY + UNRELATED
    kw = dict(steps=20, before=5, after=3, dumps=10, dump_bytes=1 << 26, ring_bytes=1 << 28, export="false", log="")
    first = text.format(**kw)
    then = first.replace("abs_max > 1e9", "abs_max > 1e8")
    zero, one = spawn(ranks_reload_dump, tmp_path, free_port, str(tmp_path), first, then)
    assert zero["revisions"] == one["revisions"]
    old, new = zero["revisions"][0], zero["revisions"][-1]
    assert old != new and zero["revisions"] == [old] * 10 + [new] * 10  # steps 0..9 the old, 10.. the new
    for ranked, rank in ((zero, 0), (one, 1)):
        assert ranked["files"] == [f"rec-layers.step{s:08d}.rank{rank}.jsonl" for s in (9, 13)]
        for lines, (step, window) in zip(ranked["lines"], ((9, range(4, 13)), (13, range(8, 17)))):
            header, records = lines[0], [r for r in lines[1:] if r.get("event") != "alert"]
            assert (header["step"], header["first"], header["last"], header["rank"]) == (step, window[0],
                                                                                       window[-1], rank)
            assert sorted({r["step"] for r in records}) == list(window) and len(records) == 2 * len(window)
            for r in records:
                assert r["stats"]["l2_norm"] == pytest.approx(ranked["norms"][f"{r['step']} {r['module']}"],
                                                              rel=1e-6)
    for a, b in zip(zero["lines"], one["lines"]):
        assert [(r["step"], r["module"], r["stats"]) for r in a[1:] if r.get("event") != "alert"] == \
            [(r["step"], r["module"], r["stats"]) for r in b[1:] if r.get("event") != "alert"]


#: A training script for `apply`: `tiny`'s shape, SGD, a step every `--sleep` seconds, one line per step; its
#: loss is 1000 times larger at the first step at which SPIKE exists, and it ends once STOP exists
SPIKING = """\
import argparse, os, sys, time
import torch
p = argparse.ArgumentParser()
p.add_argument("--spike-file")
p.add_argument("--stop-file")
args = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
spiked = False
for step in range(100000):
    spike = not spiked and os.path.exists(args.spike_file)
    spiked = spiked or spike
    loss = model(torch.randn(6, 4, generator=gen)).pow(2).mean() * (1000.0 if spike else 1.0) + (100.0 if spike else 1.0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} spike {int(spike)}", flush=True)
    if os.path.exists(args.stop_file):
        break
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_apply_watch_carries_the_ring_across_an_edit_of_another_rule(apply: Any, tmp_path: Path) -> None:
    """As a user runs it: `hookpolicy apply --watch` on a script; the unrelated rule's threshold is edited in
    the file while it trains; once the reload went in (its line on stderr, at step R), the loss spikes at a step
    S: the dump of S holds its 30 steps before, across R, and each record is the capture log's (which the old
    and the new attachment both wrote), field for field."""
    out, script = tmp_path / "out", tmp_path / "spiking.py"
    out.mkdir()
    script.write_text(SPIKING)
    spike, stop = tmp_path / "spike", tmp_path / "stop"
    text = (POLICY + UNRELATED).format(steps=40, before=30, after=3, dumps=10, dump_bytes=1 << 26,
                                       ring_bytes=1 << 28, export="false", log="log: {path: full.jsonl}")
    policy_file = tmp_path / "guard.yaml"
    policy_file.write_text(text)
    run = apply(str(policy_file), "--watch", "--", sys.executable, str(script), "--spike-file", str(spike),
                "--stop-file", str(stop), env=child_env(HOOKPOLICY_WATCH_INTERVAL="0.2", HOOKPOLICY_OUTPUT_DIR=str(out)))

    def wait(pattern: str, stream: str) -> re.Match[str]:
        deadline = time.monotonic() + 120
        while True:
            found = re.search(pattern, run.stdout if stream == "out" else run.stderr, re.M)
            if found is not None:
                return found
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr
            time.sleep(0.05)

    wait(r"^step 5 ", "out")
    policy_file.write_text(text.replace("abs_max > 1e9", "abs_max > 1e8"))
    reloaded = int(wait(r"reloaded policies at step (\d+) ", "err")[1])
    spike.touch()
    spiked = int(wait(r"^step (\d+) spike 1$", "out")[1])
    wait(rf"^step {spiked + 5} ", "out")
    stop.touch()
    assert run.wait() == 0, run.stderr
    assert 5 < reloaded < spiked
    (file,) = sorted((out / "dumps").glob("*.jsonl"))
    assert file.name == f"rec-layers.step{spiked:08d}.rank0.jsonl"
    lines = dump_lines(file)
    first = max(0, spiked - 30)
    assert first < reloaded  # the window crosses the reload
    assert (lines[0]["step"], lines[0]["first"], lines[0]["last"]) == (spiked, first, spiked + 3)
    records = [r for r in lines[1:] if r.get("event") != "alert"]
    log = {(r["step"], r["module"]): r for r in json_lines(out / "full.jsonl")}
    assert sorted({r["step"] for r in records}) == list(range(first, spiked + 4))
    assert records == [log[(r["step"], r["module"])] for r in records]
    assert run.stderr.count("reloaded policies") == 1
