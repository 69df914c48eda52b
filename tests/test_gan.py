"""Two optimizers over disjoint parts of one governed model (a GAN), each stepped after its own backward pass.

Each optimizer step is a step, and its `step` rules see only the parameters that optimizer
updates: the other part's gradients are stale (its own backward pass, or the other loss
flowing through it). References: `clip_grad_norm_` over the stepping optimizer's
parameters, an unguarded run that does not take the poisoned step, and parameters and
optimizer state compared bit for bit.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from helpers.models import GAN
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


#: takes the step: (which part, iteration, model, its optimizer, `optimizer.step`)
Stepper = Callable[[str, int, GAN, torch.optim.Optimizer, Callable[[], None]], None]


def take(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    step()


def train(gan: GAN, iterations: int, stepper: Stepper = take, through_forward: bool = False,
          set_to_none: bool = True, alone: int = 0) -> None:
    """The usual loop: the discriminator's step, then the generator's, each after its own backward pass.

    The generator's loss flows through the discriminator, so at the generator's step the
    discriminator's parameters hold gradients it does not apply. `through_forward`: the
    generator runs as `gan(z)`, the model's own forward (the discriminator's backward
    pass then does not go through it: its output is detached). `set_to_none`: what
    `zero_grad` is called with. `alone`: that many first iterations train the generator
    only (the discriminator's optimizer steps for the first time after them).
    """
    g_opt = torch.optim.Adam(gan.generator.parameters(), lr=1e-2)
    d_opt = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-2)
    generate = gan if through_forward else gan.generator
    data = torch.Generator().manual_seed(1)
    for i in range(iterations):
        z, real = torch.randn(8, 2, generator=data), torch.randn(8, 4, generator=data) + 2
        if i >= alone:
            d_opt.zero_grad(set_to_none=set_to_none)
            d_loss = (nn.functional.softplus(gan.discriminator(generate(z).detach())).mean()
                      + nn.functional.softplus(-gan.discriminator(real)).mean())
            d_loss.backward()
            stepper("discriminator", i, gan, d_opt, d_opt.step)
        g_opt.zero_grad(set_to_none=set_to_none)
        nn.functional.softplus(-gan.discriminator(generate(z))).mean().backward()
        stepper("generator", i, gan, g_opt, g_opt.step)


def state(gan: GAN, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in gan.parameters() for t in (p.detach(), *opt.state.get(p, {}).values())]


@pytest.mark.parametrize("through_forward, set_to_none, alone", [
    (False, True, 0), (True, True, 0),
    (False, False, 0), (True, False, 0),  # gradients zeroed in place: the same .grad tensors at every step
    (True, True, 20),  # the discriminator's first step after 20 steps of the generator alone
], ids=["submodules", "forward", "submodules-in-place", "forward-in-place", "late-discriminator"])
def test_a_nan_in_the_discriminator_skips_only_its_step(
    tmp_path: Path, through_forward: bool, set_to_none: bool, alone: int,
) -> None:
    """The NaN the test puts in the discriminator's gradient skips the discriminator's step, not the generator's.

    At the generator's step the discriminator's gradients still hold the NaN (the
    generator's loss adds to them): the guard must not see them there. Each step is told
    by what the backward passes wrote, whatever `zero_grad` did and however late an
    optimizer steps for the first time.
    """
    poisoned_at = alone + 2
    changed: list[tuple[str, int, bool, bool]] = []  # (part, iteration, its parameters changed, the other's)

    def poisoned(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        if which == "discriminator" and i == poisoned_at:
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
    iterations = alone + 4
    with load_policy(tmp_path, NAN_GUARD).attach(gan, registry=registry) as attached:
        train(gan, iterations, poisoned, through_forward, set_to_none, alone)
        assert attached.step == alone + 8  # one step per optimizer step, as Lightning's global_step counts them
    assert changed == [(which, i, (which, i) != ("discriminator", poisoned_at), False)
                       for i in range(iterations) for which in ("discriminator", "generator")
                       if which == "generator" or i >= alone]
    assert metric(registry, "hookpolicy_skipped_steps_total", {"rule": "nan"}) == 1

    # the reference: the same loop without hookpolicy, not taking the poisoned step
    def reference(which: str, i: int, gan: GAN, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        if (which, i) != ("discriminator", poisoned_at):
            step()

    unguarded = GAN()
    train(unguarded, iterations, reference, through_forward, set_to_none, alone)
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


def three_optimizers(gan: GAN, iterations: int, clip: bool) -> list[list[torch.Tensor]]:
    """The discriminator's SGD steps after its own backward pass; then the generator's two layers'
    SGDs step together after one backward pass. Returns the gradients each optimizer stepped
    with (read by its own step pre-hook, which runs after hookpolicy's global one); `clip`: the
    reference, `clip_grad_norm_(..., 0.05)` over the discriminator, then over both generator layers."""
    d_opt = torch.optim.SGD(gan.discriminator.parameters(), lr=0.1)
    g_opts = [torch.optim.SGD(gan.generator[i].parameters(), lr=0.1) for i in (0, 2)]
    seen: list[list[torch.Tensor]] = []
    for opt in (d_opt, *g_opts):
        opt.register_step_pre_hook(
            lambda o, a, k: seen.append([p.grad.clone() for g in o.param_groups for p in g["params"]]))
    data = torch.Generator().manual_seed(1)
    for _ in range(iterations):
        z, real = torch.randn(8, 2, generator=data), torch.randn(8, 4, generator=data) + 2
        d_opt.zero_grad()
        (nn.functional.softplus(gan.discriminator(gan.generator(z).detach())).mean()
         + nn.functional.softplus(-gan.discriminator(real)).mean()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(gan.discriminator.parameters(), 0.05)
        d_opt.step()
        for opt in g_opts:
            opt.zero_grad()
        nn.functional.softplus(-gan.discriminator(gan.generator(z))).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(gan.generator.parameters(), 0.05)
        for opt in g_opts:
            opt.step()
    return seen


def test_two_optimizers_stepping_together_and_one_apart(tmp_path: Path) -> None:
    """Three optimizers: the two of the generator's layers step together (one step, one `per: rule`
    clip over both layers' gradients), the discriminator's apart (a step of its own). Reference:
    `clip_grad_norm_` over the discriminator's parameters, then over the whole generator's."""
    gan = GAN()
    with load_policy(tmp_path, CLIP).attach(gan) as attached:
        got = three_optimizers(gan, 4, clip=False)
        assert attached.step == 8
    reference = GAN()
    want = three_optimizers(reference, 4, clip=True)
    assert len(got) == len(want) == 12
    for i, (stepped, expected) in enumerate(zip(got, want)):
        for g, w in zip(stepped, expected):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=f"optimizer step {i}")
    for (name, p), q in zip(gan.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_gradients_no_backward_pass_wrote_are_said_and_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Gradients the script assigns (`torch.autograd.grad`, then `p.grad = ...`) with two optimizers stepping in turn.

    No backward pass wrote them, so which step they belong to cannot be told: one line,
    and the acting rule is refused rather than run on a guess (no step skipped: the
    parameters equal an unguarded run's).
    """
    def assign(gan: GAN) -> None:
        g_opt = torch.optim.SGD(gan.generator.parameters(), lr=1e-2)
        d_opt = torch.optim.SGD(gan.discriminator.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1)
        for i in range(3):
            z, real = torch.randn(8, 2, generator=data), torch.randn(8, 4, generator=data) + 2
            for part, opt, loss in (
                (gan.discriminator, d_opt, lambda: nn.functional.softplus(-gan.discriminator(real)).mean()),
                (gan.generator, g_opt, lambda: nn.functional.softplus(-gan.discriminator(gan(z))).mean()),
            ):
                grads = torch.autograd.grad(loss() * (float("nan") if i == 1 else 1.0), list(part.parameters()))
                for p, grad in zip(part.parameters(), grads):
                    p.grad = grad
                opt.step()

    gan = GAN()
    with caplog.at_level(logging.WARNING, logger="hookpolicy"), load_policy(tmp_path, NAN_GUARD).attach(gan):
        assign(gan)
    said = [r.getMessage() for r in caplog.records if "no backward pass wrote" in r.getMessage()]
    assert len(said) == 1 and said[0].split(": ", 1)[1].startswith("SGD steps gradients that no backward pass"), said
    assert said[0].endswith("; refused: p/nan")
    reference = GAN()
    assign(reference)
    for (name, got), want in zip(gan.named_parameters(), reference.parameters()):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), name
