"""Section: time to result, measured: the input-aware rules and candidates against SGD, AdamW and Muon."""

from __future__ import annotations

import dataclasses
import math
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inputaware_optim import CoverageWarning

from .. import baselines, gpt, rules
from .. import digits as shared
from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..digits import BATCH, TEST_SIZE, Factory, Sweep, Task
from ..timing import Timing

SEEDS = 3
LIMIT = 0.85  # an input-aware configuration's measured time to the goal, in units of the fastest stock optimizer's
WORKLOADS_NEEDED = 2  # of JUDGED, where some input-aware configuration is within LIMIT
STOCK = ("SGD (momentum 0.9)", "AdamW", "Muon")
DIGITS_TASKS = ("CNN", "autoencoder")  # the MLP is left to the step-time sections: the budget goes to the GPT
JUDGED = ("GPT", *DIGITS_TASKS)
GOAL = "goal"
CLOCK = "measured training time (s)"
TORCH_MUON = "torch.optim.Muon as shipped"
# The rules precondition the Linear layers; an Embedding's gradient goes to the base as it is.
EMBEDDINGS = "the embeddings take AdamW's own update"
GPT_WINDOWS = 2  # validation batches per evaluation (fixed windows of held-out files, the same for every run)
# The GPT's work per optimizer step: the scale section's realistic setting (8 micro-batches of 8 × 128 tokens),
# where a Kronecker rule's statistics and products are spread over the tokens as in training at scale.
MICRO_BATCHES = 8


@dataclass(frozen=True)
class LanguageTask(Task):
    """The GPT workload as a ``Task``: judged by its validation loss (nats per byte), lower is better."""

    size: gpt.GPTSize = gpt.SIZES["quick"]
    micro_batches: int = 1  # per optimizer step, their gradients accumulated (each loss over their number)

    @property
    def metric(self) -> str:
        return "validation_loss"

    @property
    def metric_name(self) -> str:
        return "validation loss"

    def shown(self, value: float) -> str:
        return f"{value:.3f}"


def _gpt_task(config: Config) -> LanguageTask:
    size = gpt.SIZES[config.pick("quick", "small")]
    micro_batches = config.pick(2, MICRO_BATCHES)
    return LanguageTask(
        "GPT",
        f"{size.describe()}, {micro_batches} micro-batches per step "
        f"({micro_batches * size.batch * size.context:,} tokens), the standard library's sources",
        lambda: gpt.build(size),
        images=False,
        reconstruct=True,
        steps=config.pick(12, 40, 80),
        size=size,
        micro_batches=micro_batches,
    )


def _gpt_sweeps(config: Config) -> list[Sweep]:
    """The GPT's configurations: the stock three and the rules in front of AdamW (the SGD-based ones are
    SGD's poor match for a transformer); the first value of each sweep at size quick, two at default."""

    def rates(values: tuple[float, ...]) -> tuple[float, ...]:
        return config.pick(values[:1], values[:2], values)

    adamw = (3e-3, 1e-2, 1e-3)
    stock = {sweep.name: sweep for sweep in shared.baseline_sweeps(config, muon=True)}
    return [
        dataclasses.replace(stock["SGD (momentum 0.9)"], learning_rates=rates((0.03, 0.1, 0.3))),
        dataclasses.replace(stock["AdamW"], learning_rates=rates(adamw)),
        dataclasses.replace(stock["Muon"], learning_rates=rates(adamw)),
        Sweep(
            "FOOF on AdamW",
            rules.foof(adamw=True),
            rates(adamw),
            f"FOOF's preconditioned gradient handed to torch.optim.AdamW (base=torch.optim.AdamW), {rules.SCHEDULE}; "
            f"{EMBEDDINGS}",
        ),
        Sweep(
            "K-FAC on AdamW",
            rules.kfac(base=torch.optim.AdamW),
            rates(adamw),
            f"K-FAC's preconditioned gradient (damping λ = {rules.KFAC_DAMPING:g}) handed to torch.optim.AdamW, "
            f"{rules.SCHEDULE}; {EMBEDDINGS}",
        ),
        Sweep("FOOF on Muon", rules.foof_on_muon(), rates(adamw), f"{rules.FOOF_ON_MUON}; {EMBEDDINGS}"),
        Sweep(
            "Eva on AdamW",
            rules.eva(base=torch.optim.AdamW),
            rates(adamw),
            f"Eva's preconditioned gradient (damping {rules.EVA_DAMPING:g}, KL clipping 0.001) handed to "
            f"torch.optim.AdamW, statistics every {rules.STATISTICS_EVERY} steps; {EMBEDDINGS}",
        ),
        *rules.geometry_sweeps(config, rates(adamw)),
    ]


def train_gpt(
    task: LanguageTask, factory: Factory, lr: float, steps: int, eval_every: int, seed: int
) -> dict[str, Any]:
    """``steps`` steps on the GPT workload, each over ``task.micro_batches`` micro-batches (their gradients
    accumulated); the validation loss every ``eval_every`` steps.

    As ``digits.train``: ``seconds`` is the measured wall-clock of the training steps
    (zero_grad, forwards, backwards, step; drawing the batches and evaluating excluded) up to each
    evaluation, ``train_loss`` the mean loss of the steps since the previous one (at step 0,
    the first step's batches), and a step that raises ``RuntimeError`` or a non-finite loss ends the
    run as diverged.
    """
    torch.manual_seed(seed)
    model = task.build()
    optimizer = factory(model, lr)
    stream = gpt.batches(task.size, seed)
    history: dict[str, list[float]] = {key: [] for key in ("step", "seconds", "train_loss", "validation_loss")}
    seconds, step, diverged = 0.0, 0, False
    step_batches = [next(stream) for _ in range(task.micro_batches)]
    with torch.no_grad():
        batch_losses = [sum(float(gpt.loss(model, batch)) for batch in step_batches) / task.micro_batches]

    def record() -> None:
        history["step"].append(step)
        history["seconds"].append(seconds)
        history["train_loss"].append(sum(batch_losses) / len(batch_losses))
        batch_losses.clear()
        history["validation_loss"].append(gpt.evaluate(model, task.size, GPT_WINDOWS))

    with warnings.catch_warnings():
        # The rules warn, at their first step, that the embeddings take the base's update: the captions say it.
        warnings.filterwarnings("ignore", "(FOOF|KFAC|Eva) updates 2 weight matrices", CoverageWarning)
        record()
        while step < steps and not diverged:
            start = time.perf_counter()
            optimizer.zero_grad()
            losses = []
            for batch in step_batches:  # gradient accumulation: each micro-batch's loss over their number
                micro = gpt.loss(model, batch) / task.micro_batches
                micro.backward()
                losses.append(micro.detach())
            try:
                optimizer.step()
            except RuntimeError:  # a Kronecker rule refusing statistics that are no longer positive definite
                diverged = True
            seconds += time.perf_counter() - start
            step += 1
            batch_losses.append(float(sum(losses)))
            diverged = diverged or not math.isfinite(batch_losses[-1])
            if step % eval_every == 0 or step == steps or diverged:
                record()
            step_batches = [next(stream) for _ in range(task.micro_batches)]
    return {"lr": lr, "seed": seed, "diverged": diverged, "measured_training_seconds": seconds, **history}


def _muon_variants() -> dict[str, Factory]:
    """AdamW, the trained Muon (float32 Newton–Schulz) and the same recipe on ``torch.optim.Muon`` as shipped."""
    return {
        "AdamW": lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr),
        "Muon": baselines.muon,
        TORCH_MUON: lambda model, lr: baselines.muon(model, lr, torch.optim.Muon),
    }


def _gpt_muon_timing(task: LanguageTask, config: Config) -> Timing:
    """Interleaved GPT training steps of ``_muon_variants``, in a few single-step samples (the shipped Muon's take
    seconds)."""
    stream = gpt.batches(task.size, config.seed)
    step_batches = [next(stream) for _ in range(task.micro_batches)]

    def step_of(factory: Factory) -> Callable[[], None]:
        torch.manual_seed(config.seed)
        model = task.build()
        optimizer = factory(model, rules.TIMING_LR)

        def step() -> None:
            optimizer.zero_grad()
            for batch in step_batches:
                (gpt.loss(model, batch) / task.micro_batches).backward()
            optimizer.step()

        return step

    steps = {name: step_of(factory) for name, factory in _muon_variants().items()}
    for step in steps.values():  # one warm-up call each
        step()
    # As ``interleave``, in samples of one call: the order reverses every round.
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for round_ in range(config.pick(1, 2, 3)):
        for name, step in order if round_ % 2 == 0 else order[::-1]:
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
            faults[name].append(float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
    return Timing({name: 1 for name in steps}, seconds, faults, torch.get_num_threads())


def _spread(values: list[float], shown: Any, worst: float = math.inf) -> str:
    """``median (min–max)`` over the seeds; a time that never came is infinite, a diverged run's final value NaN."""
    ordered = sorted((worst if math.isnan(v) else v, v) for v in values)

    def one(value: float, original: float) -> str:
        if math.isnan(original) or (math.isinf(value) and worst != math.inf):
            return "diverged"
        return shown(value) if math.isfinite(value) else "never"

    middle = shared.median([v for v, _ in ordered])
    return f"{one(middle, middle)} ({one(*ordered[0])}–{one(*ordered[-1])})"


def _median_or_worst(values: list[float], worst: float) -> float:
    """The median, with NaN (a diverged run) counted as ``worst``."""
    return shared.median([worst if math.isnan(v) else v for v in values])


def _median_curve(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float | None]]:
    """At each evaluation, the median measured training seconds and the median of ``key`` over the runs
    (None where most have diverged)."""
    longest = max(runs, key=lambda r: len(r["step"]))
    seconds, values = [], []
    for index in range(len(longest["step"])):
        seconds.append(shared.median([r["seconds"][index] for r in runs if index < len(r["seconds"])]))
        here = [r[key][index] for r in runs if index < len(r[key]) and math.isfinite(r[key][index])]
        values.append(scale * shared.median(here) if 2 * len(here) > len(runs) else None)
    return seconds, values


def _seconds_per_step(runs: list[dict[str, Any]]) -> float:
    """The median over the runs of their measured training seconds per step."""
    return shared.median([r["measured_training_seconds"] / r["step"][-1] for r in runs if r["step"][-1] > 0])


def _train_task(
    task: Task,
    sweeps: list[Sweep],
    config: Config,
    progress: Progress,
    seeds: int,
    train: Callable[[Factory, float, int], dict[str, Any]],
    muon_timing: Callable[[], Timing],
) -> dict[str, Any]:
    """Muon's step times, the learning-rate sweeps on the first seed, then every seed at the chosen rates.

    The optimizers take turns (each sweep's n-th rate, then each optimizer's next seed), so a
    change in the shared machine's load falls on all of them alike.
    """
    progress.describe(f"{task.name} Muon step times")
    timing = muon_timing()
    progress.advance()
    sweep_runs: dict[str, list[dict[str, Any]]] = {optimizer.name: [] for optimizer in sweeps}
    for index in range(max(len(optimizer.learning_rates) for optimizer in sweeps)):
        for optimizer in sweeps:
            if index < len(optimizer.learning_rates):
                lr = optimizer.learning_rates[index]
                progress.describe(f"{task.name} {optimizer.name} lr={lr:g}")
                sweep_runs[optimizer.name].append(train(optimizer.factory, lr, config.seed))
                progress.advance()
    seed_runs = {optimizer.name: [shared.best(task, sweep_runs[optimizer.name])] for optimizer in sweeps}
    for seed in range(config.seed + 1, config.seed + seeds):
        for optimizer in sweeps:
            progress.describe(f"{task.name} {optimizer.name} seed {seed}")
            seed_runs[optimizer.name].append(train(optimizer.factory, seed_runs[optimizer.name][0]["lr"], seed))
            progress.advance()
    per_step = {name: _seconds_per_step(runs) for name, runs in seed_runs.items()}
    return {"muon_timing": timing, "per_step": per_step, "sweep_runs": sweep_runs, "seed_runs": seed_runs}


def _outcome(task: Task, trained: dict[str, Any]) -> dict[str, Any]:
    """The goal (the best stock optimizer's median final metric) and each run's measured time to reach it."""
    worst = math.inf if task.reconstruct else -math.inf
    finals = {name: [shared.final(r, task.metric) for r in runs] for name, runs in trained["seed_runs"].items()}
    median_final = {name: _median_or_worst(values, worst) for name, values in finals.items()}
    stock = [name for name in STOCK if name in median_final]
    best_stock = (min if task.reconstruct else max)(stock, key=lambda n: median_final[n])
    goal = median_final[best_stock]
    reach: dict[str, dict[str, list[Any]]] = {}
    for name, runs in trained["seed_runs"].items():
        reach[name] = {"step": [], "measured_seconds": []}
        for run in runs:
            index = shared.first_step_reaching(task, run, goal) if math.isfinite(goal) else None
            reach[name]["step"].append(None if index is None else run["step"][index])
            reach[name]["measured_seconds"].append(math.inf if index is None else run["seconds"][index])
    time_to_goal = {name: shared.median(r["measured_seconds"]) for name, r in reach.items()}
    # The fastest stock optimizer to the goal; if none reaches it in most seeds, the one that set it.
    faster_stock = min(stock, key=lambda n: (time_to_goal[n], n != best_stock))
    candidates = [name for name in trained["seed_runs"] if name not in STOCK]
    best_candidate = min(candidates, key=time_to_goal.__getitem__)
    return {
        "finals": finals,
        "median_final": median_final,
        "best_stock": best_stock,
        "goal": goal,
        "reach": reach,
        "time_to_goal": time_to_goal,
        "faster_stock": faster_stock,
        "best_candidate": best_candidate,
        # With an even number of seeds the stock optimizer that set the goal (a median of two finals) may not reach
        # it in most seeds; an input-aware configuration that does is then faster than every stock one: 0.
        "ratio": 0.0
        if math.isfinite(time_to_goal[best_candidate]) and not math.isfinite(time_to_goal[faster_stock])
        else _ratio(time_to_goal[best_candidate], time_to_goal[faster_stock]),
    }


def _swept(sweeps: list[Sweep]) -> str:
    """``"SGD (momentum 0.9) 0.01, 0.03; AdamW ..."``: the learning rates of each sweep."""
    return "; ".join(f"{o.name} {', '.join(f'{lr:g}' for lr in o.learning_rates)}" for o in sweeps)


def _seconds(seconds: float) -> str:
    return format_seconds(seconds) if math.isfinite(seconds) else "never"


def _ratio(candidate: float, baseline: float) -> float | None:
    return candidate / baseline if math.isfinite(candidate) and math.isfinite(baseline) and baseline > 0 else None


def _versus(time_to_goal: float, baseline: float) -> str:
    """A table's ratio to the fastest stock optimizer's time; faster outright when that one never reaches the goal."""
    if math.isfinite(time_to_goal) and not math.isfinite(baseline):
        return "faster (it never does)"
    ratio = _ratio(time_to_goal, baseline)
    return "never" if ratio is None else f"{ratio:.2f}×"


def _describe(task: Task, steps: int, seeds: int) -> str:
    if isinstance(task, LanguageTask):
        return f"{task.name} ({task.description}), {seeds} seeds of {steps} steps"
    return f"digits {task.name} ({task.description}), {seeds} seeds of {steps} steps of batch {BATCH}"


def _table(task: Task, sweeps: list[Sweep], trained: dict[str, Any], outcome: dict[str, Any], steps: int) -> Table:
    baseline = outcome["time_to_goal"][outcome["faster_stock"]]
    adamw = trained["per_step"]["AdamW"]
    rows = []
    for optimizer in sweeps:
        name = optimizer.name
        runs, reach = trained["seed_runs"][name], outcome["reach"][name]
        reached = [s for s in reach["step"] if s is not None]
        per_step = trained["per_step"][name]
        rows.append(
            [
                name,
                f"{runs[0]['lr']:g}",
                f"{format_seconds(per_step)} ({per_step / adamw:.2f}×)",
                _spread(outcome["finals"][name], task.shown, math.inf if task.reconstruct else -math.inf),
                str(int(shared.median(reached))) if 2 * len(reached) > len(runs) else "never",
                _spread(reach["measured_seconds"], format_seconds),
                _versus(outcome["time_to_goal"][name], baseline),
                f"{len(reached)} of {len(runs)}",
            ]
        )
    return Table(
        f"{_describe(task, steps, len(runs))}: measured time to the goal {task.metric_name} "
        f"{task.shown(outcome['goal'])}, {outcome['best_stock']}'s final median",
        [
            "optimizer",
            "lr (chosen on seed 0)",
            "training step, measured in the runs (vs AdamW)",
            f"final {task.metric_name}: median (min–max)",
            "steps to goal (median)",
            "measured training time to goal: median (min–max)",
            f"vs {outcome['faster_stock']} (the fastest stock optimizer to the goal)",
            "seeds reaching goal",
        ],
        rows,
    )


def _muon_table(timings: dict[str, Timing]) -> Table:
    rows = []
    for workload, timing in timings.items():
        cells = [workload, format_seconds(timing.per_call("AdamW"))]
        for name in ("Muon", TORCH_MUON):
            cells.append(f"{format_seconds(timing.per_call(name))} ({timing.ratio(name, 'AdamW').median:.2f}×)")
        rows.append(cells)
    return Table(
        "Muon's training step: Newton–Schulz in float32 (trained above) and torch.optim.Muon as shipped (bfloat16)",
        ["workload", "AdamW", "Muon, float32 Newton–Schulz (vs AdamW)", f"{TORCH_MUON}, bfloat16 (vs AdamW)"],
        rows,
        "Interleaved training steps (zero_grad, forward, backward, step), the same recipe (Muon on the hidden 2-D "
        "weights, AdamW on the rest) on both implementations; median per-step time with its ratio to AdamW's in the "
        "same rounds (the GPT: a few single steps, the shipped Muon takes seconds). torch.optim.Muon runs its "
        "Newton–Schulz iteration in bfloat16, made for GPUs; a CPU without native bfloat16 matrix products "
        "emulates it, so its time here measures that emulation, not Muon. The training runs use the float32 "
        "variant (the same update, tested against torch.optim.Muon to bfloat16's precision in "
        "tests/test_baselines.py), the way a CPU user would run Muon.",
    )


def _eva_speedups(tasks: list[Task], data: dict[str, Any]) -> Table:
    """Eva's end-to-end speed-up (measured time to the goal) against SGD and K-FAC, as the Eva paper reports it."""
    rows = []
    for task in tasks:
        times = data[task.name]["time_to_goal"]
        if "Eva" not in times:
            continue
        cells = []
        for other in ("SGD (momentum 0.9)", "K-FAC"):
            speedup = _ratio(times[other], times["Eva"]) if math.isfinite(times["Eva"]) else None
            cells.append(
                "Eva never reaches the goal"
                if speedup is None and not math.isfinite(times["Eva"])
                else f"{other} never reaches it"
                if speedup is None
                else f"{speedup:.2f}×"
            )
        rows.append([task.name, _seconds(times["Eva"]), *cells])
    return Table(
        "Eva's speed-up: another optimizer's measured time to the goal over Eva's (median of the seeds)",
        ["workload", "Eva's time to goal", "vs SGD (momentum 0.9)", "vs K-FAC"],
        rows,
        "The Eva paper (Zhang et al., ICLR 2023) reports 2.05× against SGD and 2.42× against K-FAC end to end, on "
        "GPU-sized image models; above 1× Eva is faster. Same goals and runs as the tables above.",
    )


def _workload_target(task: Task, outcome: dict[str, Any], seeds: int, config: Config) -> Target:
    candidate, stock, times = outcome["best_candidate"], outcome["faster_stock"], outcome["time_to_goal"]
    return Target.at_most(
        f"Fastest input-aware configuration's measured time to the best stock optimizer's final {task.metric_name}, "
        f"{task.name}, {seeds} seeds",
        outcome["ratio"],
        LIMIT,
        f"× {stock}'s time",
        f"goal {task.shown(outcome['goal'])} ({outcome['best_stock']}'s median final {task.metric_name}); "
        f"fastest input-aware configuration {candidate}: median {_seconds(times[candidate])} against {stock}'s "
        f"{_seconds(times[stock])}, the fastest of {', '.join(STOCK)}; counted by the target below",
        source="informational",
    ).full_size_only(config)


def _shown_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "never"
    return "0× (no stock optimizer reaches the goal in most seeds)" if ratio == 0 else f"{ratio:.2f}×"


def _overall_target(outcomes: dict[str, dict[str, Any]], config: Config) -> Target:
    within = [name for name in JUDGED if (r := outcomes[name]["ratio"]) is not None and r <= LIMIT]
    shown = "; ".join(
        f"{name} {_shown_ratio(outcomes[name]['ratio'])} ({outcomes[name]['best_candidate']} vs "
        f"{outcomes[name]['faster_stock']})"
        for name in JUDGED
    )
    return Target.at_least(
        f"Workloads where an input-aware configuration reaches the best stock optimizer's result in ≤ {LIMIT:g}× "
        f"its measured time ({', '.join(JUDGED)})",
        float(len(within)),
        float(WORKLOADS_NEEDED),
        f"of {len(JUDGED)}",
        f"median measured training time to the goal, fastest input-aware configuration over the fastest stock one "
        f"(SGD with momentum, AdamW, Muon): {shown}",
    ).full_size_only(config)


def _caption(sweeps: list[Sweep], seeds: int, headline: bool = False) -> str:
    legend = "; ".join(f"{o.name}: {o.about}" for o in sweeps)
    rates = (
        "Each optimizer at the learning rate chosen for the workload (the best final validation metric of its sweep "
        "on seed 0; the tables give it), one colour per optimizer across the panels"
        if headline
        else "lr: the learning rate each optimizer was chosen at (the best final validation metric of its sweep on "
        "seed 0)"
    )
    return (
        f"{legend}. {rates}. Each line is the median over {seeds} seeds at that rate, against the median measured "
        f"training time (evaluations excluded) at each evaluation. {GOAL}: the best stock optimizer's median final "
        "metric (final: the mean over the last quarter of the evaluations). Training loss: the mean loss of the "
        f"training batches since the previous evaluation. Digits test metrics on {TEST_SIZE} held-out digits; the "
        f"GPT's validation loss (nats per byte) on {GPT_WINDOWS} fixed batches of held-out files."
    )


def _zoom(task: Task, goal: float) -> tuple[float, float] | None:
    if not math.isfinite(goal):
        return None
    if isinstance(task, LanguageTask):
        return (0.97 * goal, 1.15 * goal)
    if task.reconstruct:
        return (0.95 * goal, 1.3 * goal)
    return (100 * goal - 5, min(100.5, 100 * goal + 3))


def _series(trained: dict[str, Any], key: str, seconds: bool, rates: bool = True) -> list[Series]:
    """One line per optimizer, labelled with its chosen rate if ``rates`` (else its name alone: one colour
    per optimizer across panels whose rates differ)."""
    scale = 100.0 if key.endswith("accuracy") else 1.0
    out = []
    for name, runs in trained["seed_runs"].items():
        clock, values = _median_curve(runs, key, scale)
        longest = max(runs, key=lambda r: len(r["step"]))
        x = clock if seconds else [float(s) for s in longest["step"]]
        out.append(Series(f"{name} lr={runs[0]['lr']:g}" if rates else name, x, values))
    return out


def _unit(task: Task) -> str:
    return "loss (nats per byte)" if isinstance(task, LanguageTask) else "loss" if task.reconstruct else "%"


def _zoomed_panel(task: Task, trained: dict[str, Any], goal: float, title: str, rates: bool = True) -> Panel:
    series = _series(trained, task.metric, True, rates)
    last = max((x for s in series for x in s.x), default=0.0)
    goal_line = Series(GOAL, [0.0, last], [(1.0 if task.reconstruct else 100.0) * goal] * 2, "k--")
    return Panel(title, CLOCK, _unit(task), [*series, goal_line], ylim=_zoom(task, goal))


def _task_plot(task: Task, sweeps: list[Sweep], trained: dict[str, Any], outcome: dict[str, Any], seeds: int) -> Plot:
    train_unit = "loss (nats per byte)" if isinstance(task, LanguageTask) else "loss"
    return Plot(
        task.name.lower() if isinstance(task, LanguageTask) else f"digits-{task.name.lower()}",
        f"{_describe(task, task.steps, seeds)}: {', '.join(s.name for s in sweeps)}, median of {seeds} seeds",
        [
            Panel("training loss (batches)", "step", train_unit, _series(trained, "train_loss", False), logy=True),
            Panel("training loss (batches)", CLOCK, train_unit, _series(trained, "train_loss", True), logy=True),
            Panel(task.metric_name, CLOCK, _unit(task), _series(trained, task.metric, True)),
            _zoomed_panel(task, trained, outcome["goal"], f"{task.metric_name} near the goal (zoomed)"),
        ],
        caption=_caption(sweeps, seeds),
    )


def _runners(
    task: Task, config: Config
) -> tuple[int, Callable[[Factory, float, int], dict[str, Any]], Callable[[], Timing]]:
    """A workload's evaluation interval, its training run ``(factory, lr, seed)`` and its Muon step timing."""
    if isinstance(task, LanguageTask):
        language, every = task, config.pick(6, 4, 8)
        return (
            every,
            lambda factory, lr, seed: train_gpt(language, factory, lr, language.steps, every, seed),
            lambda: _gpt_muon_timing(language, config),
        )
    every, digits = config.pick(6, 10, 20), shared.load(config.seed, task.images)
    variants = {name: (factory, rules.TIMING_LR) for name, factory in _muon_variants().items()}
    return (
        every,
        lambda factory, lr, seed: shared.train(task, factory, lr, digits, task.steps, every, seed),
        lambda: shared.step_times(task, digits, BATCH, variants, config),
    )


def run(config: Config, progress: Progress) -> Result:
    seeds = config.pick(2, SEEDS)
    digit_sweeps = [
        *shared.baseline_sweeps(config, muon=True),
        *rules.candidate_sweeps(config),
        *rules.geometry_sweeps(config),
    ]
    workloads: list[tuple[Task, list[Sweep]]] = [(_gpt_task(config), _gpt_sweeps(config))]
    every = shared.tasks()
    for name in DIGITS_TASKS:
        steps = config.pick(12, every[name].steps, 2 * every[name].steps)
        workloads.append((dataclasses.replace(every[name], steps=steps), digit_sweeps))
    progress.start(sum(1 + sum(len(o.learning_rates) + seeds - 1 for o in sweeps) for _, sweeps in workloads))
    data: dict[str, Any] = {"batch": BATCH, "seeds": seeds, "test_size": TEST_SIZE, "gpt_windows": GPT_WINDOWS}
    tables, targets, plots, headline = [], [], [], []
    outcomes: dict[str, dict[str, Any]] = {}
    muon_timings: dict[str, Timing] = {}
    for task, sweeps in workloads:
        eval_every, train, timing = _runners(task, config)
        trained = _train_task(task, sweeps, config, progress, seeds, train, timing)
        outcome = outcomes[task.name] = _outcome(task, trained)
        muon_timings[task.name] = trained["muon_timing"]
        tables.append(_table(task, sweeps, trained, outcome, task.steps))
        targets.append(_workload_target(task, outcome, seeds, config))
        plots.append(_task_plot(task, sweeps, trained, outcome, seeds))
        headline.append(
            _zoomed_panel(
                task,
                trained,
                outcome["goal"],
                f"{task.name}: {task.metric_name.removeprefix('test ')}, zoomed",
                rates=False,
            )
        )
        data[task.name] = {
            "description": task.description,
            "steps": task.steps,
            "eval_every": eval_every,
            "metric": task.metric,
            "learning_rates": {o.name: list(o.learning_rates) for o in sweeps},
            "muon_step_timing": trained["muon_timing"].to_json(),
            "seconds_per_step": trained["per_step"],
            "sweep_runs": trained["sweep_runs"],
            "seed_runs": trained["seed_runs"],
            **outcome,
        }
    targets.append(_overall_target(outcomes, config))
    all_sweeps = list({s.name: s for _, sweeps in workloads for s in sweeps}.values())
    plots.insert(
        0,
        Plot(
            "time-to-goal",
            f"Measured training time to the best stock optimizer's final metric (median of {seeds} seeds)",
            headline,
            columns=3,
            headline=True,
            caption=_caption(all_sweeps, seeds, headline=True),
        ),
    )
    note = (
        "The goal is the best stock optimizer's (SGD's, AdamW's or Muon's) median final metric over the seeds; a "
        "run reaches it at its first evaluation at least as good, and its time to the goal is the run's own "
        "measured training time up to then: the wall-clock of its training steps, evaluations excluded, on a "
        "machine other processes may share (the optimizers take turns, so a change of load falls on all). The "
        "training step is the runs' measured seconds per step (statistics steps included). Medians over the seeds "
        "count a run that never reaches the goal as infinitely slow and a diverged run as the worst final value. "
        "Muon is the float32 variant (next table). "
        + "; ".join(f"{task.name}: learning rates swept on seed 0: {_swept(sweeps)}" for task, sweeps in workloads[:2])
        + f". Digits split 1097 train / 200 validation / {TEST_SIZE} test, the same for every seed (a seed sets the "
        "initialization and the batch order); the GPT's validation files are every tenth of the standard "
        "library's, and the rate is chosen on the same validation loss the goal is set on."
    )
    tables[len(workloads) - 1].note = note
    tables.append(_muon_table(muon_timings))
    tables.append(_eva_speedups([task for task, _ in workloads], data))
    return Result(tables=tables, targets=targets, plots=plots, data=data)


SECTION = Section(
    name="convergence",
    title="Time to result, measured: FOOF, K-FAC, Eva and the candidate geometries against SGD, AdamW and Muon",
    summary=(
        "Three workloads: a byte-level GPT on the standard library's sources (the realistic workload's small size, "
        f"1.9M parameters) at the scale section's realistic work per step ({MICRO_BATCHES} micro-batches of 8 × 128 "
        "tokens, their gradients accumulated), and on scikit-learn's digits a small CNN classifying and a deep Tanh "
        "autoencoder reconstructing the pixels (the classic workload of K-FAC and FOOF, where curvature matters; "
        "batches of 64 of a 1,097-image training set, where a step of 8 such batches would be half the data). The "
        "stock "
        "optimizers a user would pick today, SGD with momentum, AdamW and Muon (Muon on the hidden 2-D weights, "
        "AdamW on the rest), against the input-aware preconditioners on the schedule of the step-time sections "
        f"({rules.SCHEDULE}): on digits FOOF, K-FAC, Eva and FOOF in front of AdamW and of Muon; on the GPT FOOF, "
        "K-FAC and Eva in front of AdamW and FOOF in front of Muon; on all three the candidate geometries of "
        "docs/rules/candidates.md (Muon's step in the input-whitened metric, its two-sided form, Adam in the "
        "Kronecker factors' eigenbases), each at its defaults. Each sweeps its learning rate on seed 0; the rate "
        f"with the best final validation metric is then trained on {SEEDS} seeds. The goal is the best stock "
        "optimizer's median final metric; each configuration's time to it is measured: the wall-clock of its "
        "training steps up to the first evaluation that reaches it. The target: on at least "
        f"{WORKLOADS_NEEDED} of the {len(JUDGED)} workloads, an input-aware configuration reaches the goal in at "
        f"most {LIMIT:g}× the time of the fastest stock optimizer."
    ),
    run=run,
    estimate=(30, 4200),
)
