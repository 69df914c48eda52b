"""hookpolicy's own lines: one channel, the `hookpolicy` logger, each line `hookpolicy: ...` on stderr.

Every stage speaks through the `hookpolicy` logger (`say()` or `logging.getLogger("hookpolicy")`),
never with a bare write to stderr, so that a user sees one format and can route all of it
in one place. The logger carries one handler of its own, installed at `import hookpolicy`,
which writes each record to the *current* `sys.stderr` (so a test's or a script's
redirection is honoured) as `hookpolicy: <message>`, at INFO and above; each line of a
record of several lines (a traceback) is prefixed, so every line hookpolicy writes starts
with `hookpolicy: `. Records still
propagate to the root logger, so an application's logging configuration receives them
too; to keep only that, remove ours: `logging.getLogger("hookpolicy").removeHandler(say.HANDLER)`.

The bootstrap (`apply/_bootstrap/sitecustomize.py`) is the one exception: it must not
import hookpolicy, so its single error line is written by hand in the same format.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["HANDLER", "LOGGER", "PREFIX", "say"]

PREFIX = "hookpolicy: "
LOGGER = logging.getLogger("hookpolicy")


class _StderrLines(logging.Handler):
    """`hookpolicy: <message>` on whatever `sys.stderr` is at the time of the record."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stderr
            # One write per record: ranks and helpers share one stderr pipe, and a line written in
            # two pieces lets another process's line in between (a test read 'p@5bc4...hookpolicy:').
            # Every line of a block (a traceback, a list of problems) carries the prefix.
            stream.write("".join((line if line.startswith(PREFIX) else PREFIX + line) + "\n"
                                 for line in text.splitlines() or [""]))
            stream.flush()
        except Exception:  # a closed stderr must not take training down with it
            self.handleError(record)


def _install() -> logging.Handler:
    for handler in LOGGER.handlers:
        if isinstance(handler, _StderrLines):
            return handler  # a reloaded module keeps the handler it installed
    handler = _StderrLines(logging.INFO)
    LOGGER.addHandler(handler)
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)
    return handler


HANDLER = _install()


def say(message: str, level: int = logging.INFO) -> None:
    """One line (or a block, each of its lines prefixed) from hookpolicy to the user."""
    LOGGER.log(level, message)
