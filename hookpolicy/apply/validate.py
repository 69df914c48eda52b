"""Load and validate reloaded policy files in a child process, off the training process's GIL.

A reload is validated while the script trains. In the training process, parsing and
checking a 1 MB policy file holds the GIL for seconds (the pure-Python YAML scanner that
keeps positions): the reported run fell from ~136 to 0-3 steps/s for 8 s. Here a child
Python does that work, on another core when there is one, and hands back the validated
policies pickled; the training process only waits on a pipe (which releases the GIL) and
unpickles a few kilobytes. (The child is not niced: on a busy machine a niced child took
minutes, and a reload should not wait that long.)

The child is `python -I`: it ignores PYTHONPATH and the HOOKPOLICY_* variables (so the
`apply` bootstrap never starts in it) and imports this very hookpolicy by path.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ..errors import PolicyError, Problem
from ..policy.model import Policy

__all__ = ["VALIDATION_TIMEOUT", "load_elsewhere"]

#: Seconds the child may take; a 1 MiB file (the largest loaded) takes ~8 s on a busy core.
VALIDATION_TIMEOUT = 120.0

#: The package's parent folder, put first on the child's sys.path.
_HOME = str(Path(__file__).resolve().parent.parent.parent)

_CHILD = """\
import pickle, sys
sys.path.insert(0, sys.argv[1])
from hookpolicy.errors import PolicyError
from hookpolicy.policy.sources import load_sources
try:
    result = ("ok", load_sources(sys.argv[2:]))
except PolicyError as exc:
    result = ("problems", list(exc.problems))
sys.stdout.buffer.write(pickle.dumps(result))
"""


def load_elsewhere(sources: Sequence[str], timeout: float = VALIDATION_TIMEOUT) -> tuple[Policy, ...]:
    """`load_sources(sources)`, run in a child process; raises PolicyError as it would.

    A child that fails (it could not start, was killed, timed out) is a PolicyError too,
    with one whole-file problem saying why: a reload that cannot be validated keeps the
    running policies, like one that is invalid.
    """
    argv = [sys.executable, "-I", "-c", _CHILD, _HOME, *[os.fspath(s) for s in sources]]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        result = pickle.loads(done.stdout) if done.returncode == 0 else None
    except subprocess.TimeoutExpired:
        raise _unvalidated(sources, f"validation took longer than {timeout:g} s") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise _unvalidated(sources, f"cannot validate in a child process: {type(exc).__name__}: {exc}") from None
    if result is None:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise _unvalidated(sources, f"the validating process exited with status {done.returncode}: "
                                    f"{lines[-1] if lines else 'no message'}")
    kind, value = result
    if kind != "ok":
        raise PolicyError(value)
    return tuple(value)


def _unvalidated(sources: Sequence[str], why: str) -> PolicyError:
    return PolicyError([Problem(os.fspath(sources[0]) if sources else "<none>", 0, 0, "$", why)])
