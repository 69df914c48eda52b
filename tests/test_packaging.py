"""What the image and the distribution contain, checked without a container registry."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def docker_context() -> set[str]:
    """The top-level names `.dockerignore` lets into the build context (its `*` then `!name` form)."""
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", "the context starts empty and lists what goes in"
    admitted = {l[1:] for l in lines[1:] if l.startswith("!")}
    return {name for name in admitted if not any(fnmatch.fnmatch(name, l) for l in lines[1:] if not l.startswith("!"))}


def test_the_image_gets_the_license_the_examples_and_the_policies() -> None:
    context = docker_context()
    assert {"pyproject.toml", "README.md", "LICENSE", "hookpolicy", "policies", "examples"} <= context
    missing = [name for name in context if not (ROOT / name).exists()]
    assert missing == [], f".dockerignore admits files that do not exist: {missing}"


def test_the_image_runs_as_an_unprivileged_user() -> None:
    instructions = [l.split(None, 1) for l in (ROOT / "Dockerfile").read_text().splitlines()
                    if l and not l.startswith((" ", "#"))]
    users = [(i, rest.strip()) for i, (word, *rest_) in enumerate(instructions) if word == "USER" for rest in rest_]
    assert users, "the Dockerfile never leaves root"
    last_user, name = users[-1]
    assert name not in ("root", "0")
    assert all(word != "RUN" for word, *_ in instructions[last_user:]), "a RUN after USER would need root"
    assert re.search(rf"useradd .*\b{re.escape(name)}\b", (ROOT / "Dockerfile").read_text())


def test_license_file_is_the_apache_2_text_pyproject_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
