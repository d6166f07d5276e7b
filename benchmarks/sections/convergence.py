"""Section: FOOF, K-FAC and Eva against SGD and AdamW on digits: time to the best stock optimizer's final metric."""

from __future__ import annotations

import math
from typing import Any

from .. import digits as shared
from .. import rules
from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..digits import BATCH, TEST_SIZE, Sweep, Task

SEEDS = 5
LIMIT = 0.8  # the best rule's time to the goal, in units of the faster stock optimizer's
STOCK = ("SGD (momentum 0.9)", "AdamW")
GOAL = "goal"
ESTIMATE = "estimated seconds (steps × step time)"


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


def _median_curve(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float | None]]:
    """The evaluation steps and, at each, the median of ``key`` over the runs (None where most have diverged)."""
    longest = max(runs, key=lambda r: len(r["step"]))
    values: list[float | None] = []
    for index in range(len(longest["step"])):
        here = [r[key][index] for r in runs if index < len(r[key]) and math.isfinite(r[key][index])]
        values.append(scale * shared.median(here) if 2 * len(here) > len(runs) else None)
    return longest["step"], values


def _train_task(
    task: Task, sweeps: list[Sweep], config: Config, progress: Progress, steps: int, eval_every: int, seeds: int
) -> dict[str, Any]:
    """Step times, the learning-rate sweep on the first seed, then every seed at the chosen rate."""
    digits = shared.load(config.seed, task.images)
    progress.describe(f"{task.name} step times")
    timing = shared.step_times(
        task,
        digits,
        BATCH,
        {s.name: (s.factory, rules.TIMING_LR) for s in sweeps},
        config,
        multiple_of={s.name: rules.STATISTICS_EVERY for s in sweeps if s.name not in STOCK},
    )
    progress.advance()
    ratios = {name: timing.ratio(name, "AdamW") for name in timing.seconds}
    per_step = {name: timing.per_call("AdamW") * ratio.median for name, ratio in ratios.items()}
    sweep_runs: dict[str, list[dict[str, Any]]] = {}
    seed_runs: dict[str, list[dict[str, Any]]] = {}
    for optimizer in sweeps:
        sweep_runs[optimizer.name] = []
        for lr in optimizer.learning_rates:
            progress.describe(f"{task.name} {optimizer.name} lr={lr:g}")
            run = shared.train(task, optimizer.factory, lr, digits, steps, eval_every, config.seed)
            sweep_runs[optimizer.name].append(run)
            progress.advance()
        chosen = shared.best(task, sweep_runs[optimizer.name])
        seed_runs[optimizer.name] = [chosen]
        for seed in range(config.seed + 1, config.seed + seeds):
            progress.describe(f"{task.name} {optimizer.name} seed {seed}")
            seed_runs[optimizer.name].append(
                shared.train(task, optimizer.factory, chosen["lr"], digits, steps, eval_every, seed)
            )
            progress.advance()
    return {"timing": timing, "ratios": ratios, "per_step": per_step, "sweep_runs": sweep_runs, "seed_runs": seed_runs}


def _outcome(task: Task, trained: dict[str, Any]) -> dict[str, Any]:
    """The goal (the best stock optimizer's median final test metric) and each run's time to reach it."""
    worst = math.inf if task.reconstruct else -math.inf
    finals = {name: [shared.final(r, task.metric) for r in runs] for name, runs in trained["seed_runs"].items()}
    median_final = {name: _median_or_worst(values, worst) for name, values in finals.items()}
    best_stock = (min if task.reconstruct else max)(STOCK, key=lambda n: median_final[n])
    goal = median_final[best_stock]
    reach: dict[str, dict[str, list[Any]]] = {}
    for name, runs in trained["seed_runs"].items():
        reach[name] = {"step": [], "estimated_seconds": [], "measured_seconds": []}
        for run in runs:
            index = shared.first_step_reaching(task, run, goal) if math.isfinite(goal) else None
            step = None if index is None else run["step"][index]
            reach[name]["step"].append(step)
            reach[name]["estimated_seconds"].append(math.inf if step is None else step * trained["per_step"][name])
            reach[name]["measured_seconds"].append(math.inf if index is None else run["seconds"][index])
    time_to_goal = {name: shared.median(r["estimated_seconds"]) for name, r in reach.items()}
    # The faster stock optimizer to the goal; if neither reaches it in most seeds, the one that set it.
    faster_stock = min(STOCK, key=lambda n: (time_to_goal[n], n != best_stock))
    candidates = [name for name in trained["seed_runs"] if name not in STOCK]
    best_candidate = min(candidates, key=time_to_goal.__getitem__)
    return {
        "finals": finals,
        "median_final": median_final,
        "best_stock": best_stock,
        "goal": goal,
        "reach": reach,
        "time_to_goal": time_to_goal,
        "measured_time_to_goal": {name: shared.median(r["measured_seconds"]) for name, r in reach.items()},
        "faster_stock": faster_stock,
        "best_candidate": best_candidate,
    }


def _swept(sweeps: list[Sweep]) -> str:
    """``"SGD (momentum 0.9) 0.01, 0.03; AdamW ..."``: the learning rates of each sweep."""
    return "; ".join(f"{o.name} {', '.join(f'{lr:g}' for lr in o.learning_rates)}" for o in sweeps)


def _seconds(seconds: float) -> str:
    return format_seconds(seconds) if math.isfinite(seconds) else "never"


def _ratio(candidate: float, baseline: float) -> float | None:
    return candidate / baseline if math.isfinite(candidate) and math.isfinite(baseline) and baseline > 0 else None


def _table(task: Task, sweeps: list[Sweep], trained: dict[str, Any], outcome: dict[str, Any], steps: int) -> Table:
    baseline = outcome["time_to_goal"][outcome["faster_stock"]]
    rows = []
    for optimizer in sweeps:
        name = optimizer.name
        runs, reach = trained["seed_runs"][name], outcome["reach"][name]
        ratio = _ratio(outcome["time_to_goal"][name], baseline)
        reached = [s for s in reach["step"] if s is not None]
        rows.append(
            [
                name,
                f"{runs[0]['lr']:g}",
                f"{format_seconds(trained['per_step'][name])} ({trained['ratios'][name].median:.2f}×)",
                _spread(outcome["finals"][name], task.shown, math.inf if task.reconstruct else -math.inf),
                str(int(shared.median(reached))) if 2 * len(reached) > len(runs) else "never",
                _spread(reach["estimated_seconds"], format_seconds),
                "never" if ratio is None else f"{ratio:.2f}×",
                _spread(reach["measured_seconds"], format_seconds),
                f"{len(reached)} of {len(runs)}",
            ]
        )
    return Table(
        f"digits {task.name} ({task.description}): time to the goal {task.metric_name} "
        f"{task.shown(outcome['goal'])}, {outcome['best_stock']}'s final median, {len(runs)} seeds of {steps} "
        f"steps of batch {BATCH}",
        [
            "optimizer",
            "lr (chosen on seed 0)",
            "step time (vs AdamW)",
            f"final {task.metric_name}: median (min–max)",
            "steps to goal (median)",
            "time to goal, estimate: median (min–max)",
            f"vs {outcome['faster_stock']} (the faster stock optimizer)",
            "measured wall-clock to goal: median (min–max)",
            "seeds reaching goal",
        ],
        rows,
    )


def _eva_speedups(tasks: dict[str, Task], data: dict[str, Any]) -> Table:
    """Eva's end-to-end speed-up (time to the goal) against SGD and K-FAC, as the Eva paper reports it."""
    rows = []
    for task in tasks.values():
        times = data[task.name]["time_to_goal"]
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
        "Eva's speed-up: another optimizer's time to the goal over Eva's (median of the seeds, estimate)",
        ["workload", "Eva's time to goal", "vs SGD (momentum 0.9)", "vs K-FAC"],
        rows,
        "The Eva paper (Zhang et al., ICLR 2023) reports 2.05× against SGD and 2.42× against K-FAC end to end, on "
        "GPU-sized image models; above 1× Eva is faster. Same goals and step times as the tables above.",
    )


def _target(task: Task, outcome: dict[str, Any], seeds: int, config: Config) -> Target:
    candidate, stock = outcome["best_candidate"], outcome["faster_stock"]
    times, measured = outcome["time_to_goal"], outcome["measured_time_to_goal"]
    ratio = _ratio(times[candidate], times[stock])
    measured_ratio = _ratio(measured[candidate], measured[stock])
    return Target.at_most(
        f"Best input-aware preconditioner's time to the best stock optimizer's final {task.metric_name}, digits "
        f"{task.name}, {seeds} seeds",
        ratio,
        LIMIT,
        f"× {stock}'s time",
        f"goal {task.shown(outcome['goal'])} ({outcome['best_stock']}'s median final {task.metric_name}); "
        f"fastest rule {candidate}: median {_seconds(times[candidate])} (estimate) against {stock}'s "
        f"{_seconds(times[stock])}, the faster of SGD and AdamW; measured wall-clock ratio "
        + ("never" if measured_ratio is None else f"{measured_ratio:.2f}×"),
        strict=True,
    ).full_size_only(config)


def _caption(task: Task | None, sweeps: list[Sweep], seeds: int) -> str:
    legend = "; ".join(f"{o.name}: {o.about}" for o in sweeps)
    metric = "test reconstruction loss or test accuracy" if task is None else task.metric_name
    return (
        f"{legend}. lr: the learning rate each optimizer was chosen at (the best final validation metric of its "
        f"sweep on seed 0). Each line is the median over {seeds} seeds at that rate. {GOAL}: the best stock "
        f"optimizer's median final {metric} (final: the mean over the last quarter of the evaluations). "
        f"{ESTIMATE.capitalize()}: each evaluated step times the optimizer's median training-step time from the "
        "interleaved timing, an estimate, not the runs' own wall-clock (the table has both). Training loss: the "
        "mean loss of the training batches since the previous evaluation. Test metrics on "
        f"{TEST_SIZE} held-out digits (for accuracy, one digit is {100 / TEST_SIZE:.1f}%)."
    )


def _zoom(task: Task, goal: float) -> tuple[float, float] | None:
    if not math.isfinite(goal):
        return None
    if task.reconstruct:
        return (0.95 * goal, 1.3 * goal)
    return (100 * goal - 5, min(100.5, 100 * goal + 3))


def _series(task: Task, trained: dict[str, Any], key: str, seconds: bool) -> list[Series]:
    scale = 100.0 if key.endswith("accuracy") else 1.0
    out = []
    for name, runs in trained["seed_runs"].items():
        steps, values = _median_curve(runs, key, scale)
        x = [s * trained["per_step"][name] if seconds else float(s) for s in steps]
        out.append(Series(f"{name} lr={runs[0]['lr']:g}", x, values))
    return out


def _goal_series(task: Task, trained: dict[str, Any], goal: float) -> Series:
    last = max(run["step"][-1] * trained["per_step"][name] for name, run in _firsts(trained))
    return Series(GOAL, [0.0, last], [(1.0 if task.reconstruct else 100.0) * goal] * 2, "k--")


def _firsts(trained: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, runs[0]) for name, runs in trained["seed_runs"].items()]


def _zoomed_panel(task: Task, trained: dict[str, Any], goal: float, title: str) -> Panel:
    unit = "loss" if task.reconstruct else "%"
    return Panel(
        title,
        ESTIMATE,
        unit,
        [*_series(task, trained, task.metric, True), _goal_series(task, trained, goal)],
        ylim=_zoom(task, goal),
    )


def _task_plot(task: Task, sweeps: list[Sweep], trained: dict[str, Any], outcome: dict[str, Any], seeds: int) -> Plot:
    unit = "loss" if task.reconstruct else "%"
    return Plot(
        f"digits-{task.name.lower()}",
        f"digits {task.name}, {task.description}: FOOF, FOOF on AdamW, K-FAC, Eva, SGD and AdamW, "
        f"median of {seeds} seeds",
        [
            Panel("training loss (batches)", "step", "loss", _series(task, trained, "train_loss", False), logy=True),
            Panel("training loss (batches)", ESTIMATE, "loss", _series(task, trained, "train_loss", True), logy=True),
            Panel(task.metric_name, ESTIMATE, unit, _series(task, trained, task.metric, True)),
            _zoomed_panel(task, trained, outcome["goal"], f"{task.metric_name} near the goal (zoomed)"),
        ],
        caption=_caption(task, sweeps, seeds),
    )


def run(config: Config, progress: Progress) -> Result:
    sweeps = [*shared.baseline_sweeps(config), *rules.candidate_sweeps(config)]
    tasks = shared.tasks()
    seeds = config.pick(2, SEEDS)
    eval_every = config.pick(6, 10, 20)
    progress.start(len(tasks) * (1 + sum(len(o.learning_rates) + seeds - 1 for o in sweeps)))
    data: dict[str, Any] = {"batch": BATCH, "seeds": seeds, "eval_every": eval_every, "test_size": TEST_SIZE}
    tables, targets, plots, headline = [], [], [], []
    for task in tasks.values():
        steps = config.pick(12, task.steps, 2 * task.steps)
        trained = _train_task(task, sweeps, config, progress, steps, eval_every, seeds)
        outcome = _outcome(task, trained)
        tables.append(_table(task, sweeps, trained, outcome, steps))
        targets.append(_target(task, outcome, seeds, config))
        plots.append(_task_plot(task, sweeps, trained, outcome, seeds))
        headline.append(
            _zoomed_panel(
                task, trained, outcome["goal"], f"{task.name}: {task.metric_name.removeprefix('test ')}, zoomed"
            )
        )
        data[task.name] = {
            "description": task.description,
            "steps": steps,
            "metric": task.metric,
            "step_timing": trained["timing"].to_json(),
            "ratios_vs_adamw": {name: ratio.__dict__ for name, ratio in trained["ratios"].items()},
            "seconds_per_step": trained["per_step"],
            "sweep_runs": trained["sweep_runs"],
            "seed_runs": trained["seed_runs"],
            **outcome,
        }
    plots.insert(
        0,
        Plot(
            "time-to-goal",
            f"Time to the best stock optimizer's final test metric on digits (median of {seeds} seeds; x: estimate)",
            headline,
            columns=3,
            headline=True,
            caption=_caption(None, sweeps, seeds),
        ),
    )
    tables.append(_eva_speedups(tasks, data))
    tables[-2].note = (
        "The goal is the better stock optimizer's (SGD's or AdamW's) median final test metric over the seeds; "
        "a run reaches it at its first evaluation at least as good. Time to goal, estimate: the step it is reached "
        "at × the optimizer's median step time from the interleaved timing (its ratio to AdamW's in brackets in "
        "the step-time column, so every clock comes from one moment); measured wall-clock: the run's own training "
        "steps up to then (evaluations excluded), noisier on a shared machine. Medians over the seeds count a "
        "run that never reaches the goal as infinitely slow and a diverged run as the worst final value. "
        f"Learning rates swept on seed 0: {_swept(sweeps)}. "
        f"Digits split 1097 train / 200 validation / {TEST_SIZE} test, the same for every seed (a seed sets "
        "the initialization and the batch order)."
    )
    return Result(tables=tables, targets=targets, plots=plots, data=data)


SECTION = Section(
    name="convergence",
    title="Time to accuracy: FOOF, K-FAC and Eva against the best stock optimizer on digits",
    summary=(
        "Three workloads on scikit-learn's digits: an MLP and a small CNN classifying, and a deep Tanh "
        "autoencoder reconstructing the pixels (the classic workload of K-FAC and FOOF, where curvature "
        "matters). SGD with momentum and AdamW, and the input-aware preconditioners FOOF, K-FAC, Eva and FOOF "
        f"in front of AdamW on the schedule of the step-time sections ({rules.SCHEDULE}), each sweep their "
        f"learning rate on seed 0; the rate with the best final validation metric is then trained on {SEEDS} "
        "seeds. The goal is the better stock optimizer's median final test metric; each optimizer's time to "
        "it is steps × its interleaved step time (an estimate; the runs' measured wall-clock is reported too). "
        f"The target: the fastest preconditioner reaches the goal in under {LIMIT:g}× the time of the faster "
        "of SGD and AdamW."
    ),
    run=run,
    estimate=(4, 220),
)
