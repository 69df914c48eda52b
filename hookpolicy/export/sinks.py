"""Where captured values go besides Prometheus: JSON-lines logs and tensor files.

Both write only at step boundaries (never inside a hook), only under their output
folder (`HOOKPOLICY_OUTPUT_DIR`, else the working directory): a path that resolves
outside it, through `..` or a symbolic link, is refused. Tensor files are written to a
temporary name and renamed, so a run killed mid-write leaves no partial file. A log file
is rotated before it would grow past its `max_bytes`, and ends on a whole line even when a
write fails half-way (a full disk): the torn tail is cut back off.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, Optional

import torch

from ..environment import output_dir, run_id
from ..policy.model import Capture, LogSink, Policy, TensorFiles

__all__ = [
    "ALERT_LOG_EVENT", "AlertFiles", "DUMP_EVENT", "BudgetSpent", "SinkError", "TEMP_PREFIX", "alert_log_beside", "file_name",
    "output_root", "safe_path", "JsonLines", "TensorWriter", "write_whole",
]


class SinkError(OSError):
    """A sink cannot write: the path is unsafe."""


class BudgetSpent(Exception):
    """A tensor writer reached its `max_files`/`max_bytes`: the configured end, not a fault."""


def output_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder policy paths are relative to."""
    return Path(output_dir(environ) or os.getcwd()).resolve()


def safe_path(root: Path, relative: str) -> Path:
    """`root / relative`, refusing anything that resolves outside `root` (`..`, symlinks)."""
    if os.path.isabs(relative):
        raise SinkError(f"{relative!r} is absolute; policy paths are relative to {root}")
    candidate = (root / relative)
    try:
        resolved = candidate.resolve()
    except ValueError as exc:  # an embedded NUL: not a path at all
        raise SinkError(f"{relative!r} is not a usable path: {exc}") from None
    if resolved != root and root not in resolved.parents:
        raise SinkError(f"{relative!r} resolves to {resolved}, outside the output folder {root}")
    return resolved


class JsonLines:
    """One JSON object a line, to a file under the output root or to stderr.

    A file is rotated (`path` -> `path.1` -> ... -> `path.<keep>`, the oldest dropped)
    before a write would take it past `max_bytes`, so it exceeds that only when one write
    alone does (the readback writes a rule's records of a step at once). The ranks of a machine may share a file: each write goes to the
    file now at the path, so a writer follows a rotation another process made (as
    logging's `WatchedFileHandler` does). Two processes rotating at the same moment may
    drop one rotated file between them; the bound holds.

    The file is unbuffered: a write that fails (a full disk) fails in `write`, where the
    part of it that did land is truncated back off, so the log ends on a whole line and
    `close()` has nothing left to flush, hence nothing to raise.
    """

    def __init__(self, root: Path, sink: Optional[LogSink]) -> None:
        self._file: Optional[BinaryIO] = None
        self._root = root
        self._sink = sink or LogSink()
        self._target = None if self._sink.path is None else safe_path(root, self._sink.path)

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, allow_nan=True) + "\n" for r in records)
        if self._target is None:
            sys.stderr.write(data)
            sys.stderr.flush()
            return
        encoded = data.encode("utf-8")
        _append_whole(self._stream(self._target, len(encoded)), encoded)

    def _stream(self, target: Path, incoming: int) -> BinaryIO:
        try:
            here: Optional[os.stat_result] = os.lstat(target)
        except FileNotFoundError:
            here = None
        if here is not None and stat.S_ISLNK(here.st_mode):
            raise SinkError(f"{target} is a symbolic link; refusing to write through it")
        full = here is not None and here.st_size > 0 and here.st_size + incoming > self._sink.max_bytes
        if self._file is not None:
            mine = os.fstat(self._file.fileno())
            if here is not None and (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino) and not full:
                return self._file
            self.close()  # full, or rotated or removed meanwhile (by another rank): follow the path
        # Opening anew (and maybe rotating first): the path must still lead where it did.
        assert self._sink.path is not None
        if safe_path(self._root, self._sink.path) != target:  # a folder on the way became a symlink
            raise SinkError(f"{self._sink.path!r} no longer resolves to {target}; refusing to write elsewhere")
        if full:
            self._rotate(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(target, "ab", buffering=0)
        return self._file

    def _rotate(self, target: Path) -> None:
        """`path.<keep-1>` -> `path.<keep>`, ..., `path` -> `path.1` (with keep 0: `path` removed)."""
        names = [str(target)] + [f"{target}.{n}" for n in range(1, self._sink.keep + 1)]
        moves = reversed(list(zip(names, names[1:])))
        for older, newer in moves if self._sink.keep else [(str(target), None)]:
            try:
                if newer is None:
                    os.unlink(older)
                else:
                    os.replace(older, newer)
            except FileNotFoundError:
                pass  # not there yet, or another rank moved it first

    def close(self) -> None:
        """Close the file; never raises (nothing is buffered, so nothing can be lost here)."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass


#: The header record of a flight recorder's dump (`engine/decide/recorder.py`); `hookpolicy report` reads it.
DUMP_EVENT = "dump"


#: The record an alert file starts a run's part with: this run's alert records are kept here
#: (`hookpolicy report` says "unknown (no alert records)" for a run without one).
ALERT_LOG_EVENT = "alert log"


def alert_log_beside(log: Path) -> Path:
    """The file the alert records of a run are kept in beside its capture log `log`:
    `runs/observe.jsonl` -> `runs/observe.alerts.jsonl`."""
    return log.with_name(f"{log.stem}.alerts{log.suffix}" if log.suffix else f"{log.name}.alerts")


class AlertFiles:
    """The alert records of a run, kept beside each of its capture logs (`alert_log_beside`), so that
    `hookpolicy report LOG` finds them without being told.

    Every alert record goes to every such file (an alert of a guard that captures nothing is
    part of the run too); each file takes the capture log's `max_bytes` and `keep`. A file is
    opened at its first write: the first alert, or the first record of its capture log
    (`started`), which writes one `{"event": "alert log"}` record, so that a page knows that
    this run's alerts were kept even when there were none.
    """

    @classmethod
    def of(cls, root: Path, policies: Iterable[Policy], rank: int) -> "AlertFiles":
        """The alert files beside every capture log of `policies`."""
        return cls(root, (a.log for p in policies for r in p.rules for a in r.actions
                          if isinstance(a, Capture) and a.log is not None), rank)

    def __init__(self, root: Path, sinks: Iterable[LogSink], rank: int) -> None:
        self._rank = rank
        self._files: dict[str, JsonLines] = {}
        for sink in sinks:
            if sink.path is None or sink.path in self._files:
                continue
            beside = alert_log_beside(Path(sink.path))
            self._files[sink.path] = JsonLines(root, LogSink(path=str(beside), max_bytes=sink.max_bytes,
                                                             keep=sink.keep))
        self._started: set[str] = set()

    def started(self, sink: Optional[LogSink]) -> None:
        """The capture log of `sink` is being written: its alert file says, once, that it keeps this run's alerts."""
        if sink is None or sink.path is None or sink.path in self._started or sink.path not in self._files:
            return
        self._files[sink.path].write([self._header()])
        self._started.add(sink.path)

    def write(self, records: list[dict[str, Any]]) -> None:
        for path, file in self._files.items():
            if path not in self._started:
                file.write([self._header()])
                self._started.add(path)
            file.write(records)

    def _header(self) -> dict[str, Any]:
        return {"run": run_id(os.environ), "time": time.time(), "rank": self._rank, "event": ALERT_LOG_EVENT}

    def close(self) -> None:
        """Close the files; never raises (`remove()` never does)."""
        for file in self._files.values():
            try:
                file.close()
            except Exception:  # noqa: BLE001 - JsonLines.close does not raise; nothing is buffered to lose
                pass


def _append_whole(file: BinaryIO, data: bytes) -> None:
    """Append `data` in full, or, if a write fails part-way, cut what landed back off and raise.

    The cut is made only while the file still ends where this write left it: a rank
    sharing the file that appended meanwhile keeps its lines (and the torn part stays).
    """
    start = os.fstat(file.fileno()).st_size
    written = 0
    try:
        while written < len(data):
            written += file.write(data[written:]) or 0
    except BaseException:
        try:
            if written and os.fstat(file.fileno()).st_size == start + written:
                os.ftruncate(file.fileno(), start)
        except OSError:
            pass
        raise


#: Temporary files start with this and end in `.partial`, never `.pt`: a `*.pt` glob
#: finds only complete files, even after a run was killed in the middle of a write.
TEMP_PREFIX = ".tmp-"
#: File names are cut to this many bytes (most file systems allow 255).
MAX_NAME_BYTES = 200


def file_name(name: str) -> str:
    """`name` as one safe file name: no separators, NULs or other control characters, short.

    The parts of a tensor file's name come from the model (module names, dict keys of
    outputs), which may hold any character. Unsafe ones become `_`; a name longer than
    `MAX_NAME_BYTES` is cut and ends in a hash of the whole name, so it stays unique.
    """
    safe = "".join(
        "_" if c in "/\\" or not (c.isprintable() or c == " ") else c for c in name
    )
    encoded = safe.encode("utf-8")
    if len(encoded) <= MAX_NAME_BYTES and not safe.startswith("."):
        return safe
    stem, suffix = os.path.splitext(safe)
    if len(suffix.encode("utf-8")) > 16:  # not an extension, just a dot in a long name
        stem, suffix = safe, ""
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    room = MAX_NAME_BYTES - len(suffix.encode("utf-8")) - len(digest) - 1
    cut = stem.encode("utf-8")[:room].decode("utf-8", "ignore").lstrip(".")
    return f"{cut}-{digest}{suffix}"


class TensorWriter:
    """Writes detached CPU copies as `.pt` files within `max_files` and `max_bytes`."""

    def __init__(self, root: Path, config: TensorFiles) -> None:
        self.config = config
        self.folder = safe_path(root, config.dir)
        self.files = 0
        self.bytes = 0
        self.spent = False
        self._names: dict[str, int] = {}  # the names written, each with its count (at most max_files)

    def write(self, name: str, tensor: torch.Tensor) -> Path:
        """Write `tensor` as `name`; a name this writer already wrote (the forwards of one step: its
        micro-batches, an evaluation loop's batches) is numbered, `x.pt`, `x.2.pt`, ..., never overwritten."""
        if self.files >= self.config.max_files:
            self.spent = True
            raise BudgetSpent(f"capture.tensors.max_files={self.config.max_files} reached in {self.folder}")
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        data = buffer.getvalue()
        if self.bytes + len(data) > self.config.max_bytes:
            self.spent = True
            raise BudgetSpent(
                f"capture.tensors.max_bytes={self.config.max_bytes} would be exceeded in {self.folder} "
                f"({self.bytes} written, {len(data)} more)"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        name = file_name(name)  # two names that become one safe file name must not overwrite each other either
        count = self._names[name] = self._names.get(name, 0) + 1
        stem, suffix = os.path.splitext(name)
        while count > 1 and f"{stem}.{count}{suffix}" in self._names:
            count += 1
        if count > 1:
            name = file_name(f"{stem}.{count}{suffix}")
            self._names[name] = 1
        final = safe_path(self.folder, name)
        write_whole(final, data)
        self.files += 1
        self.bytes += len(data)
        return final


def write_whole(final: Path, data: bytes) -> None:
    """Write `data` as `final` through a temporary file in its folder, renamed: the file is whole or absent."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=TEMP_PREFIX, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
