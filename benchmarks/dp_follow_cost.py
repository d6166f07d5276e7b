"""What DP's batch check by the computation costs a DP-SGD step, as a ratio to the same step checked by sizes alone.

``python -m benchmarks.dp_follow_cost [--rounds 9] [--steps 5]`` trains two copies of a small GPT
(``benchmarks.models.GPT``: token and position embeddings, pre-norm blocks, a head; same weights, same
batch) with ``DPSGD``: one follows the samples through each forward (``Capture.follow_samples``, what
``DPSGD`` does), the other has the following turned off (``capture.follow_samples(None)``: the check by
sizes alone, the step as it was before). Interleaved rounds run ``steps`` steps of the step without
following, ``steps`` with it, ``steps`` without again; a round's ratio is the following step's time over
the mean of the two around it, and the median over rounds is printed, with the fastest run over the
fastest. Times are the process's CPU time (``--clock wall`` for wall-clock time).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inputaware_optim import DPSGD

from .models import GPT

# name -> (layers, width, heads, context, batch), vocabulary 256
SIZES = {
    "tiny": (2, 64, 2, 32, 4),
    "small": (4, 128, 2, 64, 8),
    "medium": (4, 192, 3, 128, 8),
}
CLOCK = {"process": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def workload(size: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model and a function computing its loss on a fixed batch."""
    layers, width, heads, context, batch = SIZES[size]
    torch.manual_seed(0)
    model = GPT(256, context, width, layers, heads)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, context + 1), generator=generator)
    return model, lambda m: F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _run(model: nn.Module, optimizer: DPSGD, loss: Callable[[nn.Module], torch.Tensor], steps: int) -> float:
    start = _clock()
    for _ in range(steps):
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()
    return _clock() - start


def measure(size: str, rounds: int, steps: int) -> tuple[list[float], float, float]:
    """The following step's time ratios, one per interleaved round (the fastest over the fastest first), and
    the median step times without and with it."""
    base, loss = workload(size)
    runs = {}
    for follows in (False, True):
        model = copy.deepcopy(base)
        optimizer = DPSGD(model, lr=1e-3, max_grad_norm=1.0, noise_multiplier=1.0)
        if not follows:
            optimizer.capture.follow_samples(None)
        runs[follows] = (model, optimizer)
        _run(model, optimizer, loss, 2)
    ratios, fastest = [], {False: math.inf, True: math.inf}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        before = _run(*runs[False], loss, steps)
        mine = _run(*runs[True], loss, steps)
        after = _run(*runs[False], loss, steps)
        ratios.append(2 * mine / (before + after))
        fastest[True], fastest[False] = min(fastest[True], mine), min(fastest[False], before, after)
        times[True].append(mine / steps)
        times[False] += [before / steps, after / steps]
    # The fastest run of each, over the other's fastest: what the machine's load adds least to.
    ratios.insert(0, fastest[True] / fastest[False])
    return ratios, statistics.median(times[False]), statistics.median(times[True])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dp_follow_cost", description=__doc__)
    parser.add_argument("--sizes", nargs="*", choices=tuple(SIZES), default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier under load)")
    parser.add_argument("--clock", choices=tuple(CLOCK), default="process", help="CPU time (default) or wall time")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    print(f"DPSGD step following the samples / the same step checked by sizes alone ({args.clock} time)")
    for size in args.sizes:
        (fastest, *values), without, with_ = measure(size, args.rounds, args.steps)
        layers, width, heads, context, batch = SIZES[size]
        spread = " ".join(f"{v:.3f}" for v in values)
        print(
            f"  {size} GPT ({layers} blocks, width {width}, {heads} heads, context {context}, batch {batch}): "
            f"{without * 1e3:.1f} ms -> {with_ * 1e3:.1f} ms, median {statistics.median(values):.3f}x, "
            f"fastest/fastest {fastest:.3f}x ({spread})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
