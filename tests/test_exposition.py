"""The exporter's /metrics answer is prometheus_client's `make_wsgi_app`'s, byte for byte, on every kind of request,
while the statistic series' line heads are formatted once (hookpolicy/export/exposition.py)."""

from __future__ import annotations

import gzip
import math
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, make_wsgi_app
from prometheus_client import exposition as text_format
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

import hookpolicy
from helpers.models import make_model, train_step, train_then_evaluate
from hookpolicy.export.collector import store_for
from hookpolicy.export.exposition import Exposition, StatFamily, metrics_app

#: label values the library must escape (quote, backslash, newline), non-ASCII, and plain ones
ODD = ['plain', 'say "hi"', 'back\\slash', 'two\nlines', 'ünïcode.π', '']
#: values whose text the library writes its own way (NaN, +Inf, -Inf, -0.0, Go's exponents)
VALUES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 1e22, 123456789.0, 1.5e-7, -2.5, 3.0000000000000004]

ACCEPT = [
    None, "", "*/*", "text/plain", "text/plain;version=0.0.4", "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8", "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values", "text/plain;version=1.0.0;escaping=underscores",
    "application/openmetrics-text", "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=0.0.1",
    # Prometheus 2's default and Prometheus 3's
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,application/openmetrics-text;version=0.0.1;"
    "q=0.8,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.4,*/*;q=0.1",
]


def _registry() -> tuple[CollectorRegistry, Any]:
    """A registry with hookpolicy's store (odd labels and values) and the user's own metrics of every kind."""
    registry = CollectorRegistry()
    store = store_for(registry, 3)
    store.set_stats(_stats(ODD, VALUES), {})
    Counter("user_requests", "Requests, with a \\ and a\nnewline in the help.", ["path"], registry=registry).labels(
        'a"b').inc(2)
    Gauge("user_temperature", "A gauge.", registry=registry).set(-0.0)
    Histogram("user_latency_seconds", "A histogram.", registry=registry).observe(0.3)
    Info("user_build", "An info.", registry=registry).info({"version": "1.2", "odd": 'x"\\\ny'})
    Gauge("user.dotted.name", "A name outside the legacy character set.", ["label.dotted"],
          registry=registry).labels("v").set(7)
    return registry, store


def _stats(labels: list[str], values: list[float], module: str = "m") -> dict[tuple[str, tuple[str, ...]], float]:
    stats = {}
    for i, odd in enumerate(labels):
        for j, value in enumerate(values):
            stats[("hookpolicy_grad_l2_norm", ("pol", odd, f"{module}.{j}", "weight", "Net"))] = value
            stats[("hookpolicy_output_nonfinite", (odd, "r", f"{module}.{j}", odd, f"Net#{i}"))] = -value
    return stats


def _grads_policy(name: str, stats: str) -> str:
    """A policy `name` capturing `stats` of every Linear's gradients per module at the step (more rules may follow)."""
    return f"""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: {name}}}
spec:
  rules:
    - name: grads
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions: [{{capture: {{stats: [{stats}], per: module}}}}]
"""


def _ask(app: Any, method: str = "GET", path: str = "/metrics", query: str = "", accept: Any = None,
         encoding: Any = None) -> tuple[str, list[tuple[str, str]], bytes]:
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if encoding is not None:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    started: list[Any] = []
    body = b"".join(app(environ, lambda status, headers, exc_info=None: started.extend((status, headers))))
    headers = list(started[1])
    if ("Content-Encoding", "gzip") in headers:
        body = gzip.decompress(body)  # gzip writes the time into its header: the content is compared
    return started[0], headers, body


def _same_answers(registry: CollectorRegistry, ours: Any) -> int:
    """Every kind of request answered alike by `ours` and the library's app; the number compared."""
    library = make_wsgi_app(registry)
    asked = 0
    for accept in ACCEPT:
        for encoding in (None, "gzip", "deflate, gzip;q=0.5", "identity"):
            expected = _ask(library, accept=accept, encoding=encoding)
            assert _ask(ours, accept=accept, encoding=encoding) == expected, (accept, encoding)
            asked += 1
    for kind in [dict(method="POST"), dict(method="OPTIONS"), dict(method="HEAD"), dict(path="/favicon.ico"),
                 dict(path="/anything"), dict(query="name[]=hookpolicy_grad_l2_norm&name[]=user_requests_total"),
                 dict(query="name[]=hookpolicy_output_nonfinite", accept="application/openmetrics-text")]:
        assert _ask(ours, **kind) == _ask(library, **kind), kind  # type: ignore[arg-type]
        asked += 1
    return asked


def test_every_request_is_answered_as_the_library_answers_it() -> None:
    registry, store = _registry()
    ours = metrics_app(registry)
    assert _same_answers(registry, ours) == len(ACCEPT) * 4 + 7
    # the values escaped, written and read back by the library's own parser agree with the store's
    text = _ask(ours)[2].decode()
    assert 'rule="say \\"hi\\""' in text and 'rule="two\\nlines"' in text and 'rule="back\\\\slash"' in text
    assert "} NaN\n" in text and "} +Inf\n" in text and "} -Inf\n" in text and "} -0.0\n" in text
    assert "} 1e+22\n" in text and "} 1.23456789e+08\n" in text


def test_the_heads_are_made_once_and_follow_the_series_the_store_holds() -> None:
    """New values, forgotten series and new ones (a hot reload) between scrapes: still the library's text."""
    registry, store = _registry()
    exposition = Exposition(registry)
    assert exposition.render(generate_latest) == generate_latest(registry)
    held = sum(len(series) for series in store.snapshot()[1].values())
    assert sum(len(heads) for heads in exposition._heads[(generate_latest,)].values()) == held
    assert held == 2 * len(ODD) * len(VALUES)
    # the second scrape formats no label: the library's sample formatting is not called for the statistics
    store.set_stats(_stats(ODD, [v * 3 for v in VALUES]), {})
    assert exposition.render(generate_latest) == generate_latest(registry)
    # a reload: the policy's series of some modules forgotten, others new under changed labels
    store.forget_modules("pol", {"m.0", "m.1"})
    store.set_stats(_stats(["new"], VALUES, module="n"), {})
    for render in range(2):
        assert exposition.render(generate_latest) == generate_latest(registry), render
        assert exposition.render(openmetrics_latest) == openmetrics_latest(registry), render
    held = {labels for series in store.snapshot()[1].values() for labels in series}
    assert {labels for heads in exposition._heads[(generate_latest,)].values() for labels in heads} == held
    store.forget_policy("pol")
    store.forget_policy("say \"hi\"")
    assert exposition.render(generate_latest) == generate_latest(registry)
    held = {labels for series in store.snapshot()[1].values() for labels in series}
    assert {labels for heads in exposition._heads[(generate_latest,)].values() for labels in heads} == held


def test_clients_asking_for_many_formats_cannot_grow_the_heads_without_bound() -> None:
    """A client chooses the Accept header (any OpenMetrics version >= 1.0.0): the heads of a few encoders are kept."""
    registry, _ = _registry()
    ours, library = metrics_app(registry), make_wsgi_app(registry)
    exposition = Exposition(registry)
    for minor in range(12):
        accept = f"application/openmetrics-text;version=1.{minor}.0"
        assert _ask(ours, accept=accept) == _ask(library, accept=accept)
        encoder, _ = text_format.choose_encoder(accept)
        assert exposition.render(encoder) == encoder(registry)
        assert len(exposition._heads) <= Exposition.MAX_ENCODERS
    assert exposition.render(generate_latest) == generate_latest(registry)
    assert (generate_latest,) in exposition._heads and len(exposition._heads) == Exposition.MAX_ENCODERS


def test_a_statistic_family_reads_as_add_metric_made_it() -> None:
    """Code that reads the samples (get_sample_value, a name[] restriction) gets those of add_metric."""
    registry, store = _registry()
    families = [f for f in registry.collect() if isinstance(f, StatFamily)]
    assert {f.name for f in families} == {"hookpolicy_grad_l2_norm", "hookpolicy_output_nonfinite"}
    for family in families:
        assert family.samples  # built when read
        for sample in family.samples:
            labels = tuple(sample.labels[k] for k in ("policy", "rule", "module", "tensor", "model"))
            value = family.series[labels]
            assert sample.value == value or (math.isnan(value) and math.isnan(sample.value))
            assert sample.labels["rank"] == "3" and sample.timestamp is None and sample.exemplar is None
    assert registry.get_sample_value("hookpolicy_grad_l2_norm", {
        "policy": "pol", "rule": "plain", "module": "m.5", "tensor": "weight", "model": "Net", "rank": "3"}) == 1.0


def test_a_trained_model_s_scrapes_are_the_library_s(tmp_path: Any) -> None:
    """A real attachment: values handed over by the step and finished at the scrape, three scrapes apart."""
    (tmp_path / "p.yaml").write_text(_grads_policy("scrape", "l2_norm, nonfinite, mean") + """\
    - name: outputs
      match: {types: [Linear, LayerNorm]}
      trigger: {at: forward}
      target: output
      actions: [{capture: {stats: [abs_max, rms]}}]
""")
    model = make_model()
    registry = CollectorRegistry()
    ours = metrics_app(registry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hookpolicy.load(str(tmp_path / "p.yaml")).attach(model, registry=registry, rank=0):
        for step in range(4):
            train_step(model, opt, step)  # the step hands its gradient statistics over, finished by the scrape
            if step == 2:
                continue  # two steps between two scrapes
            body = _ask(ours)[2]
            assert body == generate_latest(registry) and b"hookpolicy_grad_l2_norm{" in body
            accept = "application/openmetrics-text;version=1.0.0"
            assert _ask(ours, accept=accept)[2] == openmetrics_latest(registry)
        train_then_evaluate(model, steps=1)
        assert _same_answers(registry, ours) > 0


@pytest.mark.parametrize("encoder", [generate_latest, openmetrics_latest])
def test_a_registry_without_statistics_is_the_library_s(encoder: Any) -> None:
    registry = CollectorRegistry()
    Gauge("alone", "Nothing of hookpolicy's.", registry=registry).set(1)
    assert Exposition(registry).render(encoder) == encoder(registry)
    assert Exposition(CollectorRegistry()).render(encoder) == encoder(CollectorRegistry())


def test_a_step_whose_sums_are_plus_and_minus_inf_is_scraped_with_torch_s_values(tmp_path: Any) -> None:
    """A module's gradient summing to +inf in its weight and -inf in its bias: the scrape answers (it raised in
    math.fsum), with the mean and l2_norm torch gives the module's gradients together."""
    (tmp_path / "p.yaml").write_text(_grads_policy("infs", "mean, l2_norm"))
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    registry = CollectorRegistry()
    ours = metrics_app(registry)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    labels = {"policy": "infs", "rule": "grads", "module": "0", "tensor": "", "model": "Sequential", "rank": "0"}
    with hookpolicy.load(str(tmp_path / "p.yaml")).attach(model, registry=registry, rank=0):
        for infinite in (False, True, False):
            model(torch.ones(1, 2)).sum().backward()
            model[0].weight.grad.fill_(math.inf if infinite else 1.5)
            model[0].bias.grad.fill_(-math.inf if infinite else -0.5)
            grads = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad]).double()
            opt.step()
            status, _, body = _ask(ours)
            assert status == "200 OK" and body == generate_latest(registry)
            mean = registry.get_sample_value("hookpolicy_grad_mean", labels)
            norm = registry.get_sample_value("hookpolicy_grad_l2_norm", labels)
            assert mean is not None and norm is not None
            want_mean, want_norm = grads.mean().item(), torch.linalg.vector_norm(grads).item()
            assert (math.isnan(mean) and math.isnan(want_mean)) or mean == pytest.approx(want_mean, rel=1e-6)
            assert norm == pytest.approx(want_norm, rel=1e-6)  # a step rule's norms accumulate in float32
            opt.zero_grad()


def test_a_library_that_writes_lines_of_another_shape_gets_its_families_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A future library writing a value otherwise (here 0.0 as `0`): the heads cannot be cut, so the family is the
    library's own text, not heads glued to values written the old way; an encoder it does not know is the library's."""
    registry, _ = _registry()
    monkeypatch.setattr(text_format, "floatToGoString", lambda value: "0" if value == 0 else repr(float(value)))
    exposition = Exposition(registry)
    assert exposition.render(generate_latest) == generate_latest(registry)
    assert not any(exposition._heads.get((generate_latest,), {}).values())  # no head was kept
    assert b" 0\n" in generate_latest(registry)  # the changed writing is what was served

    def custom(reg: Any) -> bytes:
        return b"# a format of the user's\n" + generate_latest(reg)

    assert exposition.render(custom) == custom(registry)
