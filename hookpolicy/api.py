"""The Python API: `load` policies, then `attach` them to a model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from prometheus_client import CollectorRegistry

from .errors import Halt
from .policy.sources import load_sources
from .policy.model import Policy
from .plan.planner import Plan, build_plan
from .engine.runtime import Attached

__all__ = ["PolicySet", "load"]

Source = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class PolicySet:
    """Validated policies, ready to be compiled against models; immutable and reusable."""

    policies: tuple[Policy, ...]

    def attach(
        self, model: torch.nn.Module, registry: Optional[CollectorRegistry] = None,
        rank: Optional[int] = None, *, audit: bool = False, start_step: int = 0,
        on_halt: Optional[Callable[[Halt], object]] = None, strict: bool = False,
    ) -> Attached:
        """Install the hooks the policies need on `model`; use as `with policies.attach(model):`.

        Metrics go to `registry` (prometheus_client's default registry when None), labelled
        with `rank` (from `RANK`/`LOCAL_RANK`, else 0, when None). `audit=True` forces every
        rule into audit mode: everything is evaluated and reported, nothing is changed.
        `start_step` numbers the first step (a hot reload continues the old count);
        `on_halt(halt)` is called just before a `hookpolicy.Halt` is raised. A rule that
        selects nothing on `model` is a warning (`FILE:LINE:COL` of its `match`), and with
        `strict=True` a `PolicyError` raised before anything is installed.
        """
        return Attached(self.policies, model, registry=registry, rank=rank, audit=audit,
                        start_step=start_step, on_halt=on_halt, strict=strict)

    def plan(self, model: torch.nn.Module) -> Plan:
        """What `attach` would install, without installing anything."""
        return build_plan(self.policies, model)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.policies)


def load(sources: Union[Source, Sequence[Source]]) -> PolicySet:
    """Load and validate policy files (paths, folders, or a list of them).

    Raises `hookpolicy.PolicyError` listing every problem of every file; nothing is
    returned unless all of them are valid.
    """
    return PolicySet(load_sources(sources))
