"""Time per module name of the patterns that backtrack in `re`, and of ordinary ones (a few seconds).

    python bench/patterns.py

Matching runs at attach (under `hookpolicy apply`, in the script's first forward), once per
(pattern, module name). The reliability pass found globs and regexes for which Python's
backtracking `re` needs minutes for one name; docs/reliability.md quotes these numbers.
Each row: the pattern, the name's length, which engine `compile_glob` chose, the time of the
first name (the automaton builds its sets) and of the same name again, and, for ordinary
patterns, the time per name over a 4,000-module model's names.
"""

from __future__ import annotations

import time

from hookpolicy.policy.patterns import compile_glob

WORST = [
    ("*a*a*a*a*a*a*a*a*a*a*a*ab", "a" * 40),
    ("*a*a*a*a*a*a*a*a*a*a*a*ab", "a" * 1000),
    ("re:(a+)+x", "a" * 24 + "b"),
    ("re:(a+)+x", "a" * 1000),
    ("re:(?:a|aa)*c", "a" * 1000),
    ("**.*.**.*.**.*.**.*.**.*.**.*.**.zzz", ".".join(["0"] * 60)),
    ("**.*.**.*.**.*.**.*.**.*.**.*.**.zzz", ".".join(["0"] * 500)),
    ("*a*b", "a" * 1000 + "c"),  # two wildcards: re, O(n^2) at worst
    ("**a**b", ".".join(["a"] * 500) + "c"),
]
ORDINARY = ["**.q_proj", "model.layers.*.self_attn.*", "re:.*\\.layers\\.\\d+\\..*proj", "lm_head", "**.*.mlp.*_proj"]
NAMES = [f"model.layers.{i}.self_attn.{p}" for i in range(1000) for p in ("q_proj", "k_proj")] + [
    f"model.layers.{i}.mlp.{p}" for i in range(1000) for p in ("up_proj", "down_proj")]


def main() -> None:
    print(f"{'pattern':40s} {'name':>6s} {'engine':14s} {'first':>10s} {'again':>10s}")
    for pattern, name in WORST:
        compiled = compile_glob(pattern)
        start = time.perf_counter()
        compiled.fullmatch(name)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiled.fullmatch(name)
        again = time.perf_counter() - start
        print(f"{pattern:40s} {len(name):6d} {type(compiled).__name__:14s} {first * 1e3:8.3f}ms {again * 1e3:8.3f}ms")
    print(f"\n{'pattern':40s} per name over {len(NAMES)} names")
    for pattern in ORDINARY:
        compiled = compile_glob(pattern)
        start = time.perf_counter()
        for name in NAMES:
            compiled.fullmatch(name)
        took = (time.perf_counter() - start) / len(NAMES)
        print(f"{pattern:40s} {took * 1e6:8.2f} us ({type(compiled).__name__})")


if __name__ == "__main__":
    main()
