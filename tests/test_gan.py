"""Two optimizers over disjoint parts of one governed model (a GAN), each stepped after its own backward pass.

Each optimizer step is a step, and its `step` rules see only the parameters that optimizer
updates: the other part's gradients are stale (its own backward pass, or the other loss
flowing through it). References: `clip_grad_norm_` over the stepping optimizer's
parameters, an unguarded run that does not take the poisoned step, and parameters and
optimizer state compared bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from helpers.outputs import metric
from helpers.policies import load_policy

NAN_GUARD = """
    - name: nan
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: module, then: skip_step}
"""
CLIP = """
    - name: clip
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - clip: {max_norm: 0.05, per: rule}
"""


class GAN(nn.Module):
    """A generator and a discriminator in one module; `forward` is the generator (Lightning's GAN example)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)


#: takes the step: (which part, iteration, model, its optimizer, `optimizer.step`)
Stepper = Callable[[str, int, GAN, torch.optim.Optimizer, Callable[[], None]], None]


def take(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    step()


def train(gan: GAN, iterations: int, stepper: Stepper = take, through_forward: bool = False) -> None:
    """The usual loop: the discriminator's step, then the generator's, each after its own backward pass.

    The generator's loss flows through the discriminator, so at the generator's step the
    discriminator's parameters hold gradients it does not apply. `through_forward`: the
    generator runs as `gan(z)`, the model's own forward (the discriminator's backward
    pass then does not go through it: its output is detached).
    """
    g_opt = torch.optim.Adam(gan.generator.parameters(), lr=1e-2)
    d_opt = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-2)
    generate = gan if through_forward else gan.generator
    data = torch.Generator().manual_seed(1)
    for i in range(iterations):
        z, real = torch.randn(8, 2, generator=data), torch.randn(8, 4, generator=data) + 2
        d_opt.zero_grad()
        d_loss = (nn.functional.softplus(gan.discriminator(generate(z).detach())).mean()
                  + nn.functional.softplus(-gan.discriminator(real)).mean())
        d_loss.backward()
        stepper("discriminator", i, gan, d_opt, d_opt.step)
        g_opt.zero_grad()
        nn.functional.softplus(-gan.discriminator(generate(z))).mean().backward()
        stepper("generator", i, gan, g_opt, g_opt.step)


def state(gan: GAN, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in gan.parameters() for t in (p.detach(), *opt.state.get(p, {}).values())]


@pytest.mark.parametrize("through_forward", [False, True], ids=["submodules", "forward"])
def test_a_nan_in_the_discriminator_skips_only_its_step(tmp_path: Path, through_forward: bool) -> None:
    """The NaN the test puts in the discriminator's gradient skips the discriminator's step, not the generator's.

    At the generator's step the discriminator's gradients still hold the NaN (the
    generator's loss adds to them): the guard must not see them there.
    """
    changed: list[tuple[str, int, bool, bool]] = []  # (part, iteration, its parameters changed, the other's)

    def poisoned(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        if which == "discriminator" and i == 2:
            gan.discriminator[0].weight.grad[0, 0] = float("nan")  # type: ignore[index]
        part, other = getattr(gan, which), gan.generator if which == "discriminator" else gan.discriminator
        before = [p.detach().clone() for p in part.parameters()], [p.detach().clone() for p in other.parameters()]
        moments = [(p, k, v.clone()) for p in part.parameters() for k, v in opt.state.get(p, {}).items()]
        step()
        mine = not all(torch.equal(a, p) for a, p in zip(before[0], part.parameters()))
        theirs = not all(torch.equal(a, p) for a, p in zip(before[1], other.parameters()))
        if not mine:  # a skipped step leaves the optimizer's state as it was, bit for bit
            assert moments and all(torch.equal(v, opt.state[p][k]) for p, k, v in moments)
        changed.append((which, i, mine, theirs))

    gan, registry = GAN(), CollectorRegistry()
    with load_policy(tmp_path, NAN_GUARD).attach(gan, registry=registry) as attached:
        train(gan, 4, poisoned, through_forward)
        assert attached.step == 8  # one step per optimizer step, as Lightning's global_step counts them
    assert changed == [(which, i, (which, i) != ("discriminator", 2), False)
                       for i in range(4) for which in ("discriminator", "generator")]
    assert metric(registry, "hookpolicy_skipped_steps_total", {"rule": "nan"}) == 1

    # the reference: the same loop without hookpolicy, not taking the poisoned step
    def reference(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        if (which, i) != ("discriminator", 2):
            step()

    unguarded = GAN()
    train(unguarded, 4, reference, through_forward)
    for (name, got), want in zip(gan.named_parameters(), unguarded.parameters()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("through_forward", [False, True], ids=["submodules", "forward"])
def test_a_clip_over_the_model_clips_only_the_stepping_part(tmp_path: Path, through_forward: bool) -> None:
    """A `per: rule` clip over the whole model = `clip_grad_norm_` over the stepping optimizer's parameters."""
    gan = GAN()
    with load_policy(tmp_path, CLIP).attach(gan) as attached:
        train(gan, 4, through_forward=through_forward)
        assert attached.step == 8

    def clipped(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05)
        step()

    reference = GAN()
    train(reference, 4, clipped, through_forward)
    for (name, got), want in zip(gan.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
