"""FOOF on the digits: an MLP trained with inputs-preconditioned SGD, beside plain SGD with the
same learning rate and momentum (the same start, the same batches).

    python examples/foof_digits.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _digits import accuracy, digits
from torch import nn

from inputaware_optim import FOOF


def train(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], steps: int) -> tuple[float, float]:
    """Train a fresh MLP (seed 0) on the same batches; return (test accuracy, seconds)."""
    x, y, x_test, y_test = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = make_optimizer(model)
    batches = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return accuracy(model, x_test, y_test), time.perf_counter() - start


def foof(model: nn.Module) -> FOOF:
    optimizer = FOOF(model, lr=0.05, momentum=0.9, damping=0.1, update_every=10)
    print(optimizer.coverage())  # which parameters FOOF preconditions
    return optimizer


def main(argv: list[str] | None = None) -> float:
    """Train with SGD and with FOOF, print both test accuracies and times, and return FOOF's."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args(argv).steps
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    results = {
        "SGD (momentum 0.9)": train(lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps),
        "FOOF": train(foof, steps),
    }
    for name, (final, seconds) in results.items():
        print(f"{name:>18}: test accuracy {final:.3f}, {seconds:.1f} s")
    return results["FOOF"][0]


if __name__ == "__main__":
    main()
