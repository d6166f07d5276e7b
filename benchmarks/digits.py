"""Training on scikit-learn's digits, shared by the FOOF, K-FAC and convergence sections.

The data split, the three workloads (an MLP and a small CNN classifying, a deep autoencoder
reconstructing), one training run with its evaluation history, the learning-rate sweeps of the
stock baselines, picking a learning rate by validation, and interleaved training-step times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from . import baselines
from .core import Config
from .models import SmallCNN, autoencoder, mlp
from .timing import Timing, interleave

__all__ = [
    "AUTOENCODER_WIDTHS",
    "BATCH",
    "TEST_SIZE",
    "VALIDATION_SIZE",
    "Digits",
    "Factory",
    "Sweep",
    "Task",
    "baseline_sweeps",
    "best",
    "final",
    "first_step_reaching",
    "load",
    "median",
    "models",
    "step_times",
    "sweep",
    "tasks",
    "train",
]

BATCH = 64
VALIDATION_SIZE, TEST_SIZE = 200, 500
AUTOENCODER_WIDTHS = (64, 128, 64, 32, 16, 32, 64, 128, 64)

Factory = Callable[[nn.Module, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class Sweep:
    """An optimizer and the learning rates it is trained with (the one chosen by validation is kept)."""

    name: str
    factory: Factory
    learning_rates: tuple[float, ...]
    about: str = ""  # what the name stands for, for a plot's caption


def sweep(config: Config, values: tuple[float, ...]) -> tuple[float, ...]:
    """The learning rates of a sweep for this run's size: the middle two under ``--quick``."""
    return config.pick(values[1:3], values)


def baseline_sweeps(config: Config, *, muon: bool = False) -> list[Sweep]:
    """SGD with momentum and AdamW (and with ``muon``, Muon as ``baselines.muon``), each with its learning-rate sweep.

    Muon's rate is AdamW's (its update is scaled to AdamW's RMS), so it sweeps AdamW's values.
    """
    adamw_rates = sweep(config, (3e-4, 1e-3, 3e-3, 1e-2, 3e-2))
    stock = [
        Sweep(
            "SGD (momentum 0.9)",
            lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            sweep(config, (0.01, 0.03, 0.1, 0.3, 1.0)),
            "torch.optim.SGD with momentum 0.9",
        ),
        Sweep(
            "AdamW",
            lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr),
            adamw_rates,
            "torch.optim.AdamW with its defaults",
        ),
    ]
    if muon:
        stock.append(Sweep("Muon", baselines.muon, adamw_rates, baselines.ABOUT))
    return stock


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
    """The classifiers by name: a builder, whether it takes 8x8 images (else flat vectors), and a description."""
    return {
        "MLP": (lambda: mlp(64, 128, 10), False, "MLP 64-128-128-10 (ReLU)"),
        "CNN": (lambda: SmallCNN(1, 8, (16, 32), 64), True, "CNN conv3-16, conv3-32 (ReLU, max-pool), Linear-64-10"),
    }


@dataclass(frozen=True)
class Task:
    """A model trained on digits and how it is judged.

    Attributes:
        name: Short name ("MLP", "CNN", "autoencoder").
        description: The model, for titles.
        build: A fresh model (seeded by the caller).
        images: Whether it takes 8x8 images (else flat vectors).
        reconstruct: Whether it reconstructs its inputs (loss and metric: the mean binary
            cross-entropy of the pixels, lower is better) instead of classifying them (loss:
            cross-entropy; metric: accuracy, higher is better).
        steps: Training steps at size default (twice at size large).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    images: bool
    reconstruct: bool
    steps: int

    @property
    def metric(self) -> str:
        """The history key the task is judged by on the test split."""
        return "test_loss" if self.reconstruct else "test_accuracy"

    @property
    def metric_name(self) -> str:
        return "test reconstruction loss" if self.reconstruct else "test accuracy"

    def better(self, a: float, b: float) -> bool:
        """Whether metric value ``a`` is at least as good as ``b``."""
        return a <= b if self.reconstruct else a >= b

    def shown(self, value: float) -> str:
        """A metric value as tables print it."""
        return f"{value:.4f}" if self.reconstruct else f"{100 * value:.1f}%"

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        output = model(x)
        if self.reconstruct:
            return F.binary_cross_entropy_with_logits(output, x)
        return F.cross_entropy(output, y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: tuple[Tensor, Tensor]) -> tuple[float, float]:
        """``(loss, accuracy)``; the accuracy is NaN for a reconstruction."""
        output = model(data[0])
        if self.reconstruct:
            return float(F.binary_cross_entropy_with_logits(output, data[0])), math.nan
        return float(F.cross_entropy(output, data[1])), float((output.argmax(1) == data[1]).float().mean())


def tasks() -> dict[str, Task]:
    """The MLP and CNN classifiers, and a deep autoencoder (the classic curvature benchmark, at digits' size)."""
    classifiers = {
        name: Task(name, description, build, images, False, 360)
        for name, (build, images, description) in models().items()
    }
    widths = "-".join(map(str, AUTOENCODER_WIDTHS))
    return {
        **classifiers,
        "autoencoder": Task(
            "autoencoder",
            f"autoencoder {widths} (Tanh, sigmoid output, binary cross-entropy of the pixels)",
            lambda: autoencoder(AUTOENCODER_WIDTHS),
            False,
            True,
            720,
        ),
    }


def train(
    task: Task, factory: Factory, lr: float, digits: Digits, steps: int, eval_every: int, seed: int
) -> dict[str, Any]:
    """``steps`` steps of batch ``BATCH``; losses and accuracies every ``eval_every`` steps.

    ``train_loss`` is the mean loss of the training batches since the previous evaluation;
    validation and test figures are over the whole split.

    ``seconds`` holds the measured wall-clock of the training steps (zero_grad, forward,
    backward, step; evaluations excluded) up to each evaluation. A step that raises
    ``RuntimeError`` (a rule refusing statistics that are no longer finite and positive
    definite, for example K-FAC asking for more damping) or a non-finite loss ends the run as
    diverged.
    """
    torch.manual_seed(seed)
    model = task.build()
    optimizer = factory(model, lr)
    order = torch.Generator().manual_seed(seed)
    x, y = digits.train
    history: dict[str, list[float]] = {
        key: []
        for key in (
            "step",
            "seconds",
            "train_loss",
            "validation_loss",
            "validation_accuracy",
            "test_loss",
            "test_accuracy",
        )
    }
    seconds, step, diverged = 0.0, 0, False
    batch_losses: list[float] = []

    def record() -> None:
        history["step"].append(step)
        history["seconds"].append(seconds)
        # The mean loss of the batches since the last evaluation (at step 0: the whole training split),
        # not a pass over the training split: evaluating it would cost as much as training.
        history["train_loss"].append(
            sum(batch_losses) / len(batch_losses) if batch_losses else task.evaluate(model, digits.train)[0]
        )
        batch_losses.clear()
        for split in ("validation", "test"):
            loss, accuracy = task.evaluate(model, getattr(digits, split))
            history[f"{split}_loss"].append(loss)
            history[f"{split}_accuracy"].append(accuracy)

    record()
    batches: list[Tensor] = []
    while step < steps and not diverged:
        if not batches:
            batches = list(torch.randperm(len(y), generator=order).split(BATCH))[: len(y) // BATCH]
        index = batches.pop(0)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = task.loss(model, x[index], y[index])
        loss.backward()
        try:
            optimizer.step()
        except RuntimeError:  # the Kronecker rules refuse statistics that are no longer finite and positive definite
            diverged = True
        seconds += time.perf_counter() - start
        step += 1
        batch_losses.append(float(loss.detach()))
        diverged = diverged or not math.isfinite(batch_losses[-1])
        if step % eval_every == 0 or step == steps or diverged:
            record()
    if task.reconstruct:
        del history["validation_accuracy"], history["test_accuracy"]  # NaN throughout
    return {"lr": lr, "seed": seed, "diverged": diverged, "measured_training_seconds": seconds, **history}


def final(run: dict[str, Any], key: str) -> float:
    """The final value of a run's ``key``: the mean over its last quarter of evaluations (less noisy than the last).

    A diverged run's final value is NaN.
    """
    if run["diverged"]:
        return math.nan
    values = run[key]
    last = values[-max(1, len(values) // 4) :]
    return sum(last) / len(last)


def best(task: Task, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the best final validation metric (accuracy, then loss; loss for a reconstruction)."""

    def score(run: dict[str, Any]) -> tuple[float, float]:
        loss = final(run, "validation_loss")
        if task.reconstruct:
            return (-loss, 0.0)
        return (final(run, "validation_accuracy"), -loss)

    finite = [r for r in runs if not r["diverged"] and all(math.isfinite(v) for v in score(r))]
    return max(finite, key=score, default=runs[0])


def first_step_reaching(task: Task, run: dict[str, Any], goal: float) -> int | None:
    """The index of the first evaluation whose test metric is at least as good as ``goal`` (``None`` if none)."""
    for index, value in enumerate(run[task.metric]):
        if math.isfinite(value) and task.better(value, goal):
            return index
    return None


def median(values: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def step_times(
    task: Task,
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
        multiple_of: Round a variant's calls per sample to a multiple of this (the period of
            its schedule), so every sample holds its share of statistics and inverse steps.
    """
    x, y = digits.train[0][:batch], digits.train[1][:batch]

    def step_of(factory: Factory, lr: float) -> Callable[[], None]:
        torch.manual_seed(config.seed)
        model = task.build()
        optimizer = factory(model, lr)

        def step() -> None:
            optimizer.zero_grad()
            task.loss(model, x, y).backward()
            optimizer.step()

        return step

    calls = {name: step_of(factory, lr) for name, (factory, lr) in variants.items()}
    return interleave(calls, config, multiple_of=multiple_of)
