"""The strict YAML loader: positions, refusals, files, folders and the bad-file corpus."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hookpolicy.policy import loader, schema
from hookpolicy.policy.build import build_policy
from hookpolicy.errors import PolicyError, Problem
from hookpolicy.policy.document import json_path
from hookpolicy.policy.loader import MAX_BYTES, parse_document, read_document
from hookpolicy.policy.sources import load_sources

ROOT = Path(__file__).resolve().parent.parent
BAD = Path(__file__).resolve().parent / "bad"
EXPECT = re.compile(r"# expect: (\d+):(\d+): (\S+): (.+)")

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: {name}
spec:
  rules:
    - name: r
      match: {{modules: ["**"]}}
      trigger: {{at: forward}}
      actions:
        - capture: {{stats: [l2_norm]}}
"""


def problems_of(text: str) -> list[Problem]:
    with pytest.raises(PolicyError) as caught:
        parse_document(text, "p.yaml")
    return list(caught.value.problems)


def load_problems(*sources: str | os.PathLike[str]) -> list[Problem]:
    with pytest.raises(PolicyError) as caught:
        load_sources(sources)
    return list(caught.value.problems)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- corpus


@pytest.mark.parametrize("path", sorted(BAD.glob("*.yaml")), ids=lambda p: p.name)
def test_bad_file_reports_exactly_the_expected_problems(path: Path) -> None:
    expected = [EXPECT.match(line) for line in path.read_text("utf-8").splitlines()]
    wanted = [(int(m[1]), int(m[2]), m[3], m[4]) for m in expected if m]
    assert wanted, f"{path.name} has no '# expect:' line"

    problems = load_problems(path)

    for line, column, where, message in wanted:
        assert any(
            (p.line, p.column, p.path) == (line, column, where) and message in p.message
            for p in problems
        ), f"missing {line}:{column}: {where}: {message}\ngot:\n" + "\n".join(map(str, problems))
    assert len(problems) == len(wanted), "unexpected problems:\n" + "\n".join(map(str, problems))
    assert all(p.file == str(path) for p in problems)


def test_corpus_covers_every_refusal_of_the_spec() -> None:
    names = {p.stem for p in BAD.glob("*.yaml")}
    for needed in (
        "unknown-key-deep", "duplicate-key", "anchor-alias", "alias-bomb", "merge-key",
        "python-tag", "tab", "syntax-error", "wrong-api-version", "wrong-kind", "wrong-type",
        "out-of-range", "non-finite", "not-in-enum", "target-trigger", "stat-unknown",
        "duplicate-rule-names", "bad-glob", "bad-regex", "if-does-not-parse", "clip-both-kinds",
        "escaping-paths", "message-field",
    ):
        assert needed in names


# --------------------------------------------------------------------------- YAML layer


def test_positions_of_values_and_keys_are_one_based() -> None:
    document = parse_document(POLICY.format(name="p"), "p.yaml")
    assert document.values[("metadata", "name")] == (4, 9)
    assert document.keys[("metadata", "name")] == (4, 3)
    assert document.values[("spec", "rules", 0, "match", "modules", 0)] == (8, 25)
    assert document.position(("spec", "rules", 0, "no", "such")) == (7, 7)
    assert document.data["spec"]["rules"][0]["trigger"] == {"at": "forward"}


def test_json_path_quotes_keys_that_are_not_identifiers() -> None:
    assert json_path(()) == "$"
    assert json_path(("spec", "rules", 0, "match")) == "$.spec.rules[0].match"
    assert json_path(("labels", "a.b/c", "it's")) == "$.labels['a.b/c']['it\\'s']"


def test_scalars_resolve_like_yaml_1_1_without_constructing_objects() -> None:
    document = parse_document(
        "a: 1\nb: 1.5\nc: true\nd: ~\ne: 2024-01-01\nf: '1'\ng: 0x10\nh: .nan\n", "p.yaml"
    )
    data = document.data
    assert (data["a"], data["b"], data["c"], data["d"]) == (1, 1.5, True, None)
    assert data["e"] == "2024-01-01"  # a timestamp stays the text it is
    assert (data["f"], data["g"]) == ("1", 16)
    assert data["h"] != data["h"]


def test_tags_never_construct_anything(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f'a: !!python/object/apply:os.system ["touch {marker}"]\n'
    problems = problems_of(text)
    assert [p.message.split(";")[0] for p in problems] == [
        "tags (!!python/object/apply:os.system) are not allowed"
    ]
    assert not marker.exists()


def test_alias_bomb_is_refused_at_the_anchor_without_expansion() -> None:
    levels = ["a0: &a0 [" + ",".join(['"lol"'] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 30)]
    problems = problems_of("\n".join(levels) + "\n")  # 10**30 strings if expanded
    assert (problems[0].line, problems[0].column) == (1, 5)
    assert problems[0].message.startswith("anchors (&a0) are not allowed")


@pytest.mark.parametrize("opening", ["[", "{", "- ", "? "])
def test_deep_nesting_is_a_problem_not_a_recursion_error(opening: str) -> None:
    nested = opening * 100_000 + "x\n"
    problems = problems_of("a: " + nested if opening in "[{" else nested)
    assert len(problems) == 1
    assert "nested deeper than 64 levels" in problems[0].message


def test_sixty_four_levels_are_fine() -> None:
    text = "a: " + "[" * 63 + "1" + "]" * 63 + "\n"  # the top mapping is level 1
    assert parse_document(text, "p.yaml").data["a"] is not None
    assert "nested deeper" in problems_of("a: " + "[" * 64 + "1" + "]" * 64 + "\n")[0].message


def test_non_string_keys_name_the_yaml_1_1_trap() -> None:
    problems = problems_of("trigger:\n  on: step\n1: x\n[a]: b\n")
    assert [(p.line, p.column, p.path) for p in problems] == [
        (2, 3, "$.trigger.on"), (3, 1, "$['1']"), (4, 1, "$"),
    ]
    assert "read as a boolean by YAML 1.1" in problems[0].message
    assert "a key must be a string, found a list" in problems[2].message


def test_yaml_problems_are_all_reported_together() -> None:
    problems = problems_of("a: &x 1\nb: 1\nb: 2\nc: !!str 3\n<<: {d: 1}\n")
    assert [(p.line, p.column) for p in problems] == [(1, 4), (3, 1), (4, 4), (5, 1)]


def test_syntax_errors_after_other_problems_keep_both() -> None:
    problems = problems_of("a: &x 1\nb: [1, 2\n")
    assert [p.line for p in problems] == [1, 3]
    assert "invalid YAML" in problems[1].message


def test_too_many_problems_stop_with_a_note() -> None:
    problems = problems_of("".join(f"k{i}: &a{i} 1\n" for i in range(500)))
    assert len(problems) == loader.MAX_PROBLEMS + 1
    assert problems[-1].message == f"stopped after {loader.MAX_PROBLEMS} problems"


def test_not_utf8_points_at_the_byte() -> None:
    with pytest.raises(PolicyError) as caught:
        parse_document(b"a: 1\nb: caf\xe9\n", "p.yaml")
    (problem,) = caught.value.problems
    assert (problem.line, problem.column) == (2, 7)
    assert "not UTF-8" in problem.message


def test_control_characters_are_refused_with_position() -> None:
    (problem,) = problems_of("a: 1\nb: x\x00y\n")
    assert (problem.line, problem.column) == (2, 5)
    assert "U+0000" in problem.message


@pytest.mark.parametrize("brk", ["\r", "\x85", "\u2028", "\u2029"], ids=["CR", "NEL", "LS", "PS"])
def test_line_breaks_that_editors_do_not_count_are_refused_where_they_stand(brk: str) -> None:
    """YAML counts them as line breaks; with one in the file, every later position would
    name a line the user's editor does not have (the fuzz test found one past the end)."""
    (problem,) = problems_of(f"a: 1\nb: [x,{brk}{brk}\nc: [\n")
    assert (problem.line, problem.column) == (2, 7)
    assert f"U+{ord(brk):04X}" in problem.message and "line break" in problem.message


def test_windows_line_ends_are_allowed_and_counted_as_one() -> None:
    assert parse_document(b"a: 1\r\nb: 2\r\n", "p.yaml").data == {"a": 1, "b": 2}
    (problem,) = problems_of("a: 1\r\nb: [\r\nc: 1\r\n")
    assert problem.line <= 4


def test_a_byte_order_mark_is_allowed() -> None:
    assert parse_document("\ufeffa: 1\n".encode("utf-8"), "p.yaml").data == {"a": 1}


YAML_BITS = st.sampled_from(list(" \n\t-:{}[],'\"&*!|>#%?.09az") + ["<<", ".nan", "on", "~"])


@settings(max_examples=300, deadline=None)
@given(
    position=st.floats(min_value=0, max_value=1),
    inserted=st.lists(YAML_BITS, max_size=4).map("".join),
    deleted=st.integers(min_value=0, max_value=6),
)
def test_a_mangled_policy_gives_problems_never_a_traceback(
    position: float, inserted: str, deleted: int
) -> None:
    text = POLICY.format(name="p")
    at = int(position * len(text))
    mangled = text[:at] + inserted + text[at + deleted:]
    try:
        build_policy(parse_document(mangled, "p.yaml"))
    except PolicyError as exc:
        assert exc.problems and all(p.path.startswith("$") for p in exc.problems)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_problems_never_a_traceback(content: bytes) -> None:
    try:
        parse_document(content, "p.yaml")
    except PolicyError as exc:
        assert exc.problems


def test_revision_is_the_content_hash() -> None:
    import hashlib

    text = POLICY.format(name="p").encode()
    assert parse_document(text, "p.yaml").revision == hashlib.sha256(text).hexdigest()[:12]


# --------------------------------------------------------------------------- files


def test_a_file_over_one_mib_is_refused_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: " + b"x" * (2 * MAX_BYTES) + b"\n")

    def never(*args: object) -> None:
        raise AssertionError("the YAML parser must not run on an oversized file")

    monkeypatch.setattr(loader, "_StrictLoader", never)
    with pytest.raises(PolicyError) as caught:
        read_document(big)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column) == (str(big), 0, 0)
    assert "larger than 1 MiB" in problem.message


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_reading_stops_after_one_mib() -> None:
    with pytest.raises(PolicyError, match="larger than 1 MiB"):
        read_document("/dev/zero")  # endless: only a bounded read returns


def test_exactly_one_mib_is_allowed(tmp_path: Path) -> None:
    text = POLICY.format(name="p").encode()
    padded = text + b"#" * (MAX_BYTES - len(text) - 1) + b"\n"
    assert len(padded) == MAX_BYTES
    path = tmp_path / "p.yaml"
    path.write_bytes(padded)
    assert load_sources(path)[0].name == "p"


def test_missing_file_is_a_problem(tmp_path: Path) -> None:
    (problem,) = load_problems(tmp_path / "nope.yaml")
    assert problem.message == "no such file"
    assert (problem.line, problem.column, problem.path) == (0, 0, "$")
    # Printed without a position it does not have (no ":0:0: $:").
    assert str(problem) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_source_and_revision_are_kept(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", POLICY.format(name="p"))
    (policy,) = load_sources(str(path))
    assert policy.source == str(path)
    assert re.fullmatch(r"[0-9a-f]{12}", policy.revision)


def test_folders_expand_to_their_yaml_files_in_name_order(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(name="bee"))
    write(tmp_path, "a.yml", POLICY.format(name="ay"))
    write(tmp_path, "c.txt", "not a policy")
    write(tmp_path, ".hidden.yaml", "not: [valid")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "d.yaml", "not: [valid")
    policies = load_sources(tmp_path)
    assert [p.name for p in policies] == ["ay", "bee"]
    assert policies[0].source == os.path.join(str(tmp_path), "a.yml")


def test_a_folder_without_policies_is_a_problem(tmp_path: Path) -> None:
    (problem,) = load_problems(tmp_path)
    assert problem.file == str(tmp_path)
    assert "no *.yaml or *.yml files" in problem.message


def test_duplicate_policy_names_across_files_point_at_the_second(tmp_path: Path) -> None:
    first = write(tmp_path, "one.yaml", POLICY.format(name="same"))
    second = write(tmp_path, "two.yaml", POLICY.format(name="same"))
    (problem,) = load_problems(first, second)
    assert (problem.file, problem.line, problem.column) == (str(second), 4, 9)
    assert problem.path == "$.metadata.name"
    assert f"first in {first}" in problem.message


def test_problems_of_every_file_are_collected_and_nothing_is_returned(tmp_path: Path) -> None:
    good = write(tmp_path, "good.yaml", POLICY.format(name="good"))
    bad1 = write(tmp_path, "bad1.yaml", POLICY.format(name="Bad"))
    bad2 = write(tmp_path, "bad2.yaml", "a: [\n")
    problems = load_problems(good, bad1, bad2)
    assert {p.file for p in problems} == {str(bad1), str(bad2)}


def test_sources_may_be_one_path_or_several(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", POLICY.format(name="a"))
    b = write(tmp_path, "b.yaml", POLICY.format(name="b"))
    assert [p.name for p in load_sources(a)] == ["a"]
    assert [p.name for p in load_sources([str(b), a])] == ["b", "a"]
    assert load_sources([]) == ()


# --------------------------------------------------------------------------- schema file


def test_schema_passes_draft_07_and_2020_12_meta_schemas() -> None:
    document = json.loads(schema.schema_json())
    jsonschema.Draft7Validator.check_schema(document)
    jsonschema.Draft202012Validator.check_schema(document)
    assert document["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert document["$id"]


def _subschemas(node: object) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    if isinstance(node, dict):
        found.append(node)
        for value in node.values():
            found.extend(_subschemas(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_subschemas(value))
    return found


def test_schema_avoids_what_differs_between_drafts_and_documents_every_field() -> None:
    document = json.loads(schema.schema_json())
    for sub in _subschemas(document):
        if "$ref" in sub:
            assert list(sub) == ["$ref"], f"$ref with siblings: {sub}"
        assert "oneOf" not in sub and "anyOf" not in sub
        assert not isinstance(sub.get("items"), list)
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False, sub.get("title")
            for name, prop in sub["properties"].items():  # type: ignore[attr-defined]
                assert "$ref" in prop or "description" in prop, name
    for name, definition in document["definitions"].items():
        assert "description" in definition, name


def test_schema_agrees_under_both_drafts() -> None:
    document = json.loads(schema.schema_json())
    data = parse_document((BAD / "out-of-range.yaml").read_text("utf-8"), "p").data
    seven = sorted(e.message for e in jsonschema.Draft7Validator(document).iter_errors(data))
    twenty = sorted(e.message for e in jsonschema.Draft202012Validator(document).iter_errors(data))
    assert seven == twenty and len(seven) == 4


def test_every_schema_pattern_is_explained_in_words() -> None:
    patterns = {
        sub["pattern"] for sub in _subschemas(json.loads(schema.schema_json())) if "pattern" in sub
    }
    assert patterns and patterns <= set(schema._PATTERN_HELP)


def test_schemas_folder_links_to_the_packaged_schema() -> None:
    link = ROOT / "schemas" / "hookpolicy-v1.schema.json"
    assert link.is_symlink()
    assert os.readlink(link) == "../hookpolicy/policy/hookpolicy-v1.schema.json"
    assert link.read_text("utf-8") == schema.schema_json()


def test_shipped_policies_load() -> None:
    folder = ROOT / "policies"
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    if not files:
        pytest.skip("no policies/*.yaml yet")
    assert len(load_sources(files)) == len(files)
