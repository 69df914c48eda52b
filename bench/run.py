"""hookpolicy's overhead benchmark (issue 5): one command, a terminal table, docs/benchmarks.md.

    python bench/run.py                              # full run (5-9 minutes on 2 CPU cores)
    python bench/run.py --quick                      # short run (under 3 minutes)
    python bench/run.py --out docs/benchmarks.md     # also write the markdown report

Variants, timed interleaved in one process (see `timing.py`), each as a ratio to the
no-hook loop: (1) no hooks; (2) the seed's hand-written GradientMonitor and (2p) the same
six statistics as a policy; (2b) the statistics of `policies/monitor.yaml` by hand;
(3) `policies/monitor.yaml` every step; (4) the same with `every: 10`; (5) the clip policy
against `clip_grad_norm_(foreach=True)`; (6) compile/attach on a 10,001-module model and a
10,000-series `/metrics` scrape; (7) the flight recorder's ring (`capture.keep`) on a
96-layer model every step, against the same loop without a policy and against the capture
without keep (`recorder.py`). On CUDA the models run there and host-device syncs per
step are counted too. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hotspots import OpRow, frame_profile, op_profile  # noqa: E402
from models import WORKLOADS  # noqa: E402
from recorder import RecorderResult, lines as recorder_lines, markdown as recorder_markdown, measure_recorder  # noqa: E402
from scale import ScaleResult, measure_scale  # noqa: E402
from timing import (  # noqa: E402
    Samples, amortized, bootstrap_ratio, count_syncs, interleave, quantile, resampled_amortized,
    resampled_median, bootstrap_share,
)
from variants import VARIANTS, Variant, build_variants  # noqa: E402

#: workload -> (undisturbed steps wanted per variant, warm-up rounds, time budget in seconds)
ROUNDS = {
    "full": {"gpt": (60, 4, 200), "nanogpt": (150, 10, 80), "cnn": (150, 10, 80), "lstm": (120, 10, 80)},
    "quick": {"gpt": (15, 3, 55), "nanogpt": (40, 5, 20), "cnn": (40, 5, 20), "lstm": (30, 5, 20)},
}
GOALS = {"hp": 1.05, "hp10": 1.01, "third": 1 / 3, "clip": 1.02, "attach_s": 1.0, "scrape_s": 0.100, "publish_s": 0.005}


@dataclass
class Row:
    key: str
    label: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    ratio: float
    ratio_p10: float
    ratio_p90: float
    ci: tuple[float, float]
    cpu_ratio: float
    syncs: Optional[tuple[float, float]] = None
    note: str = ""


@dataclass
class WorkloadResult:
    name: str
    describe: str
    rounds: int
    warmup: int
    seconds: float
    rows: list[Row]
    #: variant -> the steps its statistics use (the undisturbed ones where there are enough: `used`)
    samples: dict[str, Samples]
    #: variant -> rule -> ms per step inside hookpolicy (its own hookpolicy_hook_seconds_total)
    inside: dict[str, dict[str, float]] = field(default_factory=dict)
    used: str = "all steps"
    #: variant -> (steps the statistics use, steps timed)
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return {
        "CPU": cpu, "cores available": str(_cores()), "torch": torch.__version__,
        "torch threads (all variants)": str(torch.get_num_threads()), "Python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)",
    }


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _hook_seconds(v: Variant) -> dict[str, float]:
    if v.attached is None:
        return {}
    series = v.attached.store.store.snapshot()[0].get("hookpolicy_hook_seconds", {})
    return {labels[1]: value for labels, value in series.items()}


def run_workload(name: str, rounds: int, warmup: int, budget: float, device: torch.device) -> WorkloadResult:
    wl = WORKLOADS[name]
    variants = build_variants(wl, device, list(VARIANTS))
    for _ in range(warmup):  # warm-up excluded, also from hookpolicy's own accounting
        for v in variants:
            v.step()
    before = {v.key: _hook_seconds(v) for v in variants}
    start = time.perf_counter()
    samples = interleave(variants, rounds, 0, device.type == "cuda", budget)
    seconds = time.perf_counter() - start
    rounds = len(samples["floor"].times)
    inside = {}
    for v in variants:
        after = _hook_seconds(v)
        if after:
            inside[v.key] = {rule: (value - before[v.key].get(rule, 0.0)) / rounds * 1e3 for rule, value in after.items()}
    raw = samples
    clean = {k: s.clean() for k, s in raw.items()}
    enough = all(len(c.times) >= max(10, 0.25 * len(raw[k].times)) and (k != "hp10" or any(c.active))
                 for k, c in clean.items())
    samples = clean if enough else raw
    used = "undisturbed steps" if enough else "all steps (too few undisturbed ones)"
    kept = {k: (len(samples[k].times), len(raw[k].times)) for k in raw}
    floor, floor_cpu = samples["floor"].times, samples["floor"].cpu
    f50, f10, f90 = (quantile(floor, q) for q in (0.5, 0.1, 0.9))
    c50 = quantile(floor_cpu, 0.5)
    rows = []
    for v in variants:
        s = samples[v.key]
        med, cpu_med = quantile(s.times, 0.5), quantile(s.cpu, 0.5)
        num = resampled_median(s.times)
        note = ""
        if v.key == "hp10":
            med, on, off = amortized(s)
            cpu_med = amortized(Samples(s.cpu, s.active))[0]
            num = resampled_amortized(s)
            if on and off:
                note = (f"amortized: median of its {len(on)} active steps {quantile(on, 0.5) / f50:.3f}x, "
                        f"of its {len(off)} inactive steps {quantile(off, 0.5) / f50:.4f}x")
        p10, p90 = quantile(s.times, 0.1), quantile(s.times, 0.9)
        ci = bootstrap_ratio(num, resampled_median(floor)) if v.key != "floor" else (1.0, 1.0)
        rows.append(Row(v.key, VARIANTS[v.key], med * 1e3, p10 * 1e3, p90 * 1e3, med / f50, p10 / f10, p90 / f90,
                        ci, cpu_med / c50, note=note))
    if device.type == "cuda":
        for v, row in zip(variants, rows):
            row.syncs = count_syncs(v, steps=10)
    for v in variants:
        v.close()
    return WorkloadResult(name, wl.describe, rounds, warmup, seconds, rows, samples, inside, used, kept)


# -- targets -------------------------------------------------------------------------------

@dataclass
class Check:
    """One target: what was measured against its goal, and the 95% interval of the measure where there is one."""

    name: str
    got: str
    goal: str
    met: bool
    limit: float = 0.0
    interval: Optional[tuple[float, float]] = None

    @property
    def doubt(self) -> str:
        """Where the interval holds the goal, what says so: the verdict (by the median) is not resolved by the run."""
        if self.interval is not None and self.interval[0] <= self.limit < self.interval[1]:
            return f"not resolved: its 95% interval {_interval(self.interval)} holds the goal"
        return ""


def _interval(ci: tuple[float, float]) -> str:
    return "[" + ", ".join("inf" if x == float("inf") else f"{x:.2f}" for x in ci) + "]"


def checks(results: list[WorkloadResult], scale: Optional[ScaleResult]) -> list[Check]:
    """Every target of issues 5 and 36, with the interval of each one timed in the interleaved steps."""
    out = []
    for res in results:
        r = {row.key: row for row in res.rows}
        t = {key: s.times for key, s in res.samples.items()}
        hp, hp10 = r["hp"].ratio, r["hp10"].ratio
        share = (hp - 1) / (r["hand"].ratio - 1) if r["hand"].ratio > 1 else float("inf")
        share6 = (r["hp_seed"].ratio - 1) / (r["seed"].ratio - 1) if r["seed"].ratio > 1 else float("inf")
        clip = r["clip_hp"].median_ms / r["clip_ref"].median_ms
        third = GOALS["third"]
        out += [
            Check(f"{res.name}: variant 3 / floor", f"{hp:.3f}x", f"<= {GOALS['hp']:.2f}x", hp <= GOALS["hp"],
                  GOALS["hp"], r["hp"].ci),
            Check(f"{res.name}: variant 4 / floor (amortized)", f"{hp10:.4f}x", f"<= {GOALS['hp10']:.2f}x",
                  hp10 <= GOALS["hp10"], GOALS["hp10"], r["hp10"].ci),
            Check(f"{res.name}: overhead of 3 / overhead of 2b (monitor.yaml's statistics by hand)",
                  f"{(hp - 1) * 100:.1f}% / {(r['hand'].ratio - 1) * 100:.1f}% = {share:.2f}", "<= 0.33",
                  share <= third, third, bootstrap_share(t["hp"], t["hand"], t["floor"])),
            Check(f"{res.name}: overhead of 2p / overhead of 2 (the seed's six statistics)",
                  f"{(r['hp_seed'].ratio - 1) * 100:.1f}% / {(r['seed'].ratio - 1) * 100:.1f}% = {share6:.2f}",
                  "<= 0.33", share6 <= third, third, bootstrap_share(t["hp_seed"], t["seed"], t["floor"])),
            Check(f"{res.name}: clip policy / clip_grad_norm_(foreach=True)", f"{clip:.3f}x", f"<= {GOALS['clip']:.2f}x",
                  clip <= GOALS["clip"], GOALS["clip"],
                  bootstrap_ratio(resampled_median(t["clip_hp"]), resampled_median(t["clip_ref"]))),
        ]
    if scale is not None:
        out += [
            Check(f"attach (plan + install) on {scale.modules:,} modules", f"{scale.attach.median * 1e3:.0f} ms",
                  "<= 1000 ms", scale.attach.median <= GOALS["attach_s"]),
            Check(f"/metrics scrape with {scale.series:,} series (wall)", f"{scale.scrape.median * 1e3:.1f} ms",
                  "<= 100 ms", scale.scrape.median <= GOALS["scrape_s"]),
            Check(f"/metrics scrape with {scale.series:,} series (CPU time of the scrape)",
                  f"{scale.scrape_cpu.median * 1e3:.1f} ms", "<= 100 ms", scale.scrape_cpu.median <= GOALS["scrape_s"]),
            Check(f"publishing {scale.series:,} series: CPU time of the step's read-back",
                  f"{scale.publish_cpu.median * 1e3:.1f} ms", "<= 5 ms", scale.publish_cpu.median <= GOALS["publish_s"]),
        ]
    return out


# -- output --------------------------------------------------------------------------------

def terminal(info: dict[str, str], results: list[WorkloadResult], scale: Optional[ScaleResult]) -> str:
    lines = ["", "machine: " + ", ".join(f"{k} {v}" for k, v in info.items())]
    for res in results:
        kept = ", ".join(f"{k} {n}/{m}" for k, (n, m) in res.kept.items())
        lines += ["", f"{res.describe}  ({res.rounds} rounds after {res.warmup} warm-up, {res.seconds:.0f} s)",
                  f"statistics over {res.used}: {kept}",
                  f"{'variant':58s} {'median':>9s} {'p10':>8s} {'p90':>8s} {'x median':>9s} {'95% CI':>15s}"
                  f" {'x p10':>6s} {'x p90':>6s} {'x CPU':>7s}"]
        for r in res.rows:
            lines.append(f"{r.label:58s} {r.median_ms:7.1f}ms {r.p10_ms:6.1f}ms {r.p90_ms:6.1f}ms {r.ratio:9.4f} "
                         f"[{r.ci[0]:.3f},{r.ci[1]:.3f}] {r.ratio_p10:6.3f} {r.ratio_p90:6.3f} {r.cpu_ratio:7.4f}"
                         + (f"  syncs/step {r.syncs[0]:.1f} ({r.syncs[1]:.1f} in readback)" if r.syncs else ""))
            if r.note:
                lines.append(f"{'':58s} {r.note}")
        for key, rules in res.inside.items():
            shown = ", ".join(f"{rule} {ms:.2f}" for rule, ms in rules.items())
            lines.append(f"  inside hookpolicy, ms/step ({key}): {shown}; total {sum(rules.values()):.2f}")
    if scale is not None:
        lines += ["", f"plan/attach on {scale.modules:,} modules ({scale.bindings:,} bindings): load "
                  f"{scale.load.median * 1e3:.1f} ms, plan {scale.plan.median * 1e3:.0f} ms, attach "
                  f"{scale.attach.median * 1e3:.0f} ms, remove {scale.remove.median * 1e3:.0f} ms",
                  f"scrape of {scale.series:,} series ({scale.scrape_bytes / 1e6:.1f} MB): median "
                  f"{scale.scrape.median * 1e3:.1f} ms wall, {scale.scrape_cpu.median * 1e3:.1f} ms CPU; "
                  f"the step that publishes them: {scale.readback_step.median * 1e3:.0f} ms vs "
                  f"{scale.plain_step.median * 1e3:.0f} ms, its read-back {scale.publish_cpu.median * 1e3:.1f} ms CPU",
                  "copies: " + ", ".join(f"{op} {by['plain'].median * 1e3:.0f} ms plain, {by['governed'].median * 1e3:.0f} ms "
                                         "governed" for op, by in scale.copies.items())]
    lines += ["", "targets:"]
    for c in checks(results, scale):
        lines.append(f"  {'met ' if c.met else 'MISS'} {c.name}: {c.got} (goal {c.goal}{'; ' + c.doubt if c.doubt else ''})")
    return "\n".join(lines)


def markdown(info: dict[str, str], command: str, results: list[WorkloadResult], scale: Optional[ScaleResult],
             ops: Optional[tuple[list[OpRow], float, float]], frames: Optional[tuple[dict[str, float], int]],
             load: tuple[str, str], elapsed: float, recorder: Optional[RecorderResult] = None,
             notes: bool = True) -> str:
    cuda = torch.cuda.is_available()
    out = [
        "# Benchmarks", "",
        "hookpolicy's cost inside a training step, measured by `bench/run.py` (issue 5). This page is",
        "written by the benchmark: every table is from the last run; the prose at the end",
        "(`bench/where-the-time-goes.md`) was written by hand from such runs and from",
        "measurements taken while the code was written, and says which is which.", "",
        f"Command: `{command}` ({elapsed / 60:.1f} minutes). `python bench/run.py` is the full run"
        " (5-9 minutes: longer when the machine is busy), `--quick` a short one (under 3 minutes);"
        " `--out docs/benchmarks.md`"
        " rewrites this page.", "",
        "## Machine", "",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- load average (1, 5, 15 min) before the run: {load[0]}; after: {load[1]}", "",
        "The machine is shared: other processes ran during the measurement (see the load average).",
        "With 2 torch threads on 2 cores, a step that shares a core with another process waits at",
        "every parallel region and can take 10x its time. So the benchmark records, per step,",
        "whether another process used the CPU meanwhile (`/proc/stat` against `/proc/self/stat`,",
        "3 clock ticks or more), and the statistics are taken over the undisturbed steps when",
        "there are enough of them (each table says which). `x CPU` is the ratio of the process's",
        "CPU time per step, another view less sensitive to preemption.", "",
        "## How it is measured", "",
        "- Every variant trains its own copy of the same model on the same fixed batch; a step is",
        "  forward, loss, backward, (clip or the hand-written monitor's check), `optimizer.step()`,",
        "  `zero_grad(set_to_none=True)`. hookpolicy's once-a-step readback runs inside",
        "  `optimizer.step()` (its step pre-hook), so it is in the timed step.",
        "- Interleaved in one process: one step of each variant per round, the starting variant",
        "  rotating each round; warm-up rounds are discarded. Rounds continue until every variant",
        "  has the wanted number of undisturbed steps or the workload's time budget is spent.",
        "- `x median` is the variant's median step time over the floor's; `x p10`/`x p90` compare",
        "  the same quantiles; the 95% interval of `x median` is a bootstrap over the steps, as are the targets'",
        "  intervals (a share of overheads: each variant's steps and the floor's resampled apart); a target whose",
        "  interval holds its goal is marked not resolved by the run: met or missed by its median alone.",
        "- Variant 4 (`every: 10`) is split into its active and inactive steps; its `x median` is",
        "  amortized: `(median(active) + 9 * median(inactive)) / 10` over the floor's median.",
        "- `torch.set_num_threads` is set once for the whole process (all variants alike).",
        "- On a CUDA machine the benchmark runs on the GPU and also counts host-device syncs per",
        "  step with `torch.cuda.set_sync_debug_mode(\"warn\")` (hookpolicy: zero inside hooks, one",
        "  in the readback)." + ("" if cuda else " **This run had no GPU: CPU only, no sync counts.**"), "",
        "Variants: (1) no hooks; (2) the seed's hand-written `GradientMonitor` (`bench/monitors.py`:"
        " forward hook and `register_full_backward_hook` on every Linear, six statistics of each"
        " output and grad_output, each read with `.item()`, plus its `isnan().any()`), every step;"
        " (2p) the same six statistics as a policy (`bench/policies/seed-stats.yaml`); (2b) the"
        " statistics of `monitor.yaml` by hand, with `.item()` and a NaN guard that skips the step"
        " (the apples-to-apples baseline for 3); (3) `bench/policies/monitor.yaml` every step; (4)"
        " `bench/policies/monitor-every10.yaml`; (5a) `clip_grad_norm_(params, 1.0, foreach=True)`"
        " before each step; (5b) `bench/policies/clip.yaml`.", "",
    ]
    for res in results:
        out += [f"## {res.name}: {res.describe}", "",
                f"{res.rounds} rounds after {res.warmup} warm-up rounds, {res.seconds:.0f} s. Statistics over"
                f" {res.used} (used/timed: " + ", ".join(f"{k} {n}/{m}" for k, (n, m) in res.kept.items()) + ").", "",
                "| variant | median | p10 | p90 | x median | 95% CI | x p10 | x p90 | x CPU |"
                + (" syncs/step (readback) |" if res.rows[0].syncs else ""),
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if res.rows[0].syncs else "")]
        for r in res.rows:
            out.append(f"| {r.label} | {r.median_ms:.1f} ms | {r.p10_ms:.1f} ms | {r.p90_ms:.1f} ms | "
                       f"**{r.ratio:.4f}** | {r.ci[0]:.3f}–{r.ci[1]:.3f} | {r.ratio_p10:.3f} | {r.ratio_p90:.3f} | "
                       f"{r.cpu_ratio:.4f} |" + (f" {r.syncs[0]:.1f} ({r.syncs[1]:.1f}) |" if r.syncs else ""))
        out.append("")
        for r in res.rows:
            if r.note:
                out += [f"Variant 4, {r.note}.", ""]
        if res.inside:
            out.append("Time inside hookpolicy by rule, ms per step (its own `hookpolicy_hook_seconds_total`, wall):")
            out.append("")
            for key, rules in res.inside.items():
                shown = ", ".join(f"`{rule}` {ms:.2f}" for rule, ms in rules.items())
                out.append(f"- {VARIANTS[key]}: {shown}; total {sum(rules.values()):.2f}")
            out.append("")
    if scale is not None:
        out += [
            "## Plan, attach and scrape at scale", "",
            f"A model of {scale.modules:,} modules ({scale.linears:,} `Linear(8, 8)` in 100 `Sequential`"
            f" blocks, `bench/models.py:wide_model`), with `monitor.yaml` ({scale.bindings:,} bindings).", "",
            "| what | median | p10 | p90 |", "|---|---:|---:|---:|",
            _scale_row("load `monitor.yaml`", scale.load, 1),
            _scale_row(f"build the plan ({scale.bindings:,} bindings)", scale.plan),
            _scale_row(f"**attach** (plan, compile, install {scale.hooks:,} hooks)", scale.attach, bold=True),
            _scale_row("remove", scale.remove),
            _scale_row(f"**the exporter's /metrics answer with {scale.series:,} statistic series**"
                       f" ({scale.scrape_bytes / 1e6:.1f} MB, text format), wall, each after a step (it finishes the values"
                       " the step handed over)", scale.scrape, 1, bold=True),
            _scale_row("the same scrape, CPU time of the scraping thread", scale.scrape_cpu, 1),
            _scale_row("the same in OpenMetrics (Prometheus's Accept header), CPU time", scale.scrape_openmetrics_cpu, 1),
            _scale_row("prometheus_client's `generate_latest(registry)` after a step (the same bytes), CPU time",
                       scale.library_cpu, 1),
            _scale_row("the optimizer step that reads back and publishes them (`scrape.yaml`)", scale.readback_step),
            _scale_row("its read-back (fetch, hand over, publish), CPU time", scale.publish_cpu, 1),
            _scale_row("the same SGD step without a policy", scale.plain_step),
            *(_scale_row(f"`{op}` of the model, {'with `monitor.yaml` attached' if label == 'governed' else 'no policy'}"
                         " (CPU time outside the garbage collector; its share: `bench/save.py`)",
                         s) for op, by in scale.copies.items() for label, s in by.items()), "",
        ]
    if recorder is not None:
        out += recorder_markdown(recorder)
    out += ["## Targets", "", "| target | measured | goal | |", "|---|---|---|---|"]
    for c in checks(results, scale):
        out.append(f"| {c.name} | {c.got} | {c.goal} | {'met' if c.met else '**missed**'}{' (' + c.doubt + ')' if c.doubt else ''} |")
    out += ["", "## Where the time goes", ""]
    if ops is not None:
        rows, base_ms, hp_ms = ops
        out += [
            f"`torch.profiler`, GPT, self CPU time per step by operator: floor {base_ms:.1f} ms, variant 3"
            f" {hp_ms:.1f} ms (the profiler's own overhead inflates both). The operators whose time grows"
            " most with the policy:", "",
            "| operator | calls/step, floor | calls/step, variant 3 | ms/step, floor | ms/step, variant 3 | difference |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for op in rows[:14]:
            out.append(f"| `{op.name}` | {op.calls_base:.0f} | {op.calls_hp:.0f} | {op.ms_base:.2f} | {op.ms_hp:.2f} | "
                       f"{op.ms_hp - op.ms_base:+.2f} |")
        out.append("")
    if frames is not None:
        shares, total = frames
        out += [
            f"py-spy (250 Hz, {total} samples inside the timed GPT steps of variant 3): share of the step"
            " spent under each hookpolicy function, inclusive of the torch operators it launches:", "",
            "| Python frame | share of the step |", "|---|---:|",
        ]
        for name, share in sorted(shares.items(), key=lambda kv: -kv[1])[:16]:
            out.append(f"| `{name}` | {share * 100:.1f}% |")
        out.append("")
    written = Path(__file__).with_name("where-the-time-goes.md")
    if notes and written.exists():
        out.append(written.read_text().strip())
    return "\n".join(out) + "\n"


def _scale_row(what: str, s: Any, digits: int = 0, bold: bool = False) -> str:
    med = f"{s.median * 1e3:.{digits}f} ms"
    return (f"| {what} | {'**' + med + '**' if bold else med} | {s.p10 * 1e3:.{digits}f} ms | "
            f"{s.p90 * 1e3:.{digits}f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer rounds)")
    parser.add_argument("--out", type=Path, help="write the markdown report here (e.g. docs/benchmarks.md)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores available)")
    parser.add_argument("--workloads", default="gpt,nanogpt,cnn,lstm", help="comma-separated: gpt, nanogpt, cnn, lstm")
    parser.add_argument("--rounds", type=int, default=None, help="override the rounds of every workload")
    parser.add_argument("--no-scale", action="store_true", help="skip variant 6 (10k modules, 10k series)")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler and py-spy profiles")
    parser.add_argument("--no-recorder", action="store_true", help="skip the flight recorder's ring on 96 layers")
    parser.add_argument("--no-notes", action="store_true",
                        help="leave bench/where-the-time-goes.md out of the report (a second report, e.g. a GPU's)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads or _cores())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = machine()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python bench/run.py", *sys.argv[1:]])
    start = time.perf_counter()
    mode = "quick" if args.quick else "full"
    results = []
    for name in args.workloads.split(","):
        rounds, warmup, budget = ROUNDS[mode][name]
        rounds = args.rounds or rounds
        print(f"[{time.perf_counter() - start:5.0f}s] {name}: {len(VARIANTS)} variants, {rounds} undisturbed steps"
              f" each wanted, at most {budget} s ...", flush=True)
        results.append(run_workload(name, rounds, warmup, budget, device))
    scale = None
    if not args.no_scale:
        print(f"[{time.perf_counter() - start:5.0f}s] plan/attach and scrape at 10k ...", flush=True)
        scale = measure_scale(3 if args.quick else 5, 10 if args.quick else 30, device)
    recorder = None
    if not args.no_recorder:
        print(f"[{time.perf_counter() - start:5.0f}s] the flight recorder's ring on 96 layers ...", flush=True)
        recorder = measure_recorder(20 if args.quick else 60, 3 if args.quick else 5)
    ops = frames = None
    if not args.no_profile:
        print(f"[{time.perf_counter() - start:5.0f}s] profiling variant 3 on gpt ...", flush=True)
        ops = op_profile("gpt", 3 if args.quick else 8, device)
        if device.type == "cpu":
            frames = frame_profile("gpt", 10 if args.quick else 30, torch.get_num_threads())
    elapsed = time.perf_counter() - start
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(terminal(info, results, scale))
    if recorder is not None:
        print("\n" + "\n".join(recorder_lines(recorder)))
    print(f"\n{elapsed:.0f} s in all; load average before {load_before}, after {load_after}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(info, command, results, scale, ops, frames, (load_before, load_after), elapsed,
                                           recorder, notes=not args.no_notes))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
