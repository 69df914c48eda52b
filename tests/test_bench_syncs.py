"""`bench/timing.py`'s sync count, the one part of the benchmark that only runs on a GPU, checked here without one.

On CUDA, `torch.cuda.set_sync_debug_mode("warn")` warns at every synchronising call; here the
test's own `Tensor.tolist`/`item` warn the same words and count their calls, and the CUDA calls
the count makes are no-ops. A clip policy's read-back reads its rows once a step on CPU (a
`ClipEntry` stays in the buffer), so the read-back's share is not zero. Each warning the
count hands on is recorded once: a count that re-recorded them inside its own recorder looped
until the machine ran out of memory on the first GPU that ran it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import REPO
from helpers.policies import load_policy


def test_syncs_are_counted_in_all_and_in_the_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from timing import count_syncs
    from variants import Variant
    from hookpolicy.engine.decide.readback import Readback

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    reads = {"all": 0, "read_back": 0}
    inside = [False]
    for name in ("tolist", "item"):
        def warned(self: torch.Tensor, *args: Any, _original: Any = getattr(torch.Tensor, name)) -> Any:
            reads["all"] += 1
            reads["read_back"] += inside[0]
            warnings.warn("called a synchronizing CUDA operation")
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, warned)
    read = Readback.read

    def marked(self: Readback, *args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return read(self, *args, **kwargs)
        finally:
            inside[0] = False
    monkeypatch.setattr(Readback, "read", marked)
    handed_on = [0]
    explicit = warnings.warn_explicit

    def bounded(*args: Any, **kwargs: Any) -> None:  # a count that re-records what it hands on fails, not hangs
        handed_on[0] += 1
        assert handed_on[0] < 1000, "the count records the warnings it hands on again"
        explicit(*args, **kwargs)
    monkeypatch.setattr(warnings, "warn_explicit", bounded)

    pol = load_policy(tmp_path, """
        - name: clip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: 0.1}}]
    """)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        loss = model(torch.randn(6, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()  # the loop's own read, as a training script's logging
    with pol.attach(model) as attached:
        step()
        reads.update(all=0, read_back=0)
        total, in_read_back = count_syncs(Variant("clip", "clip", step, lambda: None, attached=attached), steps=4)
        assert "read" not in vars(attached._cycle.readback)  # the class's method again
    assert (total, in_read_back) == (reads["all"] / 4, reads["read_back"] / 4)
    assert in_read_back >= 1 and total > in_read_back
