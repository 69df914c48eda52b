"""Variant 6: compiling and attaching on a 10,001-module model, copying and saving it, and a 10,000-series scrape."""

from __future__ import annotations

import copy
import io
import time
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, generate_latest

import hookpolicy

from models import wide_model
from timing import Summary, readback_cpu, summarize
from variants import POLICIES

__all__ = ["ScaleResult", "measure_scale"]


@dataclass
class ScaleResult:
    modules: int
    linears: int
    bindings: int
    hooks: int
    load: Summary
    plan: Summary
    attach: Summary
    remove: Summary
    series: int
    scrape_bytes: int
    readback_step: Summary
    plain_step: Summary
    #: CPU time of the step's read-back (fetch, finish or hand over, publish): what publishing costs the step
    publish_cpu: Summary
    scrape: Summary  # each after a step: it finishes the values the step handed over
    scrape_cpu: Summary  # CPU time of the scraping thread: what the scrape costs without other tenants
    #: "deepcopy"/"torch.save" -> "plain"/"governed" (monitor.yaml attached) -> seconds
    copies: dict[str, dict[str, Summary]]


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def measure_scale(repeats: int, scrapes: int, device: torch.device) -> ScaleResult:
    model = wide_model().to(device)
    modules = sum(1 for _ in model.modules())
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    loads, plans, attaches, removes = [], [], [], []
    bindings = hooks = 0
    for _ in range(repeats):
        start = time.perf_counter()
        policy = hookpolicy.load(POLICIES / "monitor.yaml")
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan = policy.plan(model)
        plans.append(time.perf_counter() - start)
        bindings = len(plan.bindings)
        start = time.perf_counter()
        attached = policy.attach(model, registry=CollectorRegistry())
        attaches.append(time.perf_counter() - start)
        hooks = _hooks(model)
        start = time.perf_counter()
        attached.remove()
        removes.append(time.perf_counter() - start)

    copies = _copies(model, hookpolicy.load(POLICIES / "monitor.yaml"), repeats)

    # The scrape: one training step publishes l2_norm and nonfinite of 5,000 Linear layers.
    registry = CollectorRegistry()
    scraper = hookpolicy.load(POLICIES / "scrape.yaml")
    x = torch.randn(16, 8, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plain, readback = [], []
    for _ in range(repeats):  # the same step without a policy, for the readback's cost
        model(x).square().mean().backward()
        start = time.perf_counter()
        opt.step()
        plain.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    publish: list[float] = []  # the read-back's CPU time, every step after the first
    timer = readback_cpu()
    spent = timer.__enter__()
    attached = scraper.attach(model, registry=registry)
    try:
        def step() -> float:
            model(x).square().mean().backward()
            spent[0] = 0.0
            start = time.perf_counter()
            opt.step()  # hookpolicy's readback of 10,000 statistics runs in its pre-hook
            opt.zero_grad(set_to_none=True)
            publish.append(spent[0])
            return time.perf_counter() - start

        step()  # the first step admits the series (maxSeries); the next ones only swap their values in
        publish.clear()
        readback = [step() for _ in range(repeats)]
        text = generate_latest(registry)
        series = sum(1 for line in text.decode().splitlines()
                     if line.startswith(("hookpolicy_grad_l2_norm{", "hookpolicy_grad_nonfinite{")))
        times, cpu = [], []
        for _ in range(scrapes):  # each after a step: the scrape finishes what the step handed over
            step()
            start, cpu_start = time.perf_counter(), time.thread_time()
            generate_latest(registry)
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - cpu_start)
    finally:
        attached.remove()
        timer.__exit__(None, None, None)
    return ScaleResult(
        modules, linears, bindings, hooks, summarize(loads), summarize(plans), summarize(attaches),
        summarize(removes), series, len(text), summarize(readback), summarize(plain), summarize(publish),
        summarize(times), summarize(cpu), copies,
    )


def _copies(model: torch.nn.Module, policy: hookpolicy.PolicySet, repeats: int) -> dict[str, dict[str, Summary]]:
    """`copy.deepcopy` and `torch.save` of the model, alternately without and with the policy attached."""
    times: dict[str, dict[str, list[float]]] = {op: {"plain": [], "governed": []} for op in ("deepcopy", "torch.save")}
    for _ in range(repeats):
        for label in ("plain", "governed"):
            attached = policy.attach(model, registry=CollectorRegistry()) if label == "governed" else None
            start = time.perf_counter()
            copy.deepcopy(model)
            times["deepcopy"][label].append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.save(model, io.BytesIO())
            times["torch.save"][label].append(time.perf_counter() - start)
            if attached is not None:
                attached.remove()
    return {op: {label: summarize(t) for label, t in by.items()} for op, by in times.items()}
