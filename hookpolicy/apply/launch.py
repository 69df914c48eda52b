"""The parent side of `hookpolicy apply`: run a COMMAND whose Python processes carry the policy.

The wrapper never imports the user's script. It validates the policies, then starts the
COMMAND with an environment that makes every Python process in it run hookpolicy's
bootstrap (`_bootstrap/sitecustomize.py`, first on PYTHONPATH), waits for it, and turns
the way it ended into an exit status:

- the COMMAND's own status; 128+N when a signal N killed it (as shells report it);
- 3 when a process halted training: the child's `sys.excepthook` wrote the `Halt` line to
  `halt` in the run folder, and the parent prints that one line on stderr;
- 127 when the COMMAND cannot be found, 126 when it cannot be executed (as shells do).

Every process of the COMMAND writes its records with one run id (HOOKPOLICY_RUN_ID: yours
when set, else a new one). With `--report PATH`, when the COMMAND has ended the parent
draws this run of the policies' capture logs, with the alert records kept beside them
(and HOOKPOLICY_ALERT_LOG's file, when you set one), into PATH (`hookpolicy report`'s page). `--log-format json` has the alerts written on
stderr as JSON records instead of readable lines (HOOKPOLICY_LOG_FORMAT).

Signals: the COMMAND runs in its own session and process group, so the parent decides
what reaches it. SIGINT (Ctrl-C), SIGTERM and SIGQUIT sent to the parent are forwarded to
the whole group (a launcher and its workers alike). SIGHUP means "reload the policies":
the parent bumps the `reload` file of the run folder, which every governed process polls;
it is not forwarded as a signal, because launchers such as torchrun stop the job on SIGHUP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Mapping, Optional, Sequence

from ..environment import DEFAULT_METRICS_ADDR, DEFAULT_PUSH_JOB, ENV_RUN_ID, alert_log, apply_variables, new_run_id, run_id
from ..say import say

__all__ = ["BOOTSTRAP_DIR", "HALT_STATUS", "Launch", "child_environment", "resolve_command", "run"]

#: The folder that goes first on the children's PYTHONPATH.
BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")

#: `hookpolicy apply`'s exit status when a policy halted training.
HALT_STATUS = 3

_PYTHON_NAMES = ("python", "python3")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)


@dataclass(frozen=True)
class Launch:
    """What `apply` runs: the policy sources (absolute) and its options."""

    sources: tuple[str, ...]
    metrics_port: Optional[int] = None
    metrics_addr: str = DEFAULT_METRICS_ADDR
    audit: bool = False
    watch: bool = False
    strict: bool = False
    #: `--report`: the HTML page to write at the end (absolute), and the capture logs it draws
    report: Optional[str] = None
    report_logs: tuple[str, ...] = ()
    #: `--log-format`: None leaves HOOKPOLICY_LOG_FORMAT as inherited
    log_format: Optional[str] = None
    #: `--push-gateway`, `--push-job`: where each process pushes its final series at exit
    push_gateway: Optional[str] = None
    push_job: str = DEFAULT_PUSH_JOB
    #: `--web-config`: the exporter-toolkit web config (absolute) securing the metrics endpoint
    web_config: Optional[str] = None
    #: `--textfile-dir`: the folder each process writes its final series to at exit (absolute)
    textfile_dir: Optional[str] = None


def resolve_command(command: Sequence[str]) -> list[str]:
    """The argv to execute: `train.py args` runs with this Python; anything else as given.

    `python train.py`, `python -m pkg` and launchers (`torchrun ...`) are run as written,
    found on PATH; their Python must have hookpolicy installed (the bootstrap says so
    clearly when it has not).
    """
    argv = list(command)
    if argv and argv[0].endswith(".py") and os.path.basename(argv[0]) not in _PYTHON_NAMES:
        return [sys.executable, *argv]
    return argv


def child_environment(launch: Launch, run_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The COMMAND's environment: the user's, plus the bootstrap and `environment.apply_variables`."""
    env = dict(environ)
    python_path = [BOOTSTRAP_DIR, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    variables = apply_variables(
        launch.sources, run_dir, audit=launch.audit, watch=launch.watch,
        metrics_port=launch.metrics_port, metrics_addr=launch.metrics_addr, strict=launch.strict,
        log_format=launch.log_format, push_gateway=launch.push_gateway, push_job=launch.push_job,
        web_config=launch.web_config, textfile_dir=launch.textfile_dir,
    )
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    if not env.get(ENV_RUN_ID, "").strip():  # one identity for every rank of this run
        env[ENV_RUN_ID] = new_run_id()
    return env


def run(launch: Launch, command: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> int:
    """Run COMMAND under the policies; return the exit status `hookpolicy apply` exits with."""
    argv = resolve_command(command)
    if os.sep not in argv[0] and shutil.which(argv[0]) is None:
        say(f"error: command not found: {argv[0]}")
        return 127
    run_dir = tempfile.mkdtemp(prefix="hookpolicy-run-")
    try:
        given = os.environ if environ is None else environ
        env = child_environment(launch, run_dir, given)
        status = _supervise(argv, env, run_dir)
        if launch.report:
            _write_report(launch.report, launch.report_logs, alert_log(given), run_id(env))
        halt = _read_halt(run_dir)
        if halt is not None:
            say(halt)  # already starts with 'hookpolicy: ', which say does not repeat
            return HALT_STATUS
        if status == 0 and not any(n.startswith("governed-") for n in os.listdir(run_dir)):
            say(
                "warning: no model was governed: COMMAND trained no model that hookpolicy "
                "could see, and evaluated none that a rule with phase: eval or any binds (see "
                "'Discovery' in the README for what it looks for)"
            )
        return status
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(argv: list[str], env: dict[str, str], run_dir: str) -> int:
    """Start the COMMAND in its own session, forward signals to its group, wait for it."""
    child: Optional[subprocess.Popen[bytes]] = None
    early: list[int] = []  # signals that came before the child existed
    reloads = 0

    def forward(signum: int, frame: Optional[FrameType]) -> None:
        if child is None:
            early.append(signum)
        elif child.returncode is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    def reload(signum: int, frame: Optional[FrameType]) -> None:
        nonlocal reloads
        reloads += 1
        request = Path(run_dir, "reload")
        request.with_suffix(".tmp").write_text(str(reloads), encoding="utf-8")
        os.replace(request.with_suffix(".tmp"), request)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    try:
        try:
            child = subprocess.Popen(argv, env=env, start_new_session=True)
        except FileNotFoundError:
            say(f"error: command not found: {argv[0]}")
            return 127
        except OSError as exc:  # permission denied, not an executable format, ...
            say(f"error: cannot execute {argv[0]}: {exc.strerror or exc}")
            return 126
        for signum in early:
            forward(signum, None)
        status = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status


def _write_report(page: str, logs: Sequence[str], alerts: Optional[str], run: str) -> None:
    """Draw this run of the capture logs (with the alert records kept beside them, and `alerts`, the
    HOOKPOLICY_ALERT_LOG file, if any) into `page`; one line either way."""
    from ..export.report import ReportError, write_report

    written = [log for log in logs if os.path.isfile(log)]
    if not written:
        say(f"no report: no capture of the policies wrote a log ({', '.join(logs) or 'none has `log: {path: ...}`'})")
        return
    try:
        done = write_report([*written, *([alerts] if alerts and os.path.isfile(alerts) else [])], Path(page),
                            runs=[run])
    except ReportError as exc:
        say(f"no report: {exc}")
        return
    except OSError as exc:
        say(f"no report: cannot write {page}: {exc.strerror or exc}")
        return
    say(f"report: {page} ({done.count} figure(s) from {', '.join(written)})")


def _read_halt(run_dir: str) -> Optional[str]:
    try:
        text = Path(run_dir, "halt").read_text(encoding="utf-8")
    except OSError:
        return None
    return text.splitlines()[0] if text.strip() else None

