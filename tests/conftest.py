"""Shared test helpers: the repository root, free ports, policies written on the fly, the
tiny models (an MLP, a two-block GPT and its training loop), PyTorch's hook tables counted
(to catch a leaked hook), the exporter for a `with`, the output-folder and one-thread
fixtures, and `hookpolicy apply` run for real (the `apply` fixture, scraping its metrics,
torchrun)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
import torch.nn.functional as F
from torch import nn

import hookpolicy

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The 10,000-step soak test runs only when a `-m` expression names `soak`.

    Not pyproject's `addopts = -m 'not soak'`: a `-m` on the command line (the README's
    `-m 'not slow'`) replaces that one, and the soak test would run in the quick loop.
    """
    if "soak" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("soak") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("soak")])
        items[:] = kept


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


# --------------------------------------------------------------------------- policies

#: The example policy of the user contract (shared/policy-spec.md), field for field.
SPEC_EXAMPLE = """\
# yaml-language-server: $schema=../schemas/hookpolicy-v1.schema.json
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: llm-guardrails              # required: [a-z0-9]([a-z0-9-]*[a-z0-9])?, at most 63 chars
  labels: {team: ml-platform}       # optional, string to string; shown in hookpolicy_policy_info
  annotations: {runbook: "..."}     # optional, free text, never parsed
spec:
  mode: enforce                     # enforce (default) | audit
  onError: continue                 # continue (default) | halt
  limits:
    maxSeries: 10000                # cap on the metric series this policy may create
  rules:
    - name: clip-attention-grads    # required, unique within the policy
      mode: audit                   # optional, overrides spec.mode for this rule
      priority: 50                  # optional int 0..100, lower runs first; ties keep file order
      match:
        modules: ["transformer.h.*.attn.*"]
        types: [Linear]
        exclude: ["**.c_proj"]
        params: ["weight"]          # only for targets that are parameters (grad, weight)
      trigger:
        at: step                    # forward_pre | forward | backward | step
        every: 1                    # evaluate on steps where step % every == 0
        steps: {from: 100, until: 5000}   # optional window: from inclusive, until exclusive
        phase: train                # train (default) | eval | any
      target: grad                  # see the table in 3.
      actions:
        - capture: {stats: [l2_norm, abs_max, nonfinite]}
        - clip: {max_norm: 1.0, norm_type: 2, per: rule}
        - alert:
            if: "nonfinite > 0"
            for: 1
            severity: critical
            then: skip_step
            message: "non-finite gradients in {module} at step {step}"
"""



def policy_text(rules: str, *, name: str = "p", spec: str = "") -> str:
    """A policy named `name` with `rules` (a YAML list, indented as you like) and more `spec` keys."""
    text = f"apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata:\n  name: {name}\nspec:\n"
    text += textwrap.indent(textwrap.dedent(spec), "  ")
    return text + "  rules:\n" + textwrap.indent(textwrap.dedent(rules), "    ")


def write_policy(folder: Path, rules: str, *, name: str = "p", spec: str = "") -> Path:
    """`policy_text(...)` written to `folder/<name>.yaml`."""
    path = folder / f"{name}.yaml"
    path.write_text(policy_text(rules, name=name, spec=spec))
    return path


def load_policy(folder: Path, rules: str, *, name: str = "p", spec: str = "") -> hookpolicy.PolicySet:
    """`write_policy(...)`, loaded as users load it (`hookpolicy.load`)."""
    return hookpolicy.load(write_policy(folder, rules, name=name, spec=spec))


# --------------------------------------------------------------------------- models


def tiny(seed: int = 0, out: int = 2) -> nn.Sequential:
    """Linear(4, 8), ReLU, Linear(8, out), seeded: the smallest model with a hidden layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out))


VOCAB, BLOCK = 64, 16

class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A two-block GPT with nanoGPT's module names and weight tying.

    The conventional GPT-2/nanoGPT names (`transformer.wte`, `transformer.h.N.attn.c_attn`,
    `transformer.h.N.mlp.c_fc`, `lm_head`, ...) with the token embedding tied to
    `lm_head`, as nanoGPT does: the names the policy library's patterns are written for.
    """

    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d), wpe=nn.Embedding(BLOCK, d), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(d, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(d),
        ))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def lora(model: GPT) -> nn.Module:
    """`model` with LoRA (r=4) on every c_attn, as peft.get_peft_model makes it."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"]))  # type: ignore[no-any-return]


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    idx = torch.randint(0, VOCAB, (size, BLOCK), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, loss_scale: float = 1.0,
               before_step: Optional[Callable[[], None]] = None) -> None:
    idx, targets = batch(seed)
    _, loss = model(idx, targets)
    assert loss is not None
    (loss * loss_scale).backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_then_evaluate(model: nn.Module, steps: int) -> None:
    """`steps` AdamW training steps, then one evaluation batch (eval mode, no grad)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        train_step(model, opt, i)
    model.eval()
    with torch.no_grad():
        model(batch(99)[0])
    model.train()


# --------------------------------------------------------------------------- leaks


def module_hook_count(model: nn.Module) -> int:
    """Every hook on every module of `model` (0 once hookpolicy let go of it)."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        + len(m._forward_hooks_always_called) + len(m._forward_hooks_with_kwargs)
        for m in model.modules()
    )


def global_hook_counts() -> tuple[int, ...]:
    """PyTorch's process-wide hooks: optimizer step pre/post, module forward pre/post, backward."""
    return (
        len(optimizer_hooks._global_optimizer_pre_hooks), len(optimizer_hooks._global_optimizer_post_hooks),
        len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks),
        len(module_hooks._global_backward_hooks), len(module_hooks._global_backward_pre_hooks),
    )


def process_wide_state() -> dict[str, object]:
    """Everything of the process hookpolicy may change while attached, and must give back.

    PyTorch's process-wide hooks (call, registration, optimizer step), hookpolicy's own
    step subscribers, its `nn.Module.__reduce_ex__` (in place while it holds a module hook)
    and its threads.
    """
    from hookpolicy.engine import optimizer_hooks as step_owner

    return {
        "global hooks": global_hook_counts(),
        "registration hooks": (
            len(module_hooks._global_module_registration_hooks), len(module_hooks._global_parameter_registration_hooks),
            len(module_hooks._global_buffer_registration_hooks),
        ),
        "step subscribers": len(step_owner._OWNER._subscriptions),
        "nn.Module.__reduce_ex__": nn.Module.__dict__.get("__reduce_ex__"),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("hookpolicy")),
    }


@pytest.fixture(autouse=True)
def _process_left_as_found() -> Iterator[None]:
    """Every test leaves the process as it found it, so no test depends on which ran before it.

    A test that detaches everything it attached passes this; one that leaves a hook, a
    subscriber or a thread behind fails here, not in whichever test happens to run next.
    """
    before = process_wide_state()
    yield
    after = process_wide_state()
    assert after == before, f"process-wide state left behind: {before} -> {after}"


# --------------------------------------------------------------------------- outputs


@contextlib.contextmanager
def served(registry: CollectorRegistry, port: int, **options: Any) -> Iterator[Any]:
    """`hookpolicy.export.exporter.serve` for the length of a `with`, shut down after."""
    from hookpolicy.export.exporter import serve

    server = serve(registry, port, **options)
    assert server is not None
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log, every line complete."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path} ends in a partial line"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The output folder for logs and tensor files (HOOKPOLICY_OUTPUT_DIR)."""
    folder = tmp_path / "out"
    folder.mkdir()
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(folder))
    return folder


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread, and a busy CI machine cannot slow them 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- hookpolicy apply, for real


Samples = list[tuple[str, dict[str, str], float]]


class Run:
    """One `python -m hookpolicy apply ...` process; its stdout and stderr go to files."""

    def __init__(self, folder: Path, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.out_path = folder / "apply.stdout"
        self.err_path = folder / "apply.stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hookpolicy", "apply", *args],
                cwd=cwd, env=env, stdout=out, stderr=err,
            )

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"apply did not finish in {timeout} s; stderr:\n{self.stderr}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # forwarded to the COMMAND's process group
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def apply(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(*args: str, env: Optional[dict[str, str]] = None, cwd: Path = REPO) -> Run:
        folder = tmp_path / f"run{len(runs)}"
        folder.mkdir()
        run = Run(folder, list(args), env or child_env(), cwd)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.stop()


def scrape(port: int) -> Optional[Samples]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> Optional[float]:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples if n == name]


def wait_metrics(run: Run, port: int, ready: Callable[[Samples], bool], timeout: float = 90) -> Samples:
    """Scrape until `ready` holds, while the script still runs."""
    deadline = time.monotonic() + timeout
    samples: Optional[Samples] = None
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            pytest.fail(f"apply exited ({run.proc.returncode}) before the metrics were ready; stderr:\n{run.stderr}")
        samples = scrape(port)
        if samples is not None and ready(samples):
            assert run.proc.poll() is None  # read while the training script runs
            return samples
        time.sleep(0.1)
    pytest.fail(f"metrics on port {port} never got ready; last scrape: {samples}\nstderr:\n{run.stderr}")


def steps_are(n: int, rank: str = "0") -> Callable[[Samples], bool]:
    return lambda samples: value(samples, "hookpolicy_steps_total", rank=rank) == n


def losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"(rank \d+ )?step \d+ loss ", line)]


def torchrun() -> list[str]:
    """How to start torchrun: beside this Python, on PATH, or as `python -m torch.distributed.run`."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


#: the Tensor methods that read a value back to the host (a host-device sync on CUDA)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, reading a tensor's value on the host raises, as no hookpolicy hook may do.

    A hook that did would raise inside the hook, where onError contains it: a test using
    this also checks that no hook error was counted, or it could not fail.
    """
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync inside a hook")

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, forbidden)
        yield


def metric(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> Optional[float]:
    """The one sample of `name` whose labels include `labels` (None if there is none).

    Like `registry.get_sample_value`, but a label the test does not care about (`model`,
    say) need not be spelled out.
    """
    found = [s.value for family in registry.collect() for s in family.samples
             if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None
