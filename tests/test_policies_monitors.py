"""The library's monitoring policies (`policies/`): gradient-monitor, activation-sparsity,
feature-extraction and observe, each against the test's own hooks and PyTorch's statistics.

The model (helpers.models' `GPT`) uses the conventional GPT-2/nanoGPT names, so the library's
patterns are tested against the names they are written for.
"""

from __future__ import annotations

import collections
import copy
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from helpers.outputs import json_lines
from helpers.models import batch, make_model, train_step
from helpers.library import alert_records, counter, load, load_text, modules_named, POLICIES, same_tensors, snapshot, stat


@pytest.fixture
def grad_outputs() -> Iterator[Callable[[nn.Module, type], dict[str, list[torch.Tensor]]]]:
    """Records the gradient w.r.t. the output of every module of a type, with tensor hooks."""
    handles: list[Any] = []

    def install(model: nn.Module, kind: type) -> dict[str, list[torch.Tensor]]:
        seen: dict[str, list[torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, kind):
                def hook(mod: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                    if out.requires_grad:
                        out.register_hook(lambda g: seen.setdefault(name, []).append(g.detach().clone()))
                handles.append(module.register_forward_hook(hook))
        return seen

    yield install
    for h in handles:
        h.remove()


def test_gradient_monitor_matches_torch_statistics(workdir: Path, grad_outputs: Any) -> None:
    model = make_model()
    seen = grad_outputs(model, nn.Linear)
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with load("gradient-monitor.yaml").attach(model, registry=reg, rank=0):
        train_step(model, opt, 0)  # step 0: evaluated (every: 10)
        assert set(seen) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name, (g,) in seen.items():
            g = g.double()
            expected = {
                "l2_norm": torch.linalg.vector_norm(g), "mean": g.mean(), "std": g.std(), "max": g.max(),
                "min": g.min(), "zero_fraction": (g == 0).double().mean(), "nonfinite": (~torch.isfinite(g)).sum(),
            }
            for key, value in expected.items():
                got = stat(reg, f"hookpolicy_grad_output_{key}", "gradient-monitor", "layer-grads", name)
                assert got == pytest.approx(value.item(), rel=1e-4, abs=1e-9), (name, key)
        assert counter(reg, "hookpolicy_alerts_total", policy="gradient-monitor", rule="layer-grads", severity="warning") == 0


def test_gradient_monitor_alerts(workdir: Path) -> None:
    labels = {"policy": "gradient-monitor", "rule": "layer-grads"}
    policies = load("gradient-monitor.yaml")

    # large norm: a loss scaled by 1e4 gives layer gradients far above 10
    model, reg = make_model(), CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 0, loss_scale=1e4)
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="warning") >= 1
        assert counter(reg, "hookpolicy_alert_firing", **labels, severity="warning") == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 0

    # NaN: one poisoned weight makes every gradient downstream of it non-finite
    model, reg = make_model(), CollectorRegistry()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    with policies.attach(model, registry=reg, rank=0):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 0)
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") >= 1
        assert stat(reg, "hookpolicy_grad_output_nonfinite", **labels, module="lm_head") > 0

    # dead neurons: a very negative bias silences every ReLU of block 0; the info alert
    # needs 3 consecutive evaluations (steps 0, 10, 20)
    model, reg = make_model(), CollectorRegistry()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.bias.fill_(-1e3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with policies.attach(model, registry=reg, rank=0):
        for i in range(21):
            train_step(model, opt, i)
            if i == 10:
                assert counter(reg, "hookpolicy_alert_firing", **labels, severity="info") == 0
        assert stat(reg, "hookpolicy_grad_output_zero_fraction", **labels, module="transformer.h.0.mlp.c_fc") == 1.0
        assert counter(reg, "hookpolicy_alert_firing", **labels, severity="info") == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="info") == 1  # only c_fc of block 0


def test_activation_sparsity_matches_reference(workdir: Path) -> None:
    model = make_model()
    acts = modules_named(model, r"transformer\.h\.\d+\.mlp\.act", nn.ReLU)
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n, m in acts]
    reg = CollectorRegistry()
    labels = {"policy": "activation-sparsity", "rule": "mlp-activations"}
    try:
        with load("activation-sparsity.yaml").attach(model, registry=reg, rank=0):
            opt = torch.optim.SGD(model.parameters(), lr=1e-1)
            for step in range(11):  # every: 10 - steps 0 and 10 measured, the others keep step 0's values
                train_step(model, opt, step)
                if step % 10 == 0:
                    measured = dict(outputs)
                for name, out in measured.items():
                    assert stat(reg, "hookpolicy_output_zero_fraction", **labels, module=name) == pytest.approx(
                        (out == 0).double().mean().item()), (step, name)
                    assert stat(reg, "hookpolicy_output_mean", **labels, module=name) == pytest.approx(out.double().mean().item(), rel=1e-5)
                    assert stat(reg, "hookpolicy_output_rms", **labels, module=name) == pytest.approx(
                        out.double().pow(2).mean().sqrt().item(), rel=1e-5)
                    assert stat(reg, "hookpolicy_output_abs_max", **labels, module=name) == out.abs().max().item()
                    assert 0.2 < (out == 0).double().mean().item() < 0.8  # a ReLU at init: about half silent
                assert step % 10 == 0 or not all(torch.equal(measured[n], o) for n, o in outputs.items())

        # phase: any - the same policy measures an evaluation set, read back per batch
        model.eval()
        reg = CollectorRegistry()
        with load("activation-sparsity.yaml").attach(model, registry=reg, rank=0), torch.no_grad():
            for i in range(2):
                model(batch(50 + i)[0])
                for name, out in outputs.items():
                    assert stat(reg, "hookpolicy_output_zero_fraction", **labels, module=name) == pytest.approx(
                        (out == 0).double().mean().item())
    finally:
        for h in handles:
            h.remove()


def test_feature_extraction_writes_loadable_tensors(workdir: Path) -> None:
    model = make_model()
    names = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n in names]
    policy = load("feature-extraction.yaml")
    (capture,) = [a for a in policy.policies[0].rules[0].actions if getattr(a, "tensors", None)]
    assert capture.tensors is not None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with policy.attach(model, registry=CollectorRegistry(), rank=0):
            train_step(model, opt, 0)  # step 0 is evaluated (every: 100)
            at_step0 = dict(outputs)
            for i in range(1, 4):
                train_step(model, opt, i)
    finally:
        for h in handles:
            h.remove()
    files = sorted((workdir / capture.tensors.dir).glob("*.pt"))
    assert 0 < len(files) <= capture.tensors.max_files
    assert sum(f.stat().st_size for f in files) <= capture.tensors.max_bytes
    assert [f.name for f in files] == [f"step00000000-{n}-output.pt" for n in names]
    for f, name in zip(files, names):
        assert torch.equal(torch.load(f), at_step0[name])


def test_feature_extraction_stays_within_max_files(workdir: Path, tmp_path: Path) -> None:
    text = (POLICIES / "feature-extraction.yaml").read_text()
    text = text.replace("every: 100", "every: 1").replace("max_files: 200", "max_files: 4")
    policy = load_text(tmp_path, text)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with policy.attach(model, registry=CollectorRegistry(), rank=0):
        for i in range(4):  # 3 modules x 4 steps would be 12 files
            train_step(model, opt, i)
    files = list((workdir / "features").glob("*.pt"))
    assert len(files) == 4
    for f in files:
        assert torch.load(f).shape[-1] == 32


def test_feature_budget_spent_is_not_an_error(workdir: Path, tmp_path: Path) -> None:
    text = (POLICIES / "feature-extraction.yaml").read_text().replace("every: 100", "every: 1").replace("max_files: 200", "max_files: 4")
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with load_text(tmp_path, text).attach(model, registry=reg, rank=0):
        for i in range(5):
            train_step(model, opt, i)
        # statistics keep flowing after the file budget is spent
        assert stat(reg, "hookpolicy_output_l2_norm", "feature-extraction", "save-features", "transformer.ln_f") > 0
        assert counter(reg, "hookpolicy_hook_errors_total", policy="feature-extraction", rule="save-features") == 0


def test_observe_logs_what_its_header_says(workdir: Path) -> None:
    """observe.yaml: the loss every step, each Linear's gradient l2 norm (weight and bias) every
    step, output rms and zero fraction every 10th step, all in runs/observe.jsonl; nothing changed."""
    import examples.charlm

    model = examples.charlm.build_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n, m in linears.items()]
    losses, norms, activations = [], [], {}
    data = examples.charlm.encode()
    with load("observe.yaml").attach(model, rank=0):
        for step in range(12):
            x, y = examples.charlm.batch(data, torch.arange(step, step + 64, 8), 32)
            for m, o in ((model, opt), (reference, ref_opt)):
                loss = m(x, y)[1]
                o.zero_grad(set_to_none=True)
                loss.backward()
                if m is model:
                    losses.append(loss.item())
                    norms.append({n: torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in mod.parameters(
                        recurse=False)])).item() for n, mod in linears.items()})
                    if step % 10 == 0:
                        activations[step] = {n: (o_.pow(2).mean().sqrt().item(), (o_ == 0).float().mean().item())
                                             for n, o_ in outputs.items()}
                o.step()
    for h in handles:
        h.remove()
    records = json_lines(workdir / "runs" / "observe.jsonl")
    by = collections.defaultdict(dict)
    for r in records:
        by[r["rule"]][(r["step"], r["module"])] = r["stats"]
    assert {s: v["mean"] for (s, _), v in by["loss"].items()} == pytest.approx(dict(enumerate(losses)), rel=1e-6)
    assert set(by["grad-norms"]) == {(s, n) for s in range(12) for n in linears}
    for (s, n), v in by["grad-norms"].items():
        assert v["l2_norm"] == pytest.approx(norms[s][n], rel=1e-5)
    assert {s for s, _ in by["layer-outputs"]} == {0, 10}
    for (s, n), v in by["layer-outputs"].items():
        assert (v["rms"], v["zero_fraction"]) == pytest.approx(activations[s][n], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # it only watches


def test_observe_calls_a_nan_or_inf_loss_critical_and_changes_nothing(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """observe.yaml: "A NaN or Inf in the loss is a critical alert. It changes nothing: no clip, no
    skipped step." The script backpropagates `loss + nan` at step 3 and `loss + inf` at step 5 (a
    constant added: the gradients stay the loss's own, finite). The alert records are exactly those
    two steps', critical, and hookpolicy_alerts_total counts them; every step is applied: the
    parameters stay bit for bit those of a twin trained on the same losses without the policy."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    poison = {3: float("nan"), 5: float("inf")}
    reg = CollectorRegistry()
    with load("observe.yaml").attach(model, registry=reg, rank=0):
        for step in range(8):
            for m, o in ((model, opt), (twin, twin_opt)):
                loss = m(*batch(step))[1]
                assert loss is not None
                (loss + poison.get(step, 0.0)).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            assert same_tensors(snapshot(model), snapshot(twin)), step
    alerts = alert_records(tmp_path / "alerts.jsonl")
    assert [(a["rule"], a["step"], a["severity"], a["outcome"]) for a in alerts] == [
        ("loss", 3, "critical", "logged"), ("loss", 5, "critical", "logged")]
    assert [a["message"] for a in alerts] == ["the loss is not finite at step 3", "the loss is not finite at step 5"]
    assert counter(reg, "hookpolicy_alerts_total", policy="observe", rule="loss", severity="critical") == 2
    assert counter(reg, "hookpolicy_skipped_steps_total", policy="observe", rule="loss") == 0


def test_gradient_monitor_combines_micro_batches_every_10th_step_and_only_watches(
        workdir: Path, grad_outputs: Any) -> None:
    """gradient-monitor.yaml: "every 10th step, on every backward pass, reads the gradient with
    respect to the output of each Linear (micro-batches of a step are combined)" and "It only
    watches: nothing is clipped or skipped". Two micro-batches a step: the statistics of steps 0 and
    10 are those of both micro-batches' grad_output together (the test's own tensor hooks), steps
    1-9 leave them as they were; a loss scaled by 1e4 at step 10 fires the warning alert, and the
    parameters stay bit for bit those of a twin trained without the policy."""
    model = make_model()
    twin = copy.deepcopy(model)
    seen = grad_outputs(model, nn.Linear)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    reg = CollectorRegistry()
    labels = {"policy": "gradient-monitor", "rule": "layer-grads"}
    expected: dict[str, float] = {}
    with load("gradient-monitor.yaml").attach(model, registry=reg, rank=0):
        for step in range(11):
            seen.clear()
            for micro in range(2):
                for m in (model, twin):
                    loss = m(*batch(2 * step + micro))[1]
                    assert loss is not None
                    (loss * (1e4 if step == 10 else 1.0) / 2).backward()
            for m, o in ((model, opt), (twin, twin_opt)):
                o.step()
                o.zero_grad(set_to_none=True)
            assert same_tensors(snapshot(model), snapshot(twin)), step
            if step % 10 == 0:
                assert all(len(gs) == 2 for gs in seen.values())
                expected = {name: torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs]).double()).item()
                            for name, gs in seen.items()}
                for name, gs in seen.items():
                    g = torch.cat([g.flatten() for g in gs]).double()
                    assert stat(reg, "hookpolicy_grad_output_std", **labels, module=name) == pytest.approx(g.std().item(), rel=1e-4)
                    assert stat(reg, "hookpolicy_grad_output_max", **labels, module=name) == pytest.approx(g.max().item(), rel=1e-6)
            for name, norm in expected.items():
                assert stat(reg, "hookpolicy_grad_output_l2_norm", **labels, module=name) == pytest.approx(norm, rel=1e-5), step
            fired = counter(reg, "hookpolicy_alerts_total", **labels, severity="warning")
            assert fired == (sum(norm > 10 for norm in expected.values()) if step == 10 else 0), step
    assert min(expected.values()) > 10  # the scaled step's norms: every layer's warning fired, nothing was clipped


def test_feature_extraction_summary_and_its_byte_budget(workdir: Path, tmp_path: Path) -> None:
    """feature-extraction.yaml: "Saving stops at max_files files or max_bytes bytes, whichever comes
    first. The shape-free summary (l2_norm, mean, std) of the same outputs is exported". With a
    byte budget of two and a half files (a file's size: the test's own torch.save) two files are
    written, the rest is not; the summary keeps flowing and equals torch's on the outputs the test's
    own hooks saw."""
    import io

    model = make_model()
    names = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n in names]
    size = io.BytesIO()
    torch.save(torch.zeros(4, 16, 32), size)
    budget = int(2.5 * len(size.getvalue()))
    text = (POLICIES / "feature-extraction.yaml").read_text().replace("every: 100", "every: 1")
    text = text.replace("max_bytes: 2147483648", f"max_bytes: {budget}")
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with load_text(tmp_path, text).attach(model, registry=reg, rank=0):
            for step in range(3):
                train_step(model, opt, step)
                for n, out in outputs.items():
                    got = {k: stat(reg, f"hookpolicy_output_{k}", "feature-extraction", "save-features", n)
                           for k in ("l2_norm", "mean", "std")}
                    o = out.double()
                    assert got == pytest.approx({"l2_norm": torch.linalg.vector_norm(o).item(), "mean": o.mean().item(),
                                                 "std": o.std().item()}, rel=1e-5, abs=1e-6), (step, n)  # ln_f's mean: about 0
    finally:
        for h in handles:
            h.remove()
    files = sorted((workdir / "features").glob("*.pt"))
    assert [f.name for f in files] == ["step00000000-transformer.h.0-output.pt", "step00000000-transformer.h.1-output.pt"]
    assert sum(f.stat().st_size for f in files) <= budget


def test_feature_extraction_keeps_every_forward_of_a_step(workdir: Path) -> None:
    """feature-extraction.yaml: "each evaluated forward writes one file per matched module (so gradient
    accumulation writes one per micro-batch)" and "collecting embeddings from an evaluation run
    (phase: any captures under model.eval() too)". An evaluation loop of three batches before the
    first step (an evaluation forward does not advance the step), then two micro-batches of step 0:
    every forward's output is in a file of its own, equal to what the test's own hook saw, numbered
    in order (.pt, .2.pt, ... .5.pt); none overwrites another (they all did before)."""
    model = make_model()
    seen: list[torch.Tensor] = []
    handle = model.transformer.ln_f.register_forward_hook(lambda mod, a, out: seen.append(out.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with load("feature-extraction.yaml").attach(model, registry=CollectorRegistry(), rank=0):
            model.eval()
            with torch.no_grad():
                for i in range(3):
                    model(batch(10 + i)[0])
            model.train()
            for micro in range(2):
                loss = model(*batch(micro))[1]
                assert loss is not None
                loss.backward()
            opt.step()
    finally:
        handle.remove()
    assert len(seen) == 5
    names = ["step00000000-transformer.ln_f-output.pt"] + [
        f"step00000000-transformer.ln_f-output.{n}.pt" for n in range(2, 6)]
    assert sorted(f.name for f in (workdir / "features").glob("*ln_f*")) == sorted(names)
    for name, out in zip(names, seen):
        assert torch.equal(torch.load(workdir / "features" / name), out), name
