"""The plan: which rule goes on which module, at which hook point, on which target.

`build_plan(policies, model)` is a pure function: it walks the model once, matches every
rule, and returns bindings ordered by (priority, policy order, rule order, module order),
plus the warnings a user should see before training (a rule that matches nothing, a
`grad_input` rule on a module whose inputs are indices, a `grad` rule's frozen parameters,
an `exclude` or `modules` glob that names a container whose parameters are its children's).
The runtime installs exactly
what the plan lists and nothing else; `explain` prints it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .matcher import Matcher, ModuleEntry, Target, iter_modules
from ..errors import Problem
from ..process import collector_paused
from ..policy.messages import missing_extras
from ..policy.patterns import compile_glob
from ..policy.model import (
    AFTER_UPDATE, LOSS, OPTIMIZER_STATE, PARAM_TARGETS, UPDATE, Action, Alert, Capture, Clip, Policy, Rule, Scale,
)

__all__ = ["LOSS_SOURCE", "STATE_KEYS", "Binding", "Plan", "build_plan", "describe_action", "owner_of", "param", "param_in"]

#: what `target: loss` is (engine/hooks/loss.py takes it there)
LOSS_SOURCE = ("the tensor the script calls backward() on (loss.backward(), torch.autograd.backward), at each "
               "backward call of the step that reaches its parameters, divided by GradScaler's scale when one "
               "scaled it: one value per root; the optimizer applies the gradient of their sum (mean * numel)")

#: the targets of parameters the optimizer updates: a frozen parameter (no gradient) has none of them
_TRAINED_TARGETS = frozenset({"grad"}) | AFTER_UPDATE

#: Modules whose inputs are integer indices: no gradient ever reaches them.
_INDEX_INPUT_TYPES = ("Embedding", "EmbeddingBag")


@dataclass(frozen=True)
class Binding:
    """One rule on one module: `module` is the canonical name, `params` its selected parameters.

    `params` are labels; `param_paths`, when given, are the dotted paths that find them
    from `obj` (a PEFT tuner layer's `weight` lives at `base_layer.weight`). `kind` says
    what `obj` is when it is not an ordinary module: the tuner (`lora`) for a tuner layer,
    which stands for its base layer, or the tuner and role of an adapter piece (`lora down`,
    `lora up`, `lora other`).
    """

    policy: Policy = field(repr=False)
    rule: Rule = field(repr=False)
    module: str
    qualname: str
    hook: str
    target: str
    params: tuple[str, ...] = ()
    obj: Any = field(default=None, repr=False, compare=False)
    param_paths: tuple[str, ...] = ()
    kind: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.policy.name, self.rule.name)

    def paths(self) -> tuple[str, ...]:
        """The dotted path of each of `params` from `obj`."""
        return self.param_paths or self.params

    def type_name(self) -> str:
        """`Linear`; `Conv1D+lora` for a tuner layer adapting a Conv1D; `Linear[lora down]` for a piece."""
        if " " in self.kind:
            return f"{type(self.obj).__name__}[{self.kind}]"
        if self.kind:
            base = self.obj
            while getattr(base, "base_layer", None) is not None:
                base = base.base_layer
            return f"{type(base).__name__}+{self.kind}"
        return type(self.obj).__name__

    def row(self) -> dict[str, Any]:
        """A JSON-ready description, as `explain --format json` prints it."""
        return {
            "policy": self.policy.name,
            "rule": self.rule.name,
            "priority": self.rule.priority,
            "mode": self.rule.mode,
            "module": self.module,
            "type": self.type_name(),
            "hook": self.hook,
            "target": self.target,
            "params": list(self.params),
            "select": list(self.rule.select),
            "actions": [describe_action(a) for a in self.rule.actions],
        }


@dataclass(frozen=True)
class Plan:
    bindings: tuple[Binding, ...]
    warnings: tuple[str, ...]
    #: rules that select nothing on this model, each at its `match` (FILE:LINE:COL): a warning,
    #: or the error of a strict attach
    unmatched: tuple[Problem, ...] = ()
    #: what a user should know about how a binding works (where `target: loss` looks for the loss)
    notes: tuple[str, ...] = ()

    def rows(self) -> list[dict[str, Any]]:
        return [b.row() for b in self.bindings]

    def __str__(self) -> str:
        lines = [
            f"{b.policy.name}/{b.rule.name} -> {b.module or '<root>'} "
            f"[{b.hook}:{b.target}{'(' + ','.join(b.params) + ')' if b.params else ''}] "
            + "; ".join(describe_action(a) for a in b.rule.actions)
            for b in self.bindings
        ]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def describe_action(action: Action) -> str:
    """A short human form of an action, e.g. `clip(max_norm=1, per=rule)`."""
    if isinstance(action, Capture):
        parts = [",".join(action.stats)] if action.stats else []
        parts.append(f"per={action.per}")
        if action.tensors:
            parts.append(f"tensors={action.tensors.dir}")
        if action.log:
            parts.append(f"log={action.log.path or 'stderr'}")
        if action.keep:
            parts.append(f"keep={action.keep.steps}" + ("" if action.keep.export else ",not-exported")
                         + ("" if action.keep.dump is None else f",dump={action.keep.dump.dir}"))
        return f"capture({' '.join(parts)})"
    if isinstance(action, Clip):
        if action.unitwise_ratio is not None:
            return f"clip(unitwise_ratio={action.unitwise_ratio:g}, eps={action.eps:g})"
        if action.remembers:
            warmup = f", warmup={action.warmup}" if action.warmup else ""
            when = f", when={str(action.when)!r}" if action.when is not None else ""
            limit = repr(str(action.adaptive)) if action.adaptive is not None else f"{action.max_norm:g}"
            return (f"clip(max_norm={limit}{when}{warmup}, norm_type={action.norm_type:g}, "
                    f"per={action.per})")
        if isinstance(action.max_norm, float):
            return f"clip(max_norm={action.max_norm:g}, norm_type={action.norm_type:g}, per={action.per})"
        return f"clip(min={action.min}, max={action.max})"
    if isinstance(action, Scale):
        return f"scale({action.factor:g})"
    assert isinstance(action, Alert)
    warmup = f" after {action.warmup} values" if action.warmup else ""
    return f"alert(if {action.source!r} for {action.for_}{warmup} -> {action.then}, {action.severity})"


def _type_hints(rule: Rule, entries: Sequence[ModuleEntry]) -> list[str]:
    """For each `types` name no module of the model has (class or base class), the model's class
    names it may have meant: the same letters in another case, or a close spelling."""
    import difflib

    names = sorted({cls.__name__ for entry in entries for cls in type(entry.typed).__mro__} - {"object"})
    hints = []
    for wanted in rule.match.types:
        if "." in wanted or wanted in names:
            continue
        same = [n for n in names if n.lower() == wanted.lower()]
        close = same or difflib.get_close_matches(wanted, names, n=3, cutoff=0.75)
        if close:
            hints.append(f"types: no module is a {wanted}; did you mean {' or '.join(close)}? "
                         "(class names are case-sensitive)")
    return hints


def build_plan(policies: Sequence[Policy], model: Any) -> Plan:
    """Compile policies against a model; never touches the model beyond reading its tree."""
    with collector_paused():  # tens of thousands of objects on a large model, none garbage
        return _build_plan(policies, model)


def _build_plan(policies: Sequence[Policy], model: Any) -> Plan:
    entries = iter_modules(model)
    ordered = sorted(
        ((rule.priority, p_index, rule.index, policy, rule)
         for p_index, policy in enumerate(policies) for rule in policy.rules),
        key=lambda item: item[:3],
    )
    bindings: list[Binding] = []
    warnings: list[str] = []
    notes: list[str] = []
    unmatched: list[Problem] = []

    def selects_nothing(policy: Policy, rule: Rule, what: str) -> None:
        problem = Problem(policy.source, *rule.match_at, f"$.spec.rules[{rule.index}].match",
                          f"{policy.name}/{rule.name}: {what}")
        unmatched.append(problem)
        warnings.append(str(problem))

    for policy in policies:
        warnings.extend(f"{policy.name}/{rule.name}: {what}" for rule, what in missing_extras(policy))
    for *_, policy, rule in ordered:
        matcher = Matcher(rule.match)
        found = matcher.select(entries)
        where = f"{policy.name}/{rule.name}"
        if rule.target == LOSS:  # the model's loss: the rule binds the model (its root) or nothing
            root = next((e for e in found if e.name == ""), None)
            if root is None:
                selects_nothing(policy, rule, f"target: loss is the loss of the whole model, so match must select "
                                f"its root (root: true, or types: [{type(model).__name__}]); it does not")
            else:
                bindings.append(Binding(policy, rule, "", root.qualname, "step", LOSS, obj=root.module))
                notes.append(f"{where}: the loss of {type(model).__name__} is {LOSS_SOURCE}")
            continue
        if not found:
            selects_nothing(policy, rule, f"matches no module of {type(model).__name__}"
                            + "".join(f"; {hint}" for hint in _type_hints(rule, entries)))
            continue
        if rule.target in PARAM_TARGETS:
            warnings.extend(f"{where}: {w}" for w in _bare_containers(rule, matcher, entries))
        targets = [(entry, t) for entry in found for t in matcher.targets(entry, rule.target in PARAM_TARGETS)]
        if not targets:
            selects_nothing(policy, rule, f"none of the {len(found)} matched modules is an adapted layer "
                            f"(PEFT tuner layer), so adapters: {rule.match.adapters} selects nothing")
            continue
        made, frozen = 0, 0
        claimed: set[int] = set()  # a shared (tied) parameter belongs to the first module that has it
        for entry, target in targets:
            params = target.params
            if rule.target in PARAM_TARGETS:
                params = tuple(p for p in params if _claim(claimed, param(target.module, p[1])))
                if rule.target in _TRAINED_TARGETS:
                    trainable = tuple(p for p in params if param(target.module, p[1]).requires_grad)
                    frozen += len(params) - len(trainable)
                    params = trainable
                if not params:
                    continue
            if rule.target == "grad_input" and type(entry.typed).__name__ in _INDEX_INPUT_TYPES:
                warnings.append(
                    f"{where}: {entry.name or '<root>'} is an {type(entry.typed).__name__}; "
                    "its inputs are indices and never receive a gradient"
                )
            bindings.append(_binding(policy, rule, entry, target, params))
            made += 1
        if frozen:
            warnings.append(f"{where}: {frozen} frozen parameters (requires_grad=False) left out: "
                            "they never get a gradient")
        bound_names = {b.module for b in bindings[len(bindings) - made:]}
        if rule.target in PARAM_TARGETS:
            warnings.extend(f"{where}: {w}" for w in _partial_owners(bound_names, entries))
        else:
            warnings.extend(f"{where}: {w}" for w in _never_called(bound_names, entries))
        warnings.extend(f"{where}: {w}" for w in _lookalikes(rule, matcher, entries))
        if made and rule.target in AFTER_UPDATE:
            notes.append(f"{where}: {_after_update_note(rule, bindings[-made:])}")
        if not made:
            what = "trainable parameters" if frozen else "parameters"
            selects_nothing(policy, rule, f"the matched modules have no {what} matching {list(rule.match.params) or '*'}")
    notes.extend(_series_notes(policies, bindings))
    return Plan(tuple(bindings), tuple(warnings), tuple(unmatched), tuple(notes))


def _series_notes(policies: Sequence[Policy], bindings: Sequence[Binding]) -> list[str]:
    """Per policy, the rules whose series a process group exports once per job (`engine/decide/replicas.py`)."""
    bound = {b.key for b in bindings}
    notes = []
    for policy in policies:
        rules = [r.name for r in policy.rules if (policy.name, r.name) in bound and r.trigger.at == "step"
                 and r.target in PARAM_TARGETS and any(isinstance(a, Capture) and a.series == "job" and a.exports
                                                  for a in r.actions)]
        losses = [r.name for r in policy.rules if (policy.name, r.name) in bound and r.target == LOSS
                  and r.ranks == "job" and any(isinstance(a, Capture) and a.series == "job" and a.exports
                                                  for a in r.actions)]
        if rules:
            notes.append(f"{policy.name}: in a process group, the series of {', '.join(rules)} are exported once per "
                         "job, by rank 0, where DDP or FSDP2 over every rank reduces their parameters and an optimizer "
                         "steps; else per rank, and rank 0 says why (capture series: rank keeps them per rank)")
        if losses:
            notes.append(f"{policy.name}: in a process group, the series of {', '.join(losses)} (the job's loss) are "
                         "exported once per job, by rank 0 (capture series: rank keeps them per rank)")
        if policy.max_job_series is not None:
            notes.append(f"{policy.name}: spec.limits.maxJobSeries={policy.max_job_series}: the job exports at most "
                         "that many of its statistic series, all ranks together; a series exported once per job "
                         "counts 1, one every rank exports counts the number of ranks; the job's series of a step are "
                         "kept before each rank's, then first published, first kept")
    return notes


#: how many module names a warning lists before "..."
_SHOWN = 3


def _bare_containers(rule: Rule, matcher: Matcher, entries: list[ModuleEntry]) -> list[str]:
    """The globs of a parameter rule that name a module with no parameters of its own, to no effect.

    Globs match whole names, so `exclude: [head]` excludes `head`, not `head.fc`: on a
    timm model, where `head` only holds `head.fc`, the classifier stays selected. Said
    for an `exclude` glob when a container it names has selected parameters below it and
    none of them excluded; for a `modules` glob when no `modules` glob names any of them.
    """
    holders = [e for e in entries if e.name and _has_own_params(e.module)]
    below_selected = _ancestors(e.name for e in holders if matcher.matches(e.name, e.typed, False))
    below_any = _ancestors(e.name for e in holders)
    excludes = tuple(compile_glob(g) for g in rule.match.exclude)
    below_excluded = _ancestors(e.name for e in holders if any(g.fullmatch(e.name) for g in excludes))
    named = tuple(compile_glob(g) for g in rule.match.modules)
    below_named = _ancestors(e.name for e in holders if any(g.fullmatch(e.name) for g in named))
    #: per field, the containers whose parameters the glob meant and missed
    missed = {"exclude": below_selected - below_excluded, "modules": below_any - below_named}
    found: list[str] = []
    for field, globs in (("exclude", rule.match.exclude), ("modules", rule.match.modules)):
        for glob in globs:
            pattern = compile_glob(glob)
            bare = [e for e in entries if e.name in missed[field] and pattern.fullmatch(e.name)
                    and not _has_own_params(e.module)]
            if not bare:
                continue
            children = [h.name for h in holders if any(h.name.startswith(e.name + ".") for e in bare)]
            shown = ", ".join(children[:_SHOWN]) + (", ..." if len(children) > _SHOWN else "")
            what = ("stay selected" if field == "exclude" else "are not selected")
            hint = f"did you mean {glob + '.**'!r}?" if not glob.startswith("re:") else "name them too."
            one = len(bare) == 1
            found.append(f"{field} glob {glob!r} names {', '.join(e.name for e in bare[:_SHOWN])}, which "
                         f"{'has' if one else 'have'} no parameters of {'its' if one else 'their'} "
                         f"own; globs match whole names, so the parameters of {shown} {what}: {hint}")
    return found


#: layer classes a `types` name does not match but that do the same job: a policy that names
#: the first likely meant the second too (transformers' Conv1D is a Linear whose weight is
#: stored transposed: HF GPT-2's attention and MLP projections are all Conv1D)
_LOOKALIKES: dict[str, tuple[str, ...]] = {"Linear": ("Conv1D",)}

#: (parent class, child attribute): a child module its parent never calls as a module. PyTorch's
#: MultiheadAttention passes `out_proj.weight` to F.multi_head_attention_forward, so `out_proj`'s
#: forward and backward hooks never run.
_NOT_CALLED: frozenset[tuple[str, str]] = frozenset({("MultiheadAttention", "out_proj")})


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _partial_owners(bound: set[str], entries: Sequence[ModuleEntry]) -> list[str]:
    """The parents of bound modules that hold trainable parameters of their own the rule does not bind.

    `nn.MultiheadAttention` holds `in_proj_weight` and `in_proj_bias` itself beside its child
    `out_proj`, a Linear: `types: [Linear]` there selects a quarter of the attention's
    parameters. Said per parent class, with what would cover them. The root is left out: its
    own parameters (a position embedding) are rarely part of a child's layer.
    """
    by_name = {e.name: e for e in entries}
    missed: dict[str, list[str]] = {}
    params: dict[str, list[str]] = {}
    for name in sorted(bound):
        parent = name.rpartition(".")[0]
        entry = by_name.get(parent)
        if not parent or parent in bound or entry is None:
            continue
        own = [n for n, p in entry.module.named_parameters(recurse=False) if p.requires_grad]
        if own:
            cls = type(entry.typed).__name__
            if parent not in missed.setdefault(cls, []):
                missed[cls].append(parent)
                params[cls] = own
    return [f"binds children of {_listed(parents)} ({cls}) but not the parameters {', '.join(params[cls])} that "
            + (f"it holds itself; to cover them, add {cls} to types (or match its name)" if len(parents) == 1 else
               f"they hold themselves; to cover them, add {cls} to types (or match their names)")
            for cls, parents in missed.items()]


def _never_called(bound: set[str], entries: Sequence[ModuleEntry]) -> list[str]:
    """Bound modules whose parent never calls them as modules, so their hooks never run."""
    by_name = {e.name: e for e in entries}
    found: dict[tuple[str, str], list[str]] = {}
    for name in sorted(bound):
        parent, _, attr = name.rpartition(".")
        entry = by_name.get(parent)
        if entry is not None and (type(entry.typed).__name__, attr) in _NOT_CALLED:
            found.setdefault((type(entry.typed).__name__, attr), []).append(name)
    return [f"{_listed(names)} {'is' if len(names) == 1 else 'are'} never called as a module: {cls} uses "
            f"{attr}'s weights directly, so {'its' if len(names) == 1 else 'their'} forward and backward hooks "
            f"never run; match the {cls} itself for its inputs and outputs"
            for (cls, attr), names in found.items()]


def _lookalikes(rule: Rule, matcher: Matcher, entries: Sequence[ModuleEntry]) -> list[str]:
    """For each `types` name, the model's modules of a class that does the same job, which the rule's
    globs select but its `types` leave out."""
    found = []
    for wanted in rule.match.types:
        for other in _LOOKALIKES.get(wanted, ()):
            if other in rule.match.types:
                continue
            wider = Matcher(dataclasses.replace(rule.match, types=rule.match.types + (other,)))
            names = [e.name for e in entries if type(e.typed).__name__ == other
                     and not matcher.matches(e.name, e.typed, e.name == "") and wider.matches(e.name, e.typed, e.name == "")]
            if names:
                found.append(f"types: [{wanted}] does not select the {len(names)} {other} modules "
                             f"({_listed(names)}), which do a {wanted}'s job; add {other} to types to govern them")
    return found


def _has_own_params(module: Any) -> bool:
    return next(iter(module.named_parameters(recurse=False)), None) is not None


def _ancestors(names: Iterable[str]) -> set[str]:
    """Every proper dotted prefix of each of `names` (`a` and `a.b` for `a.b.c`)."""
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


#: what torch.optim's optimizers keep per parameter after a step (the `explain` note and the
#: line said when an `optimizer_state` rule finds nothing); read from torch 2.13's optimizers
STATE_KEYS: dict[str, str] = {
    "SGD": "SGD keeps momentum_buffer only with momentum > 0, else no state",
    "Adam": "Adam keeps exp_avg, exp_avg_sq (max_exp_avg_sq with amsgrad) and a step count",
    "AdamW": "AdamW keeps exp_avg, exp_avg_sq (max_exp_avg_sq with amsgrad) and a step count",
    "NAdam": "NAdam keeps exp_avg, exp_avg_sq, and step and mu_product counts",
    "RAdam": "RAdam keeps exp_avg, exp_avg_sq and a step count",
    "Adamax": "Adamax keeps exp_avg, exp_inf and a step count",
    "Adagrad": "Adagrad keeps sum and a step count",
    "Adadelta": "Adadelta keeps square_avg, acc_delta and a step count",
    "RMSprop": "RMSprop keeps square_avg (momentum_buffer with momentum, grad_avg when centered) and a step count",
    "Rprop": "Rprop keeps prev, step_size and a step count",
    "ASGD": "ASGD keeps ax and the scalars eta, mu and step",
    "Adafactor": "Adafactor keeps row_var and col_var (factored: not shaped like the parameter; name them in "
                 "match.state) and a step count",
    "LBFGS": "LBFGS keeps its state for all its parameters together, under the first one (flat d, "
             "prev_flat_grad, histories), none per parameter",
}


def _after_update_note(rule: Rule, bound: Sequence[Binding]) -> str:
    """What an `update` or `optimizer_state` rule measures, when, and what it costs (for `explain`)."""
    when = ("measured after the optimizer applied the step and read back with the next step's statistics "
            "(a step a skip or GradScaler kept from updating has none)")
    if rule.target == OPTIMIZER_STATE:
        keys = ", ".join(rule.match.state) if rule.match.state else "every state tensor shaped like its parameter"
        return (f"{OPTIMIZER_STATE} is the optimizer's state of each parameter ({keys}), {when}; an optimizer that "
                "keeps none is said at the first step. What torch's optimizers keep: "
                + "; ".join(STATE_KEYS.values()))
    params = [param(b.obj, path) for b in bound for path in b.paths()]
    size = sum(p.numel() * p.element_size() for p in params)
    shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    return (f"{UPDATE} is w_after - w_before of each parameter, {when}; on a step where the rule is active, a copy "
            f"of its {len(params)} parameters ({shown}; under FSDP2 each rank copies its shards) "
            "is kept on their device from before the update to after it")


def _binding(policy: Policy, rule: Rule, entry: ModuleEntry, target: Target,
             params: tuple[tuple[str, str], ...]) -> Binding:
    labels = tuple(label for label, _ in params)
    paths = tuple(path for _, path in params)
    kind = ""
    if entry.tuner is not None:
        roles = [part.role for part in entry.tuner.parts if part.module is target.module]
        kind = f"{entry.tuner.tuner} {roles[0]}" if roles else entry.tuner.tuner
    return Binding(
        policy, rule, target.name, target.qualname, rule.trigger.at, rule.target, labels, target.module,
        paths if paths != labels else (), kind,
    )


def param(module: Any, path: str) -> Any:
    """The parameter at dotted `path` from `module`, looked up now (it may have been replaced)."""
    return param_in(*owner_of(module, path))


def owner_of(module: Any, path: str) -> tuple[Any, str]:
    """The module holding the parameter at dotted `path` from `module`, and the parameter's name there."""
    owner_path, _, name = path.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), name


def param_in(owner: Any, name: str) -> Any:
    """`owner`'s parameter `name` now: a registered parameter first; else the attribute (a property, a
    wrapper's alias)."""
    found = owner._parameters.get(name)
    return found if found is not None else getattr(owner, name)



def _claim(claimed: set[int], obj: Any) -> bool:
    """True the first time `obj` is seen in this rule."""
    if id(obj) in claimed:
        return False
    claimed.add(id(obj))
    return True
