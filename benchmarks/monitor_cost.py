"""What ``Monitor`` and ``NonFiniteFinder`` cost a training step, as a ratio to stock AdamW's step.

``python -m benchmarks.monitor_cost [--model mlp|transformer|gpt] [--rounds 7] [--steps 5]`` builds
one copy of the model per configuration (same initial weights, same batch), then runs interleaved
rounds: ``steps`` steps of stock AdamW, ``steps`` of the configuration, ``steps`` of stock AdamW
again; a round's ratio is the configuration's time over the mean of the two stock runs around it,
and the median over rounds is printed, with the fastest run of the configuration over the
fastest stock run. Times are the process's CPU time (``--clock wall`` for
wall-clock time), which a machine others load at the same time disturbs much less.
Models: a 6-layer ReLU MLP of width 1024 (batch 64), a 4-layer transformer encoder (d=256,
4 heads, 1024 hidden, batch 16 x 64 tokens), or the realistic-size byte-level GPT of
``benchmarks/gpt.py`` (10.9M parameters, batch 8 x 128 tokens).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inputaware_optim import InputAwareAdamW, Monitor, NonFiniteFinder

CONFIGURATIONS: dict[str, Callable[[nn.Module], tuple[torch.optim.Optimizer, list[Any]]]] = {
    "AdamW + Monitor(every=1)": lambda m: _with(torch.optim.AdamW(m.parameters(), lr=1e-4), Monitor, m),
    "AdamW + NonFiniteFinder": lambda m: _with(torch.optim.AdamW(m.parameters(), lr=1e-4), NonFiniteFinder, m),
    "InputAwareAdamW + Monitor(every=1)": lambda m: _with(InputAwareAdamW(m, lr=1e-4), Monitor),
    "InputAwareAdamW + NonFiniteFinder": lambda m: _with(InputAwareAdamW(m, lr=1e-4), NonFiniteFinder),
}


def _with(optimizer: torch.optim.Optimizer, tool: Any, *model: nn.Module) -> tuple[torch.optim.Optimizer, list[Any]]:
    return optimizer, [tool(optimizer, *model)]


class _Encoder(nn.Module):
    def __init__(self, vocabulary: int = 512, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def workload(name: str, batch: int | None = None) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    """The model and a function computing its loss on a fixed batch (``batch`` rows or sequences)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers, nn.Linear(1024, 10))
        rows = batch or 64
        x, y = torch.randn(rows, 1024, generator=generator), torch.randint(0, 10, (rows,), generator=generator)
        return model, lambda m: F.cross_entropy(m(x), y)
    if name == "gpt":
        from . import gpt

        size = gpt.SIZES["default"]
        model = gpt.build(size)
        window = next(gpt.batches(size, 0))
        return model, lambda m: gpt.loss(m, window)
    model = _Encoder()
    tokens = torch.randint(0, 512, (batch or 16, 65), generator=generator)
    return model, lambda m: F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


CLOCK = {"process": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[[nn.Module], Tensor], steps: int) -> float:
    start = _clock()
    for _ in range(steps):
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()
    return _clock() - start


def measure(
    name: str, rounds: int, steps: int, only: list[str] | None = None, batch: int | None = None
) -> dict[str, list[float]]:
    """Each configuration's step-time ratios to stock AdamW, one per interleaved round."""
    base, loss = workload(name, batch)
    stock_model = copy.deepcopy(base)
    stock = torch.optim.AdamW(stock_model.parameters(), lr=1e-4)
    setups = {}
    for label, make in CONFIGURATIONS.items():
        if only and not any(word in label for word in only):
            continue
        model = copy.deepcopy(base)
        optimizer, tools = make(model)
        setups[label] = (model, optimizer, tools)
        _run(model, optimizer, loss, 2)
    _run(stock_model, stock, loss, 2)
    ratios: dict[str, list[float]] = {label: [] for label in setups}
    fastest: dict[str, float] = {label: math.inf for label in ["stock", *setups]}
    for _ in range(rounds):
        for label, (model, optimizer, _) in setups.items():
            before = _run(stock_model, stock, loss, steps)
            mine = _run(model, optimizer, loss, steps)
            after = _run(stock_model, stock, loss, steps)
            ratios[label].append(2 * mine / (before + after))
            fastest[label] = min(fastest[label], mine)
            fastest["stock"] = min(fastest["stock"], before, after)
    # The fastest run of each, over the fastest stock run: what the machine's load adds least to.
    for label in setups:
        ratios[label].insert(0, fastest[label] / fastest["stock"])
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_cost", description=__doc__)
    parser.add_argument("--model", choices=("mlp", "transformer", "gpt"), default="mlp")
    parser.add_argument("--batch", type=int, help="rows (MLP, default 64) or sequences (transformer, default 16)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier under load)")
    parser.add_argument("--only", nargs="*", help="configurations whose label contains one of these words")
    parser.add_argument("--clock", choices=tuple(CLOCK), default="process", help="CPU time (default) or wall time")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    base, loss = workload(args.model, args.batch)
    stock = torch.optim.AdamW(base.parameters(), lr=1e-4)
    _run(base, stock, loss, 1)
    step = _run(base, stock, loss, args.steps) / args.steps
    clock = f"{args.clock} time"
    print(f"{args.model}: stock AdamW step {step * 1e3:.1f} ms ({clock}); median ratio over {args.rounds} rounds")
    print(f"  {'configuration':36s} median  fastest/fastest  (each round)")
    for label, (fastest, *values) in measure(args.model, args.rounds, args.steps, args.only, args.batch).items():
        spread = " ".join(f"{v:.3f}" for v in values)
        print(f"  {label:36s} {statistics.median(values):.3f}x  {fastest:.3f}x  ({spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
