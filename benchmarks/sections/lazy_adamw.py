"""Section 6: LazyAdamW against dense fused AdamW and SparseAdam on a large embedding table."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inputaware_optim import Inputs, LazyAdamW

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..timing import interleave

EMBEDDING_ROWS, EMBEDDING_WIDTH, TOKENS = 50_000, 128, 768


def _learning_rates(config: Config) -> tuple[float, ...]:
    return config.pick((3e-3,), (1e-3, 3e-3, 1e-2))


FUSED, LAZY, SPARSE_ADAM, LAZY_SPARSE = (
    "AdamW (fused, dense)",
    "LazyAdamW (dense gradients)",
    "SparseAdam (sparse=True)",
    "LazyAdamW (sparse=True)",
)


class _Variant:
    """One optimizer on its own copy of the embedding, with the step it times and the training step."""

    def __init__(self, embedding: nn.Embedding, make: Callable[[nn.Embedding], torch.optim.Optimizer]) -> None:
        self.embedding = embedding
        self.optimizer = make(embedding)
        self.inputs: Inputs | None = None
        self.grad: Tensor | None = None

    def backward(self, tokens: Tensor, direction: Tensor) -> None:
        """Gradients (and, for LazyAdamW, captured inputs) from one forward and backward."""
        self.optimizer.zero_grad()
        (self.embedding(tokens) * direction).sum().backward()
        self.grad = self.embedding.weight.grad
        if isinstance(self.optimizer, LazyAdamW):
            self.inputs = self.optimizer.capture.inputs()

    def step(self) -> None:
        # Every repeat steps the gradient as backward left it: LazyAdamW keeps a sparse gradient
        # coalesced in .grad, and its later repeats must not skip the coalescing a real step pays
        # (SparseAdam coalesces a copy at every step).
        self.embedding.weight.grad = self.grad
        if isinstance(self.optimizer, LazyAdamW):
            # The same captured inputs at every repeat: the capture is released by each step.
            self.optimizer.step(inputs=self.inputs)
        else:
            self.optimizer.step()


def _step_times(config: Config) -> dict[str, Any]:
    rows = config.pick(5_000, EMBEDDING_ROWS)
    torch.manual_seed(config.seed)
    dense = nn.Embedding(rows, EMBEDDING_WIDTH)
    sparse = nn.Embedding(rows, EMBEDDING_WIDTH, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    variants = {
        FUSED: _Variant(copy.deepcopy(dense), lambda e: torch.optim.AdamW(e.parameters(), lr=1e-3, fused=True)),
        LAZY: _Variant(copy.deepcopy(dense), lambda e: LazyAdamW(e, lr=1e-3)),
        SPARSE_ADAM: _Variant(copy.deepcopy(sparse), lambda e: torch.optim.SparseAdam(e.parameters(), lr=1e-3)),
        LAZY_SPARSE: _Variant(copy.deepcopy(sparse), lambda e: LazyAdamW(e, lr=1e-3)),
    }
    generator = torch.Generator().manual_seed(config.seed)
    direction = torch.randn(TOKENS, EMBEDDING_WIDTH, generator=generator)

    def fresh_gradients(variant: _Variant) -> Callable[[], None]:
        def make() -> None:
            variant.backward(torch.randint(0, rows, (TOKENS,), generator=generator), direction)

        return make

    step_timing = interleave(
        {name: v.step for name, v in variants.items()},
        config,
        before_sample={name: fresh_gradients(v) for name, v in variants.items()},
    )

    def training_step(variant: _Variant) -> Callable[[], None]:
        def step() -> None:
            variant.optimizer.zero_grad()
            tokens = torch.randint(0, rows, (TOKENS,), generator=generator)
            (variant.embedding(tokens) * direction).sum().backward()
            variant.optimizer.step()

        return step

    end_to_end = interleave({name: training_step(v) for name, v in variants.items()}, config)
    return {"rows": rows, "step": step_timing, "end_to_end": end_to_end}


def _copy_bandwidth(config: Config) -> float:
    """Bytes per second this machine moves in a large float32 copy (read and write counted),
    the median of several copies of 64 MiB: the memory bandwidth a row update can hope for."""
    source = torch.ones(16 * 2**20)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(config.pick(3, 11)):
        start = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / statistics.median(seconds)


def _bandwidth_estimate(rows: int, bandwidth: float) -> tuple[float, float]:
    """The expected rows a step of ``TOKENS`` uniform tokens touches, and the seconds the bandwidth
    needs to read the touched rows of the weight, its gradient and both moments, and write back
    the weight and both moments (7 row passes)."""
    touched = rows * (1 - (1 - 1 / rows) ** TOKENS)
    return touched, 7 * touched * EMBEDDING_WIDTH * 4 / bandwidth


def _bag_of_words(config: Config, vocabulary: int, bags: int, bag: int, seed: int) -> dict[str, Any]:
    """A planted logistic model over a Zipf-distributed vocabulary: ``p(y=1) = σ(2 Σ w*_t / √bag)``."""
    generator = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, vocabulary + 1, dtype=torch.float64) ** 1.1
    planted = torch.randn(vocabulary, generator=generator)

    def sample(count: int) -> tuple[Tensor, Tensor, Tensor]:
        tokens = torch.multinomial(popularity, count * bag, replacement=True, generator=generator).reshape(count, bag)
        probability = torch.sigmoid(2 * planted[tokens].sum(1) / math.sqrt(bag))
        return tokens, torch.bernoulli(probability, generator=generator), probability

    return {"train": sample(bags), "test": sample(config.pick(2_000, 20_000))}


class _BagModel(nn.Module):
    """``EmbeddingBag`` (sum) then a linear read-out: a logistic model over learned token vectors."""

    def __init__(self, vocabulary: int, width: int, sparse: bool) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocabulary, width, mode="sum", sparse=sparse)
        self.out = nn.Linear(width, 1)
        nn.init.normal_(self.bag.weight, std=0.01)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.bag(tokens)).squeeze(1)


class _Stepper(Protocol):
    def zero_grad(self) -> None: ...

    def step(self) -> Any: ...


class _SparseAdamWithHead:
    """SparseAdam for the embedding, AdamW for the dense head: how SparseAdam is used in practice."""

    def __init__(self, model: _BagModel, lr: float) -> None:
        self.parts = [
            torch.optim.SparseAdam(model.bag.parameters(), lr=lr),
            torch.optim.AdamW(model.out.parameters(), lr=lr, weight_decay=0.0),
        ]

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def step(self) -> None:
        for part in self.parts:
            part.step()


def _quality(config: Config, progress: Progress) -> dict[str, Any]:
    vocabulary = config.pick(5_000, EMBEDDING_ROWS)
    bag, bags_per_step, width = 12, TOKENS // 12, 16
    steps = config.pick(60, 1000, 3000)
    evaluate_every = max(1, steps // 30)
    data = _bag_of_words(config, vocabulary, steps * bags_per_step, bag, config.seed)
    train_tokens, train_labels, _ = data["train"]
    test_tokens, test_labels, test_probability = data["test"]
    bayes = float(F.binary_cross_entropy(test_probability, test_labels))
    optimizers: dict[str, tuple[bool, Callable[[_BagModel, float], _Stepper]]] = {
        "AdamW (fused, dense)": (False, lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)),
        "LazyAdamW": (False, lambda m, lr: LazyAdamW(m, lr=lr, weight_decay=0.0)),
        "SparseAdam + AdamW head": (True, _SparseAdamWithHead),
    }
    learning_rates = _learning_rates(config)
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, (sparse, make) in optimizers.items():
        runs[name] = []
        for lr in learning_rates:
            progress.describe(f"bag of words {name} lr={lr:g}")
            torch.manual_seed(config.seed)
            model = _BagModel(vocabulary, width, sparse)
            optimizer = make(model, lr)
            history: dict[str, list[float]] = {"step": [], "test_loss": [], "test_accuracy": []}
            for step in range(steps + 1):
                if step % evaluate_every == 0 or step == steps:
                    with torch.no_grad():
                        logits = model(test_tokens)
                    history["step"].append(step)
                    history["test_loss"].append(float(F.binary_cross_entropy_with_logits(logits, test_labels)))
                    history["test_accuracy"].append(float(((logits > 0).float() == test_labels).float().mean()))
                if step == steps:
                    break
                rows = slice(step * bags_per_step, (step + 1) * bags_per_step)
                optimizer.zero_grad()
                F.binary_cross_entropy_with_logits(model(train_tokens[rows]), train_labels[rows]).backward()
                optimizer.step()
            runs[name].append({"lr": lr, **history})
            progress.advance()
    best = {name: min(candidates, key=lambda r: r["test_loss"][-1]) for name, candidates in runs.items()}
    return {
        "vocabulary": vocabulary,
        "bag": bag,
        "bags_per_step": bags_per_step,
        "width": width,
        "steps": steps,
        "bayes_test_loss": bayes,
        "runs": runs,
        "best": {name: run["lr"] for name, run in best.items()},
        "best_runs": best,
    }


def _style(name: str) -> str:
    # LazyAdamW and SparseAdam follow almost the same path; dashes keep both visible.
    return "--" if name.startswith("SparseAdam") else "-"


def run(config: Config, progress: Progress) -> Result:
    progress.start(1 + 3 * len(_learning_rates(config)))
    progress.describe("step times")
    timed = _step_times(config)
    progress.advance()
    quality = _quality(config, progress)

    step, end_to_end = timed["step"], timed["end_to_end"]
    timing_rows = []
    for name in step.seconds:
        timing_rows.append(
            [
                name,
                format_seconds(step.per_call(name)),
                step.ratio(FUSED, name).shown(),
                step.ratio(name, SPARSE_ADAM).shown(),
                format_seconds(end_to_end.per_call(name)),
                end_to_end.ratio(FUSED, name).shown(),
            ]
        )
    bandwidth = _copy_bandwidth(config)
    touched, bound = _bandwidth_estimate(timed["rows"], bandwidth)
    over_bound = step.per_call(LAZY) / bound
    speedup = step.ratio(FUSED, LAZY)
    versus_sparse = step.ratio(LAZY, SPARSE_ADAM)
    sparse_twin = step.ratio(LAZY_SPARSE, SPARSE_ADAM)
    shape = f"Embedding({timed['rows']:,}, {EMBEDDING_WIDTH}), {TOKENS} tokens"
    targets = [
        Target.at_least(
            "LazyAdamW step vs dense fused AdamW",
            speedup.median,
            25.0,
            "× faster",
            f"{shape}; pairs {speedup.low:.1f}–{speedup.high:.1f}×",
        ).full_size_only(config),
        Target.at_most(
            "LazyAdamW step vs the memory-bandwidth estimate of its touched rows",
            over_bound,
            3.0,
            "× the estimate",
            f"about {touched:.0f} rows touched; 7 row passes (weight, gradient and both moments read, weight and "
            f"moments written) at the {bandwidth / 1e9:.1f} GB/s of a 64 MiB copy: {format_seconds(bound)}, "
            f"against a measured step of {format_seconds(step.per_call(LAZY))}",
        ).full_size_only(config),
        Target.at_most(
            "LazyAdamW (dense gradients) step vs SparseAdam",
            versus_sparse.median,
            1.0,
            "× SparseAdam's time",
            f"pairs {versus_sparse.low:.3f}–{versus_sparse.high:.3f}",
        ).full_size_only(config),
        Target.at_most(
            "LazyAdamW (sparse=True) step vs SparseAdam",
            sparse_twin.median,
            1.0,
            "× SparseAdam's time",
            f"pairs {sparse_twin.low:.3f}–{sparse_twin.high:.3f}",
        ).full_size_only(config),
    ]
    best = quality.pop("best_runs")
    quality_rows = [
        [
            name,
            f"{run['lr']:g}",
            f"{run['test_loss'][-1]:.4f}",
            f"{100 * run['test_accuracy'][-1]:.1f}%",
        ]
        for name, run in best.items()
    ]
    tables = [
        Table(
            f"Optimizer step alone and full training step on {shape} a step",
            [
                "optimizer",
                "step",
                "speed-up vs fused AdamW",
                "step / SparseAdam's",
                "training step",
                "speed-up vs fused AdamW",
            ],
            timing_rows,
            "Step alone: the same gradients (one backward before each sample) stepped repeatedly, each repeat "
            "from the gradient as backward left it (a sparse one uncoalesced). Training "
            "step: zero_grad, forward, backward, step; with dense gradients the backward writes the whole "
            "table's gradient, which no optimizer can avoid.",
        ),
        Table(
            f"Bag-of-words logistic regression with a planted model: vocabulary {quality['vocabulary']:,} "
            f"(Zipf 1.1), {quality['bags_per_step']} bags of {quality['bag']} tokens a step, "
            f"{quality['steps']} steps, EmbeddingBag width {quality['width']}",
            ["optimizer", "best lr", "final test loss", "final test accuracy"],
            quality_rows,
            f"The planted model's own test loss (the floor) is {quality['bayes_test_loss']:.4f}. Weight decay 0 "
            "for every optimizer (SparseAdam has none). Best learning rate by final test loss of "
            + ", ".join(f"{lr:g}" for lr in _learning_rates(config))
            + ".",
        ),
    ]
    plot = Plot(
        "bag-of-words",
        "Bag-of-words with a planted model: best learning rate of each optimizer",
        [
            Panel(
                "test loss",
                "step",
                "binary cross-entropy",
                [Series(f"{n} lr={r['lr']:g}", r["step"], r["test_loss"], _style(n)) for n, r in best.items()]
                + [Series("planted model", [0, quality["steps"]], [quality["bayes_test_loss"]] * 2, style="k--")],
            ),
            Panel(
                "test accuracy",
                "step",
                "%",
                [
                    Series(f"{n} lr={r['lr']:g}", r["step"], [100 * a for a in r["test_accuracy"]], _style(n))
                    for n, r in best.items()
                ],
            ),
        ],
        caption=(
            "AdamW (fused, dense): torch.optim.AdamW(fused=True), every row updated each step; LazyAdamW: "
            "inputaware_optim.LazyAdamW, only the rows a step's tokens touched; SparseAdam + AdamW head: "
            "torch.optim.SparseAdam on a sparse=True EmbeddingBag with AdamW on the linear head; lr: the "
            "learning rate of each optimizer's best run by final test loss; planted model: the test loss of the "
            "model that generated the labels (the floor). LazyAdamW and SparseAdam take nearly the same path, so "
            "their lines may coincide; the markers show each."
        ),
    )
    data = {
        "embedding": {"rows": timed["rows"], "width": EMBEDDING_WIDTH, "tokens": TOKENS},
        "step": step.to_json(),
        "end_to_end": end_to_end.to_json(),
        "step_speedup_vs_fused": {n: step.ratio(FUSED, n).__dict__ for n in step.seconds},
        "step_ratio_vs_sparse_adam": {n: step.ratio(n, SPARSE_ADAM).__dict__ for n in step.seconds},
        "bandwidth": {"copy_bytes_per_second": bandwidth, "rows_touched": touched, "estimate_seconds": bound},
        "quality": quality,
    }
    return Result(tables=tables, targets=targets, plots=[plot], data=data)


SECTION = Section(
    name="lazy_adamw",
    title="LazyAdamW vs dense fused AdamW and SparseAdam",
    summary=(
        "An `nn.Embedding(50_000, 128)` receiving 768 tokens a step: the optimizer step of dense fused "
        "`AdamW` (every row), `LazyAdamW` (the touched rows, from the captured token ids) on dense "
        "gradients and on a `sparse=True` twin, and `torch.optim.SparseAdam` on the twin, interleaved. "
        "Then quality on a large-vocabulary bag-of-words task with a planted logistic model."
    ),
    run=run,
    estimate=(1, 40),
)
