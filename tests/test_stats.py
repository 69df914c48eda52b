"""The statistics of `engine.measure.stats` and `clip_norm`, against float64 PyTorch references.

The speed-ups in stats.py (dot products, the `1 + 0 * x` count of finite elements, the
scratch buffer and its chunks, deferred counts) change how statistics are computed, not
what they are: every statistic is checked over float32/float64/bfloat16/float16 tensors,
strided ones, ones with NaN and +-Inf, lists of tensors combined per rule, and the
chunked path (with the chunk size made tiny), each against `torch.linalg.vector_norm`,
`mean`, `std`, ... of the same values in float64.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Callable, Iterator

import pytest
import torch

from hookpolicy.engine.measure import stats
from hookpolicy.engine.measure.actions import clip_norm
from hookpolicy.engine.measure.stats import combine, finish, partials_for, resolve_counts, tensor_partials

ALL = ("l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel")
SETS = (ALL, ("l2_norm", "abs_max", "nonfinite"), ("nonfinite",), ("std",), ("mean",), ("l2_norm", "nonfinite"),
        ("abs_max",), ("zero_fraction", "numel"), ("std", "nonfinite"), ("mean", "nonfinite"), ("max", "nonfinite"),
        ("min", "max", "nonfinite"))


def reference(tensors: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat([t.double().flatten() for t in tensors])
    return {
        "l2_norm": torch.linalg.vector_norm(x).item(), "mean": x.mean().item(),
        "std": x.std().item() if x.numel() > 1 else math.nan, "min": x.min().item(), "max": x.max().item(),
        "abs_max": x.abs().max().item(), "rms": x.pow(2).mean().sqrt().item(),
        "zero_fraction": (x == 0).double().mean().item(), "nonfinite": float((~torch.isfinite(x)).sum().item()),
        "numel": float(x.numel()),
    }


def computed(tensors: list[torch.Tensor], wanted: tuple[str, ...], defer: bool = False) -> dict[str, float]:
    """What the runtime reports: partials per tensor on the device, combined per rule on the host."""
    kinds = partials_for(wanted)
    matrix = tensor_partials(tensors, kinds, defer_counts=defer)
    assert matrix.dtype == torch.float64 and tuple(matrix.shape) == (len(tensors), len(kinds))
    rows = matrix.tolist()
    if defer:
        resolve_counts(rows, tensors, kinds)
    return finish(combine(rows, [t.numel() for t in tensors], kinds), sum(t.numel() for t in tensors), wanted)


def agrees(got: float, want: float, stat: str, rel: float, any_nonfinite: bool) -> bool:
    if stat in ("nonfinite", "numel"):
        return got == want
    if stat == "zero_fraction":
        return abs(got - want) < 1e-12
    if any_nonfinite and stat not in ("min", "max", "abs_max"):
        return math.isnan(got) or math.isinf(got)  # NaN and Inf propagate
    if math.isnan(want) or math.isinf(want):
        return (math.isnan(got) and math.isnan(want)) or got == want
    return abs(got - want) <= rel * max(abs(want), 1e-6)


def cases() -> Iterator[tuple[str, list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for shape in ((7,), (33, 65), (2, 3, 4), (1,), (300, 257)):
            t = (torch.randn(*shape, generator=g) * 3 + 1).to(dtype)
            name = f"{str(dtype)[6:]}-{'x'.join(map(str, shape))}"
            yield name, [t]
            yield name + "+5", [t, (torch.randn(5, generator=g) * 2).to(dtype)]
    base = torch.randn(40, 30, generator=g)
    yield "transposed", [base.t()]
    yield "strided", [base[:, ::2]]
    yield "transposed+float64", [base.t(), torch.randn(9, generator=g, dtype=torch.float64)]
    zeros = torch.randn(100, generator=g)
    zeros[::3] = 0
    yield "zeros", [zeros]
    bad = torch.randn(50, generator=g)
    bad[3], bad[7], bad[9] = float("nan"), float("inf"), -float("inf")
    only_inf = torch.randn(50, generator=g)
    only_inf[2] = float("inf")
    yield "nan-inf", [bad]
    yield "nan-inf+finite", [bad, torch.randn(4, generator=g)]
    yield "inf", [only_inf]
    yield "nan-inf-float16", [bad.half()]


CASES = dict(cases())


@pytest.fixture(params=[False, True], ids=["whole", "chunked"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both paths of the scratch buffer: whole tensors, and chunks of 1,000 elements."""
    if request.param:
        monkeypatch.setattr(stats, "_SCRATCH_ELEMENTS", 1000)
        monkeypatch.setattr(stats, "_SCRATCH_MIN", 10)
    return bool(request.param)


@pytest.fixture(params=[False, True], ids=["counted", "proved"])
def proved(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways to the count of finite elements on CPU: always counted, or proved by the other partials first."""
    monkeypatch.setattr(stats, "_HOST_MIN", 0 if request.param else 1 << 62)
    return bool(request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_statistic_matches_float64(case: str, chunked: bool, proved: bool) -> None:
    tensors = CASES[case]
    want = reference(tensors)
    rel = 1e-5 if tensors[0].dtype in (torch.float32, torch.float64) else 1e-2
    any_nonfinite = any(not bool(torch.isfinite(t).all()) for t in tensors)
    mismatches = [
        f"{stat} (defer={defer}, of {wanted}): {got[stat]} != {want[stat]}"
        for wanted in SETS for defer in (False, True)
        for got in [computed(tensors, wanted, defer)]
        for stat in wanted if not agrees(got[stat], want[stat], stat, rel, any_nonfinite)
    ]
    assert not mismatches, mismatches


def test_every_statistic_of_the_policy_language_is_computed_and_finished() -> None:
    """Each statistic a policy may name has its partials (`partials_for`) and its finishing step (`finish`)."""
    from hookpolicy.policy.expr import STATS
    assert set(STATS) == set(stats._NEEDS) == set(stats._FINISH)


def test_the_chunked_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked cases above mean something only if the chunk loop runs on them."""
    monkeypatch.setattr(stats, "_SCRATCH_ELEMENTS", 1000)
    calls: list[int] = []
    chunks = stats._chunks
    monkeypatch.setattr(stats, "_chunks", lambda t: (calls.append(t.numel()), chunks(t))[1])
    monkeypatch.setattr(stats, "_SCRATCH_MIN", 10)
    computed(CASES["float32-300x257"], ALL)
    assert calls


@pytest.mark.parametrize(("wanted", "bad", "counts"), [
    (("l2_norm", "abs_max", "nonfinite"), False, 0), (("l2_norm", "abs_max", "nonfinite"), True, 1),
    (("nonfinite",), False, 0), (("max", "nonfinite"), True, 1), (("std", "nonfinite"), False, 0),
    (("mean", "nonfinite"), True, 1),
])
def test_cpu_counts_only_what_the_partials_do_not_prove(
    monkeypatch: pytest.MonkeyPatch, wanted: tuple[str, ...], bad: bool, counts: int,
) -> None:
    """On CPU a finite min and max (or sum of squares, m2, sum) proves the count: no pass is spent on it."""
    t = torch.randn(1 << 15)
    if bad:
        t[5] = -float("inf")
    calls: list[int] = []
    finite = stats._finite
    monkeypatch.setattr(stats, "_finite", lambda x: (calls.append(x.numel()), finite(x))[1])
    got = computed([t], wanted)
    assert len(calls) == counts
    assert got["nonfinite"] == (1.0 if bad else 0.0)


def same_bits(a: list[list[float]], b: list[list[float]]) -> bool:
    """Row for row, value for value, the same float64 bits; a NaN equals any NaN (its sign and payload are
    not a statistic's: every sink writes it as NaN)."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all((math.isnan(u) and math.isnan(v)) or struct.pack("<d", u) == struct.pack("<d", v)
                                 for u, v in zip(x, y))
        for x, y in zip(a, b))


@pytest.fixture(params=[False, True], ids=["count_nonzero", "compared"])
def compared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a CPU hook counts the nonzero elements of its one tensor: `count_nonzero`, or from
    `_COMPARE_MIN` elements on (any: NaN and Inf included) the sum of `x != 0` as 1.0 and 0.0."""
    monkeypatch.setattr(stats, "_COMPARE_MIN", 1 if request.param else 1 << 62)
    return bool(request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hook_s_rows_read_on_cpu_are_the_device_path_s_bits(
    case: str, chunked: bool, compared: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a CPU hook reads at once (`host_partials`: per-thread row buffer, host-side squares, the count
    proved) is, bit for bit, what the device path's matrix holds (`_partials`: the stacked float64 matrix
    CUDA reads at the step) for every set of statistics, so the fast path moves no statistic."""
    monkeypatch.setattr(stats, "_HOST_MIN", 1 << 62)  # tensor_partials: always the device path
    buffered = stats._buffered_row
    served: list[bool] = []
    monkeypatch.setattr(stats, "_buffered_row",
                        lambda t, kinds: (lambda row: (served.append(row is not None), row)[1])(buffered(t, kinds)))
    tensors = CASES[case]
    for wanted in SETS + (("l2_norm", "mean", "std", "max", "min", "zero_fraction"),
                          ("l2_norm", "mean", "std", "max", "min", "zero_fraction", "nonfinite")):
        kinds = partials_for(wanted)
        got = stats.host_partials(tensors, kinds)
        want = tensor_partials(tensors, kinds).tolist()
        assert same_bits(got, want), (wanted, got, want)
        for t in tensors:  # and each tensor alone, as a forward or backward hook sees it
            assert same_bits(stats.host_partials([t], kinds), tensor_partials([t], kinds).tolist()), (wanted, t.shape)
    # the row buffer serves the float32/float64 contiguous tensors (and the others take the general path)
    assert any(served) == any(t.dtype in (torch.float32, torch.float64) and t.is_contiguous() for t in tensors)


SEED_SIX = ("l2_norm", "mean", "std", "max", "min", "zero_fraction")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hook_s_one_row_is_the_device_path_s_bits_and_its_statistics_torch_s(
    case: str, chunked: bool, compared: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`host_row` (a hook's one tensor, its plan found once) gives, bit for bit, the device path's row
    (`_partials`) for every set of statistics, and the statistics finished from it are torch's float64
    ones of the same tensor; it serves the float32/float64 contiguous tensors (an `m2` within the scratch
    buffer's one piece) and leaves the rest (None)."""
    monkeypatch.setattr(stats, "_HOST_MIN", 1 << 62)  # tensor_partials: always the device path
    for t in CASES[case]:
        nonfinite = not bool(torch.isfinite(t).all())
        want_stats = reference([t])
        for wanted in SETS + (SEED_SIX, SEED_SIX + ("nonfinite",)):
            kinds = partials_for(wanted)
            plan = stats.row_plan(kinds)
            assert plan is not None  # every partial but `ref_sumsq` has its place in the row buffer
            row = stats.host_row(t, plan)
            served = (t.dtype in (torch.float32, torch.float64) and t.is_contiguous()
                      and not ("m2" in kinds and t.numel() > stats._SCRATCH_ELEMENTS))
            if not served:
                assert row is None, (case, wanted)
                continue
            assert row is not None and same_bits([row], tensor_partials([t], kinds).tolist()), (case, wanted, row)
            got = finish(dict(zip(kinds, row)), t.numel(), wanted)
            rel = 1e-5 if t.numel() > 1 else 1e-6
            bad = [s for s in wanted if not agrees(got[s], want_stats[s], s, rel, nonfinite)]
            assert not bad, (case, wanted, {s: (got[s], want_stats[s]) for s in bad})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("flush_denormal", [False, True], ids=["denormals", "flushed"])
def test_zeros_counted_by_comparison_are_count_nonzero_s(
    dtype: torch.dtype, flush_denormal: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count of nonzero elements as the sum of `x != 0` (a hook's one tensor within the scratch buffer's
    size) is torch's `count_nonzero`, with -0.0, subnormals, the largest and smallest normals among the values,
    NaN and +-Inf, at sizes from 1 to the scratch bound and beyond it, and with denormals flushed
    (`torch.set_flush_denormal`, where the CPU has it)."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(7)
    t = torch.randn(5000, generator=g, dtype=dtype)
    t[::7] = 0.0
    t[3::11] = -0.0
    t[5::13] = info.smallest_normal / 4  # subnormal
    t[6::17] = -info.tiny / 1024
    t[1], t[2], t[4] = info.max, -info.max, info.smallest_normal
    bad = t.clone()
    bad[9], bad[10], bad[12] = float("nan"), float("inf"), -float("inf")
    big = torch.randn(stats._SCRATCH_ELEMENTS + 1, generator=g, dtype=dtype)
    big[::3] = 0.0
    sizes = [1, 640, 4095, 4096, stats._SCRATCH_ELEMENTS]
    flushing = flush_denormal and torch.set_flush_denormal(True)
    try:
        for least in (1, 1 << 62):  # compared, and `count_nonzero`
            monkeypatch.setattr(stats, "_COMPARE_MIN", least)
            for wanted in [("zero_fraction", "min", "max"), SEED_SIX, SEED_SIX + ("nonfinite",),
                           ("zero_fraction", "mean"), ("zero_fraction",)]:
                kinds = partials_for(wanted)
                plan = stats.row_plan(kinds)
                assert plan is not None
                for x in [t, bad, *(big[:n] for n in sizes), big]:
                    want = float(torch.count_nonzero(x))
                    got = stats.host_partials([x], kinds)[0][kinds.index("nonzero")]
                    assert got == want, (wanted, x.numel(), got, want)
                    row = stats.host_row(x, plan)
                    assert row is None or row[kinds.index("nonzero")] == want, (wanted, x.numel(), row)
    finally:
        if flushing:
            torch.set_flush_denormal(False)


def test_a_sum_of_squares_that_overflows_is_counted_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finite elements whose squares overflow float32: the proof fails, the count says 0, exactly."""
    monkeypatch.setattr(stats, "_HOST_MIN", 0)
    t = torch.full((100,), 3e30)
    assert computed([t], ("l2_norm", "nonfinite"))["nonfinite"] == 0.0
    assert computed([t], ("nonfinite",))["nonfinite"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("defer", [False, True], ids=["counted", "deferred"])
def test_many_small_tensors_normed_by_shape_match_float64(dtype: torch.dtype, defer: bool) -> None:
    """A step rule over many small tensors norms them by shape in one kernel each: every row is still its tensor's."""
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(shape, generator=g) * (1 + i)).to(dtype)
               for i, shape in enumerate([(8, 8), (8,), (3, 5, 2), ()] * 30 + [(100, 100)])]
    tensors[5][0] = float("nan")
    kinds = partials_for(("l2_norm", "nonfinite"))
    rows = tensor_partials(tensors, kinds, defer_counts=defer).tolist()
    if defer:
        resolve_counts(rows, tensors, kinds)
    for row, t in zip(rows, tensors):
        got = finish(dict(zip(kinds, row)), t.numel(), ("l2_norm", "nonfinite"))
        want = reference([t])
        assert agrees(got["l2_norm"], want["l2_norm"], "l2_norm", 1e-6, bool(torch.isnan(t).any()))
        assert got["nonfinite"] == want["nonfinite"]


@pytest.mark.parametrize("defer", [False, True], ids=["counted", "deferred"])
def test_counts_stay_exact_beyond_float32s_2_pow_24(defer: bool) -> None:
    big = torch.zeros((1 << 24) + 5)
    big[-1], big[0] = float("nan"), float("inf")
    got = computed([big], ("nonfinite", "numel"), defer)
    assert got == {"nonfinite": 2.0, "numel": float((1 << 24) + 5)}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_norm_in_place_is_clip_grad_norm(norm_type: float) -> None:
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 3, generator=g) for _ in range(3)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
    ours = [t.clone() for t in grads]
    _, report = clip_norm(ours, [0.5], norm_type, [[0, 1, 2]], inplace=True)
    for mine, p in zip(ours, params):
        assert p.grad is not None and torch.equal(mine, p.grad)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, norm_type) for t in grads]), norm_type)
    assert total.item() > 0.5  # the norm as it left the clip is the limit
    assert report.dtype == torch.float64 and report.tolist() == [[pytest.approx(0.5, rel=1e-6), 1.0, 0.0]]


def test_clip_norm_reports_per_group_and_audits_without_changing_anything() -> None:
    """Per group: its norm as it left the clip (min(vector_norm, limit)) and whether it was clipped
    (or would have been); apply=False changes nothing."""
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(4, generator=g) * s for s in (0.1, 10.0, 1.0)]
    groups, limits = [[0], [1], [2]], [1.0, 1.0, None]
    audited, report = clip_norm([t.clone() for t in grads], limits, 2.0, groups, inplace=True, apply=False)
    assert all(torch.equal(a, t) for a, t in zip(audited, grads))
    norms = [torch.linalg.vector_norm(t).item() for t in grads]
    left = [min(n, limit) if limit is not None else n for n, limit in zip(norms, limits)]
    assert norms[1] > 1.0 and left[1] == 1.0
    assert report.tolist() == [[pytest.approx(n, rel=1e-6), c, 0.0] for n, c in zip(left, (0.0, 1.0, 0.0))]
    clipped, same = clip_norm([t.clone() for t in grads], limits, 2.0, groups, inplace=True)
    assert torch.equal(same, report)
    assert torch.equal(clipped[0], grads[0]) and torch.equal(clipped[2], grads[2])  # under the limit, no limit
    assert torch.linalg.vector_norm(clipped[1]).item() == pytest.approx(1.0, rel=1e-5)


def test_a_device_limit_that_is_not_usable_clips_nothing_and_is_reported() -> None:
    """A limit computed on the device: NaN (not usable: a NaN or non-positive threshold) and +inf (a false
    `when`) clip nothing; only NaN is flagged in the report's third column, for the read-back to say."""
    grads = [torch.full((4,), 3.0) for _ in range(3)]
    limits = [lambda norm: norm.new_full((), math.nan), lambda norm: norm.new_full((), math.inf),
              lambda norm: norm / 2]
    clipped, report = clip_norm([t.clone() for t in grads], limits, 2.0, [[0], [1], [2]], inplace=True)
    assert torch.equal(clipped[0], grads[0]) and torch.equal(clipped[1], grads[1])
    assert torch.allclose(clipped[2], grads[2] / 2)
    assert report.tolist() == [[6.0, 0.0, 1.0], [6.0, 0.0, 0.0], [3.0, 1.0, 0.0]]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_norm_out_of_place_keeps_the_autograd_graph(norm_type: float) -> None:
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(5, 3, generator=g).requires_grad_() for _ in range(3)]
    clipped, _ = clip_norm([t * 1 for t in leaves], [0.5, 0.5], norm_type, [[0], [1, 2]], inplace=False)
    torch.stack([c.sum() for c in clipped]).sum().backward()  # type: ignore[no-untyped-call]
    assert all(t.grad is not None for t in leaves)


@pytest.mark.parametrize("kinds", [["sumsq", "min", "max"], ["sum", "m2", "nonzero", "finite"]], ids=["row buffer", "scratch"])
def test_a_first_call_under_inference_mode_leaves_the_thread_s_buffers_usable_outside_it(kinds: list[str]) -> None:
    """Lightning validates (under `torch.inference_mode`) before it trains: the thread's reused buffers, made
    at that first call, must not be inference tensors, which a later call outside it could not write."""
    data = [torch.randn(300, 300, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    got: list[object] = []

    def fresh_thread() -> None:  # the buffers are per thread: this one has none yet
        try:
            with torch.inference_mode():
                got.append(stats.host_partials([data[0]], kinds))
            got.append(stats.host_partials([data[1]], kinds))
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            got.append(exc)

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert len(got) == 2 and not isinstance(got[1], Exception), got
    for t, rows in zip(data, got):
        assert rows == tensor_partials([t], kinds).tolist()


def _bits(value: float) -> bytes:
    return b"nan" if math.isnan(value) else struct.pack("<d", value)


def _finished_or_error(make: Callable[[], list[dict[str, float]]]) -> object:
    try:
        return [{stat: _bits(value) for stat, value in group.items()} for group in make()]
    except (ValueError, OverflowError) as exc:  # math.fsum's: +inf and -inf, or an overflow, in one sum
        return type(exc)


def _partial(kind: str, numel: int, rng: torch.Generator, special: list[float]) -> float:
    """A partial a tensor of `numel` elements could have: counts up to numel, a sum of squares not negative."""
    if kind in ("nonzero", "finite"):
        return float(int(torch.randint(0, numel + 1, (1,), generator=rng)))
    if special and torch.rand(1, generator=rng).item() < 0.3:
        value = special[int(torch.randint(0, len(special), (1,), generator=rng))]
    else:  # magnitudes far apart, so that a plain sum rounds where fsum does not
        value = torch.randn(1, generator=rng).item() * 10.0 ** int(torch.randint(-8, 9, (1,), generator=rng))
    return abs(value) if kind == "sumsq" else value


def test_many_groups_of_sums_merge_as_combine_merges_each_bit_for_bit() -> None:
    """`combine_sums` (a scrape finishing thousands of groups column by column) against `combine` per group.

    Groups of one row (its values as they are, -0.0 kept) and of several (fsum in row order),
    rows of NaN, +-Inf, -0.0, subnormals and large values, every statistic a sum serves; the same
    statistics bit for bit, also where fsum alone would raise (+inf and -inf, an overflow).
    """
    from operator import itemgetter

    rng = torch.Generator().manual_seed(5)
    special = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308, -1e308, 1.0, 3.0]
    sum_stats = [s for s in ALL if stats.summed(partials_for((s,))) and s != "numel"]
    assert set(sum_stats) == {"l2_norm", "mean", "rms", "zero_fraction", "nonfinite"}
    compared = undefined = 0
    for case in range(400):
        wanted = tuple(s for s in sum_stats if torch.rand(1, generator=rng).item() < 0.5) or ("l2_norm",)
        kinds = partials_for(wanted)
        assert stats.summed(kinds)
        n_rows = int(torch.randint(1, 12, (1,), generator=rng))
        rare = case % 4 == 0  # a quarter of the cases with special values
        numels = [int(torch.randint(0, 50, (1,), generator=rng)) for _ in range(n_rows)]
        rows = [[_partial(kind, numel, rng, special if rare else []) for kind in kinds] for numel in numels]
        order = torch.randperm(n_rows, generator=rng).tolist()
        groups, start = [], 0
        while start < n_rows:  # groups of 1-4 rows, not contiguous
            size = int(torch.randint(1, 5, (1,), generator=rng))
            groups.append(order[start:start + size])
            start += size
        expected = _finished_or_error(lambda: [
            finish(combine([rows[i] for i in at], [numels[i] for i in at], kinds), sum(numels[i] for i in at), wanted)
            for at in groups])
        picks = [(itemgetter(*at), len(at) == 1) for at in groups]
        got = _finished_or_error(lambda: [
            finish(dict(zip(kinds, merged)), sum(numels[i] for i in at), wanted)
            for at, merged in zip(groups, stats.combine_sums(rows, picks))])
        assert isinstance(expected, list) and got == expected, (case, rows, groups)
        compared += 1
        undefined += any(value == b"nan" for group in expected for value in group.values())
    assert compared == 400 and undefined > 0
    assert not stats.summed(()) and not stats.summed(partials_for(("std",))) and not stats.summed(("min", "sumsq"))


def test_a_sum_fsum_cannot_take_is_the_ieee_one() -> None:
    """+inf and -inf in one sum: NaN, torch's float64 sum; an intermediate overflow: the exact sum (Fraction)."""
    from fractions import Fraction

    inf, big = math.inf, 1e308
    for values in ([inf, -inf], [1.0, inf, 2.0, -inf], [big, big, inf, -inf], [-inf, 1.0, inf]):
        assert math.isnan(stats.exact_sum(values)) and math.isnan(torch.tensor(values, dtype=torch.float64).sum().item())
    for values in ([big, big, -big], [big, big, -big, -big, 2.5], [-big, -big, big, 1e-300], [1.7e308] * 4 + [-1.7e308] * 3,
                   [big, big], [-big, -big, -big]):
        exact = sum(Fraction(v) for v in values)
        want = float(exact) if abs(exact) <= Fraction(1.7976931348623157e308) else (math.inf if exact > 0 else -math.inf)
        assert stats.exact_sum(values) == want, values
    for values in ([0.1, 0.2, 0.3], [1e100, 1.0, -1e100], [inf, 1.0], [math.nan, 1.0], [-0.0, -0.0]):
        expected = math.fsum(values)
        got = stats.exact_sum(values)
        assert got == expected or (math.isnan(got) and math.isnan(expected)), values
    # a module's mean whose weight sums to +inf and bias to -inf: NaN, as torch's mean of both
    kinds = partials_for(("mean", "l2_norm"))
    tensors = [torch.full((2,), inf), torch.full((1,), -inf)]
    got = computed(tensors, ("mean", "l2_norm"))
    want = reference(tensors)
    assert math.isnan(got["mean"]) and math.isnan(want["mean"]) and got["l2_norm"] == want["l2_norm"] == inf
    assert stats.combine_sums([[inf, 0.0], [-inf, 0.0]], [(lambda c: (c[0], c[1]), False)])[0][0] != 0.0
    assert kinds == ("sumsq", "sum")
