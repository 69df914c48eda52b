"""Serve one process's metrics registry over HTTP for Prometheus to scrape.

`hookpolicy apply` gives every governed process its own `CollectorRegistry` and serves it
on `--metrics-addr`, port `--metrics-port` + LOCAL_RANK, so the ranks of one machine do
not collide. A port that cannot be bound is one line on stderr naming the rank and the
port; training goes on without metrics rather than crashing on an observability problem.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["serve", "BACKLOG"]

#: Pending connections the listening socket holds. prometheus_client's server keeps
#: socketserver's default of 5, so 50 scrapers connecting at once have most attempts
#: dropped by the kernel and retried after 1, 3, 7 s; 128 is the common kernel default.
BACKLOG = 128


class _Server(ThreadingWSGIServer):
    request_queue_size = BACKLOG


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on the training process's stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, rank: int = 0) -> Optional[WSGIServer]:
    """Start serving `registry` on http://addr:port/metrics in a daemon thread; None if it cannot."""
    server_class = _Server6 if ":" in addr else _Server
    try:
        server = make_server(addr, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
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
