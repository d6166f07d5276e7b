"""Training on scikit-learn's digits, shared by the FOOF and K-FAC sections.

The data split, the two models, one training run with its evaluation history, the
learning-rate sweeps of the stock baselines, picking the best run, interleaved training-step
times and the convergence plot (against steps, and against seconds = steps × step time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from .core import Config, Panel, Plot, Progress, Series, format_seconds
from .models import SmallCNN, mlp
from .timing import Timing, interleave

__all__ = [
    "BATCH",
    "CONVERGENCE_COLUMNS",
    "TEST_SIZE",
    "VALIDATION_SIZE",
    "Convergence",
    "Digits",
    "Factory",
    "Sweep",
    "at_step",
    "baseline_sweeps",
    "best",
    "converge",
    "convergence_plot",
    "first_step_reaching",
    "load",
    "models",
    "plateau",
    "step_times",
    "sweep",
    "sweeps_swept",
    "train",
]

BATCH = 64
VALIDATION_SIZE, TEST_SIZE = 200, 500
GOAL_LABEL = "AdamW's final accuracy"

Factory = Callable[[nn.Module, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class Sweep:
    """An optimizer and the learning rates it is trained with (the best run is kept)."""

    name: str
    factory: Factory
    learning_rates: tuple[float, ...]
    about: str = ""  # what the name stands for, for a plot's caption


def sweep(config: Config, values: tuple[float, ...]) -> tuple[float, ...]:
    """The learning rates of a sweep for this run's size: the middle two under ``--quick``."""
    return config.pick(values[1:3], values)


def baseline_sweeps(config: Config) -> list[Sweep]:
    """SGD with momentum and AdamW, each with its learning-rate sweep."""
    return [
        Sweep(
            "SGD (momentum 0.9)",
            lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            sweep(config, (0.01, 0.03, 0.1, 0.3)),
            "torch.optim.SGD with momentum 0.9",
        ),
        Sweep(
            "AdamW",
            lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr),
            sweep(config, (3e-4, 1e-3, 3e-3, 1e-2)),
            "torch.optim.AdamW with its defaults",
        ),
    ]


@dataclass(frozen=True)
class Digits:
    """The three splits, each ``(inputs, labels)``."""

    train: tuple[Tensor, Tensor]
    validation: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]


def load(seed: int, images: bool) -> Digits:
    """scikit-learn's 1,797 8x8 digits (shipped with the package), scaled to [0, 1], split 1097/200/500."""
    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all, dtype=torch.float32) / 16
    y = torch.tensor(y_all, dtype=torch.long)
    if images:
        x = x.reshape(-1, 1, 8, 8)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    parts = order[: -VALIDATION_SIZE - TEST_SIZE], order[-VALIDATION_SIZE - TEST_SIZE : -TEST_SIZE], order[-TEST_SIZE:]
    train_split, validation, test = ((x[p], y[p]) for p in parts)
    return Digits(train_split, validation, test)


def models() -> dict[str, tuple[Callable[[], nn.Module], bool, str]]:
    """By name: a builder, whether it takes 8x8 images (else flat vectors), and a description."""
    return {
        "MLP": (lambda: mlp(64, 128, 10), False, "MLP 64-128-128-10 (ReLU)"),
        "CNN": (lambda: SmallCNN(1, 8, (16, 32), 64), True, "CNN conv3-16, conv3-32 (ReLU, max-pool), Linear-64-10"),
    }


@torch.no_grad()
def _evaluate(model: nn.Module, data: tuple[Tensor, Tensor]) -> tuple[float, float]:
    logits = model(data[0])
    return float(F.cross_entropy(logits, data[1])), float((logits.argmax(1) == data[1]).float().mean())


def train(
    build: Callable[[], nn.Module], factory: Factory, lr: float, digits: Digits, steps: int, eval_every: int, seed: int
) -> dict[str, Any]:
    """``steps`` steps of batch ``BATCH``; losses and accuracies every ``eval_every`` steps.

    A step that raises ``RuntimeError`` (a rule refusing statistics that are no longer finite and
    positive definite, for example K-FAC asking for more damping) or a non-finite loss ends the
    run as diverged.
    """
    torch.manual_seed(seed)
    model = build()
    optimizer = factory(model, lr)
    order = torch.Generator().manual_seed(seed)
    x, y = digits.train
    history: dict[str, list[float]] = {
        key: []
        for key in ("step", "train_loss", "validation_loss", "validation_accuracy", "test_loss", "test_accuracy")
    }

    def record(step: int) -> None:
        history["step"].append(step)
        history["train_loss"].append(_evaluate(model, digits.train)[0])
        for split in ("validation", "test"):
            loss, accuracy = _evaluate(model, getattr(digits, split))
            history[f"{split}_loss"].append(loss)
            history[f"{split}_accuracy"].append(accuracy)

    record(0)
    seconds, step, diverged = 0.0, 0, False
    batches: list[Tensor] = []
    while step < steps and not diverged:
        if not batches:
            batches = list(torch.randperm(len(y), generator=order).split(BATCH))[: len(y) // BATCH]
        index = batches.pop(0)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        try:
            optimizer.step()
        except RuntimeError:  # FOOF and K-FAC refuse statistics that are no longer finite and positive definite
            diverged = True
        seconds += time.perf_counter() - start
        step += 1
        diverged = diverged or not math.isfinite(float(loss.detach()))
        if step % eval_every == 0 or step == steps or diverged:
            record(step)
    return {"lr": lr, "diverged": diverged, "measured_training_seconds": seconds, **history}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the best final validation accuracy (then the lowest validation loss)."""

    def score(run: dict[str, Any]) -> tuple[float, float]:
        loss = run["validation_loss"][-1]
        return (run["validation_accuracy"][-1], -loss if math.isfinite(loss) else -math.inf)

    return max((r for r in runs if not r["diverged"]), key=score, default=runs[0])


def at_step(step: int | None) -> str:
    """``"at step 80"``, or ``"never"``."""
    return "never" if step is None else f"at step {step}"


def plateau(accuracies: list[float]) -> float:
    """The final accuracy of a run: the mean over its last quarter of evaluations (one test sample is 0.2%)."""
    last = accuracies[-max(1, len(accuracies) // 4) :]
    return sum(last) / len(last)


def first_step_reaching(run: dict[str, Any], accuracy: float) -> int | None:
    """The first evaluated step whose test accuracy is at least ``accuracy`` (``None`` if none)."""
    for step, reached in zip(run["step"], run["test_accuracy"], strict=True):
        if reached >= accuracy:
            return step
    return None


def step_times(
    build: Callable[[], nn.Module],
    digits: Digits,
    batch: int,
    variants: Mapping[str, tuple[Factory, float]],
    config: Config,
    multiple_of: Mapping[str, int] | None = None,
) -> Timing:
    """Interleaved training-step times (zero_grad, forward, backward, step) of each optimizer.

    Args:
        variants: By name, the optimizer's factory and the learning rate it is timed at; each
            gets its own model built from the same seed.
        multiple_of: Round a variant's calls per sample to a multiple of this (its ``update_every``).
    """
    x, y = digits.train[0][:batch], digits.train[1][:batch]

    def step_of(factory: Factory, lr: float) -> Callable[[], None]:
        torch.manual_seed(config.seed)
        model = build()
        optimizer = factory(model, lr)

        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        return step

    calls = {name: step_of(factory, lr) for name, (factory, lr) in variants.items()}
    return interleave(calls, config, multiple_of=multiple_of)


def convergence_plot(
    subject: str,
    model: str,
    description: str,
    sweeps: list[Sweep],
    best_runs: dict[str, dict[str, Any]],
    per_step: dict[str, float],
    headline: bool,
    goal: float,
) -> Plot:
    """Training loss and test accuracy of each optimizer's best run, against steps and against estimated seconds.

    Args:
        subject: What the plot is about, first in its title ("FOOF", "K-FAC").
        goal: AdamW's final test accuracy (a fraction): the last panel zooms in around it, where
            "time to AdamW's accuracy" is read.
    """
    seconds_label = "estimated seconds (steps × step time)"

    def series(key: str, seconds: bool) -> list[Series]:
        return [
            Series(
                f"{name} lr={run['lr']:g}",
                [s * per_step[name] if seconds else s for s in run["step"]],
                run[key] if key != "test_accuracy" else [100 * a for a in run[key]],
            )
            for name, run in best_runs.items()
        ]

    legend = "; ".join(f"{o.name}: {o.about}" for o in sweeps if o.about)
    last = max(run["step"][-1] * per_step[name] for name, run in best_runs.items())
    return Plot(
        f"digits-{model.lower()}",
        f"{subject} on digits, {description}: best learning rate of each optimizer",
        [
            Panel("training loss", "step", "loss", series("train_loss", False), logy=True),
            Panel("training loss", seconds_label, "loss", series("train_loss", True), logy=True),
            Panel("test accuracy", "step", "%", series("test_accuracy", False)),
            Panel("test accuracy", seconds_label, "%", series("test_accuracy", True)),
            Panel(
                "test accuracy near AdamW's final accuracy (zoomed)",
                seconds_label,
                "%",
                [*series("test_accuracy", True), Series(GOAL_LABEL, [0.0, last], [100 * goal] * 2, "k--")],
                ylim=(100 * goal - 5, min(100.0, 100 * goal + 3)),
            ),
        ],
        headline=headline,
        caption=(
            f"{legend}. lr: the learning rate of the optimizer's best run in its sweep (by final validation "
            f"accuracy). {GOAL_LABEL}: the mean test accuracy over the last quarter of AdamW's best run; the "
            "zoomed panel shows when each optimizer reaches it. Estimated seconds: steps × the optimizer's "
            "median training-step time from the interleaved timing, an estimate, not the training runs' own "
            "wall-clock. Test accuracy on "
            f"{TEST_SIZE} held-out digits (one digit is {100 / TEST_SIZE:.1f}%)."
        ),
    )


CONVERGENCE_COLUMNS = [
    "model",
    "optimizer",
    "best lr",
    "final train loss",
    "final test loss",
    "final test accuracy",
    "steps to AdamW's accuracy",
    "time to AdamW's accuracy",
]


@dataclass
class Convergence:
    """Every run of every sweep on one model, the best of each, and when each best reaches AdamW's accuracy.

    Attributes:
        runs: By optimizer, one training history per learning rate.
        best: By optimizer, its best run.
        goal: AdamW's final test accuracy (the plateau of its best run).
        reach: By optimizer, the first evaluated ``step`` at which its best run reaches ``goal`` and the
            ``seconds`` that is at its interleaved step time (both ``None`` if never).
    """

    runs: dict[str, list[dict[str, Any]]]
    best: dict[str, dict[str, Any]]
    goal: float
    reach: dict[str, dict[str, Any]]

    def rows(self, model: str) -> list[list[str]]:
        """The rows of the convergence table (``CONVERGENCE_COLUMNS``) for this model."""
        rows = []
        for name, chosen in self.best.items():
            reached, seconds = self.reach[name]["step"], self.reach[name]["seconds"]
            rows.append(
                [
                    model,
                    name,
                    f"{chosen['lr']:g}",
                    f"{chosen['train_loss'][-1]:.4f}",
                    f"{chosen['test_loss'][-1]:.4f}",
                    f"{100 * chosen['test_accuracy'][-1]:.1f}%",
                    "never" if reached is None else str(reached),
                    "never" if seconds is None else format_seconds(seconds),
                ]
            )
        return rows


def converge(
    build: Callable[[], nn.Module],
    digits: Digits,
    sweeps: list[Sweep],
    per_step: Mapping[str, float],
    steps: int,
    eval_every: int,
    config: Config,
    progress: Progress,
    model: str,
) -> Convergence:
    """Train every learning rate of every sweep (one progress unit each); ``per_step`` gives the seconds."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for optimizer in sweeps:
        runs[optimizer.name] = []
        for lr in optimizer.learning_rates:
            progress.describe(f"{model} {optimizer.name} lr={lr:g}")
            runs[optimizer.name].append(train(build, optimizer.factory, lr, digits, steps, eval_every, config.seed))
            progress.advance()
    best_runs = {name: best(candidates) for name, candidates in runs.items()}
    goal = plateau(best_runs["AdamW"]["test_accuracy"])
    reach: dict[str, dict[str, Any]] = {}
    for name, chosen in best_runs.items():
        reached = first_step_reaching(chosen, goal)
        reach[name] = {"step": reached, "seconds": None if reached is None else reached * per_step[name]}
    return Convergence(runs, best_runs, goal, reach)


def sweeps_swept(sweeps: list[Sweep]) -> str:
    """``"SGD (momentum 0.9) 0.01, 0.03; AdamW ..."``: the learning rates of each sweep, for a table note."""
    return "; ".join(f"{o.name} {', '.join(f'{lr:g}' for lr in o.learning_rates)}" for o in sweeps)
