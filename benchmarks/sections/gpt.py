"""Section: every optimizer's training step on the realistic GPT (10.9M parameters), beside its arithmetic floor.

One model per configuration, all with the same weights, train on the same batch in interleaved
rounds; a sample is 10 training steps (one statistics period of the rules), so every sample holds
its share of statistics and inverse steps. Beside the rules, their floors: the same base
optimizer plus the rule's own arithmetic on the same schedule, called directly with no capture
(``rules.kernel_floor``), and for DP the noise draw alone. Memory: the bytes a configuration
holds beyond stock AdamW just before ``step`` (after backward), and each one's peak resident set
in a process of its own. Where the time goes: ``torch.profiler``'s top operators of the rules
and DP.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import CoverageWarning, DPAdamW, InputAwareAdamW, Monitor, NonFiniteFinder

from .. import baselines, gpt, rules
from ..core import Config, Progress, Result, Section, Table, Target, format_seconds
from ..machine import allocated_bytes, has_allocation_probe, profiled
from ..timing import Ratio, Timing, interleave

LR = 1e-5  # small: thousands of timed steps on one batch stay finite (a step's work does not depend on it)
PERIOD = rules.STATISTICS_EVERY
ADAMW, SGD = "AdamW", "SGD (momentum 0.9)"
MUON = "Muon + AdamW"
DROP_IN, MONITOR, FINDER = "InputAwareAdamW, no rule", "Monitor(every=1)", "NonFiniteFinder"
EVA, FOOF, KFAC, DP = "Eva → AdamW", "FOOF → AdamW", "K-FAC → AdamW", "DPAdamW (σ = 1, C = 1)"
FOOF_MUON = "FOOF → Muon + AdamW"
FOOF_FLOOR, KFAC_FLOOR, NOISE_FLOOR = "FOOF's arithmetic → AdamW", "K-FAC's arithmetic → AdamW", "AdamW + DP's noise"
PROFILED = (FOOF, KFAC, DP)
# The candidates of docs/rules/candidates.md, each beside its arithmetic alone (rules.candidate_floor).
CANDIDATES = {
    "whitened_muon": (
        "Whitened Muon + AdamW",
        f"the Muon recipe, its Muon part taking the polar step in the input-whitened metric, polar(M A^-1/2) A^-1/2, "
        f"{rules.ROOTS_SCHEDULE}",
    ),
    "two_sided_muon": (
        "Two-sided Muon + AdamW",
        f"the same two-sided, B^-1/2 polar(B^-1/2 M A^-1/2) A^-1/2, {rules.ROOTS_SCHEDULE}",
    ),
    "eigenbasis_adam": (
        "Eigenbasis Adam + AdamW",
        "Adam in the eigenbases of the Kronecker factors on every layer with both, AdamW on the rest, "
        f"{rules.ROOTS_SCHEDULE.replace('inverse roots', 'eigenbases')}",
    ),
}


@dataclass(frozen=True)
class Variant:
    """One configuration: ``build(model) -> (optimizer, whatever must stay alive beside it)``.

    ``limit``: the target of its step time over AdamW's; ``floor``: the variant that is its
    arithmetic alone, reported beside it, and ``floor_limit`` the target of the ratio to it.
    """

    build: Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]
    what: str
    limit: float | None = None
    floor: str | None = None
    floor_limit: float | None = None
    period: int = PERIOD


FLOOR_LIMIT = 1.05  # a Kronecker rule's step over its arithmetic alone


def _alone(factory: Callable[[nn.Module, float], torch.optim.Optimizer]) -> Callable[[nn.Module], tuple[Any, Any]]:
    return lambda model: (factory(model, LR), None)


def _with_tool(tool: Callable[[torch.optim.Optimizer], Any]) -> Callable[[nn.Module], tuple[Any, Any]]:
    def build(model: nn.Module) -> tuple[Any, Any]:
        optimizer = InputAwareAdamW(model, lr=LR)
        return optimizer, tool(optimizer)

    return build


class NoiseFloor(torch.optim.AdamW):
    """AdamW that first adds a standard normal draw to every gradient: DP's noise, with nothing else of DP."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        noise = torch.randn(sum(g.numel() for g in grads))
        for grad, draw in zip(grads, noise.split([g.numel() for g in grads]), strict=True):
            grad.add_(draw.view_as(grad))
        return super().step(closure)


def variants(size: gpt.GPTSize) -> dict[str, Variant]:
    """Every configuration timed, the baseline (AdamW) first."""
    dp = lambda model: (DPAdamW(model, lr=LR, expected_batch_size=size.batch), None)  # noqa: E731
    return {
        ADAMW: Variant(_alone(lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr)), "stock, foreach: the baseline"),
        SGD: Variant(_alone(lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)), "stock, foreach"),
        MUON: Variant(
            _alone(baselines.muon),
            "torch.optim.Muon for the blocks' 2-D weights (Newton–Schulz in float32), AdamW for the rest",
        ),
        DROP_IN: Variant(_alone(lambda m, lr: InputAwareAdamW(m, lr=lr)), "nothing reads the capture", 1.01),
        MONITOR: Variant(
            _with_tool(lambda o: Monitor(o, every=1, callback=lambda record: None)),
            "input statistics of every module, gradient and update norms, every step",
            1.05,
        ),
        FINDER: Variant(_with_tool(NonFiniteFinder), "left on: names the first non-finite module", 1.02),
        EVA: Variant(_alone(rules.eva(base=torch.optim.AdamW)), f"statistics every {PERIOD} steps", 1.08),
        FOOF: Variant(_alone(rules.foof(adamw=True)), rules.SCHEDULE, 1.20, FOOF_FLOOR, FLOOR_LIMIT),
        FOOF_FLOOR: Variant(
            _alone(rules.kernel_floor(two_sided=False, base=torch.optim.AdamW)),
            "AdamW plus FOOF's statistics products and their running averages, inverses and preconditioning "
            "products, called directly",
        ),
        FOOF_MUON: Variant(
            _alone(rules.foof_on_muon()),
            f"FOOF in front of the Muon part of the Muon + AdamW recipe (base=Muon), {rules.SCHEDULE}",
        ),
        KFAC: Variant(_alone(rules.kfac(base=torch.optim.AdamW)), rules.SCHEDULE, 1.40, KFAC_FLOOR, FLOOR_LIMIT),
        KFAC_FLOOR: Variant(
            _alone(rules.kernel_floor(two_sided=True, base=torch.optim.AdamW)),
            "AdamW plus K-FAC's statistics products and their running averages, inverses and two-sided "
            "products, called directly",
        ),
        DP: Variant(dp, "per-sample clipping of every layer, noise, positions batched", 1.30, NOISE_FLOOR),
        NOISE_FLOOR: Variant(_alone(lambda m, lr: NoiseFloor(m.parameters(), lr=lr)), "a normal draw per parameter"),
        **{
            name: Variant(_alone(factory()), what, floor=f"{name}: arithmetic alone")
            for (name, what), factory in zip(
                CANDIDATES.values(), (rules.whitened_muon, rules.two_sided_muon, rules.eigenbasis_adam), strict=True
            )
        },
        **{
            f"{name}: arithmetic alone": Variant(
                _alone(rules.candidate_floor(candidate)),
                "the candidate's base and its statistics, eigendecompositions and per-step products, called directly",
            )
            for candidate, (name, _) in CANDIDATES.items()
        },
    }


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad()
        gpt.loss(model, batch).backward()
        optimizer.step()

    return step


def _held_before_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]) -> int:
    """Heap bytes allocated since ``zero_grad`` once backward has run, just before ``step``."""
    optimizer.zero_grad()
    gc.collect()
    gc.disable()
    try:
        start = allocated_bytes()
        gpt.loss(model, batch).backward()
        held = allocated_bytes() - start
    finally:
        gc.enable()
    optimizer.step()
    return held


def _profile(step: Callable[[], None], steps: int, top: int = 6) -> list[list[str]]:
    """The operators with the most self CPU time over ``steps`` training steps, with their share."""
    with profiled(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        [
            e.key,
            str(e.count),
            format_seconds(e.self_cpu_time_total / 1e6 / steps),
            f"{e.self_cpu_time_total / total:.0%}",
        ]
        for e in events[:top]
    ]


def peak_rss(name: str, size_name: str, steps: int = 3) -> int:
    """Peak resident bytes of a process that builds the model and optimizer ``name`` and trains ``steps`` steps."""
    import resource

    size = gpt.SIZES[size_name]
    torch.manual_seed(0)
    model = gpt.build(size)
    optimizer, _keep = variants(size)[name].build(model)
    batch = next(gpt.batches(size, 0))
    step = _step(model, optimizer, batch)
    for _ in range(steps):
        step()
    # Linux: this process's own high-water mark. ru_maxrss would carry the parent's (a child started
    # by vfork, as subprocess does, is charged the parent's peak when it execs).
    status = Path("/proc/self/status")
    if status.exists():
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peaks(names: list[str], size_name: str, threads: int) -> dict[str, int]:
    code = (
        f"import json, sys, torch; torch.set_num_threads({threads}); "
        "from benchmarks.sections.gpt import peak_rss; print(json.dumps(peak_rss(sys.argv[1], sys.argv[2])))"
    )
    out = {}
    for name in names:
        done = subprocess.run([sys.executable, "-c", code, name, size_name], capture_output=True, text=True, check=True)
        out[name] = int(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def _mib(value: float) -> str:
    return f"{value / 2**20:+.0f} MiB" if abs(value) >= 2**19 else f"{value / 2**10:+.0f} KiB"


def _rows(
    table: dict[str, Variant], timing: Timing, ratios: dict[str, Ratio], memory: dict[str, Any]
) -> list[list[str]]:
    rows = []
    for name, variant in table.items():
        floor = ratios[variant.floor].median if variant.floor else None
        rows.append(
            [
                name,
                variant.what,
                format_seconds(timing.per_call(name)),
                "1" if name == ADAMW else ratios[name].shown(),
                f"{ratios[name].median / floor:.3f}×" if floor else "",
                _mib(memory["held"].get(name, 0) - memory["held"].get(ADAMW, 0)) if memory["held"] else "",
                _mib(memory["peak"][name] - memory["peak"][ADAMW]) if memory["peak"] else "",
            ]
        )
    return rows


def _targets(table: dict[str, Variant], ratios: dict[str, Ratio], config: Config, described: str) -> list[Target]:
    targets = []
    for name, variant in table.items():
        if variant.limit is None:
            continue
        ratio = ratios[name]
        detail = f"rounds {ratio.low:.3f}–{ratio.high:.3f}; {described}"
        targets.append(
            Target.at_most(
                f"{name} training step vs AdamW, GPT", ratio.median, variant.limit, "×", detail
            ).full_size_only(config)
        )
        if variant.floor and variant.floor_limit:
            floor = ratios[variant.floor]
            targets.append(
                Target.at_most(
                    f"{name} training step vs its arithmetic floor ({variant.floor}), GPT",
                    ratio.median / floor.median,
                    variant.floor_limit,
                    "×",
                    f"floor {floor.median:.3f}× AdamW",
                ).full_size_only(config)
            )
    return targets


def _models(base: nn.Module, names: Iterator[str] | list[str]) -> dict[str, nn.Module]:
    return {name: copy.deepcopy(base) for name in names}


def run(config: Config, progress: Progress) -> Result:
    with warnings.catch_warnings():
        # The embeddings take the base optimizer's update under the Kronecker rules (coverage() says
        # so, with a CoverageWarning at the first step): expected here, and said in the table's note.
        warnings.simplefilter("ignore", CoverageWarning)
        return _run(config, progress)


def _run(config: Config, progress: Progress) -> Result:
    # A sample is PERIOD whole steps of a 0.7 s model: five rounds already take minutes.
    config = dataclasses.replace(config, pairs=config.pick(config.pairs, 5), sample_seconds=0.0)
    size = gpt.size_of(config)
    table = variants(size)
    progress.start(3 + len(PROFILED))
    torch.manual_seed(config.seed)
    base = gpt.build(size)
    described = size.describe(base)
    batch = next(gpt.batches(size, config.seed))
    models = _models(base, list(table))
    built = {name: table[name].build(models[name]) for name in table}
    steps = {name: _step(models[name], built[name][0], batch) for name in table}

    progress.describe("interleaved training steps")
    timing = interleave(steps, config, multiple_of={name: v.period for name, v in table.items()})
    ratios = {name: timing.ratio(name, ADAMW) for name in table}
    progress.advance()

    progress.describe("memory held before step")  # after the timed steps: every optimizer's state exists
    memory: dict[str, Any] = {"held": {}, "peak": {}}
    if has_allocation_probe():
        memory["held"] = {name: _held_before_step(models[name], built[name][0], batch) for name in table}
    progress.advance()

    tops = {}
    for name in PROFILED:
        progress.describe(f"profiling {name}")
        tops[name] = _profile(steps[name], PERIOD)
        progress.advance()
    del built, steps, models

    if config.size != "quick":
        progress.describe("peak resident memory, one process per configuration")
        memory["peak"] = _peaks(list(table), "default", config.threads)
    progress.advance()

    tables = [
        Table(
            f"Training step on the {described}, ratio vs AdamW",
            ["configuration", "what runs", "step", "ratio vs AdamW", "vs its floor", "held before step", "peak RSS"],
            _rows(table, timing, ratios, memory),
            f"Interleaved rounds, each sample {PERIOD} whole steps (zero_grad, forward, backward, step) on one batch; "
            "every model starts from the same weights. Ratio: median over rounds (range in brackets). vs its floor: "
            "the ratio over that of the same base optimizer plus only the rule's arithmetic on the same schedule, "
            "called directly. Held before step: heap bytes allocated between zero_grad and the end of backward, "
            "beyond AdamW's (gradients and what the capture keeps). Peak RSS: a process of its own building the "
            "model and training 3 steps, beyond AdamW's. The Kronecker rules: "
            f"{rules.SCHEDULE}; the embeddings take AdamW's own update under them (as `coverage()` reports). "
            "torch.optim.Muon as shipped (Newton–Schulz in bfloat16, emulated on this CPU) is timed in the "
            "convergence section, on the small GPT.",
        ),
        *(
            Table(
                f"Where {name}'s step time goes: torch.profiler's top operators by self CPU time",
                ["operator", "calls", "per training step", "share"],
                rows,
                f"{PERIOD} training steps profiled (one statistics period).",
            )
            for name, rows in tops.items()
        ),
    ]
    return Result(
        tables=tables,
        targets=_targets(table, ratios, config, described),
        data={
            "workload": described,
            "ratios_vs_adamw": {name: ratio.__dict__ for name, ratio in ratios.items()},
            "memory": memory,
            "profiles": tops,
            "timing": timing.to_json(),
            "median_step_seconds": {name: statistics.median(timing.seconds[name]) for name in table},
        },
    )


def heading(config: Config) -> tuple[str, str]:
    """The section's title and summary at ``config``: the model that run trained, counted."""
    size = gpt.size_of(config)
    with torch.device("meta"):  # counted without allocating or initializing the weights
        parameters = sum(p.numel() for p in gpt.build(size).parameters())
    realistic = config.size != "quick"
    title = (
        f"At {'realistic' if realistic else 'quick'} size: a {parameters / 1e6:.1f}M-parameter GPT "
        f"({size.layers} blocks, width {size.width}, {size.batch * size.context:,} tokens per step), "
        "every optimizer against AdamW and its floor"
    )
    scale = (
        "at this size arithmetic, not a torch call's microseconds, dominates a CPU step, so what remains above a "
        "rule's floor is overhead"
        if realistic
        else "at the quick size a torch call's microseconds, not arithmetic, dominate a step: a smoke run of the "
        "realistic-size measurement, whose targets are not judged"
    )
    summary = (
        f"A byte-level GPT ({size.layers} blocks, width {size.width}, context {size.context}, batch {size.batch} × "
        f"{size.context} tokens) on the Python standard library's own sources (`benchmarks/gpt.py`): {scale}. Every "
        "configuration trains its own copy of the model in interleaved rounds: the stock optimizers a user would "
        "pick today (AdamW, SGD with momentum, Muon for the hidden matrices with AdamW for the rest), the drop-in "
        "with nothing reading, the Monitor and the non-finite finder, Eva, FOOF and K-FAC in front of AdamW, "
        "DPAdamW, and the candidate geometries of docs/rules/candidates.md; each rule beside its arithmetic floor; "
        "memory beyond AdamW; and torch.profiler's top operators."
    )
    return title, summary


_DEFAULT_TITLE, _DEFAULT_SUMMARY = heading(Config())

SECTION = Section(
    name="gpt",
    title=_DEFAULT_TITLE,
    summary=_DEFAULT_SUMMARY,
    run=run,
    estimate=(5, 600),
    heading_at=heading,
)
