"""Tests of hookpolicy.plan.matcher: glob semantics, types, root/exclude, params, wrappers."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hookpolicy.plan.matcher import (
    WRAPPER_SEGMENTS,
    Matcher,
    ModuleEntry,
    iter_modules,
    model_class,
    type_matches,
)
from hookpolicy.policy.model import Match
from hookpolicy.policy.patterns import PatternError, compile_glob

# --------------------------------------------------------------------------- fixture model


class LoRALinear(nn.Linear):
    """A user subclass of Linear, for base-class and dotted-path type matching."""


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = LoRALinear(d, d)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)


class TinyGPT(nn.Module):
    def __init__(self, d: int = 4, layers: int = 2, vocab: int = 11) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, d),
            "h": nn.ModuleList(Block(d) for _ in range(layers)),
            "ln_f": nn.LayerNorm(d),
        })
        self.lm_head = nn.Linear(d, vocab, bias=False)


def block(model: TinyGPT, i: int) -> Block:
    """The i-th transformer block, typed (ModuleDict and ModuleList lose the type)."""
    layer = model.transformer["h"][i]  # type: ignore[index]
    assert isinstance(layer, Block)
    return layer


@pytest.fixture
def model() -> TinyGPT:
    return TinyGPT()


def select(model: Any, match: Match) -> list[ModuleEntry]:
    """The modules of `model` that `match` selects, as the planner selects them."""
    return Matcher(match).select(iter_modules(model))


def names(model: Any, **match: Any) -> list[str]:
    """Canonical names that a Match built from keyword arguments selects."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in match.items()}
    return [e.name for e in select(model, Match(**fields))]


def full(pattern: str, name: str) -> bool:
    return compile_glob(pattern).fullmatch(name) is not None


# --------------------------------------------------------------------------- globs


@pytest.mark.parametrize("pattern, name, expected", [
    ("transformer.h.*.attn", "transformer.h.0.attn", True),
    ("transformer.h.*.attn", "transformer.h.0.x.attn", False),  # `*` does not cross dots
    ("transformer.*", "transformer.h.0", False),
    ("*", "lm_head", True),
    ("*", "transformer.h", False),
    ("*", "", True),  # an empty segment is still one segment
    ("transformer.h.*", "transformer.h", False),
    ("c_*", "c_attn", True),
    ("*_proj", "c_proj", True),
    ("*attn*", "transformer.h.0.attn", False),
])
def test_star_stays_inside_one_segment(pattern: str, name: str, expected: bool) -> None:
    assert full(pattern, name) is expected


@pytest.mark.parametrize("pattern, name, expected", [
    # leading: zero or more segments before
    ("**.attn", "attn", True),
    ("**.attn", "a.attn", True),
    ("**.attn", "a.b.attn", True),
    ("**.attn", "myattn", False),
    ("**.attn", "a.myattn", False),
    ("**.attn", "attn.x", False),
    # trailing: zero or more segments after
    ("layers.**", "layers", True),
    ("layers.**", "layers.0", True),
    ("layers.**", "layers.0.mlp", True),
    ("layers.**", "layers0", False),
    ("layers.**", "xlayers.0", False),
    # middle: zero or more segments between
    ("a.**.b", "a.b", True),
    ("a.**.b", "a.x.b", True),
    ("a.**.b", "a.x.y.b", True),
    ("a.**.b", "ab", False),
    ("a.**.b", "a.xb", False),
    ("a.**.b", "a.b.c", False),
    # alone, and repeated
    ("**", "", True),
    ("**", "transformer.h.0.mlp.fc", True),
    ("**.**.fc", "fc", True),
    ("**.**.fc", "mlp.fc", True),
    ("a.**.**.b", "a.b", True),
    # inside a segment, `**` is just "anything, dots included"
    ("transformer**fc", "transformer.h.0.mlp.fc", True),
    ("transformer.**fc", "transformer.h.0.mlp.fc", True),
    ("transformer.**fc", "transformer.fc", True),
    ("**_attn", "transformer.h.0.attn.c_attn", True),
])
def test_double_star(pattern: str, name: str, expected: bool) -> None:
    assert full(pattern, name) is expected


@pytest.mark.parametrize("pattern, name, expected", [
    ("h.?.attn", "h.0.attn", True),
    ("h.?.attn", "h.10.attn", False),
    ("h?0", "h.0", False),  # `?` never matches a dot
    ("h.[0-2]", "h.1", True),
    ("h.[0-2]", "h.3", False),
    ("h.[02]", "h.2", True),
    ("h.[!0]", "h.1", True),
    ("h.[!0]", "h.0", False),
    ("h[.]0", "h.0", False),  # a class never matches a dot...
    ("h[!x]0", "h.0", False),  # ...not even a negated one
    ("h[--/]0", "h.0", False),  # ...nor a range that spans it
    ("h[--/]0", "h-0", True),
    ("x[]]", "x]", True),  # `]` first in a class is a member
    ("x[!]]", "xa", True),
    ("x[!]]", "x]", False),
    ("x[a-]", "x-", True),
    ("x[^]", "x^", True),
    ("x[\\]", "x\\", True),
])
def test_question_mark_and_classes(pattern: str, name: str, expected: bool) -> None:
    assert full(pattern, name) is expected


@pytest.mark.parametrize("pattern, name, expected", [
    ("re:transformer\\.h\\.\\d+\\.attn", "transformer.h.12.attn", True),
    ("re:transformer\\.h\\.\\d+", "transformer.h.12.attn", False),  # whole name, not a prefix
    ("re:h\\.\\d+", "transformer.h.1", False),  # not a search either
    ("re:.*(c_attn|c_proj)", "transformer.h.0.attn.c_proj", True),
    ("re:a|b", "a", True),  # alternation stays inside the full match
    ("re:a|b", "ab", False),
])
def test_regex_prefix_is_a_full_match(pattern: str, name: str, expected: bool) -> None:
    assert full(pattern, name) is expected


@pytest.mark.parametrize("pattern, name, expected", [
    ("transformer.h", "transformer.h", True),
    ("transformer.h", "transformerXh", False),  # the dot is literal
    ("a+b", "a+b", True),
    ("a+b", "aab", False),
    ("f(x)", "f(x)", True),
    ("a|b", "a", False),
    ("a$", "a$", True),
    ("^a", "^a", True),
    ("a{2}", "a{2}", True),
    ("a\\d", "a\\d", True),
    ("re", "re", True),
    ("xre:a", "xre:a", True),
])
def test_everything_else_is_literal(pattern: str, name: str, expected: bool) -> None:
    assert full(pattern, name) is expected


@pytest.mark.parametrize("pattern, message", [
    ("", "empty pattern"),
    ("abc[de", "unterminated character class '[' at 3"),
    ("[!]", "unterminated character class '[' at 0"),
    ("[]", "unterminated character class '[' at 0"),
    ("h.[z-a]", "bad character range z-a at 3"),
    ("re:", "empty regular expression"),
    ("re:(", "missing ), unterminated subpattern"),
    ("re:[a", "unterminated character set"),
    ("re:*a", "nothing to repeat"),
])
def test_bad_patterns_raise_pattern_error(pattern: str, message: str) -> None:
    with pytest.raises(PatternError, match=re.escape(message)) as info:
        compile_glob(pattern)
    assert isinstance(info.value, ValueError)
    assert info.value.pattern == pattern


def test_compiled_patterns_are_cached() -> None:
    assert compile_glob("**.attn") is compile_glob("**.attn")


def test_bad_pattern_fails_when_matcher_is_built() -> None:
    with pytest.raises(PatternError):
        Matcher(Match(modules=("ok",), exclude=("bad[",)))
    with pytest.raises(PatternError):
        Matcher(Match(root=True, params=("re:(",)))


# --------------------------------------------------------------------------- the tree


def test_iter_modules_follows_named_modules(model: TinyGPT) -> None:
    entries = iter_modules(model)
    assert [e.name for e in entries] == [n for n, _ in model.named_modules()]
    assert [e.qualname for e in entries] == [n for n, _ in model.named_modules()]
    assert all(e.module is m for e, (_, m) in zip(entries, model.named_modules()))
    assert entries[0] == ModuleEntry("", "", model)


def test_shared_submodule_appears_once_under_its_first_name() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a = nn.Sequential(shared, nn.ReLU())
    model.b = shared
    model.c = nn.Sequential(nn.Linear(2, 2))
    model.c.add_module("again", model.a)  # a whole shared subtree
    entries = iter_modules(model)
    assert [e.name for e in entries] == ["", "a", "a.0", "a.1", "c", "c.0"]
    assert [e.name for e in entries] == [n for n, _ in model.named_modules()]


def test_none_children_are_skipped() -> None:
    model = nn.Module()
    model.register_module("gone", None)
    model.kept = nn.ReLU()
    assert [e.name for e in iter_modules(model)] == ["", "kept"]


def test_matcher_module_never_imports_torch() -> None:
    import hookpolicy.plan.matcher as matcher

    tree = ast.parse(Path(matcher.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name == "torch" or name.startswith("torch.") for name in imported)


def test_duck_typed_tree_without_torch() -> None:
    class Node:
        def __init__(self, **children: "Node") -> None:
            self.children = children

        def named_children(self) -> Any:
            return iter(self.children.items())

        def named_parameters(self, recurse: bool = True) -> Any:
            assert recurse is False
            return iter([("weight", 1), ("bias", 2)])

    class DistributedDataParallel(Node):
        pass

    inner = Node(enc=Node(layer=Node()), module=Node())
    tree = DistributedDataParallel(module=inner)
    entries = iter_modules(tree)
    assert [e.name for e in entries] == ["", "enc", "enc.layer", "module"]
    assert entries[0].module is inner
    assert Matcher(Match(root=True, params=("w*",))).param_names(inner) == ["weight"]


# --------------------------------------------------------------------------- types


def test_type_by_class_name(model: TinyGPT) -> None:
    linears = names(model, types=["Linear"])
    assert linears == [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert "transformer.h.0.attn.c_proj" in linears  # a subclass matches its base's name
    assert names(model, types=["LayerNorm"]) == [
        "transformer.h.0.ln_1", "transformer.h.0.ln_2",
        "transformer.h.1.ln_1", "transformer.h.1.ln_2", "transformer.ln_f",
    ]


def test_type_by_own_subclass_name(model: TinyGPT) -> None:
    assert names(model, types=["LoRALinear"]) == [
        "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj",
    ]


def test_type_by_dotted_path() -> None:
    assert type_matches(nn.Linear, "torch.nn.Linear")  # public path, class lives deeper
    assert type_matches(nn.Linear, "torch.nn.modules.linear.Linear")  # exact path
    assert type_matches(nn.Linear, "torch.Linear")  # the package prefix also holds
    assert type_matches(LoRALinear, "torch.nn.Linear")  # through the base class
    assert type_matches(LoRALinear, f"{LoRALinear.__module__}.LoRALinear")
    assert type_matches(nn.Linear, "torch.nn.Module")
    assert type_matches(nn.GELU, "torch.nn.Module")
    assert type_matches(Block, "torch.nn.Module")


def test_type_by_wrong_dotted_path() -> None:
    assert not type_matches(nn.Linear, "my_pkg.Linear")
    assert not type_matches(nn.Linear, "torch.nn.modules.conv.Linear")
    assert not type_matches(nn.Linear, "torch.nn.Conv2d")
    assert not type_matches(nn.Linear, "torc.Linear")  # a prefix of a segment is no package
    assert not type_matches(nn.Linear, "torch.nn.modules.linear.Linea")
    assert not type_matches(LoRALinear, "torch.nn.LoRALinear")
    assert not type_matches(nn.Linear, "Conv2d")


def test_type_by_nested_qualname() -> None:
    class Outer:
        class Inner:
            pass

    spec = f"{Outer.Inner.__module__}.{Outer.Inner.__qualname__}"
    assert type_matches(Outer.Inner, spec)
    assert type_matches(Outer.Inner, "Inner")


def test_type_matching_imports_nothing() -> None:
    before = set(sys.modules)
    assert not type_matches(nn.Linear, "some_module_that_does_not_exist.Linear")
    assert set(sys.modules) == before


def test_types_in_select_use_dotted_paths(model: TinyGPT) -> None:
    assert names(model, types=["torch.nn.Embedding"]) == ["transformer.wte"]
    assert names(model, types=["torch.nn.modules.sparse.Embedding"]) == ["transformer.wte"]
    assert names(model, types=["my_pkg.Embedding"]) == []


# --------------------------------------------------------------------------- rules


def test_root_selects_only_the_model(model: TinyGPT) -> None:
    entries = select(model, Match(root=True))
    assert [e.name for e in entries] == [""]
    assert entries[0].module is model


def test_root_and_types_must_both_hold(model: TinyGPT) -> None:
    assert names(model, root=True, types=["TinyGPT"]) == [""]
    assert names(model, root=True, types=["Linear"]) == []


def test_modules_or_within_the_field(model: TinyGPT) -> None:
    assert names(model, modules=["lm_head", "**.ln_f"]) == ["transformer.ln_f", "lm_head"]


def test_types_or_within_the_field(model: TinyGPT) -> None:
    assert names(model, modules=["transformer.h.0.**"], types=["LayerNorm", "GELU"]) == [
        "transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.0.mlp.act",
    ]


def test_modules_and_types_must_both_hold(model: TinyGPT) -> None:
    assert names(model, modules=["**.mlp.*"], types=["Linear"]) == [
        "transformer.h.0.mlp.fc", "transformer.h.0.mlp.proj",
        "transformer.h.1.mlp.fc", "transformer.h.1.mlp.proj",
    ]
    assert names(model, modules=["**.mlp.*"], types=["Embedding"]) == []


def test_exclude_wins_over_modules(model: TinyGPT) -> None:
    assert names(model, modules=["**.attn.*"], exclude=["transformer.h.0.**"]) == [
        "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj",
    ]
    assert names(model, modules=["lm_head"], exclude=["lm_head"]) == []


def test_exclude_wins_over_types(model: TinyGPT) -> None:
    assert names(model, types=["Linear"], exclude=["**.mlp.**", "re:.*c_attn"]) == [
        "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj", "lm_head",
    ]


def test_exclude_wins_over_root(model: TinyGPT) -> None:
    assert names(model, root=True, exclude=["**"]) == []


def test_matches_directly(model: TinyGPT) -> None:
    matcher = Matcher(Match(modules=("**.attn",), exclude=("transformer.h.1.**",)))
    attn = block(model, 0).attn
    assert matcher.matches("transformer.h.0.attn", attn, is_root=False)
    assert not matcher.matches("transformer.h.1.attn", attn, is_root=False)
    assert not Matcher(Match(root=True)).matches("", model, is_root=False)


def test_selection_is_in_model_order(model: TinyGPT) -> None:
    selected = names(model, modules=["lm_head", "transformer.wte", "**.fc"])
    assert selected == ["transformer.wte", "transformer.h.0.mlp.fc", "transformer.h.1.mlp.fc", "lm_head"]


def test_param_names_default_to_all_own_parameters(model: TinyGPT) -> None:
    matcher = Matcher(Match(types=("Linear",)))
    assert matcher.param_names(block(model, 0).mlp.fc) == ["weight", "bias"]
    assert matcher.param_names(model.lm_head) == ["weight"]
    assert matcher.param_names(block(model, 0).mlp.act) == []
    assert matcher.param_names(block(model, 0)) == []  # own parameters only


def test_param_names_follow_params_globs_in_definition_order(model: TinyGPT) -> None:
    fc = block(model, 0).mlp.fc
    assert Matcher(Match(root=True, params=("bias",))).param_names(fc) == ["bias"]
    assert Matcher(Match(root=True, params=("bias", "weight"))).param_names(fc) == ["weight", "bias"]
    assert Matcher(Match(root=True, params=("*",))).param_names(fc) == ["weight", "bias"]
    assert Matcher(Match(root=True, params=("w*",))).param_names(fc) == ["weight"]
    assert Matcher(Match(root=True, params=("re:b.*",))).param_names(fc) == ["bias"]
    assert Matcher(Match(root=True, params=("scale",))).param_names(fc) == []


def test_param_names_of_a_module_with_a_dotless_own_parameter() -> None:
    module = nn.Module()
    module.register_parameter("gain", nn.Parameter(torch.ones(1)))
    module.inner = nn.Linear(1, 1)
    assert Matcher(Match(root=True)).param_names(module) == ["gain"]


# --------------------------------------------------------------------------- wrappers


class DistributedDataParallel(nn.Module):
    """Stands in for torch's DDP (which needs a process group): holds the model as `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class MyDDP(DistributedDataParallel):
    """A subclass of a DDP class is a DDP wrapper too (the MRO is compared)."""


class OptimizedModule(nn.Module):
    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._orig_mod = mod


class CheckpointWrapper(nn.Module):
    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = mod


class FullyShardedDataParallel(nn.Module):
    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = mod


def test_wrapper_segments() -> None:
    assert set(WRAPPER_SEGMENTS) == {
        "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module", "base_model", "model",
    }
    assert WRAPPER_SEGMENTS["_orig_mod"] is None
    assert WRAPPER_SEGMENTS["module"] == frozenset({"DistributedDataParallel", "DataParallel"})


def plain_names(model: Any) -> list[str]:
    return [n for n, _ in model.named_modules()]


@pytest.mark.parametrize("wrap", [
    DistributedDataParallel, DataParallel, MyDDP, OptimizedModule, FullyShardedDataParallel,
    lambda m: DistributedDataParallel(OptimizedModule(m)),
    lambda m: OptimizedModule(DataParallel(m)),
    lambda m: FullyShardedDataParallel(CheckpointWrapper(m)),
])
def test_fake_wrappers_are_removed(model: TinyGPT, wrap: Any) -> None:
    wrapped = wrap(model)
    entries = iter_modules(wrapped)
    assert [e.name for e in entries] == plain_names(model)
    assert all(e.module is m for e, (_, m) in zip(entries, model.named_modules()))
    root = select(wrapped, Match(root=True))
    assert [(e.name, e.module) for e in root] == [("", model)]
    assert entries[1].qualname != "transformer"  # qualname keeps the wrapper's prefix


def test_qualname_keeps_the_wrapper_path(model: TinyGPT) -> None:
    entries = iter_modules(DistributedDataParallel(OptimizedModule(model)))
    head = next(e for e in entries if e.name == "lm_head")
    assert head.qualname == "module._orig_mod.lm_head"
    assert dict(DistributedDataParallel(OptimizedModule(model)).named_modules())[head.qualname] is model.lm_head


def test_checkpoint_wrapper_on_submodules_keeps_the_inner_module(model: TinyGPT) -> None:
    inner = block(model, 0).mlp
    setattr(block(model, 0), "mlp", CheckpointWrapper(inner))
    entries = iter_modules(model)
    assert [e.name for e in entries] == plain_names(TinyGPT())
    mlp = next(e for e in entries if e.name == "transformer.h.0.mlp")
    assert mlp.module is inner
    assert mlp.qualname == "transformer.h.0.mlp._checkpoint_wrapped_module"
    assert names(model, types=["CheckpointWrapper"]) == []
    assert names(model, types=["MLP"]) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]


def test_user_submodule_named_module_keeps_its_name() -> None:
    model = nn.Module()
    model.module = nn.Sequential(nn.Linear(2, 2))
    model.wrapper = nn.Module()
    model.wrapper.module = nn.ReLU()
    assert [e.name for e in iter_modules(model)] == ["", "module", "module.0", "wrapper", "wrapper.module"]
    assert names(model, modules=["module.*"]) == ["module.0"]
    # ...and it keeps it under a DDP wrapper too: only DDP's own `module` is removed
    assert [e.name for e in iter_modules(DistributedDataParallel(model))] == [
        "", "module", "module.0", "wrapper", "wrapper.module",
    ]


def test_module_under_a_class_merely_named_like_ddp_elsewhere_is_kept() -> None:
    class DistributedDataParallelConfig(nn.Module):  # not a DDP: name differs
        pass

    holder = DistributedDataParallelConfig()
    holder.module = nn.ReLU()
    assert [e.name for e in iter_modules(holder)] == ["", "module"]


POLICIES = [
    Match(modules=("**.attn.*",)),
    Match(modules=("transformer.h.*.mlp",), exclude=("transformer.h.1.**",)),
    Match(types=("Linear",), exclude=("lm_head",)),
    Match(types=("torch.nn.LayerNorm",)),
    Match(root=True),
    Match(modules=("re:transformer\\.h\\.\\d+",)),
    Match(modules=("**",)),
]


@pytest.mark.parametrize("match", POLICIES)
@pytest.mark.parametrize("wrap", [
    DistributedDataParallel, DataParallel, OptimizedModule,
    lambda m: DistributedDataParallel(OptimizedModule(m)),
])
def test_same_policy_same_names_wrapped_or_not(model: TinyGPT, match: Match, wrap: Any) -> None:
    plain = select(model, match)
    wrapped = select(wrap(model), match)
    assert plain, "every policy here selects something"
    assert [(e.name, e.module) for e in wrapped] == [(e.name, e.module) for e in plain]


# --------------------------------------------------------------------------- real torch wrappers


# importing torch._dynamo warns about torch.jit internals; that is torch's, not ours
TORCH_INTERNAL_WARNING = "ignore:.*torch.jit.script_method.*:DeprecationWarning"


@pytest.mark.filterwarnings(TORCH_INTERNAL_WARNING)
def test_real_torch_compile_wrapper(model: TinyGPT) -> None:
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    assert type(compiled).__name__ == "OptimizedModule"
    assert plain_names(compiled)[1] == "_orig_mod"
    assert [e.name for e in iter_modules(compiled)] == plain_names(model)
    for match in POLICIES:
        assert [(e.name, e.module) for e in select(compiled, match)] == [
            (e.name, e.module) for e in select(model, match)
        ]


def test_real_data_parallel_wrapper(model: TinyGPT) -> None:
    wrapped = nn.DataParallel(model)  # on CPU it only holds the module
    assert plain_names(wrapped)[1] == "module"
    assert [e.name for e in iter_modules(wrapped)] == plain_names(model)
    assert select(wrapped, Match(root=True))[0].module is model


@pytest.mark.filterwarnings(TORCH_INTERNAL_WARNING)
def test_real_checkpoint_wrapper(model: TinyGPT) -> None:
    cw = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    attn = block(model, 1).attn
    setattr(block(model, 1), "attn", cw.checkpoint_wrapper(attn))
    assert "transformer.h.1.attn._checkpoint_wrapped_module" in plain_names(model)
    entries = iter_modules(model)
    assert [e.name for e in entries] == plain_names(TinyGPT())
    assert next(e for e in entries if e.name == "transformer.h.1.attn").module is attn
    assert names(model, modules=["**.attn"], types=["Attention"]) == [
        "transformer.h.0.attn", "transformer.h.1.attn",
    ]
    compiled = torch.compile(nn.parallel.DataParallel(model))
    assert [e.name for e in iter_modules(compiled)] == plain_names(TinyGPT())


def test_real_distributed_data_parallel(model: TinyGPT, tmp_path: Any) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model)
        assert plain_names(wrapped)[1] == "module"
        assert [e.name for e in iter_modules(wrapped)] == plain_names(model)
        for match in POLICIES:
            assert [(e.name, e.module) for e in select(wrapped, match)] == [
                (e.name, e.module) for e in select(model, match)
            ]
    finally:
        dist.destroy_process_group()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.ReLU())


def test_model_class_reads_the_innermost_wrapped_module_as_the_whole_walk_does() -> None:
    """model_class follows the wrapper segments down (DataParallel's `module`, torch.compile's `_orig_mod`)."""

    class DistributedDataParallel(nn.Module):
        """Named as torch's wrapper, with a child beside `module`: not a wrapper's shape."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner
            self.extra = nn.Linear(1, 1)

    net = _Net()
    compiled = torch.compile(net, backend="eager")
    cases = {
        "plain": (net, "_Net"), "compiled": (compiled, "_Net"), "data parallel": (nn.DataParallel(net), "_Net"),
        "data parallel of compiled": (nn.DataParallel(compiled), "_Net"),
        "wrapper beside another child": (DistributedDataParallel(net), "_Net"),
        "a Sequential root": (nn.Sequential(nn.Linear(1, 1)), "Sequential"),
    }
    for what, (model, expected) in cases.items():
        assert model_class(model) == expected, what
        assert model_class(model) == type(iter_modules(model)[0].module).__name__, what
    odd = DistributedDataParallel(net)
    del odd.module
    odd.module = net  # now after `extra`
    assert model_class(odd) == type(iter_modules(odd)[0].module).__name__ == "_Net"
    odd.extra = net  # the wrapped module, reached first under another name: the walk keeps the wrapper
    assert model_class(odd) == type(iter_modules(odd)[0].module).__name__ == "DistributedDataParallel"
