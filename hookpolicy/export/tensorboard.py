"""The TensorBoard sink: a capture's statistics as scalars, and its tensors as histograms where asked.

Written through `torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package is an
optional extra, `hookpolicy[tensorboard]`), only at step boundaries, from the readback,
never inside a hook. Each rank writes its own run folder, `<dir>/rank<r>`, so TensorBoard
shows the ranks as separate runs; rules naming the same `dir` share one writer (one
event file), so a run folder is never read half-way by TensorBoard's loader.

Tags are `<policy>/<rule>/<target>_<stat>/<module>[/<tensor>]` for scalars and
`<policy>/<rule>/<target>/<module>[/<tensor>]` for histograms; `per: rule` values use
the module name `<rule>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..policy.messages import MISSING_TENSORBOARD
from ..policy.model import Board
from .sinks import SinkError, safe_path

__all__ = ["MISSING_TENSORBOARD", "Boards", "scalar_tag", "histogram_tag"]



def scalar_tag(policy: str, rule: str, target: str, stat: str, module: str, tensor: str) -> str:
    return f"{policy}/{rule}/{target}_{stat}/{module or '<rule>'}" + (f"/{tensor}" if tensor else "")


def histogram_tag(policy: str, rule: str, target: str, module: str, tensor: str) -> str:
    return f"{policy}/{rule}/{target}/{module or '<rule>'}" + (f"/{tensor}" if tensor else "")


class Boards:
    """The open SummaryWriters of one attached policy set, one per run folder."""

    def __init__(self, root: Path, rank: int) -> None:
        self._root = root
        self._rank = rank
        self._writers: dict[Path, Any] = {}

    def _folder(self, board: Board) -> Path:
        return safe_path(self._root, f"{board.dir}/rank{self._rank}")

    def _writer(self, board: Board) -> Any:
        folder = self._folder(board)
        writer = self._writers.get(folder)
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SinkError(MISSING_TENSORBOARD) from None
            writer = self._writers[folder] = SummaryWriter(log_dir=str(folder))
        return writer

    def scalars(self, board: Board, step: int, values: list[tuple[str, float]]) -> None:
        writer = self._writer(board)
        for tag, value in values:
            writer.add_scalar(tag, value, global_step=step)

    def histogram(self, board: Board, step: int, tag: str, tensor: torch.Tensor) -> None:
        self._writer(board).add_histogram(tag, tensor.detach().float().reshape(-1), global_step=step)

    def flush(self, board: Board) -> None:
        """Write out what `board`'s run holds; raises what its writer raises (the caller contains it)."""
        writer = self._writers.get(self._folder(board))
        if writer is not None:
            writer.flush()

    def close(self) -> list[tuple[Path, Exception]]:
        """Close every writer, each whatever the others do; the writers that failed, with why."""
        failed: list[tuple[Path, Exception]] = []
        for folder, writer in self._writers.items():
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001 - a full disk at exit: said by the caller, never raised
                failed.append((folder, exc))
        self._writers.clear()
        return failed
