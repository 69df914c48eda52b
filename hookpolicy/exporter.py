"""Serve one process's metrics registry over HTTP for Prometheus to scrape.

`hookpolicy apply` gives every governed process its own `CollectorRegistry` and serves it
on `--metrics-addr`, port `--metrics-port` + LOCAL_RANK, so the ranks of one machine do
not collide. A port that cannot be bound is one line on stderr naming the rank and the
port; training goes on without metrics rather than crashing on an observability problem.
"""

from __future__ import annotations

import sys
from typing import Optional
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["serve"]


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, rank: int = 0) -> Optional[WSGIServer]:
    """Start serving `registry` on http://addr:port/metrics in a daemon thread; None if it cannot."""
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        sys.stderr.write(
            f"hookpolicy: rank {rank}: cannot serve metrics on {addr}:{port}: {reason}; "
            "training continues without metrics\n"
        )
        sys.stderr.flush()
        return None
    return server
