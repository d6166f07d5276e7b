"""Section 3: the memory each rule holds between forward and step, against stock AdamW, and RSS over steps."""

from __future__ import annotations

import copy
import gc
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, CoverageWarning, InputAwareAdamW, LazyAdamW

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target
from ..machine import allocated_bytes, has_allocation_probe, resident_bytes
from ..models import GPT

KIB, MIB = 1024, 1024 * 1024
MICRO_BATCHES = (1, 4, 16)
SLACK = 64 * KIB  # allocator rounding and the capture's own bookkeeping, whatever the model
TOLERANCE = 0.05  # of the statistics' size
STOCK = "stock AdamW"
LR = 1e-3


@dataclass(frozen=True)
class _Rule:
    """An input-aware optimizer measured against stock AdamW: ``build(model, samples_per_step)``."""

    name: str
    build: Callable[[nn.Module, int], torch.optim.Optimizer]


RULES = (
    _Rule("InputAwareAdamW (no rule)", lambda model, samples: InputAwareAdamW(model, lr=LR)),
    _Rule("FOOF", lambda model, samples: FOOF(model, lr=LR)),
    _Rule("K-FAC", lambda model, samples: KFAC(model, lr=LR)),
    _Rule("NLMS", lambda model, samples: NLMS(model, lr=LR)),
    _Rule("LazyAdamW", lambda model, samples: LazyAdamW(model, lr=LR)),
    _Rule(
        "DPSGD (noise 0)",
        lambda model, samples: DPSGD(model, lr=LR, noise_multiplier=0.0, expected_batch_size=samples),
    ),
)


class TokenMLP(nn.Module):
    """Tokens → ``Embedding`` → ``blocks`` × (``Linear`` + ``ReLU``) on every position → mean → ``Linear`` head.

    Every rule has a layer here: the ``Linear`` layers for FOOF, K-FAC and NLMS, the ``Embedding``
    for LazyAdamW, both for DPSGD. With ``checkpointed``, the blocks run as one non-reentrant
    activation-checkpointed region.
    """

    def __init__(self, vocabulary: int, width: int, blocks: int, classes: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h = checkpoint(self.blocks, h, use_reentrant=False) if self.checkpointed else self.blocks(h)
        return self.head(h.mean(1))


Batch = tuple[Tensor, Tensor]


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batches(count: int, batch: int, length: int, vocabulary: int, classes: int, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocabulary, (batch, length), generator=generator),
            torch.randint(0, classes, (batch,), generator=generator),
        )
        for _ in range(count)
    ]


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def statistics_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the distinct tensor storages the optimizer's reductions hold now (0 for a stock optimizer)."""
    capture = getattr(optimizer, "capture", None)
    if capture is None:
        return 0
    storages: dict[int, int] = {}
    for reduction in capture.reductions:
        for tensor in _tensors(list(capture.reduced(reduction).values())):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _accumulated_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch]) -> tuple[int, int]:
    """One step over ``batches`` as micro-batches: heap bytes held since ``zero_grad`` once every
    backward has run (just before step), and the size of the statistics held then."""
    optimizer.zero_grad()
    start = allocated_bytes()
    for batch in batches:
        loss = _loss(model, batch)
        loss.backward()
        del loss
    held = allocated_bytes() - start
    kept = statistics_bytes(optimizer)
    optimizer.step()
    return held, kept


def _checkpointed_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> tuple[int, int]:
    """One step: heap bytes held since ``zero_grad`` just after forward, and the statistics' size before step."""
    optimizer.zero_grad()
    start = allocated_bytes()
    loss = _loss(model, batch)
    held = allocated_bytes() - start
    loss.backward()
    del loss
    kept = statistics_bytes(optimizer)
    optimizer.step()
    return held, kept


Measure = Callable[[nn.Module, torch.optim.Optimizer], tuple[int, int]]


def _against_stock(rule: _Rule, base: nn.Module, samples: int, measure: Measure, pairs: int) -> dict[str, Any]:
    """``measure`` on a copy of ``base`` under stock AdamW and another under ``rule``, in turn, after
    two warm-up steps each (so optimizer state and first-call caches exist before anything is measured)."""
    models = {STOCK: copy.deepcopy(base), rule.name: copy.deepcopy(base)}
    optimizers = {
        STOCK: torch.optim.AdamW(models[STOCK].parameters(), lr=LR),
        rule.name: rule.build(models[rule.name], samples),
    }
    for name in (STOCK, rule.name):
        for _ in range(2):
            measure(models[name], optimizers[name])
    samples_of: dict[str, list[tuple[int, int]]] = {STOCK: [], rule.name: []}
    # No collection mid-step: freeing unrelated garbage there would show up as a difference.
    gc.collect()
    gc.disable()
    try:
        for _ in range(pairs):
            for name in (STOCK, rule.name):
                samples_of[name].append(measure(models[name], optimizers[name]))
    finally:
        gc.enable()
    ours, stock = samples_of[rule.name], samples_of[STOCK]
    return {
        "stock_bytes": statistics.median(s[0] for s in stock),
        "extra_bytes": statistics.median(o[0] - s[0] for o, s in zip(ours, stock, strict=True)),
        "statistics_bytes": statistics.median(o[1] for o in ours),
        "pairs": {"stock": stock, "rule": ours},
    }


def _accumulation(config: Config, progress: Progress) -> dict[str, Any]:
    vocabulary, width, blocks, classes = config.pick(256, 4096), config.pick(32, 256), config.pick(4, 8), 10
    batch, length = config.pick(2, 4), config.pick(8, 32)
    pairs = config.pick(3, 5)
    torch.manual_seed(config.seed)
    base = TokenMLP(vocabulary, width, blocks, classes)
    batches = _batches(max(MICRO_BATCHES), batch, length, vocabulary, classes, config.seed)
    out: dict[str, Any] = {
        "model": f"Embedding({vocabulary}, {width}), {blocks} × Linear({width}) + ReLU, mean, "
        f"Linear({width}, {classes}); micro-batches of {batch} sequences of {length} tokens",
        "rules": {},
    }

    def measure_with(micro: list[Batch]) -> Measure:
        return lambda model, optimizer: _accumulated_step(model, optimizer, micro)

    for rule in RULES:
        by_count = {}
        for count in MICRO_BATCHES:
            progress.describe(f"{rule.name}, {count} micro-batches")
            by_count[count] = _against_stock(rule, base, count * batch, measure_with(batches[:count]), pairs)
            progress.advance()
        out["rules"][rule.name] = by_count
    return out


def _checkpointing(config: Config, progress: Progress) -> dict[str, Any]:
    """After forward with the blocks checkpointed, at two batch sizes: what a rule keeps of the region's
    activations grows with the batch, its statistics do not."""
    vocabulary, width, blocks, classes = config.pick(256, 4096), config.pick(32, 256), config.pick(4, 8), 10
    small, length = config.pick(2, 8), config.pick(16, 64)
    sizes = (small, 2 * small)
    pairs = config.pick(3, 5)
    torch.manual_seed(config.seed)
    base = TokenMLP(vocabulary, width, blocks, classes, checkpointed=True)
    data = {batch: _batches(1, batch, length, vocabulary, classes, config.seed)[0] for batch in sizes}

    def measure_at(batch: int) -> Measure:
        return lambda model, optimizer: _checkpointed_step(model, optimizer, data[batch])

    plain = copy.deepcopy(base)
    plain.checkpointed = False
    progress.describe("stock AdamW without checkpointing")
    unchecked = _against_stock(RULES[0], plain, sizes[-1], measure_at(sizes[-1]), pairs)
    out: dict[str, Any] = {
        "model": f"Embedding({vocabulary}, {width}), one checkpointed region of {blocks} × Linear({width}) + ReLU "
        f"(use_reentrant=False), mean, Linear({width}, {classes}); batches of {small} and {2 * small} × {length} "
        "tokens",
        "batches": list(sizes),
        "stock_without_checkpointing_bytes": unchecked["stock_bytes"],
        "rules": {},
    }
    for rule in RULES:
        progress.describe(f"{rule.name}, checkpointed")
        out["rules"][rule.name] = {
            batch: _against_stock(rule, base, batch, measure_at(batch), pairs) for batch in sizes
        }
        progress.advance()
    return out


def _resident_over_steps(config: Config, steps: int) -> dict[str, Any]:
    """Resident set and heap bytes every few steps of a small GPT, for stock AdamW and two input-aware optimizers."""
    torch.manual_seed(config.seed)
    base = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    generator = torch.Generator().manual_seed(config.seed)
    tokens = torch.randint(0, 256, (4, 17), generator=generator)
    builds: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
        STOCK: lambda model: torch.optim.AdamW(model.parameters(), lr=1e-4),
        "InputAwareAdamW": lambda model: InputAwareAdamW(model, lr=1e-4),
        "FOOF": lambda model: FOOF(model, lr=1e-3),
    }
    every = max(1, steps // 100)
    out: dict[str, Any] = {"every": every, "steps": steps, "variants": {}}
    for name, build in builds.items():
        model = copy.deepcopy(base)
        optimizer = build(model)
        resident, heap = [], []
        for step in range(steps):
            # A fresh batch tensor each step, as a data loader makes: a leak would keep them.
            batch = tokens.clone()
            optimizer.zero_grad()
            logits = model(batch[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            optimizer.step()
            if step % every == 0 or step == steps - 1:
                resident.append(resident_bytes())
                heap.append(allocated_bytes())
        out["variants"][name] = {"resident_bytes": resident, "heap_bytes": heap}
    return out


def _since_start(label: str, steps: list[int], values: list[int], unit: int) -> Series:
    return Series(label, list(steps), [(v - values[0]) / unit for v in values])


def _growth(values: list[int]) -> int:
    """Growth after warm-up: median of the last tenth minus median of the second tenth of samples."""
    tenth = max(1, len(values) // 10)
    return int(statistics.median(values[-tenth:]) - statistics.median(values[tenth : 2 * tenth]))


def _allowance(statistics_size: float) -> float:
    return TOLERANCE * statistics_size + SLACK


def _worst(excess: dict[str, float], limits: dict[str, float]) -> str:
    """The rule whose value is furthest beyond (or least within) its limit."""
    return max(excess, key=lambda name: excess[name] - limits[name])


def _targets(accumulation: dict[str, Any], checkpointed: dict[str, Any]) -> list[Target]:
    rules = accumulation["rules"]
    first, last = min(MICRO_BATCHES), max(MICRO_BATCHES)
    growth = {name: r[last]["extra_bytes"] - r[first]["extra_bytes"] for name, r in rules.items()}
    growth_limit = {name: _allowance(r[last]["statistics_bytes"]) for name, r in rules.items()}
    beyond = {
        name: max(abs(r[n]["extra_bytes"] - r[n]["statistics_bytes"]) for n in MICRO_BATCHES)
        for name, r in rules.items()
    }
    beyond_limit = {name: _allowance(max(r[n]["statistics_bytes"] for n in MICRO_BATCHES)) for name, r in rules.items()}
    small, large = checkpointed["batches"]
    checkpoint_rules = checkpointed["rules"]
    after_forward = {
        name: r[large]["extra_bytes"] - r[large]["statistics_bytes"] for name, r in checkpoint_rules.items()
    }
    forward_limit = {name: float(SLACK) for name in after_forward}
    batch_growth = {name: r[large]["extra_bytes"] - r[small]["extra_bytes"] for name, r in checkpoint_rules.items()}
    batch_limit = {name: _allowance(r[large]["statistics_bytes"]) for name, r in checkpoint_rules.items()}
    stock = checkpoint_rules[RULES[0].name][large]["stock_bytes"]

    def verdict(name: str, requirement: str, values: dict[str, float], limits: dict[str, float], what: str) -> Target:
        worst = _worst(values, limits)
        return Target(
            name,
            requirement,
            values[worst] / KIB,
            "KiB",
            all(values[n] <= limits[n] for n in values),
            f"worst: {worst}, limit {limits[worst] / KIB:.0f} KiB. "
            + "; ".join(f"{n} {values[n] / KIB:+.1f} KiB" for n in values)
            + f". {what}",
            limits[worst] / KIB,
        )

    return [
        verdict(
            f"Extra bytes before step, flat in micro-batches ({last} vs {first}), every rule",
            f"≤ {TOLERANCE:.0%} of the rule's statistics + {SLACK // KIB} KiB",
            growth,
            growth_limit,
            f"Extra bytes (vs stock AdamW) held before step with {last} micro-batches minus with {first}.",
        ),
        verdict(
            "Extra bytes before step = the statistics' size, every rule and micro-batch count",
            f"|extra − statistics| ≤ {TOLERANCE:.0%} of the statistics + {SLACK // KIB} KiB",
            beyond,
            beyond_limit,
            "Largest |extra − statistics' size| over " + ", ".join(map(str, MICRO_BATCHES)) + " micro-batches.",
        ),
        verdict(
            f"Checkpointed region: extra bytes after forward beyond the statistics' size (batch {large}), every rule",
            f"≤ {SLACK // KIB} KiB",
            after_forward,
            forward_limit,
            f"Stock AdamW keeps checkpointing's savings: {stock / MIB:.2f} MiB after forward with the region "
            f"checkpointed, {checkpointed['stock_without_checkpointing_bytes'] / MIB:.2f} MiB without.",
        ),
        verdict(
            f"Checkpointed region: extra bytes after forward flat in the batch ({large} vs {small}), every rule",
            f"≤ {TOLERANCE:.0%} of the rule's statistics + {SLACK // KIB} KiB",
            batch_growth,
            batch_limit,
            "Doubling the batch doubles the region's activations; a rule that keeps none of them holds the same "
            "extra bytes after forward.",
        ),
    ]


def run(config: Config, progress: Progress) -> Result:
    if not has_allocation_probe():
        return Result(notes=["Skipped: measuring heap bytes needs glibc's mallinfo2 (Linux, glibc >= 2.33)."])
    progress.start(len(RULES) * (len(MICRO_BATCHES) + 1) + 1)
    steps = config.pick(100, 1000, 1000)
    # What exists now (torch, the suite) is never garbage: the collections before each measurement
    # then only scan what the section itself creates.
    gc.freeze()
    try:
        with warnings.catch_warnings():
            # Which parameters a rule leaves to its stock update (the embedding, for FOOF): known, and
            # a warning's text must not be allocated inside a measured window.
            warnings.simplefilter("ignore", CoverageWarning)
            accumulation = _accumulation(config, progress)
            checkpointed = _checkpointing(config, progress)
            progress.describe(f"RSS over {steps} steps")
            resident = _resident_over_steps(config, steps)
    finally:
        gc.unfreeze()
    progress.advance()
    variants = resident["variants"]
    growth = {
        name: {kind: _growth(v[kind]) for kind in ("resident_bytes", "heap_bytes")} for name, v in variants.items()
    }
    resident["growth"] = growth

    first, last = min(MICRO_BATCHES), max(MICRO_BATCHES)
    accumulation_rows = []
    for name, by_count in accumulation["rules"].items():
        accumulation_rows.append(
            [
                name,
                f"{by_count[first]['stock_bytes'] / MIB:.2f}",
                *(f"{by_count[n]['extra_bytes'] / KIB:+.1f}" for n in MICRO_BATCHES),
                *(f"{by_count[n]['statistics_bytes'] / KIB:.1f}" for n in (first, last)),
                f"{(by_count[last]['extra_bytes'] - by_count[first]['extra_bytes']) / KIB:+.1f}",
            ]
        )
    small, large = checkpointed["batches"]
    checkpoint_rows = [
        [
            name,
            f"{r[large]['stock_bytes'] / MIB:.2f}",
            f"{r[small]['extra_bytes'] / KIB:+.1f}",
            f"{r[large]['extra_bytes'] / KIB:+.1f}",
            f"{r[large]['statistics_bytes'] / KIB:.1f}",
        ]
        for name, r in checkpointed["rules"].items()
    ]
    input_aware = [name for name in variants if name != STOCK]
    worst_rss = max(input_aware, key=lambda name: growth[name]["resident_bytes"])
    targets = _targets(accumulation, checkpointed)
    targets.append(
        Target.at_most(
            f"RSS growth over {steps} steps, input-aware optimizers",
            growth[worst_rss]["resident_bytes"] / MIB,
            1.0,
            "MiB",
            "worst: "
            + worst_rss
            + "; "
            + "; ".join(
                f"{name}: RSS {growth[name]['resident_bytes'] / MIB:+.2f} MiB, "
                f"heap {growth[name]['heap_bytes'] / KIB:+.1f} KiB"
                for name in variants
            ),
        )
    )
    tables = [
        Table(
            f"Before step, under gradient accumulation: heap bytes held beyond stock AdamW ({accumulation['model']})",
            [
                "optimizer",
                f"stock AdamW, {first} micro-batch (MiB)",
                *(f"extra, {n} micro-batch{'es' if n > 1 else ''} (KiB)" for n in MICRO_BATCHES),
                f"statistics, {first} (KiB)",
                f"statistics, {last} (KiB)",
                f"extra: {last} − {first} (KiB)",
            ],
            accumulation_rows,
            "Bytes from glibc's mallinfo2 (uordblks + hblkhd), counted from zero_grad to just before step (every "
            "backward done), medians over interleaved steps of a stock AdamW copy and the rule's copy of one model. "
            "Statistics: the bytes of the tensors the rule's reductions hold then (Capture.reduced); the stock "
            "column includes the gradients both sides allocate.",
        ),
        Table(
            f"After forward, activation checkpointing: heap bytes held beyond stock AdamW ({checkpointed['model']})",
            [
                "optimizer",
                f"stock AdamW after forward, batch {large} (MiB)",
                f"extra after forward, batch {small} (KiB)",
                f"extra after forward, batch {large} (KiB)",
                f"statistics before step, batch {large} (KiB)",
            ],
            checkpoint_rows,
            f"Without checkpointing, stock AdamW holds {checkpointed['stock_without_checkpointing_bytes'] / MIB:.2f} "
            f"MiB after forward at batch {large}: the difference is what checkpointing saves. A rule keeps it when "
            "its extra bytes after forward are no more than the statistics it keeps until step, and do not grow "
            "with the batch.",
        ),
    ]
    x: list[int] = [i * resident["every"] for i in range(len(variants[STOCK]["resident_bytes"]))]
    x[-1] = steps - 1
    plots = [
        Plot(
            "held",
            "Heap bytes each optimizer holds beyond stock AdamW, minus its statistics' size (0: it holds just them)",
            [
                Panel(
                    "before step, under gradient accumulation",
                    "micro-batches",
                    "KiB",
                    [
                        Series(
                            name,
                            list(MICRO_BATCHES),
                            [(r[n]["extra_bytes"] - r[n]["statistics_bytes"]) / KIB for n in MICRO_BATCHES],
                            "o-",
                        )
                        for name, r in accumulation["rules"].items()
                    ],
                    logx=True,
                ),
                Panel(
                    "after forward, hidden layers checkpointed",
                    "batch (sequences)",
                    "KiB",
                    [
                        Series(
                            name,
                            [float(b) for b in (small, large)],
                            [(r[b]["extra_bytes"] - r[b]["statistics_bytes"]) / KIB for b in (small, large)],
                            "o-",
                        )
                        for name, r in checkpointed["rules"].items()
                    ],
                ),
            ],
            caption=(
                "One line per input-aware optimizer at its defaults: InputAwareAdamW (no rule), FOOF, K-FAC, NLMS, "
                "LazyAdamW and DPSGD (noise 0) (no noise drawn). Every value is heap bytes (glibc's mallinfo2) "
                "beyond stock torch.optim.AdamW on the same model, minus the statistics the rule keeps until step: "
                "0 means it holds exactly its statistics. Lines that lie on top of each other near 0 are told apart "
                "by their markers, largest first."
            ),
        ),
        Plot(
            "rss",
            f"Memory across {steps} training steps of a small GPT",
            [
                Panel(
                    "resident set size, change since the first step",
                    "step",
                    "MiB",
                    [_since_start(name, x, v["resident_bytes"], MIB) for name, v in variants.items()],
                ),
                Panel(
                    "heap bytes allocated, change since the first step",
                    "step",
                    "KiB",
                    [_since_start(name, x, v["heap_bytes"], KIB) for name, v in variants.items()],
                ),
            ],
            caption=(
                f"{STOCK}: torch.optim.AdamW; InputAwareAdamW: the drop-in with no rule; FOOF: the FOOF rule. "
                "Resident set size from the process's statistics, heap bytes from glibc's mallinfo2, each as the "
                "change since the first sample."
            ),
        ),
    ]
    return Result(
        tables=tables,
        targets=targets,
        plots=plots,
        data={"accumulation": accumulation, "checkpointing": checkpointed, "resident": resident},
    )


SECTION = Section(
    name="memory",
    title="Memory held between forward and step",
    summary=(
        "What each optimizer holds beyond stock `torch.optim.AdamW`: `InputAwareAdamW` with no rule (which "
        "attaches no hook and keeps nothing), FOOF, K-FAC, NLMS, LazyAdamW and DPSGD (noise 0, "
        "`expected_batch_size` set). Each runs on a copy of one model, in turn with a stock AdamW copy, "
        "after two warm-up steps each (optimizer state excluded) and with the garbage collector off. "
        "The C heap's allocated bytes (glibc `mallinfo2`) are counted from `zero_grad`: **before step** "
        "(every backward done) under gradient accumulation with 1, 4 and 16 micro-batches, and **after "
        "forward** when the hidden layers run in one non-reentrant activation-checkpointed region, at two "
        "batch sizes. Beside each, the size of the statistics the rule's reductions hold before step "
        "(`Capture.reduced`). The extra bytes should be those statistics: flat in the number of "
        "micro-batches, and after a checkpointed forward within them and flat in the batch (so "
        "checkpointing keeps its savings). Then the resident set over many steps "
        "of a small GPT, stock AdamW, `InputAwareAdamW` and FOOF, which must stay flat."
    ),
    run=run,
    estimate=(3, 75),
)
