"""`hookpolicy apply` with policy paths that `check` accepts, whatever characters they hold."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest

from helpers import REPO
from helpers.policies import write_policy
from helpers.processes import Run


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["with:colon", "a b:c,d"])
def test_a_policy_path_holding_a_colon_is_applied(apply: Callable[..., Run], tmp_path: Path, folder: str) -> None:
    """It passed `check`, then the child split HOOKPOLICY_POLICIES on ':' and found neither half."""
    (tmp_path / folder).mkdir()
    policy = write_policy(tmp_path / folder, """\
        - name: grads
          match: {types: [Linear]}
          trigger: {at: step}
          target: grad
          actions:
            - capture: {stats: [l2_norm]}
        """)
    assert ":" in str(policy)
    run = apply(str(policy), "--", sys.executable, str(REPO / "examples" / "train_mlp.py"), "--steps", "2")
    assert run.wait() == 0, run.stderr
    assert "governing Sequential" in run.stderr
