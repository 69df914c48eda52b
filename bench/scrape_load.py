"""What 50 clients scraping /metrics in a loop cost a training step (issue 6's exporter load).

    python bench/scrape_load.py                 # 3 rounds, ~2 minutes on 2 CPU cores
    python bench/scrape_load.py --rounds 5 --layers 200
    python bench/scrape_load.py --scrapers 1 --period 0 --raw    # one client in a tight loop (issue 15)

A training process (an MLP of `--layers` hidden Linear layers, one torch thread,
`policies/scraped.yaml`: a NaN guard, per-tensor gradient statistics, output statistics) records
every step's duration. The harness measures 2 s with no scraper, 4 s with 50 threads in
another process each scraping in a loop (one scrape every `--period` seconds, so every
server is offered the same load; 0.25 s is 200 scrapes a second, where Prometheus sends
one every 15 s) and parsing what it gets, and 2 s without again; the slowdown is the
median step under load over the median step without. Servers, one
fresh training process each, taken in turn (A B C, A B C, ...):

- `hookpolicy`: the policy attached and its registry served by `hookpolicy.export.exporter.serve`
  (what `hookpolicy apply --metrics-port` runs);
- `stock`: the same registry served by prometheus_client's `start_http_server` (a thread
  per request, a fresh rendering per scrape);
- `elsewhere`: the same policy attached, and the scrapers get the same bytes from a
  static server in the harness process: what the load costs the machine (the scrapers and
  a server share its cores) with nothing of it inside the training process.

Timings are reported, never asserted (tests/test_reliability_exporter.py checks the answers).
"""

from __future__ import annotations

import argparse
import http.server
import os
import random
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

SERVERS = ("hookpolicy", "stock", "elsewhere")
QUIET_S, LOAD_S, WARM_S = 2.0, 4.0, 3.0

POLICY = Path(__file__).resolve().parent / "policies" / "scraped.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(server: str, port: int, layers: int, folder: Path) -> None:
    """The training process: serve, then step until `folder/stop` appears."""
    import torch
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    import hookpolicy
    from hookpolicy.export.exporter import serve

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = [m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), *hidden, torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    registry = CollectorRegistry()
    hookpolicy.load(POLICY).attach(model, registry=registry)
    x = torch.randn(64, 64)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(10):
        step()
    if server == "hookpolicy":
        serve(registry, port)
    elif server == "stock":
        start_http_server(port, addr="127.0.0.1", registry=registry)
    else:
        (folder / "metrics").write_bytes(generate_latest(registry))
    (folder / "ready").touch()
    with open(folder / "times", "w", buffering=1) as out:
        while not (folder / "stop").exists():
            start, wall = time.perf_counter(), time.time()
            step()
            out.write(f"{wall} {time.perf_counter() - start}\n")


def static_server(folder: Path, port: int) -> None:
    """Serve `folder/metrics` to every GET: the `elsewhere` server."""
    body = (folder / "metrics").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        request_queue_size = 128

    Server(("127.0.0.1", port), Handler).serve_forever()


def scrape_loop(
    port: int, period: float, deadline: float, latencies: list[float], errors: list[str], parse: bool = True,
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    due = time.monotonic() + random.uniform(0, period)
    while due < deadline and time.monotonic() < deadline:  # (with period 0, `due` stays put)
        time.sleep(max(0.0, due - time.monotonic()))
        due += period
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
                text = answer.read().decode()
            latencies.append(time.perf_counter() - start)
            if parse:
                list(text_string_to_metric_families(text))
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")


def one_run(server: str, layers: int, period: float, scrapers: int, parse: bool = True) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder, port = Path(tmp), free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                             os.environ.get("PYTHONPATH", "")])}
        child = subprocess.Popen([sys.executable, __file__, "--train", server, "--port", str(port),
                                  "--layers", str(layers), "--folder", tmp], env=env)
        static: Optional[threading.Thread] = None
        try:
            deadline = time.monotonic() + 120
            while not (folder / "ready").exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the {server} training process did not come up")
                time.sleep(0.05)
            if server == "elsewhere":
                static = threading.Thread(target=static_server, args=(folder, port), daemon=True)
                static.start()  # its own thread here; the scrapers' parsing is in this process too
            time.sleep(WARM_S)
            quiet_before = (time.time(), time.time() + QUIET_S)
            time.sleep(QUIET_S)
            latencies: list[float] = []
            errors: list[str] = []
            load_start, until = time.time(), time.monotonic() + LOAD_S
            threads = [threading.Thread(target=scrape_loop, args=(port, period, until, latencies, errors, parse))
                       for _ in range(scrapers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            load = (load_start, time.time())
            quiet_after = (time.time(), time.time() + QUIET_S)
            time.sleep(QUIET_S)
        finally:
            (folder / "stop").touch()
            child.wait(60)
        rows = [tuple(map(float, line.split())) for line in (folder / "times").read_text().splitlines()
                if len(line.split()) == 2]

        def median_in(*windows: tuple[float, float]) -> float:
            return statistics.median(dt for wall, dt in rows if any(a <= wall < b for a, b in windows))

        quiet, loaded = median_in(quiet_before, quiet_after), median_in(load)
        latencies.sort()
        return {
            "step_ms": 1000 * quiet, "slowdown": loaded / quiet, "scrapes_per_s": len(latencies) / (load[1] - load[0]),
            "p95_ms": 1000 * latencies[int(len(latencies) * 0.95)] if latencies else float("nan"),
            "errors": float(len(errors)),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1, help="hidden Linear layers (series grow with them)")
    parser.add_argument("--period", type=float, default=0.25, help="seconds between two scrapes of one scraper")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--scrapers", type=int, default=50,
                        help="scraping threads (1 with --period 0: one client in a tight loop, issue 15's flood)")
    parser.add_argument("--raw", action="store_true",
                        help="scrapers do not parse what they get (a flood: as many requests as the server answers)")
    parser.add_argument("--train", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args.train, args.port, args.layers, Path(args.folder))
        return
    servers = args.servers.split(",")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
    for index in range(args.rounds):
        for server in servers[index % len(servers):] + servers[:index % len(servers)]:
            result = one_run(server, args.layers, args.period, args.scrapers, not args.raw)
            results[server].append(result)
            print(f"round {index + 1} {server:10s} " + " ".join(f"{k}={v:.3g}" for k, v in result.items()), flush=True)
    print(f"\n{args.scrapers} scraper(s), one scrape each every {args.period} s, {args.layers} hidden layer(s), "
          f"{args.rounds} rounds:")
    print("| server | step (quiet) | median slowdown under load | range | scrapes/s | scrape p95 | errors |")
    print("|---|---|---|---|---|---|---|")
    for server, rows in results.items():
        slow = [r["slowdown"] for r in rows]
        print(f"| {server} | {statistics.median(r['step_ms'] for r in rows):.2f} ms | {statistics.median(slow):.3f}x "
              f"| {min(slow):.3f}-{max(slow):.3f}x | {statistics.median(r['scrapes_per_s'] for r in rows):.0f} "
              f"| {statistics.median(r['p95_ms'] for r in rows):.0f} ms | {sum(r['errors'] for r in rows):.0f} |")


if __name__ == "__main__":
    main()
