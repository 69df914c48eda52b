"""A ConfigMap volume as the kubelet writes it, one step at a time.

The kubelet's `AtomicWriter` (kubernetes `pkg/volume/util/atomic_writer.go`) keeps each
version's files in a hidden, timestamped folder, points `..data` at the current one, and
shows each key as a link `KEY -> ..data/KEY`. An update:

1. writes the new version's folder (`..2026_11_28_00_00_00.000000002`);
2. points `..data` at it (a new link renamed over the old one: atomic);
3. creates the links of the keys that are new;
4. removes the links of the keys that were removed;
5. removes the old version's folder.

Between 2 and 4 a removed key's link dangles (its target is gone from `..data`); between
2 and 3 a new key is in `..data` but not yet shown. `update` runs the steps and calls
`look` after each of the ones named, so a test can put a watcher's look exactly there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, Optional

__all__ = ["ConfigMapVolume"]


class ConfigMapVolume:
    """A folder holding the keys of a ConfigMap the way a pod's volume mount does."""

    def __init__(self, folder: Path, data: Mapping[str, str]) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._version = 0
        self._keys: set[str] = set()
        self.update(data)

    def update(self, data: Mapping[str, str], look: Optional[Callable[[str], None]] = None) -> None:
        """Move the volume to `data`; `look(step)` is called after "swapped", "linked" and "unlinked"."""
        def at(step: str) -> None:
            if look is not None:
                look(step)

        self._version += 1
        old = os.readlink(self.folder / "..data") if (self.folder / "..data").is_symlink() else None
        version = f"..2026_11_28_00_00_00.{self._version:09d}"
        (self.folder / version).mkdir()
        for key, text in data.items():
            (self.folder / version / key).write_text(text)
        os.symlink(version, self.folder / "..data_tmp")
        os.replace(self.folder / "..data_tmp", self.folder / "..data")
        at("swapped")
        for key in sorted(set(data) - self._keys):
            os.symlink(f"..data/{key}", self.folder / key)
        at("linked")
        for key in sorted(self._keys - set(data)):
            os.unlink(self.folder / key)
        at("unlinked")
        if old is not None:
            for name in os.listdir(self.folder / old):
                os.unlink(self.folder / old / name)
            os.rmdir(self.folder / old)
        self._keys = set(data)
