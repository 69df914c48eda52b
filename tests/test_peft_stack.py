"""PEFT (LoRA) on the compatibility matrix: HF Trainer + peft under `hookpolicy apply`.

tests/peft/trainer.py is an unmodified fine-tuning script (Trainer, accelerate, a tiny
GPT-2 with LoRA on c_attn, the loss NaN at one step); tests/peft/guard.yaml is written
for the base model's names plus `adapters: all`. Checked against what hookpolicy did not
compute: `hookpolicy_steps_total` is the Trainer's `state.global_step`; the NaN step left
the adapter and the optimizer state bit for bit as they were (the script's own optimizer
step hooks) and every other step changed them; the norm of the gradients the optimizer
applied is at most max_norm and equals min(exported pre-clip norm, max_norm); the layer
labels are the base model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO

pytest.importorskip("peft")

HERE = REPO / "tests" / "peft"
MAX_NORM = 0.5


@pytest.mark.slow
def test_hf_trainer_with_lora_under_apply(tmp_path: Path, free_port: int) -> None:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STACK_OUT": str(out), "OMP_NUM_THREADS": "1"}
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(HERE / "guard.yaml"), "--metrics-port", str(free_port), "--",
         sys.executable, str(HERE / "trainer.py"), "--steps", "6", "--nan-at", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    seen = json.loads(out.read_text())
    probe = seen["probes"]["optimizer"]  # the script's own measurements (tests/stacks/probe.py)
    samples = [(s.name, dict(s.labels), s.value)
               for f in text_string_to_metric_families(seen["metrics"]) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        found = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
        assert len(found) == 1, f"{name}{labels}: {found}\n{done.stderr}"
        return found[0]

    assert value("hookpolicy_steps_total") == seen["global_step"] == len(probe["norms"]) == 6
    assert [i for i, same in enumerate(probe["unchanged"]) if not same] == [0, 1, 2, 4, 5]
    assert value("hookpolicy_skipped_steps_total", rule="nan") == 1
    assert seen["finite"]
    applied = [n for i, n in enumerate(probe["norms"]) if i != 3]
    assert all(n <= MAX_NORM * (1 + 1e-5) for n in applied), applied
    assert value("hookpolicy_grad_l2_norm", rule="clip") > 10 * MAX_NORM  # the clip had work to do
    assert applied[-1] == pytest.approx(min(value("hookpolicy_grad_l2_norm", rule="clip"), MAX_NORM), rel=1e-4)
    layers = {lab["module"] for n, lab, _ in samples if n == "hookpolicy_output_rms"}
    assert layers == {"transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"}
    frozen = [line for line in done.stderr.splitlines() if "frozen parameters" in line]
    assert frozen == [  # clip (adapters: all) binds no frozen one
        "hookpolicy: stack/nan: 28 frozen parameters (requires_grad=False) left out: they never get a gradient"], done.stderr
