"""A script of nanoGPT's `train.py`'s shape and defaults under each shipped loss policy (`hookpolicy apply`), on the CPU
and, where torch sees a GPU, on CUDA with the defaults a GPU reaches (`CUDA_CONFIGS`, and `compile=True`).

`tests/stacks/nanogpt_pattern.py` is written here (nothing of another repository is committed to
this one), keeping what of nanoGPT's script matters to hookpolicy as it is there; nanoGPT's own
`train.py` was run unmodified under the same policies while this was built, and crashed the same
way before the fix. The test writes a tiny `train.bin`/`val.bin` of random tokens and passes the
overrides nanoGPT's configurator takes. What its defaults reach on a CPU:

- `GradScaler(enabled=(dtype == 'float16'))`: the default dtype on a machine without CUDA
  is 'float16', and `torch.cuda.amp.GradScaler` then disables itself (no CUDA); with
  `--dtype=bfloat16` or `float32` it is made disabled. A disabled scaler has no `_scale`
  (what broke hookpolicy's `GradScaler.scale` wrapper at the first backward, and the
  first snapshot of recover.yaml at step 50); `scaler.unscale_`, `clip_grad_norm_`,
  `scaler.step`, `scaler.update` go through it as no-ops;
- gradient accumulation (`loss / gradient_accumulation_steps`, one backward each);
- an evaluation under `torch.no_grad()` with `model.eval()` every `eval_interval`, and a
  checkpoint (`torch.save` of the state dicts) after it;
- a second run into the same folder with `--init_from=resume` (`optimizer.load_state_dict`).

Each configuration must run to its end (exit 0) and print the same losses as the script
run without hookpolicy (the guard skips no step on clean data), its loss records must be
the script's own printed loss (observe.yaml), and recover.yaml's first snapshot must be
taken (55 steps, every: 50).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO

SCRIPT = REPO / "tests" / "stacks" / "nanogpt_pattern.py"
TINY = ["--device=cpu", "--compile=False", "--dataset=tiny", "--n_layer=2", "--n_head=2", "--n_embd=32",
        "--block_size=32", "--batch_size=4", "--eval_interval=25", "--eval_iters=2", "--log_interval=1",
        "--warmup_iters=5", "--lr_decay_iters=60"]
#: (name, overrides): the configurations the script's defaults reach on a CPU
CONFIGS = [
    ("defaults", ["--max_iters=55", "--gradient_accumulation_steps=2"]),  # float16 asked, scaler disabled (no CUDA)
    ("bf16", ["--max_iters=55", "--dtype=bfloat16", "--gradient_accumulation_steps=3"]),
    ("fp32-no-clip", ["--max_iters=55", "--dtype=float32", "--gradient_accumulation_steps=1", "--grad_clip=0.0"]),
]
#: what the defaults reach on a GPU (bfloat16 where supported, float16 with an enabled GradScaler where not;
#: skipped without CUDA: run where a GPU is lent, as tests/test_cuda.py)
CUDA_CONFIGS = [
    ("cuda-defaults", ["--device=cuda", "--max_iters=55", "--gradient_accumulation_steps=2"]),
    ("cuda-fp16", ["--device=cuda", "--max_iters=55", "--dtype=float16", "--gradient_accumulation_steps=2"]),
]
POLICIES = ["loss-spike-guard", "recover", "observe"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def folder(tmp_path: Path) -> Path:
    """The script's files and a tiny data set of random tokens (vocab 64) in `tmp_path`."""
    shutil.copy(SCRIPT, tmp_path / "train.py")
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 20000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 64, 4000, dtype=np.uint16).tofile(data / "val.bin")
    import pickle
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)
    return tmp_path


def run(cwd: Path, args: list[str], policy: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOOKPOLICY_OUTPUT_DIR": str(cwd / "hp")}
    head = [sys.executable, "-m", "hookpolicy", "apply", str(REPO / "policies" / f"{policy}.yaml"), "--"] if policy else []
    return subprocess.run([*head, sys.executable, "train.py", *TINY, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400)


def losses(stdout: str) -> list[str]:
    return re.findall(r"^iter (\d+): loss (\S+),", stdout, flags=re.M)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,overrides", [*CONFIGS, *(pytest.param(*c, marks=needs_cuda) for c in CUDA_CONFIGS)],
                         ids=[c[0] for c in CONFIGS + CUDA_CONFIGS])
def test_nanogpt_runs_unmodified_under_each_loss_policy(
    tmp_path: Path, policy: str, name: str, overrides: list[str],
) -> None:
    cwd = folder(tmp_path)
    plain = run(cwd, [*overrides, "--out_dir=plain"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    governed = run(cwd, [*overrides, "--out_dir=governed"], policy)
    assert governed.returncode == 0, governed.stderr[-3000:]
    assert "Traceback" not in governed.stderr
    assert "raised" not in governed.stderr  # no fault of hookpolicy's, contained or not
    assert losses(governed.stdout) == losses(plain.stdout) and len(losses(plain.stdout)) == 56
    if policy == "recover":
        assert "first snapshot for then: rewind after step 49" in governed.stderr
    if policy == "observe":
        import json
        records = [json.loads(line) for line in (cwd / "hp" / "runs" / "observe.jsonl").read_text().splitlines()]
        mean = [r["stats"]["mean"] for r in records if r.get("rule") == "loss"]
        assert len(mean) == 56
        accum = int(next(o for o in overrides if "gradient_accumulation" in o).split("=")[1])
        if accum == 1:  # nanoGPT prints loss.item() * accum of the last micro-batch, to 4 decimals
            printed = [float(loss) for _, loss in losses(plain.stdout)]
            assert mean == pytest.approx(printed, abs=6e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recover", "loss-spike-guard"])
def test_nanogpt_resumes_into_the_same_folder_under_a_policy(tmp_path: Path, policy: str) -> None:
    """A first run writes out/ckpt.pt; the second, `--init_from=resume`, loads the model and the optimizer's state."""
    cwd = folder(tmp_path)
    first = run(cwd, ["--max_iters=30", "--gradient_accumulation_steps=1", "--out_dir=out"], policy)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (cwd / "out" / "ckpt.pt").exists()
    second = run(cwd, ["--max_iters=60", "--gradient_accumulation_steps=1", "--out_dir=out", "--init_from=resume"],
                 policy)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert losses(second.stdout)[-1][0] == "60"


@pytest.mark.slow
@needs_cuda
def test_nanogpt_compiled_on_cuda_runs_under_the_loss_spike_guard(tmp_path: Path) -> None:
    """nanoGPT's own defaults on a GPU: `compile=True`, bfloat16 (float16 and a GradScaler where not supported)."""
    cwd = folder(tmp_path)
    overrides = ["--device=cuda", "--compile=True", "--max_iters=55", "--gradient_accumulation_steps=2"]
    plain = run(cwd, [*overrides, "--out_dir=plain"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    governed = run(cwd, [*overrides, "--out_dir=governed"], "loss-spike-guard")
    assert governed.returncode == 0, governed.stderr[-3000:]
    assert "Traceback" not in governed.stderr and "raised" not in governed.stderr
    assert losses(governed.stdout) == losses(plain.stdout) and len(losses(plain.stdout)) == 56
