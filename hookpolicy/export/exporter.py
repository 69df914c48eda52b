"""Serve one process's metrics registry over HTTP for Prometheus to scrape.

`hookpolicy apply` gives every governed process its own `CollectorRegistry` and serves it
on `--metrics-addr`, port `--metrics-port` + LOCAL_RANK, so the ranks of one machine do
not collide. A port that cannot be bound is one line on stderr naming the rank and the
port; training goes on without metrics rather than crashing on an observability problem.

The exporter shares the training process and its GIL, so what a scrape costs is taken
from training. The values change once per step at most, so a rendering of the registry
is reused for `RENDER_INTERVAL` seconds: however many clients scrape however often, the
registry is rendered at most once per interval (per kind of request), and the scrapes in
between cost only their HTTP exchange.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["serve", "BACKLOG", "RENDER_INTERVAL", "REQUEST_TIMEOUT", "RenderCache"]

#: Pending connections the listening socket holds. prometheus_client's server keeps
#: socketserver's default of 5, so 50 scrapers connecting at once have most attempts
#: dropped by the kernel and retried after 1, 3, 7 s; 128 is the common kernel default.
BACKLOG = 128

#: Seconds a rendering of the registry is served again. Prometheus, scraping every
#: 15-60 s, always gets a fresh one; 50 clients scraping in a loop share one a second.
RENDER_INTERVAL = 1.0

#: The request fields prometheus_client's WSGI app answers by (format, compression, name[]).
_REQUEST_KEY = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT", "HTTP_ACCEPT_ENCODING")

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class RenderCache:
    """A WSGI app that replays `app`'s answer to the same request for `interval` seconds.

    One lock: while one request renders, the others of the moment wait for its result
    instead of rendering it again each. A rendering that raises is answered with a 500
    and one line on stderr (the first time that error is seen), not cached, and never a
    traceback on the training script's stderr.
    """

    MAX_KEYS = 16  # request kinds remembered; clients choose the headers, so it is bounded

    def __init__(self, app: WSGIApp, interval: float = RENDER_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self._app, self._interval, self._clock = app, interval, clock
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, ...], tuple[float, str, list[tuple[str, str]], bytes]] = {}
        self._reported: set[str] = set()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        key = tuple(str(environ.get(name, "")) for name in _REQUEST_KEY)
        with self._lock:
            answer = self._answers.get(key)
            if answer is None or self._clock() - answer[0] >= self._interval:
                answer = self._render(environ, key)
        _, status, headers, body = answer
        start_response(status, list(headers))
        return [body]

    def _render(self, environ: dict[str, Any], key: tuple[str, ...]) -> tuple[float, str, list[tuple[str, str]], bytes]:
        started: list[Any] = []
        try:
            body = b"".join(self._app(environ, lambda status, headers, exc_info=None: started.extend((status, headers))))
        except Exception as exc:  # noqa: BLE001 - a broken collector must not reach the script's stderr as a traceback
            reason = f"{type(exc).__name__}: {exc}"
            if reason not in self._reported and len(self._reported) < self.MAX_KEYS:
                self._reported.add(reason)
                sys.stderr.write(f"hookpolicy: cannot render metrics: {reason}\n")
            return (-float("inf"), "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")],
                    f"cannot render metrics: {reason}\n".encode())
        answer = (self._clock(), str(started[0]), list(started[1]), body)
        if len(self._answers) >= self.MAX_KEYS:
            self._answers.clear()
        self._answers[key] = answer
        return answer


#: Seconds a connection may take to send its request or read the answer. Requests are
#: answered one after the other on the exporter's one thread, so this bounds how long a
#: stalled client can hold the others back (Prometheus's scrape timeout is 10 s).
REQUEST_TIMEOUT = 5.0


class _Server(WSGIServer):
    """Answers requests one at a time on the serving thread.

    prometheus_client's server starts a thread per request; under 50 clients scraping in
    a loop those threads' fight for the GIL slowed a 1 ms training step by ~30 %, one
    thread (with the rendering cached) by ~5 % (docs/reliability.md).
    """

    request_queue_size = BACKLOG

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or hung up is dropped quietly; anything else is one line.

        (socketserver's default prints a traceback on the training script's stderr.)
        """
        kind, exc = sys.exc_info()[:2]
        if isinstance(exc, OSError):
            return
        sys.stderr.write(f"hookpolicy: a metrics request from {client_address[0]} failed: "
                         f"{getattr(kind, '__name__', kind)}: {exc}\n")


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on the training process's stderr; a stalled client times out."""

    timeout = REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve(
    registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, rank: int = 0,
    render_interval: float = RENDER_INTERVAL,
) -> Optional[WSGIServer]:
    """Start serving `registry` on http://addr:port/metrics in a daemon thread; None if it cannot."""
    server_class = _Server6 if ":" in addr else _Server
    app = RenderCache(make_wsgi_app(registry), render_interval)
    try:
        server = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        sys.stderr.write(
            f"hookpolicy: rank {rank}: cannot serve metrics on {addr}:{port}: {reason}; "
            "training continues without metrics\n"
        )
        sys.stderr.flush()
        return None
    threading.Thread(target=server.serve_forever, name="hookpolicy-exporter", daemon=True).start()
    return server
