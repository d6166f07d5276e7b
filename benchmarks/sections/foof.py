"""Section 4: FOOF's step time against AdamW, and its convergence on scikit-learn's digits."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from inputaware_optim import FOOF

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..models import SmallCNN, mlp
from ..timing import Timing, interleave

BATCH = 64
# FOOF's extra work per layer is about in² (out + batch) multiply-adds against the layer's own
# 3 · batch · in · out, so its relative cost falls as the batch grows: timed at both sizes.
LARGE_BATCH = 512
UPDATE_EVERY = (1, 10, 100)
TRAINED_UPDATE_EVERY = 10
# FOOF's default damping (1e-3) lets these models diverge at learning rates >= 0.03; 0.1 keeps the
# whole sweep stable. It is fixed (not swept) so that FOOF gets no more tuning than the others.
DAMPING = 0.1

Factory = Callable[[nn.Module, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class _Optimizer:
    name: str
    factory: Factory
    learning_rates: tuple[float, ...]


def _optimizers(config: Config) -> list[_Optimizer]:
    def sweep(values: tuple[float, ...]) -> tuple[float, ...]:
        return config.pick(values[1:3], values)

    return [
        _Optimizer(
            "SGD (momentum 0.9)",
            lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            sweep((0.01, 0.03, 0.1, 0.3)),
        ),
        _Optimizer(
            "AdamW",
            lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr),
            sweep((3e-4, 1e-3, 3e-3, 1e-2)),
        ),
        _Optimizer(
            f"FOOF (update_every={TRAINED_UPDATE_EVERY})",
            _foof(TRAINED_UPDATE_EVERY),
            sweep((0.003, 0.01, 0.03, 0.1)),
        ),
    ]


@dataclass(frozen=True)
class _Digits:
    train: tuple[Tensor, Tensor]
    validation: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]


def _digits(seed: int, images: bool) -> _Digits:
    """scikit-learn's 1,797 8x8 digits (shipped with the package), scaled to [0, 1], split 1097/200/500."""
    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all, dtype=torch.float32) / 16
    y = torch.tensor(y_all, dtype=torch.long)
    if images:
        x = x.reshape(-1, 1, 8, 8)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    parts = order[:-700], order[-700:-500], order[-500:]
    train, validation, test = ((x[p], y[p]) for p in parts)
    return _Digits(train, validation, test)


def _models() -> dict[str, tuple[Callable[[], nn.Module], bool, str]]:
    return {
        "MLP": (lambda: mlp(64, 128, 10), False, "MLP 64-128-128-10 (ReLU)"),
        "CNN": (lambda: SmallCNN(1, 8, (16, 32), 64), True, "CNN conv3-16, conv3-32 (ReLU, max-pool), Linear-64-10"),
    }


@torch.no_grad()
def _evaluate(model: nn.Module, data: tuple[Tensor, Tensor]) -> tuple[float, float]:
    logits = model(data[0])
    return float(F.cross_entropy(logits, data[1])), float((logits.argmax(1) == data[1]).float().mean())


def _train(
    build: Callable[[], nn.Module], factory: Factory, lr: float, digits: _Digits, steps: int, eval_every: int, seed: int
) -> dict[str, Any]:
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
        except RuntimeError:  # FOOF refuses statistics that are no longer finite and positive definite
            diverged = True
        seconds += time.perf_counter() - start
        step += 1
        diverged = diverged or not math.isfinite(float(loss.detach()))
        if step % eval_every == 0 or step == steps or diverged:
            record(step)
    return {"lr": lr, "diverged": diverged, "measured_training_seconds": seconds, **history}


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the best final validation accuracy (then the lowest validation loss)."""

    def score(run: dict[str, Any]) -> tuple[float, float]:
        loss = run["validation_loss"][-1]
        return (run["validation_accuracy"][-1], -loss if math.isfinite(loss) else -math.inf)

    return max((r for r in runs if not r["diverged"]), key=score, default=runs[0])


def _at_step(step: int | None) -> str:
    return "never" if step is None else f"at step {step}"


def _plateau(accuracies: list[float]) -> float:
    """The final accuracy of a run: the mean over its last quarter of evaluations (one test sample is 0.2%)."""
    last = accuracies[-max(1, len(accuracies) // 4) :]
    return sum(last) / len(last)


def _first_step_reaching(run: dict[str, Any], accuracy: float) -> int | None:
    for step, reached in zip(run["step"], run["test_accuracy"], strict=True):
        if reached >= accuracy:
            return step
    return None


def _foof(update_every: int) -> Factory:
    return lambda model, lr: FOOF(model, lr=lr, damping=DAMPING, update_every=update_every)


def _step_times(
    build: Callable[[], nn.Module], digits: _Digits, batch: int, update_every: tuple[int, ...], config: Config
) -> Timing:
    """Interleaved training-step times of AdamW, SGD and FOOF at each ``update_every``."""
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

    variants = {
        "AdamW": step_of(lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr), 1e-4),
        "SGD (momentum 0.9)": step_of(lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), 1e-3),
    }
    for every in update_every:
        variants[f"FOOF (update_every={every})"] = step_of(_foof(every), 1e-3)
    multiples = {f"FOOF (update_every={every})": every for every in update_every}
    return interleave(variants, config, multiple_of=multiples)


def run(config: Config, progress: Progress) -> Result:
    optimizers = _optimizers(config)
    models = _models()
    steps, eval_every = config.pick(12, 360, 720), config.pick(6, 10, 20)
    runs_per_model = sum(len(o.learning_rates) for o in optimizers)
    progress.start(len(models) * (1 + runs_per_model))
    data: dict[str, Any] = {"batch": BATCH, "steps": steps, "eval_every": eval_every}
    timing_rows, convergence_rows, targets, plots = [], [], [], []
    for model_name, (build, images, description) in models.items():
        digits = _digits(config.seed, images)
        progress.describe(f"{model_name} step times")
        timings = {
            BATCH: _step_times(build, digits, BATCH, config.pick(UPDATE_EVERY[:2], UPDATE_EVERY), config),
            LARGE_BATCH: _step_times(build, digits, LARGE_BATCH, (TRAINED_UPDATE_EVERY,), config),
        }
        progress.advance()
        timing = timings[BATCH]
        adamw_seconds = timing.per_call("AdamW")
        per_step: dict[str, float] = {}
        ratios: dict[int, dict[str, Any]] = {}
        for batch, batch_timing in timings.items():
            ratios[batch] = {}
            for name in batch_timing.seconds:
                ratio = batch_timing.ratio(name, "AdamW")
                ratios[batch][name] = ratio.__dict__
                if batch == BATCH:
                    per_step[name] = adamw_seconds * ratio.median
                timing_rows.append(
                    [model_name, str(batch), name, format_seconds(batch_timing.per_call(name)), ratio.shown()]
                )
        runs: dict[str, list[dict[str, Any]]] = {}
        for optimizer in optimizers:
            runs[optimizer.name] = []
            for lr in optimizer.learning_rates:
                progress.describe(f"{model_name} {optimizer.name} lr={lr:g}")
                runs[optimizer.name].append(
                    _train(build, optimizer.factory, lr, digits, steps, eval_every, config.seed)
                )
                progress.advance()
        best = {name: _best(candidates) for name, candidates in runs.items()}
        goal = _plateau(best["AdamW"]["test_accuracy"])
        reach: dict[str, dict[str, Any]] = {}
        for name, chosen in best.items():
            reached = _first_step_reaching(chosen, goal)
            seconds = None if reached is None else reached * per_step[name]
            reach[name] = {"step": reached, "seconds": seconds}
            convergence_rows.append(
                [
                    model_name,
                    name,
                    f"{chosen['lr']:g}",
                    f"{chosen['train_loss'][-1]:.4f}",
                    f"{chosen['test_loss'][-1]:.4f}",
                    f"{100 * chosen['test_accuracy'][-1]:.1f}%",
                    "never" if reached is None else str(reached),
                    "never" if seconds is None else format_seconds(seconds),
                ]
            )
        foof_name = f"FOOF (update_every={TRAINED_UPDATE_EVERY})"
        foof_ratio = ratios[BATCH][foof_name]
        targets.append(
            Target.at_most(
                f"FOOF update_every=10 training step vs AdamW, digits {model_name}",
                foof_ratio["median"],
                1.25,
                "×",
                f"pairs {foof_ratio['low']:.3f}–{foof_ratio['high']:.3f}; batch {BATCH}",
            )
        )
        foof_reach, adamw_reach = reach[foof_name]["seconds"], reach["AdamW"]["seconds"]
        targets.append(
            Target.at_most(
                f"FOOF time to AdamW's final test accuracy, digits {model_name}",
                None if foof_reach is None or not adamw_reach else foof_reach / adamw_reach,
                1.0,
                "× AdamW's time",
                f"AdamW's final accuracy (mean of its last quarter) {100 * goal:.1f}%: "
                f"AdamW reaches it at step {reach['AdamW']['step']}, "
                f"FOOF {_at_step(reach[foof_name]['step'])} (best FOOF accuracy "
                f"{100 * max(best[foof_name]['test_accuracy']):.1f}%)",
                strict=True,
            )
        )
        data[model_name] = {
            "description": description,
            "step_timing": {str(batch): t.to_json() for batch, t in timings.items()},
            "ratios_vs_adamw": {str(batch): r for batch, r in ratios.items()},
            "seconds_per_step": per_step,
            "runs": runs,
            "best_lr": {name: chosen["lr"] for name, chosen in best.items()},
            "adamw_final_test_accuracy": goal,
            "time_to_adamw_accuracy": reach,
        }
        plots.append(_convergence_plot(model_name, description, best, per_step, headline=model_name == "MLP"))
    tables = [
        Table(
            "Training step time (zero_grad, forward, backward, step) on digits, ratio vs AdamW",
            ["model", "batch", "optimizer", "step time", "ratio vs AdamW"],
            timing_rows,
            "FOOF samples span whole multiples of update_every, so each includes its share of inverse refreshes. "
            f"Batch {BATCH} is the training setting below; at {LARGE_BATCH} FOOF's per-layer work (the input "
            "statistics and the preconditioning product, about in² · (out + batch) multiply-adds) weighs less "
            "against the layers' own 3 · batch · in · out. FOOF damping "
            f"{DAMPING:g} throughout.",
        ),
        Table(
            f"Convergence on digits: {steps} steps of batch {BATCH}; best learning rate of each sweep by "
            "final validation accuracy",
            [
                "model",
                "optimizer",
                "best lr",
                "final train loss",
                "final test loss",
                "final test accuracy",
                "steps to AdamW's accuracy",
                "time to AdamW's accuracy",
            ],
            convergence_rows,
            "Time = steps × the optimizer's step time from the interleaved timing above (so every clock comes "
            "from the same moment); the raw training times of every run are in the JSON. Learning rates swept: "
            + "; ".join(f"{o.name} {', '.join(f'{lr:g}' for lr in o.learning_rates)}" for o in optimizers)
            + ". Digits split 1097 train / 200 validation / 500 test.",
        ),
    ]
    return Result(tables=tables, targets=targets, plots=plots, data=data)


def _convergence_plot(
    model: str, description: str, best: dict[str, dict[str, Any]], per_step: dict[str, float], headline: bool
) -> Plot:
    def series(key: str, seconds: bool) -> list[Series]:
        return [
            Series(
                f"{name} lr={run['lr']:g}",
                [s * per_step[name] if seconds else s for s in run["step"]],
                run[key] if key != "test_accuracy" else [100 * a for a in run[key]],
            )
            for name, run in best.items()
        ]

    return Plot(
        f"digits-{model.lower()}",
        f"Digits, {description}: best learning rate of each optimizer",
        [
            Panel("training loss", "step", "loss", series("train_loss", False), logy=True),
            Panel("training loss", "seconds (step time × steps)", "loss", series("train_loss", True), logy=True),
            Panel("test accuracy", "step", "%", series("test_accuracy", False)),
            Panel("test accuracy", "seconds (step time × steps)", "%", series("test_accuracy", True)),
        ],
        headline=headline,
    )


SECTION = Section(
    name="foof",
    title="FOOF: step time and convergence on digits",
    summary=(
        "FOOF's training step (its input statistics, the preconditioning matmul, a Cholesky inverse every "
        "`update_every` steps) against AdamW's and SGD's, interleaved; then training on scikit-learn's "
        "digits with an MLP and a small CNN, each optimizer with a small learning-rate sweep, the best "
        "taken by validation accuracy. The target: FOOF reaches AdamW's final test accuracy in less time."
    ),
    run=run,
)
