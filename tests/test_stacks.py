"""The compatibility matrix: real training stacks under `hookpolicy apply`, checked against their own numbers.

Each test runs an unmodified training script of one stack (tests/stacks/) under
tests/stacks/guard.yaml (a NaN guard that skips the step, a `per: rule` clip to 0.5,
per-layer gradient norms) and checks, against what hookpolicy did not compute:

- steps: `hookpolicy_steps_total` equals the framework's own count (Lightning's
  `global_step`, the Trainer's `state.global_step`, the loop's count);
- skip: the step with a NaN loss left the parameters and the optimizer state bit for bit
  as they were, every other step changed them, and `hookpolicy_skipped_steps_total` is 1;
- clip: the norm of the gradients the optimizer applied, read by the test's own
  optimizer step pre-hook (after the closure, for `step(closure)`), is at most 0.5,
  and equals min(the exported pre-clip norm, 0.5) at the last step;
- labels: the modules and the `model` label are the same whatever the script's flags.

docs/compatibility.md is the table these tests back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.utils.hooks import RemovableHandle

import hookpolicy
from helpers import REPO
from helpers.outputs import metric
from hookpolicy.export.collector import store_for

STACKS = REPO / "tests" / "stacks"
GUARD = STACKS / "guard.yaml"
MAX_NORM = 0.5

Sample = tuple[str, dict[str, str], float]


@dataclass
class Stack:
    """What one stack script measured (probe.py) and what hookpolicy exported, at its end."""

    out: dict[str, Any]
    stderr: str

    @property
    def samples(self) -> list[Sample]:
        text = self.out["metrics"]
        return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
        assert len(found) == 1, f"{name}{labels}: {found}\n{self.stderr}"
        return found[0]

    def labels(self, name: str, key: str, **labels: str) -> set[str]:
        return {lab[key] for n, lab, _ in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())}

    def probe(self, name: str = "optimizer") -> dict[str, Any]:
        return self.out["probes"][name]  # type: ignore[no-any-return]


def run_stack(tmp_path: Path, free_port: int, script: str, *args: str, policy: Path = GUARD,
              timeout: float = 240) -> Stack:
    out = tmp_path / f"{Path(script).stem}-{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STACK_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "default"}
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--metrics-port", str(free_port), "--",
         sys.executable, str(STACKS / script), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return Stack(json.loads(out.read_text()), done.stderr)


def check_guarded(stack: Stack, nan_at: Optional[int], model: str, probe: str = "optimizer") -> None:
    """Steps, skip and clip as the module docstring says, for one model stepped by one optimizer."""
    seen = stack.probe(probe)
    assert stack.value("hookpolicy_steps_total", model=model) == stack.out["framework_steps"] == len(seen["norms"])
    changed = [i for i, same in enumerate(seen["unchanged"]) if not same]
    expected = [i for i in range(len(seen["norms"])) if i != nan_at]
    assert changed == expected, stack.stderr
    skipped = stack.value("hookpolicy_skipped_steps_total", model=model, rule="nan")
    assert skipped == (0 if nan_at is None else 1)
    applied = [n for i, n in enumerate(seen["norms"]) if i != nan_at]
    assert applied and all(n is not None and n <= MAX_NORM * (1 + 1e-5) for n in applied), applied
    assert any(n > MAX_NORM * 0.99 for n in applied)  # the clip had work to do
    exported = stack.value("hookpolicy_grad_l2_norm", model=model, rule="clip")
    assert applied[-1] == pytest.approx(min(exported, MAX_NORM), rel=1e-4)
    assert "Traceback" not in stack.stderr, stack.stderr


# -- in process: counters and model labels, with the Python API ----------------------------

HEADER = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
"""

COUNTING = HEADER + """\
    - name: nan
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: module, then: skip_step}
    - name: outputs
      match: {types: [Linear]}
      trigger: {at: forward}
      actions:
        - capture: {stats: [rms]}
"""


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = metric(registry, name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def test_counters_count_what_their_names_say(tmp_path: Path) -> None:
    """One NaN step, 4 micro-batches a step, 3 Linears: 1 skipped step, 3 firings, actions once per step and module."""
    (tmp_path / "p.yaml").write_text(COUNTING)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    with hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=registry) as attached:
        for step in range(3):
            for _ in range(4):
                x = torch.randn(5, 4) * (float("nan") if step == 1 else 1.0)
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert _metric(registry, "hookpolicy_steps_total") == 3
    assert _metric(registry, "hookpolicy_skipped_steps_total", rule="nan") == 1
    assert _metric(registry, "hookpolicy_alerts_total", rule="nan") == 3  # one firing per module
    modules = {rule: len([b for b in attached.plan.bindings if b.rule.name == rule]) for rule in ("nan", "outputs")}
    assert modules == {"nan": 3, "outputs": 3}
    assert _metric(registry, "hookpolicy_actions_total", rule="nan", action="alert") == 3 * 3
    assert _metric(registry, "hookpolicy_actions_total", rule="outputs", action="capture") == 3 * 3  # not x 4


def test_every_family_says_its_unit() -> None:
    """The HELP text of each engine family, as Prometheus shows it: what one unit of it is."""
    registry = CollectorRegistry()
    text = generate_latest(registry).decode()
    assert text == ""  # nothing registered yet
    store_for(registry, 0)
    helps = {line.split()[2]: line.split(" ", 3)[3] for line in generate_latest(registry).decode().splitlines()
             if line.startswith("# HELP")}
    assert helps == {
        "hookpolicy_steps_total": "Optimizer steps of the model evaluated by hookpolicy: one per optimizer step() "
        "(several optimizers after one backward pass, or the micro-batches of one step, make one).",
        "hookpolicy_last_step_timestamp_seconds": "Unix time in seconds of the last step of the model hookpolicy evaluated.",
        "hookpolicy_actions_total": "Actions run: one per step and binding (a rule on one module) on which the action "
        "ran, however many calls or micro-batches the step had; audit actions change nothing.",
        "hookpolicy_alerts_total": "Alert firings: one per evaluation (once a step) and group of the alert's per "
        "(rule, module or tensor) on which it fired.",
        "hookpolicy_alert_firing": "1 while an alert's condition holds (after its for: count), else 0.",
        "hookpolicy_skipped_steps_total": "Optimizer steps skipped by a rule's alert: one per skipped step, however "
        "many modules fired.",
        "hookpolicy_clipped_total": "Groups (per: tensor, module or rule) a norm clip scaled down, or units a "
        "unit-wise clip did: one per group or unit and clip execution (a call of the hooked module, or a step for "
        "trigger.at: step); in audit mode the ones it would have clipped, nothing changed.",
        "hookpolicy_hook_errors_total": "Errors raised inside hookpolicy's hooks: one per error.",
        "hookpolicy_hook_seconds_total": "Seconds spent inside hookpolicy's hooks and read-back.",
        "hookpolicy_policy_info": "The applied policies: revision is the file's content hash.",
        "hookpolicy_config_last_reload_successful": "1 if the last policy (re)load succeeded, else 0.",
        "hookpolicy_series_dropped_total": "Statistic series not exported because spec.limits.maxSeries or "
        "maxJobSeries was reached: one per series.",
        "hookpolicy_rewinds_total": "Rewinds to an in-memory snapshot by a rule's then: rewind alert: one per rewind "
        "(the steps since the snapshot are dropped).",
        "hookpolicy_agreement_wait_seconds_total": "Seconds this rank waited in the step's agreement, hookpolicy's one "
        "collective a step in a process group, from entering it to its result: the ranks that arrive first wait for "
        "the last, so a straggler waits least and its peers about its delay.",
        "hookpolicy_run_info": "1, labelled with this run's identity (HOOKPOLICY_RUN_ID): a retry is a new run, which "
        "the alerting rules join to tell its counters from the previous attempt's.",
    }


def test_two_models_of_one_class_get_their_own_label(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(COUNTING)
    policies = hookpolicy.load(tmp_path / "p.yaml")
    registry = CollectorRegistry()
    first, second = nn.Sequential(nn.Linear(4, 1)), nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        second[0].weight.mul_(100)
    with policies.attach(first, registry=registry), policies.attach(second, registry=registry):
        for model, steps in ((first, 2), (second, 3)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(steps):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert _metric(registry, "hookpolicy_steps_total", model="Sequential") == 2
        assert _metric(registry, "hookpolicy_steps_total", model="Sequential#2") == 3
        rms = {m: _metric(registry, "hookpolicy_output_rms", model=m, module="0") for m in ("Sequential", "Sequential#2")}
        assert rms["Sequential#2"] > 10 * rms["Sequential"]  # neither overwrote the other


CLIP_AND_GUARD = HEADER + """\
    - name: nan
      priority: 0
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: rule, then: skip_step}
    - name: clip
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - clip: {max_norm: 0.5, per: rule}
"""


def _closure_run(tmp_path: Path, make_opt: Any, nan_at: int = -1, hookpolicy_on: bool = True,
                 clip_in_closure: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    """Five `opt.step(closure)` steps of a small MLP; returns the model, optimizer and a copy of both per step."""
    (tmp_path / "p.yaml").write_text(CLIP_AND_GUARD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = make_opt(model.parameters())
    x = torch.randn(16, 4)
    copies = []

    def train() -> None:
        for step in range(5):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = model(x).pow(2).mean() * (float("nan") if step == nan_at else 10.0)
                loss.backward()
                if clip_in_closure:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                return loss
            copies.append(_state(model, opt))
            opt.step(closure)
        copies.append(_state(model, opt))

    if hookpolicy_on:
        with hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=CollectorRegistry()):
            train()
    else:
        train()
    return model, opt, copies


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    def copy(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else (v.copy() if isinstance(v, list) else v)
    return ([p.detach().clone() for p in model.parameters()],
            [{k: copy(v) for k, v in opt.state[p].items()} for p in model.parameters() if p in opt.state])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1), id="sgd"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.01), id="adam"),
    pytest.param(lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=1), id="lbfgs"),
])
def test_a_closure_step_is_clipped_as_clip_grad_norm_inside_the_closure(tmp_path: Path, make_opt: Any) -> None:
    """The rule acts after the closure's backward: the same parameters as clip_grad_norm_ called inside it."""
    _, _, ours = _closure_run(tmp_path, make_opt)
    _, _, reference = _closure_run(tmp_path, make_opt, hookpolicy_on=False, clip_in_closure=True)
    for got, want in zip(ours, reference):
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got[0], want[0]))


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="sgd-momentum"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.01), id="adam"),
    pytest.param(lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=1), id="lbfgs"),
    pytest.param(lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3), id="lbfgs-iterations"),
])
def test_a_skipped_closure_step_leaves_parameters_and_optimizer_state_bit_identical(
    tmp_path: Path, make_opt: Any,
) -> None:
    model, _, copies = _closure_run(tmp_path, make_opt, nan_at=2)
    same = [_equal(before, after) for before, after in zip(copies, copies[1:])]
    assert same == [False, False, True, False, False]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_halt_inside_a_closure_step_stops_before_the_update(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(CLIP_AND_GUARD.replace("then: skip_step", "then: halt"))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).sum() * float("nan")
        loss.backward()
        return loss

    with hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=CollectorRegistry()):
        with pytest.raises(hookpolicy.Halt):
            opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _guard_run(tmp_path: Path, step: Any, caplog: pytest.LogCaptureFixture, nan_at: int = -1,
               setup: Any = None) -> tuple[nn.Module, CollectorRegistry]:
    """Five steps of a small MLP under CLIP_AND_GUARD, the update done by `step(model, optimizer)`."""
    (tmp_path / "p.yaml").write_text(CLIP_AND_GUARD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if setup is not None:
        setup(model)
    registry = CollectorRegistry()
    with caplog.at_level("WARNING", logger="hookpolicy"), \
            hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=registry):
        for i in range(5):
            loss = model(torch.randn(8, 4)).pow(2).mean() * (float("nan") if i == nan_at else 10.0)
            loss.backward()
            step(model, opt)
            opt.zero_grad()
    return model, registry


def test_an_update_without_step_hooks_is_detected_and_guarded_per_backward_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """`SGD.step.__wrapped__` updates without the hooks `Optimizer.step` fires."""
    model, registry = _guard_run(tmp_path, lambda m, opt: type(opt).step.__wrapped__(opt), caplog, nan_at=3)
    said = [r.getMessage() for r in caplog.records if "without an optimizer step hook" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Sequential: ")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # the NaN step was still skipped
    assert _metric(registry, "hookpolicy_skipped_steps_total", rule="nan") == 1


def test_an_optimizer_stepping_inside_backward_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Per-parameter optimizers stepped from post-accumulate-grad hooks: no step has final gradients."""
    handles: list[RemovableHandle] = []

    def in_backward(model: nn.Module) -> None:
        for p in model.parameters():
            inner = torch.optim.SGD([p], lr=0.1)

            def update(p: torch.Tensor, inner: torch.optim.Optimizer = inner) -> None:
                inner.step()
                inner.zero_grad()
            handles.append(p.register_post_accumulate_grad_hook(update))

    try:
        _, registry = _guard_run(tmp_path, lambda m, opt: None, caplog, setup=in_backward)
    finally:  # p -> its hook -> inner -> p is a cycle through PyTorch's C++ hook list that gc never frees:
        for handle in handles:  # the four optimizers would stay alive for the rest of the process
            handle.remove()
    said = [r.getMessage() for r in caplog.records if "inside the backward pass" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("refused: p/nan, p/clip")
    assert metric(registry, "hookpolicy_actions_total", {"rule": "clip", "action": "clip"}) in (None, 0)  # never ran


def test_gradients_hidden_from_the_step_hooks_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A wrapper that keeps gradients in its own buffers and hands them to the optimizer inside step()."""
    buffers: dict[torch.Tensor, torch.Tensor] = {}

    def keep(p: torch.Tensor) -> None:
        buffers[p], p.grad = p.grad, None

    def give_back(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:  # runs after hookpolicy's
        for p in list(buffers):
            p.grad = buffers.pop(p)

    def offload(model: nn.Module) -> None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(keep)

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if not opt._optimizer_step_pre_hooks:
            opt.register_step_pre_hook(give_back)
        opt.step()

    _guard_run(tmp_path, step, caplog, setup=offload)
    said = [r.getMessage() for r in caplog.records if "has a .grad" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("refused: p/nan, p/clip")


# -- PyTorch Lightning ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    pytest.param([], id="automatic"),
    pytest.param(["--accum", "2", "--clip-val", "1.0", "--optimizer", "adam"], id="accumulate-clip-adam"),
    pytest.param(["--manual"], id="manual"),
])
def test_lightning(tmp_path: Path, free_port: int, flags: list[str]) -> None:
    stack = run_stack(tmp_path, free_port, "lightning_reg.py", "--steps", "8", "--nan-at", "3", *flags)
    check_guarded(stack, nan_at=3, model="Regressor")
    assert stack.out["finite"]
    assert stack.labels("hookpolicy_grad_l2_norm", "module", rule="layers") == {"net.0", "net.2"}
    assert stack.labels("hookpolicy_grad_l2_norm", "model") == {"Regressor"}
    assert "hookpolicy: governing Regressor " in stack.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--in-place"]], ids=["set-to-none", "zeroed-in-place"])
def test_lightning_gan_steps_each_optimizer_on_its_own(tmp_path: Path, free_port: int, flags: list[str]) -> None:
    """Manual optimization with `opt_g, opt_d = self.optimizers()`: every optimizer step is a step, guarded alone.

    The discriminator's NaN loss (global_step 3) skips its step only: the generator's next
    step, with the NaN still on the discriminator's gradients, is taken. The clip at each
    step bounds only that optimizer's gradients, measured on them alone. Also when the
    gradients are zeroed in place (the same `.grad` tensors at every step).
    """
    stack = run_stack(tmp_path, free_port, "lightning_gan.py", "--steps", "8", "--nan-at", "3", *flags)
    generator, discriminator = stack.probe("generator"), stack.probe("discriminator")
    assert stack.value("hookpolicy_steps_total", model="GAN") == stack.out["framework_steps"] == 8
    assert len(generator["norms"]) == len(discriminator["norms"]) == 4, stack.stderr
    assert not any(generator["unchanged"]), stack.stderr
    assert discriminator["unchanged"] == [False, True, False, False], stack.stderr
    assert stack.value("hookpolicy_skipped_steps_total", model="GAN", rule="nan") == 1
    applied = [n for n in generator["norms"] + discriminator["norms"] if n is not None and n == n]
    assert len(applied) == 7 and all(n <= MAX_NORM * (1 + 1e-5) for n in applied), applied
    # the last step is the discriminator's: its pre-clip norm is over its own gradients
    exported = stack.value("hookpolicy_grad_l2_norm", model="GAN", rule="clip")
    assert discriminator["norms"][-1] == pytest.approx(min(exported, MAX_NORM), rel=1e-4)
    assert stack.out["finite"]
    assert "Traceback" not in stack.stderr, stack.stderr


# -- transformers Trainer (accelerate underneath) ------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch, accum, model, layers", [
    pytest.param("gpt2", "2", "GPT2LMHeadModel", {"lm_head"}, id="gpt2-accumulate"),
    pytest.param("llama", "1", "LlamaForCausalLM", {"lm_head", "model.layers.0.self_attn.q_proj"}, id="llama"),
])
def test_transformers_trainer(tmp_path: Path, free_port: int, arch: str, accum: str, model: str,
                              layers: set[str]) -> None:
    stack = run_stack(tmp_path, free_port, "hf_trainer.py", "--arch", arch, "--steps", "6", "--accum", accum,
                      "--nan-at", "3")
    check_guarded(stack, nan_at=3, model=model)
    assert stack.out["finite"]
    assert layers <= stack.labels("hookpolicy_grad_l2_norm", "module", rule="layers")
    assert stack.labels("hookpolicy_grad_l2_norm", "model") == {model}


# -- plain PyTorch loops -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", ["closure-sgd", "closure-adam", "lbfgs", "compile", "checkpoint"])
def test_plain_loops(tmp_path: Path, free_port: int, case: str) -> None:
    stack = run_stack(tmp_path, free_port, "loops.py", "--case", case, "--nan-at", "3")
    check_guarded(stack, nan_at=3, model="Sequential")  # a compiled model is labelled as the model it wraps
    assert stack.out["finite"]
    assert stack.labels("hookpolicy_grad_l2_norm", "module", rule="layers") == {"0", "2"}
    assert "warn" not in stack.stderr.lower(), stack.stderr  # e.g. torch.compile's about global module hooks


@pytest.mark.slow
def test_grad_scaler_skips_the_overflow_step_itself(tmp_path: Path, free_port: int) -> None:
    """GradScaler skips the NaN step before any optimizer step: hookpolicy neither counts nor evaluates it."""
    stack = run_stack(tmp_path, free_port, "loops.py", "--case", "grad-scaler", "--nan-at", "3")
    stack.out["framework_steps"] = stack.out["scaler_steps"]  # the optimizer steps GradScaler took: 5 of 6
    check_guarded(stack, nan_at=None, model="Sequential")
    assert stack.out["scaler_steps"] == 5


@pytest.mark.slow
def test_two_models_are_told_apart(tmp_path: Path, free_port: int) -> None:
    """A GAN's generator and discriminator, both `Sequential`: `Sequential` and `Sequential#2` everywhere."""
    stack = run_stack(tmp_path, free_port, "loops.py", "--case", "gan", "--nan-at", "3")
    check_guarded(stack, nan_at=3, model="Sequential", probe="generator")
    seen = stack.probe("discriminator")
    assert stack.value("hookpolicy_steps_total", model="Sequential#2") == len(seen["norms"]) == 6
    assert not any(seen["unchanged"])  # the discriminator's loss was finite at every step
    assert stack.value("hookpolicy_skipped_steps_total", model="Sequential#2", rule="nan") == 0
    assert stack.labels("hookpolicy_grad_l2_norm", "model") == {"Sequential", "Sequential#2"}
    governed = [line for line in stack.stderr.splitlines() if line.startswith("hookpolicy: governing")]
    assert [line.split()[2] for line in governed] == ["Sequential", "Sequential#2"]


# -- the loss column: target: loss against the loss each stack computed itself ----------------

LOSS = STACKS / "loss.yaml"


def loss_records(tmp_path: Path) -> list[dict[str, Any]]:
    """What the loss rule of tests/stacks/loss.yaml logged, one record per step."""
    path = tmp_path / "loss.jsonl"
    return [json.loads(line)["stats"] for line in path.read_text().splitlines()] if path.exists() else []


def per_step(micro: list[list[Any]]) -> list[list[float]]:
    """[(step, loss), ...] per micro-batch -> the losses of each step."""
    steps: dict[int, list[float]] = {}
    for step, loss in micro:
        steps.setdefault(step, []).append(loss)
    return [steps[k] for k in sorted(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["closure-adam", "lbfgs-iterations", "compile", "grad-scaler", "checkpoint"])
def test_loss_of_plain_loops(tmp_path: Path, free_port: int, case: str) -> None:
    """The loss each loop backpropagated (a functional loss, times 10, or times NaN after it at step 3): one root a step.

    A closure's first call for LBFGS (its later calls inside the same step() belong to
    no step); the unscaled loss under GradScaler, whose NaN step no optimizer takes (not
    evaluated: 5 records); a compiled model; activation checkpointing.
    """
    stack = run_stack(tmp_path, free_port, "loops.py", "--case", case, "--nan-at", "3", policy=LOSS)
    got = loss_records(tmp_path)
    want = stack.out["losses"]
    if case == "grad-scaler":
        want = want[:3] + want[4:]
    assert [r["numel"] for r in got] == [1] * len(want), stack.stderr
    assert [r["nonfinite"] for r in got] == [int(w != w) for w in want]
    finite = [(r["mean"], w) for r, w in zip(got, want) if w == w]
    assert [m for m, _ in finite] == pytest.approx([w for _, w in finite], rel=1e-6)
    assert "no loss seen" not in stack.stderr


@pytest.mark.slow
@pytest.mark.parametrize("accum, flags", [("1", []), ("2", []), ("1", ["--manual"])], ids=["1", "2", "manual"])
def test_loss_under_lightning(tmp_path: Path, free_port: int, accum: str, flags: list[str]) -> None:
    """Lightning backpropagates training_step's loss / accumulate_grad_batches for every micro-batch (the
    earlier ones in closures it runs itself, outside optimizer.step()): accum roots a step, their sum the
    average micro-batch loss. Manual optimization: what manual_backward was given."""
    stack = run_stack(tmp_path, free_port, "lightning_reg.py", "--steps", "6", "--accum", accum, *flags,
                      policy=LOSS)
    got = loss_records(tmp_path)
    steps = per_step(stack.out["micro_losses"])
    assert len(got) == len(steps) == 6
    assert [r["numel"] for r in got] == [int(accum)] * 6
    assert [r["max"] for r in got] == pytest.approx([max(s) / int(accum) for s in steps], rel=1e-6)
    assert [r["mean"] * r["numel"] for r in got] == pytest.approx([sum(s) / int(accum) for s in steps], rel=1e-6)
    assert stack.out["callback_loss"] == pytest.approx(steps[-1][-1], rel=1e-6)  # what the LightningModule logged


@pytest.mark.slow
@pytest.mark.parametrize("arch, accum", [("llama", "1"), ("gpt2", "2")])
def test_loss_under_the_transformers_trainer(tmp_path: Path, free_port: int, arch: str, accum: str) -> None:
    """The Trainer backpropagates (through accelerate's backward) what compute_loss returned, one root per
    micro-batch. It passes num_items_in_batch, so each is the micro-batch's token loss sum over the whole step's
    tokens: their sum (mean x numel) is the loss the Trainer logs."""
    stack = run_stack(tmp_path, free_port, "hf_trainer.py", "--arch", arch, "--steps", "4", "--accum", accum,
                      policy=LOSS)
    got = loss_records(tmp_path)
    steps = per_step(stack.out["micro_losses"])
    logged = [loss for _, loss in stack.out["logged_losses"]]
    assert len(got) == len(steps) == len(logged) == 4
    assert [r["numel"] for r in got] == [int(accum)] * 4
    assert [r["max"] for r in got] == pytest.approx([max(s) for s in steps], rel=1e-6)
    assert [r["mean"] * r["numel"] for r in got] == pytest.approx(logged, rel=1e-5)


@pytest.mark.slow
def test_loss_of_the_tiny_gpt_under_apply(tmp_path: Path, free_port: int) -> None:
    """`python -m examples.charlm`, unmodified: nanoGPT's (logits, loss); the script prints its loss per step."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(LOSS), "--", sys.executable, "-m", "examples.charlm",
         "--steps", "5"], cwd=tmp_path, env={**env, "PYTHONPATH": f"{REPO}"}, capture_output=True, text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    printed = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    got = loss_records(tmp_path)
    assert len(printed) == 5 and [r["numel"] for r in got] == [1] * 5
    assert [r["mean"] for r in got] == pytest.approx(printed, rel=1e-6)
