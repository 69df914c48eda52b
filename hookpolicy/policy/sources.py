"""Find and load several policy sources: files and folders in, validated Policies out.

This sits above both halves of the policy side: `loader.read_document` turns one file
into a Document, `build.build_policy` turns one Document into a Policy, and this module
does both for everything named on a command line or in HOOKPOLICY_POLICY_DIRS (which
the caller reads with `environment.policy_dirs`), all or nothing. Neither half imports it, so the imports point one way.
"""

from __future__ import annotations

import difflib
import os
import stat
from typing import Iterable, Optional, Sequence, Union

from ..errors import PolicyError, Problem
from .build import build_policy
from .document import Document
from .loader import Source, read_document
from .model import Alert, Policy

__all__ = ["expand_sources", "load_sources"]

def expand_sources(sources: Union[Source, Sequence[Source]]) -> tuple[list[str], list[Problem]]:
    """The policy files named by `sources`: files as given, folders as their `*.yaml`/`*.yml`.

    A folder's files are taken in name order, without descending into sub-folders and
    without hidden files (a Kubernetes ConfigMap mount keeps its real files in `..data`).
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    files: list[str] = []
    problems: list[Problem] = []
    for source in sources:
        name = os.fspath(source)
        if not os.path.isdir(name):
            files.append(name)
            continue
        try:
            found, unreadable = _folder_files(name)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            problems.append(Problem(name, 0, 0, "$", f"cannot read the folder: {reason}"))
            continue
        problems.extend(unreadable)
        if not found and not unreadable:
            problems.append(Problem(name, 0, 0, "$", "the folder holds no *.yaml or *.yml files"))
        files.extend(found)
    return files, problems


def _folder_files(folder: str) -> tuple[list[str], list[Problem]]:
    """The folder's policy files, and a problem for each `*.yaml` entry that is not a file.

    A dangling symbolic link, a FIFO (which would block the reader forever) or a folder
    named like a policy is reported, never skipped: a policy someone meant to apply would
    otherwise be missing without a word.
    """
    files: list[str] = []
    problems: list[Problem] = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".yaml", ".yml")) or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        kind = _not_a_file(path)
        if kind is None:
            files.append(path)
        else:
            problems.append(Problem(path, 0, 0, "$", f"{kind}, not a policy file; remove or rename it"))
    return files, problems


def _not_a_file(path: str) -> Optional[str]:
    """What `path` is when it is not a regular file (following links), else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"a dangling symbolic link (to {os.readlink(path)!r})" if os.path.islink(path) else "gone"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    return "a special file (socket or device)"


def load_sources(sources: Union[Source, Sequence[Source]]) -> tuple[Policy, ...]:
    """Load every policy named by `sources` (files and folders); all or nothing.

    The problems of every file are collected and raised together as one PolicyError,
    so a user fixes a whole set of files in one round. Policy names must be unique
    across everything loaded together. An empty `sources` gives an empty tuple.
    """
    files, problems = expand_sources(sources)
    loaded: list[tuple[Document, Policy]] = []
    for file in files:
        try:
            document = read_document(file)
            loaded.append((document, build_policy(document)))
        except PolicyError as exc:
            problems.extend(exc.problems)
    problems.extend(_duplicate_names(loaded))
    problems.extend(_unknown_alerts(loaded))
    if problems:
        raise PolicyError(problems)
    return tuple(policy for _, policy in loaded)


def _duplicate_names(loaded: Iterable[tuple[Document, Policy]]) -> list[Problem]:
    first: dict[str, str] = {}
    problems: list[Problem] = []
    for document, policy in loaded:
        if policy.name in first:
            problems.append(document.problem(
                ("metadata", "name"),
                f"duplicate policy name {policy.name!r} (first in {first[policy.name]}); "
                "policies applied together need unique names",
            ))
        else:
            first[policy.name] = document.file
    return problems


def _unknown_alerts(loaded: Sequence[tuple[Document, Policy]]) -> list[Problem]:
    """A `trigger.after.alert` must name a rule with an alert among the policies loaded together."""
    policies = {policy.name: policy for _, policy in loaded}
    problems: list[Problem] = []
    for document, policy in loaded:
        for rule in policy.rules:
            after = rule.trigger.after
            if after is None:
                continue
            named, wanted = after.rule
            path = ("spec", "rules", rule.index, "trigger", "after", "alert")
            other = policies.get(named)
            if other is None:
                problems.append(document.problem(path, (
                    f"no policy named {named!r} is applied with this one (loaded: {', '.join(sorted(policies))}); "
                    f"load the file of {named!r} beside it, or name a rule of a loaded policy (POLICY/RULE)"
                    + _did_you_mean(named, policies))))
                continue
            target = next((r for r in other.rules if r.name == wanted), None)
            if target is None:
                problems.append(document.problem(path, (
                    f"policy {named!r} ({other.source}) has no rule {wanted!r}; its rules: "
                    f"{', '.join(r.name for r in other.rules)}" + _did_you_mean(wanted, [r.name for r in other.rules]))))
            elif not any(isinstance(action, Alert) for action in target.actions):
                problems.append(document.problem(path, (
                    f"rule {named}/{wanted} ({other.source}) has no alert, so nothing would ever wake this rule; "
                    "name a rule with an alert action")))
    return problems


def _did_you_mean(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
