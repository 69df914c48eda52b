"""A process's final series pushed to a Prometheus Pushgateway at exit (`apply --push-gateway`).

A pull-based Prometheus never sees what a process did after its last scrape: a job
shorter than the scrape interval, or the steps, skips and alerts between the last scrape
and a halt. At exit `apply`'s child pushes its whole registry once, grouped by `job`,
`rank` and `run` (`HOOKPOLICY_RUN_ID`), so each attempt of each rank is a group of its own
and a retry never overwrites the attempt before; the Pushgateway keeps a group until it is
deleted. What goes wrong is one line, never an exception: the exit goes on.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, push_to_gateway

__all__ = ["PUSH_TIMEOUT", "push_final"]

#: Seconds one push may take: the process waits for it at exit (torchrun gives 30 s after SIGTERM).
PUSH_TIMEOUT = 5.0


def push_final(
    registry: CollectorRegistry, gateway: str, *, job: str, rank: int, run: str, timeout: float = PUSH_TIMEOUT,
) -> str:
    """PUT the registry's series to `gateway` as the group job/rank/run; return the line to say."""
    group = f"job {job!r}, rank {rank}, run {run!r}"
    try:
        push_to_gateway(gateway, job=job, registry=registry, grouping_key={"rank": str(rank), "run": run},
                        timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - urllib's errors, a bad URL: said, and the exit goes on
        return f"error: could not push the final series to {gateway} ({group}): {type(exc).__name__}: {exc}"
    return f"pushed the final series to {gateway} ({group})"
