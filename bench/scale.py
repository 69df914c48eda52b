"""Variant 6: compiling and attaching on a 10,001-module model, copying and saving it, and a 10,000-series scrape.

The scrape is the exporter's answer to a GET of /metrics (`hookpolicy.export.exposition.metrics_app`,
what `hookpolicy apply --metrics-port` serves): in the text format a request without an Accept
header gets, and in OpenMetrics, which Prometheus asks for. Both are checked to be the bytes
of prometheus_client's own encoders, and `generate_latest(registry)` is timed beside them.
"""

from __future__ import annotations

import copy
import gc
import io
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

import hookpolicy
from hookpolicy.export.exposition import metrics_app

from collector import Collector
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
    scrape: Summary  # the exporter's text answer, each after a step: it finishes the values the step handed over
    scrape_cpu: Summary  # CPU time of the scraping thread: what the scrape costs without other tenants
    scrape_openmetrics_cpu: Summary  # the same in OpenMetrics (Prometheus's Accept header), CPU time
    library_cpu: Summary  # prometheus_client's generate_latest(registry) after a step, CPU time
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
        app = metrics_app(registry)
        if _answer(app, None) != text or _answer(app, PROMETHEUS_ACCEPT) != openmetrics_latest(registry):
            raise AssertionError("the exporter's answer is not prometheus_client's text")
        times, cpu, openmetrics_cpu, library_cpu = [], [], [], []
        for _ in range(scrapes):  # each after a step: the scrape finishes what the step handed over
            step()
            start, cpu_start = time.perf_counter(), time.thread_time()
            _answer(app, None)
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - cpu_start)
            step()
            cpu_start = time.thread_time()
            _answer(app, PROMETHEUS_ACCEPT)
            openmetrics_cpu.append(time.thread_time() - cpu_start)
            step()
            cpu_start = time.thread_time()
            generate_latest(registry)
            library_cpu.append(time.thread_time() - cpu_start)
    finally:
        attached.remove()
        timer.__exit__(None, None, None)
    return ScaleResult(
        modules, linears, bindings, hooks, summarize(loads), summarize(plans), summarize(attaches),
        summarize(removes), series, len(text), summarize(readback), summarize(plain), summarize(publish),
        summarize(times), summarize(cpu), summarize(openmetrics_cpu), summarize(library_cpu), copies,
    )


#: Prometheus 2's Accept header: OpenMetrics first
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _answer(app: Callable[..., Iterable[bytes]], accept: Optional[str]) -> bytes:
    """The body of the exporter's answer to a GET of /metrics."""
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": ""}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    return b"".join(app(environ, lambda status, headers, exc_info=None: None))


def _copies(model: torch.nn.Module, policy: hookpolicy.PolicySet, repeats: int) -> dict[str, dict[str, Summary]]:
    """`copy.deepcopy` and `torch.save` of the model, alternately without and with the policy attached.

    CPU time of this thread outside the garbage collector, after a collection (`bench/save.py`'s
    way): the first full collection after an attach walks every object the attach made, and a
    full collection comes once in one or two saves of this model, each walking the whole heap
    (the runtime of an attached policy too). `bench/save.py` gives the collector's share apart.
    """
    times: dict[str, dict[str, list[float]]] = {op: {"plain": [], "governed": []} for op in ("deepcopy", "torch.save")}
    collector = Collector()
    try:
        for _ in range(repeats):
            for label in ("plain", "governed"):
                attached = policy.attach(model, registry=CollectorRegistry()) if label == "governed" else None
                gc.collect()
                for op in ("deepcopy", "torch.save"):
                    start, in_gc = time.thread_time(), collector.spent
                    if op == "deepcopy":
                        copy.deepcopy(model)
                    else:
                        torch.save(model, io.BytesIO())
                    times[op][label].append(time.thread_time() - start - (collector.spent - in_gc))
                if attached is not None:
                    attached.remove()
    finally:
        collector.close()
    return {op: {label: summarize(t) for label, t in by.items()} for op, by in times.items()}
