"""The `hookpolicy` command line: a thin edge over the loader, the plan and the launcher.

Exit statuses (spec section 6): 0 success; 1 an invalid policy (every problem on its
own line as `FILE:LINE:COL: $.path: message`) or another user mistake reported in one
line; 2 a usage error (click's); `apply` exits with its COMMAND's status, 3 on halt.
Heavy modules (the launcher, the exporters) are imported inside the commands that use
them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

import click

from . import __version__
from . import environment
from .environment import LOG_FORMATS, policy_dirs
from .errors import PolicyError
from .say import PREFIX, say
from .policy.model import Policy, rule_name

__all__ = ["cli", "main"]

_COMMAND_KEY = "hookpolicy.command"


class PolicyProblems(click.ClickException):
    """An invalid policy: prints each problem on its own line (no "Error:" prefix); exit 1.

    `notes` follow the problems: where files came from (HOOKPOLICY_POLICY_DIRS, which the
    user may not know is set) and what was not done because of them.
    """

    def __init__(self, error: PolicyError, notes: Sequence[str] = (), prefixed: bool = False) -> None:
        super().__init__(str(error))
        self.problems = error.problems
        self.notes = list(notes)
        #: under `apply`, problems are hookpolicy's lines among the run's: `hookpolicy: FILE:LINE:COL: ...`
        self.prefixed = prefixed

    def show(self, file: Any = None) -> None:
        for problem in self.problems:
            click.echo(f"{PREFIX if self.prefixed else ''}{problem}", err=True)
        for note in self.notes:
            click.echo(f"{PREFIX}{note}", err=True)


def _sources(policies: Sequence[str]) -> list[str]:
    """The POLICY arguments plus every folder named by HOOKPOLICY_POLICY_DIRS."""
    sources = [*policies, *policy_dirs(os.environ)]
    if not sources:
        raise click.UsageError("no policy given: name POLICY files or folders, or set HOOKPOLICY_POLICY_DIRS")
    return sources


def _load(sources: Sequence[str], not_done: Optional[str] = None) -> tuple[Policy, ...]:
    """Load `sources`; a PolicyProblems naming the HOOKPOLICY_POLICY_DIRS folders that hold
    broken files, and saying `not_done` (what `apply` did not start: its problems are then
    `hookpolicy:` lines), if any is invalid."""
    from .policy.sources import load_sources

    try:
        return load_sources(list(sources))
    except PolicyError as exc:
        notes = [note for folder in policy_dirs(os.environ) if (note := _from_env_dir(exc, folder))]
        raise PolicyProblems(exc, notes + ([not_done] if not_done else []), prefixed=not_done is not None) from None


def _from_env_dir(error: PolicyError, folder: str) -> Optional[str]:
    inside = sorted({p.file for p in error.problems
                     if os.path.abspath(p.file).startswith(os.path.join(os.path.abspath(folder), ""))})
    if not inside:
        return None
    return (f"{', '.join(inside)} {'comes' if len(inside) == 1 else 'come'} from HOOKPOLICY_POLICY_DIRS "
            f"(folder {folder}), which adds every policy of its folders to every run")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hookpolicy")
def cli() -> None:
    """Declarative YAML policies for PyTorch hooks: capture, clip, scale and alert.

    Policies are also read from every *.yaml/*.yml in the folders of HOOKPOLICY_POLICY_DIRS
    (colon-separated), by check, explain, apply and the exporters alike.
    """


@cli.command()
@click.argument("policies", nargs=-1, metavar="POLICY...")
def check(policies: tuple[str, ...]) -> None:
    """Validate policy files; print every problem as FILE:LINE:COL: $.path: message.

    Exit status 0 when all are valid, 1 otherwise.
    """
    from .policy.messages import missing_extras

    for policy in _load(_sources(policies)):
        rules = len(policy.rules)
        click.echo(f"{policy.source}: ok ({policy.name}, {rules} rule{'s' if rules != 1 else ''}, "
                   f"revision {policy.revision[:12]})")
        for rule, what in missing_extras(policy):
            click.echo(f"warning: {policy.source}: {policy.name}/{rule.name}: {what}", err=True)


@cli.command()
@click.argument("policies", nargs=-1, metavar="POLICY...")
@click.option("--model", "model_spec", required=True, metavar="MODULE:ATTR",
              help="An nn.Module, or a zero-argument callable returning one, e.g. examples.train_mlp:build_model "
                   "(MODULE may also be a path to a .py file).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--strict", is_flag=True, help="Exit 1 when a rule selects nothing on the model.")
def explain(policies: tuple[str, ...], model_spec: str, fmt: str, strict: bool) -> None:
    """Show which rule goes on which module, hook point and target, with the plan's warnings."""
    from dataclasses import replace

    from .api import PolicySet
    from .engine.measure.history import bounds as history_bounds
    from .engine.decide.recorder import bounds as ring_bounds
    from .engine.heal.snapshots import config as snapshot_config, describe as describe_snapshots
    from .policy.messages import wake_notes

    loaded = PolicySet(_load(_sources(policies)))
    model = _resolve_model(model_spec)
    plan = loaded.plan(model)
    history_notes, history_warnings = history_bounds(loaded.policies, plan.bindings)
    ring_notes, ring_warnings = ring_bounds(loaded.policies, plan.bindings)
    history_notes += ring_notes
    history_warnings += ring_warnings
    snapshots = snapshot_config(loaded.policies)
    if snapshots is not None:
        history_notes.append(describe_snapshots(model, *snapshots))
    history_notes.extend(wake_notes(loaded.policies))
    plan = replace(plan, notes=plan.notes + tuple(history_notes), warnings=plan.warnings + tuple(history_warnings))
    triggers = {(p.name, r.name): r.trigger for p in loaded.policies for r in p.rules}
    rows = [{**row, "when": _window(triggers[(row["policy"], row["rule"])])} for row in plan.rows()]
    if fmt == "json":
        click.echo(json.dumps({"bindings": rows, "notes": list(plan.notes), "warnings": list(plan.warnings)},
                              indent=2))
    else:
        _explain_text(plan, rows, model)
    if strict and plan.unmatched:
        raise PolicyProblems(PolicyError(plan.unmatched))


def _window(trigger: Any) -> dict[str, Any]:
    """When a rule is active: its phase, `every` (steps whose number it divides), `steps` range and the alert
    it wakes on (`after`: the rule `POLICY/RULE` and how many steps; None for a rule that is always awake)."""
    after = trigger.after
    return {"phase": trigger.phase, "every": trigger.every, "from": trigger.steps_from, "until": trigger.steps_until,
            "after": None if after is None else {"alert": rule_name(after.rule), "steps": after.steps}}


def _window_text(when: dict[str, Any]) -> str:
    """`train, every step`, `any phase, every 10th step, steps 100-4999` (`until` is exclusive),
    `train, every step, 50 steps after an alert of loss-spike-guard/loss-spike`."""
    phase = "any phase" if when["phase"] == "any" else when["phase"]
    every = "every step" if when["every"] == 1 else f"every {when['every']}th step"
    if when["until"] is not None:
        span = f", steps {when['from']}-{when['until'] - 1}"
    else:
        span = f", from step {when['from']}" if when["from"] else ""
    after = when["after"]
    woken = "" if after is None else f", {after['steps']} steps after an alert of {after['alert']}"
    return f"{phase}, {every}{span}{woken}"


def _explain_text(plan: Any, rows: list[dict[str, Any]], model: Any) -> None:
    if rows:
        click.echo(_table(rows))
    else:
        click.echo(f"no rule binds to any module of {type(model).__name__}")
    for note in plan.notes:
        click.echo(f"note: {note}")
    for warning in plan.warnings:
        click.echo(f"warning: {warning}")


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("RULE", "MODULE", "TYPE", "HOOK", "WHEN", "TARGET", "ACTIONS")
    body = [
        (
            f"{r['policy']}/{r['rule']}",
            r["module"] or "<root>",
            r["type"],
            r["hook"],
            _window_text(r["when"]),
            r["target"] + (f"({','.join(r['params'])})" if r["params"] else ""),
            "; ".join(r["actions"]),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths)) + "  " + line[-1]
        for line in (header, *body)
    )


def _resolve_model(spec: str) -> Any:
    """`MODULE:ATTR` -> an nn.Module: the attribute itself, or what calling it returns."""
    import torch

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise click.BadParameter(f"{spec!r} is not MODULE:ATTR (e.g. examples.train_mlp:build_model)",
                                 param_hint="--model")
    module = _import(module_name, until=attr.split(".")[0])
    value: Any = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise click.BadParameter(f"{module_name} has no attribute {attr!r}", param_hint="--model") from None
    if isinstance(value, torch.nn.Module):
        return value
    if not callable(value):
        raise click.BadParameter(
            f"{spec} is a {type(value).__name__}, not an nn.Module or a zero-argument callable returning one",
            param_hint="--model",
        )
    try:
        made = value()
    except (Exception, SystemExit) as exc:
        raise click.ClickException(f"calling {spec}() failed: {_describe(exc)}") from None
    if not isinstance(made, torch.nn.Module):
        raise click.ClickException(f"{spec}() returned a {type(made).__name__}, not an nn.Module")
    return made


def _import(name: str, until: Optional[str] = None) -> Any:
    """Import a module by dotted name (the working directory first on sys.path) or by file path.

    A file (`train.py:model`) runs only up to the top-level statement that defines `until`:
    a script without `if __name__ == "__main__":` trains below the line that builds its
    model, and `explain` must not train it.
    """
    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            raise click.BadParameter(f"no such file: {name}", param_hint="--model")
        stem = os.path.splitext(os.path.basename(name))[0]
        spec = importlib.util.spec_from_file_location(stem, name)
        if spec is None or spec.loader is None:
            raise click.BadParameter(f"cannot import {name}", param_hint="--model")
        module = importlib.util.module_from_spec(spec)
        sys.modules[stem] = module
        loader = spec.loader

        def load() -> Any:
            if until is None:
                loader.exec_module(module)
            else:
                _run_until(name, module, until)
            return module

        return _guarded_import(name, load)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return _guarded_import(name, lambda: importlib.import_module(name))


def _run_until(path: str, module: Any, name: str) -> None:
    """Run the file's top-level statements in `module` until one binds `name`; say so when the rest is left."""
    import __future__
    import ast

    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, path)
    namespace = module.__dict__
    namespace.setdefault("__file__", os.path.abspath(path))
    flags = 0  # `from __future__ import annotations` holds for every statement, as in a whole-file import
    for index, statement in enumerate(tree.body):
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            flags |= sum(getattr(__future__, alias.name).compiler_flag for alias in statement.names)
        exec(compile(ast.Module([statement], type_ignores=[]), path, "exec", flags=flags, dont_inherit=True), namespace)
        if name in namespace:
            rest = tree.body[index + 1:]
            if rest:
                say(f"{path}: ran its top level up to line {statement.end_lineno or statement.lineno}, where "
                    f"{name!r} is defined; lines {rest[0].lineno}-{rest[-1].end_lineno or rest[-1].lineno} "
                    "(its training, say) are not run")
            return


def _guarded_import(name: str, do: Callable[[], Any]) -> Any:
    try:
        return do()
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise click.BadParameter(f"cannot import {name}: no module named {exc.name!r}",
                                     param_hint="--model") from None
        raise click.ClickException(f"importing {name} failed: {_describe(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise click.ClickException(f"importing {name} failed: {_describe(exc)}") from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


class _DashDashCommand(click.Command):
    """Takes everything after the first `--` as COMMAND, untouched by option parsing."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta[_COMMAND_KEY] = args[at + 1:]
            return super().parse_args(ctx, args[:at])
        ctx.meta[_COMMAND_KEY] = []
        try:
            return super().parse_args(ctx, list(args))  # a copy: click consumes the list it parses
        except click.NoSuchOption as exc:  # the script's options, parsed as ours: a forgotten `--`?
            hint = _dash_dash_hint(args)
            if hint is None:
                raise
            raise click.UsageError(f"no such option {exc.option_name!r}: {hint}", ctx) from None

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "-- COMMAND..."]


def _dash_dash_hint(args: Sequence[str]) -> Optional[str]:
    """For arguments without `--`, the command line that was probably meant, or None.

    COMMAND is taken to start at the first argument that is neither an option of ours nor
    a policy (an existing folder, or a name ending in .yaml/.yml).
    """
    ours = {"--metrics-port", "--metrics-addr", "--web-config", "--push-gateway", "--push-job", "--textfile-dir"}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ours:
            i += 2
        elif arg.startswith("-") or arg.endswith((".yaml", ".yml")) or os.path.isdir(arg):
            i += 1
        else:
            break
    if i >= len(args):
        return None
    head, command = args[:i], args[i:]
    return ("put the training command after `--`, which keeps its options its own: hookpolicy apply "
            + " ".join([*head, "--", *command]))


@cli.command(cls=_DashDashCommand)
@click.argument("policies", nargs=-1, metavar="POLICY...")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, metavar="N",
              help="Serve Prometheus metrics: rank r (its LOCAL_RANK) on port N+r. Default: no server.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, metavar="A",
              help="Address the metrics endpoint listens on.")
@click.option("--web-config", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Secure the metrics endpoint with the TLS and basic auth of this web config file, in the "
                   "format node_exporter's and Prometheus' --web.config.file read (exporter-toolkit's).")
@click.option("--audit", is_flag=True, help="Force audit mode: evaluate and report everything, change nothing.")
@click.option("--watch", is_flag=True, help="Reload changed policy files between two steps (SIGHUP also reloads).")
@click.option("--strict", is_flag=True,
              help="A rule that selects nothing on the trained model stops the process (status 1) instead of a warning.")
@click.option("--report", "report_page", type=click.Path(dir_okay=False), default=None, metavar="PAGE",
              help="When COMMAND ends, draw the policies' capture logs into this HTML page (hookpolicy report).")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default=None,
              help="Alerts on stderr as one readable 'hookpolicy:' line each (text, the default) or as JSON records "
                   "(json, what HOOKPOLICY_LOG_FORMAT says when not given).")
@click.option("--push-gateway", default=None, metavar="URL",
              help="At exit (a halt and SIGTERM included) each process pushes its final series to this Prometheus "
                   "Pushgateway, grouped by job, rank and run, so a job shorter than a scrape interval still shows.")
@click.option("--push-job", default=environment.DEFAULT_PUSH_JOB, show_default=True, metavar="NAME",
              help="The job label of those pushes.")
@click.option("--textfile-dir", type=click.Path(exists=True, file_okay=False, writable=True), default=None,
              metavar="DIR", help="At exit (a halt and SIGTERM included) each process writes its final series, with "
              "its run, to DIR/hookpolicy-RUN-rankR.prom for node_exporter's textfile collector (atomically).")
@click.pass_context
def apply(
    ctx: click.Context, policies: tuple[str, ...], metrics_port: Optional[int], metrics_addr: str,
    web_config: Optional[str], audit: bool, watch: bool, strict: bool, report_page: Optional[str], log_format: Optional[str],
    push_gateway: Optional[str], push_job: str, textfile_dir: Optional[str],
) -> None:
    """Run COMMAND with the policies on every model it trains, unmodified.

    \b
    hookpolicy apply POLICY... [options] -- python train.py args
    hookpolicy apply POLICY... [options] -- train.py args
    hookpolicy apply POLICY... [options] -- python -m pkg args
    hookpolicy apply POLICY... [options] -- torchrun --nproc_per_node 2 train.py

    Exits with COMMAND's status, 3 when a policy halted training, 1 (running nothing)
    when a policy is invalid.
    """
    from .apply.launch import Launch, run

    command: list[str] = ctx.meta.get(_COMMAND_KEY, [])
    if not command:
        hint = _dash_dash_hint(policies)
        raise click.UsageError("missing '-- COMMAND': " + (hint or "e.g. hookpolicy apply policy.yaml -- python train.py"))
    if log_format is None:
        try:
            environment.log_format(os.environ)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    if web_config is not None:
        _check_web_config(web_config, metrics_port, command)
    sources = _sources(policies)
    loaded = _load(sources, not_done=f"nothing was started: {' '.join(command)} did not run")
    logs: tuple[str, ...] = ()
    if report_page is not None:
        from .export.report import capture_logs

        logs = tuple(str(p) for p in capture_logs(loaded))
    launch = Launch(
        sources=tuple(os.path.abspath(s) for s in sources), metrics_port=metrics_port,
        metrics_addr=metrics_addr, audit=audit, watch=watch, strict=strict,
        report=None if report_page is None else os.path.abspath(report_page), report_logs=logs,
        log_format=log_format, push_gateway=push_gateway, push_job=push_job,
        web_config=None if web_config is None else os.path.abspath(web_config),
        textfile_dir=None if textfile_dir is None else os.path.abspath(textfile_dir),
    )
    ctx.exit(run(launch, command))


def _check_web_config(file: str, metrics_port: Optional[int], command: Sequence[str]) -> None:
    """Refuse, before COMMAND starts, a web config that cannot secure the endpoint (or secures none)."""
    from .export.webconfig import WebConfigError, load_web_config

    if metrics_port is None:
        raise click.UsageError("--web-config secures the metrics endpoint, which only --metrics-port N starts")
    try:
        load_web_config(file)
    except WebConfigError as exc:
        raise click.ClickException(
            f"--web-config {file} cannot secure the metrics endpoint; nothing was started: "
            f"{' '.join(command)} did not run\n{exc}") from None


@cli.command()
def schema() -> None:
    """Print the JSON Schema of policy files (for editors and CI)."""
    from .policy.schema import schema_json

    text = schema_json()
    click.echo(text, nl=not text.endswith("\n"))


@cli.group()
def export() -> None:
    """Generate monitoring configuration from policies."""


@export.command("prometheus-rules")
@click.argument("policies", nargs=-1, metavar="POLICY...")
def export_prometheus_rules(policies: tuple[str, ...]) -> None:
    """Prometheus alerting rules for the policies' alerts (promtool check rules passes)."""
    from .export.rules import prometheus_rules

    text = prometheus_rules(_load(_sources(policies)))
    click.echo(text, nl=not text.endswith("\n"))


@export.command("grafana")
@click.argument("policies", nargs=-1, metavar="POLICY...")
def export_grafana(policies: tuple[str, ...]) -> None:
    """A Grafana dashboard (JSON) for the policies' metrics."""
    from .export.grafana import grafana_dashboard

    text = grafana_dashboard(_load(_sources(policies)))
    click.echo(text, nl=not text.endswith("\n"))


@export.command("kubernetes")
@click.argument("policies", nargs=-1, metavar="POLICY...")
@click.option("--name", default="hookpolicy", show_default=True, help="Name (and app.kubernetes.io/name label) of the objects.")
@click.option("--nproc-per-node", "ranks", type=click.IntRange(1, 9999), default=1, show_default=True,
              help="Ranks per pod: one named container port and one PodMonitor endpoint each.")
@click.option("--metrics-port", "port", type=click.IntRange(1, 65535), default=9400, show_default=True,
              help="Base port: LOCAL_RANK r serves on port + r.")
@click.option("--image", default="registry.example.com/hookpolicy:0.1.0", show_default=True,
              help="The example Job's image.")
@click.option("--web-config-secret", "web_secret", default=None, metavar="SECRET",
              help="Serve the metrics over TLS with basic auth: the Job mounts web.yml, tls.crt and tls.key of this "
                   "Secret (--web-config), the PodMonitor scrapes over https with its ca.crt, username and password.")
def export_kubernetes(policies: tuple[str, ...], name: str, ranks: int, port: int, image: str,
                      web_secret: Optional[str]) -> None:
    """PrometheusRule and PodMonitor (monitoring.coreos.com/v1), the policies' ConfigMap and an example Job."""
    from .export.kubernetes import kubernetes_objects

    try:
        text = kubernetes_objects(_load(_sources(policies)), name=name, ranks=ranks, port=port, image=image,
                                  web_secret=web_secret)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(text, nl=not text.endswith("\n"))


@cli.command()
@click.argument("logs", nargs=-1, required=True, metavar="LOG...")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default="report.html", show_default=True,
              help="The HTML file to write (one self-contained page, no network needed to view it).")
@click.option("--png", "png_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Also write every figure as a PNG file into DIR (a folder per run when there are several).")
@click.option("--run", "runs", multiple=True, metavar="ID",
              help="The run to show (its id, a unique start of it, 'last' or 'all'); repeat it to put runs side "
                   "by side. Default: the last run of the logs.")
def report(logs: tuple[str, ...], output: str, png_dir: Optional[str], runs: tuple[str, ...]) -> None:
    """Plot capture logs (JSON lines): per rule and statistic, one line per module over steps.

    A page shows one run (every record carries its run's id), by default the last one
    written. A LOG brings its rotated files (LOG.1, LOG.2, ...) and the alert records kept
    beside it (LOG's name with .alerts before the suffix) along; logs of several ranks are
    merged; alert records (a HOOKPOLICY_ALERT_LOG file, or a stderr saved from a run with
    --log-format json) add alert and skipped-step markers. Needs matplotlib: pip install
    'hookpolicy[report]'.
    """
    from pathlib import Path

    from .export.report import ReportError, write_report

    try:
        written = write_report(list(logs), Path(output), None if png_dir is None else Path(png_dir), runs)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write the report: {exc}") from None
    first = written.runs[0]
    skipped = f", {first.ignored} other line(s) skipped" if first.ignored else ""
    shown = ", ".join(r.run or "(no run id)" for r in written.runs)
    rules = len({key for r in written.runs for key in r.rules})
    click.echo(f"{output}: {written.count} figure(s), {rules} rule(s) of run {shown} from "
               f"{len(first.files)} file(s){skipped}")
    if png_dir is not None:
        click.echo(f"{output}: the figures as PNG files in {os.path.abspath(png_dir)}{os.sep}")
    if written.others:
        click.echo(f"{output}: the logs hold {len(written.others)} other run(s) (--run ID, or --run all): "
                   + ", ".join(o or "(no run id)" for o in written.others))


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="POLICY... LOG...")
@click.option("--audit", is_flag=True,
              help="Replay as in audit mode: every step enters the history and nothing is decided, as a run with "
                   "apply --audit (default: as enforced, each rule in its own mode).")
@click.option("--run", "run", default=None, metavar="ID",
              help="The run of the logs to replay (its id or a unique start of it). Default: the last.")
@click.option("--rank", "rank", type=click.IntRange(0), default=None,
              help="The rank whose values are replayed. Default: the lowest in the logs.")
@click.option("--report", "report_page", type=click.Path(dir_okay=False), default=None, metavar="PAGE",
              help="Also draw the run's figures with the replayed alerts and skipped steps into this HTML page.")
def replay(paths: tuple[str, ...], audit: bool, run: Optional[str], rank: Optional[int],
           report_page: Optional[str]) -> None:
    """Evaluate POLICY's alerts and decisions offline over a recorded capture log.

    POLICY is a policy file (.yaml, .yml) or folder (HOOKPOLICY_POLICY_DIRS is not read: the
    policies replayed are those named); LOG a capture log (JSON lines, what a capture's `log:`
    writes; its rotated files and the alert records beside it come along).
    Prints, per rule, the steps it would have skipped, rewound, cooled down or halted at, and
    how often each alert fired; a series a rule reads that the log lacks is named, and a rule
    none of whose alerts can be evaluated makes the exit status 1.
    """
    from pathlib import Path

    from .engine.replay import ReplayError, replay as run_replay, summary

    policy_paths, logs = _policies_and_logs(paths)
    policies = _load(policy_paths)
    try:
        replayed = run_replay(policies, logs, run, rank, audit)
    except ReplayError as exc:
        raise click.ClickException(str(exc)) from None
    for line in summary(replayed):
        click.echo(line)
    if report_page is not None:
        from .export.report import ReportError, replayed_page

        try:
            written = replayed_page(replayed.records, replayed.alerts, summary(replayed), Path(report_page))
        except ReportError as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:
            raise click.ClickException(f"cannot write the report: {exc}") from None
        click.echo(f"{report_page}: {written} figure(s) with the replayed alerts")
    if replayed.unevaluated:
        names = ", ".join(rule_name(key) for key in replayed.unevaluated)
        raise click.ClickException(f"{names}: no alert could be evaluated over the logs (the series above are "
                                   "missing)")


def _policies_and_logs(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split `replay`'s arguments: a folder, .yaml or .yml file is a policy; a file whose first line is a JSON
    object is a log; anything else is an error that says which."""
    policies: list[str] = []
    logs: list[str] = []
    for path in paths:
        if os.path.isdir(path) or path.endswith((".yaml", ".yml")):
            policies.append(path)
            continue
        if not os.path.isfile(path):
            raise click.ClickException(f"{path}: no such file")
        if os.path.getsize(path) == 0:
            raise click.ClickException(f"{path}: an empty file, no capture log record in it")
        if not _first_line_is_json(path):
            raise click.ClickException(f"{path}: neither a capture log (its first line is not a JSON record, as a "
                                       "capture's `log:` writes) nor a policy (a .yaml or .yml file, or a folder)")
        logs.append(path)
    if not policies:
        raise click.UsageError("no policy given: name POLICY files (.yaml, .yml) or folders before the logs")
    if not logs:
        raise click.UsageError("no capture log given: name the LOG files a capture's `log:` wrote")
    return policies, logs


def _first_line_is_json(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    try:
                        return isinstance(json.loads(line), dict)
                    except (ValueError, RecursionError):
                        return False
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
    return False


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """The `hookpolicy` console script."""
    cli.main(args=None if argv is None else list(argv), prog_name="hookpolicy")
    raise SystemExit(0)  # cli.main exits itself; this is for the type checker
