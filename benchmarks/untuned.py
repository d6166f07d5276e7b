"""WhitenedMuon against Muon and AdamW on two workloads the benchmark's sections never ran (issue 44's check that
the rule was not tuned to the benchmark).

``python -m benchmarks.untuned [--workloads lm mlp] [--steps 300] [--seeds 3]`` prints one JSON object per
workload:

- ``lm``: a character-level transformer LM on English prose (the standard library's pydoc topics, the last
  10% held out), 3 blocks, width 128, context 64, batch 32 (2,048 characters per step); validation loss on 8
  fixed held-out batches, lower is better.
- ``mlp``: an 8-class tabular classifier (scikit-learn's ``make_classification``: 20 features, 4,000 train and
  1,000 test rows), 20-256-256-8 with Tanh, batch 128; test accuracy, higher is better.

AdamW, Muon (``baselines.muon``: float32 Newton–Schulz on the hidden matrices, AdamW on the rest) and
WhitenedMuon (``rules.whitened_muon()``: the recipe's Muon part replaced by the library's rule, at the
benchmark's defaults) each sweep the learning rate on seed 0; the best (final metric: the mean of the last
quarter of the evaluations) trains on the other seeds; the goal is Muon's median final metric, and each
optimizer's time to it is its measured training time (evaluations excluded) up to its first evaluation at
least as good, the median over the seeds (``inf``: most never reach it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import baselines, rules
from .models import GPT

Batch = tuple[Tensor, Tensor]
OPTIMIZERS: dict[str, Callable[[nn.Module, float], Any]] = {
    "AdamW": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=baselines.WEIGHT_DECAY),
    "Muon": baselines.muon,
    "WhitenedMuon": rules.whitened_muon(),
}
RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    batches: Callable[[int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], Tensor]
    metric: Callable[[nn.Module], float]
    lower_is_better: bool


def language_model() -> Workload:
    import pydoc_data.topics as topics

    data = torch.tensor(list("".join(topics.topics.values()).encode()), dtype=torch.long)
    cut = int(0.9 * len(data))
    train, valid = data[:cut], data[cut:]
    context, batch = 64, 32
    offsets = torch.arange(context + 1)
    held_out = torch.randint(0, len(valid) - context - 1, (8, batch), generator=torch.Generator().manual_seed(99))

    def batches(seed: int) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            window = train[torch.randint(0, len(train) - context - 1, (batch, 1), generator=generator) + offsets]
            yield window[:, :-1], window[:, 1:]

    def loss(model: nn.Module, b: Batch) -> Tensor:
        return nn.functional.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten())

    @torch.no_grad()
    def metric(model: nn.Module) -> float:
        windows = [valid[starts[:, None] + offsets] for starts in held_out]
        return sum(float(loss(model, (w[:, :-1], w[:, 1:]))) for w in windows) / len(windows)

    return Workload(lambda: GPT(256, context, 128, 3, 2), batches, loss, metric, lower_is_better=True)


def tabular() -> Workload:
    from sklearn.datasets import make_classification

    x_all, y_all = make_classification(5000, 20, n_informative=12, n_classes=8, n_clusters_per_class=2, random_state=0)
    x = torch.tensor((x_all - x_all[:4000].mean(0)) / x_all[:4000].std(0), dtype=torch.float32)
    y = torch.tensor(y_all)

    def batches(seed: int) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            rows = torch.randint(0, 4000, (128,), generator=generator)
            yield x[rows], y[rows]

    def loss(model: nn.Module, b: Batch) -> Tensor:
        return nn.functional.cross_entropy(model(b[0]), b[1])

    @torch.no_grad()
    def metric(model: nn.Module) -> float:
        return float((model(x[4000:]).argmax(1) == y[4000:]).float().mean())

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))

    return Workload(build, batches, loss, metric, lower_is_better=False)


WORKLOADS = {"lm": language_model, "mlp": tabular}


def train(work: Workload, make: Callable[[nn.Module, float], Any], lr: float, seed: int, steps: int) -> dict[str, Any]:
    """``steps`` steps; ``(step, measured training seconds, metric)`` at step 0 and every ``steps // 12``."""
    torch.manual_seed(seed)
    model = work.build()
    optimizer = make(model, lr)
    stream = work.batches(seed)
    every, seconds = max(1, steps // 12), 0.0
    curve = [(0, 0.0, work.metric(model))]
    for step in range(1, steps + 1):
        batch = next(stream)
        start = time.perf_counter()
        optimizer.zero_grad()
        value = work.loss(model, batch)
        value.backward()
        optimizer.step()
        seconds += time.perf_counter() - start
        if not math.isfinite(float(value.detach())):
            return {"lr": lr, "seed": seed, "curve": curve, "diverged": True}
        if step % every == 0 or step == steps:
            curve.append((step, seconds, work.metric(model)))
    return {"lr": lr, "seed": seed, "curve": curve, "diverged": False}


def final(run: dict[str, Any], lower: bool) -> float:
    if run["diverged"]:
        return math.inf if lower else -math.inf
    values = [value for _, _, value in run["curve"][1:]]
    return statistics.mean(values[-max(1, len(values) // 4) :])


def measure(name: str, steps: int, seeds: int, rates: tuple[float, ...]) -> dict[str, Any]:
    work = WORKLOADS[name]()
    lower = work.lower_is_better
    pick = min if lower else max
    swept: dict[str, list[dict[str, Any]]] = {n: [] for n in OPTIMIZERS}
    for lr in rates:  # (the optimizers take turns: a change of the machine's load falls on all)
        for n, make in OPTIMIZERS.items():
            swept[n].append(train(work, make, lr, 0, steps))
    runs = {n: [pick(s, key=lambda r: final(r, lower))] for n, s in swept.items()}
    for seed in range(1, seeds):
        for n, make in OPTIMIZERS.items():
            runs[n].append(train(work, make, runs[n][0]["lr"], seed, steps))
    finals = {n: statistics.median(final(r, lower) for r in rs) for n, rs in runs.items()}
    goal = finals["Muon"]
    results: dict[str, Any] = {}
    for n, rs in runs.items():
        reached = [
            next(((s, t) for s, t, v in r["curve"][1:] if (v <= goal if lower else v >= goal)), None) for r in rs
        ]
        results[n] = {
            "lr": rs[0]["lr"],
            "final_median": finals[n],
            "finals": [final(r, lower) for r in rs],
            "steps_to_goal": [None if hit is None else hit[0] for hit in reached],
            "time_to_goal": statistics.median(math.inf if hit is None else hit[1] for hit in reached),
            "seconds_per_step": statistics.median(r["curve"][-1][1] / r["curve"][-1][0] for r in rs),
        }
    for n in results:
        results[n]["time_vs_muon"] = results[n]["time_to_goal"] / results["Muon"]["time_to_goal"]
    return {"workload": name, "steps": steps, "seeds": seeds, "rates": list(rates), "goal": goal, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.untuned", description=__doc__)
    parser.add_argument("--workloads", nargs="*", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rates", type=float, nargs="*", default=list(RATES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier under load)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the coverage warnings name the parts AdamW takes, as the recipe says)
        for name in args.workloads:
            print(json.dumps(measure(name, args.steps, args.seeds, tuple(args.rates)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
