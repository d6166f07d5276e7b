"""Section: what Monitor and NonFiniteFinder cost on a small GPT's training step, against the same step without
them (a torch call's microseconds count at this size; the realistic size is the gpt section)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from inputaware_optim import InputAwareAdamW, Monitor, NonFiniteFinder

from ..core import Config, Progress, Result, Section, Table, Target, format_seconds
from ..models import training_step, workloads
from ..timing import Ratio, interleave

PLAIN, EVERY_STEP, EVERY_100, FINDER = (
    "no monitoring",
    "Monitor(every=1)",
    "Monitor(every=100)",
    "NonFiniteFinder",
)
DESCRIPTIONS = {
    PLAIN: "InputAwareAdamW with nothing reading its capture (no hook on the model): the baseline",
    EVERY_STEP: "input statistics of every module and parameter norms, logged at every step (to a callback)",
    EVERY_100: "the same, logged every 100 steps: the steps in between compute and keep nothing",
    FINDER: "a sum of each computing module's inputs, outputs and their gradients, one check per step",
}


def _records() -> list[dict[str, Any]]:
    return []


def run(config: Config, progress: Progress) -> Result:
    # Targets of 0.5-3 % under a shared CPU's pair-to-pair noise need more rounds than the default.
    config = dataclasses.replace(config, pairs=config.pick(config.pairs, max(config.pairs, 21)))
    workload = next(w for w in workloads(config) if w.name == "GPT")
    progress.start(1)
    progress.describe(workload.name)
    torch.manual_seed(config.seed)
    base = workload.build()
    models: dict[str, nn.Module] = {name: copy.deepcopy(base) for name in DESCRIPTIONS}
    optimizers = {name: InputAwareAdamW(model, lr=1e-4) for name, model in models.items()}
    logged: dict[str, list[dict[str, Any]]] = {EVERY_STEP: _records(), EVERY_100: _records()}
    monitors = [
        Monitor(optimizers[EVERY_STEP], every=1, callback=logged[EVERY_STEP].append),
        Monitor(optimizers[EVERY_100], every=100, callback=logged[EVERY_100].append),
    ]
    finder = NonFiniteFinder(optimizers[FINDER])
    timing = interleave(
        {name: training_step(models[name], optimizers[name], workload) for name in DESCRIPTIONS}, config
    )
    for monitor in monitors:
        monitor.remove()
    finder.remove()
    progress.advance()

    every_step = timing.ratio(EVERY_STEP, PLAIN)
    skipping = timing.ratio(EVERY_100, PLAIN)
    checking = timing.ratio(FINDER, PLAIN)
    # A timed sample of the every-100 variant holds a logged step only now and then: its ratio is
    # that of the steps in between. One step in a hundred costs what every-step logging does.
    amortized = Ratio.of([(99 * s + e) / 100 for s, e in zip(skipping.rounds, every_step.rounds, strict=True)])
    rows = [
        [
            name,
            DESCRIPTIONS[name],
            format_seconds(timing.per_call(name)),
            "1" if name == PLAIN else timing.ratio(name, PLAIN).shown(),
        ]
        for name in DESCRIPTIONS
    ]
    rows.append([f"{EVERY_100}, amortized", "(99 × steps in between + 1 × logged step) / 100", "", amortized.shown()])
    statistics = logged[EVERY_STEP][-1] if logged[EVERY_STEP] else {"modules": {}, "parameters": {}}
    targets = [
        Target.at_most(
            f"Monitor every step, small {workload.name} training step",
            every_step.median,
            1.05,
            "×",
            f"pairs {every_step.low:.3f}–{every_step.high:.3f}",
        ).full_size_only(config),
        Target.at_most(
            f"Monitor every 100 steps, small {workload.name} training step",
            amortized.median,
            1.005,
            "×",
            f"99 steps in between ({skipping.median:.3f}×) and one logged step ({every_step.median:.3f}×)",
        ).full_size_only(config),
        Target.at_most(
            f"NonFiniteFinder left on, small {workload.name} training step",
            checking.median,
            1.02,
            "×",
            f"pairs {checking.low:.3f}–{checking.high:.3f}",
        ).full_size_only(config),
    ]
    return Result(
        tables=[
            Table(
                f"Training step with monitoring / without, {workload.description}, InputAwareAdamW",
                ["variant", "what runs", "step", "ratio to no monitoring"],
                rows,
                f"{len(statistics['modules'])} modules and {len(statistics['parameters'])} parameters logged per "
                "step. Four copies of the model with the same weights train on the same batch, in turn.",
            )
        ],
        targets=targets,
        data={
            "workload": workload.description,
            "ratios": {
                EVERY_STEP: every_step.__dict__,
                EVERY_100: skipping.__dict__,
                f"{EVERY_100}, amortized": amortized.__dict__,
                FINDER: checking.__dict__,
            },
            "logged_steps": {name: len(records) for name, records in logged.items()},
            "timing": timing.to_json(),
        },
    )


SECTION = Section(
    name="monitor",
    title="Monitoring and the non-finite finder: training step vs none",
    summary=(
        "`Monitor` (input statistics of every module from the hooks, gradient and update norms of every "
        "parameter) logged every step and every 100 steps, and `NonFiniteFinder` left on, each on its own "
        "copy of the GPT model, against the same training with nothing reading the capture. The every-100 "
        "figure combines the measured cost of the steps in between (nothing is computed there) with one "
        "logged step in a hundred.\n\n"
        "Where a logged step's cost comes from, on CPU: the capture's hooks running a reduction at all "
        "(a forward hook and an output-gradient pre-hook per call, a commit per backward pass), five "
        "passes over every distinct module input (sum, sum of squares, zeros on the integer view, the "
        "-0.0 check, smallest and largest value in one `aminmax`; a container's input that is its child's "
        "is summarised once), and per parameter the norms of the gradient, the weight and the update, the "
        "last from a copy of the parameters kept between logged steps. The finder hooks only the modules "
        "that compute (no containers), sums each new tensor once in its own dtype (inputs that are another "
        "module's output are not summed again) and each gradient once."
    ),
    run=run,
    estimate=(0.5, 180),
)
