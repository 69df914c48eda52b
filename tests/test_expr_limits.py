"""What `check` accepts in an expression, evaluation runs: the limits match what evaluation can do.

A flat chain of ~1,000 `+ - * /` terms used to pass `check` and raise RecursionError at
every evaluation (the rule switched off; under `onError: halt`, training halted at step
0): the depth limit counted only parentheses and signs. The tokenizer sliced the rest of
the text once per token (10k/20k/40k terms took 1.5/4.8/12.3 s to check).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import hookpolicy
from hookpolicy.policy import expr
from hookpolicy.policy.expr import MAX_OPERATIONS_DEEP, MAX_TOKENS, ExprError, parse, parse_value

from helpers.policies import write_policy

def _chain(ops: str, terms: int) -> tuple[str, Callable[[float], float]]:
    """`l2_norm op 1.5 op 1.5 ...` (`terms` operands in all), and Python's own reading of it."""
    text = "l2_norm" + "".join(f" {ops[i % len(ops)]} 1.5" for i in range(terms - 1))

    def reference(x: float) -> float:
        return float(eval(text, {"__builtins__": {}}, {"l2_norm": x}))  # same precedence, same associativity

    return text, reference


def _at_depth(frames: int, run: Callable[[], Any]) -> Any:
    """`run()` called `frames` Python frames down, as a hook deep in a model's forward is."""
    return run() if frames == 0 else _at_depth(frames - 1, run)


@pytest.mark.parametrize("ops", ["+", "-", "*", "/", "+-*/"])
def test_every_chain_check_accepts_evaluates_as_python_does_even_deep_in_a_stack(ops: str) -> None:
    text, reference = _chain(ops, MAX_OPERATIONS_DEEP)  # the comparison is one more operation
    condition = parse(f"{text} > 0")
    value = parse_value(text)
    frames = sys.getrecursionlimit() - 300
    assert _at_depth(frames, lambda: value.evaluate({"l2_norm": 2.0})) == reference(2.0)
    assert _at_depth(frames, lambda: condition.evaluate({"l2_norm": 2.0})) == (reference(2.0) > 0)
    assert _at_depth(frames, lambda: parse(str(condition)) == condition and hash(condition) == hash(parse(text + " > 0")))


@pytest.mark.parametrize("terms", [MAX_OPERATIONS_DEEP + 2, 1000, 5000])
def test_a_longer_chain_is_refused_at_the_operator_past_the_limit(terms: int) -> None:
    text, _ = _chain("+", terms)
    with pytest.raises(ExprError) as caught:
        parse_value(text)
    offsets = [m.start() for m in re.finditer(r"\+", text)]
    if terms - 1 < MAX_TOKENS // 2:
        assert caught.value.offset == offsets[MAX_OPERATIONS_DEEP], caught.value  # the 65th "+"
        assert f"more than {MAX_OPERATIONS_DEEP} operations deep" in str(caught.value)
    else:  # refused by length first: the 1,001st token
        assert f"longer than {MAX_TOKENS} tokens" in str(caught.value)
        assert caught.value.offset == offsets[MAX_TOKENS // 2 - 1] + 2


def test_signs_and_comparisons_count_as_operations_too() -> None:
    deepest = "-(" * 15 + "l2_norm" + " + 1" * 32 + ")" * 15 + " > 0"  # 15 signs + 32 + 1 = 48
    assert parse(deepest).evaluate({"l2_norm": 1.0}) is False
    with pytest.raises(ExprError, match="operations deep"):
        parse("-(" * 16 + "l2_norm" + " + 1" * 48 + ")" * 16 + " > 0")
    many = " or ".join(["l2_norm > 1"] * 200)  # `or` joins any number of comparisons at one level
    assert parse(many).evaluate({"l2_norm": 2.0})


def test_the_tokenizer_reads_each_character_once_and_stops_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    token = expr._TOKEN

    class Counting:
        def match(self, text: str, pos: int = 0) -> Any:
            calls.append(pos)
            return token.match(text, pos)

    monkeypatch.setattr(expr, "_TOKEN", Counting())
    text, _ = _chain("+", 40000)
    with pytest.raises(ExprError, match="tokens"):
        parse(f"{text} > 0")
    assert len(calls) == MAX_TOKENS + 1 and calls == sorted(set(calls))
    calls.clear()
    assert parse(" " * 1_000_000 + "l2_norm > 1" + " " * 1_000_000).evaluate({"l2_norm": 2.0})
    assert len(calls) == 3


def test_check_gives_the_file_line_and_column_of_a_chain_too_long(tmp_path: Path) -> None:
    text, _ = _chain("+", 1000)
    path = write_policy(tmp_path, f"""
        - name: r
          match: {{types: [Linear]}}
          trigger: {{at: step}}
          actions:
            - alert: {{if: "{text} > 0"}}
    """)
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    (problem,) = caught.value.problems
    line = path.read_text().splitlines()[problem.line - 1]
    assert problem.path == "$.spec.rules[0].actions[0].alert.if"
    assert line[problem.column - 3:].startswith("+ 1.5 +")  # the 1,001st token: the 500th term's 1.5
    assert f"longer than {MAX_TOKENS} tokens" in problem.message


@pytest.mark.parametrize("field", ["{step:c}", "{rank:c}"])
def test_a_message_that_formats_only_early_steps_is_refused_at_check(tmp_path: Path, field: str) -> None:
    """`{step:c}` passed check (step 0 is a character) and raised from step 1,114,112 on."""
    with pytest.raises(OverflowError):
        format(1_114_112, "c")  # the reference: Python's own format at that step
    path = write_policy(tmp_path, f"""
        - name: r
          match: {{types: [Linear]}}
          trigger: {{at: step}}
          actions:
            - alert: {{if: "l2_norm > 1", message: "at {field}"}}
    """)
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    (problem,) = caught.value.problems
    assert problem.path == "$.spec.rules[0].actions[0].alert.message" and problem.line > 0
    assert "cannot be formatted at step" in problem.message
