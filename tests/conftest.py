"""Shared fixtures: the repository root and free TCP ports."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def free_port() -> int:
    """A free TCP port whose successor is free too (for rank 1).

    Drawn below Linux's ephemeral range (32768-60999), where the OS hands out ports to
    `bind(0)`, gloo and torchrun's rendezvous, so none of them takes it meanwhile.
    """
    for _ in range(200):
        port = random.randrange(20000, 32700)
        if _bindable(port) and _bindable(port + 1):
            return port
    raise RuntimeError("no free pair of ports")
