"""Serve one process's metrics registry over HTTP for Prometheus to scrape.

`hookpolicy apply` gives every governed process its own `CollectorRegistry` and serves it
on `--metrics-addr`, port `--metrics-port` + LOCAL_RANK, so the ranks of one machine do
not collide. A port that cannot be bound is one line on stderr naming the rank and the
port; training goes on without metrics rather than crashing on an observability problem.

The exporter shares the training process and its GIL, so what a scrape costs is taken
from training. The values change once per step at most, so a rendering of the registry
is reused for `RENDER_INTERVAL` seconds: however many clients scrape however often, the
registry is rendered at most once per interval (per kind of request), and the scrapes in
between cost only their HTTP exchange. Those exchanges are capped too: at most
`MAX_ANSWERS_PER_SECOND` answers a second (more wait their turn), so a scrape flood costs
training a bounded share.

No client can hold the others back: one asyncio loop on one daemon thread serves every
connection at once; a connection has `REQUEST_DEADLINE` seconds in all (not per read) to
send its request and take the answer; at most `MAX_CONNECTIONS` are open, and a new one
beyond that closes the oldest (so a flood of idle connections cannot keep Prometheus out).

A child forked from the process (`os.fork`, a fork DataLoader worker, a helper) closes its
copy of the listening socket at once: a child outliving the training would otherwise hold
the port, so that scrapes hang unanswered and the next run cannot bind it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional
from urllib.parse import unquote

from prometheus_client import CollectorRegistry

from ..process import Once, start_thread
from ..say import say
from .exposition import metrics_app
from .webconfig import LiveWebConfig, WebConfig

__all__ = [
    "BACKLOG", "Exporter", "MAX_ANSWERS_PER_SECOND", "MAX_CONNECTIONS", "RENDER_INTERVAL", "REQUEST_DEADLINE",
    "RenderCache", "serve",
]

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
        self._said = Once(limit=self.MAX_KEYS)  # error texts said; clients choose them, so bounded

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
            if self._said(reason):
                say(f"cannot render metrics: {reason}", logging.ERROR)
            return (-float("inf"), "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")],
                    f"cannot render metrics: {reason}\n".encode())
        answer = (self._clock(), str(started[0]), list(started[1]), body)
        if len(self._answers) >= self.MAX_KEYS:
            self._answers.clear()
        self._answers[key] = answer
        return answer


#: Seconds a connection has, in all, to send its request and take the answer: a client
#: dripping a byte at a time is cut off after this, however regular its drips.
#: (Prometheus's scrape timeout is 10 s; an answer takes milliseconds.)
REQUEST_DEADLINE = 5.0

#: Connections open at once. One more closes the oldest: idle or slow clients cannot
#: fill the exporter and keep a real scrape out.
MAX_CONNECTIONS = 64

#: Answers a second at most; a request beyond waits for its turn (within its deadline).
#: Prometheus asks once every 15-60 s; a client in a tight loop gets 50 a second, which
#: costs the training thread a few percent at most (docs/reliability.md, bench/scrape_load.py).
MAX_ANSWERS_PER_SECOND = 50.0

#: The longest request head read (request line and headers).
MAX_REQUEST_BYTES = 8192

class Exporter:
    """The metrics endpoint: an asyncio server on a daemon thread (see the module docstring).

    `shutdown()` stops it and waits for the thread; `server_close()` closes the socket.
    """

    request_queue_size = BACKLOG

    def __init__(
        self, app: WSGIApp, sock: socket.socket, *, deadline: Optional[float] = None,
        max_connections: Optional[int] = None, rate: Optional[float] = None, web: Optional[WebConfig] = None,
    ) -> None:
        self._app, self._sock = app, sock
        self._checking: Optional[asyncio.Lock] = None  # one bcrypt check at a time
        #: the web config, read again when its files change; each handshake takes the current TLS context
        self._web = None if web is None else LiveWebConfig(web)
        self._tls = None if web is None else web.tls
        if self._tls is not None:
            self._tls.sni_callback = self._handshake  # called at every ClientHello, with SNI or without
        self.server_address = sock.getsockname()
        self.deadline = REQUEST_DEADLINE if deadline is None else deadline
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.rate = MAX_ANSWERS_PER_SECOND if rate is None else rate
        self._loop = asyncio.new_event_loop()
        self._open: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self._next_answer = 0.0
        # made here, not on the exporter thread: a shutdown() that comes before that thread
        # reaches its loop (a script that ends at once, a busy machine) must still stop it
        self._stopped = asyncio.Event()
        self._thread = start_thread("exporter", self._run)
        _LISTENING.add(self)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            try:  # queued on the loop, also one not running yet: its first turn sets the event
                self._loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:  # the loop closed meanwhile: the thread is ending on its own
                pass
        self._thread.join(timeout=5)

    def server_close(self) -> None:
        self._sock.close()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        # the TLS handshake has the request's deadline too: a client that stalls it is cut off
        server = await asyncio.start_server(self._client, sock=self._sock, limit=MAX_REQUEST_BYTES, ssl=self._tls,
                                            ssl_handshake_timeout=None if self._tls is None else self.deadline)
        async with server:
            await self._stopped.wait()
        for writer in list(self._open):
            writer.transport.abort()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = None
        if len(self._open) > self.max_connections:
            next(iter(self._open)).transport.abort()  # the oldest makes room
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self.deadline)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # too slow, hung up, or a head too long: dropped quietly
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback on the script's stderr
            peer = writer.get_extra_info("peername") or ("?",)
            say(f"a metrics request from {peer[0]} failed: {type(exc).__name__}: {exc}", logging.ERROR)
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        environ = _environ(head)
        await self._turn()
        if environ is None:
            status, headers, body = "400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n"
        elif not await self._authorized(environ.get("HTTP_AUTHORIZATION")):
            status, headers, body = "401 Unauthorized", [
                ("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", 'Basic realm="hookpolicy"')], \
                b"Unauthorized\n"
        else:
            started: list[Any] = []
            body = b"".join(self._app(environ, lambda status, headers, exc_info=None: started.extend((status, headers))))
            status, headers = str(started[0]), list(started[1])
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
                 f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1") + body)
        await writer.drain()

    async def _authorized(self, header: Optional[str]) -> bool:
        """Whether the web config's basic auth lets this request in (always, without basic_auth_users).

        A bcrypt check costs 50-300 ms of CPU: it runs off the loop, one at a time, so a
        flood of wrong passwords neither stalls the other connections nor takes more than
        one core; a password that passed once is remembered and costs nothing again.
        """
        credentials = None if self._web is None else self._web.current().credentials
        if credentials is None or credentials.remembered(header):
            return True
        if self._checking is None:  # made on the loop's own thread
            self._checking = asyncio.Lock()
        async with self._checking:
            return await self._loop.run_in_executor(None, credentials.check, header)

    def _handshake(self, connection: ssl.SSLObject, server_name: Optional[str], context: ssl.SSLContext) -> None:
        """A TLS ClientHello: serve it with the web config's current context (a renewed certificate)."""
        try:
            current = None if self._web is None else self._web.current().tls
            if current is not None and current is not context:
                connection.context = current
        except Exception as exc:  # noqa: BLE001 - never a traceback from inside OpenSSL's callback
            say(f"metrics endpoint: cannot take the renewed web config: {type(exc).__name__}: {exc}", logging.ERROR)

    async def _turn(self) -> None:
        """Wait until the answer rate allows one more (answers are spaced 1/rate apart)."""
        now = self._loop.time()
        slot = max(now, self._next_answer)
        self._next_answer = slot + 1.0 / self.rate
        if slot > now:
            await asyncio.sleep(slot - now)


#: Every exporter of this process whose socket may be open; a forked child closes them.
_LISTENING: "weakref.WeakSet[Exporter]" = weakref.WeakSet()


def _close_in_forked_child() -> None:
    """os.register_at_fork(after_in_child=...): the child serves nothing (its exporter thread did not survive)."""
    for exporter in list(_LISTENING):
        exporter.server_close()
    _LISTENING.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


def _environ(head: bytes) -> Optional[dict[str, Any]]:
    """The WSGI fields prometheus_client's app reads, from a request head; None if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    path, _, query = parts[1].partition("?")
    environ: dict[str, Any] = {"REQUEST_METHOD": parts[0], "PATH_INFO": unquote(path), "QUERY_STRING": query}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
    return environ


def serve(
    registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, rank: int = 0,
    render_interval: float = RENDER_INTERVAL, web: Optional[WebConfig] = None,
) -> Optional[Exporter]:
    """Start serving `registry` on http(s)://addr:port/metrics in a daemon thread; None if it cannot.

    `web` (a loaded `--web-config`) adds its TLS and basic auth.
    """
    try:
        sock = socket.create_server(
            (addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET, backlog=BACKLOG,
        )
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        say(f"rank {rank}: cannot serve metrics on {addr}:{port}: {reason}; training continues without metrics",
            logging.WARNING)
        return None
    exporter = Exporter(RenderCache(metrics_app(registry), render_interval), sock, web=web)
    exporter.start()
    return exporter


def metrics_url(addr: str, port: int, *, tls: bool = False) -> str:
    host = f"[{addr}]" if ":" in addr else addr
    return f"{'https' if tls else 'http'}://{host}:{port}/metrics"
