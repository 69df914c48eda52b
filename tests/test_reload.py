"""The reload watcher (`hookpolicy/apply/reload.py`) in ops' world: a ConfigMap volume updated
the way the kubelet updates it, with the watcher looking between its steps; half-written
files; a reload that fails for a reason the files do not show. A failed reload is tried again
until it succeeds or the files change, so no update is lost.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers import REPO
from helpers.configmap import ConfigMapVolume
from helpers.outputs import parse_exposition
from helpers.policies import LOG_EVERY_STEP, policy_text
from helpers.processes import Proc, scrape_text, start_apply
from hookpolicy.apply import reload
from hookpolicy.apply.reload import Reloader, Swaps
from hookpolicy.environment import ChildConfig

A, B = policy_text(LOG_EVERY_STEP, name="a"), policy_text(LOG_EVERY_STEP, name="b")
INTERVAL = 0.05


def watcher(folder: Path) -> tuple[Reloader, Swaps, CollectorRegistry]:
    """A watching Reloader on `folder`, started on what the folder holds now (as `apply` starts)."""
    swaps = Swaps(hookpolicy.load(folder), rank=0)
    registry = CollectorRegistry()
    config = ChildConfig(sources=(str(folder),), watch=True, interval=INTERVAL)
    return Reloader(config, swaps, registry=registry), swaps, registry


def newest(swaps: Swaps) -> list[str]:
    """The names of the newest policies this process was handed (what every model swaps to)."""
    return [p.name for p in swaps.current()[0].policies]


def reload_ok(registry: CollectorRegistry) -> Optional[float]:
    return registry.get_sample_value("hookpolicy_config_last_reload_successful", {"rank": "0"})


@pytest.mark.parametrize("looks", [("swapped", "unlinked"), ("unlinked",), ("swapped",), ("linked", "unlinked")])
def test_a_key_removed_from_a_configmap_is_unloaded_whenever_the_watcher_looks(
    tmp_path: Path, looks: tuple[str, ...], capsys: pytest.CaptureFixture[str],
) -> None:
    """The reported fault: a look between the `..data` swap and the removal of the key's link saw a
    dangling link and failed; the next looks saw the file list of the failed reload, so nothing
    retried and the removed policy stayed live."""
    volume = ConfigMapVolume(tmp_path / "guardrails", {"a.yaml": A, "b.yaml": B})
    reloader, swaps, registry = watcher(volume.folder)
    assert newest(swaps) == ["a", "b"]
    volume.update({"a.yaml": A}, look=lambda step: reloader.check() if step in looks else None)
    if "swapped" in looks and "unlinked" not in looks:  # the link dangled at the only look
        assert reload_ok(registry) == 0 and "a dangling symbolic link" in capsys.readouterr().err
        assert newest(swaps) == ["a", "b"]
    reloader.check()  # the next look after the update
    assert newest(swaps) == ["a"] and reload_ok(registry) == 1
    reloader.check()
    assert newest(swaps) == ["a"] and reload_ok(registry) == 1


@pytest.mark.parametrize("looks", [("swapped", "linked"), ("linked",), ("swapped",)])
def test_a_key_added_to_a_configmap_is_loaded_whenever_the_watcher_looks(tmp_path: Path, looks: tuple[str, ...]) -> None:
    volume = ConfigMapVolume(tmp_path / "guardrails", {"a.yaml": A})
    reloader, swaps, registry = watcher(volume.folder)
    volume.update({"a.yaml": A, "b.yaml": B}, look=lambda step: reloader.check() if step in looks else None)
    reloader.check()
    assert newest(swaps) == ["a", "b"] and reload_ok(registry) == 1


def test_a_key_changed_in_a_configmap_is_reloaded_at_the_swap(tmp_path: Path) -> None:
    """A changed key's link never dangles: the look right after the `..data` swap loads the new content."""
    volume = ConfigMapVolume(tmp_path / "guardrails", {"a.yaml": A, "b.yaml": B})
    reloader, swaps, registry = watcher(volume.folder)
    old = swaps.current()[0].policies[0].revision
    seen: list[str] = []

    def look(step: str) -> None:
        reloader.check()
        seen.append(swaps.current()[0].policies[0].revision)

    volume.update({"a.yaml": A.replace("rms]", "rms, mean]"), "b.yaml": B}, look=look)
    new = hookpolicy.load(volume.folder / "a.yaml").policies[0].revision
    assert new != old and seen == [new, new, new] and reload_ok(registry) == 1


def test_a_half_written_file_is_reloaded_once_it_is_whole(tmp_path: Path) -> None:
    """An in-place write seen halfway: a prefix that does not parse fails (and is tried again), a
    prefix that does (1 rule of 2) loads; either way the whole file is what runs in the end."""
    folder = tmp_path / "policies"
    folder.mkdir()
    path = folder / "a.yaml"
    path.write_text(policy_text(LOG_EVERY_STEP.split("- name: outputs")[0], name="a"))
    reloader, swaps, registry = watcher(folder)
    whole = policy_text(LOG_EVERY_STEP, name="a")
    cut = whole.index("  trigger: {at: forward}")  # in the middle of the second rule: no `actions:` yet
    path.write_text(whole[:cut])
    reloader.check()
    assert reload_ok(registry) == 0
    with open(path, "a") as f:
        f.write(whole[cut:])
    reloader.check()
    assert reload_ok(registry) == 1
    assert [r.name for r in swaps.current()[0].policies[0].rules] == ["norms", "outputs"]


def test_a_failed_reload_is_tried_again_until_it_succeeds_without_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A validation cut short (a busy node) fails once; the files do not change again, and the
    retry, one interval later, loads them. Retries that fail the same way say nothing new, and
    wait twice as long each time."""
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "a.yaml").write_text(A)
    reloader, swaps, registry = watcher(folder)
    real = reload.load_elsewhere
    fails = [3]
    calls: list[float] = []

    def flaky(sources: Any, timeout: float = 120.0) -> Any:
        calls.append(time.monotonic())
        if fails[0]:
            fails[0] -= 1
            raise hookpolicy.PolicyError([hookpolicy.Problem(sources[0], 0, 0, "$", "validation took longer than 120 s")])
        return real(sources)

    monkeypatch.setattr(reload, "load_elsewhere", flaky)
    (folder / "b.yaml").write_text(B)
    reloader.check()
    assert reload_ok(registry) == 0 and newest(swaps) == ["a"] and len(calls) == 1
    reloader.check()  # at once: not yet
    assert len(calls) == 1
    deadline = time.monotonic() + 10
    while reload_ok(registry) != 1 and time.monotonic() < deadline:
        time.sleep(INTERVAL / 5)
        reloader.check()
    assert reload_ok(registry) == 1 and newest(swaps) == ["a", "b"] and len(calls) == 4
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps[0] >= INTERVAL and gaps[1] >= 2 * INTERVAL and gaps[2] >= 4 * INTERVAL, gaps
    err = capsys.readouterr().err
    assert err.count("reload failed") == 1 and "the policy files load again" in err
    reloader.check()
    assert len(calls) == 4  # nothing to retry once it succeeded


def test_a_change_during_the_retry_wait_reloads_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "a.yaml").write_text(A)
    reloader, swaps, registry = watcher(folder)
    reloader.config = ChildConfig(sources=(str(folder),), watch=True, interval=3600.0)  # a retry would wait an hour
    (folder / "b.yaml").write_text("not: [a policy")
    reloader.check()
    assert reload_ok(registry) == 0
    (folder / "b.yaml").write_text(B)
    reloader.check()
    assert reload_ok(registry) == 1 and newest(swaps) == ["a", "b"]


@pytest.mark.slow
def test_apply_watch_unloads_a_key_removed_from_a_configmap_volume(
    tmp_path: Path, procs: list[Proc], free_port: int,
) -> None:
    """End to end: `apply --watch` on a ConfigMap volume, the removed key's link left dangling for
    1 s after the `..data` swap (ten watch intervals), as a slow kubelet does."""
    volume = ConfigMapVolume(tmp_path / "guardrails", {"a.yaml": A, "b.yaml": B})
    stop = tmp_path / "stop"
    proc = start_apply(procs, tmp_path / "apply", [
        str(volume.folder), "--watch", "--metrics-port", str(free_port), "--", sys.executable,
        str(REPO / "examples" / "train_mlp.py"), "--steps", "100000", "--sleep", "0.02", "--stop-file", str(stop),
    ], HOOKPOLICY_OUTPUT_DIR=str(tmp_path), HOOKPOLICY_WATCH_INTERVAL="0.1")

    def policies() -> tuple[set[str], Optional[float]]:
        try:
            samples = parse_exposition(scrape_text(free_port))
        except OSError:
            return set(), None
        names = {dict(labels)["policy"] for (name, labels) in samples if name == "hookpolicy_policy_info"}
        ok = samples.get(("hookpolicy_config_last_reload_successful", (("rank", "0"),)))
        return names, None if ok is None else ok[1]

    proc.wait_for(lambda: policies() == ({"a", "b"}, 1.0), timeout=90, what="both policies live")
    volume.update({"a.yaml": A}, look=lambda step: time.sleep(1.0) if step == "linked" else None)
    proc.wait_for(lambda: policies() == ({"a"}, 1.0), timeout=30, what="b unloaded")
    assert "a dangling symbolic link" in proc.stderr  # the watcher did look in between
    stop.touch()
    assert proc.wait(60) == 0, proc.stderr
