"""`steps.Scopes`: which parameters each backward pass wrote, told by hooks that run no Python.

Each parameter's post-accumulate-grad hook takes its id out of a dict (`dict.pop`, the
parameter as the default); the step takes the writes in when it asks. References: the
optimizers' own step hooks (how many steps there were), `clip_grad_norm_` over the
stepping optimizer's parameters in a loop the test writes by hand (parameters bit for
bit), and weak references (a dropped model is freed).
"""

from __future__ import annotations

import functools
import gc
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from helpers.models import GAN
from helpers.policies import load_policy
from hookpolicy.engine.execute.steps import Scopes


def parameters_of(model: "weakref.ref[nn.Module]") -> list[nn.Parameter]:
    module = model()
    return [] if module is None else list(module.parameters())

CLIP_EVERY_2 = """
    - name: clip
      match: {modules: ["**"]}
      trigger: {at: step, every: 2, steps: {from: 1}}
      target: grad
      actions:
        - clip: {max_norm: 0.05, per: rule}
"""


def train(gan: GAN, iterations: int, clip_at: set[int]) -> list[int]:
    """The generator, then the discriminator, each after three micro-batches of its own.

    The generator's micro-batches go through the model's forward; the discriminator's call
    it alone (no root forward, no backward marker), and the generator's loss flows through
    the discriminator: its parameters hold gradients it does not apply at the generator's step. Clips (`clip_at`, by hand) the stepping optimizer's
    parameters at those optimizer steps, counted from 0. Returns the optimizer steps seen by
    the optimizers' own post-hooks, in order.
    """
    opts = [torch.optim.Adam(gan.generator.parameters(), lr=1e-2),
            torch.optim.Adam(gan.discriminator.parameters(), lr=1e-2)]
    seen: list[int] = []
    for k, opt in enumerate(opts):
        opt.register_step_post_hook(lambda o, a, kw, k=k: seen.append(k))
    data = torch.Generator().manual_seed(1)
    for _ in range(iterations):
        for k, opt in enumerate(opts):
            opt.zero_grad()
            for _ in range(3):
                out = (gan.discriminator(torch.randn(4, 4, generator=data)) if k == 1
                       else gan.discriminator(gan(torch.randn(4, 2, generator=data))))
                (out.pow(2).mean() / 3).backward()
            if len(seen) in clip_at:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05)
            opt.step()
    return seen


def test_parts_stepped_in_turn_after_micro_batches_are_one_step_each_and_each_clips_only_its_part(
    tmp_path: Path,
) -> None:
    """Three backward passes write each parameter before its optimizer steps (a hook finds its id gone twice).

    Every optimizer step is one step (the optimizers' own post-hooks count them); a clip
    active on every second step from the discriminator's first on clips only the stepping
    part, as `clip_grad_norm_` does over that optimizer's parameters; the inactive steps
    leave the gradients alone. (Step 0 is left out: before the discriminator's optimizer has
    stepped once, nothing says yet that it steps apart, and step 0 sees all of the model.)
    """
    gan = GAN()
    with load_policy(tmp_path, CLIP_EVERY_2).attach(gan, registry=CollectorRegistry()) as attached:
        seen = train(gan, 4, set())
        assert attached.step == len(seen) == 8
    reference = GAN()
    assert train(reference, 4, {2, 4, 6}) == seen
    for (name, got), want in zip(gan.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name
    unclipped = GAN()
    train(unclipped, 4, set())
    assert not all(torch.equal(a, b) for a, b in zip(gan.parameters(), unclipped.parameters()))  # the clip acted


def test_writes_before_and_after_the_check_are_told_apart() -> None:
    """`touched` cleared, then a backward pass: True only when the pass wrote a parameter; the sets follow."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    scopes = Scopes(lambda: list(model.parameters()))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model(torch.randn(3, 2)).sum().backward()
    model(torch.randn(3, 2)).sum().backward()  # the second write of each id before anything asked
    scopes.touched = False  # the writes so far are taken in before the clearing
    assert scopes.touched is False
    assert scopes.begins(opt) is True
    torch.randn(2, requires_grad=True).sum().backward()  # another graph: not this model's
    assert scopes.touched is False
    model[1](torch.randn(3, 2)).sum().backward()  # writes only the second Linear, which opt does not hold
    assert scopes.touched is True
    scopes.evaluating(opt)
    assert scopes.begins(opt) is False  # written, but all before the evaluation
    scopes.stepped(opt)
    assert scopes.begins(opt) is None  # nothing of opt's written since its step
    model[0](torch.randn(3, 2)).sum().backward()
    assert scopes.begins(opt) is True
    scopes.remove()
    model[0](torch.randn(3, 2)).sum().backward()  # no hook left: nothing is noted
    scopes.stepped(opt)
    assert scopes.begins(opt) is None


def test_a_dropped_model_whose_last_writes_no_step_took_in_is_freed(tmp_path: Path) -> None:
    """The hooks hold no tensor: a model dropped right after a backward pass goes with gc, its gradients too.

    A hook that kept the parameter until the step (`list.append`) would hold it from the
    parameter's own C++ hook list, in a cycle gc cannot see.
    """
    remains: list[Callable[[], None]] = []  # what `apply` would remove once the model is garbage

    def dropped(attach: bool) -> "weakref.ref[torch.Tensor]":
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scopes = Scopes(functools.partial(parameters_of, weakref.ref(model)))  # as StepTracker makes it
        attached = load_policy(tmp_path, CLIP_EVERY_2).attach(model, registry=CollectorRegistry()) if attach else None
        if attached is not None:
            attached.when_dropped(remains.append)
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        model[1](torch.randn(2, 3)).sum().backward()  # written, not taken in: no step, no backward marker
        assert attached is None or attached.step == 3
        del scopes, attached
        return weakref.ref(model[1].weight)

    for attach in (False, True):
        ref = dropped(attach)
        gc.collect()
        assert ref() is None, attach
    assert len(remains) == 1
    remains[0]()
