"""Section: what a step costs as the work per step grows (gradient accumulation), beside the cost model.

The GPT section times one micro-batch of 8 × 128 tokens per optimizer step, the setting that makes a
preconditioner look its most expensive: its products cost about ``in_features / (3 · tokens per step)`` of a
layer's forward and backward, so they fall as the tokens grow, while the statistics, the tools' per-call
work and DP's per-sample work grow with them. Here every configuration trains the GPT at 1, 4, 8 and 16
micro-batches per optimizer step, at two widths, in rounds of ``PERIOD`` optimizer steps that each hold one
statistics step, timed against AdamW on the same micro-batches (three interleaved pairs of rounds, medians).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import CoverageWarning, DPAdamW, InputAwareAdamW, Monitor, NonFiniteFinder

from .. import gpt, rules
from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..timing import interleave

PERIOD = 5  # optimizer steps per round: one of them collects statistics (and refreshes the inverses)
LR = rules.TIMING_LR
ADAMW = "AdamW"
# What each configuration is held to at 8 micro-batches (averaged over the round's steps).
LIMITS = {
    "FOOF → AdamW": 1.05,
    "K-FAC → AdamW": 1.07,
    "Eva → AdamW": 1.03,
    "Monitor(every=1)": 1.03,
    "NonFiniteFinder": 1.01,
    "DPAdamW (σ = 1, C = 1)": 1.40,
}
TARGET_MICRO_BATCHES = 8
DESCRIPTIONS = {  # what each configuration is, as the plot's caption says it
    "InputAwareAdamW, no rule": "the drop-in, nothing reading the capture",
    "Monitor(every=1)": "the drop-in with a Monitor recording every step",
    "NonFiniteFinder": "the drop-in with the non-finite finder attached",
    "Eva → AdamW": f"Eva's preconditioned gradient handed to AdamW, statistics every {PERIOD} steps",
    "FOOF → AdamW": f"FOOF's, statistics and inverses every {PERIOD} steps (Cholesky in float32)",
    "K-FAC → AdamW": f"K-FAC's, statistics and inverses every {PERIOD} steps (Cholesky in float32)",
    "DPAdamW (σ = 1, C = 1)": "DP-AdamW, noise multiplier 1, clip 1, per-sample clipping at every step",
}


def _configurations(samples_per_step: int) -> dict[str, Callable[[nn.Module], tuple[Any, Any]]]:
    """Every configuration, AdamW first: ``build(model) -> (optimizer, what must stay alive beside it)``."""

    def tool(make: Callable[[Any], Any]) -> Callable[[nn.Module], tuple[Any, Any]]:
        def build(model: nn.Module) -> tuple[Any, Any]:
            optimizer = InputAwareAdamW(model, lr=LR)
            return optimizer, make(optimizer)

        return build

    return {
        ADAMW: lambda m: (torch.optim.AdamW(m.parameters(), lr=LR), None),
        "InputAwareAdamW, no rule": lambda m: (InputAwareAdamW(m, lr=LR), None),
        "Monitor(every=1)": tool(lambda o: Monitor(o, every=1, callback=lambda record: None)),
        "NonFiniteFinder": tool(NonFiniteFinder),
        "Eva → AdamW": lambda m: (rules.eva(PERIOD, base=torch.optim.AdamW)(m, LR), None),
        "FOOF → AdamW": lambda m: (rules.foof(PERIOD, 1, adamw=True)(m, LR), None),
        "K-FAC → AdamW": lambda m: (rules.kfac(PERIOD, 1, base=torch.optim.AdamW)(m, LR), None),
        "DPAdamW (σ = 1, C = 1)": lambda m: (DPAdamW(m, lr=LR, expected_batch_size=samples_per_step), None),
    }


def _step(model: nn.Module, optimizer: Any, batches: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
    """One optimizer step over ``batches`` (gradient accumulation: each micro-batch's loss divided by their number)."""

    def step() -> None:
        optimizer.zero_grad()
        for batch in batches:
            (gpt.loss(model, batch) / len(batches)).backward()
        optimizer.step()

    return step


def model_ratio(size: gpt.GPTSize, tokens: int) -> float:
    """The cost model of a Kronecker rule's products over a step: per layer of ``in`` inputs, the products cost
    about ``in / (3 · tokens)`` of the layer's forward and backward (``in² · out`` multiply-adds against
    ``3 · tokens · in · out``), amortized here over the GPT's matrices (width ``w``: three of ``w`` inputs and
    one of ``4w`` per block; the statistics themselves cost ``in² · tokens``, about ``in / (3 · out)``)."""
    width = size.width
    layers = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]  # (in, out) per block
    work = sum(3 * tokens * i * o for i, o in layers)
    products = sum(i * i * o for i, o in layers)
    return 1 + products / work


def _sizes(config: Config) -> list[gpt.GPTSize]:
    base = gpt.size_of(config)
    narrow = dataclasses.replace(base, width=max(32, base.width // 2))
    return [base, narrow]


def run(config: Config, progress: Progress) -> Result:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageWarning)  # (the embeddings: AdamW's own update, as the GPT's)
        return _run(config, progress)


def _run(config: Config, progress: Progress) -> Result:
    counts = config.pick((1, 2), (1, 4, 8, 16))
    config = dataclasses.replace(config, pairs=config.pick(config.pairs, 3), sample_seconds=0.0)
    sizes = _sizes(config)
    progress.start(len(sizes) * len(counts))
    ratios: dict[str, dict[str, dict[int, float]]] = {}
    seconds: dict[str, dict[int, float]] = {}
    for size in sizes:
        label = f"width {size.width}"
        ratios[label], seconds[label] = {}, {}
        torch.manual_seed(config.seed)
        base = gpt.build(size)
        stream = gpt.batches(size, config.seed)
        for count in counts:
            progress.describe(f"{label}, {count} micro-batches")
            batches = [next(stream) for _ in range(count)]
            table = _configurations(count * size.batch)
            models = {name: copy.deepcopy(base) for name in table}
            built = {name: table[name](models[name]) for name in table}
            steps = {name: _step(models[name], built[name][0], batches) for name in table}
            timing = interleave(steps, config, multiple_of=dict.fromkeys(table, PERIOD))
            for name in table:
                ratios[label].setdefault(name, {})[count] = timing.ratio(name, ADAMW).median
            seconds[label][count] = statistics.median(timing.seconds[ADAMW])  # (per call: one optimizer step)
            del built, steps, models
            progress.advance()
    tokens_per_micro = sizes[0].batch * sizes[0].context
    return Result(
        tables=[
            _table(label, ratios[label], seconds[label], counts, size, tokens_per_micro)
            for label, size in zip(ratios, sizes, strict=True)
        ],
        targets=_targets(ratios[f"width {sizes[0].width}"], config),
        plots=[_plot(ratios, sizes, counts, tokens_per_micro)],
        data={"ratios_vs_adamw": ratios, "adamw_step_seconds": seconds, "micro_batches": list(counts)},
    )


def _table(
    label: str,
    ratios: dict[str, dict[int, float]],
    seconds: dict[int, float],
    counts: tuple[int, ...],
    size: gpt.GPTSize,
    tokens_per_micro: int,
) -> Table:
    columns = ["configuration", *(f"{c} × {tokens_per_micro:,} tokens" for c in counts)]
    rows = [["AdamW's step", *(format_seconds(seconds[c]) for c in counts)]]
    rows += [[name, *(f"{by_count[c]:.3f}×" for c in counts)] for name, by_count in ratios.items() if name != ADAMW]
    rows.append(
        [
            "cost model: a Kronecker rule's products",
            *(f"{model_ratio(size, c * tokens_per_micro):.3f}×" for c in counts),
        ]
    )
    return Table(
        f"Step time vs AdamW as the tokens per step grow, GPT {label} ({size.layers} blocks)",
        columns,
        rows,
        f"Gradient accumulation over 1 to {counts[-1]} micro-batches of {size.batch} × {size.context} tokens per "
        f"optimizer step; each sample {PERIOD} optimizer steps, one of which collects statistics (and refreshes "
        "the Kronecker rules' inverses); medians of interleaved rounds against AdamW on the same micro-batches. "
        "The cost model counts only the preconditioning products (the statistics grow with the tokens, as DP's "
        "per-sample work and the tools' per-call work do).",
    )


def _targets(ratios: dict[str, dict[int, float]], config: Config) -> list[Target]:
    return [
        Target.at_most(
            f"{name} step vs AdamW at {TARGET_MICRO_BATCHES} micro-batches per step (averaged over steps)",
            ratios[name].get(TARGET_MICRO_BATCHES),
            limit,
            "×",
        ).full_size_only(config)
        for name, limit in LIMITS.items()
    ]


def _plot(
    ratios: dict[str, dict[str, dict[int, float]]], sizes: list[gpt.GPTSize], counts: tuple[int, ...], tokens: int
) -> Plot:
    panels = []
    for (label, by_name), size in zip(ratios.items(), sizes, strict=True):
        x = [float(c * tokens) for c in counts]
        series = [Series(name, x, [by_count[c] for c in counts]) for name, by_count in by_name.items() if name != ADAMW]
        series.append(Series("cost model (products only)", x, [model_ratio(size, int(t)) for t in x], style="--"))
        panels.append(Panel(f"GPT, {label}", "tokens per optimizer step", "step time / AdamW's", series, logx=True))
    return Plot(
        "ratio-vs-tokens",
        "Step time against AdamW's as the tokens per optimizer step grow",
        panels,
        caption="Measured: each configuration's step time over AdamW's (torch.optim.AdamW) on the same micro-batches "
        f"(medians of interleaved rounds of {PERIOD} steps holding one statistics step), against the tokens per "
        "optimizer step (gradient accumulation). "
        + "; ".join(f"{name}: {what}" for name, what in DESCRIPTIONS.items())
        + ". Dashed, cost model (products only): a Kronecker rule's preconditioning products alone, over the "
        "layers' forward and backward.",
    )


SECTION = Section(
    name="tokens",
    title="What a step costs as the work per step grows",
    summary=__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
    run=run,
    estimate=(8.0, 3600.0),
)
