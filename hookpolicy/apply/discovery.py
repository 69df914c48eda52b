"""Find the models a script trains and keep the policies attached to them.

`Discovery` is what `hookpolicy apply` runs in every Python process of its COMMAND (set up
by `hookpolicy.apply.child.bootstrap`): it attaches the policies to each model the script
trains, without a line of the script changed:

1. A module called through `__call__` while grad mode is on, that has parameters
   requiring grad and is not inside an already governed model, is governed at that call,
   before its forward runs, so the first step is governed too. Modules called from its
   forward are inside it and are skipped with one dict lookup. With grad mode off (an
   evaluation under `torch.no_grad()`, a script that only evaluates, nanoGPT's
   `estimate_loss` before its first step), a module with parameters is governed only when
   it fits the policies: a rule that fires outside training (`phase: eval` or `any`) binds
   something on it. A policy of training rules alone waits for the first forward with
   grad on, as before, at the cost of one check of grad mode per module call.
2. If optimizers exist at that moment, one of them must hold one of its parameters (a
   target network run with grad on but never stepped is left alone). With no optimizer
   yet (manual SGD, or an optimizer made after a first forward) the module is governed.
3. A candidate that contains governed models replaces them: they are detached and the
   bigger model is attached, keeping the step count.
4. At an optimizer's first step, parameters it holds that no governed model owns, or
   that are spread over several governed models (a script that calls `model.forward(x)`
   directly, so only the children were seen), are traced to the outermost module owning
   them (one scan of the heap), which is governed at the next module call; for the
   loose parameters, that first step is not governed.
5. The global forward pre-hook is removed once every parameter of every optimizer that
   stepped belongs to a governed model (it costs a little on every module call); it
   comes back when an optimizer steps parameters nobody governs, or to swap in a reloaded
   policy. Without optimizers (manual SGD) it stays.

6. A governed model the script drops is let go: discovery holds it weakly (`Governed`),
   the model's own hooks hold its attachment, and once the collector frees it a
   finalizer queues the removal of what is left in the process (`Attached.when_dropped`),
   run at discovery's next hook on the training thread (`_drain`), never inside the
   collector, where this thread may hold the locks the removal takes.

Reload (`--watch`, SIGHUP): `reload` holds the whole protocol; discovery governs new
models with `swaps.current()` and hands every module call of a governed model and every
step end to `swaps` while a swap is pending.

The traps: hooks here are global state of the process (like every
`register_module_*` hook); PyTorch iterates the global optimizer hooks while it calls
them, so nothing in this module attaches or detaches from inside an optimizer step
(`optimizer_hooks` owns those hooks and says what is safe there).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from prometheus_client import CollectorRegistry
from torch.utils.hooks import RemovableHandle

from ..api import PolicySet
from ..errors import Halt, PolicyError
from ..process import Once
from ..engine.hooks import heap, module_hooks, optimizer_hooks
from ..engine.hooks.wrappers import data_parallel
from ..engine.runtime import Attached
from ..say import say
from .reload import Governed, Swaps, Vote

__all__ = ["Discovery"]


class Discovery:
    """Finds the models a script trains and keeps the policies attached to them.

    `install()` puts a process-wide module call hook in place and subscribes to the
    optimizer steps (`optimizer_hooks`, first in order); `remove()` detaches everything
    and takes them off again (safe to call twice). See the module docstring for the rules.
    """

    def __init__(
        self, policies: PolicySet, *, registry: CollectorRegistry, rank: int, audit: bool = False,
        strict: bool = False, on_govern: Optional[Callable[[torch.nn.Module, Attached], None]] = None,
        on_halt: Optional[Callable[[Halt], object]] = None,
    ) -> None:
        self.swaps = Swaps(policies, rank=rank)
        self._on_halt = on_halt
        self.registry = registry
        self.rank = rank
        self.audit = audit
        self.strict = strict
        self._on_govern = on_govern
        self._roots: dict[int, Governed] = {}
        self._inside: dict[int, int] = {}  # id of every module of a governed model -> id of its root
        self._covered: dict[int, int] = {}  # id of every parameter of a governed model -> id of its root
        self._plain: dict[int, "weakref.ref[torch.nn.Module]"] = {}  # modules without parameters
        self._rejected: dict[int, "weakref.ref[torch.nn.Module]"] = {}  # not stepped by any optimizer
        #: modules an evaluation (grad off) called that no evaluating rule binds, per policy generation
        self._unfit: dict[int, "weakref.ref[torch.nn.Module]"] = {}
        self._evaluating: Optional[tuple[int, bool]] = None  # (generation, whether a rule fires outside training)
        self._pending: list["weakref.ref[torch.nn.Module]"] = []  # found at a step, governed at the next call
        self._checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
        self._said_orphans = Once()
        self._forward: Optional[RemovableHandle] = None
        self._steps: Optional[optimizer_hooks.Subscription] = None
        self._watching = module_hooks.Watching(self)
        self._removed = False
        #: what removes a dropped model's remains, queued by the garbage collector (`_drain` runs it)
        self._dropped: list[Callable[[], None]] = []
        self._finalizers: "dict[int, weakref.finalize[..., torch.nn.Module]]" = {}  # id of a governed root -> its finalizer

    # -- public ------------------------------------------------------------------------
    @property
    def governed(self) -> list[Governed]:
        self._drain()
        return list(self._roots.values())

    @property
    def watching_calls(self) -> bool:
        """Whether the global forward pre-hook is installed (it is retired once discovery is done)."""
        return self._forward is not None

    def install(self) -> None:
        self._install_forward()
        self._steps = optimizer_hooks.subscribe(self, optimizer_hooks.DISCOVERY)

    def remove(self) -> None:
        """Detach every governed model and take the global hooks off; safe to call twice."""
        if self._removed:
            return
        self._removed = True
        self._retire_forward()
        if self._steps is not None:
            self._steps.remove()
            self._steps = None
        self._drain()
        for finalizer in self._finalizers.values():
            finalizer.detach()
        for governed in list(self._roots.values()):
            if not governed.dropped:
                governed.attached.remove()
        self._drain()  # a model collected during the loop
        self._roots.clear()
        self._inside.clear()
        self._covered.clear()
        self._watching.remove()

    def forget(self) -> None:
        """Stop discovering (in a forked child): take the global hooks off, detach nothing, flush nothing."""
        self._removed = True
        self._retire_forward()
        if self._steps is not None:
            self._steps.remove()
            self._steps = None
        self._pending.clear()

    def govern(self, module: torch.nn.Module) -> Optional[Attached]:
        """Attach the policies to `module` now (replacing governed models it contains)."""
        self._drain()
        modules = [id(m) for m in module.modules()]
        replaced = [self._roots[m] for m in modules if m in self._roots]
        step = max((g.attached.step for g in replaced), default=0)
        for governed in replaced:
            self._release(governed)
        replicated = data_parallel(module)
        policies, generation = self.swaps.current(replicated)
        try:
            attached = self._attach(policies, module, step)
        except PolicyError as exc:  # --strict: a rule selects nothing; refuse to train half-governed
            for problem in exc.problems:
                say(f"{problem} (--strict: stopping before the first step)")
            raise SystemExit(1) from None
        except Exception as exc:  # a guardrail that cannot attach must not stop training
            say(f"error: cannot govern {type(module).__name__}: {type(exc).__name__}: {exc}")
            self._rejected[id(module)] = weakref.ref(module)
            return None
        root = id(module)
        governed = self._roots[root] = Governed(module, attached, generation, replicated=replicated)
        if replicated:
            attached.vote_on_reloads(Vote(self.swaps, governed, self._roots.values()))
        self._inside.update(dict.fromkeys(modules, root))
        self._covered.update(dict.fromkeys((id(p) for p in module.parameters()), root))
        self._watching.add(list(module.modules()))
        self._finalizers[root] = finalizer = weakref.finalize(module, self._dropped.append, _Forget(self, governed))
        finalizer.atexit = False
        if self._on_govern is not None:
            self._on_govern(module, attached)
        return attached

    def tree_changed(self, parent: torch.nn.Module, name: str, value: object) -> None:
        """A module or parameter joins a governed model (`model.head = ...`): it is inside that model."""
        self._drain()
        root = self._inside.get(id(parent))
        if root is None or root not in self._roots:
            return
        if isinstance(value, torch.nn.Module):
            self._inside.update(dict.fromkeys((id(m) for m in value.modules()), root))
            self._covered.update(dict.fromkeys((id(p) for p in value.parameters()), root))
            self._watching.add(list(value.modules()))
        elif isinstance(value, torch.nn.Parameter):
            self._covered[id(value)] = root

    # -- the global forward pre-hook ---------------------------------------------------
    def call(self, module: torch.nn.Module, args: Any) -> None:
        """A module call under way when discovery was installed (its global hook missed it)."""
        if self._forward is not None:
            self._on_call(module, args)

    def _on_call(self, module: torch.nn.Module, args: Any) -> None:
        """hook(module, args) -> None: called before every module call while installed."""
        if self._dropped:
            self._drain()
        root = self._inside.get(id(module))
        if root is not None:
            governed = self._roots[root]
            if self.swaps.next is not None or governed.agreed is not None:
                self.swaps.at_call(governed, self._roots.values(), self._attach)
            return None
        if self._pending:
            self._govern_pending()
            if id(module) in self._inside:
                return None
        grad = torch.is_grad_enabled()
        if not grad and not self._policies_evaluate():
            return None
        if _known(self._plain, module) or _known(self._rejected, module):
            return None
        trainable = False
        has_params = False
        for p in module.parameters():
            has_params = True
            if p.requires_grad:
                trainable = True
                break
        if not has_params:
            self._plain[id(module)] = weakref.ref(module)
            return None
        if grad and not trainable:
            return None
        if not grad and (_known(self._unfit, module) or not self._fits(module)):
            return None
        optimizers, held = _held()
        if optimizers and not any(id(p) in held for p in module.parameters()):
            # Before leaving it alone, the optimizers that are only garbage awaiting the
            # collector (an earlier run's, in a reference cycle) go: they step nothing.
            optimizers, held = _held(collect=True)
            if optimizers and not any(id(p) in held for p in module.parameters()):
                self._rejected[id(module)] = weakref.ref(module)
                return None
        model = _trained_root(module, held) if optimizers else module
        attached = self.govern(model)
        if attached is not None and model is module:
            attached.entered(args)  # its own pre-hook came too late for this call
        return None

    def _policies_evaluate(self) -> bool:
        """Whether a rule of the current policies fires outside training (`phase: eval` or `any`)."""
        policies, generation = self.swaps.current()
        if self._evaluating is None or self._evaluating[0] != generation:
            self._unfit.clear()
            self._evaluating = (generation, any(rule.trigger.phase != "train"
                                                for policy in policies.policies for rule in policy.rules))
        return self._evaluating[1]

    def _fits(self, module: torch.nn.Module) -> bool:
        """Whether a rule that fires outside training binds something on `module` (its plan, built once)."""
        policies, _ = self.swaps.current()
        try:
            plan = policies.plan(module)
        except Exception:  # a plan that cannot be built is said at attach, at the first forward with grad on
            plan = None
        if plan is not None and any(b.rule.trigger.phase != "train" for b in plan.bindings):
            return True
        self._unfit[id(module)] = weakref.ref(module)
        return False

    def _govern_pending(self) -> None:
        pending, self._pending = self._pending, []
        for ref in pending:
            module = ref()
            if module is not None and id(module) not in self._roots:
                self.govern(module)

    # -- optimizer steps (an optimizer_hooks subscriber, called before step tracking) ---
    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Check that one governed model owns what `optimizer` steps.

        Parameters nobody governs, or parameters split over several governed models (a
        model whose `forward` was called directly, so its children looked like models),
        send us looking for the outermost module owning them, governed at the next call.
        """
        if self._dropped:
            self._drain()
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._checked.get(optimizer) == count:
            if self._forward is not None:
                self._maybe_retire_forward()
            return
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        loose = {p for p in params if p not in self._covered}
        roots = {self._covered[p] for p in params if p in self._covered}
        if not loose and len(roots) <= 1:
            self._checked[optimizer] = count
            self._maybe_retire_forward()
            return
        owners = _outermost_owners(params)
        owned = {id(p) for m in owners for p in m.parameters()}
        if loose - owned and self._said_orphans():
            say(
                f"warning: {type(optimizer).__name__} steps {len(loose - owned)} parameter(s) that "
                "belong to no nn.Module; hookpolicy cannot govern them"
            )
        fresh = [
            m for m in owners if id(m) not in self._roots and (
                any(id(p) in loose for p in m.parameters())
                or len(roots & {id(sub) for sub in m.modules()}) > 1
            )
        ]
        if not fresh:
            self._checked[optimizer] = count
            return
        self._checked[optimizer] = -1  # look again at the next step
        self._pending.extend(weakref.ref(m) for m in fresh)
        self._install_forward()

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """A step ends; a pending reload may go in after it.

        Called before step tracking (`optimizer_hooks.DISCOVERY` comes first), so
        `attached.step` is still the step ending.
        """
        if self._dropped:
            self._drain()
        if self.swaps.step_ended(self._roots.values()):
            self._install_forward()

    # -- hot-path bookkeeping ----------------------------------------------------------
    def _install_forward(self) -> None:
        if self._forward is None and not self._removed:
            self._forward = module_hooks.global_forward_pre_hook(self._on_call)

    def _retire_forward(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def _maybe_retire_forward(self) -> None:
        if self._forward is None or self._pending or not self._roots:
            return
        if self.swaps.outdated(self._roots.values()):
            return
        if all(count >= 0 for count in self._checked.values()):
            self._retire_forward()

    # -- attaching, detaching ----------------------------------------------------------
    def _attach(self, policies: PolicySet, module: torch.nn.Module, step: int, generation: int = 0) -> Attached:
        attached = Attached(policies.policies, module, registry=self.registry, rank=self._rank(), audit=self.audit,
                            start_step=step, on_halt=self._on_halt, strict=self.strict, generation=generation)
        attached.when_dropped(self._dropped.append)
        return attached

    def _rank(self) -> int:
        """The process group's rank once one exists, else the launcher's (RANK, LOCAL_RANK).

        A rank of `torch.multiprocessing.spawn` has neither variable: without the group's
        word every rank would be labelled 0 and serve on one port.
        """
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            self.rank = self.swaps.rank = dist.get_rank()
        return self.rank

    def _release(self, governed: Governed) -> None:
        governed.attached.remove()
        root = id(governed.model)
        self._finalizers.pop(root).detach()
        self._forget(root)

    def _forget(self, root: int) -> None:
        del self._roots[root]
        self._inside = {m: r for m, r in self._inside.items() if r != root}
        self._covered = {p: r for p, r in self._covered.items() if r != root}

    def _drain(self) -> None:
        """Remove what dropped models left (queued by the collector): on the training thread, outside any lock."""
        while self._dropped:
            self._dropped.pop(0)()

    def forgotten(self, root: int, governed: Governed) -> None:
        """The model `governed` was garbage-collected: it is governed no more (its attachment's remains go too)."""
        if self._roots.get(root) is governed:
            self._finalizers.pop(root, None)
            self._forget(root)


class _Forget:
    """What the finalizer of a governed model queues: `Discovery.forgotten` for it; holds no part of the model."""

    def __init__(self, discovery: Discovery, governed: Governed) -> None:
        self._discovery, self._governed = discovery, governed
        self._root = id(governed.model)

    def __call__(self) -> None:
        self._discovery.forgotten(self._root, self._governed)


def _known(cache: dict[int, "weakref.ref[torch.nn.Module]"], module: torch.nn.Module) -> bool:
    ref = cache.get(id(module))
    return ref is not None and ref() is module


def _held(collect: bool = False) -> tuple[bool, set[int]]:
    """Whether optimizers are alive (after a full collection when `collect`), and the ids of the parameters they hold.

    Neither holds an optimizer: a list of them kept by the caller would keep garbage alive
    through the next collection.
    """
    optimizers = heap.live_optimizers(collect)
    return bool(optimizers), {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}


def _trained_root(module: torch.nn.Module, held: set[int]) -> torch.nn.Module:
    """The outermost module containing `module` all of whose trainable parameters optimizers hold.

    A training framework often calls only a part of the model through `__call__`:
    Lightning calls `training_step` of the LightningModule, whose forward calls `self.net`.
    Governing the part that happens to be called first would make the governed root, and
    with it every label, depend on the framework's flags (Lightning's
    `accumulate_grad_batches` changes whether the first call is inside `optimizer.step`).
    The module whose trainable parameters are exactly what the optimizers train is the
    model the script trains, whatever calls it. One scan of the heap, once per model.
    """
    parents: dict[int, list[torch.nn.Module]] = {}
    for m in heap.live_modules():
        for child in m.children():
            parents.setdefault(id(child), []).append(m)
    root, seen = module, {id(module)}
    while True:
        up = next((p for p in parents.get(id(root), ()) if id(p) not in seen and all(
            id(q) in held for q in p.parameters() if q.requires_grad)), None)
        if up is None:
            return root
        root = up
        seen.add(id(root))


def _outermost_owners(params: set[int]) -> list[torch.nn.Module]:
    """The modules no other module contains that own one of `params` (one scan of the heap)."""
    modules = heap.live_modules()
    children = {id(c) for m in modules for c in m.children()}
    return [
        m for m in modules
        if id(m) not in children and any(id(p) in params for p in m.parameters())
    ]
