"""The tests' shared helpers, imported by name (`from helpers.models import tiny`); the
fixtures and pytest hooks are in tests/conftest.py, and no test file imports another.

pyproject's `pythonpath = ["tests"]` puts tests/ on sys.path whichever way pytest is
started and whatever its import mode.

- `policies`: policies written on the fly, the spec's example policy;
- `models`: the tiny models (an MLP, a two-block GPT with nanoGPT's names and its LoRA
  fine-tune) and their training loop; `gpt2`: HF's GPT-2, tiny, and its LoRA fine-tune;
- `hooks`: PyTorch's hook tables counted (to catch a leaked hook), the process-wide state
  hookpolicy must give back, and a guard that no hook reads a tensor back to the host;
- `outputs`: what hookpolicy writes, read back (a registry's sample, the exporter for a
  `with`, a JSON-lines log);
- `processes`: `hookpolicy apply` run for real (scraping its metrics, torchrun);
  `child_scripts`: code shared by the scripts tests run as child processes;
- `references`: published algorithms written from their equations (AGC, ZClip), the
  references that more than one test file checks hookpolicy against;
- `dist_train`: the distributed tests' training script (run by torchrun, its `wrap` imported).
- `library`: the policy library's files and what the tests of `policies/` read back (tests/test_policies*.py).
"""

from __future__ import annotations

from pathlib import Path

#: the repository's root folder
REPO = Path(__file__).resolve().parent.parent.parent
