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

from inputaware_optim import LazyAdamW

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..timing import Timing, interleave

EMBEDDING_ROWS, EMBEDDING_WIDTH, TOKENS = 50_000, 128, 768


def _learning_rates(config: Config) -> tuple[float, ...]:
    return config.pick((3e-3,), (1e-3, 3e-3, 1e-2))


FUSED, LAZY, SPARSE_ADAM, LAZY_SPARSE = (
    "AdamW (fused, dense)",
    "LazyAdamW (dense gradients)",
    "SparseAdam (sparse=True)",
    "LazyAdamW (sparse=True)",
)
SPARSE_ADAM_WITH_HEAD = "SparseAdam + AdamW head (sparse=True)"
KERNELS = "its kernels alone (sparse=True)"


class _RowKernels:
    """LazyAdamW's step on a sparse gradient with nothing but its torch calls: coalesce, gather the
    weight's and moments' rows, torch's fused AdamW kernel, write the rows back. The floor the
    library's own step is measured against."""

    def __init__(self, embedding: nn.Embedding, lr: float) -> None:
        self.weight, self.lr = embedding.weight, lr
        self.moments = [torch.zeros_like(self.weight), torch.zeros_like(self.weight)]
        self.count = torch.zeros(())

    def zero_grad(self) -> None:
        self.weight.grad = None

    @torch.no_grad()
    def step(self) -> None:
        assert self.weight.grad is not None
        grad = self.weight.grad.coalesce()
        rows = grad.indices()[0]
        tables = [self.weight, *self.moments]
        gathered = [table.index_select(0, rows) for table in tables]
        self.count += 1
        torch._fused_adamw_(  # (the benchmark's floor; the library reaches the kernel through _torch.py)
            [gathered[0]],
            [grad.values()],
            [gathered[1]],
            [gathered[2]],
            [],
            [self.count],
            amsgrad=False,
            lr=self.lr,
            beta1=0.9,
            beta2=0.999,
            weight_decay=1e-2,
            eps=1e-8,
            maximize=False,
        )
        for table, values in zip(tables, gathered, strict=True):
            table.view(torch.complex128).index_put_((rows,), values.view(torch.complex128))


def _make(name: str, model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer | _SparseAdamWithHead:
    """The optimizer ``name`` on ``model`` (an embedding, or a model whose first child is one)."""
    if name == FUSED:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if name in (LAZY, LAZY_SPARSE):
        return LazyAdamW(model, lr=lr, fused=True)  # (the dense parameters' kernel, as the baseline's)
    if name == KERNELS:
        assert isinstance(model, nn.Embedding)
        return _RowKernels(model, lr)  # type: ignore[return-value]
    if isinstance(model, nn.Embedding):
        return torch.optim.SparseAdam(model.parameters(), lr=lr)
    assert isinstance(model, (_BagModel, _EmbeddingHeavy))
    return _SparseAdamWithHead(model, lr)


def _steps_as_users_meet_them(config: Config, rows: int) -> Timing:
    """Each variant's optimizer step, each after its own zero_grad, forward and backward (untimed;
    LazyAdamW's captures fresh), in interleaved rounds: the step a training loop pays."""
    torch.manual_seed(config.seed)
    dense = nn.Embedding(rows, EMBEDDING_WIDTH)
    sparse = nn.Embedding(rows, EMBEDDING_WIDTH, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    generator = torch.Generator().manual_seed(config.seed)
    direction = torch.randn(TOKENS, EMBEDDING_WIDTH, generator=generator)
    variants = {}
    for name in (FUSED, LAZY, LAZY_SPARSE, SPARSE_ADAM, KERNELS):
        embedding = copy.deepcopy(sparse if "sparse" in name else dense)
        variants[name] = (embedding, _make(name, embedding))

    def timed_steps(name: str, count: int) -> float:
        embedding, optimizer = variants[name]
        seconds = 0.0
        for _ in range(count):
            optimizer.zero_grad()
            tokens = torch.randint(0, rows, (TOKENS,), generator=generator)
            (embedding(tokens) * direction).sum().backward()
            start = time.perf_counter()
            optimizer.step()
            seconds += time.perf_counter() - start
        return seconds

    calls = config.pick(3, 10)
    for name in variants:  # warm-up: every page of every table and moment touched at least once
        timed_steps(name, config.pick(3, 20))
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(config.pairs):
        for name in order if round_ % 2 == 0 else order[::-1]:
            seconds[name].append(timed_steps(name, calls) / calls)
    return Timing({name: calls for name in variants}, seconds, {name: [] for name in variants}, torch.get_num_threads())


class _EmbeddingHeavy(nn.Module):
    """An embedding-heavy classifier: bags of tokens summed in an ``EmbeddingBag``, then a small MLP
    (at 50,000 rows the table holds 6.4M parameters, the head 9k)."""

    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, EMBEDDING_WIDTH, mode="sum", sparse=sparse)
        self.out = nn.Sequential(nn.Linear(EMBEDDING_WIDTH, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.bag(tokens))


def _training_steps(config: Config, rows: int) -> Timing:
    """The whole training step (zero_grad, forward, backward, step) of ``_EmbeddingHeavy`` on 64 bags
    of 12 tokens (768 tokens), interleaved."""
    torch.manual_seed(config.seed)
    dense, sparse = _EmbeddingHeavy(rows, False), _EmbeddingHeavy(rows, True)
    sparse.load_state_dict(dense.state_dict())
    generator = torch.Generator().manual_seed(config.seed + 1)
    labels = torch.randint(0, 10, (TOKENS // 12,), generator=generator)

    def training_step(name: str) -> Callable[[], None]:
        model = copy.deepcopy(sparse if "sparse" in name else dense)
        optimizer = _make(name, model)

        def step() -> None:
            optimizer.zero_grad()
            tokens = torch.randint(0, rows, (TOKENS // 12, 12), generator=generator)
            F.cross_entropy(model(tokens), labels).backward()
            optimizer.step()

        return step

    return interleave({name: training_step(name) for name in (FUSED, LAZY, LAZY_SPARSE, SPARSE_ADAM_WITH_HEAD)}, config)


def _step_times(config: Config) -> dict[str, Any]:
    rows = config.pick(5_000, EMBEDDING_ROWS)
    return {"rows": rows, "step": _steps_as_users_meet_them(config, rows), "end_to_end": _training_steps(config, rows)}


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

    def __init__(self, model: _BagModel | _EmbeddingHeavy, lr: float) -> None:
        self.parts = [
            torch.optim.SparseAdam(model.bag.parameters(), lr=lr),
            torch.optim.AdamW(model.out.parameters(), lr=lr, weight_decay=0.0, fused=True),
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
        "AdamW (fused, dense)": (
            False,
            lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0, fused=True),
        ),
        "LazyAdamW": (False, lambda m, lr: LazyAdamW(m, lr=lr, weight_decay=0.0, fused=True)),
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
    step_rows = [
        [
            name,
            format_seconds(step.per_call(name)),
            step.ratio(FUSED, name).shown(),
            step.ratio(name, SPARSE_ADAM).shown(),
        ]
        for name in step.seconds
    ]
    training_rows = [
        [name, format_seconds(end_to_end.per_call(name)), end_to_end.ratio(FUSED, name).shown()]
        for name in end_to_end.seconds
    ]
    bandwidth = _copy_bandwidth(config)
    touched, bound = _bandwidth_estimate(timed["rows"], bandwidth)
    over_bound = step.per_call(LAZY_SPARSE) / bound
    sparse_speedup, dense_speedup = step.ratio(FUSED, LAZY_SPARSE), step.ratio(FUSED, LAZY)
    sparse_whole, dense_whole = end_to_end.ratio(FUSED, LAZY_SPARSE), end_to_end.ratio(FUSED, LAZY)
    sparse_twin = step.ratio(LAZY_SPARSE, SPARSE_ADAM)
    over_kernels, kernels_speedup = step.ratio(LAZY_SPARSE, KERNELS), step.ratio(FUSED, KERNELS)
    shape = f"Embedding({timed['rows']:,}, {EMBEDDING_WIDTH}), {TOKENS} tokens"
    dense_backward = (
        "a dense embedding's backward writes a zero-filled gradient of the whole table at every step, which "
        "costs more than the lazy step itself: sparse=True is the recommended path"
    )
    targets = [
        Target.at_least(
            "LazyAdamW (sparse=True) step as users meet it vs dense fused AdamW",
            sparse_speedup.median,
            15.0,
            "× faster",
            f"{shape}; each step after its own forward and backward; pairs {sparse_speedup.low:.1f}–"
            f"{sparse_speedup.high:.1f}×; its torch calls alone reach {kernels_speedup.median:.1f}× (the row "
            "gathers and write-backs cost a memory latency per row, against fused AdamW's stream)",
        ).full_size_only(config),
        Target.at_most(
            "LazyAdamW (sparse=True) step vs its torch calls alone",
            over_kernels.median,
            1.15,
            "× their time",
            f"coalesce, three row gathers, the fused AdamW kernel, three row writes, called directly; pairs "
            f"{over_kernels.low:.3f}–{over_kernels.high:.3f}",
        ).full_size_only(config),
        Target.at_least(
            "LazyAdamW (dense gradients) step as users meet it vs dense fused AdamW",
            dense_speedup.median,
            15.0,
            "× faster",
            f"{shape}; pairs {dense_speedup.low:.1f}–{dense_speedup.high:.1f}×; its rows' gradient is gathered "
            "from the table-sized gradient the backward just wrote",
        ).full_size_only(config),
        Target.at_least(
            "Whole training step of an embedding-heavy model: LazyAdamW (sparse=True) vs fused AdamW (dense)",
            sparse_whole.median,
            3.0,
            "× faster",
            f"EmbeddingBag({timed['rows']:,}, {EMBEDDING_WIDTH}) and a 9k-parameter head, 64 bags of 12 tokens; "
            f"pairs {sparse_whole.low:.1f}–{sparse_whole.high:.1f}×",
        ).full_size_only(config),
        Target.at_least(
            "Whole training step of an embedding-heavy model: LazyAdamW (dense gradients) vs fused AdamW (dense)",
            dense_whole.median,
            3.0,
            "× faster",
            f"pairs {dense_whole.low:.1f}–{dense_whole.high:.1f}×; {dense_backward}",
        ).full_size_only(config),
        Target.at_most(
            "LazyAdamW (sparse=True) step vs the memory-bandwidth estimate of its touched rows",
            over_bound,
            3.0,
            "× the estimate",
            f"about {touched:.0f} rows touched; 7 row passes (weight, gradient and both moments read, weight and "
            f"moments written) at the {bandwidth / 1e9:.1f} GB/s of a 64 MiB copy: {format_seconds(bound)}, "
            f"against a measured step of {format_seconds(step.per_call(LAZY_SPARSE))}; the rows are scattered over "
            "tables larger than the cache, so each row costs a memory latency, not a share of a stream",
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
            f"Optimizer step as users meet it on {shape} a step",
            ["optimizer", "step", "speed-up vs fused AdamW", "step / SparseAdam's"],
            step_rows,
            "Each step timed after its own zero_grad, forward and backward (untimed), so LazyAdamW reads "
            "captures made for that step and every optimizer meets its gradient as backward left it: a sparse "
            "one uncoalesced, a dense one the size of the table. LazyAdamW (sparse=True) coalesces the sparse "
            "gradient and updates its rows with the fused AdamW kernel. Interleaved rounds, medians of ratios.",
        ),
        Table(
            f"Whole training step of an embedding-heavy model (EmbeddingBag({timed['rows']:,}, {EMBEDDING_WIDTH}) "
            "summing 64 bags of 12 tokens, then Linear-ReLU-Linear to 10 classes)",
            ["optimizer", "training step", "speed-up vs fused AdamW"],
            training_rows,
            f"zero_grad, forward, cross-entropy, backward, step; {dense_backward}, as SparseAdam (which needs "
            "a second optimizer for the head) also shows.",
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
        "training_step_speedup_vs_fused": {n: end_to_end.ratio(FUSED, n).__dict__ for n in end_to_end.seconds},
        "bandwidth": {"copy_bytes_per_second": bandwidth, "rows_touched": touched, "estimate_seconds": bound},
        "quality": quality,
    }
    return Result(tables=tables, targets=targets, plots=[plot], data=data)


SECTION = Section(
    name="lazy_adamw",
    title="LazyAdamW vs dense fused AdamW and SparseAdam",
    summary=(
        "An `nn.Embedding(50_000, 128)` receiving 768 tokens a step: the optimizer step as a training loop "
        "meets it (after its own forward and backward) of dense fused `AdamW` (every row), `LazyAdamW` "
        "(the touched rows) on dense gradients and on a `sparse=True` twin (the recommended path), and "
        "`torch.optim.SparseAdam` on the twin, interleaved; the whole training step of an embedding-heavy "
        "model with each. Then quality on a large-vocabulary bag-of-words task with a planted logistic model."
    ),
    run=run,
    estimate=(1, 40),
)
