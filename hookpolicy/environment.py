"""The environment contract: every variable hookpolicy reads, and how each one is read.

Three parties set them:

- you: `HOOKPOLICY_POLICY_DIRS` (folders of ops-managed policies), `HOOKPOLICY_OUTPUT_DIR`
  (where policy `log`/`tensors` paths point), `HOOKPOLICY_WATCH_INTERVAL`,
  `HOOKPOLICY_LOG_FORMAT` (alerts on stderr as readable lines or JSON; `apply --log-format`
  sets it too), `HOOKPOLICY_ALERT_LOG` (a file that gets every alert record as JSON, besides
  the file kept beside each capture log) and `HOOKPOLICY_RUN_ID` (the run's identity, which
  every log and alert record carries; `apply` sets one when you have not);
- `hookpolicy apply`, for every process of its COMMAND (`apply_variables` writes them,
  `ChildConfig.from_env` reads them back in the child): `HOOKPOLICY_BOOTSTRAP`,
  `HOOKPOLICY_POLICIES`, `HOOKPOLICY_AUDIT`, `HOOKPOLICY_STRICT`, `HOOKPOLICY_WATCH`,
  `HOOKPOLICY_METRICS_PORT`, `HOOKPOLICY_METRICS_ADDR`, `HOOKPOLICY_PUSH_GATEWAY`, `HOOKPOLICY_PUSH_JOB`,
  `HOOKPOLICY_RUN_DIR`; and, set by each
  process of COMMAND that imports torch, for the processes it starts: `HOOKPOLICY_PARENT`;
- the launcher (torchrun, Lightning, accelerate): `RANK` and `LOCAL_RANK`, read by the
  one rank rule here (`rank`), which both `attach` and the `apply` child use.

The README's environment table lists the same. This module imports nothing but the
standard library: the CLI reads it before torch is imported, and the bootstrap's one
variable (`ENV_BOOTSTRAP`) is spelled out in `apply/_bootstrap/sitecustomize.py`, which
must not import the package at all (a test keeps the two spellings equal).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = [
    "ENV_POLICY_DIRS", "ENV_OUTPUT_DIR", "ENV_WATCH_INTERVAL", "ENV_BOOTSTRAP", "ENV_POLICIES",
    "ENV_AUDIT", "ENV_STRICT", "ENV_WATCH", "ENV_METRICS_PORT", "ENV_METRICS_ADDR", "ENV_WEB_CONFIG", "ENV_TEXTFILE_DIR", "ENV_PUSH_GATEWAY", "ENV_PUSH_JOB", "ENV_RUN_DIR", "ENV_PARENT", "ENV_RANK",
    "ENV_LOCAL_RANK", "ENV_LOG_FORMAT", "ENV_ALERT_LOG", "ENV_RUN_ID", "DEFAULT_METRICS_ADDR", "DEFAULT_PUSH_JOB", "LOG_FORMATS", "ChildConfig",
    "alert_log", "apply_variables", "local_rank", "log_format", "new_run_id", "output_dir", "policy_dirs", "rank",
    "rank_identity", "run_id",
]

# -- set by you
#: Colon-separated folders whose policies `hookpolicy apply` (and `check`, `explain`, ...) always applies.
ENV_POLICY_DIRS = "HOOKPOLICY_POLICY_DIRS"
#: The folder that policy `log`/`tensors` paths are relative to (default: the working directory).
ENV_OUTPUT_DIR = "HOOKPOLICY_OUTPUT_DIR"
#: Seconds between two looks at the policy files and the reload request (default 1).
ENV_WATCH_INTERVAL = "HOOKPOLICY_WATCH_INTERVAL"
#: How alerts are written on stderr: `text` (one readable `hookpolicy:` line each, the
#: default) or `json` (one JSON record each); `apply --log-format` sets it for its COMMAND.
ENV_LOG_FORMAT = "HOOKPOLICY_LOG_FORMAT"
#: A file every alert record is appended to, as a JSON line, whatever the format on stderr
#: (they are kept beside each capture log too).
ENV_ALERT_LOG = "HOOKPOLICY_ALERT_LOG"
#: This run's identity, the `run` label of `hookpolicy_run_info`: unique per attempt (a
#: retried Job's new pod, a new `apply`), so the alerting rules tell a retry from the run
#: before it. Unset: `apply` sets a new one for its COMMAND, a process outside `apply` makes
#: its own. torchrun's TORCHELASTIC_RESTART_COUNT, when above 0, is appended (`ID.2`).
ENV_RUN_ID = "HOOKPOLICY_RUN_ID"

# -- set by `hookpolicy apply` for its COMMAND
#: Set to 1: the bootstrap is on (without it `_bootstrap/sitecustomize.py` does nothing).
ENV_BOOTSTRAP = "HOOKPOLICY_BOOTSTRAP"
#: The policy files and folders to apply, absolute, a JSON list (CLI + HOOKPOLICY_POLICY_DIRS):
#: a path may hold os.pathsep.
ENV_POLICIES = "HOOKPOLICY_POLICIES"
#: Set to 1: every rule runs in audit mode (`--audit`).
ENV_AUDIT = "HOOKPOLICY_AUDIT"
#: Set to 1: a rule that selects nothing on a governed model stops the process (`--strict`).
ENV_STRICT = "HOOKPOLICY_STRICT"
#: Set to 1: reload changed policy files (`--watch`).
ENV_WATCH = "HOOKPOLICY_WATCH"
#: Base port of the metrics endpoint (`--metrics-port`); rank r serves on port + LOCAL_RANK.
ENV_METRICS_PORT = "HOOKPOLICY_METRICS_PORT"
#: Address the metrics endpoint listens on (`--metrics-addr`, default 127.0.0.1).
ENV_METRICS_ADDR = "HOOKPOLICY_METRICS_ADDR"
#: A web config file (exporter-toolkit's format) securing the metrics endpoint with TLS and
#: basic auth (`--web-config`), absolute.
ENV_WEB_CONFIG = "HOOKPOLICY_WEB_CONFIG"
#: A folder node_exporter's textfile collector reads: every process writes its final series
#: there at exit (`--textfile-dir`), absolute.
ENV_TEXTFILE_DIR = "HOOKPOLICY_TEXTFILE_DIR"
#: A Pushgateway every process pushes its final series to at exit (`--push-gateway`).
ENV_PUSH_GATEWAY = "HOOKPOLICY_PUSH_GATEWAY"
#: The `job` of those pushes (`--push-job`, default hookpolicy).
ENV_PUSH_JOB = "HOOKPOLICY_PUSH_JOB"
#: A folder private to one `apply` run: `halt` (the halt line), `reload` (bumped on
#: SIGHUP), `governed-<pid>` (one per process that governs a model).
ENV_RUN_DIR = "HOOKPOLICY_RUN_DIR"
#: The rank (`rank_identity`) of the nearest process above that imported torch under
#: `apply`: a process started by exec with the same rank is a helper, not governed.
#: Remove it from a helper's environment to have that helper governed.
ENV_PARENT = "HOOKPOLICY_PARENT"

# -- set by the launcher
#: The global rank: the `rank` label of every sample.
ENV_RANK = "RANK"
#: The rank on this machine: the metrics port offset, and the `rank` label without RANK.
ENV_LOCAL_RANK = "LOCAL_RANK"

DEFAULT_METRICS_ADDR = "127.0.0.1"
DEFAULT_PUSH_JOB = "hookpolicy"
_DEFAULT_INTERVAL = 1.0
_MIN_INTERVAL = 0.05
_MAX_INTERVAL = 3600.0  # threading's waits refuse some larger timeouts (OverflowError)


def new_run_id() -> str:
    """A fresh run identity: the UTC start time and 6 random hex digits, `20261128T004300Z-3f9a1c`."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


_OWN_RUN_ID = new_run_id()


def run_id(environ: Mapping[str, str]) -> str:
    """HOOKPOLICY_RUN_ID (this process's own when unset), with torchrun's restart count when above 0."""
    base = environ.get(ENV_RUN_ID, "").strip() or _OWN_RUN_ID
    restarts = environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return f"{base}.{restarts}" if restarts.isdigit() and restarts.isascii() and int(restarts) else base


def policy_dirs(environ: Mapping[str, str]) -> list[str]:
    """The folders named by HOOKPOLICY_POLICY_DIRS (colon-separated; empty entries ignored)."""
    return [entry for entry in environ.get(ENV_POLICY_DIRS, "").split(":") if entry]


#: The values of HOOKPOLICY_LOG_FORMAT, the default first.
LOG_FORMATS = ("text", "json")


def log_format(environ: Mapping[str, str]) -> str:
    """HOOKPOLICY_LOG_FORMAT: `text` when unset or empty; another value than LOG_FORMATS' is a ValueError."""
    value = environ.get(ENV_LOG_FORMAT, "").strip().lower() or LOG_FORMATS[0]
    if value not in LOG_FORMATS:
        raise ValueError(f"{ENV_LOG_FORMAT}={environ[ENV_LOG_FORMAT]!r}: write one of {', '.join(LOG_FORMATS)}")
    return value


def alert_log(environ: Mapping[str, str]) -> Optional[str]:
    """The file named by HOOKPOLICY_ALERT_LOG, absolute (relative: to the working directory), or None."""
    value = environ.get(ENV_ALERT_LOG)
    return os.path.abspath(value) if value else None


def output_dir(environ: Mapping[str, str]) -> Optional[str]:
    """The folder named by HOOKPOLICY_OUTPUT_DIR, or None (unset or empty)."""
    return environ.get(ENV_OUTPUT_DIR) or None


def rank(environ: Mapping[str, str]) -> int:
    """This process's rank: RANK, else LOCAL_RANK, else 0 (a value that is no count is unset)."""
    for name in (ENV_RANK, ENV_LOCAL_RANK):
        value = _count(environ, name)
        if value is not None:
            return value
    return 0


def rank_identity(environ: Mapping[str, str]) -> str:
    """RANK/LOCAL_RANK as the launcher set them: a launcher gives each rank its own."""
    return "/".join(environ.get(name, "") for name in (ENV_RANK, ENV_LOCAL_RANK))


def local_rank(environ: Mapping[str, str]) -> int:
    """This process's rank on its machine: LOCAL_RANK, else 0."""
    value = _count(environ, ENV_LOCAL_RANK)
    return 0 if value is None else value


def _count(environ: Mapping[str, str], name: str) -> Optional[int]:
    """The variable as a non-negative integer, or None when unset or not one."""
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() and value.isascii() else None


def _watch_interval(environ: Mapping[str, str]) -> float:
    """HOOKPOLICY_WATCH_INTERVAL within [0.05, 3600] s; not a finite number: the default."""
    try:
        interval = float(environ.get(ENV_WATCH_INTERVAL) or _DEFAULT_INTERVAL)
    except ValueError:
        interval = _DEFAULT_INTERVAL
    if not math.isfinite(interval):
        interval = _DEFAULT_INTERVAL
    return min(max(interval, _MIN_INTERVAL), _MAX_INTERVAL)


def _sources(environ: Mapping[str, str]) -> tuple[str, ...]:
    """HOOKPOLICY_POLICIES: a JSON list of paths (os.pathsep-separated if it is not one)."""
    text = environ.get(ENV_POLICIES, "")
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    return tuple(s for s in text.split(os.pathsep) if s)


def apply_variables(
    sources: Sequence[str], run_dir: str, *, audit: bool, watch: bool,
    metrics_port: Optional[int], metrics_addr: str, strict: bool = False, log_format: Optional[str] = None,
    alert_log: Optional[str] = None, push_gateway: Optional[str] = None, push_job: str = DEFAULT_PUSH_JOB,
    web_config: Optional[str] = None, textfile_dir: Optional[str] = None,
) -> dict[str, Optional[str]]:
    """What `hookpolicy apply` sets for its COMMAND; None means "remove it if inherited".

    `log_format` and `alert_log` are set only when given: otherwise an inherited value stands.
    """
    variables: dict[str, Optional[str]] = {
        ENV_BOOTSTRAP: "1",
        ENV_POLICIES: json.dumps(list(sources)),
        ENV_RUN_DIR: run_dir,
        ENV_AUDIT: "1" if audit else "",
        ENV_STRICT: "1" if strict else "",
        ENV_WATCH: "1" if watch else "",
        ENV_METRICS_ADDR: metrics_addr,
        ENV_METRICS_PORT: None if metrics_port is None else str(metrics_port),
        ENV_WEB_CONFIG: web_config,
        ENV_TEXTFILE_DIR: textfile_dir,
        ENV_PUSH_GATEWAY: push_gateway,
        ENV_PUSH_JOB: None if push_gateway is None else push_job,
    }
    for name, value in ((ENV_LOG_FORMAT, log_format), (ENV_ALERT_LOG, alert_log)):
        if value is not None:
            variables[name] = value
    return variables


@dataclass(frozen=True)
class ChildConfig:
    """What `apply` asked of this process, read back from `apply_variables` and the launcher's."""

    sources: tuple[str, ...]
    audit: bool = False
    strict: bool = False
    watch: bool = False
    interval: float = _DEFAULT_INTERVAL
    metrics_port: Optional[int] = None
    metrics_addr: str = DEFAULT_METRICS_ADDR
    web_config: Optional[str] = None
    run_dir: Optional[str] = None
    push_gateway: Optional[str] = None
    push_job: str = DEFAULT_PUSH_JOB
    textfile_dir: Optional[str] = None
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "ChildConfig":
        return cls(
            sources=_sources(environ),
            audit=bool(environ.get(ENV_AUDIT)),
            strict=bool(environ.get(ENV_STRICT)),
            watch=bool(environ.get(ENV_WATCH)),
            interval=_watch_interval(environ),
            metrics_port=_count(environ, ENV_METRICS_PORT),
            metrics_addr=environ.get(ENV_METRICS_ADDR) or DEFAULT_METRICS_ADDR,
            web_config=environ.get(ENV_WEB_CONFIG) or None,
            run_dir=environ.get(ENV_RUN_DIR) or None,
            push_gateway=environ.get(ENV_PUSH_GATEWAY) or None,
            push_job=environ.get(ENV_PUSH_JOB) or DEFAULT_PUSH_JOB,
            textfile_dir=environ.get(ENV_TEXTFILE_DIR) or None,
            rank=rank(environ),
            local_rank=local_rank(environ),
        )
