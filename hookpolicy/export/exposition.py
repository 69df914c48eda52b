"""The /metrics answer of a registry, each statistic series' line head formatted once.

prometheus_client's encoders format every sample's labels at every scrape: sorted, each
name checked against the legacy character set, each value escaped. For 10,000 statistic
series of six labels that was about 67 ms of the scrape (bench/where-the-time-goes.md).
Their label sets do not change between scrapes, so `Exposition` has the library format
each new series once, and at each scrape writes only the values.

The text stays the library's, byte for byte, whatever the request asks for:
- A family that is not a `StatFamily` is encoded by the library itself, one family at a
  time (an encoder's text is its families' texts in turn, then its tail: nothing in the
  text format, `# EOF` in OpenMetrics).
- A statistic family's header is the library's text of the family without samples; a new
  series' head is the library's line for it with the value 0.0, less the value. A line of
  a sample without timestamp, exemplar or native histogram is its head, a space, the
  value as the library's `floatToGoString` writes it and a newline, in both encoders.
- A line that does not end in " 0.0" (a future library that writes it otherwise) sends
  the family back to the library.
tests/test_exposition.py compares the answers with `make_wsgi_app`'s on every kind of
request (format, version, escaping, compression, method, `name[]`).
"""

from __future__ import annotations

import functools
import gzip
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, cast
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client import exposition as text_format
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics_format
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .metrics import STAT_LABELS, Labels

__all__ = ["Exposition", "StatFamily", "metrics_app"]

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
Encoder = Callable[[Any], bytes]

_POLICY, _RULE, _MODULE, _TENSOR, _MODEL = STAT_LABELS
_sample = Sample._make
#: the library's value text (`+Inf`, `NaN`, Go's exponents), the one every sample line of both encoders ends in
_value_text = cast(Callable[[float], str], floatToGoString)


class StatFamily(GaugeMetricFamily):
    """A statistic family: its series as the store holds them, its samples built only when read.

    `Exposition` writes its text from `series` without building a sample; anything else
    that reads `samples` (the library's encoders, `registry.get_sample_value`, a
    `name[]` restriction) gets the samples `add_metric` would make.
    """

    def __init__(self, name: str, documentation: str, series: dict[Labels, float], rank: str) -> None:
        self._samples: Optional[list[Sample]] = None
        super().__init__(name, documentation, labels=[*STAT_LABELS, "rank"])
        self.series, self.rank = series, rank
        self._samples = None

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = stat_samples(self.name, self.series, self.rank)
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        self._samples = value


def stat_samples(name: str, series: dict[Labels, float], rank: str) -> list[Sample]:
    """The samples `add_metric` would make, in one comprehension: a scrape of 10,000 series makes 10,000.

    The same samples (name, labels, value, no timestamp/exemplar/histogram), hence the
    same exposition; a label dict written out instead of zipped, no call per sample but
    `_make`: 12 -> 5 ms a scrape of 10,000 series.
    """
    try:
        return [
            _sample((name, {_POLICY: policy, _RULE: rule, _MODULE: module, _TENSOR: tensor, _MODEL: model,
                            "rank": rank}, value, None, None, None))
            for (policy, rule, module, tensor, model), value in series.items()
        ]
    except ValueError:  # a series of other labels (a store written directly): zipped as add_metric does
        names = (*STAT_LABELS, "rank")
        return [_sample((name, dict(zip(names, (*labels, rank))), value, None, None, None))
                for labels, value in series.items()]


class _Families:
    """A collector of the given families: the library encodes one family (or none) through it."""

    def __init__(self, *families: Metric) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


#: the library's encoders `choose_encoder` gives, whose text `Exposition` knows the shape of
_KNOWN = (text_format.generate_latest, openmetrics_format.generate_latest)


def _encoder_key(encoder: Encoder) -> Optional[tuple[Any, ...]]:
    """What an encoder `choose_encoder` made writes by (the function, escaping, version); None if unknown."""
    if isinstance(encoder, functools.partial):
        if encoder.func in _KNOWN and not encoder.args:
            return (encoder.func, *sorted(encoder.keywords.items()))
        return None
    return (encoder,) if encoder in _KNOWN else None


class Exposition:
    """Encodes `registry` as a library encoder would, statistic series' heads formatted once (module docstring).

    The heads are kept per encoder (format, escaping, version: `MAX_ENCODERS` at most, as
    clients choose them) and family, for the series of the last scrape only: a series
    forgotten by the store is forgotten here at the next scrape. One render at a time (a lock).
    """

    MAX_ENCODERS = 4

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._lock = threading.Lock()
        #: encoder key -> (family, rank) -> labels -> the series' line up to its value
        self._heads: dict[tuple[Any, ...], dict[tuple[str, str], dict[Labels, str]]] = {}

    def render(self, encoder: Encoder) -> bytes:
        """`encoder(registry)`'s bytes."""
        key = _encoder_key(encoder)
        if key is None:
            return encoder(self.registry)
        with self._lock:
            held = self._heads.pop(key, None)
            if held is None:
                held = {}
                while len(self._heads) >= self.MAX_ENCODERS:  # the encoder asked for least recently goes
                    del self._heads[next(iter(self._heads))]
            heads: dict[tuple[str, str], dict[Labels, str]] = {}
            self._heads[key] = heads  # the most recent last; only the families of this scrape stay
            tail = encoder(_Families())
            parts: list[bytes] = []
            for family in self.registry.collect():
                text = None
                if isinstance(family, StatFamily):
                    where = (family.name, family.rank)
                    heads[where] = held.get(where, {})
                    text = self._family(encoder, tail, family, heads, where)
                if text is None:
                    text = _without(encoder(_Families(family)), tail)
                parts.append(text)
            parts.append(tail)
            return b"".join(parts)

    @staticmethod
    def _family(encoder: Encoder, tail: bytes, family: StatFamily, held: dict[tuple[str, str], dict[Labels, str]],
                where: tuple[str, str]) -> Optional[bytes]:
        """The family's text from its series, or None where the library's text has another shape."""
        header = _without(encoder(_Families(GaugeMetricFamily(family.name, family.documentation))), tail)
        heads, series = held[where], family.series
        new = [labels for labels in series if labels not in heads]
        if new:
            probe = GaugeMetricFamily(family.name, family.documentation)
            probe.samples = stat_samples(family.name, dict.fromkeys(new, 0.0), family.rank)
            text = _without(encoder(_Families(probe)), tail)
            if not text.startswith(header):
                return None
            lines = text[len(header):].decode("utf-8").split("\n")
            if len(lines) != len(new) + 1 or lines[-1] or not all(line.endswith(" 0.0") for line in lines[:-1]):
                return None
            heads.update(zip(new, (line[:-4] for line in lines)))
        if len(heads) != len(series):  # series forgotten since: keep only the current ones
            heads = held[where] = {labels: heads[labels] for labels in series}
        body = "".join([f"{heads[labels]} {_value_text(value)}\n" for labels, value in series.items()])
        return header + body.encode("utf-8")


def _without(text: bytes, tail: bytes) -> bytes:
    return text[:len(text) - len(tail)] if tail else text


def metrics_app(registry: CollectorRegistry) -> WSGIApp:
    """prometheus_client's `make_wsgi_app(registry)`, its metrics text from an `Exposition`.

    A GET of the metrics (any path but /favicon.ico, as the library's) without `name[]` is
    answered here, with the library's own choice of format (`choose_encoder`) and of
    compression (`gzip_accepted`); every other request is the library app's.
    """
    library = make_wsgi_app(registry)
    exposition = Exposition(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if (environ.get("REQUEST_METHOD") != "GET" or environ.get("PATH_INFO") == "/favicon.ico"
                or "name[]" in parse_qs(environ.get("QUERY_STRING", ""))):
            return library(environ, start_response)  # type: ignore[no-any-return]
        encoder, content_type = text_format.choose_encoder(environ.get("HTTP_ACCEPT"))  # type: ignore[arg-type]
        body = exposition.render(encoder)
        headers = [("Content-Type", content_type)]
        if text_format.gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING")):  # type: ignore[arg-type]
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app
