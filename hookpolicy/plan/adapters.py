"""PEFT's tuner layers, seen as the layer they adapt: what an adapted layer is called and owns.

`peft.get_peft_model` replaces each targeted layer `L` by a tuner layer (`lora.Linear`,
`ia3.Linear`, ...) that keeps `L` as its `base_layer` and adds the adapter's pieces
(`lora_A.<adapter>`, `lora_B.<adapter>`, `lora_dropout.<adapter>`). A policy written for
the base model names `L`; on the fine-tune it must select the same layer, with the same
label. So, decided here (docs/policy-language.md, "Adapters (PEFT)"):

- the tuner layer answers to the original name and to its base layer's type, and is the
  only module of the three that ordinary matching sees: its forward output is what the
  fine-tuned layer contributes to the model (the base layer's output plus the adapter's),
  which is what a rule on that layer's activations is about;
- its parameters, for `grad`/`weight` rules, are the base layer's (labelled as on the base
  model: `weight`, `bias`) plus the adapter's (labelled by their path, `lora_A.default.weight`),
  so a whole-model gradient rule still covers the adapter;
- the adapter's pieces are selected only by `match.adapters` (`all`, `down`, `up`):
  `down` are the `*_A` pieces (LoRA's A: their output is the adapter's bottleneck neurons),
  `up` the `*_B` pieces; each is bound under `<layer>.<piece>.<adapter>`.

Detection compares class names, never imports peft: a tuner layer is a module whose class
derives from a class named `BaseTunerLayer` and that holds a `base_layer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["AdapterPart", "TunerLayer", "tuner_layer", "ADAPTER_ROLES"]

_TUNER_BASE = "BaseTunerLayer"
_BASE_ATTR = "base_layer"
#: the pieces LoRA keeps when a tuner layer class does not list its own
_DEFAULT_PIECES = ("lora_A", "lora_B")
#: `match.adapters` value -> the roles of the pieces it selects
ADAPTER_ROLES = {"all": frozenset({"down", "up", "other"}), "down": frozenset({"down"}), "up": frozenset({"up"})}


@dataclass(frozen=True)
class AdapterPart:
    """One piece of an adapter: `name` is canonical, `path` relative to its tuner layer.

    `role` is down, up or other. `called` is False for a piece that holds bare parameters
    (a ParameterDict such as LoRA's `lora_embedding_A`): it has no forward of its own, so
    only `grad`/`weight` rules can bind it.
    """

    name: str
    qualname: str
    path: str
    module: Any
    role: str
    called: bool


@dataclass(frozen=True)
class TunerLayer:
    """What a tuner layer stands for: its innermost `base` layer and the adapter's pieces.

    `tuner` is PEFT's name for the method (`lora` for peft.tuners.lora.layer.Linear).
    """

    tuner: str
    base: Any
    base_path: str
    parts: tuple[AdapterPart, ...]

    def params(self) -> list[tuple[str, str]]:
        """(label, path from the tuner layer) of the base layer's parameters, then the adapter's."""
        base = [(n, f"{self.base_path}.{n}") for n, _ in self.base.named_parameters(recurse=False)]
        adapter = [
            (f"{part.path}.{n}",) * 2
            for part in self.parts for n, _ in part.module.named_parameters(recurse=False)
        ]
        return base + adapter


def tuner_layer(module: Any, name: str, qualname: str) -> Optional[TunerLayer]:
    """The TunerLayer of `module` named `name`, or None when it is not a PEFT tuner layer."""
    if not any(c.__name__ == _TUNER_BASE for c in type(module).__mro__):
        return None
    base, path = module, []
    while getattr(base, _BASE_ATTR, None) is not None:  # a tuner layer may wrap another one
        base = getattr(base, _BASE_ATTR)
        path.append(_BASE_ATTR)
    if not path:
        return None
    parts: list[AdapterPart] = []
    children = dict(module.named_children())
    for piece in getattr(module, "adapter_layer_names", _DEFAULT_PIECES):
        holder = children.get(piece)
        if holder is None:
            continue
        role = "down" if piece.endswith("_A") else "up" if piece.endswith("_B") else "other"
        entries = list(holder.named_children())
        if entries:
            parts += [AdapterPart(_join(name, f"{piece}.{key}"), f"{qualname}.{piece}.{key}", f"{piece}.{key}",
                                  child, role, True)
                      for key, child in entries]
        elif any(True for _ in holder.named_parameters(recurse=False)):
            parts.append(AdapterPart(_join(name, piece), f"{qualname}.{piece}", piece, holder, role, False))
    return TunerLayer(_tuner_name(module), base, ".".join(path), tuple(parts))


def _tuner_name(module: Any) -> str:
    parts = type(module).__module__.split(".")
    return parts[parts.index("tuners") + 1] if "tuners" in parts[:-1] else "adapter"


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path
